"""The thin socket-and-thread driver under ``ZmqExchange``: one ``PeerNode``, its lock, and the threads.

The protocol (``gossiploco.protocol``) is sans-I/O; ``ZmqDriver`` gives it I/O. Its parts, one concern each:

    zmq_sockets      the ROUTER, the DEALERs per peer (data and control), their monitors, CurveZMQ
    zmq_sealed       the sealed data path: chunks sealed with AES-GCM on a second port (with ``trust``)
    zmq_receiver     the receiver thread: validates each message and feeds it to the node (``_feed``)
    admission        who a sender is (routing id, header, authenticated key) and which process (pure)
    zmq_service      the service thread: sends what the receiver decided, serves state uploads
    traffic          byte accounting of every send
    fault_injection  the optional ``fault`` hook run before each send (given by the caller; tests)

Threads (zmq sockets are not thread-safe; one lock and condition, ``_cond``, guard the ``PeerNode``):
the receiver and the service thread above, and the callers (the training thread, the Mix1 thread),
which run their calls with ``protocol.call.run_call`` (``_run``): they send their own data chunks
(``NOBLOCK`` with a poll/retry loop bounded by the call's deadline; the ring sends views of its buffer
without copying and waits for zmq to release a segment before overwriting it) and wait on the
condition with the call's deadline. If the receiver or service thread dies, the exchange is
*broken*: the cause is logged, and every call in progress or later raises ``ExchangeBroken`` (never a
silent identity), which stops the peer.

``ZmqExchange`` (``zmq_exchange``) builds the ``Exchange`` interface, membership and path control on
this driver; the driver's public methods are its diagnostics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from gossiploco.errors import ExchangeError
from gossiploco.protocol import codec, lifecycle
from gossiploco.protocol.agreement import CONTROL_SEND_S
from gossiploco.protocol.call import Call, run_call
from gossiploco.protocol.messages import CONTROL, MAX_PEER_ID, Data, Ready, Send, StateRequest, to_wire
from gossiploco.protocol.node import PeerNode
from gossiploco.security.trust import Trust
from gossiploco.transport.admission import Admission
from gossiploco.transport.fault_injection import SendHook
from gossiploco.transport.traffic import Traffic
from gossiploco.transport.zmq_receiver import Event, Receiver
from gossiploco.transport.zmq_service import Service
from gossiploco.transport.zmq_sockets import ZmqSockets

log = logging.getLogger(__name__)

_FLOAT_BYTES = 4


class ZmqDriver:
    """Peer ``rank``'s node, lock, sockets and threads; see the module docstring and ``ZmqExchange``
    (which documents the arguments). Every public method is thread-safe."""

    def __init__(self, rank: int, endpoints: Sequence[str] | Mapping[int, str], run_id: str, timeout_s: float,
                 max_message_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20, mailbox_bytes: int = 1 << 30,
                 grace_s: float = 10.0, *, bind: str | None = None, join_round: int | None = 0,
                 heartbeat_s: float | None = None, trust: Trust | None = None, sender_mailbox_bytes: int | None = None,
                 fault: SendHook | None = None, io_threads: int | None = None, stripes: int | None = None,
                 sealed_port: int | None = 0, links_idle_s: float = 0.0, links_cap: int | None = None):
        endpoints = dict(enumerate(endpoints)) if not isinstance(endpoints, Mapping) else dict(endpoints)
        if rank not in endpoints:
            raise ValueError(f"rank {rank} has no endpoint among {sorted(endpoints)}")
        if any(not 0 <= p < MAX_PEER_ID for p in endpoints):
            raise ValueError(f"peer ids must be in 0..{MAX_PEER_ID - 1}, got {sorted(endpoints)}")
        if chunk_bytes < _FLOAT_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes} must hold at least one float32")
        if chunk_bytes + codec.MAX_HEADER_BYTES + 64 > max_message_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} plus a header does not fit max_message_bytes={max_message_bytes}")
        if trust is not None and trust.peer_id != rank:
            raise ValueError(f"rank {rank} is not the peer id of this identity ({trust.peer_id})")
        if trust is not None and any(trust.key_of(p) is None for p in endpoints if p != rank):
            raise ValueError("a static peer list needs every rank's key (Trust.static)")
        self.rank = rank
        self.endpoints = endpoints
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.trust = trust
        self.traffic = Traffic()
        self.admission = Admission(authenticated=trust is not None)
        """Who senders are (guarded by ``_cond``: read it inside ``inspect``)."""
        self._fault = fault
        self._cond = threading.Condition()  # guards the node (and ``admission``)
        self._node = PeerNode(rank, endpoints, grace_s=grace_s, chunk_elems=max(1, chunk_bytes // _FLOAT_BYTES),
                              mailbox_bytes=mailbox_bytes, sender_mailbox_bytes=sender_mailbox_bytes,
                              join_round=join_round, links_on_demand=links_idle_s > 0)
        self._closed = False
        self._close_lock = threading.Lock()
        if sealed_port is not None and not 0 <= sealed_port < 65536:
            raise ValueError(f"sealed_port must be a TCP port (0: any) or None, got {sealed_port}")
        bind = bind or self.endpoints[rank]
        self._sockets = ZmqSockets(rank, bind, self.endpoints[rank], heartbeat_s=heartbeat_s,
                                   max_message_bytes=max_message_bytes, chunk_bytes=chunk_bytes, trust=trust,
                                   io_threads=io_threads, stripes=stripes, links_idle_s=links_idle_s,
                                   links_cap=links_cap,
                                   sealed_bind=None if sealed_port is None else f"{bind.rpartition(':')[0]}:{sealed_port}")
        self.endpoints[rank] = self._sockets.endpoint
        self._dealers = self._sockets.dealers
        for peer, endpoint in endpoints.items():
            if peer != rank:
                self._sockets.connect(peer, endpoint, trust.key_of(peer) if trust is not None else None)
        closed = lambda: self._closed  # noqa: E731
        self._receiver_work = Receiver(rank, self._sockets, self.admission, run_id=run_id,
                                       max_message_bytes=max_message_bytes, feed=self._feed,
                                       flush_notes=self._flush_notes, closed=closed, endpoints=self.known_endpoints,
                                       transport_send=lambda message: self._service_work.submit(message))
        self._service_work = Service(rank, self._send, self.traffic, chunk_elems=self._node.chunk_elems,
                                     timeout_s=timeout_s, closed=closed, send_frames=self._send_frames)
        self._receiver = threading.Thread(target=self._guarded, args=(self._receiver_work.run, "receiver"),
                                          name=f"zmq-exchange-{rank}-recv", daemon=True)
        self._service = threading.Thread(target=self._guarded, args=(self._service_work.run, "service"),
                                         name=f"zmq-exchange-{rank}-service", daemon=True)
        self._receiver.start()
        self._service.start()

    # -- state and counters ------------------------------------------------------------------------

    @property
    def current_round(self) -> int:
        """The round this peer is in (set by its runtime; -1 before the first); told to peers."""
        return self._node.current_round

    @current_round.setter
    def current_round(self, value: int) -> None:
        with self._cond:
            self._node.begin_round(value, time.monotonic())

    @property
    def round_ends(self) -> tuple[int, float] | None:
        """(round, when its training ends) on a shared round clock (``time.monotonic()``; set by its runtime, None on
        its own clock); answers to hellos tell it (``PeerNode.round_ends``)."""
        return self._node.round_ends

    @round_ends.setter
    def round_ends(self, value: tuple[int, float] | None) -> None:
        with self._cond:
            self._node.round_ends = value

    @property
    def bytes_sent(self) -> int:
        """Payload bytes of the data chunks this peer sent (``Traffic.payload_sent``)."""
        return self.traffic.payload_sent

    @property
    def wire_bytes_sent(self) -> int:
        """Bytes of every message this peer sent (``Traffic.wire_sent``)."""
        return self.traffic.wire_sent

    @property
    def dropped_messages(self) -> int:
        """Actions the full service queue dropped (``Traffic.dropped``)."""
        return self.traffic.dropped

    @property
    def unencodable_messages(self) -> int:
        """Messages the codec refused to encode, so not sent (``Traffic.unencodable``)."""
        return self.traffic.unencodable

    @property
    def bytes_received(self) -> int:
        return self._node.bytes_received

    @property
    def malformed_messages(self) -> int:
        """Messages refused after they arrived (every reason in ``security_counts``)."""
        with self._cond:
            return self.admission.total_rejected

    def close(self, linger_s: float = 0.0) -> None:
        """Stop: calls in progress and later raise ``ExchangeClosed``. ``linger_s > 0`` (a graceful
        leave) gives messages already sent that long to reach their peers. Idempotent."""
        with self._close_lock:
            with self._cond:
                if self._closed:
                    return
                self._closed = self._node.closed = True
                self._cond.notify_all()
            self._sockets.waker.wake()  # the receiving thread may sleep up to a second otherwise
            for thread in self.threads:
                if thread is not threading.current_thread():
                    thread.join(timeout=10)
            if any(thread.is_alive() for thread in self.threads):
                log.error("rank %d: exchange threads did not stop; leaking their sockets", self.rank)
                return
            self._sockets.close(linger_s)

    def known_endpoints(self) -> dict[int, str]:
        """Every peer's endpoint this exchange knows (including its own), a copy."""
        with self._cond:
            return dict(self.endpoints)

    def check_reachable(self, timeout_s: float) -> bool:
        """True if a ZeroMQ handshake with this peer's own advertised endpoint succeeds within
        ``timeout_s`` (what another peer does first). A failure means the address or port is wrong
        or closed here; success does not prove that peers behind other networks can reach it."""
        return self._sockets.check_reachable(timeout_s)

    # -- diagnostics (tests, benchmarks, summaries) ---------------------------------------------------

    def protocol_state(self) -> dict[str, int]:
        """Sizes of the protocol's records and mailbox (bounded; for tests and diagnostics)."""
        with self._cond:
            return self._node.pending_state()

    def security_counts(self) -> dict[str, dict[str, int]]:
        """Connections the ZAP handler refused and messages the receiver rejected, by reason; state requests
        refused by the requester's limit (``protocol.state_limit``), by requester; with links on demand, their counts
        (``zmq_links``: parked members, links made on demand and closed idle; None with a full mesh)."""
        with self._cond:
            rejected = dict(self.admission.rejected)
            state = {str(p): n for p, n in self._node.state_limit.refused.items()}
        links = self._sockets.links
        return {"refused_connections": self._sockets.refused_connections(), "rejected_messages": rejected,
                "refused_state_requests": state, "links_on_demand": None if links is None else links.counts()}

    def sealed_counts(self) -> dict[str, object]:
        """The sealed data path (``zmq_sealed``): this peer's sealed port (None: none), the data messages it sent
        sealed, and the peers it sends to sealed now (the others get data over CurveZMQ)."""
        sealed = self._sockets.sealed
        if sealed is None:
            return {"sealed_port": None, "sealed_messages": 0, "sealed_to": []}
        return {"sealed_port": sealed.port, "sealed_messages": sealed.sent,
                "sealed_to": sorted(p for p in self.known_endpoints() if p != self.rank and sealed.is_up(p))}

    def grow_mailbox(self, total_bytes: int, per_sender_bytes: int) -> None:
        """Let the mailbox of early chunks hold at least ``total_bytes``, ``per_sender_bytes`` from one
        peer (a benchmark's payload larger than the exchange was sized for). Never shrinks it."""
        with self._cond:
            box = self._node.mailbox
            box.limit_bytes = max(box.limit_bytes, total_bytes)
            box.sender_limit_bytes = max(box.sender_limit_bytes, per_sender_bytes)

    def inspect(self, look: Callable[[PeerNode], object]) -> object:
        """``look(node)`` with this peer's ``PeerNode``, under the lock, and what it returns: a look at the
        protocol's state (and ``admission``) for tests, benchmarks and diagnostics. ``look`` must not
        block and must not change anything (events reach the node from the network, requests by the
        methods above)."""
        with self._cond:
            return look(self._node)

    @property
    def broken(self) -> str | None:
        """Why this exchange is broken (one of its threads died), or None."""
        with self._cond:
            return self._node.broken

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The receiver and service threads (alive until ``close``; tests check that none leaks)."""
        return self._receiver, self._service

    @property
    def sockets(self) -> ZmqSockets:
        """The sockets, to read their options and ``incarnation`` in tests and diagnostics. Sending or
        receiving on them is this driver's (the thread rules of ``zmq_sockets``)."""
        return self._sockets

    @property
    def receiver(self) -> Receiver:
        """The receiving thread's work, to read its state in tests and diagnostics (``Receiver.dropping``)."""
        return self._receiver_work

    def _wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate() and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return predicate()

    # -- running calls and feeding events -------------------------------------------------------------

    def _run(self, call: Call, in_flight: dict | None = None, before_feed=None, before_outcome=None):
        """Run ``call`` on this thread (``protocol.call.run_call``) and log what the node noted."""
        def send(sends: list[Send]) -> None:
            for s in sends:
                if isinstance(s.message, (Data, Ready, StateRequest)):  # the caller's own messages: sent here
                    deadline = call.deadline if isinstance(s.message, Data) else time.monotonic() + CONTROL_SEND_S
                    tracker = self._send(s, deadline, call.what, zero_copy=in_flight is not None)
                    if in_flight is not None and s.segment is not None and tracker is not None:
                        in_flight.setdefault(s.segment, []).append(tracker)
                else:  # aborts and decisions: the service thread, so a failing call does not block on them
                    self._service_work.submit(s)

        def wait(until: float | None) -> None:
            self._cond.wait(max(0.0, until - time.monotonic()) if until is not None else None)

        try:
            return run_call(call, self._node, locked=lambda: self._cond, wait=wait, clock=time.monotonic,
                            send=send, before_feed=before_feed, before_outcome=before_outcome)
        finally:
            self._flush_notes()

    def drive(self, program: Callable[[PeerNode], lifecycle.Program]) -> Any:
        """Run the lifecycle program ``program(node)`` (``protocol.lifecycle``) on this peer's node: it runs under
        the node's lock, waits on the node's condition and runs its exchange calls as ``_run`` does. Blocks
        until the program ends (its own deadlines bound it); returns its result or raises its error
        (``ExchangeClosed`` once this exchange closes)."""
        def wait(until: float) -> None:
            if not self._closed:
                self._cond.wait(max(0.0, until - time.monotonic()))

        def sleep(until: float) -> None:
            while not self._closed and (left := until - time.monotonic()) > 0:
                self._cond.wait(left)

        try:
            return lifecycle.drive(program(self._node), locked=lambda: self._cond, act=self._dispatch, wait=wait,
                                   sleep=sleep, clock=time.monotonic, run=self._run)
        finally:
            self._flush_notes()

    def _feed(self, event: Event) -> None:
        """Run ``event(node, now)`` under the lock (the receiver's events), wake the callers, perform the actions."""
        with self._cond:
            actions = event(self._node, time.monotonic())
            self._cond.notify_all()
        self._dispatch(actions)

    def _send(self, send: Send, deadline: float, what: str, zero_copy: bool = False) -> zmq.MessageTracker | None:
        """Queue one message for its peer, retrying a full queue until ``deadline``. By default zmq
        copies the payload; with ``zero_copy`` it reads it in place until the returned tracker is done."""
        message, peer = send.message, send.peer
        if self._fault is not None:
            self._fault(self.rank, message)
        try:
            frames = codec.encode(*to_wire(message, self.rank, self.run_id))
        except ValueError as exc:  # a bug here or a field taken from what arrived: this message only, never the thread
            self.traffic.refuse()
            log.error("rank %d: %s message for %d cannot be encoded and is not sent: %s", self.rank,
                      type(message).__name__, peer, exc)
            raise ExchangeError(f"{what}: {type(message).__name__} message for {peer} cannot be encoded: {exc}") \
                from None
        tracker = self._sockets.send(peer, frames, control=isinstance(message, CONTROL), chunk=isinstance(message, Data),
                                     deadline=deadline, what=what, zero_copy=zero_copy, closed=lambda: self._closed)
        self.traffic.sent(message, frames)
        return tracker

    def _send_frames(self, peer: int, frames: list, deadline: float, what: str) -> None:
        """Queue the transport's own message ``frames`` on the control connection to ``peer``."""
        self._sockets.send(peer, frames, control=True, deadline=deadline, what=what, zero_copy=False,
                           closed=lambda: self._closed)

    def _dispatch(self, actions: list) -> None:
        """Hand the node's actions to the service thread (never sends on the calling thread)."""
        for action in actions:
            self._service_work.submit(action)

    def _guarded(self, loop: Callable[[], None], name: str) -> None:
        """Run a driver thread; if it dies, the exchange is broken: logged, and every call fails."""
        try:
            loop()
        except Exception as exc:  # noqa: BLE001 - reported below, then every call fails with it
            log.critical("rank %d: the exchange's %s thread died: %s: %s; mixing cannot go on",
                         self.rank, name, type(exc).__name__, exc, exc_info=True)
            with self._cond:
                self._node.broken = f"{name} thread died: {type(exc).__name__}: {exc}"
                self._cond.notify_all()
        finally:
            if name == "receiver":
                self._sockets.close_router()  # the DEALERs' monitors are closed by close(), after their dealers stop them

    def _flush_notes(self) -> None:
        with self._cond:
            notes, self._node.notes = self._node.notes, []
        for routine, note in notes:
            log.log(logging.INFO if routine else logging.WARNING, "rank %d: %s", self.rank, note)

