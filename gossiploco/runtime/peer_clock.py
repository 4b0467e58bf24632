"""Where a network peer's seconds go: computing, blocked in Mix1 and Mix2 (sync-dp: in gradient
all-reduces), measuring, and the rest of each round (``other_s``: the pseudo-gradient, the outer step,
copies, bookkeeping). Kept per record (the metrics), per round (the summary's ``round_times``) and in
total (the summary's ``total_*`` and utilizations). The caller measures; this only adds up."""

from __future__ import annotations

import time

TICKED = ("compute_s", "monitor_s")
"""Seconds counted as they happen, within rounds and between records."""


class PeerClock:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.since_record = dict.fromkeys(TICKED, 0.0)
        self.in_round = dict.fromkeys(TICKED, 0.0)
        self.rounds: list[dict] = []
        self.totals = {"compute_s": 0.0, "monitor_s": 0.0, "mix1_wait_s": 0.0, "mix2_s": 0.0, "grad_s": 0.0,
                       "other_s": 0.0, "catchup_s": 0.0, "startup_s": 0.0}

    def run_s(self) -> float:
        """Seconds since this peer started (its records' ``run_s``: when each record's step was reached, which a
        record written later, once its background measurement ends, still tells)."""
        return time.monotonic() - self.started

    def tick(self, clock: str, seconds: float) -> None:
        """``seconds`` more of ``compute_s`` or ``monitor_s``."""
        self.since_record[clock] += seconds
        self.in_round[clock] += seconds

    def add(self, total: str, seconds: float) -> None:
        """``seconds`` more in the total ``total`` (blocked in a mix, catching up...)."""
        self.totals[total] = self.totals.get(total, 0.0) + seconds

    def begin_round(self) -> None:
        self.in_round = dict.fromkeys(TICKED, 0.0)

    def end_round(self, r: int, wall_s: float, blocked: dict[str, float], steps: int | None = None) -> float:
        """Round ``r`` took ``wall_s``, of which ``blocked`` (seconds per mix) waiting for exchanges, and ran
        ``steps`` inner steps; returns its other seconds (neither ticked nor blocked) and keeps the round's split."""
        other = wall_s - sum(self.in_round.values()) - sum(blocked.values())
        self.totals["other_s"] += other
        self.rounds.append({"round": r, "s": wall_s, **self.in_round, **blocked, "other_s": other,
                            **({"steps": steps} if steps is not None else {})})
        return other

    def take_record(self) -> dict[str, float]:
        """The ticked seconds since the last record (moved into the totals)."""
        taken, self.since_record = self.since_record, dict.fromkeys(TICKED, 0.0)
        for clock, seconds in taken.items():
            self.totals[clock] += seconds
        return taken

    def summary(self, wall_s: float) -> dict:
        totals, rounds_s = dict(self.totals), self.totals.get("rounds_s", 0.0)
        return {
            "compute_utilization": totals["compute_s"] / wall_s if wall_s > 0 else 0.0,
            # Over the training rounds only (no start-up, no final measurement): what the simulator predicts.
            "round_utilization": totals["compute_s"] / rounds_s if rounds_s else 0.0,
            # The share of the rounds spent neither computing nor blocked in a mix or a measurement.
            "other_fraction": totals["other_s"] / rounds_s if rounds_s else 0.0,
            **{f"total_{k}": v for k, v in totals.items()},
            "round_times": self.rounds,
        }
