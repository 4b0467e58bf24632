"""The libp2p carrier: ZeroMQ connections carried over libp2p streams, through a relay.

When neither peer of a pair can be dialed (both behind NAT), the sender's data and control
DEALERs connect to a local port (``open_tunnel``) instead of the receiver's address. Each TCP
connection accepted there is carried over libp2p streams through a relay (``reach.relay``) to the
receiver's handler (``serve_tunnel``), which connects it to its own ZeroMQ ROUTER on loopback. The
bytes are ZeroMQ's own, so the protocol, CurveZMQ's end-to-end encryption (the relay sees
ciphertext) and the members-only admission are exactly those of a direct connection: the carrier
is a byte pipe, nothing above it changes.

One connection is one *session* (a random id the dialing side sends first on each of its streams:
``HELLO`` + 8 bytes). A stream nearing its relay's limits (past half of either) is handed over to
a new stream between exchanges without losing a byte (``reach.streams.carry``), so the limits
never cut an exchange; the receiving side keeps the ROUTER connection open for ``RESUME_S`` for
the session to come back. A stream that breaks (its relay died) ends the session: the connection
closes and ZeroMQ reconnects at once; the next session goes through the next relay that answers
(a failed attempt holds its connection for a backoff first, so reconnects do not hammer). A session no relay can
carry is counted as failed (``STATS.failed``, logged as a warning), unless a relay that answered said it cannot reach
the target (``relay.TargetUnreachable``): the peer is gone, the relays work (``STATS.unreachable``, logged as info;
a peer that left is redialed by ZeroMQ, with this backoff, for as long as this peer runs).

The receiving side serves only streams opened by its own relays (the nodes it keeps connected to,
``reach.relay.keep_relays``); a relay splices only for members of the run (``reach.relay``).

Both ends run inside a peer's DHT process (``dht.run_coroutine``), on its event loop, off the
training process's interpreter lock.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from gossiploco.reach.relay import CONNECT_S, TUNNEL_PROTOCOL, TargetUnreachable, kept_relays, through
from gossiploco.reach.streams import STATS, close, carry

log = logging.getLogger(__name__)

HELLO = b"GLT1"
SESSION_BYTES = 8
RESUME_S = 2 * CONNECT_S
"""How long the receiving side keeps a handed-over session's ROUTER connection for its next stream."""
MAX_SESSIONS = 64
"""Sessions one peer serves at once (two per relayed member: data and control)."""
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 8.0

_TUNNELS: dict[str, tuple[int, list[str]]] = {}
"""Per remote libp2p peer id: (local port, the relays to try), in this DHT process."""
_SERVERS: dict[str, asyncio.AbstractServer] = {}
"""Per remote libp2p peer id: the server listening on its local port."""


async def serve_tunnel(_dht: Any, node: Any, *, router_host: str, router_port: int) -> None:
    """Run in the DHT process: carry every incoming session to the ROUTER at ``router_host:router_port``."""
    host = "127.0.0.1" if router_host in ("0.0.0.0", "*", "") else router_host
    parked: dict[bytes, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}  # handed over, awaiting a stream
    live: set[bytes] = set()

    async def expire(session: bytes) -> None:
        await asyncio.sleep(RESUME_S)
        local = parked.pop(session, None)
        if local is not None:
            close(local[1])

    async def handle(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if info.peer_id.to_base58() not in kept_relays():  # only this node's relays splice streams to it
            STATS.refusals["tunnel not from a relay"] = STATS.refusals.get("tunnel not from a relay", 0) + 1
            STATS.refused += 1
            close(writer)
            return
        try:
            hello = await asyncio.wait_for(reader.readexactly(len(HELLO) + SESSION_BYTES), CONNECT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError):
            close(writer)
            return
        session = hello[len(HELLO):]
        if not hello.startswith(HELLO) or session in live or (session not in parked and len(live) >= MAX_SESSIONS):
            STATS.refused += 1
            close(writer)
            return
        local = parked.pop(session, None)
        if local is None:
            try:
                local = await asyncio.wait_for(asyncio.open_connection(host, router_port), CONNECT_S)
            except (OSError, asyncio.TimeoutError) as exc:
                STATS.failed += 1
                STATS.last_error = f"cannot reach the local ROUTER {host}:{router_port}: {exc}"
                close(writer)
                return
            STATS.served += 1
        else:
            STATS.resumed += 1
        live.add(session)
        try:
            handed_over = await carry(local, (reader, writer))
        finally:
            live.discard(session)
            close(writer)
        if handed_over:
            parked[session] = local
            asyncio.ensure_future(expire(session))
        else:
            close(local[1])

    await node.p2p.add_binary_stream_handler(TUNNEL_PROTOCOL, handle)


async def open_tunnel(_dht: Any, node: Any, *, peer_id: str, relays: list[str]) -> int:
    """Run in the DHT process: a local port whose connections are carried to ``peer_id``'s tunnel
    handler through one of ``relays`` (tried in order, starting after the last that failed).
    Idempotent per ``peer_id`` (a second call updates the relays and returns the same port)."""
    if peer_id in _TUNNELS:
        port, _ = _TUNNELS[peer_id]
        _TUNNELS[peer_id] = (port, list(relays))
        return port
    failures = [0]

    async def stream() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any] | None:
        """A stream through the first relay that answers (reordering the relays), or None."""
        relays_now = _TUNNELS[peer_id][1]
        errors, target_gone = [], False
        for at, relay in enumerate(relays_now):
            try:
                opened = await asyncio.wait_for(through(node.p2p, relay, peer_id), CONNECT_S)
            except Exception as exc:  # noqa: BLE001 - try the next relay
                target_gone |= isinstance(exc, TargetUnreachable)
                errors.append(f"{relay.rsplit('/p2p/', 1)[0]}: {type(exc).__name__}: {exc}"[:300])
                continue
            STATS.relays_used[relay] = STATS.relays_used.get(relay, 0) + 1
            if at:  # the failed ones go last next time
                _TUNNELS[peer_id] = (_TUNNELS[peer_id][0], relays_now[at:] + relays_now[:at])
            return opened
        STATS.last_error = "; ".join(errors) or "no relay known"
        if target_gone:  # a relay works but cannot reach the peer: it is gone, not the relays
            STATS.unreachable += 1
            count, level, what = STATS.unreachable, logging.INFO, "is unreachable through every relay that answered"
        else:
            STATS.failed += 1
            count, level, what = STATS.failed, logging.WARNING, "could not be carried by any relay"
        if count & (count - 1) == 0:  # the first, then at powers of two: a peer that left is redialed for a while
            log.log(level, "tunnel to %s %s (%d so far): %s", peer_id, what, count, STATS.last_error)
        return None

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = secrets.token_bytes(SESSION_BYTES)
        handed_over = False
        while True:
            opened = await stream()
            if opened is None:
                failures[0] += 1
                if not handed_over:  # hold ZeroMQ's connection a while before it retries
                    await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures[0] - 1)))
                break
            failures[0] = 0
            r, w, limits = opened
            STATS.opened += 1
            STATS.renewed += handed_over
            w.write(HELLO + session)
            handed_over = await carry((reader, writer), (r, w), renew_after=(limits.data_bytes / 2, limits.time_s / 2))
            close(w)
            if not handed_over:
                break
        close(writer)

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _TUNNELS[peer_id] = (port, list(relays))
    _SERVERS[peer_id] = server
    return port


async def close_tunnel(_dht: Any, _node: Any, *, peer_id: str) -> bool:
    """Run in the DHT process: stop listening for connections to ``peer_id`` (it left the run; sessions still open
    end on their own). True if there was such a tunnel."""
    server = _SERVERS.pop(peer_id, None)
    _TUNNELS.pop(peer_id, None)
    if server is None:
        return False
    server.close()
    return True


async def tunnel_stats(_dht: Any, _node: Any) -> dict:
    """Run in the DHT process: the counters of this node's tunnels and relaying."""
    s = STATS
    return {"opened": s.opened, "served": s.served, "resumed": s.resumed, "failed": s.failed,
            "unreachable": s.unreachable, "refused": s.refused,
            "renewed": s.renewed, "relayed": s.relayed, "limit_cuts": s.limit_cuts, "bytes": int(s.bytes),
            "idle_cuts": s.idle_cuts, "refusals": dict(s.refusals), "last_error": s.last_error,
            "relays_used": dict(s.relays_used)}

