"""When the ZeroMQ driver tries again, how long it waits, and when it gives up: pure, no sockets, no clock.

Two things are retried (times are ``time.monotonic`` seconds, passed in by the caller):

* A send whose queue is full (the peer is not taking data as fast as it comes): the sender waits for
  room, at most ``SEND_RETRY_S`` at a time so that it notices a close soon, and gives up at the caller's
  deadline (``send_wait_s``). Any other send error is not retried: the peer is taken to have failed.
* A connection whose handshake the peer refused: libzmq never retries it, so the driver connects again
  itself (``HandshakeBackoff``), soon at first (the peer may not have read this peer's record yet: a
  refusal is expected while a peer joins), then backing off: ``RETRY_FIRST_S`` doubled per refusal in a
  row, at most ``RETRY_MAX_S``. A handshake that succeeds starts the count again. It never gives up: a
  refusing peer is tried every ``RETRY_MAX_S`` for as long as it is a member. A message from a refusing peer hurries
  the next try (``HandshakeBackoff.hurry``): a peer connects to another only once it admitted that one's key, so its
  first message says the next handshake will succeed (once per refusal: a peer that talks but still refuses is
  tried at most twice as often as the backoff says).
* A reverse connection (a peer behind NAT's ROUTER dials the ports a reachable peer listens on for it) that failed
  or dropped: libzmq's own redialing starts again at 100 ms after every TCP connection, handshake or not (an
  endpoint that accepts and refuses the handshake was dialed 10 times a second), so the driver turns it off and
  redials the endpoints it still wants itself (``Redials``): ``REDIAL_FIRST_S`` after a loss, doubling per loss
  since the last handshake, at most ``REDIAL_MAX_S``; an endpoint no longer wanted (its peer moved or was
  forgotten) is never dialed again.
"""

from __future__ import annotations

from collections.abc import Hashable

SEND_RETRY_S = 0.05
"""Longest wait between two tries of a send whose queue is full."""
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 8.0
"""After a refused handshake: the first new try, and the longest wait between tries."""
REDIAL_FIRST_S, REDIAL_MAX_S = 0.1, 2.0
"""After a reverse connection failed or dropped: the first redial (libzmq's own reconnect interval), and the longest
wait between redials (a connection that dropped for a moment is back within this much)."""


def send_wait_s(deadline: float, now: float, step_s: float = SEND_RETRY_S) -> float | None:
    """How long to wait for room in a full send queue before the next try, at ``now``: at most ``step_s``
    and never past ``deadline``; None when the deadline has come (give up)."""
    remaining = deadline - now
    if remaining <= 0:
        return None
    return min(remaining, step_s)


def refused_delay_s(refusals: int, first_s: float = RETRY_FIRST_S, max_s: float = RETRY_MAX_S) -> float:
    """Seconds until the next connection after ``refusals`` (>= 1) refused handshakes in a row:
    ``first_s``, doubling per refusal, at most ``max_s``."""
    if refusals < 1:
        raise ValueError(f"refusals must be at least 1, got {refusals}")
    return min(max_s, first_s * 2 ** (refusals - 1))


class HandshakeBackoff:
    """The peers whose handshake was refused: how many times in a row, and when to connect to each again. A peer is
    any hashable key (``Redials`` keys endpoints).

    Not thread-safe: one thread (the ZeroMQ driver's receiving thread, which sees the handshakes) owns it.
    Nothing blocks.
    """

    def __init__(self, first_s: float = RETRY_FIRST_S, max_s: float = RETRY_MAX_S):
        self.first_s, self.max_s = first_s, max_s
        self._refusals: dict[Hashable, int] = {}  # refusals in a row, per peer (until a handshake succeeds)
        self._retry_at: dict[Hashable, float] = {}  # when to connect again, per peer waiting to
        self._hurried: set[Hashable] = set()  # peers whose try was hurried since their last refusal

    def refused(self, peer: Hashable, now: float) -> float:
        """``peer`` refused a handshake at ``now``: schedule the next connection; the delay until it. One try counts
        once: a refusal while the next try is already scheduled (another of its sockets, refused in the same try)
        changes nothing."""
        if peer in self._retry_at:  # another socket's refusal of the same try (each try dials all of the peer's)
            return max(0.0, self._retry_at[peer] - now)
        count = self._refusals.get(peer, 0) + 1
        self._refusals[peer] = count
        delay = refused_delay_s(count, self.first_s, self.max_s)
        self._retry_at[peer] = now + delay
        self._hurried.discard(peer)
        return delay

    def hurry(self, peer: Hashable, now: float) -> bool:
        """``peer``, which refused a handshake, says it has admitted this peer since (a message came from it): bring
        its next try forward to ``now``, once per refusal. True if it was brought forward."""
        at = self._retry_at.get(peer)
        if at is None or at <= now or peer in self._hurried:
            return False
        self._retry_at[peer] = now
        self._hurried.add(peer)
        return True

    def succeeded(self, peer: Hashable) -> None:
        """A handshake with ``peer`` succeeded: its next refusal counts as the first again."""
        self._refusals.pop(peer, None)

    def refusals(self, peer: Hashable) -> int:
        """Handshakes ``peer`` refused in a row (0 after one succeeded)."""
        return self._refusals.get(peer, 0)

    @property
    def pending(self) -> bool:
        """Whether a connection is scheduled."""
        return bool(self._retry_at)

    def cancel(self, peer: Hashable) -> None:
        """Forget ``peer``: no connection scheduled, no refusal counted."""
        self._refusals.pop(peer, None)
        self._retry_at.pop(peer, None)
        self._hurried.discard(peer)

    def due(self, now: float) -> list[Hashable]:
        """The peers whose time to connect again has come by ``now``, in the order they were scheduled; each
        is returned once (until it refuses again)."""
        peers = [peer for peer, at in self._retry_at.items() if at <= now]
        for peer in peers:
            del self._retry_at[peer]
            self._hurried.discard(peer)
        return peers


class Redials:
    """The endpoints a socket dials itself, with libzmq's redialing off (its ``RECONNECT_IVL`` is -1): which are still
    wanted, and when to dial each again after its connection failed or dropped (module docstring).

    Not thread-safe: the thread that owns the socket (the receiving thread, for the ROUTER) owns it. Nothing blocks.
    """

    def __init__(self, first_s: float = REDIAL_FIRST_S, max_s: float = REDIAL_MAX_S):
        self._wanted: set[str] = set()
        self._backoff = HandshakeBackoff(first_s, max_s)

    def want(self, endpoint: str) -> None:
        """``endpoint`` is dialed now (by the caller) and wanted until ``drop``: its failures count from none."""
        self._wanted.add(endpoint)
        self._backoff.cancel(endpoint)

    def drop(self, endpoint: str) -> None:
        """``endpoint`` is no longer wanted (the caller disconnects it): never dialed again, whatever it reports."""
        self._wanted.discard(endpoint)
        self._backoff.cancel(endpoint)

    def wanted(self, endpoint: str) -> bool:
        return endpoint in self._wanted

    def lost(self, endpoint: str, now: float) -> float | None:
        """A connection attempt to ``endpoint`` failed, or its connection dropped, at ``now``: the delay until it is
        due again (doubling per loss since its last handshake); None when it is not wanted (nothing to do)."""
        if endpoint not in self._wanted:
            return None
        return self._backoff.refused(endpoint, now)

    def up(self, endpoint: str) -> None:
        """A handshake with ``endpoint`` succeeded: its next loss is redialed after ``first_s`` again."""
        self._backoff.succeeded(endpoint)

    def losses(self, endpoint: str) -> int:
        """Losses of ``endpoint`` in a row since its last handshake."""
        return self._backoff.refusals(endpoint)

    @property
    def pending(self) -> bool:
        return self._backoff.pending

    def due(self, now: float) -> list[str]:
        """The wanted endpoints to dial again by ``now``, each once (until it is lost again)."""
        return [e for e in self._backoff.due(now) if e in self._wanted]
