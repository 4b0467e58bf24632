"""Relays for peers behind NAT: a reachable node splices a stream from one member to another.

Why not libp2p's circuit relay v2: hivemind 1.1.12's p2pd reserves a relay slot only through
autorelay, which waits for 4 relay candidates or a boot delay (3 minutes by go-libp2p's default)
before reserving: in the NAT testbed, with one static relay, a daemon forced "private" had no circuit
address after 20 s and dialing it through the relay failed with ``NO_RESERVATION (204)``. The daemon
offers no hole punching either (``p2pd -h`` has no such option). This relay needs nothing of the daemon
but streams: a member behind NAT keeps a connection open to each of its relays (``keep_relays``;
it dials out, so that works through any NAT), and a relay opens streams to it over that connection.

Protocol ``RELAY_PROTOCOL`` (each message one length-prefixed frame, ``reach.framing``, its length checked
before its body is read): the asking peer sends ``{"target": libp2p id, "run": run id, "proof": bytes}``
(at most ``MAX_REQUEST_BYTES``); the relay answers ``{"status": "ok", "data_bytes", "time_s", "idle_s"}``
(its ``Limits`` per relayed connection) and splices the two streams until either ends or a limit is
reached, or answers ``{"status": "REASON: detail"}`` and closes. Every relay and bootstrap node
(``gossiploco dht``) and every reachable peer's DHT node serves it.

Who may ask, and for whom (``RelayAdmission``, decided per request before anything is opened): the
asker is the stream's libp2p peer id, which libp2p authenticates (nobody can ask under another node's
id). ``membership.relay_admission.RunMembers`` admits an asker whose libp2p id is in a currently valid
record of the named run (a record the node's validator accepted: sealed with the swarm key in a
private run, signed in an open run) and that, in a private run, first proves the swarm key (``proof``:
a MAC of its own libp2p id, so a proof copied by a stranger is worth nothing under the stranger's id);
the target must have a valid record of the same run. A node without a record validator relays for
nobody (``ClosedRelay``). Limits (``Limits``): ``per_asker`` splices per asker and ``total`` in all,
``MAX_PENDING_PER_ASKER`` / ``MAX_PENDING`` requests being read or checked, bytes per direction, time
and idle time per splice. Every refusal is answered with its reason, counted by reason
(``STATS.refusals``) and logged (the first of each reason and then at each power of ten).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgpack

from gossiploco.errors import MalformedMessage
from gossiploco.reach.framing import receive_frame, send_frame
from gossiploco.reach.streams import STATS, close, splice

log = logging.getLogger(__name__)

RELAY_PROTOCOL = "/gossiploco/relay/1"
TUNNEL_PROTOCOL = "/gossiploco/tunnel/1"
"""The target's end of a relayed stream (``reach.tunnel.serve_tunnel``)."""
RELAY_OK = "ok"
MAX_RELAYED = 256
"""Relayed connections one relay carries at once."""
MAX_PER_ASKER = 32
"""Relayed connections one asker (libp2p peer id) may hold at once on one relay. A member's tunnels take two
per peer behind NAT it exchanges with (its data and control connections): 32 serve 16 such peers per relay,
and one asker holds at most an eighth of ``MAX_RELAYED``."""
MAX_PENDING = 512
"""Requests a relay reads and checks at once (an asker that opens a stream and says nothing holds one
for ``REQUEST_S``); more are refused at once."""
MAX_PENDING_PER_ASKER = 16
MAX_REQUEST_BYTES = 1024
MAX_ANSWER_BYTES = 512
REQUEST_S = 5.0
"""How long the relay waits for a request once the stream is open."""
CONNECT_S = 10.0
"""How long opening one stream (to the relay, or from it to the target) may take."""
IDLE_S = 60.0
"""A relayed connection that carries no byte either way for this long is cut (ZeroMQ's heartbeats, every
second, keep a tunnel's connections busy)."""
KEEP_RELAYS_S = 5.0
"""How often a node behind NAT checks that it is connected to each of its relays."""


@dataclass(frozen=True)
class Limits:
    """A relay's limits: per relayed connection (p2pd's ``-relayDataLimit``/``-relayTimeLimit`` defaults for
    bytes and time), per asker and in all."""

    data_bytes: float = 4 << 30
    """Bytes per direction."""
    time_s: float = 30 * 60.0
    idle_s: float = IDLE_S
    per_asker: int = MAX_PER_ASKER
    total: int = MAX_RELAYED


class RelayAdmission(ABC):
    """Who may ask a relay to splice, and to whom. Called on the relay's event loop (its DHT process)."""

    @abstractmethod
    def proof(self, run: str, asker: str) -> bytes:
        """What libp2p peer ``asker`` sends with its requests for ``run`` (on the asker's node)."""

    @abstractmethod
    async def refuse(self, node: Any, *, asker: str, target: str, run: str, proof: bytes) -> str | None:
        """None to splice ``asker`` to ``target`` for ``run``, else the refusal ``"REASON: detail"`` (``REASON``
        is counted). ``node``: the relay's hivemind ``DHTNode``. Never raises; bounded in time."""


class ClosedRelay(RelayAdmission):
    """A node that checks no records (no record validator) relays for nobody."""

    def proof(self, run: str, asker: str) -> bytes:
        return b""

    async def refuse(self, node: Any, *, asker: str, target: str, run: str, proof: bytes) -> str | None:
        return "closed: this relay checks no records (a DHT node without a record validator)"


@dataclass(frozen=True)
class Credentials:
    """What this node sends with its relay requests: its run and its proof (``RelayAdmission.proof``)."""

    run: str = ""
    proof: bytes = b""


_CREDENTIALS = Credentials()
"""This DHT process's credentials (set by ``serve_reach``)."""


def credentials() -> Credentials:
    """This DHT process's relay credentials (empty before ``serve_reach`` or without a run)."""
    return _CREDENTIALS


def split_relay(relay: str) -> tuple[Any, Any]:
    """``(transport multiaddr, PeerID)`` of ``/ip4/HOST/tcp/PORT/p2p/ID``."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    base, _, pid = relay.rpartition("/p2p/")
    return Multiaddr(base), PeerID.from_base58(pid)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


async def through(p2p: Any, relay: str, target: str, creds: Credentials | None = None
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Limits]:
    """A stream to ``target``'s tunnel handler, spliced by ``relay``, and the relay's limits. ``creds``
    (default: this process's ``credentials()``) go with the request. Raises ``ConnectionError`` (or the
    daemon's error, or ``MalformedMessage`` for an oversized answer) when the relay cannot or will not;
    ``TargetUnreachable`` (a ``ConnectionError``) when it answered that it cannot reach ``target``."""
    creds = credentials() if creds is None else creds
    address, relay_id = split_relay(relay)
    await p2p._client.connect(relay_id, [address])  # a no-op when connected; needed for a --relay node
    _, reader, writer = await p2p.call_binary_stream_handler(relay_id, RELAY_PROTOCOL)
    try:
        await send_frame(msgpack.packb({"target": target, "run": creds.run, "proof": creds.proof}), writer)
        answer = msgpack.unpackb(await receive_frame(reader, MAX_ANSWER_BYTES), raw=False)
    except BaseException:
        close(writer)
        raise
    if not isinstance(answer, dict) or answer.get("status") != RELAY_OK:
        close(writer)
        status = str(answer.get("status") if isinstance(answer, dict) else answer)[:200]
        unreachable = status.split(":", 1)[0] in TARGET_REFUSALS
        raise (TargetUnreachable if unreachable else ConnectionError)(f"the relay refused: {status}")
    data, age = answer.get("data_bytes"), answer.get("time_s")
    if not all(_positive(v) for v in (data, age)):
        close(writer)
        raise ConnectionError(f"the relay sent malformed limits: {answer!r:.200}")
    idle = answer.get("idle_s")
    return reader, writer, Limits(float(data), float(age), float(idle) if _positive(idle) else IDLE_S)


class TargetUnreachable(ConnectionError):
    """The relay answered but cannot reach the target (``target unreachable``: no connection to it, or
    ``unknown target``: no valid record of the run names it): the relay works; the target is gone (it left the
    run, or its own connection to this relay is down)."""


TARGET_REFUSALS = ("target unreachable", "unknown target")
"""The refusal reasons that are about the target, not the relay (``TargetUnreachable``)."""


class Refused(Exception):
    """A request the relay will not serve; ``str`` is ``"REASON: detail"``."""


def parse_request(raw: bytes) -> tuple[str, str, bytes]:
    """``(target, run, proof)`` of a request's bytes; ``Refused("malformed: ...")`` for anything else."""
    try:
        request = msgpack.unpackb(raw, raw=False, max_str_len=256, max_bin_len=256, max_array_len=0, max_map_len=8)
    except Exception as exc:  # noqa: BLE001 - msgpack raises a zoo of types on junk
        raise Refused(f"malformed: not msgpack ({type(exc).__name__})") from None
    if not isinstance(request, dict) or set(request) != {"target", "run", "proof"}:
        raise Refused("malformed: a request is {target, run, proof}")
    target, run, proof = request["target"], request["run"], request["proof"]
    if not (isinstance(target, str) and isinstance(run, str) and isinstance(proof, bytes)):
        raise Refused("malformed: target and run are strings, proof is bytes")
    return target, run, proof


class RelayService:
    """The relay's handler (see the module docstring): admission by ``admission``, within ``limits``."""

    def __init__(self, node: Any, limits: Limits, admission: RelayAdmission):
        self.node, self.limits, self.admission = node, limits, admission
        self.active: Counter[str] = Counter()
        """Relayed connections per asker now."""
        self.pending: Counter[str] = Counter()
        """Requests being read or checked per asker now."""

    @property
    def total_active(self) -> int:
        return sum(self.active.values())

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asker = info.peer_id.to_base58()
        if sum(self.pending.values()) >= MAX_PENDING or self.pending[asker] >= MAX_PENDING_PER_ASKER:
            await self._refuse(writer, asker, f"pending: {MAX_PENDING_PER_ASKER} requests per asker "
                                              f"(and {MAX_PENDING} in all) are read at once")
            return
        self.pending[asker] += 1
        try:
            opened = await self._admit(asker, reader)
        except Refused as exc:
            await self._refuse(writer, asker, str(exc))
            return
        finally:
            self._release(self.pending, asker)
        r, w = opened  # its slot is taken (``_admit``)
        STATS.relayed += 1
        try:
            await send_frame(msgpack.packb({"status": RELAY_OK, "data_bytes": self.limits.data_bytes,
                                            "time_s": self.limits.time_s, "idle_s": self.limits.idle_s}), writer)
            await splice((reader, writer), (r, w), data_limit=self.limits.data_bytes, time_limit=self.limits.time_s,
                         idle_limit=self.limits.idle_s)
        except (OSError, ConnectionError):
            pass
        finally:
            close(writer)
            close(w)
            self._release(self.active, asker)

    async def _admit(self, asker: str, reader: asyncio.StreamReader) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Read and check one request; the stream to its target, with the asker's slot taken, or ``Refused``."""
        from hivemind.p2p import PeerID

        try:
            raw = await asyncio.wait_for(receive_frame(reader, MAX_REQUEST_BYTES), REQUEST_S)
        except MalformedMessage as exc:
            raise Refused(f"malformed: {exc}") from None
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError) as exc:
            raise Refused(f"no request: {type(exc).__name__} within {REQUEST_S:g} s") from None
        target, run, proof = parse_request(raw)
        if target == asker:
            raise Refused("malformed: the target is the asker")
        if self.active[asker] >= self.limits.per_asker:
            raise Refused(f"asker limit: {self.limits.per_asker} relayed connections per asker at once")
        if self.total_active >= self.limits.total:
            raise Refused(f"relay busy: {self.limits.total} relayed connections at once")
        reason = await self.admission.refuse(self.node, asker=asker, target=target, run=run, proof=proof)
        if reason is not None:
            raise Refused(reason)
        if self.active[asker] >= self.limits.per_asker:  # checked again, and taken, with no await in between
            raise Refused(f"asker limit: {self.limits.per_asker} relayed connections per asker at once")
        if self.total_active >= self.limits.total:
            raise Refused(f"relay busy: {self.limits.total} relayed connections at once")
        self.active[asker] += 1
        try:
            peer = PeerID.from_base58(target)
            _, r, w = await asyncio.wait_for(self.node.p2p.call_binary_stream_handler(peer, TUNNEL_PROTOCOL), CONNECT_S)
        except BaseException as exc:
            self._release(self.active, asker)
            if not isinstance(exc, Exception):
                raise
            raise Refused(f"target unreachable: {type(exc).__name__}: {exc}"[:200]) from None
        return r, w

    @staticmethod
    def _release(counter: Counter[str], asker: str) -> None:
        counter[asker] -= 1
        if counter[asker] <= 0:
            del counter[asker]

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, asker: str, status: str) -> None:
        """Answer ``status``, close, count it by reason, and log the first of each reason and each power of ten."""
        reason = status.split(":", 1)[0]
        count = STATS.refusals[reason] = STATS.refusals.get(reason, 0) + 1
        STATS.refused += 1
        if count == 1 or str(count).rstrip("0") == "1":
            log.warning("relay: refused %s (%d refused for this reason so far): %s", asker, count, status[:200])
        try:
            await asyncio.wait_for(send_frame(msgpack.packb({"status": status[:200]}), writer), CONNECT_S)
        except (OSError, ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            close(writer)


async def serve_relay(_dht: Any, node: Any, *, limits: Limits = Limits(), admission: RelayAdmission | None = None
                      ) -> None:
    """Run in a reachable DHT node's process: relay streams to the members behind NAT connected to it, for
    askers ``admission`` admits (None: nobody, ``ClosedRelay``)."""
    service = RelayService(node, limits, admission or ClosedRelay())
    await node.p2p.add_binary_stream_handler(RELAY_PROTOCOL, service.handle)


async def serve_reach(dht: Any, node: Any, *, behind_nat: bool, relays: list[str],
                      relay_limits: tuple[float, ...] | None = None, admission: RelayAdmission | None = None,
                      run: str | None = None) -> None:
    """Run in a DHT node's process (``membership.dht_node.start_dht``): what every node offers for
    reaching peers behind NAT. Every node answers dial-back checks; a node behind NAT stays connected
    to ``relays``; any other relays for members behind NAT within ``relay_limits`` (bytes, seconds per
    relayed connection), for askers ``admission`` admits. ``run``: this node's run (its relay requests
    carry it and ``admission``'s proof)."""
    global _CREDENTIALS
    from gossiploco.reach.dialback import serve_dialback

    if run is not None and admission is not None:
        _CREDENTIALS = Credentials(run, admission.proof(run, node.peer_id.to_base58()))
    await serve_dialback(dht, node)
    if behind_nat:
        await keep_relays(dht, node, relays=relays)
    else:
        limits = Limits(*relay_limits) if relay_limits else Limits()
        await serve_relay(dht, node, limits=limits, admission=admission)


_KEEPER: asyncio.Future | None = None
_KEPT: set[str] = set()
"""The libp2p ids of the relays this (NAT'd) node keeps connected to: the only nodes whose tunnel streams it serves."""


def kept_relays() -> frozenset[str]:
    """The libp2p ids of this DHT process's relays (``keep_relays``)."""
    return frozenset(_KEPT)


async def keep_relays(_dht: Any, node: Any, *, relays: list[str]) -> None:
    """Run in a NAT'd node's DHT process: stay connected to each relay (checked every
    ``KEEP_RELAYS_S``), so that they can open streams to this node over that connection."""
    global _KEEPER
    _KEPT.update(split_relay(relay)[1].to_base58() for relay in relays)

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
