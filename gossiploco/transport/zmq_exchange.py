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

Messages of one call:

* ``swap``: the payload in chunks of ``chunk_bytes``; message ``chunk = i`` holds chunk i.
* ``all_reduce_mean``: a bandwidth-optimal ring over ``sorted(members)``: reduce-scatter then
  all-gather, 2 (n - 1) steps; step s sends one segment to the right neighbour in ``cps``
  chunks numbered ``chunk = s * cps + c`` and receives the same numbering from the left
  neighbour. ``cps`` (chunks per segment) follows from the payload size, the group size and
  ``chunk_bytes``, so every peer of a group must use the same ``chunk_bytes``.

Every message carries two tensors: an int64 ``[total elements]`` (so a size mismatch is
detected and raised as ``PeerFailed``) and the float32 chunk. ``bytes_sent``/``bytes_received``
count the float32 chunk bytes only.

Failure detection: a monitor on each DEALER reports TCP disconnects. A peer whose connection
dropped after having been up (its process exited or crashed; ZMTP heartbeats catch a silent
machine within ``HEARTBEAT_TIMEOUT_MS``) is marked failed: it leaves ``members()`` and calls
waiting on it raise ``PeerFailed`` at once. It rejoins when the connection is back. A peer that
never connected, or that stays connected but silent, makes calls raise ``ExchangeTimeout`` at
their deadline (``timeout_s`` for the whole call).

Known limits: a message rejected by the codec (including a payload holding NaN or Inf) is
dropped, so the waiting call times out rather than failing fast. Messages that arrive before
anyone waits for them are kept up to ``mailbox_bytes``; past that, entries of keys nobody is
waiting on are evicted oldest first, then incoming messages are dropped (logged, counted in
``dropped_messages``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence

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
_FLOAT_BYTES = 4


def _op_and_round(key: str) -> tuple[str, int]:
    """Header ``op`` and ``round`` for ``key``: ``"mix1/12"`` gives ``("mix1", 12)``; unknown prefixes are "monitor"."""
    prefix, _, rest = key.partition("/")
    op = prefix if prefix in ("mix1", "mix2", "grad") else "monitor"
    number = rest.split("/", 1)[0]
    return op, int(number) if number.isdigit() else 0


class _Mail:
    """One received message waiting for its taker."""

    __slots__ = ("total", "data", "nbytes", "arrived")

    def __init__(self, total: int, data: torch.Tensor, nbytes: int):
        self.total, self.data, self.nbytes, self.arrived = total, data, nbytes, time.monotonic()


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
        self._failed: set[int] = set()
        self._connected: set[int] = set()
        self._closed = False
        self._close_lock = threading.Lock()

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
            monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            monitor.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.endpoints[peer])
            self._dealers[peer] = (dealer, threading.Lock())
            self._monitors[monitor] = peer

        self._receiver = threading.Thread(target=self._receive_loop, name=f"zmq-exchange-{rank}-recv", daemon=True)
        self._receiver.start()

    # -- the Exchange interface ------------------------------------------------------------------

    def members(self) -> list[int]:
        with self._cond:
            return [r for r in range(self.world) if r not in self._failed]

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
                self._send(partner, key, c, total, mine[c * per_chunk:(c + 1) * per_chunk], deadline, what)
            result = torch.empty(total, dtype=torch.float32)
            for c in range(n_chunks):
                part = result[c * per_chunk:(c + 1) * per_chunk]
                part.copy_(self._take(key, partner, c, total, part.numel(), [partner], deadline, what))
            return result.reshape(flat.shape)
        finally:
            self._end(key)

    def all_reduce_mean(self, key: str, flat: torch.Tensor, members: Sequence[int]) -> torch.Tensor:
        members = sorted(set(members))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not among members {members}")
        if not all(0 <= m < self.world for m in members):
            raise ValueError(f"members {members} outside world of {self.world}")
        acc = torch.empty(flat.numel(), dtype=torch.float32)
        acc.copy_(flat.detach().reshape(-1))
        n = len(members)
        if n == 1:
            return acc.reshape(flat.shape)
        deadline = time.monotonic() + self.timeout_s
        me = members.index(self.rank)
        right, left = members[(me + 1) % n], members[(me - 1) % n]
        others = [m for m in members if m != self.rank]
        total = acc.numel()
        bounds = [total * k // n for k in range(n + 1)]  # segment k is acc[bounds[k]:bounds[k + 1]]
        per_chunk = self._chunk_elems()
        cps = max(1, math.ceil(math.ceil(total / n) / per_chunk))  # chunks per segment
        what = f"all-reduce {key!r} over {members}"

        def segment(k: int) -> torch.Tensor:
            k %= n
            return acc[bounds[k]:bounds[k + 1]]

        def step(s: int, send_seg: int, recv_seg: int, reduce: bool) -> None:
            out = segment(send_seg)
            for c in range(cps):
                self._send(right, key, s * cps + c, total, out[c * per_chunk:(c + 1) * per_chunk], deadline, what)
            into = segment(recv_seg)
            for c in range(cps):
                part = into[c * per_chunk:(c + 1) * per_chunk]
                got = self._take(key, left, s * cps + c, total, part.numel(), others, deadline, what)
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
        finally:
            self._end(key)
        return (acc / n).reshape(flat.shape)

    def close(self) -> None:
        with self._close_lock:
            with self._cond:
                if self._closed:
                    return
                self._closed = True
                self._cond.notify_all()
            self._receiver.join(timeout=10)
            if self._receiver.is_alive():
                log.error("rank %d: receiver thread did not stop; leaking its sockets", self.rank)
                return
            for dealer, lock in self._dealers.values():
                with lock:  # senders notice _closed within SEND_RETRY_S and release it
                    try:
                        dealer.disable_monitor()
                    except zmq.ZMQError:
                        pass
                    dealer.close(linger=0)
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

    # -- sending -----------------------------------------------------------------------------------

    def _chunk_elems(self) -> int:
        return max(1, self.chunk_bytes // _FLOAT_BYTES)

    def _send(self, peer: int, key: str, chunk: int, total: int, data: torch.Tensor, deadline: float, what: str) -> None:
        op, round_index = _op_and_round(key)
        header = codec.Header(run=self.run_id, round=round_index, op=op, chunk=chunk, sender=self.rank, key=key)
        frames = codec.encode(header, [torch.tensor([total], dtype=torch.int64), data])
        dealer, lock = self._dealers[peer]
        with lock:
            while True:
                if self._closed:
                    raise ExchangeClosed(f"rank {self.rank}: exchange closed during {what}")
                try:
                    # copy=True: zmq owns a copy, so the caller may change ``data`` right after.
                    dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
                    break
                except zmq.Again:
                    pass
                except zmq.ZMQError as exc:
                    raise PeerFailed(f"{what}: sending to {peer} failed: {exc}") from exc
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ExchangeTimeout(f"{what}: peer {peer} did not take data within {self.timeout_s:.1f}s")
                dealer.poll(max(1, int(1000 * min(remaining, SEND_RETRY_S))), zmq.POLLOUT)
        with self._cond:
            self.bytes_sent += data.numel() * _FLOAT_BYTES

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

    def _take(self, key: str, sender: int, chunk: int, total: int, numel: int, watch: Sequence[int],
              deadline: float, what: str) -> torch.Tensor:
        """Wait for message ``(key, sender, chunk)``; check it carries ``numel`` of ``total`` elements."""
        with self._cond:
            while True:
                if self._closed:
                    raise ExchangeClosed(f"rank {self.rank}: exchange closed during {what}")
                box = self._mail.get(key)
                mail = box.pop((sender, chunk), None) if box else None
                if mail is not None:
                    self._mail_bytes -= mail.nbytes
                    break
                gone = sorted(p for p in watch if p in self._failed)
                if gone:
                    raise PeerFailed(f"{what}: peer(s) {gone} disconnected")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ExchangeTimeout(f"{what}: no chunk {chunk} from {sender} within {self.timeout_s:.1f}s")
                self._cond.wait(remaining)
            self.bytes_received += mail.nbytes
        if mail.total != total or mail.data.numel() != numel:
            raise PeerFailed(f"{what}: peer {sender} sent chunk {chunk} of {mail.data.numel()} elements "
                             f"(of {mail.total}); expected {numel} (of {total})")
        return mail.data

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
            for monitor in self._monitors:
                monitor.close(linger=0)
            self._router.close(linger=0)

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
        header, tensors = codec.decode(frames[1:], expect_run=self.run_id, max_bytes=self.max_message_bytes)
        if identity != str(header.sender).encode():
            raise MalformedMessage(f"sender {header.sender} arrived on connection {identity[:32]!r}")
        if not 0 <= header.sender < self.world or header.sender == self.rank:
            raise MalformedMessage(f"sender {header.sender} is not another peer of this group of {self.world}")
        if (len(tensors) != 2 or tensors[0].dtype != torch.int64 or tensors[0].shape != (1,)
                or tensors[1].dtype != torch.float32 or tensors[1].dim() != 1):
            raise MalformedMessage("expected an int64 [total] and a 1-d float32 chunk")
        mail = _Mail(int(tensors[0].item()), tensors[1], tensors[1].numel() * _FLOAT_BYTES)
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
                if event["event"] == zmq.EVENT_CONNECTED:
                    self._connected.add(peer)
                    self._failed.discard(peer)
                elif event["event"] == zmq.EVENT_DISCONNECTED and peer in self._connected:
                    self._connected.discard(peer)
                    self._failed.add(peer)
                    log.warning("rank %d: lost the connection to peer %d", self.rank, peer)
                self._cond.notify_all()
