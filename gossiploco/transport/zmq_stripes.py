"""A peer's further data connections to others (``zmq_sockets``' striping): made when data first goes to a peer over
CurveZMQ, and kept for the peers data went to most recently, a bounded pool.

CurveZMQ encrypts a connection in the one libzmq I/O thread that owns it, so a peer stripes its data to another over
``count`` DEALERs (the first one, which ``zmq_sockets`` makes with the peer and keeps, and ``count - 1`` further ones
made here), which take the data messages in turn. Made up front for every member, the further ones cost every member
a libzmq mailbox and a TCP connection each way per stripe, and a heartbeat per interval, however little data went
to it: with sealed data (``zmq_sealed``) CurveZMQ's data connections carry only the fallback, and a peer exchanges
with its groups' members, not with the swarm. So:

* A peer's further stripes are made at the first data chunk to it over CurveZMQ (``pick``), once it admitted this
  peer (``admitted``: its first data connection's handshake succeeded; dialed before, a stripe could be refused by a
  peer that admitted this one in between, and libzmq never dials again after a refusal), and only on a direct path
  (a relay's slots and link are shared; a reverse path has one listening DEALER).
* At most ``MAX_STRIPED`` peers hold further stripes. Making a new peer's closes those of the peer data went to
  least recently, if none went for ``IDLE_S``; otherwise the pool goes over its bound until one is idle (a peer in
  the middle of an exchange keeps its stripes).
* Closing gives messages still queued ``CLOSE_LINGER_S`` to go out.

Thread rules: any thread calls ``pick`` (a sender), ``due`` (whoever connects a peer), ``admitted`` (the receiving
thread), ``drop`` (whoever retires a peer's sockets); one lock guards the pool, and each stripe has its own lock, held while sending on it or closing it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

MAX_STRIPED = 32
"""Peers that may hold further data connections at once (two buckets of the default group size)."""
IDLE_S = 30.0
"""A peer's further stripes are closed to make room only when no data went on them for this long."""
CLOSE_LINGER_S = 1.0
"""What messages still queued on a stripe closed to make room get to go out."""

Stripe = tuple[zmq.Socket, threading.Lock]


class Stripes:
    """The further data DEALERs of one peer's connections; see the module docstring. ``count``: data connections per
    striped peer, the first included; ``make(peer, stripe, endpoint)``: a new DEALER for stripe ``stripe`` (1 ..
    ``count - 1``) of ``peer``, connected to ``endpoint``."""

    def __init__(self, count: int, make: Callable[[int, int, str], zmq.Socket]):
        self.count = count
        self._make = make
        self._lock = threading.Lock()
        self._due: dict[int, str] = {}  # peer -> where its further stripes will dial once it admits this peer
        self._allowed: dict[int, str] = {}  # peer -> where its further stripes dial (admitted, direct path)
        self._extra: dict[int, list[Stripe]] = {}
        self._used: OrderedDict[int, float] = OrderedDict()  # striped peer -> its last data message, oldest first
        self._turn: dict[int, itertools.count] = {}
        self.sends = [0] * count
        """Data chunks queued on each stripe so far (all peers together; for tests and diagnostics)."""
        self.opened = 0
        """Peers whose further stripes were made (again: counted each time)."""
        self.evicted = 0
        """Peers whose further stripes were closed to make room."""
        self.failed = 0
        """Peers whose further stripes could not be made (logged)."""

    def due(self, peer: int, endpoint: str) -> None:
        """``peer`` is dialed directly at ``endpoint``: its further stripes may be made once it admits this peer
        (``admitted``)."""
        if self.count > 1:
            with self._lock:
                self._due[peer] = endpoint

    def admitted(self, peer: int) -> None:
        """``peer``'s first data connection's handshake succeeded: if it is due further stripes, they may be made."""
        with self._lock:
            endpoint = self._due.pop(peer, None)
            if endpoint is not None:
                self._allowed[peer] = endpoint

    def pick(self, peer: int, first: Stripe, now: float) -> Stripe:
        """The DEALER (and its lock) the next data message to ``peer`` takes: ``first`` (its first data DEALER) or a
        further stripe, in turn; the further ones are made now if ``peer`` is allowed them and has none."""
        evicted: list[Stripe] = []
        with self._lock:
            extras = self._extra.get(peer)
            if extras is None and peer in self._allowed:
                extras = self._open(peer, now, evicted)
            if not extras:
                self.sends[0] += 1
                chosen = first
            else:
                self._used[peer] = now
                self._used.move_to_end(peer)
                stripe = next(self._turn[peer]) % (1 + len(extras))
                self.sends[stripe] += 1
                chosen = first if stripe == 0 else extras[stripe - 1]
        _close(evicted, CLOSE_LINGER_S)
        return chosen

    def _open(self, peer: int, now: float, evicted: list[Stripe]) -> list[Stripe]:
        """Make ``peer``'s further stripes; those of peers evicted to make room go into ``evicted`` (closed by the
        caller once it let go of the pool's lock). Holding ``_lock``."""
        while len(self._extra) >= MAX_STRIPED:
            oldest, used = next(iter(self._used.items()))
            if now - used < IDLE_S:
                break  # every striped peer is in use: over the bound until one is idle
            evicted += self._take(oldest)
            self.evicted += 1
        endpoint = self._allowed[peer]
        extras: list[Stripe] = []
        try:
            for stripe in range(1, self.count):
                extras.append((self._make(peer, stripe, endpoint), threading.Lock()))
        except zmq.ZMQError as exc:  # out of file descriptors, say: this peer's data keeps its first DEALER
            evicted += extras
            del self._allowed[peer]
            self.failed += 1
            log.warning("cannot make further data connections to peer %d (%s); its data keeps one connection until "
                        "it is connected afresh", peer, exc)
            return []
        self._extra[peer] = extras
        self._turn[peer] = itertools.count()
        self._used[peer] = now
        self.opened += 1
        return extras

    def _take(self, peer: int) -> list[Stripe]:
        """Remove ``peer``'s further stripes from the pool (to be closed: ``_close``). Holding ``_lock``."""
        self._used.pop(peer, None)
        self._turn.pop(peer, None)
        return self._extra.pop(peer, [])

    def drop(self, peer: int) -> None:
        """``peer``'s sockets are retired (forgotten, or made afresh): close its further stripes, messages and all, and
        forget that it was allowed any (its new first DEALER must be admitted again)."""
        with self._lock:
            self._due.pop(peer, None)
            self._allowed.pop(peer, None)
            taken = self._take(peer)
        _close(taken, 0.0)

    def connections(self, peer: int) -> int:
        """Data DEALERs carrying messages to ``peer`` now: 1, or ``count`` while it holds further stripes."""
        with self._lock:
            return 1 + len(self._extra.get(peer, ()))

    def striped(self) -> list[int]:
        """The peers holding further stripes now."""
        with self._lock:
            return sorted(self._extra)

    def close(self, linger_s: float) -> None:
        """Close every further stripe (messages already queued get ``linger_s``)."""
        with self._lock:
            taken = [stripe for peer in list(self._extra) for stripe in self._take(peer)]
        _close(taken, linger_s)


def _close(stripes: list[Stripe], linger_s: float) -> None:
    """Close each stripe under its lock (a sender on one finishes first), outside the pool's lock: a sender waiting
    on a full queue holds its stripe until its deadline, and must not hold every other sender's ``pick`` meanwhile."""
    for sock, lock in stripes:
        with lock:
            sock.close(linger=int(1000 * linger_s))
