"""What a peer says while it waits at start for the run's ``workers`` peers (pure; no I/O).

A fresh run starts round 0 once ``workers`` peers are in, or after ``timeouts.startup_s`` with
whoever came. A user who starts fewer peers than the preset's ``workers`` would otherwise see
nothing for that long, so the waiting peer reports who is here, who is missing, when it starts
without them and the fix (``--workers N``): at once, then whenever who is here changes (at most
every ``CHANGE_EVERY_S``) and at least every ``REPORT_EVERY_S``. ``WaitingReport`` decides when,
``waiting_line`` and ``short_start_line`` say it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

REPORT_EVERY_S = 10.0
"""The longest silence while waiting."""
CHANGE_EVERY_S = 2.0
"""The shortest time between two lines (peers arriving one by one are reported together)."""
MAX_SHOWN_PEERS = 8


def _peer_list(peers: Sequence[int]) -> str:
    shown = ", ".join(str(p) for p in sorted(peers)[:MAX_SHOWN_PEERS])
    return shown + (f" and {len(peers) - MAX_SHOWN_PEERS} more" if len(peers) > MAX_SHOWN_PEERS else "")


def _fix(here: int) -> str:
    return f"Running fewer peers? Start every peer with --workers {max(here, 1)}"


def waiting_line(present: Sequence[int], workers: int, seconds_left: float) -> str:
    """``waiting for peers: 2 of 4 here (0, 1); 2 missing; starting without them in 95 s. Running fewer
    peers? Start every peer with --workers 2``. ``present``: the peer ids found (this one's included)."""
    missing = max(workers - len(present), 0)
    return (f"waiting for peers: {len(present)} of {workers} here ({_peer_list(present)}); {missing} missing; "
            f"starting without them in {max(math.ceil(seconds_left), 0)} s. {_fix(len(present))}")


def short_start_line(round_index: int, members: Sequence[int], workers: int, waited_s: float) -> str:
    """The warning of a peer that starts a fresh run with fewer than ``workers`` peers."""
    return (f"starting round {round_index} with {len(members)} of {workers} peers ({_peer_list(members)}) after "
            f"waiting {waited_s:.0f} s; the others join when they come. {_fix(len(members))}")


class WaitingReport:
    """When a waiting peer says ``waiting_line``: ``update`` returns the line when one is due, else None.
    Times are the caller's clock (``time.monotonic``), so tests drive it without waiting."""

    def __init__(self, workers: int, deadline: float):
        self.workers = workers
        self.deadline = deadline
        self._last_time: float | None = None
        self._last_present: tuple[int, ...] | None = None

    def update(self, now: float, present: Sequence[int]) -> str | None:
        here = tuple(sorted(present))
        if self._last_time is not None:
            since = now - self._last_time
            changed = here != self._last_present
            if not (since >= REPORT_EVERY_S or (changed and since >= CHANGE_EVERY_S)):
                return None
        self._last_time, self._last_present = now, here
        return waiting_line(here, self.workers, self.deadline - now)
