"""Strikes and exclusion: a member whose contributions keep failing the screen stops counting.

Robust mixing (``gossiploco.mixing.robust``) bounds what one lying contribution can do; the ledger ends the
lying. Each peer keeps its own: every screen failure it sees (as a segment's owner, as a gossip partner, or
as a receiver of two owners' disagreeing results) is a strike against that member in that round, and a
member with strikes in ``strikes`` of the last ``window`` rounds is **excluded**: from then on this peer
gives it weight 0 in every aggregate it computes and mixes with it in no pair. The reason is logged once,
as a warning, and kept for the summary's ``security`` section. Members are keyed by their rank, which a
joined peer derives from its identity (its public key), so an excluded member that leaves and rejoins with
the same identity is still excluded; a new identity starts with a clean record (in an open run identities
are free: exclusion ends a liar's influence for the life of its identity, robust aggregation bounds it
before that). Thread-safe: Mix1's thread and Mix2's both report.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque

log = logging.getLogger(__name__)

STRIKES = 3
WINDOW = 5


class Ledger:
    """One peer's record of the members' screen failures and of whom it excluded (module docstring)."""

    def __init__(self, strikes: int = STRIKES, window: int = WINDOW):
        self.strikes, self.window = strikes, window
        self._lock = threading.Lock()
        self._rounds: dict[int, deque[int]] = {}
        self._excluded: dict[int, str] = {}
        self._failures: Counter[int] = Counter()
        self._reasons: dict[int, str] = {}
        self._disagreements = 0
        self._pairs: dict[tuple[int, int], int] = {}

    def excluded(self) -> set[int]:
        with self._lock:
            return set(self._excluded)

    def is_excluded(self, member: int) -> bool:
        with self._lock:
            return member in self._excluded

    def strike(self, round_index: int, member: int, reason: str) -> None:
        """``member``'s contribution to round ``round_index`` failed the screen for ``reason``."""
        with self._lock:
            self._failures[member] += 1
            self._reasons[member] = reason
            rounds = self._rounds.setdefault(member, deque(maxlen=self.window))
            if round_index not in rounds:
                rounds.append(round_index)
            recent = [r for r in rounds if r > round_index - self.window]
            if member in self._excluded or len(recent) < self.strikes:
                return
            why = (f"failed the screen in {len(recent)} of the last {self.window} rounds "
                   f"(last: round {round_index}, {reason})")
            self._excluded[member] = why
        log.warning("excluding peer %s from mixing: %s", member, why)

    def disagreement(self, round_index: int, owners: tuple[int, int], what: str) -> None:
        """The two owners of a segment sent different results (one of them lied, a sender sent them different
        values, or their exclusions differ): counted and logged, nobody struck (``robust_mean``)."""
        with self._lock:
            self._disagreements += 1
            pair = self._pairs[owners] = self._pairs.get(owners, 0) + 1
        if pair & (pair - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... time for this pair: no flood of warnings
            log.warning("round %d: the owners %s of %s disagree (%d time(s) so far); that segment takes the median "
                        "of their results and this peer's own", round_index, owners, what, pair)

    def summary(self) -> dict:
        """The summary's ``security`` entries of robust mixing."""
        with self._lock:
            return {"screen_failures": {str(m): n for m, n in sorted(self._failures.items())},
                    "last_screen_failure": {str(m): r for m, r in sorted(self._reasons.items())},
                    "excluded": {str(m): why for m, why in sorted(self._excluded.items())},
                    "owner_disagreements": self._disagreements}
