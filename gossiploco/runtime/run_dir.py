"""A run's output directory: never overwrite a run by accident, find what ``--resume`` continues.

A directory *holds a run* when it has metrics, a summary, checkpoints or peer directories in it.
Without ``--resume``: an ``--out`` given explicitly that holds a run is refused (saying how to
continue it or where else to write); the default directory (``runs/simulate``, ``runs/swarm``...)
moves on to the first free ``-2``, ``-3``... so running the same command twice keeps both runs.
With ``--resume``: the given ``--out``, or the newest of the default directories, is continued.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from gossiploco.checkpoint import Checkpoint, check_compatible, latest_checkpoint, run_checkpoints
from gossiploco.errors import ConfigError

log = logging.getLogger(__name__)

RUN_MARKERS = ("metrics.jsonl", "summary.json", "checkpoints", "model.safetensors")


def holds_run(directory: Path) -> bool:
    directory = Path(directory)
    return directory.is_dir() and (any((directory / m).exists() for m in RUN_MARKERS)
                                   or any(directory.glob("peer-*/metrics.jsonl")))


def _numbered(default: Path) -> list[Path]:
    """``default`` and its numbered siblings (``default-2``, ...), in order."""
    pattern = re.compile(re.escape(default.name) + r"(?:-(\d+))?$")
    found = []
    if default.parent.is_dir():
        for p in default.parent.iterdir():
            m = pattern.fullmatch(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1) or 1), p))
    return [p for _, p in sorted(found)]


def output_dir(out: Path | None, default: Path, resume: bool) -> Path:
    """The directory a run writes to (see the module docstring)."""
    if resume:
        if out is not None:
            return Path(out)
        runs = [p for p in _numbered(default) if holds_run(p)]
        if not runs:
            raise ConfigError("--resume", f"no run to resume in {default} (give --out DIR of the run to continue)")
        return runs[-1]
    if out is not None:
        if holds_run(out):
            raise ConfigError("--out", f"{out} already holds a run; add --resume to continue it, or give another "
                                       "--out (nothing there is overwritten)")
        return Path(out)
    candidate, n = default, 1
    while holds_run(candidate):
        n += 1
        candidate = default.with_name(f"{default.name}-{n}")
    return candidate


def resume_checkpoint(out: Path, config: dict) -> Checkpoint | None:
    """The newest intact checkpoint of the run in ``out``, checked against ``config``; None when the run
    stopped before its first checkpoint (killed in round 0): it starts again at round 0, said in a warning."""
    checkpoint = latest_checkpoint(run_checkpoints(out))
    if checkpoint is None:
        log.warning("%s has no checkpoint (the run stopped before writing one): starting again at round 0", out)
        return None
    check_compatible(checkpoint, config)
    return checkpoint
