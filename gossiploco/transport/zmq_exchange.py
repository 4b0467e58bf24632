"""``Exchange`` over ZeroMQ for a static peer list (the only module that imports zmq).

Topology: peer ``i`` binds one ROUTER socket at ``endpoints[i]`` and connects one DEALER to every
other peer's ROUTER (routing id ``str(i)``). Sending goes out on the DEALER to the destination;
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

Every message carries two tensors: an int64 ``meta`` vector (1 to 4 entries; for data chunks
``[total elements, tag]``, so a size mismatch is detected and raised as ``PeerFailed``) and a
float32 chunk. ``bytes_sent``/``bytes_received`` count the float32 chunk bytes only.

Membership (a static peer list, made dynamic by ``hello`` messages): ``members(r)`` is the set
of peers taking part in round r's exchanges. At construction every peer of the list takes part
from round 0. A peer whose connection drops leaves the group and, when it comes back, stays
*pending* until it says ``hello``: "I take part from round J on" (``announce``). A hello may ask
for a reply; the reply carries the replier's own join round and ``current_round`` (the round it
is in, -1 before the first), so a starting peer learns whether the swarm is already past round 0
(``peer_rounds``) and must catch up by downloading state (``fetch_state`` from a peer that
``serve_state``s; served by a service thread, never the receiver).

Failing fast: when a call fails on this peer (deadline, lost peer, bad data), it sends ``abort``
for that key to the call's other participants, so they fail at once instead of waiting out their
deadline for chunks that will never come.

Failure detection: a monitor on each DEALER reports ZMTP handshakes and disconnects. A peer whose
connection dropped after having been up (its process exited or crashed; ZMTP heartbeats catch a
frozen process or a silent machine within ``HEARTBEAT_TIMEOUT_MS``) is marked failed: it leaves
``members()``, and a call waiting for data from it raises ``PeerFailed`` after
``FAILED_GRACE_S`` (data it sent before dying may still be arriving). When it comes back it is
pending until it says hello. A peer that never connected, or that stays connected but silent,
makes calls raise ``ExchangeTimeout`` at their deadline (``timeout_s`` for the whole call).

Known limits: a message rejected by the codec (including a payload holding NaN or Inf) is
dropped, so the waiting call times out (it cannot know which call the message belonged to); its
own abort then releases the other participants. Messages that arrive before
anyone waits for them are kept up to ``mailbox_bytes``; past that, entries of keys nobody is
waiting on are evicted oldest first, then incoming messages are dropped (logged, counted in
``dropped_messages``).
"""

from __future__ import annotations

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
from collections.abc import Callable, Sequence

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from gossiploco.errors import ExchangeClosed, ExchangeError, ExchangeTimeout, MalformedMessage, PeerFailed
from gossiploco.mixing.exchange import Exchange
from gossiploco.transport import codec

log = logging.getLogger(__name__)

POLL_MS = 100
"""How often the receiver thread wakes to notice ``close()``."""
SEND_RETRY_S = 0.05
"""Longest wait between two tries of a send whose queue is full."""
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
CONTROL_SEND_S = 1.0
"""Deadline for sending one control message (hello, abort, state request)."""
MAX_ABORTED_KEYS = 4096
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

    def __init__(self, rank: int, endpoints: Sequence[str], run_id: str, timeout_s: float,
                 max_message_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20, mailbox_bytes: int = 1 << 30):
        if not 0 <= rank < len(endpoints):
            raise ValueError(f"rank {rank} outside the {len(endpoints)} endpoints")
        if chunk_bytes < _FLOAT_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes} must hold at least one float32")
        if chunk_bytes + codec.MAX_HEADER_BYTES + 64 > max_message_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} plus a header does not fit max_message_bytes={max_message_bytes}")
        self.rank = rank
        self.endpoints = list(endpoints)
        self.world = len(endpoints)
        self.run_id = run_id
        self.timeout_s = timeout_s
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
        self._failed: dict[int, float] = {}  # rank -> when its connection dropped (cleared on reconnect)
        self._lost_at: dict[int, float] = {}  # rank -> when its connection last dropped (kept)
        self._connected: set[int] = set()
        self._joined: dict[int, int] = {p: 0 for p in range(self.world)}  # rank -> first round; absent: pending
        self._reported: dict[int, int] = {}  # rank -> current round it reported in a hello reply
        self._aborted: OrderedDict[str, set[int]] = OrderedDict()  # key -> peers that abandoned it
        self._closed = False
        self._close_lock = threading.Lock()
        self.current_round = -1
        """The round this peer is in (set by its runtime; -1 before the first); told to peers in hello replies."""
        self._state_provider: StateProvider | None = None
        self._tasks: queue.Queue = queue.Queue(maxsize=64)  # (kind, peer, key, meta) for the service thread
        self._fault = _parse_fault(os.environ.get(FAULT_ENV))

        self._ctx = zmq.Context(io_threads=1)
        sndhwm = max(8, min(1000, (256 << 20) // chunk_bytes))
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 1000)
        # No ROUTER_HANDOVER: a second connection claiming a connected peer's routing id is
        # ignored by zmq, so it cannot take over (or inject into) that peer's stream.
        # Frames far beyond any valid message make zmq drop the connection before buffering them;
        # a multi-frame message over max_message_bytes is caught (and counted) by the codec.
        self._router.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)  # drops a dead machine's stale connection
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + codec.MAX_HEADER_BYTES)
        try:
            self._router.bind(self.endpoints[rank])
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            self._ctx.term()
            raise ExchangeError(f"rank {rank}: cannot bind {self.endpoints[rank]}: {exc}") from exc

        self._dealers: dict[int, tuple[zmq.Socket, threading.Lock]] = {}
        self._monitors: dict[zmq.Socket, int] = {}
        for peer in range(self.world):
            if peer == rank:
                continue
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, sndhwm)
            dealer.setsockopt(zmq.ROUTING_ID, str(rank).encode())
            dealer.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            # "Connected" means the ZMTP handshake succeeded: a frozen process's kernel still accepts
            # TCP connections, but only a live peer completes the handshake.
            monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            monitor.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.endpoints[peer])
            self._dealers[peer] = (dealer, threading.Lock())
            self._monitors[monitor] = peer

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
        if not 0 <= partner < self.world:
            raise ValueError(f"partner {partner} outside world of {self.world}")
        deadline = time.monotonic() + self.timeout_s
        mine = flat.detach().reshape(-1).to(torch.float32)
        total = mine.numel()
        per_chunk = self._chunk_elems()
        n_chunks = max(1, math.ceil(total / per_chunk))
        what = f"swap {key!r} with {partner}"
        self._begin(key)
        try:
            for c in range(n_chunks):
                self._send(partner, key, c, [total, 0], mine[c * per_chunk:(c + 1) * per_chunk], deadline, what)
            result = torch.empty(total, dtype=torch.float32)
            for c in range(n_chunks):
                part = result[c * per_chunk:(c + 1) * per_chunk]
                part.copy_(self._take_data(key, partner, c, total, part.numel(), [partner], deadline, what))
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
        if not all(0 <= m < self.world for m in members):
            raise ValueError(f"members {members} outside world of {self.world}")
        if inplace and flat.dtype == torch.float32 and flat.device.type == "cpu" and flat.is_contiguous():
            acc = flat.detach().view(-1)
        else:
            acc = torch.empty(flat.numel(), dtype=torch.float32)
            acc.copy_(flat.detach().reshape(-1))
        n = len(members)
        if n == 1:
            return acc.view(flat.shape)
        deadline = time.monotonic() + self.timeout_s
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

        self._begin(key)
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
        except (ExchangeTimeout, PeerFailed):
            self._abort(key, others)
            raise
        finally:
            self._end(key)
        return acc.div_(n).view(flat.shape)

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
            self._ctx.term()

    # -- extras ------------------------------------------------------------------------------------

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a connection to every other peer is up (or ``timeout_s``); True if all are."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._connected) < self.world - 1 and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return len(self._connected) == self.world - 1

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
            gone = [p for p in range(self.world) if p != self.rank and p not in self._connected and p in self._joined]
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
        for peer in range(self.world):
            if peer != self.rank:
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
        if self._fault is not None and self._fault[1:] == (key, chunk):
            log.warning("rank %d: %s: raising signal %d before chunk %d of %r", self.rank, FAULT_ENV, self._fault[0], chunk, key)
            os.kill(os.getpid(), self._fault[0])
        derived, round_index = _op_and_round(key)
        header = codec.Header(run=self.run_id, round=round_index, op=op or derived, chunk=chunk, sender=self.rank, key=key)
        frames = codec.encode(header, [torch.tensor(meta, dtype=torch.int64), data])
        dealer, lock = self._dealers[peer]
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
                    raise ExchangeTimeout(f"{what}: peer {peer} did not take data within {self.timeout_s:.1f}s")
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
                raise ExchangeTimeout(f"{what}: sent data still queued after {self.timeout_s:.1f}s") from None
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
            self._send(peer, key, c, [total, round_index], flat[c * per_chunk:(c + 1) * per_chunk], deadline, what)
        log.info("rank %d: gave round %d state (%d values) to peer %d", self.rank, round_index, total, peer)

    # -- receiving ---------------------------------------------------------------------------------

    def _begin(self, key: str) -> None:
        with self._cond:
            if self._closed:
                raise ExchangeClosed(f"rank {self.rank}: exchange is closed")
            self._active[key] = self._active.get(key, 0) + 1

    def _end(self, key: str) -> None:
        """Forget the call: drop its leftovers (a failed call's late chunks are useless)."""
        with self._cond:
            self._active[key] -= 1
            if self._active[key] == 0:
                del self._active[key]
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
        began = deadline - self.timeout_s
        with self._cond:
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
                if lost is not None and lost < began:
                    lost = None
                if lost is not None and now >= lost + FAILED_GRACE_S:
                    raise PeerFailed(f"{what}: peer {sender} disconnected")
                quit_ = sorted(p for p in watch if p in self._aborted.get(key, ()))
                if quit_:
                    raise PeerFailed(f"{what}: peer(s) {quit_} abandoned the exchange")
                remaining = deadline - now
                if remaining <= 0:
                    raise ExchangeTimeout(f"{what}: no chunk {chunk} from {sender} within {self.timeout_s:.1f}s")
                self._cond.wait(min(remaining, lost + FAILED_GRACE_S - now) if lost is not None else remaining)
            self.bytes_received += mail.nbytes
        return mail

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        try:
            while not self._closed:
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
        if identity != str(header.sender).encode():
            raise MalformedMessage(f"sender {header.sender} arrived on connection {identity[:32]!r}")
        if not 0 <= header.sender < self.world or header.sender == self.rank:
            raise MalformedMessage(f"sender {header.sender} is not another peer of this group of {self.world}")
        if (len(tensors) != 2 or tensors[0].dtype != torch.int64 or tensors[0].dim() != 1
                or not 1 <= tensors[0].numel() <= 4 or tensors[1].dtype != torch.float32 or tensors[1].dim() != 1):
            raise MalformedMessage("expected an int64 meta vector (1 to 4 entries) and a 1-d float32 chunk")
        meta = [int(v) for v in tensors[0].tolist()]
        if header.op in ("hello", "abort") or header.key.startswith("state/req/"):
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
        if header.op == "abort":
            with self._cond:
                self._aborted.setdefault(header.key, set()).add(sender)
                self._aborted.move_to_end(header.key)
                while len(self._aborted) > MAX_ABORTED_KEYS:
                    self._aborted.popitem(last=False)
                self._cond.notify_all()
        elif header.op == "hello":
            if len(meta) != 3 or meta[0] < -1:
                raise MalformedMessage(f"hello needs [join round >= -1, current round, ask reply], got {meta}")
            join_round, current, ask_reply = meta
            with self._cond:
                if join_round >= 0:
                    self._joined[sender] = join_round
                if not ask_reply:
                    self._reported[sender] = current
                self._cond.notify_all()
            if join_round >= 0:
                log.info("rank %d: peer %d takes part from round %d (it is in round %d)", self.rank, sender, join_round, current)
            if ask_reply:
                self._submit(("hello", sender, self._joined.get(self.rank, -1), 0))
        else:
            self._submit(("state", sender, header.key.removeprefix("state/req/"), 0))

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
                elif event["event"] == zmq.EVENT_DISCONNECTED and peer in self._connected:
                    self._connected.discard(peer)
                    self._failed[peer] = self._lost_at[peer] = time.monotonic()
                    self._joined.pop(peer, None)  # back only after a hello
                    log.warning("rank %d: lost the connection to peer %d", self.rank, peer)
                self._cond.notify_all()
