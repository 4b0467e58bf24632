"""What the command line prints about runs: live progress (a redrawn table on a terminal, a plain line at
most every ``PLAIN_EVERY_S`` seconds when the output goes to a pipe or a file) and the final tables."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

PLAIN_EVERY_S = 10.0
"""Longest silence of a run whose output is not a terminal (a log file, CI, ``| tee``)."""


class PlainProgress:
    """Progress as plain lines, for a console that is not a terminal (where a redrawn bar or table shows
    nothing until the end): the first line at once, then one every ``every_s`` seconds, and one whenever the
    ``milestone`` (a new round) changes."""

    def __init__(self, console: Console, every_s: float = PLAIN_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.console, self.every_s, self.clock = console, every_s, clock
        self.started = clock()
        self._last: float | None = None
        self._milestone: object = None

    def update(self, text: str, milestone: object = None) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s and milestone == self._milestone:
            return
        self._last, self._milestone = now, milestone
        self.console.print(f"[{now - self.started:6.0f} s] {text}", highlight=False, soft_wrap=True)


def _fmt(record: dict, key: str, spec: str) -> str:
    value = record.get(key)
    return "" if value is None else format(value, spec)


def _state(exit_code: int | None) -> str:
    return "running" if exit_code is None else ("done" if exit_code == 0 else f"exit {exit_code}")


def progress_table(progress: dict, rounds: int) -> Table:
    """The live table of ``gossiploco swarm``: each peer's latest record (``LocalSwarm.progress``)."""
    table = Table(title="gossiploco swarm", caption="Ctrl+C stops every peer")
    for column in ("peer", "round", "loss", "val loss", "CD_L2", "CD_JS", "members", "state"):
        table.add_column(column, justify="right")
    for rank, p in sorted(progress.items()):
        r = p.record
        table.add_row(str(rank), f"{r.get('round', '-')}/{rounds}", _fmt(r, "loss", ".3f"), _fmt(r, "val_loss", ".3f"),
                      _fmt(r, "cd_l2", ".3g"), _fmt(r, "cd_js", ".3g"), str(r.get("members", "")), _state(p.exit_code))
    return table


def slowest_round(progress: dict) -> int | None:
    """The round of the peer furthest behind (None before any peer has measured anything)."""
    records = [p.record for p in progress.values() if p.record]
    return min(r.get("round", 0) for r in records) if records else None


def progress_line(progress: dict, rounds: int) -> str:
    """The same as one line: the slowest peer's round, the latest losses, how many peers run."""
    records = [p.record for p in progress.values() if p.record]
    reached = slowest_round(progress)
    if reached is None:
        return f"swarm: {len(progress)} peers starting (finding each other, loading data)"
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    running = sum(p.exit_code is None for p in progress.values())
    text = f"swarm: round {reached}/{rounds}"
    if losses:
        text += f", loss {sum(losses) / len(losses):.3f}"
    if vals:
        text += f", val loss {sum(vals) / len(vals):.3f}"
    return text + f"; {running} of {len(progress)} peers running"


def print_summary(summaries: list[dict]) -> None:
    """The final table of ``simulate`` and ``peer`` (one row per run), on stdout."""
    table = Table(title="gossiploco")
    for column in ("config", "workers", "H", "rounds", "val loss", "val ppl", "max CD_L2", "max CD_JS", "tokens", "wall s"):
        table.add_column(column, justify="right")
    for s in summaries:
        tokens = s.get("swarm_tokens", s.get("tokens"))  # simulate: the swarm's; peer: its own
        table.add_row(s["config"], str(s["workers"]), str(s["inner_steps"]), str(s["rounds"]), f"{s['final_val_loss']:.4f}",
                      f"{s['final_val_ppl']:.3f}", f"{s['max_cd_l2']:.4g}", f"{s['max_cd_js']:.4g}",
                      "" if tokens is None else f"{tokens:,}", f"{s['wall_s']:.1f}")
    _stdout().print(table)


def print_swarm_summary(summary: dict) -> None:
    """The final table of ``gossiploco swarm``: what differs between peers (one row each), then what they share
    (the averaged model's validation loss) once."""
    table = Table(title=f"gossiploco swarm: {summary.get('config')} ({summary.get('run_id')})")
    for column in ("peer", "exit", "rounds", "members", "mix failures", "catch-ups", "MB sent", "compute util", "wall s"):
        table.add_column(column, justify="right")
    for p in summary["per_peer"]:
        s = p["summary"] or {}
        rounds = s.get("round_reached", s.get("rounds")) if s else None
        failures = s.get("mix1_failures", 0) + s.get("mix2_failures", 0) + s.get("grad_failures", 0) if s else None
        util = s.get("compute_utilization")
        table.add_row(str(p["rank"]), _state(p["exit_code"]), "" if rounds is None else str(rounds),
                      str(s.get("workers", "")), "" if failures is None else str(failures), str(s.get("catchups", "")),
                      "" if s.get("bytes_sent") is None else f"{s['bytes_sent'] / 1e6:.1f}",
                      "" if util is None else f"{util:.0%}", "" if s.get("wall_s") is None else f"{s['wall_s']:.1f}")
    out = _stdout()
    out.print(table)
    loss, spread = summary.get("final_val_loss"), summary.get("final_val_loss_spread")
    if loss is None:
        out.print("no peer finished: no final validation loss")
        return
    import math

    agree = "one averaged model" if spread == 0 else f"spread {spread:.2g} between peers"
    out.print(f"final val loss {loss:.4f} (ppl {math.exp(min(loss, 50.0)):.3f}) over {summary['finished']} finished "
              f"peer(s): {agree}; tokens seen by the swarm {summary.get('swarm_tokens', 0):,}")


def _stdout() -> Console:
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
