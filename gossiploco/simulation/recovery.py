"""Whether each restarted or resumed peer takes part in its exchanges again, soon: the simulator's
``recovery.not_mixing`` property (``invariants``).

A peer that comes back (a crash and restart, or a freeze thawed) must be in an agreed group of two or more again
within 2 rounds of the swarm. What counts as taking part:

* a group of two or more (an unmatched member of a gossip exchange's matching takes part too: the draw left it
  over);
* alone in its bucket by the draw (``protocol.groups`` with small group sizes): it took part as agreed, with nobody
  to mix with;
* alone by a matchmaker's word (``protocol.pairing``) in an exchange where a pair formed: the odd one out of those
  ready, which is ready pairing's unmatched member. Whether a pair formed is known only once another member's
  agreement completed (it may complete after this one's), so it is decided at the end of the run.

Alone because nobody else came does not count: that is what the property catches.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from gossiploco.simulation.faults import Fault


class Recovery:
    """When each peer came back, and the first round it took part in an exchange with others after that."""

    def __init__(self) -> None:
        self.returned: dict[int, tuple[float, int, Fault]] = {}
        """peer -> (when it came back, the swarm's round then, the fault it came back from)."""
        self._mixed: dict[int, int] = {}  # peer -> the first round it took part in after coming back
        self._alone: dict[int, list[tuple[int, str]]] = {}  # peer -> (round, key) a matchmaker told it it was alone
        self._paired: set[str] = set()  # exchange keys in which a pair (or larger group) formed

    def came_back(self, peer: int, now: float, swarm_round: int, fault: Fault) -> None:
        self.returned[peer] = (now, swarm_round, fault)
        self._mixed.pop(peer, None)
        self._alone.pop(peer, None)

    def grouped(self, key: str, group: Collection[int]) -> None:
        """A member completed the agreement of ``key`` with ``group``."""
        if len(group) > 1:
            self._paired.add(key)

    def took_part(self, peer: int, r: int) -> None:
        """``peer`` took part in an exchange of round ``r``."""
        if peer in self.returned and peer not in self._mixed:
            self._mixed[peer] = r

    def told_alone(self, peer: int, r: int, key: str) -> None:
        """A matchmaker told ``peer`` it was alone in exchange ``key`` of round ``r`` (counted as taking part when a
        pair formed in it: ``first_round``)."""
        if peer in self.returned and peer not in self._mixed:
            self._alone.setdefault(peer, []).append((r, key))

    def first_round(self, peer: int) -> int | None:
        """The first round ``peer`` took part in after coming back, or None."""
        rounds = [r for r, key in self._alone.get(peer, ()) if key in self._paired]
        if peer in self._mixed:
            rounds.append(self._mixed[peer])
        return min(rounds, default=None)

    def check(self, flag: Callable[[int, str], None], faults: list[Fault], down: Collection[int], alive: int,
              rounds: int, window_s: float, aftermath_s: float) -> None:
        """Flag (``flag(peer, detail)``) every peer that came back, is up (not in ``down``), had others to mix with
        (``alive`` peers up) and rounds enough left, and did not take part within 2 rounds of the swarm, unless
        another fault overlapped its recovery (``window_s`` after it came back; a fault's effects last
        ``aftermath_s`` past its end): the property is about recovering from one."""
        for peer, (when, swarm_round, cause) in self.returned.items():
            if peer in down or alive < 2 or swarm_round + 2 >= rounds:
                continue
            if any(f is not cause and f.start < when + window_s and f.end + aftermath_s > cause.start for f in faults):
                continue
            first = self.first_round(peer)
            if first is None or first > swarm_round + 2:
                flag(peer, f"came back at t={when:.2f}s (swarm in round {swarm_round}); mixed again in round {first}")
