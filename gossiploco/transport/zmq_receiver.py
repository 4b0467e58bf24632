"""The receiver thread of the ZeroMQ driver: sockets in, protocol events out.

It owns the ROUTER and the DEALERs' monitor sockets (zmq sockets are not thread-safe). Each ROUTER
message is validated (``codec.decode``, ``messages.from_wire``), its sender identified and pinned to
its process (``admission``), and fed to the node; a message that fails is dropped, logged (the
first few of each reason, then at powers of two) and counted by reason. Monitor events (ZMTP
handshake, disconnect: a dead process at once, a frozen one after the heartbeat timeout) become
``connected``/``disconnected`` events; a refused handshake is retried with backoff
(``ZmqSockets.refused_by``, the policy in ``transport.retry``), as libzmq gives up on such a connection. It also dials the reverse
connections the driver asks for (``dial``), since only the ROUTER's thread may touch it.

The driver is reached through ``feed(event)`` only: ``event(node, now)`` runs under the driver's
lock with its ``PeerNode`` and returns the node's actions, which the driver then performs.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from gossiploco.errors import ExchangeError, MalformedMessage
from gossiploco.protocol import codec
from gossiploco.protocol.messages import from_wire
from gossiploco.protocol.node import PeerNode
from gossiploco.transport.admission import Admission
from gossiploco.transport.zmq_sockets import ZmqSockets

log = logging.getLogger(__name__)

POLL_MS = 100
"""How often the driver's threads wake to notice ``close()``."""
DRAIN_BATCH = 1000
"""Most ROUTER messages read in a row, so ``close()`` and the monitors are not starved."""

Event = Callable[[PeerNode, float], list]
"""A protocol event: called with the node and the driver's clock, under the driver's lock; returns actions."""


class Receiver:
    """The receiver thread's work for peer ``rank`` (``run`` is the thread's body); see the module docstring.

    ``feed(event)``: the driver runs ``event`` under its lock and performs the actions; ``flush_notes()``:
    it logs what the node noted; ``closed()``: the driver is closing; ``endpoints()``: a copy of the
    peers' endpoints (to connect again after a refused handshake). ``admission`` is guarded by the
    driver's lock: the receiver only touches it inside ``feed``.
    """

    def __init__(self, rank: int, sockets: ZmqSockets, admission: Admission, *, run_id: str, max_message_bytes: int,
                 feed: Callable[[Event], None], flush_notes: Callable[[], None], closed: Callable[[], bool],
                 endpoints: Callable[[], dict[int, str]]):
        self.rank = rank
        self.sockets = sockets
        self.admission = admission
        self.run_id = run_id
        self.max_message_bytes = max_message_bytes
        self.feed = feed
        self.flush_notes = flush_notes
        self.closed = closed
        self.endpoints = endpoints
        self._dials: queue.SimpleQueue = queue.SimpleQueue()  # (old, new) endpoints for the ROUTER to dial

    def dial(self, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        """Stop dialing ``old``, dial ``new`` (a reverse connection); done by the receiver thread soon. Any thread."""
        self._dials.put((old, new))

    def run(self) -> None:
        """The thread's loop, until ``closed()``. Raises ``ExchangeError`` when the ZAP thread died."""
        poller = zmq.Poller()
        router = self.sockets.router
        poller.register(router, zmq.POLLIN)
        poller.register(self.sockets.router_monitor, zmq.POLLIN)
        while not self.closed():
            while not self.sockets.new_monitors.empty():  # peers added since the last poll
                poller.register(self.sockets.new_monitors.get(), zmq.POLLIN)
            auth = self.sockets.auth
            if auth is not None and not auth.is_alive():
                raise ExchangeError("the ZAP (authentication) thread died: no peer could connect any more")
            while not self._dials.empty():
                self._dial_with_router(*self._dials.get())
            if self.sockets.handshakes.pending:
                self.sockets.retry_refused(time.monotonic(), self.endpoints())
            for sock, _ in poller.poll(POLL_MS):
                if sock is router:
                    self._drain_router()
                elif sock is self.sockets.router_monitor:
                    self.sockets.count_handshake_failures()
                else:
                    self._drain_monitor(sock)

    def _dial_with_router(self, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        router = self.sockets.router
        for endpoint in old:
            try:
                router.disconnect(endpoint)
            except zmq.ZMQError:
                pass
        for endpoint in new:
            try:
                router.connect(endpoint)
            except zmq.ZMQError as exc:  # an endpoint zmq refuses: that peer stays unreachable, the rest goes on
                log.warning("rank %d: cannot dial a reverse connection at %s: %s", self.rank, endpoint, exc)

    def _drain_router(self) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frames = self.sockets.router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                self._file(frames)
            except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError) as exc:
                # Validation itself failed on this input (a bug in it): the message is refused like
                # a malformed one, loudly, instead of the receiving thread dying for every message.
                count = self._reject(f"validation bug: {type(exc).__name__}")
                log.error("rank %d: validating a message raised %s: %s (a bug; the message is dropped)", self.rank,
                          type(exc).__name__, exc, exc_info=count == 1)
            except MalformedMessage as exc:
                count = self._reject(exc.reason)
                if count <= 3 or count & (count - 1) == 0:  # the first few, then at powers of two
                    log.warning("rank %d: dropped a malformed message (%d so far for this reason): %s",
                                self.rank, count, exc)
        self.flush_notes()

    def _reject(self, reason: str) -> int:
        counted: list[int] = []
        self.feed(lambda node, now: counted.append(self.admission.reject(reason)) or [])
        return counted[0]

    def _file(self, frames: list) -> None:
        """Validate one ROUTER message (routing id + codec frames) and feed it to the node."""
        if len(frames) < 2:
            raise MalformedMessage("no codec frames after the routing id")
        # copy=False: the chunk is a view of the zmq frame (which it keeps alive), not a copy.
        header, tensors = codec.decode(frames[1:], expect_run=self.run_id, max_bytes=self.max_message_bytes, copy=False)
        message = from_wire(header, tensors)
        authenticated_as = frames[1].get("User-Id") if self.admission.authenticated else None  # what ZAP authenticated
        sender = header.sender
        incarnation = self.admission.identify(frames[0].bytes, sender, message, authenticated_as)

        def event(node: PeerNode, now: float) -> list:
            note = self.admission.pin(sender, incarnation, node.peers.lost_at.get(sender, -math.inf), now)
            if note is not None:
                node.note(note, routine=True)
            return node.receive(sender, message, now)

        self.feed(event)

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        peer = self.sockets.monitors[monitor]
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.sockets.handshakes.succeeded(peer)
                self.feed(lambda node, now: node.connected(peer, now))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.feed(lambda node, now: node.disconnected(peer, now))
            else:  # a failed handshake: libzmq gives up on the connection, so we retry ourselves
                delay = self.sockets.refused_by(peer, time.monotonic())
                refusals = self.sockets.handshakes.refusals(peer)
                if refusals in (4, 16, 64):  # the first few are expected while a peer joins
                    self.feed(lambda node, now: node.note(
                        f"peer {peer} refused the handshake ({refusals} time(s); it may not have read this peer's "
                        f"record yet, or the keys differ); trying again in {delay:g} s") or [])
        self.flush_notes()
