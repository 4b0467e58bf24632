"""The receiver thread of the ZeroMQ driver: sockets in, protocol events out.

It owns the ROUTER and the DEALERs' monitor sockets (zmq sockets are not thread-safe). Each ROUTER
message is validated (``codec.decode``, ``messages.from_wire``), its sender identified and pinned to
its process (``admission``), and fed to the node; a message that fails is dropped, logged (the
first few of each reason, then at powers of two) and counted by reason. Monitor events (ZMTP
handshake, disconnect: a dead process at once, a frozen one after the heartbeat timeout) become
``connected``/``disconnected`` events (a disconnect after ``GOODBYE_GRACE_S``, so that a goodbye sent on another
connection just before is heard first); a refused handshake is retried with backoff
(``ZmqSockets.refused_by``, the policy in ``transport.retry``), as libzmq gives up on such a connection (one dropped
during its handshake libzmq dials again itself: ``zmq_send.HANDSHAKE_REFUSALS``). It also dials the reverse
connections the driver asks for (``dial``), since only the ROUTER's thread may touch it, and redials those that
failed or dropped while they are wanted (``retry.Redials``: libzmq's own redialing is off on the ROUTER, as it starts
again at 100 ms after every TCP connection, handshake or not).

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
from gossiploco.security.trust import parse_routing_id
from gossiploco.transport.admission import Admission
from gossiploco.transport.retry import Redials
from gossiploco.transport.sealed import OFFER
from gossiploco.transport.zmq_links import IDLE, LOST, UNOPENED
from gossiploco.transport.zmq_send import HANDSHAKE_FAILURES, HANDSHAKE_REFUSALS
from gossiploco.transport.zmq_service import TransportMessage
from gossiploco.transport.zmq_sockets import ZmqSockets

log = logging.getLogger(__name__)

POLL_MS = 100
"""How often the receiving thread wakes while it has something timed to do (a redial, a handshake to try again)."""
IDLE_POLL_MS = 1000
"""How long it sleeps otherwise: other threads wake it when they give it work or close (``transport.wakeup``)."""
DRAIN_BATCH = 1000
"""Most ROUTER messages read in a row, so ``close()`` and the monitors are not starved."""
GOODBYE_GRACE_S = 0.25
"""How long a dropped connection waits to be reported to the node: a peer's goodbye, sent just before it closed,
travels on another connection (its data DEALER, to the sealed port where keys are up) and can arrive after this
peer's own connection to it is seen to drop; heard within this time, the drop is a peer that left, not one lost."""

Event = Callable[[PeerNode, float], list]
"""A protocol event: called with the node and the driver's clock, under the driver's lock; returns actions."""


class Receiver:
    """The receiver thread's work for peer ``rank`` (``run`` is the thread's body); see the module docstring.

    ``feed(event)``: the driver runs ``event`` under its lock and performs the actions; ``flush_notes()``:
    it logs what the node noted; ``closed()``: the driver is closing; ``endpoints()``: a copy of the
    peers' endpoints (to connect again after a refused handshake); ``transport_send(message)``: the service thread
    sends the transport's own message (a sealed-data key offer). ``admission`` is guarded by the
    driver's lock: the receiver only touches it inside ``feed``.
    """

    def __init__(self, rank: int, sockets: ZmqSockets, admission: Admission, *, run_id: str, max_message_bytes: int,
                 feed: Callable[[Event], None], flush_notes: Callable[[], None], closed: Callable[[], bool],
                 endpoints: Callable[[], dict[int, str]], transport_send: Callable[[TransportMessage], None]):
        self.rank = rank
        self.sockets = sockets
        self.admission = admission
        self.run_id = run_id
        self.max_message_bytes = max_message_bytes
        self.feed = feed
        self.flush_notes = flush_notes
        self.closed = closed
        self.endpoints = endpoints
        self.transport_send = transport_send
        self.sealed = sockets.sealed
        self._dials: queue.SimpleQueue = queue.SimpleQueue()  # (old, new) endpoints for the ROUTER to dial
        self.redials = Redials()
        """The reverse endpoints the ROUTER dials, and when to dial each again (this thread's)."""
        self.redialed = 0
        """Reverse connections dialed again after they failed or dropped (for tests and diagnostics)."""
        self.polls = 0
        """Polls this thread made (for tests: an idle one makes about one a second)."""
        self._drops: dict[int, float] = {}
        """Peers whose connection dropped, and when to tell the node (``GOODBYE_GRACE_S``)."""

    def dial(self, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        """Stop dialing ``old``, dial ``new`` (a reverse connection); done by the receiver thread soon. Any thread."""
        self._dials.put((old, new))
        self.sockets.waker.wake()

    def _timed_work(self) -> bool:
        """Whether something is due at a time rather than on a message: then the thread polls every ``POLL_MS``."""
        sealed = self.sealed
        return bool(self.redials.pending or self.sockets.handshakes.pending or self._drops
                    or (sealed is not None and sealed.busy()))

    def run(self) -> None:
        """The thread's loop, until ``closed()``. Raises ``ExchangeError`` when the ZAP thread died."""
        poller = zmq.Poller()
        router = self.sockets.router
        poller.register(router, zmq.POLLIN)
        poller.register(self.sockets.router_monitor, zmq.POLLIN)
        waker = self.sockets.waker
        poller.register(waker.fd, zmq.POLLIN)
        sealed = self.sealed
        if sealed is not None and sealed.router is not None:
            poller.register(sealed.router, zmq.POLLIN)
        while not self.closed():
            while not self.sockets.new_monitors.empty():  # peers added since the last poll
                poller.register(self.sockets.new_monitors.get(), zmq.POLLIN)
            while not self.sockets.retired_monitors.empty():  # their sockets were closed (forgotten, made afresh)
                retired = self.sockets.retired_monitors.get()
                poller.unregister(retired)
                retired.close(linger=0)
            auth = self.sockets.auth
            if auth is not None and not auth.is_alive():
                raise ExchangeError("the ZAP (authentication) thread died: no peer could connect any more")
            while not self._dials.empty():
                self._dial_with_router(*self._dials.get())
            if self.redials.pending:
                self._redial_due(time.monotonic())
            if self.sockets.handshakes.pending:
                self.sockets.retry_refused(time.monotonic(), self.endpoints())
            if sealed is not None:
                sealed.dial_pending()
            if self.sockets.links is not None:
                self._links_due()
            if self._drops:
                self._drops_due(time.monotonic())
            self.polls += 1
            for sock, _ in poller.poll(POLL_MS if self._timed_work() else IDLE_POLL_MS):
                if sock == waker.fd:
                    waker.drain()
                elif sock is router:
                    self._drain_router()
                elif sealed is not None and sock is sealed.router:
                    self._drain_sealed()
                elif sealed is not None and sock in sealed.monitors:
                    self._drain_sealed_monitor(sock)
                elif sock is self.sockets.router_monitor:
                    self._drain_router_monitor()
                else:
                    self._drain_monitor(sock)

    def _dial_with_router(self, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        router = self.sockets.router
        for endpoint in old:
            self.redials.drop(endpoint)
            try:
                router.disconnect(endpoint)
            except zmq.ZMQError:  # its connection had failed or dropped already: libzmq holds nothing of it
                pass
        for endpoint in new:
            self.redials.want(endpoint)
            self._connect_router(endpoint)

    def _connect_router(self, endpoint: str) -> None:
        try:
            self.sockets.router.connect(endpoint)
        except zmq.ZMQError as exc:  # an endpoint zmq refuses: that peer stays unreachable, the rest goes on
            self.redials.drop(endpoint)
            log.warning("rank %d: cannot dial a reverse connection at %s: %s", self.rank, endpoint, exc)

    def _redial_due(self, now: float) -> None:
        """Dial again the wanted reverse endpoints whose connection failed or dropped, once their backoff is over."""
        for endpoint in self.redials.due(now):
            try:
                self.sockets.router.disconnect(endpoint)  # normally gone with its connection; never two at once
            except zmq.ZMQError:
                pass
            self.redialed += 1
            self._connect_router(endpoint)

    def _links_due(self) -> None:
        """Links on demand (``zmq_links``): close idle links (the node hears ``idled``: no failure) and report links
        opened on demand whose TCP connection was never taken, or whose handshake never ended (``disconnected``:
        libzmq goes on dialing them)."""
        idle, unanswered = self.sockets.links.due()
        for peer in idle:
            if self.sockets.close_idle(peer):
                self.feed(lambda node, now, peer=peer: node.idled(peer, now))
        for peer in unanswered:
            self.feed(lambda node, now, peer=peer: node.disconnected(peer, now))

    def dropping(self) -> list[int]:
        """Peers whose connection dropped and who are not reported yet (a goodbye may be on its way). Any thread."""
        return sorted(self._drops)

    def _drops_due(self, now: float) -> None:
        """Tell the node of the drops whose grace for a goodbye is over (``GOODBYE_GRACE_S``)."""
        for peer in [p for p, due in self._drops.items() if due <= now]:
            del self._drops[peer]
            self.feed(lambda node, at, peer=peer: node.disconnected(peer, at))
        self.flush_notes()

    def _drain_router_monitor(self) -> None:
        """Count the ROUTER's failed handshakes, and schedule a redial of a wanted reverse endpoint whose connection
        attempt closed or whose connection dropped (``retry.Redials``)."""
        now = time.monotonic()
        for kind, endpoint in self.sockets.read_router_monitor():
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.redials.up(endpoint)
            else:
                self.redials.lost(endpoint, now)

    def _drain_router(self) -> None:
        self._drain(self.sockets.router, self._file)

    def _drain_sealed(self) -> None:
        self._drain(self.sealed.router, self._file_sealed)

    def _drain(self, sock: zmq.Socket, file: Callable[[list], None]) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                file(frames)
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
        """Validate one ROUTER message (routing id + codec frames, or a sealed-data key offer) and act on it."""
        if len(frames) < 2:
            raise MalformedMessage("no codec frames after the routing id")
        authenticated_as = frames[1].get("User-Id") if self.admission.authenticated else None  # what ZAP authenticated
        if frames[1].buffer.nbytes == len(OFFER) and frames[1].bytes == OFFER:
            self._accept_offer(frames[0].bytes, frames[2:], authenticated_as)
            return
        self._admit(frames[0].bytes, frames[1:], authenticated_as)

    def _file_sealed(self, frames: list) -> None:
        """Open one message of the sealed port (its routing id, then envelope + sealed frames) and admit it as
        from the peer whose key sealed it (``zmq_sealed``)."""
        if len(frames) < 3:
            raise MalformedMessage("a sealed message without sealed frames")
        peer, routing, plain = self.sealed.open(frames[1:])
        if not plain:
            raise MalformedMessage("a sealed message without codec frames")
        self._admit(routing, plain, str(peer))

    def _accept_offer(self, routing: bytes, frames: list, authenticated_as: str | None) -> None:
        """A member's key for sealing data to it: only on its authenticated control connection."""
        claimed = parse_routing_id(routing)
        if self.sealed is None or claimed is None or not claimed[2] or authenticated_as != str(claimed[0]):
            raise MalformedMessage(f"a sealed-data key offer on connection {routing[:32]!r}, authenticated as "
                                   f"{authenticated_as!r}")
        peer = claimed[0]
        self.sealed.accept(peer, frames, self.sockets.dialed_endpoint(peer))

    def _admit(self, routing: bytes, codec_frames: list, authenticated_as: str | None) -> None:
        """Validate one message (codec frames) that came on connection ``routing`` and feed it to the node."""
        # copy=False: the chunk is a view of the frame (which it keeps alive), not a copy.
        header, tensors = codec.decode(codec_frames, expect_run=self.run_id, max_bytes=self.max_message_bytes, copy=False)
        message = from_wire(header, tensors)
        sender = header.sender
        incarnation = self.admission.identify(routing, sender, message, authenticated_as)
        if self.sockets.links is not None:
            self.sockets.links.used(sender)
        if self.sockets.handshakes.pending and self.sockets.handshakes.hurry(sender, time.monotonic()):
            log.info("rank %d: peer %d refused this peer's handshake but has admitted it since (it sent a message): "
                     "connecting again now", self.rank, sender)
            # Now, before the node answers it: an answer queued on the refused DEALER would be dropped with it
            self.sockets.retry_refused(time.monotonic(), self.endpoints())

        def event(node: PeerNode, now: float) -> list:
            lost = node.peers.lost_at.get(sender, -math.inf)
            # The link to it down since it was lost: made afresh (``ZmqSockets.renew``) before any answer is queued
            if sender not in node.peers.connected and sender in node.peers.lost_at \
                    and self.sockets.renew(sender, node.peers.lost_at[sender]):
                log.info("rank %d: peer %d speaks while the link to it is down since it was lost: its sockets made "
                         "afresh", self.rank, sender)
            unseen = node.peers.links_on_demand and sender not in node.peers.connected
            if unseen:  # no link up that would have seen its last process go: another one is a restart
                lost = now
            note = self.admission.pin(sender, incarnation, lost, now)
            if note is None:
                return node.receive(sender, message, now)
            node.note(note, routine=True)
            return (node.restarted(sender, now) if unseen else []) + node.receive(sender, message, now)

        self.feed(event)

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        peer = self.sockets.monitors.get(monitor)
        first_data = peer is not None
        if peer is None:
            peer = self.sockets.control_monitors.get(monitor)  # which reports failed handshakes only
        if peer is None:  # its socket was closed (``ZmqSockets.forget``, ``reattach``): retired at the next pass
            return
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and first_data:
                if self._drops.pop(peer, None) is not None:  # its drop first: what was in flight then is gone
                    self.feed(lambda node, now: node.disconnected(peer, now))
                if self.sockets.links is not None:
                    self.sockets.links.link_up(peer)
                self.sockets.handshakes.succeeded(peer)
                self.sockets.connect_stripes(peer)
                self._offer_key(peer)
                self.feed(lambda node, now: node.connected(peer, now))
            elif event["event"] == zmq.EVENT_CONNECTED:  # monitored with links on demand only
                self.sockets.links.answered(peer)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                down = LOST if self.sockets.links is None else self.sockets.links.link_down(peer)
                if down == UNOPENED:
                    continue  # a link on demand that never came up (a handshake too slow for the other end): redialed
                self._drain_router()  # a goodbye already here is heard first: the peer left, it was not lost
                if self.sealed is not None and self.sealed.router is not None:
                    self._drain_sealed()
                if down == IDLE:  # overdue to close as idle here: closed so (``LinksOnDemand.link_down``)
                    if self.sockets.close_idle(peer):
                        self.feed(lambda node, now: node.idled(peer, now))
                    continue
                self._drops.setdefault(peer, time.monotonic() + GOODBYE_GRACE_S)  # a goodbye on its way is heard
            elif event["event"] & HANDSHAKE_FAILURES:
                if not event["event"] & HANDSHAKE_REFUSALS:  # dropped during its handshake: libzmq dials again itself
                    if self.sockets.links is not None:  # no answer from a live process: its dial again is watched
                        self.sockets.links.handshake_dropped(peer)
                    continue
                if self.sockets.links is not None:
                    self.sockets.links.answered(peer, refused=True)
                # refused: libzmq gives up on the connection, so we retry ourselves
                delay = self.sockets.refused_by(peer, time.monotonic())
                refusals = self.sockets.handshakes.refusals(peer)
                if refusals in (4, 16, 64):  # the first few are expected while a peer joins
                    self.feed(lambda node, now: node.note(
                        f"peer {peer} refused the handshake ({refusals} time(s); it may not have read this peer's "
                        f"record yet, or the keys differ); trying again in {delay:g} s") or [])
        self.flush_notes()

    def _offer_key(self, peer: int) -> None:
        """The connection to ``peer`` is (again) made: offer it a fresh key for sealing its data to this peer."""
        offer = self.sealed.offer(peer) if self.sealed is not None else None
        if offer is not None:
            self.transport_send(TransportMessage(peer, offer, "sealed-data key offer"))

    def _drain_sealed_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self.sealed.event(monitor, event["event"], event["endpoint"].decode())
