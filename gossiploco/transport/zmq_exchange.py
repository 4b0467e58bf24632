"""``Exchange`` over ZeroMQ (the only module that imports zmq).

Topology: peer ``i`` binds one ROUTER socket at ``endpoints[i]`` and connects one DEALER to every
other known peer's ROUTER (routing id ``str(i)``), plus a second, control DEALER (routing id
``"i/control"``) for group agreement and aborts, so those never queue behind megabytes of data on
a slow link (head-of-line blocking). Peers are known from the list given at
construction (a static ``--peers`` list) or added later by discovery (``add_peer``, fed by the
hivemind DHT); peer ids are ints below ``MAX_PEER_ID``. Sending goes out on the DEALER to the destination;
everything addressed to a peer arrives on its ROUTER. Messages are ``codec`` frames: a msgpack
header plus raw tensor frames.

Threads and ownership (zmq sockets are not thread-safe):

* one receiver thread owns the ROUTER and the DEALERs' monitor sockets. It decodes every message
  (``codec.decode``), drops malformed ones with a logged reason (counted in
  ``malformed_messages``), and files valid ones in a mailbox keyed by
  ``(key, sender, chunk)``; callers wait on a condition variable with their deadline.
* each DEALER has its own lock; any caller thread may send while holding it. Sends never block:
  ``NOBLOCK`` plus a poll/retry loop bounded by the call's deadline, so a dead peer whose queue is
  full cannot hold a sender forever.
* one service thread sends what the receiver decides to send (hello replies, aborts, state
  uploads), so the receiver never waits on a socket it does not own.

Messages of one call:

* ``swap``: the payload in chunks of ``chunk_bytes``; message ``chunk = i`` holds chunk i.
* ``all_reduce_mean``: a bandwidth-optimal ring over ``sorted(members)``: reduce-scatter then
  all-gather, 2 (n - 1) steps; step s sends one segment to the right neighbour in ``cps``
  chunks numbered ``chunk = s * cps + c`` and receives the same numbering from the left
  neighbour. ``cps`` (chunks per segment) follows from the payload size, the group size and
  ``chunk_bytes``, so every peer of a group must use the same ``chunk_bytes``.

Group agreement (``group``): before an exchange, the peers taking part agree on its member list
through the lowest-id peer of their view as leader, with a grace window for stragglers; see
``group`` for the protocol. Every ring chunk also carries a digest of the member list, so a
disagreement that slips through fails at once instead of mis-mixing.

Deadlines: each swap or all-reduce gets ``deadlines.deadline_s(key)`` (``AdaptiveDeadlines``:
a multiple of recent durations of the same kind of exchange, at most ``timeout_s``).

Every message carries two tensors: an int64 ``meta`` vector (1 to 4 entries; for data chunks
``[total elements, tag]``, so a size mismatch is detected and raised as ``PeerFailed``) and a
float32 chunk. ``bytes_sent``/``bytes_received`` count the float32 chunk bytes only.

Membership (made dynamic by ``hello`` messages): ``members(r)`` is this peer's view of the
peers taking part in round r's exchanges. At construction every peer of the given list takes
part from round 0; a peer added later (``add_peer``) is pending until it says hello. A peer whose
connection drops leaves the group and, when it comes back, stays *pending* until it says
``hello``: "I take part from round J on" (``announce``). Every handshake with a pending peer
sends it a probe, whose reply says its join round, so views heal after reconnections. A hello may ask
for a reply; the reply carries the replier's own join round and ``current_round`` (the round it
is in, -1 before the first), so a starting peer learns whether the swarm is already past round 0
(``peer_rounds``) and must catch up by downloading state (``fetch_state`` from a peer that
``serve_state``s; served by a service thread, never the receiver).

Failing fast: when a call fails on this peer (deadline, lost peer, bad data), it sends ``abort``
for that key to the call's other participants, so they fail at once instead of waiting out their
deadline for chunks that will never come.

Failure detection: a monitor on each DEALER reports ZMTP handshakes and disconnects. A peer whose
connection dropped after having been up (its process exited or crashed; ZMTP heartbeats catch a
frozen process or a silent machine within the heartbeat timeout) is marked failed: it leaves
``members()``, and a call waiting for data from it raises ``PeerFailed`` after
``FAILED_GRACE_S`` (data it sent before dying may still be arriving). When it comes back it is
pending until it says hello. A peer that never connected, or that stays connected but silent,
makes calls raise ``ExchangeTimeout`` at their deadline.

Known limits: a message rejected by the codec (including a payload holding NaN or Inf) is
dropped, so the waiting call times out (it cannot know which call the message belonged to); its
own abort then releases the other participants. Messages that arrive before
anyone waits for them are kept up to ``mailbox_bytes``; past that, entries of keys nobody is
waiting on are evicted oldest first, then incoming messages are dropped (logged, counted in
``dropped_messages``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import queue
import signal
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from gossiploco.errors import ExchangeClosed, ExchangeError, ExchangeTimeout, MalformedMessage, PeerFailed
from gossiploco.mixing.exchange import Exchange
from gossiploco.transport import codec
from gossiploco.transport.deadlines import AdaptiveDeadlines

log = logging.getLogger(__name__)

POLL_MS = 100
"""How often the receiver thread wakes to notice ``close()``."""
SEND_RETRY_S = 0.05
"""Longest wait between two tries of a send whose queue is full."""
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
"""Default liveness timeout (``heartbeat_s`` overrides it). A heartbeat waits behind data already
queued on the connection, so it must exceed the time one chunk takes on the slowest link: a
4 MiB chunk needs 0.7 s at 50 Mbit/s but over 5 s below about 7 Mbit/s (bench/netem_heartbeat.py)."""
CONTROL_SEND_S = 1.0
"""Deadline for sending one control message (hello, abort, state request)."""
MAX_ABORTED_KEYS = 4096
"""How many exchange keys the abort and group-agreement records remember (oldest forgotten first)."""
MAX_PEER_ID = 2**31
MAX_GROUP = 1000
"""Most members one group-agreement message may list."""
_READY, _DECISION, _NOT_LEADING = 0, 1, 2
CONTROL_OPS = frozenset({"group", "abort"})
"""Ops sent on each peer pair's control connection. Hellos stay on the data connection: a peer's
``leave`` must arrive after its last data chunks, not overtake them."""
_LEAVING = -2
"""Join round of the hello a peer sends when it leaves gracefully."""
FAILED_GRACE_S = 0.5
"""A call waiting on a peer whose connection dropped waits this much longer for data already on its way."""
FAULT_ENV = "GOSSIPLOCO_FAULT"
"""Fault injection for tests: ``SIGNAL:KEY:CHUNK`` (``KILL:mix1/2:3``) makes this process send
itself SIGNAL just before it sends chunk CHUNK of exchange KEY, i.e. in the middle of a real
exchange. Unset in normal use."""
_FLOAT_BYTES = 4
_EMPTY = torch.empty(0, dtype=torch.float32)


def _op_and_round(key: str) -> tuple[str, int]:
    """Header ``op`` and ``round`` for ``key``: ``"mix1/12"`` gives ``("mix1", 12)``; unknown prefixes are "monitor"."""
    prefix, _, rest = key.partition("/")
    op = prefix if prefix in ("mix1", "mix2", "grad", "state", "hello") else "monitor"
    number = rest.split("/", 1)[0]
    return op, int(number) if number.isdigit() else 0


def _digest(members: Sequence[int]) -> int:
    """A short fingerprint of a member list (fits the int64 meta entry)."""
    return zlib.crc32(",".join(map(str, sorted(members))).encode())


def _chunk_hash(chunk: torch.Tensor) -> int:
    """A 64-bit BLAKE2b digest of a float32 chunk's bytes, as a signed int64 (state transfers verify every chunk)."""
    digest = hashlib.blake2b(chunk.contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _control_id(rank: int) -> bytes:
    """Routing id of ``rank``'s control connection (its data connection's is ``str(rank)``)."""
    return f"{rank}/control".encode()


def _remember(records: OrderedDict, key: str, value) -> None:
    """Set ``records[key]``, forgetting the oldest keys past ``MAX_ABORTED_KEYS``."""
    records[key] = value
    records.move_to_end(key)
    while len(records) > MAX_ABORTED_KEYS:
        records.popitem(last=False)


def _parse_fault(spec: str | None) -> tuple[int, str, int] | None:
    if not spec:
        return None
    try:
        name, key, chunk = spec.rsplit(":", 2)
        return int(getattr(signal, f"SIG{name.upper()}")), key, int(chunk)
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected SIGNAL:KEY:CHUNK, e.g. KILL:mix1/2:3") from exc


class _Mail:
    """One received message waiting for its taker."""

    __slots__ = ("meta", "data", "nbytes", "arrived")

    def __init__(self, meta: list[int], data: torch.Tensor, nbytes: int):
        self.meta, self.data, self.nbytes, self.arrived = meta, data, nbytes, time.monotonic()

    @property
    def total(self) -> int:
        return self.meta[0]

    @property
    def tag(self) -> int:
        return self.meta[1] if len(self.meta) > 1 else 0


StateProvider = Callable[[], "tuple[int, torch.Tensor] | None"]
"""Returns (round, flat fp32 state) to hand a catching-up peer, or None when there is none yet."""


class ZmqExchange(Exchange):
    """One peer's ``Exchange`` over ZeroMQ; the module docstring describes the protocol.

    ``endpoints[i]`` is peer i's address (``"tcp://127.0.0.1:5555"``); this peer binds
    ``endpoints[rank]`` and connects to all others at construction. ``timeout_s`` is the
    deadline of one whole call. Construction raises ``ExchangeError`` if the bind fails and
    ``ValueError`` for bad arguments. Every public method is thread-safe.
    """

    def __init__(self, rank: int, endpoints: Sequence[str] | Mapping[int, str], run_id: str, timeout_s: float,
                 max_message_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20, mailbox_bytes: int = 1 << 30,
                 grace_s: float = 10.0, deadlines: AdaptiveDeadlines | None = None, bind: str | None = None,
                 join_round: int | None = 0, heartbeat_s: float | None = None):
        endpoints = dict(enumerate(endpoints)) if not isinstance(endpoints, Mapping) else dict(endpoints)
        if rank not in endpoints:
            raise ValueError(f"rank {rank} has no endpoint among {sorted(endpoints)}")
        if any(not 0 <= p < MAX_PEER_ID for p in endpoints):
            raise ValueError(f"peer ids must be in 0..{MAX_PEER_ID - 1}, got {sorted(endpoints)}")
        if chunk_bytes < _FLOAT_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes} must hold at least one float32")
        if chunk_bytes + codec.MAX_HEADER_BYTES + 64 > max_message_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} plus a header does not fit max_message_bytes={max_message_bytes}")
        self.rank = rank
        self.endpoints = endpoints
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._heartbeat_ms = HEARTBEAT_TIMEOUT_MS if heartbeat_s is None else max(1, int(1000 * heartbeat_s))
        self.deadlines = deadlines or AdaptiveDeadlines(timeout_s)
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = chunk_bytes
        self.mailbox_bytes = mailbox_bytes
        self.bytes_sent = 0
        self.bytes_received = 0
        self.malformed_messages = 0
        self.dropped_messages = 0

        self._cond = threading.Condition()  # guards everything below plus the counters
        self._mail: dict[str, dict[tuple[int, int], _Mail]] = {}  # key -> (sender, chunk) -> message
        self._mail_bytes = 0
        self._active: dict[str, int] = {}  # keys with a call in progress -> number of calls
        self._began: dict[str, float] = {}  # keys with a call in progress -> when the first began
        self._failed: dict[int, float] = {}  # rank -> when its connection dropped (cleared on reconnect)
        self._lost_at: dict[int, float] = {}  # rank -> when its connection last dropped (kept)
        self._connected: set[int] = set()
        self._joined: dict[int, int] = dict.fromkeys(endpoints, 0)  # rank -> first round; absent: pending
        if join_round is None:  # this peer decides later (``announce``) when it takes part
            del self._joined[rank]
        else:
            self._joined[rank] = join_round
        self._reported: dict[int, int] = {}  # rank -> current round it reported in a hello reply
        self._leader_rounds: dict[int, int] = {}  # rank -> its round when it last answered our ready
        self._aborted: OrderedDict[str, set[int]] = OrderedDict()  # key -> peers that abandoned it
        self._ready: OrderedDict[str, set[int]] = OrderedDict()  # key -> followers ready (this peer leads)
        self._decided: OrderedDict[str, list[int]] = OrderedDict()  # key -> group this peer formed as leader
        self._told: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()  # key -> (leader, group) received
        self._closed = False
        self._close_lock = threading.Lock()
        self.current_round = -1
        """The round this peer is in (set by its runtime; -1 before the first); told to peers in hello replies."""
        self._state_provider: StateProvider | None = None
        self._tasks: queue.Queue = queue.Queue(maxsize=64)  # (kind, peer, key, meta) for the service thread
        self._fault = _parse_fault(os.environ.get(FAULT_ENV))

        self._ctx = zmq.Context(io_threads=1)
        self._sndhwm = max(8, min(1000, (256 << 20) // chunk_bytes))
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 1000)
        # No ROUTER_HANDOVER: a second connection claiming a connected peer's routing id is
        # ignored by zmq, so it cannot take over (or inject into) that peer's stream.
        # Frames far beyond any valid message make zmq drop the connection before buffering them;
        # a multi-frame message over max_message_bytes is caught (and counted) by the codec.
        self._router.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)  # drops a dead machine's stale connection
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_ms)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + codec.MAX_HEADER_BYTES)
        bind = bind or self.endpoints[rank]
        try:
            self._router.bind(bind)
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            self._ctx.term()
            raise ExchangeError(f"rank {rank}: cannot bind {bind}: {exc}") from exc
        advertised_host, _, advertised_port = self.endpoints[rank].rpartition(":")
        if advertised_port in ("0", "*"):  # the port the OS picked is the one peers must be told
            bound_port = self._router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
            self.endpoints[rank] = f"{advertised_host}:{bound_port}"

        self._dealers: dict[int, tuple[zmq.Socket, threading.Lock]] = {}
        self._controls: dict[int, tuple[zmq.Socket, threading.Lock]] = {}  # peer -> control DEALER (CONTROL_OPS)
        self._monitors: dict[zmq.Socket, int] = {}
        self._new_monitors: queue.SimpleQueue = queue.SimpleQueue()  # handed to the receiver thread
        for peer, endpoint in endpoints.items():
            if peer != rank:
                self._connect(peer, endpoint)

        self._receiver = threading.Thread(target=self._receive_loop, name=f"zmq-exchange-{rank}-recv", daemon=True)
        self._receiver.start()
        self._service = threading.Thread(target=self._service_loop, name=f"zmq-exchange-{rank}-service", daemon=True)
        self._service.start()

    # -- the Exchange interface ------------------------------------------------------------------

    def members(self, round_index: int | None = None) -> list[int]:
        last = math.inf if round_index is None else round_index
        with self._cond:
            if self._joined.get(self.rank, math.inf) > last:
                return [self.rank]  # not taking part in that round: mixes with nobody
            return [r for r, first in sorted(self._joined.items()) if first <= last and r not in self._failed]

    def swap(self, key: str, partner: int, flat: torch.Tensor) -> torch.Tensor:
        if partner == self.rank:
            raise ValueError("cannot swap with oneself")
        if partner not in self._dealers:
            raise ValueError(f"partner {partner} is not a known peer")
        began = time.monotonic()
        deadline = began + self.deadlines.deadline_s(key)
        mine = flat.detach().reshape(-1).to(torch.float32)
        total = mine.numel()
        per_chunk = self._chunk_elems()
        n_chunks = max(1, math.ceil(total / per_chunk))
        what = f"swap {key!r} with {partner}"
        self._begin(key, began)
        try:
            for c in range(n_chunks):
                self._send(partner, key, c, [total, 0], mine[c * per_chunk:(c + 1) * per_chunk], deadline, what)
            result = torch.empty(total, dtype=torch.float32)
            for c in range(n_chunks):
                part = result[c * per_chunk:(c + 1) * per_chunk]
                part.copy_(self._take_data(key, partner, c, total, part.numel(), [partner], deadline, what))
            self.deadlines.observe(key, time.monotonic() - began)
            return result.reshape(flat.shape)
        except (ExchangeTimeout, PeerFailed):
            self._abort(key, [partner])
            raise
        finally:
            self._end(key)

    def all_reduce_mean(self, key: str, flat: torch.Tensor, members: Sequence[int], *,
                        inplace: bool = False) -> torch.Tensor:
        """Mean of ``flat`` over ``members`` (see ``Exchange``). ``inplace=True`` (for a caller that
        hands over a contiguous fp32 CPU ``flat`` it no longer needs, such as Mix1's packed vector)
        reduces in ``flat``'s own memory and returns a view of it: no copy and no new buffer."""
        members = sorted(set(members))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not among members {members}")
        if any(m != self.rank and m not in self._dealers for m in members):
            raise ValueError(f"members {members} include unknown peers (known: {self.known()})")
        if inplace and flat.dtype == torch.float32 and flat.device.type == "cpu" and flat.is_contiguous():
            acc = flat.detach().view(-1)
        else:
            acc = torch.empty(flat.numel(), dtype=torch.float32)
            acc.copy_(flat.detach().reshape(-1))
        n = len(members)
        if n == 1:
            return acc.view(flat.shape)
        began = time.monotonic()
        deadline = began + self.deadlines.deadline_s(key)
        me = members.index(self.rank)
        right, left = members[(me + 1) % n], members[(me - 1) % n]
        others = [m for m in members if m != self.rank]
        total = acc.numel()
        bounds = [total * k // n for k in range(n + 1)]  # segment k is acc[bounds[k]:bounds[k + 1]]
        per_chunk = self._chunk_elems()
        cps = max(1, math.ceil(math.ceil(total / n) / per_chunk))  # chunks per segment
        what = f"all-reduce {key!r} over {members}"
        digest = _digest(members)  # every chunk carries it: a peer with another member list fails at once
        # Chunks go out zero-copy (zmq reads them from ``acc``): a segment is overwritten only
        # after zmq is done with the sends that read it, and ``acc`` is divided only at the end.
        in_flight: dict[int, list[zmq.MessageTracker]] = {k: [] for k in range(n)}

        def segment(k: int) -> torch.Tensor:
            k %= n
            return acc[bounds[k]:bounds[k + 1]]

        def step(s: int, send_seg: int, recv_seg: int, reduce: bool) -> None:
            out = segment(send_seg)
            for c in range(cps):
                in_flight[send_seg % n].append(self._send(
                    right, key, s * cps + c, [total, 0, digest], out[c * per_chunk:(c + 1) * per_chunk], deadline, what,
                    zero_copy=True))
            into = segment(recv_seg)
            if not reduce:
                self._wait_sent(in_flight[recv_seg % n], deadline, what)
            for c in range(cps):
                part = into[c * per_chunk:(c + 1) * per_chunk]
                got = self._take_data(key, left, s * cps + c, total, part.numel(), others, deadline, what, digest)
                if reduce:
                    part += got
                else:
                    part.copy_(got)

        self._begin(key, began)
        try:
            # Reduce-scatter: after n - 1 steps this peer holds the full sum of segment me + 1.
            for s in range(n - 1):
                step(s, me - s, me - s - 1, reduce=True)
            # All-gather: the reduced segments travel once round the ring, so every peer ends with
            # the same bits (each segment was summed by exactly one peer).
            for s in range(n - 1):
                step(n - 1 + s, me + 1 - s, me - s, reduce=False)
            for trackers in in_flight.values():
                self._wait_sent(trackers, deadline, what)
            self.deadlines.observe(key, time.monotonic() - began)
        except (ExchangeTimeout, PeerFailed):
            self._abort(key, others)
            raise
        finally:
            self._end(key)
        return acc.div_(n).view(flat.shape)

    def group(self, key: str, round_index: int) -> list[int]:
        """Agree with the others on who takes part in exchange ``key`` of round ``round_index``.

        The leader is the lowest id of this peer's view (``members(round_index)``). Followers
        send it ``ready``; it waits until every member of its view is ready or has failed, or
        until ``grace_s`` has passed, then sends the group (itself plus the ready followers) to
        each of them. Everyone in the group then runs the exchange over exactly that list; a
        straggler whose ``ready`` comes after the decision is told it was left out and does
        identity. A follower that hears nothing within ``2 * grace_s`` (the leader is the
        straggler, or died) abandons the key (``abort``), so a late leader fails fast instead of
        mixing with peers that are gone. Peers whose views name different leaders form disjoint
        groups (each consistent) or do identity: never a mixed-up exchange. Raises
        ``ExchangeError`` when this peer takes no part (identity for it)."""
        view = self.members(round_index)
        if view == [self.rank] and self._joined.get(self.rank, math.inf) > round_index:
            return view  # not taking part in this round yet
        if view[0] == self.rank:
            return self._lead(key, view)
        return self._follow(key, view[0], round_index)

    def _lead(self, key: str, view: list[int]) -> list[int]:
        deadline = time.monotonic() + self.grace_s
        with self._cond:
            while not self._closed:
                waiting = [p for p in view if p != self.rank and p not in self._failed
                           and p not in self._ready.get(key, ())]
                remaining = deadline - time.monotonic()
                if not waiting or remaining <= 0:
                    break
                self._cond.wait(remaining)
            if self._closed:
                raise ExchangeClosed(f"rank {self.rank}: exchange closed while forming group {key!r}")
            ready = self._ready.pop(key, set())
            group = sorted({self.rank} | {p for p in ready if p not in self._failed})
            _remember(self._decided, key, group)
        left_out = sorted(set(view) - set(group))
        if left_out:
            log.info("rank %d: %s goes on without %s (not ready within %.1fs)", self.rank, key, left_out, self.grace_s)
        meta = [_DECISION, self.current_round, _digest(group), *group]
        for peer in group:
            if peer != self.rank:
                self._submit(("group", peer, key, meta))
        return group

    def _follow(self, key: str, leader: int, round_index: int) -> list[int]:
        what = f"group {key!r} led by {leader}"
        began = time.monotonic()
        deadline = began + 2 * self.grace_s + CONTROL_SEND_S
        # No _begin/_end here: those would drop data chunks of ``key`` that fast members send
        # before this peer starts the exchange itself.
        try:
            self._send(leader, key, 0, [_READY, round_index], _EMPTY, began + CONTROL_SEND_S, what, op="group")
            with self._cond:
                while True:
                    if self._closed:
                        raise ExchangeClosed(f"rank {self.rank}: exchange closed during {what}")
                    told = self._told.pop(key, None)
                    if told is not None and told[0] == leader:
                        break
                    if leader in self._failed:
                        raise PeerFailed(f"{what}: the leader disconnected")
                    if leader in self._aborted.get(key, ()):
                        raise PeerFailed(f"{what}: the leader abandoned the exchange")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ExchangeTimeout(f"{what}: no decision within {deadline - began:.1f}s")
                    self._cond.wait(remaining)
        except (ExchangeTimeout, PeerFailed):
            self._abort(key, [leader])
            raise
        group = told[1]
        if not group:
            raise PeerFailed(f"{what}: peer {leader} does not lead it (our member views differ)")
        if self.rank not in group:
            raise ExchangeTimeout(f"{what}: this peer was not ready within the grace window; {group} went on without it")
        return group

    def close(self, linger_s: float = 0.0) -> None:
        """Stop: calls in progress and later raise ``ExchangeClosed``. ``linger_s > 0`` (a graceful
        leave) gives messages already sent that long to reach their peers. Idempotent."""
        with self._close_lock:
            with self._cond:
                if self._closed:
                    return
                self._closed = True
                self._cond.notify_all()
            self._receiver.join(timeout=10)
            self._service.join(timeout=10)
            if self._receiver.is_alive() or self._service.is_alive():
                log.error("rank %d: exchange threads did not stop; leaking their sockets", self.rank)
                return
            monitors = {peer: monitor for monitor, peer in self._monitors.items()}
            for peer, (dealer, lock) in self._dealers.items():
                with lock:  # senders notice _closed within SEND_RETRY_S and release it
                    # Stop the monitor while its reader is still open: libzmq's "monitor stopped"
                    # event is a blocking send that would hang on a closed reader.
                    try:
                        dealer.disable_monitor()
                    except zmq.ZMQError:
                        pass
                    monitors[peer].close(linger=0)
                    dealer.close(linger=int(1000 * linger_s))
            for control, lock in self._controls.values():
                with lock:
                    control.close(linger=int(1000 * linger_s))
            self._ctx.term()

    # -- extras ------------------------------------------------------------------------------------

    def add_peer(self, peer: int, endpoint: str) -> bool:
        """Connect to ``peer`` at ``endpoint`` (a peer found by discovery). It stays pending until it
        says hello; once connected, this peer asks it (a probe, sent on every handshake with a pending
        peer), so its join round arrives without waiting for its own announcement. A known peer at a new endpoint (it restarted elsewhere) is reconnected.
        Returns True if anything changed."""
        if peer == self.rank or not 0 <= peer < MAX_PEER_ID:
            return False
        with self._cond:
            if self._closed:
                return False
            old = self.endpoints.get(peer)
            if old == endpoint:
                return False
            self.endpoints[peer] = endpoint
            if old is None:
                self._connect(peer, endpoint)
        if old is not None:
            for sockets in (self._dealers, self._controls):
                sock, lock = sockets[peer]
                with lock:
                    try:
                        sock.disconnect(old)
                    except zmq.ZMQError:
                        pass
                    sock.connect(endpoint)
            log.info("rank %d: peer %d moved from %s to %s", self.rank, peer, old, endpoint)
        return True

    def leave(self, linger_s: float = 0.5) -> None:
        """Leave gracefully: tell every peer (they drop this one at once instead of waiting for a
        deadline or a heartbeat), then ``close``. Best effort, bounded by ``CONTROL_SEND_S`` per peer."""
        with self._cond:
            peers = [] if self._closed else sorted(self._connected)  # nothing to tell the unreachable
        for peer in peers:
            try:
                self._send(peer, "hello/leave", 0, [_LEAVING, self.current_round, 0], _EMPTY,
                           time.monotonic() + CONTROL_SEND_S, "leave")
            except ExchangeError:
                pass
        self.close(linger_s=linger_s)

    def check_reachable(self, timeout_s: float) -> bool:
        """True if a ZeroMQ handshake with this peer's own advertised endpoint succeeds within
        ``timeout_s`` (what another peer does first). A failure means the address or port is wrong
        or closed here; success does not prove that peers behind other networks can reach it."""
        probe = self._ctx.socket(zmq.DEALER)
        monitor = probe.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            probe.setsockopt(zmq.LINGER, 0)
            probe.setsockopt(zmq.ROUTING_ID, f"probe-{uuid.uuid4().hex[:8]}".encode())
            probe.connect(self.endpoints[self.rank])
            return bool(monitor.poll(int(1000 * timeout_s)))
        finally:
            probe.disable_monitor()
            monitor.close(linger=0)
            probe.close(linger=0)

    def known(self) -> list[int]:
        """Every peer this exchange has an endpoint for (including itself)."""
        with self._cond:
            return sorted(self.endpoints)

    def _connect(self, peer: int, endpoint: str) -> None:
        """A DEALER to ``peer`` plus its monitor (handed to the receiver thread). Holds ``_cond`` or runs in __init__."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, self._sndhwm)
        dealer.setsockopt(zmq.ROUTING_ID, str(self.rank).encode())
        dealer.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_ms)
        # "Connected" means the ZMTP handshake succeeded: a frozen process's kernel still accepts
        # TCP connections, but only a live peer completes the handshake.
        monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        monitor.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        self._dealers[peer] = (dealer, threading.Lock())
        self._monitors[monitor] = peer
        self._new_monitors.put(monitor)
        # Group agreement and aborts travel on a connection of their own, so they never wait behind
        # megabytes of another exchange's chunks queued on the data connection (head-of-line blocking).
        control = self._ctx.socket(zmq.DEALER)
        control.setsockopt(zmq.LINGER, 0)
        control.setsockopt(zmq.ROUTING_ID, _control_id(self.rank))
        control.connect(endpoint)
        self._controls[peer] = (control, threading.Lock())

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a connection to every other peer is up (or ``timeout_s``); True if all are."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._connected) < len(self._dealers) and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return len(self._connected) == len(self._dealers)

    def wait_members(self, round_index: int, count: int, timeout_s: float) -> list[int]:
        """Block until ``members(round_index)`` has ``count`` peers (or ``timeout_s``); returns it."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.members(round_index)) < count and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self.members(round_index)

    def connected(self) -> list[int]:
        """Other peers with a live connection right now."""
        with self._cond:
            return sorted(self._connected)

    def pending(self) -> list[int]:
        """Connected peers outside the group: they came back and have not said hello yet."""
        with self._cond:
            return sorted(p for p in self._connected if p not in self._joined)

    def drop_unconnected(self) -> list[int]:
        """Move peers that never connected to pending (they join with a hello when they come). Returns them."""
        with self._cond:
            gone = [p for p in self._dealers if p not in self._connected and p in self._joined]
            for p in gone:
                del self._joined[p]
            return gone

    def announce(self, join_round: int, ask_reply: bool = True) -> None:
        """Take part in exchanges from round ``join_round`` on, and tell every other peer so
        (best effort: a peer that misses it keeps this peer pending or as it was).
        ``join_round = -1`` is a probe: it changes no membership and only asks for replies."""
        with self._cond:
            if join_round >= 0:
                self._joined[self.rank] = join_round
            self._reported.clear()
            peers = list(self._dealers)
        for peer in peers:
            self._submit(("hello", peer, join_round, int(ask_reply)))

    def peer_rounds(self, wait_s: float, peers: Sequence[int] | None = None) -> dict[int, int]:
        """Current rounds other peers reported in replies to this peer's last ``announce``; waits
        up to ``wait_s`` for a reply from each of ``peers`` (default: the connected ones)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            want = set(self._connected if peers is None else peers)
            while not want <= self._reported.keys() and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return dict(self._reported)

    def leader_rounds(self) -> dict[int, int]:
        """The round each group leader was in when it last answered this peer's ``ready`` (not waited for)."""
        with self._cond:
            return dict(self._leader_rounds)

    def recently_lost(self, within_s: float) -> list[int]:
        """Peers whose connection dropped within the last ``within_s`` seconds."""
        with self._cond:
            now = time.monotonic()
            return sorted(p for p, t in self._lost_at.items() if now - t <= within_s)

    def serve_state(self, provider: StateProvider) -> None:
        """Answer other peers' ``fetch_state`` with ``provider()`` (called on the service thread)."""
        self._state_provider = provider

    def fetch_state(self, peer: int) -> tuple[int, torch.Tensor]:
        """Download ``(round, flat state)`` from ``peer``'s provider within the exchange deadline.
        Raises ``ExchangeError``."""
        deadline = time.monotonic() + self.timeout_s
        nonce = uuid.uuid4().hex[:16]
        key = f"state/rep/{nonce}"
        what = f"state download from {peer}"
        self._begin(key)
        try:
            self._send(peer, f"state/req/{nonce}", 0, [0, 0], _EMPTY, deadline, what)
            first = self._take(key, peer, 0, [peer], deadline, what)
            if first.tag < 0:
                raise PeerFailed(f"{what}: peer {peer} has no state to give yet")
            total, round_index = first.total, first.tag
            if total < 0:
                raise PeerFailed(f"{what}: invalid total {total}")
            per_chunk = self._chunk_elems()
            n_chunks = max(1, math.ceil(total / per_chunk))
            result = torch.empty(total, dtype=torch.float32)
            got = first
            for c in range(n_chunks):
                if c:
                    got = self._take(key, peer, c, [peer], deadline, what)
                part = result[c * per_chunk:(c + 1) * per_chunk]
                if got.total != total or got.data.numel() != part.numel():
                    raise PeerFailed(f"{what}: chunk {c} has {got.data.numel()} elements, expected {part.numel()}")
                if len(got.meta) < 3 or got.meta[2] != _chunk_hash(got.data):
                    raise PeerFailed(f"{what}: chunk {c} failed its hash check")
                part.copy_(got.data)
            return round_index, result
        finally:
            self._end(key)

    # -- sending -----------------------------------------------------------------------------------

    def _chunk_elems(self) -> int:
        return max(1, self.chunk_bytes // _FLOAT_BYTES)

    def _send(self, peer: int, key: str, chunk: int, meta: list[int], data: torch.Tensor, deadline: float, what: str,
              op: str | None = None, zero_copy: bool = False) -> zmq.MessageTracker | None:
        """Queue one message for ``peer``. By default zmq copies ``data``; with ``zero_copy`` it reads
        ``data`` in place until the returned tracker is done, so the caller must not change
        ``data`` before then (``_wait_sent``)."""
        if self._fault is not None and op is None and self._fault[1:] == (key, chunk):
            log.warning("rank %d: %s: raising signal %d before chunk %d of %r", self.rank, FAULT_ENV, self._fault[0], chunk, key)
            os.kill(os.getpid(), self._fault[0])
        derived, round_index = _op_and_round(key)
        header = codec.Header(run=self.run_id, round=round_index, op=op or derived, chunk=chunk, sender=self.rank, key=key)
        frames = codec.encode(header, [torch.tensor(meta, dtype=torch.int64), data])
        dealer, lock = (self._controls if op in CONTROL_OPS else self._dealers)[peer]
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ExchangeTimeout(f"{what}: the connection to {peer} stayed busy past the deadline")
        try:
            while True:
                if self._closed:
                    raise ExchangeClosed(f"rank {self.rank}: exchange closed during {what}")
                try:
                    # copy=True: zmq owns a copy, so the caller may change ``data`` right after.
                    tracker = dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=not zero_copy, track=zero_copy)
                    break
                except zmq.Again:
                    pass
                except zmq.ZMQError as exc:
                    raise PeerFailed(f"{what}: sending to {peer} failed: {exc}") from exc
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ExchangeTimeout(f"{what}: peer {peer} did not take data by the deadline")
                dealer.poll(max(1, int(1000 * min(remaining, SEND_RETRY_S))), zmq.POLLOUT)
        finally:
            lock.release()
        with self._cond:
            self.bytes_sent += data.numel() * _FLOAT_BYTES
        return tracker

    def _wait_sent(self, trackers: list[zmq.MessageTracker], deadline: float, what: str) -> None:
        """Block until zmq has released the buffers of zero-copy sends ``trackers`` (then forget them)."""
        for tracker in trackers:
            if tracker is None or tracker.done:
                continue
            try:
                tracker.wait(max(0.001, deadline - time.monotonic()))
            except zmq.NotDone:
                raise ExchangeTimeout(f"{what}: sent data still queued at the deadline") from None
        trackers.clear()

    def _abort(self, key: str, peers: Sequence[int]) -> None:
        """Tell ``peers`` this peer abandoned ``key`` (best effort, from the service thread)."""
        for peer in peers:
            if peer != self.rank:
                self._submit(("abort", peer, key, 0))

    def _submit(self, task: tuple) -> None:
        try:
            self._tasks.put_nowait(task)
        except queue.Full:
            log.warning("rank %d: service queue full; dropped a %s for %d", self.rank, task[0], task[1])

    def _service_loop(self) -> None:
        """Sends control messages and serves state requests, so the receiver thread never sends."""
        while not self._closed:
            try:
                kind, peer, arg, flag = self._tasks.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                continue
            deadline = time.monotonic() + CONTROL_SEND_S
            try:
                if kind == "hello":
                    self._send(peer, f"hello/{arg}", 0, [arg, self.current_round, flag], _EMPTY, deadline, "hello")
                elif kind == "abort":
                    self._send(peer, arg, 0, [0, 0], _EMPTY, deadline, "abort", op="abort")
                elif kind == "group":
                    self._send(peer, arg, 0, flag, _EMPTY, deadline, f"group {arg!r}", op="group")
                elif kind == "state":
                    self._serve_state(peer, arg)
            except ExchangeClosed:
                return
            except ExchangeError as exc:
                log.info("rank %d: %s to %d not sent: %s", self.rank, kind, peer, exc)
            except Exception:  # noqa: BLE001 - a provider bug must not kill the service thread
                log.exception("rank %d: serving %s to %d failed", self.rank, kind, peer)

    def _serve_state(self, peer: int, nonce: str) -> None:
        key = f"state/rep/{nonce}"
        deadline = time.monotonic() + self.timeout_s
        what = f"state upload to {peer}"
        provider = self._state_provider
        state = provider() if provider is not None else None
        if state is None:
            self._send(peer, key, 0, [0, -1], _EMPTY, deadline, what)
            return
        round_index, flat = state
        flat = flat.detach().reshape(-1).to(torch.float32)
        total, per_chunk = flat.numel(), self._chunk_elems()
        for c in range(max(1, math.ceil(total / per_chunk))):
            part = flat[c * per_chunk:(c + 1) * per_chunk]
            self._send(peer, key, c, [total, round_index, _chunk_hash(part)], part, deadline, what)
        log.info("rank %d: gave round %d state (%d values) to peer %d", self.rank, round_index, total, peer)

    # -- receiving ---------------------------------------------------------------------------------

    def _begin(self, key: str, began: float | None = None) -> None:
        """Register a call of ``key`` that started at ``began`` (now by default)."""
        with self._cond:
            if self._closed:
                raise ExchangeClosed(f"rank {self.rank}: exchange is closed")
            self._active[key] = self._active.get(key, 0) + 1
            self._began.setdefault(key, time.monotonic() if began is None else began)

    def _end(self, key: str) -> None:
        """Forget the call: drop its leftovers (a failed call's late chunks are useless)."""
        with self._cond:
            self._active[key] -= 1
            if self._active[key] == 0:
                del self._active[key]
                self._began.pop(key, None)
                for mail in self._mail.pop(key, {}).values():
                    self._mail_bytes -= mail.nbytes

    def _take_data(self, key: str, sender: int, chunk: int, total: int, numel: int, watch: Sequence[int],
                   deadline: float, what: str, digest: int | None = None) -> torch.Tensor:
        """``_take`` a data chunk and check it carries ``numel`` of ``total`` elements (and, for a
        ring, the digest of the same member list)."""
        mail = self._take(key, sender, chunk, watch, deadline, what)
        if digest is not None and (len(mail.meta) < 3 or mail.meta[2] != digest):
            raise PeerFailed(f"{what}: peer {sender} runs this all-reduce over another member list")
        if mail.total != total or mail.data.numel() != numel:
            raise PeerFailed(f"{what}: peer {sender} sent chunk {chunk} of {mail.data.numel()} elements "
                             f"(of {mail.total}); expected {numel} (of {total})")
        return mail.data

    def _take(self, key: str, sender: int, chunk: int, watch: Sequence[int], deadline: float, what: str) -> _Mail:
        """Wait for message ``(key, sender, chunk)`` while ``sender`` kept its connection since the
        call began (a lost connection counts after ``FAILED_GRACE_S``: its last data may still be
        arriving; a reconnection does not help, data in flight was lost) and no peer of ``watch``
        abandoned ``key``. A peer that crashes is seen by the peer waiting on it, whose abort then
        releases everyone else."""
        with self._cond:
            began = self._began.get(key, deadline - self.timeout_s)
            while True:
                if self._closed:
                    raise ExchangeClosed(f"rank {self.rank}: exchange closed during {what}")
                box = self._mail.get(key)
                mail = box.pop((sender, chunk), None) if box else None
                if mail is not None:
                    self._mail_bytes -= mail.nbytes
                    break
                now = time.monotonic()
                lost = self._lost_at.get(sender)
                if lost is not None and lost < began:  # lost before this call: counts only if still gone
                    lost = began if sender in self._failed else None
                if lost is not None and now >= lost + FAILED_GRACE_S:
                    raise PeerFailed(f"{what}: peer {sender} disconnected")
                quit_ = sorted(p for p in watch if p in self._aborted.get(key, ()))
                if quit_:
                    raise PeerFailed(f"{what}: peer(s) {quit_} abandoned the exchange")
                remaining = deadline - now
                if remaining <= 0:
                    raise ExchangeTimeout(f"{what}: no chunk {chunk} from {sender} within {deadline - began:.1f}s")
                self._cond.wait(min(remaining, lost + FAILED_GRACE_S - now) if lost is not None else remaining)
            self.bytes_received += mail.nbytes
        return mail

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        try:
            while not self._closed:
                while not self._new_monitors.empty():  # peers added since the last poll
                    poller.register(self._new_monitors.get(), zmq.POLLIN)
                for sock, _ in poller.poll(POLL_MS):
                    if sock is self._router:
                        self._drain_router()
                    else:
                        self._drain_monitor(sock)
        except Exception:  # noqa: BLE001 - a dying receiver must be logged; callers then time out
            log.exception("rank %d: receiver thread failed", self.rank)
        finally:
            self._router.close(linger=0)  # the monitors are closed by close(), after their dealers stop them

    def _drain_router(self) -> None:
        for _ in range(1000):  # bounded, so close() and the monitors are not starved
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._file(frames)
            except MalformedMessage as exc:
                with self._cond:
                    self.malformed_messages += 1
                log.warning("rank %d: dropped a malformed message: %s", self.rank, exc)

    def _file(self, frames: list) -> None:
        """Validate one ROUTER message (routing id + codec frames) and put it in the mailbox."""
        if len(frames) < 2:
            raise MalformedMessage("no codec frames after the routing id")
        identity = frames[0].bytes
        # copy=False: the chunk is a view of the zmq frame (which it keeps alive), not a copy.
        header, tensors = codec.decode(frames[1:], expect_run=self.run_id, max_bytes=self.max_message_bytes, copy=False)
        expected = _control_id(header.sender) if header.op in CONTROL_OPS else str(header.sender).encode()
        if identity != expected:
            raise MalformedMessage(f"sender {header.sender} arrived on connection {identity[:32]!r}")
        if header.sender not in self._dealers:
            if header.op == "hello":  # a peer of this run that discovery has not found yet; it is probed once found
                log.debug("rank %d: hello from peer %d, not discovered yet; ignored", self.rank, header.sender)
                return
            raise MalformedMessage(f"sender {header.sender} is not a known peer (not discovered yet, or not of this run)")
        max_meta = 3 + MAX_GROUP if header.op == "group" else 4
        if (len(tensors) != 2 or tensors[0].dtype != torch.int64 or tensors[0].dim() != 1
                or not 1 <= tensors[0].numel() <= max_meta or tensors[1].dtype != torch.float32 or tensors[1].dim() != 1):
            raise MalformedMessage(f"expected an int64 meta vector (1 to {max_meta} entries) and a 1-d float32 chunk")
        meta = [int(v) for v in tensors[0].tolist()]
        if header.op in ("hello", "abort", "group") or header.key.startswith("state/req/"):
            self._control(header, meta)
            return
        mail = _Mail(meta, tensors[1], tensors[1].numel() * _FLOAT_BYTES)
        with self._cond:
            if self._mail_bytes + mail.nbytes > self.mailbox_bytes:
                self._evict(mail.nbytes)
            if self._mail_bytes + mail.nbytes > self.mailbox_bytes:
                self.dropped_messages += 1
                log.warning("rank %d: mailbox full (%d bytes); dropped chunk %d of %r from %d",
                            self.rank, self._mail_bytes, header.chunk, header.key, header.sender)
                return
            box = self._mail.setdefault(header.key, {})
            old = box.pop((header.sender, header.chunk), None)
            if old is not None:
                self._mail_bytes -= old.nbytes
            box[(header.sender, header.chunk)] = mail
            self._mail_bytes += mail.nbytes
            self._cond.notify_all()

    def _control(self, header: codec.Header, meta: list[int]) -> None:
        """A hello, abort or state request (validated by the caller). Runs on the receiver thread."""
        sender = header.sender
        if header.op == "group":
            self._group_message(header, meta)
        elif header.op == "abort":
            with self._cond:
                _remember(self._aborted, header.key, self._aborted.get(header.key, set()) | {sender})
                self._cond.notify_all()
        elif header.op == "hello":
            if len(meta) != 3 or meta[0] < _LEAVING:
                raise MalformedMessage(f"hello needs [join round >= {_LEAVING}, current round, ask reply], got {meta}")
            join_round, current, ask_reply = meta
            with self._cond:
                if join_round == _LEAVING:  # a graceful leave: gone now, as if its connection dropped
                    self._joined.pop(sender, None)
                    self._failed[sender] = self._lost_at[sender] = time.monotonic()
                    log.warning("rank %d: peer %d left", self.rank, sender)
                elif join_round >= 0:
                    self._joined[sender] = join_round
                if join_round != _LEAVING:  # a probe tells the sender's round as well as a reply does
                    self._reported[sender] = current
                self._cond.notify_all()
            if join_round >= 0:
                log.info("rank %d: peer %d takes part from round %d (it is in round %d)", self.rank, sender, join_round, current)
            if ask_reply:
                self._submit(("hello", sender, self._joined.get(self.rank, -1), 0))
        else:
            self._submit(("state", sender, header.key.removeprefix("state/req/"), 0))

    def _group_message(self, header: codec.Header, meta: list[int]) -> None:
        """A follower's ``ready`` (this peer leads, or answers that it does not; a peer still starting
        up, which has not decided its join round, keeps it: it is about to lead) or a leader's decision."""
        sender, key, phase = header.sender, header.key, meta[0]
        if phase == _READY:
            if len(meta) != 2:
                raise MalformedMessage(f"group ready needs [0, round], got {meta}")
            with self._cond:
                if sender not in self._joined and sender in self._connected:
                    # It believes it takes part but its hello never reached us (it froze, came back
                    # and kept its view): adopt it from the next round rather than leave it out forever.
                    self._joined[sender] = meta[1] + 1
                    log.warning("rank %d: peer %d is back (ready for %r); it takes part from round %d",
                                self.rank, sender, key, meta[1] + 1)
                decided = self._decided.get(key)
                if decided is None:
                    own = self._joined.get(self.rank)  # None: this peer has not decided yet (starting up)
                    if own is not None and (self.members(meta[1])[0] != self.rank or own > meta[1]):
                        reply = [_NOT_LEADING, self.current_round]
                    else:
                        _remember(self._ready, key, self._ready.get(key, set()) | {sender})
                        self._cond.notify_all()
                        return
                else:  # a straggler: the group went on without it
                    reply = [_DECISION, self.current_round, _digest(decided), *decided]
            self._submit(("group", sender, key, reply))
        elif phase in (_DECISION, _NOT_LEADING):
            group = meta[3:] if phase == _DECISION else []
            if phase == _DECISION and (len(meta) < 4 or meta[2] != _digest(group) or len(set(group)) != len(group)):
                raise MalformedMessage(f"group decision with a bad member list or digest: {meta[:8]}")
            if len(meta) < 2:
                raise MalformedMessage(f"group reply without the leader's round: {meta}")
            with self._cond:
                self._leader_rounds[sender] = meta[1]  # how far the leader is: a peer left behind learns it here
                _remember(self._told, key, (sender, sorted(group)))
                self._cond.notify_all()
        else:
            raise MalformedMessage(f"unknown group phase {phase}")

    def _evict(self, needed: int) -> None:
        """Drop whole keys nobody waits for, oldest first, until ``needed`` bytes fit. Holds ``_cond``."""
        idle = sorted((k for k in self._mail if k not in self._active),
                      key=lambda k: min((m.arrived for m in self._mail[k].values()), default=0.0))
        for key in idle:
            if self._mail_bytes + needed <= self.mailbox_bytes:
                return
            box = self._mail.pop(key)
            self._mail_bytes -= sum(m.nbytes for m in box.values())
            self.dropped_messages += len(box)
            log.warning("rank %d: mailbox full; evicted %d unclaimed chunk(s) of %r", self.rank, len(box), key)

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        peer = self._monitors[monitor]
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._cond:
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._connected.add(peer)
                    self._failed.pop(peer, None)
                    if peer not in self._joined:
                        # A new or returning peer: ask where it stands (its reply carries its join
                        # round). Asked here, once the connection is up, so the question is not
                        # lost in a reconnection, which left views disagreeing for good.
                        self._submit(("hello", peer, -1, 1))
                elif event["event"] == zmq.EVENT_DISCONNECTED and peer in self._connected:
                    self._connected.discard(peer)
                    self._failed[peer] = self._lost_at[peer] = time.monotonic()
                    self._joined.pop(peer, None)  # back only after a hello
                    log.warning("rank %d: lost the connection to peer %d", self.rank, peer)
                self._cond.notify_all()
