"""Deadlines that follow observed exchange times instead of one fixed guess.

A fixed deadline is wrong twice: on a fast link a dead peer holds everyone for the whole
deadline, on a slow link a healthy exchange is cut off. ``AdaptiveDeadlines`` keeps, per kind
of exchange (the key's first part: ``mix1``, ``mix2``, ``monitor``, ``grad``), the durations of
the last ``window`` successful calls, and gives the next call

    deadline = clamp(factor * max(recent durations), min_s, max_s)

once ``warmup`` calls have been seen (``max_s`` before that). Kinds are kept apart because their
payloads differ by orders of magnitude (a Mix2 subset is a fraction of Mix1's payload); so are
exchanges over a relay (``path="relayed"``: between two peers behind NAT, at half the relay's link
and a few process hops more), which deadlines learned from direct pairs would cut off (measured:
bench/results/reach.md). The
maximum, not a mean, keeps one slow but healthy exchange in the window from being judged
against fast ones. Settings live in ``[timeouts]`` (``exchange_s`` is ``max_s``,
``min_exchange_s``, ``adaptive_factor``).
"""

from __future__ import annotations

import threading
from collections import deque


def exchange_kind(key: str) -> str:
    """``"mix1/12"`` -> ``"mix1"``; ``"monitor/3/0/terms"`` -> ``"monitor"``."""
    return key.split("/", 1)[0]


class AdaptiveDeadlines:
    """Thread-safe record of recent exchange durations, per kind; see the module docstring."""

    def __init__(self, max_s: float, *, min_s: float | None = None, factor: float = 4.0, window: int = 8,
                 warmup: int = 3):
        if max_s <= 0 or factor < 1 or window < 1 or warmup < 1:
            raise ValueError(f"bad adaptive deadline settings: max_s={max_s}, factor={factor}, window={window}, warmup={warmup}")
        self.max_s = max_s
        self.min_s = max_s if min_s is None else min(min_s, max_s)
        self.factor = factor
        self.window = window
        self.warmup = warmup
        self._seen: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # its settings and durations travel (to a companion process); a lock does not
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def deadline_s(self, key: str, path: str = "") -> float:
        """Seconds the next exchange ``key`` (over ``path``: "" or "relayed") may take."""
        with self._lock:
            seen = self._seen.get(exchange_kind(key) + path)
            if seen is None or len(seen) < self.warmup:
                return self.max_s
            return min(self.max_s, max(self.min_s, self.factor * max(seen)))

    def state(self) -> dict[str, list[float]]:
        """The durations seen, per kind (a checkpoint's JSON): ``load_state`` continues with them."""
        with self._lock:
            return {kind: list(values) for kind, values in self._seen.items()}

    def load_state(self, state: dict[str, list[float]]) -> None:
        with self._lock:
            self._seen = {kind: deque((float(v) for v in values), maxlen=self.window) for kind, values in state.items()}

    def observe(self, key: str, seconds: float, path: str = "") -> None:
        """Record a successful exchange that took ``seconds`` (over ``path``)."""
        with self._lock:
            self._seen.setdefault(exchange_kind(key) + path, deque(maxlen=self.window)).append(seconds)
