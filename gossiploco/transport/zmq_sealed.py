"""The sealed data path: data chunks sealed with AES-256-GCM (``transport.sealed``) over NULL-mechanism sockets.

With ``trust`` each peer may bind a second ROUTER, the *sealed port* (``bind``: a ``tcp://HOST:PORT``, port 0
for any), whose connections carry no CurveZMQ: every message on it is sealed, and opened (or refused) with
the keys this peer issued (``Opener``). A peer R offers each member S a key once its CurveZMQ connection to S
is up (``offer``; the receiver thread hands the frames to the service thread, which sends them on R's control
connection). S then dials R's sealed port, at the host it already dials R at (``accept``), with one DEALER
that has no routing id of its own (the ROUTER names it: nothing a passive observer reads off the wire can be
replayed to take the connection over) and ZMTP heartbeats, and from the moment its handshake succeeded sends
its data chunks to R there (``send``). The sender's routing id travels as the first sealed frame, so the
receiver admits the message exactly as one from R's CurveZMQ data connection (``admission``), authenticated
by the key instead of by ZAP.

The sealed port admits connections only from addresses a member's CurveZMQ connection came from (``zmq_auth``); a
sealed DEALER refused because its member's CurveZMQ connection was not admitted yet dials again with backoff
(``refusals``: libzmq gives up on a refused handshake).

Only a directly dialed path is sealed (``dial``; a reverse or relayed connection keeps CurveZMQ: a relay
forwards one port). When the sealed connection is not up (not yet, refused by a firewall that forwards only
the main port, dropped) data goes over CurveZMQ as before: ``send`` returns False and the caller sends it
there. Control messages, hellos, state uploads and the keys themselves always use CurveZMQ.

Thread rules: the ROUTER, ``opener``, the monitors and the making and dialing of DEALERs (``dial_pending``) belong
to the receiving thread; any thread may ask for a path change (``dial``, ``redial``: the link counts as down at
once, so a sender waiting on a full queue gives up the sealed path). Each DEALER has a lock, which ``send`` holds
while it sends and ``dial_pending`` only tries to take: the receiving thread never waits for a sender, and
applies a change its sender held up on a later poll. ``sealer`` is thread-safe.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import zmq

from gossiploco.errors import ExchangeTimeout, PeerFailed
from gossiploco.transport.retry import HandshakeBackoff
from gossiploco.transport.sealed import KEEP_KEYS, LINKS_KEEP_KEYS, MAX_FRAMES, TAG_BYTES, Opener, Sealer, offer_frames
from gossiploco.transport.zmq_auth import SEALED_DOMAIN
from gossiploco.transport.zmq_send import (HANDSHAKE_FAILURES, HANDSHAKE_REFUSALS, GaveUp, close_leaving_monitor,
                                            close_monitored, heartbeat, send_until)

RECONNECT_MAX_MS = 10_000
"""A sealed port that does not answer (a firewall) is dialed again at most this often once backoff grew."""
POOLED_MIN_BYTES = 1 << 16
"""Frames at least this large are sealed into pooled buffers (``BufferPool``); smaller ones into new ``bytes``."""
POOL_KEEP = 8
"""Free buffers a pool keeps (each the size of the largest sealed frame so far, a chunk: 32 MiB at 4 MiB chunks)."""
MAX_SENDING = 16
"""Sealed buffers queued in zmq toward one peer at once (64 MiB at 4 MiB chunks); a sender sealing more for that peer
waits for the oldest to go out (per peer: a frozen peer's full queue holds back nobody else's). Plaintext chunks
are sent in place, sealed ones are copies: without a bound, a ring step queues a whole segment's ciphertext
(measured: 0.45 of the payload in extra peak memory)."""


class BufferPool:
    """Reused buffers to seal large frames into. A fresh 4 MiB buffer per chunk faulted in a page per 4 KiB
    (measured: 20,000 more page faults per 100 MB sent, as much system time as the AES-GCM pass itself). zmq
    reads a buffer in place until the message's tracker is done (``retire``); only then is it reused. Thread-safe."""

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._sending: dict[int, list[tuple[zmq.MessageTracker, list[bytearray]]]] = {}  # peer -> queued in zmq
        self._lock = threading.Lock()

    def take(self, nbytes: int, taken: list[bytearray]) -> memoryview | None:
        """A writable view of exactly ``nbytes`` (None for a small frame), its buffer added to ``taken``."""
        if nbytes < POOLED_MIN_BYTES:
            return None
        with self._lock:
            self._reap()
            fitting = next((i for i, b in enumerate(self._free) if len(b) >= nbytes), None)
            buffer = self._free.pop(fitting) if fitting is not None else None
        if buffer is None:
            buffer = bytearray(nbytes)
        taken.append(buffer)
        return memoryview(buffer)[:nbytes]

    def wait_room(self, peer: int, deadline: float, what: str) -> None:
        """Until fewer than ``MAX_SENDING`` sealed buffers are queued in zmq toward ``peer``; ``ExchangeTimeout`` at
        ``deadline``."""
        while True:
            with self._lock:
                self._reap()
                sending = self._sending.get(peer, [])
                if sum(len(taken) for _, taken in sending) < MAX_SENDING:
                    return
                oldest = sending[0][0]
            try:
                oldest.wait(max(0.001, min(0.1, deadline - time.monotonic())))
            except zmq.NotDone:
                if time.monotonic() >= deadline:
                    raise ExchangeTimeout(f"{what}: sealed data still queued at the deadline") from None

    def retire(self, peer: int, tracker: zmq.MessageTracker | None, taken: list[bytearray]) -> None:
        """``taken`` go back to the pool once ``tracker`` (of a message to ``peer``) is done (None: not sent; at once)."""
        if not taken:
            return
        with self._lock:
            if tracker is None:
                self._keep(taken)
            else:
                self._sending.setdefault(peer, []).append((tracker, taken))
                self._reap()

    def _reap(self) -> None:
        for peer, sending in list(self._sending.items()):
            done = [entry for entry in sending if entry[0].done]
            for entry in done:
                sending.remove(entry)
                self._keep(entry[1])
            if not sending:
                del self._sending[peer]

    def _keep(self, buffers: list[bytearray]) -> None:
        self._free.extend(buffers)
        del self._free[:-POOL_KEEP]


class SealedLinks:
    """One peer's sealed port and its sealed DEALERs to others; see the module docstring.

    ``bind``: where to bind the sealed ROUTER (None: this peer offers no key, but still uses others' offers);
    ``max_frame_bytes``: the largest plaintext frame; ``heartbeat_ms``/``sndhwm``: as on the CurveZMQ data
    DEALERs; ``monitors_out``: where new monitor sockets are announced to the receiving thread.
    """

    def __init__(self, ctx: zmq.Context, rank: int, routing: bytes, bind: str | None, *, max_frame_bytes: int,
                 heartbeat_ms: int, sndhwm: int, monitors_out, monitors_retired=None,
                 wake: Callable[[], None] = lambda: None, links_on_demand: bool = False):
        self.ctx = ctx
        self.rank = rank
        self.routing = routing
        """This peer's data routing id, sealed into every message (``admission`` reads it)."""
        self.heartbeat_ms = heartbeat_ms
        self.sndhwm = sndhwm
        self.monitors_out = monitors_out
        self.monitors_retired = monitors_retired if monitors_retired is not None else queue.SimpleQueue()
        """Monitors of DEALERs closed (``forget``), for the receiving thread to stop polling and close (default: a
        queue of its own, for an owner that never forgets a peer)."""
        self.wake = wake
        """Wakes the receiving thread when a dial or a forgotten peer waits for it (``transport.wakeup``)."""
        self.opener = Opener(LINKS_KEEP_KEYS if links_on_demand else KEEP_KEYS)  # keys issued per link made
        self.sealer = Sealer()
        self.router: zmq.Socket | None = None
        self.port: int | None = None
        """The sealed port other peers dial (None: none bound)."""
        self.dealers: dict[int, tuple[zmq.Socket, threading.Lock]] = {}
        self.monitors: dict[zmq.Socket, int] = {}
        self._dialed: dict[int, str] = {}  # peer -> the sealed endpoint its DEALER dials
        self._connected: dict[int, str] = {}  # peer -> the sealed endpoint whose handshake succeeded, until it drops
        self._pending: dict[int, str | None] = {}  # peer -> an endpoint to dial (None: hang up) not applied yet
        self._again: set[int] = set()  # pending peers to dial again at the same endpoint (after a refusal)
        self._forgotten: set[int] = set()  # peers whose DEALER the receiving thread is to close (``forget``)
        self._linger: dict[int, float] = {}  # peer -> how long its DEALER, when next closed, keeps what is queued
        self._state = threading.Lock()  # guards the six above (senders read them)
        self.refusals = HandshakeBackoff()
        """Sealed ports that refused our handshake, and when to dial each again (libzmq does not; receiving thread)."""
        self.sent = 0
        """Data messages sent sealed (for tests and diagnostics)."""
        self.pool = BufferPool()
        if bind is None:
            return
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, 1000)
        router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + TAG_BYTES)
        router.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        router.setsockopt(zmq.ZAP_DOMAIN, SEALED_DOMAIN.encode())  # members' addresses only (zmq_auth)
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        router.setsockopt(zmq.TCP_KEEPALIVE, 1)  # as the CurveZMQ ROUTER: a dead machine's connection goes in ~16 s
        router.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
        router.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 2)
        router.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        try:
            router.bind(bind)
        except zmq.ZMQError:
            router.close(linger=0)
            raise
        self.router = router
        self.port = int(router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])

    # -- the receiving thread ------------------------------------------------------------------------

    def offer(self, peer: int) -> list[bytes] | None:
        """A fresh key for ``peer`` and the control message offering it (None without a sealed port)."""
        if self.port is None:
            return None
        key_id, key = self.opener.issue(peer)
        return offer_frames(key_id, key, self.port)

    def accept(self, peer: int, frames: Sequence, endpoint: str | None) -> None:
        """Take ``peer``'s offer (frames after ``OFFER``; ``MalformedMessage`` if malformed); dial its sealed port
        at ``endpoint``'s host when ``endpoint`` (its CurveZMQ address, dialed directly) is given."""
        self.sealer.accept(peer, frames)
        self.redial(peer, endpoint)
        self.dial_pending()

    def open(self, frames: list) -> tuple[int, bytes, list]:
        """(key holder, its routing id, codec frames) of one sealed message; ``MalformedMessage`` if refused."""
        peer, plain = self.opener.open([f.buffer if hasattr(f, "buffer") else f for f in frames])
        return peer, bytes(plain[0]), plain[1:]

    def event(self, monitor: zmq.Socket, kind: int, endpoint: str) -> None:
        """A monitor event of a sealed DEALER: the handshake with ``endpoint`` succeeded, or that connection dropped."""
        peer = self.monitors.get(monitor)
        if peer is None:  # its DEALER was closed (``forget``): the monitor is on its way out
            return
        if kind & HANDSHAKE_FAILURES:
            if kind & HANDSHAKE_REFUSALS:  # refused (this peer's CurveZMQ connection not admitted there yet): retry
                self.refusals.refused(peer, time.monotonic())
            return  # else dropped during its handshake: libzmq dials again itself
        with self._state:
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected[peer] = endpoint
                self.refusals.succeeded(peer)
            elif self._connected.get(peer) == endpoint:
                del self._connected[peer]

    # -- paths -----------------------------------------------------------------------------------------

    def redial(self, peer: int, endpoint: str | None, linger_s: float = 0.0) -> None:
        """``peer``'s path is direct to ``endpoint`` (its CurveZMQ address): dial its sealed port at that host, if
        it offered one; or it is not direct (None): hang up. Any thread. ``linger_s``: as ``dial``'s."""
        port = self.sealer.port_of(peer)
        self.dial(peer, None if endpoint is None or port is None else f"{endpoint.rpartition(':')[0]}:{port}", linger_s)

    def dial(self, peer: int, endpoint: str | None, linger_s: float = 0.0) -> None:
        """Dial ``peer``'s sealed port at ``endpoint`` (None: hang up) from the next ``dial_pending`` on. The link
        counts as down at once (a sender waiting on it gives up and sends over CurveZMQ). Any thread. ``linger_s``:
        how long the DEALER closed for it keeps what is still queued (0: dropped)."""
        with self._state:
            self._pending[peer] = endpoint
            self._linger[peer] = linger_s
        self.wake()

    def forget(self, peer: int) -> None:
        """``peer`` left: drop its keys and close its DEALER (on the receiving thread's next ``dial_pending``). Any
        thread."""
        self.sealer.forget(peer)
        self.opener.forget(peer)
        with self._state:
            self._pending.pop(peer, None)
            self._forgotten.add(peer)
        self.wake()

    def _close_forgotten(self) -> None:
        """Close the DEALERs of forgotten peers whose lock is free now (a busy one waits for the next pass)."""
        with self._state:
            forgotten, self._forgotten = self._forgotten, set()
        for peer in forgotten:
            entry = self.dealers.get(peer)
            if entry is not None:
                sock, lock = entry
                if not lock.acquire(blocking=False):
                    with self._state:
                        self._forgotten.add(peer)
                    continue
                try:
                    self._retire(peer, sock)
                finally:
                    lock.release()
            with self._state:
                self._dialed.pop(peer, None)
            self.refusals.succeeded(peer)

    def _retire(self, peer: int, sock: zmq.Socket) -> None:
        """Close ``peer``'s DEALER ``sock`` (the caller holds its lock: a sender racing this finds it closed and sends
        over CurveZMQ) and hand its monitor to the receiving thread to close (``monitors_retired``)."""
        monitor = next(m for m, p in self.monitors.items() if p == peer)
        del self.monitors[monitor]
        del self.dealers[peer]
        with self._state:
            self._connected.pop(peer, None)
            linger_s = self._linger.pop(peer, 0.0)
        close_leaving_monitor(sock, linger_s)
        self.monitors_retired.put(monitor)

    def busy(self) -> bool:
        """Whether ``dial_pending`` has work: dials not applied, forgotten DEALERs to close, refusals to try again."""
        return bool(self._pending or self._forgotten or self.refusals.pending)

    def dial_pending(self) -> None:
        """Apply the dials asked for, and dial again the sealed ports that refused a handshake (by the receiving
        thread, after every poll)."""
        if self._forgotten:
            self._close_forgotten()
        with self._state:
            for peer in self.refusals.due(time.monotonic()) if self.refusals.pending else ():
                if peer in self._dialed and peer not in self._pending:
                    self._pending[peer] = self._dialed[peer]
                    self._again.add(peer)  # the same endpoint, disconnected and dialed again
            pending = list(self._pending.items())
        for peer, endpoint in pending:
            if peer not in self.dealers:
                if endpoint is None:
                    with self._state:
                        self._pending.pop(peer, None)
                        self._linger.pop(peer, None)
                    continue
                self._make_dealer(peer)
            sock, lock = self.dealers[peer]
            if not lock.acquire(blocking=False):
                continue
            try:
                with self._state:
                    if peer not in self._pending or self._pending[peer] != endpoint:
                        continue  # applied by another thread, or a newer dial came in: a later pass applies it
                    del self._pending[peer]
                    old = self._dialed.pop(peer, None)
                    if endpoint is not None:
                        self._dialed[peer] = endpoint
                    changed = old != endpoint or peer in self._again
                    self._again.discard(peer)
                if old is not None and changed:
                    # made afresh, not disconnected: libzmq carries out a ``disconnect`` only when the socket is next
                    # used, and a link toward a peer that moved is not, so its old sealed port was dialed for good
                    self._retire(peer, sock)
                    if endpoint is not None:
                        self._make_dealer(peer)
                        sock = self.dealers[peer][0]  # nobody else has it yet: no lock needed to connect it
                if endpoint is not None and changed:
                    sock.connect(endpoint)
            finally:
                lock.release()

    def _make_dealer(self, peer: int) -> None:
        sock = self.ctx.socket(zmq.DEALER)  # no ROUTING_ID: the ROUTER names the connection
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.sndhwm)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing on a connection not yet (or no longer) made
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        heartbeat(sock, self.heartbeat_ms)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES)
        monitor.setsockopt(zmq.LINGER, 0)
        self.dealers[peer] = (sock, threading.Lock())
        self.monitors[monitor] = peer
        self.monitors_out.put(monitor)

    def is_up(self, peer: int) -> bool:
        """``peer``'s sealed connection is made, to the endpoint it should dial, with no dial pending."""
        with self._state:
            dialed = self._dialed.get(peer)
            return peer not in self._pending and dialed is not None and self._connected.get(peer) == dialed

    # -- sending (any thread) --------------------------------------------------------------------------

    def send(self, peer: int, frames: list, *, deadline: float, what: str, closed: Callable[[], bool]) -> bool:
        """Seal ``frames`` for ``peer`` and queue them on its sealed connection, retrying a full queue until
        ``deadline``. False (nothing sent) when that connection is not up or ``peer`` offered no key."""
        if not self.is_up(peer) or len(frames) + 1 > MAX_FRAMES:
            return False
        self.pool.wait_room(peer, deadline, what)
        taken: list[bytearray] = []
        sealed = self.sealer.seal(peer, [self.routing, *frames], into=lambda n: self.pool.take(n, taken))
        if sealed is None:
            return False
        tracker = None
        entry = self.dealers.get(peer)
        if entry is None:  # closed since ``is_up`` (``forget``, a path change under way): CurveZMQ takes it
            self.pool.retire(peer, None, taken)
            return False
        sock, lock = entry
        try:
            tracker = send_until(sock, lock, sealed, deadline=deadline, what=what, peer=peer, rank=self.rank,
                                 closed=closed, copy=False, track=bool(taken),
                                 give_up=lambda: not self.is_up(peer))  # dropped meanwhile: CurveZMQ takes it
        except GaveUp:
            return False
        except PeerFailed:
            if sock.closed:  # made afresh or closed meanwhile (a path change, ``forget``): CurveZMQ takes it
                return False
            raise
        finally:
            self.pool.retire(peer, tracker, taken)  # not sent (tracker None): free at once
        self.sent += 1
        return True

    def close(self, linger_s: float) -> None:
        """Close the DEALERs (messages already queued get ``linger_s``) and their monitors (the ROUTER:
        ``close_router``, by the receiving thread)."""
        monitors = {peer: monitor for monitor, peer in self.monitors.items()}
        for peer, (sock, lock) in self.dealers.items():
            close_monitored(sock, lock, monitors[peer], linger_s)

    def close_router(self) -> None:
        if self.router is not None:
            self.router.close(linger=0)
