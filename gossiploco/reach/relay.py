"""Relays for peers behind NAT: a reachable node splices a stream from one member to another.

Why not libp2p's circuit relay v2: hivemind 1.1.12's p2pd reserves a relay slot only through
autorelay, which waits for 4 relay candidates or a boot delay (3 minutes by go-libp2p's default)
before reserving: in the NAT testbed, with one static relay, a daemon forced "private" had no circuit
address after 20 s and dialing it through the relay failed with ``NO_RESERVATION (204)``. The daemon
offers no hole punching either (``p2pd -h`` has no such option). This relay needs nothing of the daemon
but streams: a member behind NAT keeps a connection open to each of its relays (``keep_relays``;
it dials out, so that works through any NAT), and a relay opens streams to it over that connection.

Protocol ``RELAY_PROTOCOL``: the asking peer sends the target's libp2p peer id; the relay answers
``{"status": "ok", "data_bytes", "time_s"}`` (its ``Limits`` per relayed connection) and splices
the two streams until either ends or a limit is reached, or answers ``{"status": REASON}``. Every
relay and bootstrap node (``gossiploco dht``) and every reachable peer's DHT node serves it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgpack

from gossiploco.reach.streams import STATS, close, splice

RELAY_PROTOCOL = "/gossiploco/relay/1"
TUNNEL_PROTOCOL = "/gossiploco/tunnel/1"
"""The target's end of a relayed stream (``reach.tunnel.serve_tunnel``)."""
RELAY_OK = "ok"
MAX_RELAYED = 256
"""Relayed connections one relay carries at once."""
CONNECT_S = 10.0
"""How long opening one stream (to the relay, or from it to the target) may take."""
KEEP_RELAYS_S = 5.0
"""How often a node behind NAT checks that it is connected to each of its relays."""


@dataclass(frozen=True)
class Limits:
    """A relay's limits per relayed connection (p2pd's ``-relayDataLimit``/``-relayTimeLimit`` defaults)."""

    data_bytes: float = 4 << 30
    """Bytes per direction."""
    time_s: float = 30 * 60.0


def split_relay(relay: str) -> tuple[Any, Any]:
    """``(transport multiaddr, PeerID)`` of ``/ip4/HOST/tcp/PORT/p2p/ID``."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    base, _, pid = relay.rpartition("/p2p/")
    return Multiaddr(base), PeerID.from_base58(pid)


async def through(p2p: Any, relay: str, target: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Limits]:
    """A stream to ``target``'s tunnel handler, spliced by ``relay``, and the relay's limits. Raises
    ``ConnectionError`` (or the daemon's error) when the relay cannot or will not."""
    from hivemind.p2p import P2P

    address, relay_id = split_relay(relay)
    await p2p._client.connect(relay_id, [address])  # a no-op when connected; needed for a --relay node
    _, reader, writer = await p2p.call_binary_stream_handler(relay_id, RELAY_PROTOCOL)
    await P2P.send_raw_data(target.encode(), writer)
    answer = msgpack.unpackb((await P2P.receive_raw_data(reader))[:512], raw=False)
    if not isinstance(answer, dict) or answer.get("status") != RELAY_OK:
        close(writer)
        raise ConnectionError(f"the relay refused: {str(answer.get('status') if isinstance(answer, dict) else answer)[:200]}")
    data, age = answer.get("data_bytes"), answer.get("time_s")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (data, age)):
        close(writer)
        raise ConnectionError(f"the relay sent malformed limits: {answer!r:.200}")
    return reader, writer, Limits(float(data), float(age))


class RelayService:
    """The relay's handler: at most ``MAX_RELAYED`` connections at once, each within ``limits``."""

    def __init__(self, p2p: Any, limits: Limits):
        self.p2p, self.limits = p2p, limits
        self.active = 0

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from hivemind.p2p import P2P, PeerID

        try:
            target = (await asyncio.wait_for(P2P.receive_raw_data(reader), CONNECT_S))[:128].decode()
            if self.active >= MAX_RELAYED:
                raise ConnectionError("relay busy")
            _, r, w = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(target), TUNNEL_PROTOCOL), CONNECT_S)
        except Exception as exc:  # noqa: BLE001 - the asking peer is told why, and tries another relay
            STATS.refused += 1
            try:
                await P2P.send_raw_data(msgpack.packb({"status": f"{type(exc).__name__}: {exc}"[:200]}), writer)
            finally:
                close(writer)
            return
        self.active += 1
        STATS.relayed += 1
        try:
            await P2P.send_raw_data(msgpack.packb({"status": RELAY_OK, "data_bytes": self.limits.data_bytes,
                                                   "time_s": self.limits.time_s}), writer)
            await splice((reader, writer), (r, w), data_limit=self.limits.data_bytes, time_limit=self.limits.time_s)
        finally:
            self.active -= 1


async def serve_relay(_dht: Any, node: Any, *, data_bytes: float = Limits.data_bytes,
                      time_s: float = Limits.time_s) -> None:
    """Run in a reachable DHT node's process: relay streams to the members behind NAT connected to it."""
    await node.p2p.add_binary_stream_handler(RELAY_PROTOCOL, RelayService(node.p2p, Limits(data_bytes, time_s)).handle)


async def serve_reach(dht: Any, node: Any, *, behind_nat: bool, relays: list[str],
                      relay_limits: tuple[float, float] | None = None) -> None:
    """Run in a DHT node's process (``membership.dht_node.start_dht``): what every node offers for
    reaching peers behind NAT. Every node answers dial-back checks; a node behind NAT stays connected
    to ``relays``; any other relays for members behind NAT within ``relay_limits`` (bytes, seconds)."""
    from gossiploco.reach.dialback import serve_dialback

    await serve_dialback(dht, node)
    if behind_nat:
        await keep_relays(dht, node, relays=relays)
    else:
        await serve_relay(dht, node, **dict(zip(("data_bytes", "time_s"), relay_limits or ())))


_KEEPER: asyncio.Future | None = None


async def keep_relays(_dht: Any, node: Any, *, relays: list[str]) -> None:
    """Run in a NAT'd node's DHT process: stay connected to each relay (checked every
    ``KEEP_RELAYS_S``), so that they can open streams to this node over that connection."""
    global _KEEPER

    async def keep() -> None:
        while True:
            connected = {info.peer_id for info in await node.p2p._client.list_peers()}
            for relay in relays:
                address, relay_id = split_relay(relay)
                if relay_id not in connected:
                    try:
                        await asyncio.wait_for(node.p2p._client.connect(relay_id, [address]), CONNECT_S)
                    except Exception as exc:  # noqa: BLE001 - unreachable for now: noted, tried again
                        STATS.last_error = f"relay {address}: {type(exc).__name__}: {exc}"[:300]
            await asyncio.sleep(KEEP_RELAYS_S)

    if _KEEPER is None:
        _KEEPER = asyncio.ensure_future(keep())
