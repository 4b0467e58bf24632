"""Links on demand for the ZeroMQ transport: which directly dialed peers have their sockets made, and when to close
them (``ZmqSockets`` with ``links_idle_s``; the protocol core's side is ``PeerTable``'s ``links_on_demand``).

A full mesh makes every member's DEALERs (data, control, sealed data) when the member is found, and keeps them: 15
file descriptors and a ZMTP heartbeat per member. With links on demand a member on a direct path is *parked*: its
endpoint and key are known, its key is admitted, and no socket is made until something is sent to it (``open``).
Its sockets are closed again (``due``'s idle list) once nothing was sent to it or received from it for ``idle_s``
and its link is up; the node hears ``idled`` (no failure, it stays a member). A link opened on demand whose
TCP connection is not taken within ``handshake_s`` (a process gone: refused; a machine gone: no answer), or whose
connection is taken but whose handshake neither succeeds nor is refused within ``PATIENCE`` handshake deadlines (a
frozen process: its kernel takes connections, nothing in it answers), is reported once (``due``'s unanswered list):
the node hears ``disconnected``, as a full mesh's heartbeat would tell it, and libzmq goes on dialing it, as it does a
dropped connection; a link that comes up later is ``connected`` again. A refused handshake (the member has not
admitted this peer yet, as when it has not read this peer's record) is an answer from a live process: not reported.
A handshake slower than one deadline but within ``PATIENCE`` of them (a peer busy starting: its ZAP handler is Python)
is waited for; one dropped by the other end's ``HANDSHAKE_IVL`` is dialed again, no failure (``link_down``), and that
dial again is watched as a link just opened (``handshake_dropped``: a process that died mid-handshake refuses it, and
is reported within a deadline; without this, such a member went unnoticed until its record expired). A member
reached through a relay is parked too (``relayed``): this peer dials its own DHT node's tunnel port for it, which
opens a stream through the member's relay when the connection comes (``reach.tunnel``), so such a link is made when
wanted as a direct one is; one whose stream cannot be opened (the member or its relay gone) is dropped by the tunnel
before its handshake, dialed again by libzmq, and reported once ``PATIENCE`` handshake deadlines passed since its
connection was first taken. A reverse path is not parked: the member behind NAT dials this peer's offered ports, so
it cannot be dialed when wanted. Each end closes its own idle
links, so a peer's link to a member may be up while the member's to it is closed: a peer leaving tells every peer it
sent to or heard from within ``lately_s`` (``lately``), not only those its own links reach, and waits for the links
it opened for that, so that none of them sees its link drop before the goodbye (a lost peer, to it). A link that
drops once unused for ``idle_s`` (its check came late) closes as idle: no failure (``link_down``).

``cap``: the most links a peer keeps made on demand. Past it, ``due`` also closes the least recently used links that
are up and unused for ``ROOM_IDLE_S``, as many as bring the count back to the cap, as idle links are closed (the
node hears ``idled``); a link used more lately is never closed for room: the peer goes over until one is unused
for that long. Links closed here keep what is queued on them for ``CLOSE_LINGER_S``. The simulator's carrier does
the same (``SimNetwork.links_cap``); at 1,000 simulated peers a cap of twice a bucket's other members holds a peer's
links to 2x a 16-peer swarm's at no measured cost (``bench/results/scale.md``, "Links on demand"). A cap bounds the
links a peer makes; those others make to it are bounded by their caps.

Pure bookkeeping with one lock, any thread; times are ``time.monotonic`` unless given.
"""

from __future__ import annotations

import threading
import time


CHECK_S = 0.25
"""``due`` looks at the links at most this often (it is asked after every poll of the receiving thread)."""
PATIENCE = 3
"""A connection taken whose handshake has neither succeeded nor been refused within this many handshake deadlines
(15 s by default) is reported: its process is frozen. A full mesh's heartbeat finds one within 6.7 s; a peer busy
starting (its ZAP handler runs in Python) gets this much longer."""


ROOM_IDLE_S = 1.0
"""A link is closed to make room (``cap``) only when nothing went over it for this long (``SimNetwork.MIN_IDLE_S``)."""
CLOSE_LINGER_S = 5.0
"""A link closed here (idle, or to make room) keeps what is still queued on it this long: the last chunks a peer sent
may still wait in its sockets' queues after the exchange ended on its side (its partner's chunks came faster than
its own went out), and dropping them would fail the partner's exchange. It bounds how long closing the transport may
wait for them (``ZmqSockets.close``)."""

UNOPENED, IDLE, LOST = "unopened", "idle", "lost"
"""What a dropped link was (``LinksOnDemand.link_down``)."""


class LinksOnDemand:
    """See the module docstring."""

    def __init__(self, idle_s: float, handshake_s: float, cap: int | None = None):
        if idle_s <= 0 or handshake_s <= 0:
            raise ValueError(f"idle_s and handshake_s must be positive, got {idle_s} and {handshake_s}")
        if cap is not None and cap < 1:
            raise ValueError(f"cap must be at least 1 (or None: no cap), got {cap}")
        self.idle_s, self.handshake_s, self.cap = idle_s, handshake_s, cap
        self._lock = threading.Lock()
        self._parked: dict[int, str] = {}  # peer -> its endpoint: no sockets
        self._last_use: dict[int, float] = {}  # peer with sockets made on demand -> its last message either way
        self._opened: dict[int, float] = {}  # peer -> when its sockets were made, until its TCP connection is taken
        self._answering: dict[int, float] = {}  # peer -> when its TCP connection was taken, until its handshake ends
        self._up: set[int] = set()  # peers whose link is up (handshake done, no drop since)
        self._members: set[int] = set()  # every peer parked once and not forgotten, whether its sockets exist or not
        self._relayed: set[int] = set()  # members parked on a relayed path (through this peer's tunnel port)
        self._numbers: dict[int, int] = {}  # peer -> how many links were made to it on demand
        self._contact: dict[int, float] = {}  # peer -> its last message either way, kept for ``lately_s`` (``lately``)
        self._checked_at = -CHECK_S
        self.opened = 0
        """Links opened on demand so far."""
        self.closed_idle = 0
        """Links closed for idleness so far (those closed to make room included)."""
        self.closed_for_room = 0
        """Links closed to make room under ``cap`` so far."""
        self.frozen = 0
        """Links reported because their connection was taken and their handshake never ended (a frozen process)."""

    def park(self, peer: int, endpoint: str, idle: bool = False, relayed: bool = False) -> None:
        """``peer`` is a member dialed at ``endpoint`` (its own, or this peer's tunnel port for it: ``relayed``) with no
        sockets (found, or its link closed ``idle``)."""
        with self._lock:
            self.closed_idle += idle
            self._members.add(peer)
            if relayed:
                self._relayed.add(peer)
            else:
                self._relayed.discard(peer)
            self._parked[peer] = endpoint
            self._last_use.pop(peer, None)
            self._opened.pop(peer, None)
            self._answering.pop(peer, None)
            self._up.discard(peer)

    def through_relay(self, peer: int) -> bool:
        """Whether ``peer`` was parked on a relayed path (its sockets, made on demand, dial a tunnel port)."""
        with self._lock:
            return peer in self._relayed

    def tracks(self, peer: int) -> bool:
        """Whether ``peer`` is on demand here (parked, or its sockets made on demand), until ``forget``."""
        with self._lock:
            return peer in self._members

    def open(self, peer: int, now: float | None = None) -> str | None:
        """Something is to be sent to ``peer``: its endpoint if it is parked (the caller makes its sockets now), else
        None (its sockets exist, or it is not on demand); either way its use is recorded."""
        now = time.monotonic() if now is None else now
        with self._lock:
            endpoint = self._parked.pop(peer, None)
            if endpoint is not None:
                self._opened[peer] = now
                self._answering.pop(peer, None)
                self._numbers[peer] = self._numbers.get(peer, 0) + 1
                self.opened += 1
            if endpoint is not None or peer in self._last_use:
                self._last_use[peer] = now
            self._contact[peer] = now
            return endpoint

    def used(self, peer: int, now: float | None = None) -> None:
        """A message went to or came from ``peer``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if peer in self._last_use:
                self._last_use[peer] = now
            self._contact[peer] = now

    @property
    def lately_s(self) -> float:
        """How long after the last message either way ``peer``'s own link to this peer may still be up: its idle
        timer started at most then (a message crossing slowly starts it later: twice ``idle_s`` covers that)."""
        return 2 * self.idle_s + 4 * CHECK_S

    def lately(self, now: float | None = None) -> list[int]:
        """The peers a message went to or came from within ``lately_s``: their links to this peer may be up although
        this peer's to them were closed (each end closes its own idle links), so a peer leaving tells them too."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return sorted(p for p, t in self._contact.items() if now - t <= self.lately_s)

    def number(self, peer: int) -> int:
        """The number of ``peer``'s latest link made on demand (0: none), which its sockets' routing ids carry
        (``security.trust.routing_id``)."""
        with self._lock:
            return self._numbers.get(peer, 0)

    def link_up(self, peer: int) -> None:
        with self._lock:
            self._opened.pop(peer, None)
            self._answering.pop(peer, None)
            if peer in self._last_use:
                self._up.add(peer)

    def link_down(self, peer: int, now: float | None = None) -> str:
        """``peer``'s link dropped. ``UNOPENED``: a link on demand that never came up (the other end dropped a
        handshake that took too long, as a peer busy starting makes it: libzmq dials again, and it is no failure).
        ``IDLE``: a link on demand up and unused for ``idle_s``, due to be closed here as idle (a check only comes
        after a poll, late when the thread is starved). A peer leaving may not have told this one (their last message
        was older than its ``lately_s``), so the drop is no failure: the link is closed as idle, and a peer gone is
        found when it is next opened (``due``'s unanswered list). ``LOST``: any other link."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if peer in self._members and peer not in self._up:
                return UNOPENED
            self._up.discard(peer)
            if peer in self._last_use and now - self._last_use[peer] >= self.idle_s:
                return IDLE
            return LOST

    def answered(self, peer: int, refused: bool = False, now: float | None = None) -> None:
        """``peer``'s end took the TCP connection (its handshake is then waited for up to ``PATIENCE`` handshake
        deadlines from the first time since the link was opened), or ``refused`` the handshake (it has not admitted
        this peer yet): a live process, not reported (the refusal's own retries, ``retry.HandshakeBackoff``, go on)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            taken = self._opened.pop(peer, None) is not None
            if refused:
                self._answering.pop(peer, None)
            elif taken:
                self._answering.setdefault(peer, now)

    def handshake_dropped(self, peer: int, now: float | None = None) -> None:
        """A connection to ``peer`` dropped before its handshake ended, with no refusal (the other end closed it: its
        ``HANDSHAKE_IVL`` ran out, or its process died mid-handshake; libzmq dials again). No answer from a live
        process: the dial again is watched as a link just opened (reported if not taken within ``handshake_s``), and a
        handshake waited for since the connection was first taken keeps that time (``PATIENCE``), so a process that
        died mid-handshake is reported, and one that keeps taking and dropping connections is too."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if peer in self._last_use and peer not in self._up:
                self._opened.setdefault(peer, now)

    def redialed(self, peer: int, now: float | None = None) -> None:
        """``peer``'s sockets made on demand were made afresh to dial it (a refused handshake tried again, or the peer
        moved: its link is not up until their handshake): watched as a link just opened, so a member that died after refusing a
        handshake is reported when the new connection is never taken, as one opened on demand is."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if peer in self._last_use:
                self._up.discard(peer)
                self._answering.pop(peer, None)
                self._opened[peer] = now

    def forget(self, peer: int) -> bool:
        """Drop all that is kept of ``peer``; True if it was parked."""
        with self._lock:
            self._last_use.pop(peer, None)
            self._opened.pop(peer, None)
            self._answering.pop(peer, None)
            self._up.discard(peer)
            self._members.discard(peer)
            self._relayed.discard(peer)
            self._numbers.pop(peer, None)
            self._contact.pop(peer, None)
            return self._parked.pop(peer, None) is not None

    def due(self, now: float | None = None) -> tuple[list[int], list[int]]:
        """(peers whose link is up and idle for ``idle_s``, or closed to make room under ``cap``: close them; peers
        opened on demand whose TCP connection was not taken within ``handshake_s``, or whose handshake neither
        succeeded nor was refused within ``PATIENCE`` handshake deadlines of its being taken: report them, once a link
        opened)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._checked_at < CHECK_S:  # the receiving thread asks after every poll: look 4 times a second
                return [], []
            self._checked_at = now
            for peer in [p for p, t in self._contact.items() if now - t > self.lately_s]:
                del self._contact[peer]  # kept no longer than needed: as many as this peer's recent contacts
            idle = sorted(p for p in self._up if now - self._last_use[p] >= self.idle_s)
            idle += self._room(now, len(self._last_use) - len(idle))
            unanswered = [p for p, t in self._opened.items() if now - t >= self.handshake_s]
            frozen = [p for p, t in self._answering.items() if now - t >= PATIENCE * self.handshake_s]
            for peer in frozen:
                self.frozen += 1
            for peer in unanswered + frozen:  # reported once: neither timer is left to report it again
                self._opened.pop(peer, None)
                self._answering.pop(peer, None)
            return idle, sorted(set(unanswered + frozen))

    def _room(self, now: float, linked: int) -> list[int]:
        """The links to close to bring ``linked`` back to ``cap``: the least recently used of those up and unused for
        ``ROOM_IDLE_S`` and not idle for ``idle_s`` already (fewer where too few are). Holding the lock."""
        if self.cap is None or linked <= self.cap:
            return []
        unused = sorted((t, p) for p, t in self._last_use.items()
                        if p in self._up and ROOM_IDLE_S <= now - t < self.idle_s)
        room = [p for _, p in unused[:linked - self.cap]]
        self.closed_for_room += len(room)
        return room

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"parked": len(self._parked), "linked": len(self._last_use), "up": len(self._up),
                    "opened": self.opened, "closed_idle": self.closed_idle, "closed_for_room": self.closed_for_room,
                    "frozen": self.frozen, "lately": len(self._contact), "relayed": len(self._relayed)}
