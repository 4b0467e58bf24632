"""The libp2p carrier: ZeroMQ connections carried over libp2p streams, through a relay.

When neither peer of a pair can be dialed (both behind NAT), the sender's data and control
DEALERs connect to a local port (``open_tunnel``) instead of the receiver's address. Each TCP
connection accepted there becomes one libp2p stream to a relay (``RELAY_PROTOCOL``: a reachable
bootstrap node, ``--relay`` node or member), which opens a stream to the receiver over the
connection the receiver keeps open to it (``keep_relays``: a node behind NAT dials out, so that
connection exists) and splices the two. The receiver's handler (``serve_tunnel``) connects the
stream to its own ZeroMQ ROUTER on loopback. The bytes are ZeroMQ's own, so the protocol,
CurveZMQ's end-to-end encryption (the relay sees ciphertext) and the members-only admission are
exactly those of a direct connection: the carrier is a byte pipe, nothing above it changes.

Why not libp2p's circuit relay v2: hivemind 1.1.12's p2pd reserves a relay slot only through
autorelay, which waits for 4 relay candidates or a 3-minute boot delay before reserving (measured
in the NAT testbed: ``NO_RESERVATION (204)`` for the whole first minutes with one static relay), and
it offers no hole punching (``p2pd -h`` has no such option). The relay here needs nothing of the
daemon but streams.

A stream that breaks (the relay died) closes its TCP connection; ZeroMQ reconnects and the next
stream goes through the next relay that answers (a failed attempt holds its connection for a
backoff first, so ZeroMQ's reconnects do not hammer). A relayed connection idle for
``RENEW_IDLE_S`` after it has carried ``RENEW_BYTES`` or lived ``RENEW_AGE_S`` is renewed, so limits
a relay may have are met between exchanges, not in the middle of one.

Every end runs inside a DHT process (``dht.run_coroutine``), on its event loop, off the training
process's interpreter lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

TUNNEL_PROTOCOL = "/gossiploco/tunnel/1"
RELAY_PROTOCOL = "/gossiploco/relay/1"
RELAY_OK = b"ok"
KEEP_RELAYS_S = 5.0
"""How often a node behind NAT checks that it is connected to each of its relays."""
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 8.0
READ_BYTES = 1 << 18
MAX_STREAMS = 64
"""Tunnel streams one peer serves at once (two per relayed member: data and control)."""
CONNECT_S = 10.0
"""How long opening one stream (dial through a relay, open the protocol) may take."""
RENEW_BYTES = 2 << 30
"""Half of p2pd's default relay data limit (4 GiB per direction)."""
RENEW_AGE_S = 15 * 60.0
"""Half of p2pd's default relay time limit (30 min)."""
RENEW_IDLE_S = 1.0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: list[float]) -> None:
    """Copy until EOF or an error; ``counter`` = [bytes, last activity]."""
    try:
        while True:
            data = await reader.read(READ_BYTES)
            if not data:
                break
            writer.write(data)
            await writer.drain()
            counter[0] += len(data)
            counter[1] = time.monotonic()
    except (OSError, asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - already closed by the other side
            pass


async def _splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                  stats: TunnelStats, renew: bool = False) -> None:
    """Copy both ways until one side ends; then close both. ``renew``: also end an old, busy,
    now idle connection (see the module docstring)."""
    began = time.monotonic()
    up, down = [0.0, began], [0.0, began]
    tasks = [asyncio.ensure_future(_pipe(a[0], b[1], up)), asyncio.ensure_future(_pipe(b[0], a[1], down))]
    try:
        while True:
            done, _ = await asyncio.wait(tasks, timeout=RENEW_IDLE_S, return_when=asyncio.FIRST_COMPLETED)
            if done:
                break
            now = time.monotonic()
            worn = max(up[0], down[0]) >= RENEW_BYTES or now - began >= RENEW_AGE_S
            if renew and worn and now - max(up[1], down[1]) >= RENEW_IDLE_S:
                stats.renewed += 1
                break
    finally:
        for task in tasks:
            task.cancel()
        for writer in (a[1], b[1]):
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass
        stats.bytes += up[0] + down[0]


@dataclass
class TunnelStats:
    """Counters of one peer's tunnels (both directions), for its summary."""

    opened: int = 0
    served: int = 0
    failed: int = 0
    refused: int = 0
    renewed: int = 0
    active: int = 0
    bytes: float = 0.0
    last_error: str = ""
    relays_used: dict[str, int] = field(default_factory=dict)


_STATS = TunnelStats()
_TUNNELS: dict[str, tuple[int, list[str]]] = {}
"""Per remote libp2p peer id: (local port, the relays to try), in the DHT process."""


async def serve_tunnel(_dht: Any, node: Any, *, router_host: str, router_port: int) -> None:
    """Run in the DHT process: connect every incoming tunnel stream to the ROUTER at ``router_host:router_port``."""
    host = "127.0.0.1" if router_host in ("0.0.0.0", "*", "") else router_host

    async def handle(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if _STATS.active >= MAX_STREAMS:
            _STATS.refused += 1
            writer.close()
            return
        _STATS.served += 1
        _STATS.active += 1
        try:
            local = await asyncio.wait_for(asyncio.open_connection(host, router_port), CONNECT_S)
            await _splice((reader, writer), local, _STATS)
        except (OSError, asyncio.TimeoutError) as exc:
            _STATS.failed += 1
            _STATS.last_error = f"cannot reach the local ROUTER {host}:{router_port}: {exc}"
            writer.close()
        finally:
            _STATS.active -= 1

    await node.p2p.add_binary_stream_handler(TUNNEL_PROTOCOL, handle)



async def open_tunnel(_dht: Any, node: Any, *, peer_id: str, relays: list[str]) -> int:
    """Run in the DHT process: a local port whose connections are carried to ``peer_id``'s tunnel
    handler through one of ``relays`` (tried in order, starting after the last that failed).
    Idempotent per ``peer_id`` (a second call updates the relays and returns the same port)."""
    if peer_id in _TUNNELS:
        port, _ = _TUNNELS[peer_id]
        _TUNNELS[peer_id] = (port, list(relays))
        return port
    p2p = node.p2p

    failures = [0]

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        relays_now = _TUNNELS[peer_id][1]
        errors = []
        for relay in relays_now:
            try:
                r, w = await asyncio.wait_for(_through(p2p, relay, peer_id), CONNECT_S)
            except Exception as exc:  # noqa: BLE001 - try the next relay
                errors.append(f"{relay.rsplit('/p2p/', 1)[0]}: {type(exc).__name__}: {exc}"[:300])
                continue
            failures[0] = 0
            _STATS.opened += 1
            _STATS.relays_used[relay] = _STATS.relays_used.get(relay, 0) + 1
            if relay is not relays_now[0]:  # the failed ones go last next time
                at = relays_now.index(relay)
                _TUNNELS[peer_id] = (_TUNNELS[peer_id][0], relays_now[at:] + relays_now[:at])
            await _splice((reader, writer), (r, w), _STATS, renew=True)
            return
        _STATS.failed += 1
        _STATS.last_error = "; ".join(errors) or "no relay known"
        failures[0] += 1
        await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures[0] - 1)))  # before ZeroMQ retries
        writer.close()

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _TUNNELS[peer_id] = (port, list(relays))
    return port


async def _through(p2p: Any, relay: str, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to ``peer_id``'s tunnel handler, spliced by ``relay`` (raises on any failure)."""
    from hivemind.p2p import P2P, PeerID

    from hivemind.utils.multiaddr import Multiaddr

    base, _, pid = relay.rpartition("/p2p/")
    relay_id = PeerID.from_base58(pid)
    await p2p._client.connect(relay_id, [Multiaddr(base)])  # a no-op when connected; needed for a --relay node
    _, r, w = await p2p.call_binary_stream_handler(relay_id, RELAY_PROTOCOL)
    await P2P.send_raw_data(peer_id.encode(), w)
    answer = await P2P.receive_raw_data(r)
    if answer != RELAY_OK:
        w.close()
        raise ConnectionError(f"the relay refused: {answer[:200].decode(errors='replace')}")
    return r, w


class RelayService:
    """A reachable node's relay: splices a stream from one member to another over the connection
    the (NAT'd) target keeps to this node. At most ``MAX_STREAMS`` at once."""

    def __init__(self, p2p: Any):
        self.p2p = p2p
        self.active = self.relayed = self.refused = 0

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from hivemind.p2p import P2P, PeerID

        try:
            target = (await asyncio.wait_for(P2P.receive_raw_data(reader), CONNECT_S)).decode()
            if self.active >= MAX_STREAMS:
                raise ConnectionError("relay busy")
            _, r, w = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(target), TUNNEL_PROTOCOL), CONNECT_S)
        except Exception as exc:  # noqa: BLE001 - the asking peer is told why, and tries another relay
            self.refused += 1
            try:
                await P2P.send_raw_data(f"{type(exc).__name__}: {exc}"[:200].encode(), writer)
            finally:
                writer.close()
            return
        self.active += 1
        self.relayed += 1
        try:
            await P2P.send_raw_data(RELAY_OK, writer)
            await _splice((reader, writer), (r, w), _STATS)
        finally:
            self.active -= 1


async def serve_relay(_dht: Any, node: Any) -> None:
    """Run in a reachable DHT node's process: relay tunnel streams to the members behind NAT connected to it."""
    await node.p2p.add_binary_stream_handler(RELAY_PROTOCOL, RelayService(node.p2p).handle)


async def keep_relays(_dht: Any, node: Any, *, relays: list[str]) -> None:
    """Run in a NAT'd node's DHT process: stay connected to each relay (reconnecting every
    ``KEEP_RELAYS_S``), so that they can open streams to this node over that connection."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def keep() -> None:
        while True:
            connected = {info.peer_id for info in await node.p2p._client.list_peers()}
            for relay in relays:
                base, _, pid = relay.rpartition("/p2p/")
                peer = PeerID.from_base58(pid)
                if peer not in connected:
                    try:
                        await asyncio.wait_for(node.p2p._client.connect(peer, [Multiaddr(base)]), CONNECT_S)
                    except Exception as exc:  # noqa: BLE001 - unreachable for now: counted, tried again
                        _STATS.last_error = f"relay {base}: {type(exc).__name__}: {exc}"[:300]
            await asyncio.sleep(KEEP_RELAYS_S)

    global _KEEPER
    if _KEEPER is None:
        _KEEPER = asyncio.ensure_future(keep())


_KEEPER: Any = None


async def tunnel_stats(_dht: Any, _node: Any) -> dict:
    """Run in the DHT process: the counters of this peer's tunnels."""
    s = _STATS
    return {"opened": s.opened, "served": s.served, "failed": s.failed, "refused": s.refused, "renewed": s.renewed,
            "bytes": int(s.bytes), "last_error": s.last_error, "relays_used": dict(s.relays_used)}


async def libp2p_identity(_dht: Any, node: Any) -> str:
    """Run in the DHT process: this node's libp2p peer id (base58)."""
    return node.p2p.peer_id.to_base58()
