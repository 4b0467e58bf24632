"""A barrier between processes on one machine, through files: each party writes its mark, all wait for everyone's.

Benchmarks that start many peer processes (``bench/scale_real.py``) need them to begin their first round together:
importing torch and connecting take a process seconds to tens of seconds on a loaded machine, and a peer that
started early would measure the others' start-up as its own waiting. ``FileBarrier(directory, parties)``:
``arrive(rank, note)`` writes ``directory/rank.json`` (atomically: a reader never sees half a mark),
``wait(timeout_s)`` polls until ``parties`` marks are there (a condition with a deadline, never a fixed sleep)
and says whether they are. The same directory names one barrier; use a new one per crossing (``start``, ``finish``).
Any process can read the marks (``notes``): what each party said when it arrived.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from testbed.processes import wait_until

__all__ = ["FileBarrier"]


class FileBarrier:
    """``parties`` processes meet at ``directory``; see the module docstring. Safe to use from any number of
    processes; each rank arrives once."""

    def __init__(self, directory: str | Path, parties: int, poll_s: float = 0.05):
        self.directory = Path(directory)
        self.parties = parties
        self.poll_s = poll_s

    def arrive(self, rank: int, note: dict | None = None) -> None:
        """Mark ``rank`` as arrived, with ``note`` (JSON)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{rank}.json.tmp"
        tmp.write_text(json.dumps(note or {}))
        os.replace(tmp, self.directory / f"{rank}.json")

    def arrived(self) -> int:
        """How many parties have arrived."""
        try:
            return sum(1 for name in os.listdir(self.directory) if name.endswith(".json") and not name.startswith("."))
        except FileNotFoundError:
            return 0

    def wait(self, timeout_s: float) -> bool:
        """Block until every party arrived (True) or ``timeout_s`` passed (False)."""
        return wait_until(lambda: self.arrived() >= self.parties, timeout_s, self.poll_s)

    def notes(self) -> dict[int, dict]:
        """What each party that arrived said (``arrive``'s ``note``), by rank."""
        out: dict[int, dict] = {}
        for path in self.directory.glob("*.json"):
            out[int(path.stem)] = json.loads(path.read_text())
        return out
