"""One peer's ZeroMQ sockets: what they are, how they connect, and how a message goes out.

Peer ``i`` binds one ROUTER (everything addressed to it arrives there) and connects, per other
peer, a data DEALER (routing id ``"i.<incarnation>"``) with a monitor socket (ZMTP handshakes and
disconnects: a dead process at once, a frozen one or a silent machine after the heartbeat
timeout) and a control DEALER (routing id ``"i.<incarnation>/control"``) for ``Ready``,
``Decision`` and ``Abort``, so those never queue behind megabytes of data on a slow link. The
incarnation is random per process, so the receiver can tell a restarted peer from another
connection of the same process (see ``ROUTER_HANDOVER`` below).

Striping: CurveZMQ encrypts and decrypts a connection in the one libzmq I/O thread that owns it, so one data
connection per peer caps what a peer sends to another at one core's XSalsa20-Poly1305 rate. With ``stripes`` > 1
(default: the I/O threads, ``process_limits.default_io_threads``) a directly dialed peer gets that many data DEALERs
(routing ids ``"i.<incarnation>/d<j>"`` for j >= 1), and data chunks take them in turn: their crypto runs on as many
threads. The further ones are a bounded pool (``zmq_stripes``): made at the first chunk to a peer that admitted this
one (``connect_stripes``: the first one's handshake succeeded), kept for the peers chunks went to most recently. A
data call's chunks carry their index and wait in the receiver's mailbox until consumed, so the order they arrive in
does not matter. The first data DEALER has a monitor (liveness is the peer's, not a connection's); the control
DEALER has one for failed handshakes only (``control_monitors``); a reverse or relayed path uses the first data
DEALER alone (a relay's slots and link are shared). With ``links_idle_s`` (``zmq_links``) a member this peer dials
(direct or relayed) gets its sockets when something is sent to it and loses them when its link is idle.

Sealed data (``trust``; ``zmq_sealed``): a peer also binds a NULL-mechanism ROUTER, its sealed port, and each peer
dialing it directly sends its data messages there sealed with AES-256-GCM (keys offered over CurveZMQ) once that
connection is up: ``send`` tries that first and falls back to the CurveZMQ data DEALERs below.

Security (``trust``, always given by ``gossiploco peer``): every socket but the sealed ones speaks CurveZMQ
(encrypted and authenticated with the peers' Curve25519 keys); the ROUTER admits a client only
if its key is a member's (its ZAP handler, ``zmq_auth``), so a stranger's connection is
closed after the handshake, before any of its messages is read. ``trust=None`` is plaintext, for
the benchmarks that measure what encryption costs.

Thread rules (zmq sockets are not thread-safe): the ROUTER and the monitors belong to the one
thread that receives; each DEALER has a lock, and any thread may send on it while holding it.
Sends never block for long: ``NOBLOCK`` with a poll/retry loop bounded by the caller's deadline,
so a dead peer whose queue is full cannot hold a sender forever (``zmq_send``). When to try again, how long to wait
and when to give up (a full queue, a refused handshake) is ``gossiploco.transport.retry``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from gossiploco.errors import AddressInUse, ExchangeError, ExchangeTimeout, PeerFailed
from gossiploco.security.trust import MAX_STRIPES, Trust, routing_id
from gossiploco.protocol import codec
from gossiploco.transport.process_limits import default_io_threads, raise_open_file_limit, reuse_freed_memory
from gossiploco.transport.retry import HandshakeBackoff
from gossiploco.transport.zmq_auth import SwarmAuthenticator, secure_client, secure_server
from gossiploco.transport.zmq_links import CLOSE_LINGER_S, LinksOnDemand
from gossiploco.transport.wakeup import Waker, WakingQueue
from gossiploco.transport.zmq_sealed import SealedLinks
from gossiploco.transport.zmq_stripes import Stripes
from gossiploco.transport.zmq_send import (HANDSHAKE_FAILURES, close_leaving_monitor, close_monitored, heartbeat,
                                            router_options, send_until)

HEARTBEAT_TIMEOUT_MS = 5000
"""Default liveness timeout (``heartbeat_s`` overrides it). A heartbeat waits behind data already
queued on the connection, so it must exceed the time one chunk takes on the slowest link: a
4 MiB chunk needs 0.7 s at 50 Mbit/s but over 5 s below about 7 Mbit/s."""
RELAYED_HEARTBEAT_FACTOR = 4
"""Measured (bench/results/reach.md): a 4 MiB chunk through a relay whose link is 12.5 Mbit/s took
longer than the default 5 s, and every relayed Mix2 then lost its connection."""
HANDSHAKE_MS = 5000
"""A connection must finish its ZMTP/CURVE handshake within this long, or the ROUTER drops it."""
ROUTER_CONNECTION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
"""ROUTER monitor events the receiving thread acts on: a connection made, dropped, or (an attempt to dial) closed.
Those of inbound connections name the ROUTER's own bound address, never a reverse endpoint it dials."""


class ZmqSockets:
    """The ROUTER, DEALERs and monitors of peer ``rank``; see the module docstring.

    ``bind`` is the address to bind, ``advertised`` the one peers are told (a port of 0 in it is
    replaced by the port the OS picked: ``endpoint``). Raises ``ExchangeError`` if the bind fails.
    """

    def __init__(self, rank: int, bind: str, advertised: str, *, heartbeat_s: float | None, max_message_bytes: int,
                 chunk_bytes: int, trust: Trust | None, io_threads: int | None = None, stripes: int | None = None,
                 sealed_bind: str | None = None, links_idle_s: float = 0.0, links_cap: int | None = None):
        self.rank = rank
        self.trust = trust
        self.incarnation = uuid.uuid4().hex[:12]
        """Random per process (see the module docstring)."""
        self.heartbeat_ms = HEARTBEAT_TIMEOUT_MS if heartbeat_s is None else max(1, int(1000 * heartbeat_s))
        raise_open_file_limit()
        reuse_freed_memory()
        self.io_threads = default_io_threads() if io_threads is None else io_threads
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {self.io_threads}")
        self.ctx = zmq.Context(io_threads=self.io_threads)
        self.stripes = self.io_threads if stripes is None else stripes
        """Data connections to each directly dialed peer (module docstring: striping)."""
        if not 1 <= self.stripes <= MAX_STRIPES:
            raise ValueError(f"stripes must be in 1..{MAX_STRIPES}, got {self.stripes}")
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.auth: SwarmAuthenticator | None = None
        if trust is not None:  # the ZAP handler must run before the first client connects
            self.auth = SwarmAuthenticator(self.ctx, trust, f"rank {rank}")
            self.auth.start()
        self.sndhwm = max(8, min(1000, (256 << 20) // chunk_bytes // self.stripes))
        """Chunks each data DEALER may queue: a peer's queue toward another, all stripes together, stays at 256 MiB."""
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        router_options(self.router, max_message_bytes + codec.MAX_HEADER_BYTES, HANDSHAKE_MS)
        if trust is not None:
            secure_server(self.router, trust)
        try:
            self.router.bind(bind)
        except zmq.ZMQError as exc:
            self.router.close(linger=0)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
            error = AddressInUse if exc.errno == zmq.EADDRINUSE else ExchangeError
            raise error(f"rank {rank}: cannot bind {bind}: {exc}") from exc
        # Handshakes that fail (wrong server key, a key of no member, garbage) are counted by reason; the rest tells
        # the receiving thread when a reverse connection is made, fails or drops (``read_router_monitor``).
        self.router_monitor = self.router.get_monitor_socket(HANDSHAKE_FAILURES | ROUTER_CONNECTION_EVENTS)
        self.router_monitor.setsockopt(zmq.LINGER, 0)
        self.handshake_failures: dict[str, int] = {}
        self._failures_lock = threading.Lock()  # the receiving thread counts, any thread reads
        self.bound = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        """The address the ROUTER listens on, with the port the OS picked."""
        host, _, port = advertised.rpartition(":")
        if port in ("0", "*"):  # the port the OS picked is the one peers must be told
            port = self.router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        self.endpoint = f"{host}:{port}"
        self.dealers: dict[int, tuple[zmq.Socket, threading.Lock]] = {}
        """Each peer's first data DEALER (the one with a monitor)."""
        self.further_stripes = Stripes(self.stripes, self._stripe)
        """Each peer's further data DEALERs (``stripes - 1``): a bounded pool, on direct paths (``zmq_stripes``)."""
        self._relayed: dict[int, bool] = {}
        self._dialed: dict[int, str] = {}  # peer -> the endpoint this peer dials for it (its own, or its tunnel's)
        self._made_at: dict[int, float] = {}  # peer -> when its DEALERs were made (``renew``)
        self.controls: dict[int, tuple[zmq.Socket, threading.Lock]] = {}
        self.monitors: dict[zmq.Socket, int] = {}
        """Each peer's first data DEALER's monitor: handshakes made, failed, and connections dropped."""
        self.control_monitors: dict[zmq.Socket, int] = {}
        """Each peer's control DEALER's monitor, of failed handshakes only. libzmq never dials again after a refused
        handshake, and the two DEALERs handshake apart: a peer that admits this one between them (it just read this
        peer's record) refuses one and accepts the other. Were the control DEALER's refusal unseen, it would stay
        down (seen: a peer never heard a leader's decisions for 40 s while its data came through)."""
        self.handshakes = HandshakeBackoff()
        """The peers that refused our handshake, and when to connect to each again (the receiving thread's)."""
        self.listening: dict[int, tuple[str, str]] = {}
        """Reverse connections: peer -> the (data, control) endpoints its DEALERs listen on for it to dial."""
        self.waker = Waker()
        """Wakes the receiving thread when it is given work (``transport.wakeup``)."""
        self.new_monitors = WakingQueue(self.waker)
        """Monitors of peers added since the receiving thread last looked (it polls them)."""
        self.retired_monitors = WakingQueue(self.waker)
        """Monitors of sockets closed since the receiving thread last looked (it stops polling and closes them)."""
        self._keys: dict[int, bytes | None] = {}  # peer -> the server key its DEALERs were made with
        self._changing = threading.RLock()  # one change of a peer's sockets at a time: connect, reattach, forget
        self.links = LinksOnDemand(links_idle_s, self.heartbeat_ms / 1000, links_cap) if links_idle_s else None
        self.sealed: SealedLinks | None = None
        """With ``trust``: data chunks sealed with AES-GCM on directly dialed paths (``zmq_sealed``); this peer's
        own sealed port is bound at ``sealed_bind`` (None: none, and this peer offers no key)."""
        if trust is not None:
            try:
                self.sealed = SealedLinks(self.ctx, rank, routing_id(rank, self.incarnation, False), sealed_bind,
                                          max_frame_bytes=max_message_bytes + codec.MAX_HEADER_BYTES,
                                          heartbeat_ms=self.heartbeat_ms, sndhwm=self.sndhwm,
                                          monitors_out=self.new_monitors, monitors_retired=self.retired_monitors,
                                          wake=self.waker.wake, links_on_demand=self.links is not None)
            except zmq.ZMQError as exc:
                self.router.close(linger=0)
                self.router_monitor.close(linger=0)
                if self.auth is not None:
                    self.auth.stop()
                self.ctx.term()
                raise ExchangeError(f"rank {rank}: cannot bind the sealed port {sealed_bind}: {exc}") from exc

    def _client(self, server_key: bytes | None, control: bool, incarnation: str | None = None, stripe: int = 0,
                link: int = 0) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, routing_id(self.rank, incarnation or self.incarnation, control, stripe, link))
        if self.trust is not None:
            if server_key is None:
                sock.close(linger=0)
                raise ValueError("an encrypted connection needs the server's public key")
            secure_client(sock, self.trust, server_key)
        return sock

    def _stripe(self, peer: int, stripe: int, endpoint: str) -> zmq.Socket:
        """A further data DEALER (stripe ``stripe``) to ``peer``, dialing ``endpoint`` (``zmq_stripes``)."""
        link = self.links.number(peer) if self.links is not None else 0
        dealer = self._client(self._keys[peer], control=False, stripe=stripe, link=link)
        dealer.setsockopt(zmq.SNDHWM, self.sndhwm)
        heartbeat(dealer, self.heartbeat_ms)
        dealer.connect(endpoint)
        return dealer

    def connect(self, peer: int, endpoint: str, server_key: bytes | None, listen: str | None = None,
                relayed: bool = False) -> None:
        """A data DEALER to ``peer`` with its monitor, and a control DEALER. ``server_key``: the
        peer's Curve25519 public key (from its signed record, or derived), which is also admitted
        to this peer's ROUTER as ``peer``'s; None only without ``trust``. ``listen``
        (``tcp://HOST:0``): instead of dialing ``endpoint``, both DEALERs listen there for ``peer``'s
        ROUTER to dial them (a reverse connection, ``gossiploco.reach.paths``; see ``listening``).
        ``relayed``: the connection goes through a relay, where it gets half the relay's link at
        best, so a chunk takes longer than on a direct link: its heartbeat timeout is
        ``RELAYED_HEARTBEAT_FACTOR`` times longer (see ``HEARTBEAT_TIMEOUT_MS``)."""
        with self._changing:
            if self.links is None or listen is not None:
                return self._connect(peer, endpoint, server_key, listen, relayed)
            self._admit(peer, server_key)  # links on demand: parked until something is sent
            self.links.park(peer, endpoint, relayed=relayed)

    def open_link(self, peer: int) -> None:
        """Links on demand: make ``peer``'s sockets if it is parked (``zmq_links``); record the use either way."""
        with self._changing:
            if (endpoint := self.links.open(peer)) is not None:
                self._connect(peer, endpoint, self._keys[peer], None, self.links.through_relay(peer))

    def close_idle(self, peer: int) -> bool:
        """Links on demand: close ``peer``'s idle dialed link (what is queued gets ``CLOSE_LINGER_S``) and park it (the
        receiving thread's). True if closed."""
        with self._changing:
            if peer not in self.dealers or (endpoint := self._dialed.get(peer)) is None:
                return False
            relayed = self._relayed[peer]
            self._retire(peer, CLOSE_LINGER_S)
            self.links.park(peer, endpoint, idle=True, relayed=relayed)
            if self.sealed is not None:  # its sealed DEALER hangs up too (its keys are kept)
                self.sealed.redial(peer, None, CLOSE_LINGER_S)
        return True

    def _admit(self, peer: int, server_key: bytes | None) -> None:
        """Let ``peer``'s key in (ZAP) and keep it for the DEALERs made to it."""
        if self.auth is not None and server_key is not None:
            self.auth.allow(server_key, peer)
        self._keys[peer] = server_key

    def _connect(self, peer: int, endpoint: str, server_key: bytes | None, listen: str | None, relayed: bool) -> None:
        self._admit(peer, server_key)
        link = self.links.number(peer) if self.links is not None else 0  # each link made on demand: routing ids anew
        dealer = self._client(server_key, control=False, link=link)
        dealer.setsockopt(zmq.SNDHWM, self.sndhwm)
        heartbeat(dealer, self.heartbeat_ms * (RELAYED_HEARTBEAT_FACTOR if relayed else 1))
        # "Connected" means the ZMTP handshake succeeded: a frozen process's kernel still accepts
        # TCP connections, but only a live peer completes the handshake. The first data connection speaks for all.
        monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES
                                            | (zmq.EVENT_CONNECTED if self.links is not None else 0))
        monitor.setsockopt(zmq.LINGER, 0)
        control = self._client(server_key, control=True, link=link)
        control_monitor = control.get_monitor_socket(HANDSHAKE_FAILURES)
        control_monitor.setsockopt(zmq.LINGER, 0)
        self.dealers[peer] = (dealer, threading.Lock())
        self._relayed[peer] = relayed
        self._made_at[peer] = time.monotonic()
        self.controls[peer] = (control, threading.Lock())
        self.monitors[monitor] = peer
        self.control_monitors[control_monitor] = peer
        self.new_monitors.put(monitor)
        self.new_monitors.put(control_monitor)
        self._attach(peer, endpoint, listen)

    def _attach(self, peer: int, endpoint: str, listen: str | None) -> None:
        """Dial ``endpoint`` with the DEALERs of ``peer`` (the further data stripes too when the path is direct, once
        the first handshake succeeded: ``connect_stripes``), or listen on ``listen`` with its first data DEALER and its
        control DEALER (recording the ports)."""
        (dealer, _), (control, _) = self.dealers[peer], self.controls[peer]
        if listen is None:
            self._dialed[peer] = endpoint
        else:
            self._dialed.pop(peer, None)
        if self.sealed is not None:  # only a directly dialed path is sealed (zmq_sealed)
            self.sealed.redial(peer, self.dialed_endpoint(peer))
        if listen is None:
            dealer.connect(endpoint)
            control.connect(endpoint)
            self.listening.pop(peer, None)
            if not self._relayed[peer]:  # a relay's slots and link are shared
                self.further_stripes.due(peer, endpoint)
            return
        bound = []
        for sock in (dealer, control):
            sock.bind(listen)
            bound.append(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
        self.listening[peer] = (bound[0], bound[1])

    def _retire(self, peer: int, linger_s: float = 0.0) -> None:
        """Close ``peer``'s DEALERs under their locks (a sender racing this gets ``PeerFailed``; what is queued gets
        ``linger_s``), their monitors to the receiving thread to close (``retired_monitors``). Holds ``_changing``."""
        (dealer, lock), (control, control_lock) = self.dealers.pop(peer), self.controls.pop(peer)
        monitor = next(m for m, p in self.monitors.items() if p == peer)
        control_monitor = next(m for m, p in self.control_monitors.items() if p == peer)
        del self.monitors[monitor], self.control_monitors[control_monitor]
        with lock:
            close_leaving_monitor(dealer, linger_s)
        self.retired_monitors.put(monitor)
        self.further_stripes.drop(peer)
        with control_lock:
            close_leaving_monitor(control, linger_s)
        self.retired_monitors.put(control_monitor)
        for table in (self._relayed, self._dialed, self.listening, self._made_at):
            table.pop(peer, None)

    def reattach(self, peer: int, old: str, new: str, listen: str | None, relayed: bool | None = None) -> None:
        """``peer`` moved from ``old`` to ``new`` or changed path (listen or dial; ``relayed``: None keeps the last), or
        is dialed again after a refused handshake. Its DEALERs are made afresh: libzmq 4.3.5 carries out a
        ``disconnect`` only when the socket is next used, and a DEALER toward a peer that moved is not used again, so
        it went on redialing the old endpoint (measured: connected to a new listener there within 2 s;
        ``bench/zmq_disconnect.py``); the old ones are closed instead, dropping what is queued toward ``old``."""
        with self._changing:
            if peer not in self.dealers:
                was_relayed = self.links is not None and self.links.through_relay(peer)
                if self.links is not None and self.links.forget(peer):  # parked: parked again unless now reverse
                    self.connect(peer, new, self._keys[peer], listen, was_relayed if relayed is None else relayed)
                return
            relayed = self._relayed[peer] if relayed is None else relayed
            key = self._keys[peer]
            self._retire(peer)
            self._connect(peer, new, key, listen, relayed)
            if self.links is not None and listen is None:  # a reverse path waits for the peer to dial (paths)
                self.links.redialed(peer)

    def renew(self, peer: int, lost_at: float) -> bool:
        """``peer`` spoke while this peer's link to it is down: DEALERs dialing it directly that were made before that
        link was lost at ``lost_at`` (``time.monotonic``) are made afresh (at most once a loss). libzmq drops for good a
        connection whose other end answered with something other than ZMTP, saying only that it disconnected: a peer
        restarted on the same port first runs its dial-back check's listener there (``reach.reachability.
        NonceListener``, which sends its nonce to whoever connects), so the others' DEALERs redialing that port died
        on it and never reached the new process. True if made afresh."""
        with self._changing:
            endpoint, made = self.dialed_endpoint(peer), self._made_at.get(peer)
            if endpoint is None or made is None or made >= lost_at:
                return False
            self.reattach(peer, endpoint, endpoint, None)
        return True

    def forget(self, peer: int) -> bool:
        """Close every socket to ``peer`` and drop what is kept of it (its sealed-data keys and its admission by the
        ZAP handler included): it left the run, and nothing this peer does may keep growing with every peer that
        ever came and went. True if it was known. ``connect`` makes it anew should it come back. Any thread."""
        with self._changing:
            if peer not in self.dealers and not (self.links is not None and self.links.forget(peer)):
                return False
            if peer in self.dealers:
                self._retire(peer)
            self._keys.pop(peer, None)
            if self.auth is not None:  # its connections are refused from now on, as a stranger's
                self.auth.revoke(peer)
        if self.sealed is not None:
            self.sealed.forget(peer)
        return True

    def connect_stripes(self, peer: int) -> None:
        """The first data DEALER's handshake with ``peer`` succeeded: ``peer`` admits this peer's key, so its further
        data DEALERs may be made (at the first data message to it: ``zmq_stripes``), and are admitted. Dialed with
        the first, one of them could be refused by a peer that admitted this one between their handshakes (it just
        read this peer's record), and libzmq never dials again after a refusal: that stripe would hold every message
        given to it. By the receiving thread."""
        with self._changing:
            if peer in self.dealers:
                self.further_stripes.admitted(peer)

    def dialed_endpoint(self, peer: int) -> str | None:
        """``peer``'s endpoint while this peer dials it directly, not through a relay; else None. Any thread."""
        return None if self._relayed.get(peer) else self._dialed.get(peer)

    def data_connections(self, peer: int) -> int:
        """How many data DEALERs carry messages to ``peer`` now (its stripes in use)."""
        return self.further_stripes.connections(peer)

    def refused_by(self, peer: int, now: float) -> float:
        """``peer`` refused our handshake (libzmq then never retries): schedule a new connection
        (``HandshakeBackoff``; by the receiving thread). Returns the delay."""
        return self.handshakes.refused(peer, now)

    def retry_refused(self, now: float, endpoints: dict[int, str]) -> None:
        """Connect again to the peers whose retry time has come (by the receiving thread)."""
        for peer in self.handshakes.due(now):
            if peer in endpoints and peer in self.dealers and peer not in self.listening:  # a listener: it re-dials
                self.reattach(peer, endpoints[peer], endpoints[peer], None)

    def send(self, peer: int, frames: list, *, control: bool, deadline: float, what: str, zero_copy: bool,
             closed: Callable[[], bool], chunk: bool = False) -> zmq.MessageTracker | None:
        """Queue ``frames`` for ``peer``, retrying a full queue until ``deadline``. By default zmq copies
        the payload; with ``zero_copy`` it reads it in place until the returned tracker is done. ``chunk``: a data
        chunk, which takes the further stripes in turn (``zmq_stripes``); other data messages (hellos, state
        requests) take the first data DEALER."""
        if self.links is not None:
            self.open_link(peer)
        sockets = self.controls if control else self.dealers
        with self._changing:  # a change seen whole: ``reattach`` retires the sockets, then makes them afresh
            if peer not in sockets:
                raise PeerFailed(f"{what}: {peer} is not a known peer")
        if not control and self.sealed is not None and self.sealed.send(peer, frames, deadline=deadline, what=what,
                                                                        closed=closed):
            return None  # sealed into new buffers: the caller's memory is free again at once
        with self._changing:
            if (entry := sockets.get(peer)) is None:  # forgotten meanwhile (``forget``)
                raise PeerFailed(f"{what}: the connection to {peer} was closed")
        if chunk and not control:  # chunks take the stripes in turn (their order does not matter: module docstring)
            entry = self.further_stripes.pick(peer, entry, time.monotonic())
        dealer, lock = entry
        return send_until(dealer, lock, frames, deadline=deadline, what=what, peer=peer, rank=self.rank, closed=closed,
                          copy=not zero_copy, track=zero_copy)

    @staticmethod
    def wait_sent(trackers: list[zmq.MessageTracker], deadline: float, what: str) -> None:
        """Block until zmq has released the buffers of zero-copy sends ``trackers`` (then forget them)."""
        for tracker in trackers:
            if tracker is None or tracker.done:
                continue
            try:
                tracker.wait(max(0.001, deadline - time.monotonic()))
            except zmq.NotDone:
                raise ExchangeTimeout(f"{what}: sent data still queued at the deadline") from None
        trackers.clear()

    def check_reachable(self, timeout_s: float) -> bool:
        """True if a ZeroMQ handshake with ``endpoint`` (this peer's advertised address) succeeds within ``timeout_s``."""
        own_key = self.trust.identity.curve_public if self.trust is not None else None
        probe = self._client(own_key, control=True, incarnation=f"probe{uuid.uuid4().hex[:8]}")  # own key: admitted
        monitor = probe.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            probe.connect(self.endpoint)
            return bool(monitor.poll(int(1000 * timeout_s)))
        finally:
            probe.disable_monitor()
            monitor.close(linger=0)
            probe.close(linger=0)

    def read_router_monitor(self) -> list[tuple[int, str]]:
        """Read the ROUTER's monitor (the receiving thread does, as it owns the ROUTER): count the failed handshakes by
        reason, and return the connection events, (kind, endpoint), in order (``ROUTER_CONNECTION_EVENTS``)."""
        connections: list[tuple[int, str]] = []
        while True:
            try:
                event = recv_monitor_message(self.router_monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return connections
            if event["event"] & ROUTER_CONNECTION_EVENTS:
                connections.append((event["event"], event["endpoint"].decode(errors="replace")))
                continue
            name = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake protocol error"}.get(event["event"],
                                                                                        "handshake failed")
            with self._failures_lock:
                self.handshake_failures[name] = self.handshake_failures.get(name, 0) + 1

    def refused_connections(self) -> dict[str, int]:
        """Failed handshakes and ZAP refusals of inbound connections, by reason."""
        with self._failures_lock:
            counts = dict(self.handshake_failures)
        if self.auth is not None:
            counts.update(self.auth.refusals())
        return counts

    def close_router(self) -> None:
        """Close the ROUTER, the sealed port and the ROUTER's monitor (by the receiving thread, which owns them)."""
        if self.sealed is not None:
            self.sealed.close_router()
        try:
            self.router.disable_monitor()
        except zmq.ZMQError:
            pass
        self.router_monitor.close(linger=0)
        self.router.close(linger=0)

    def close(self, linger_s: float) -> None:
        """Close every DEALER (messages already queued get ``linger_s``) and the context. The ROUTER
        must be closed first, by its thread (``router.close``)."""
        monitors = {peer: monitor for monitor, peer in self.monitors.items()}
        control_monitors = {peer: monitor for monitor, peer in self.control_monitors.items()}
        for peer, (dealer, lock) in self.dealers.items():
            close_monitored(dealer, lock, monitors[peer], linger_s)
        self.further_stripes.close(linger_s)
        for peer, (control, lock) in self.controls.items():
            close_monitored(control, lock, control_monitors[peer], linger_s)
        while not self.retired_monitors.empty():  # the receiving thread has ended: nobody polls these any more
            self.retired_monitors.get().close(linger=0)
        if self.sealed is not None:
            self.sealed.close(linger_s)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        self.waker.close()
