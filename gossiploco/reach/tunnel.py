"""The libp2p carrier: ZeroMQ connections carried over libp2p streams, through circuit relays.

When neither peer of a pair can be dialed (both behind NAT), the sender's data and control
DEALERs connect to a local port (``open_tunnel``) instead of the receiver's address. Each TCP
connection accepted there becomes one libp2p stream (``TUNNEL_PROTOCOL``) to the receiver's libp2p
daemon, reached through a circuit relay (``/RELAY/p2p-circuit``: a reachable member or bootstrap
node that offers relay service); the receiver's handler (``serve_tunnel``) connects the stream to
its own ZeroMQ ROUTER on loopback. The bytes are ZeroMQ's own, so the protocol, CurveZMQ's
end-to-end encryption (the relay sees ciphertext) and the members-only admission are exactly
those of a direct connection: the carrier is a byte pipe, nothing above it changes.

A stream that breaks (the relay died, or hit its data or time limit) closes its TCP connection;
ZeroMQ reconnects at once and the next stream goes through the next relay that answers. A relayed
connection idle for ``RENEW_IDLE_S`` after it has carried ``RENEW_BYTES`` or lived ``RENEW_AGE_S``
is renewed before the relay's limits cut it mid-exchange.

Both ends run inside the peer's DHT process (``dht.run_coroutine``), on its event loop, off the
training process's interpreter lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

TUNNEL_PROTOCOL = "/gossiploco/tunnel/1"
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


def circuit_maddr(relay: str) -> Any:
    """``RELAY/p2p-circuit`` as a hivemind ``Multiaddr``. Built from bytes: hivemind's multiaddr
    library encodes ``/p2p/`` as a CID, which the daemon's Go side rejects ("length greater than
    remaining number of bytes in buffer"), so the peer id goes in as its raw multihash."""
    import varint
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    base, _, pid = relay.rpartition("/p2p/")
    if not base or not pid:
        raise ValueError(f"a relay address must end in /p2p/<peer id>, got {relay!r}")
    multihash = PeerID.from_base58(pid.strip("/")).to_bytes()
    raw = Multiaddr(base).to_bytes() + varint.encode(421) + varint.encode(len(multihash)) + multihash
    return Multiaddr(raw + varint.encode(290))


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
    from hivemind.p2p import PeerID

    if peer_id in _TUNNELS:
        port, _ = _TUNNELS[peer_id]
        _TUNNELS[peer_id] = (port, list(relays))
        return port
    target = PeerID.from_base58(peer_id)
    p2p = node.p2p

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        relays_now = _TUNNELS[peer_id][1]
        errors = []
        for relay in relays_now:
            try:
                await asyncio.wait_for(p2p._client.connect(target, [circuit_maddr(relay)]), CONNECT_S)
                _, r, w = await asyncio.wait_for(p2p.call_binary_stream_handler(target, TUNNEL_PROTOCOL), CONNECT_S)
            except Exception as exc:  # noqa: BLE001 - try the next relay
                errors.append(f"{relay[-12:]}: {type(exc).__name__}: {exc}"[:160])
                continue
            _STATS.opened += 1
            _STATS.relays_used[relay] = _STATS.relays_used.get(relay, 0) + 1
            if relay is not relays_now[0]:  # the failed ones go last next time
                order = relays_now[relays_now.index(relay):] + relays_now[:relays_now.index(relay)]
                _TUNNELS[peer_id] = (_TUNNELS[peer_id][0], order)
            await _splice((reader, writer), (r, w), _STATS, renew=True)
            return
        _STATS.failed += 1
        _STATS.last_error = "; ".join(errors) or "no relay known"
        writer.close()

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _TUNNELS[peer_id] = (port, list(relays))
    return port


async def tunnel_stats(_dht: Any, _node: Any) -> dict:
    """Run in the DHT process: the counters of this peer's tunnels."""
    s = _STATS
    return {"opened": s.opened, "served": s.served, "failed": s.failed, "refused": s.refused, "renewed": s.renewed,
            "bytes": int(s.bytes), "last_error": s.last_error, "relays_used": dict(s.relays_used)}


async def libp2p_identity(_dht: Any, node: Any) -> str:
    """Run in the DHT process: this node's libp2p peer id (base58)."""
    return node.p2p.peer_id.to_base58()
