"""Training curves of one or several runs: loss, validation loss, CD_L2 and CD_JS over inner steps.

Reads a run's ``metrics.jsonl`` (a ``simulate`` output directory or a network peer's): one JSON
object per measurement with ``step`` and, where measured, ``loss`` (absent in the first
record), ``val_loss`` (round starts only), ``cd_l2`` and ``cd_js``; a missing or null field
just leaves a gap. The last panel is Figure 4 (right): the median of CD_JS over a rolling
window of records, with the window's min-max range shaded. Drawn headless (Agg) to a PNG.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gossiploco.errors import ConfigError

PANELS = (("loss", "training loss"), ("val_loss", "validation loss"), ("cd_l2", "CD_L2 (eq. 34)"), ("cd_js", "CD_JS (eq. 46)"))


@dataclass
class Run:
    """One run's records, as read from its output directory."""

    path: Path
    records: list[dict]
    summary: dict = field(default_factory=dict)
    """summary.json, when the run finished and wrote one."""
    label: str = ""
    """Legend entry: the directory name, plus the summary's config name when it differs."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records that carry ``key`` with a value."""
        points = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        return [s for s, _ in points], [v for _, v in points]


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file; ``ConfigError`` naming the file (and line) when
    it is empty, a line is not a JSON object, or a record has no ``step``."""
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}", f"malformed JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{lineno}", f"expected a JSON object, got {type(record).__name__}")
            if not isinstance(record.get("step"), int):
                raise ConfigError(f"{path}:{lineno}", "record has no integer 'step' field")
            records.append(record)
    if not records:
        raise ConfigError(str(path), "no records (empty file)")
    return records


def load_run(run_dir: str | Path) -> Run:
    """A run directory's metrics and summary. ``ConfigError`` when the directory or its
    ``metrics.jsonl`` is missing, empty or malformed (see ``read_metrics``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(str(run_dir), "no such run directory")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(str(run_dir), "no metrics.jsonl in this directory or its peer-N directories (not the output "
                          "directory of simulate, peer or swarm?)")
    records = read_metrics(metrics)
    summary = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass  # an unfinished run has no summary; the metrics are enough
    config = summary.get("config") if isinstance(summary, dict) else None
    name = run_dir.resolve().name
    label = f"{name} ({config})" if config and config != name else name
    return Run(run_dir, records, summary if isinstance(summary, dict) else {}, label)


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """The runs named by ``paths``: run directories, and swarm directories (``gossiploco swarm --out``), which
    stand for their peers' directories (``peer-0``, ``peer-1``, ...) in peer order."""
    runs = []
    for path in map(Path, paths):
        peer_dirs = swarm_peer_dirs(path)
        runs += [load_run(d) for d in peer_dirs] if peer_dirs else [load_run(path)]
    return runs


def swarm_peer_dirs(path: Path) -> list[Path]:
    """A swarm directory's peer directories that hold metrics, sorted by peer number; [] for anything else."""
    if not path.is_dir() or (path / "metrics.jsonl").exists():
        return []
    found = [d for d in path.glob("peer-*") if d.is_dir() and d.name[5:].isdigit() and (d / "metrics.jsonl").is_file()]
    return sorted(found, key=lambda d: int(d.name[5:]))


def windowed_stats(values: Sequence[float], window: int) -> tuple[list[float], list[float], list[float]]:
    """(median, min, max) of ``values[max(0, i - window + 1) : i + 1]`` for every i: a trailing
    rolling window of ``window`` values (shorter at the start)."""
    if window < 1:
        raise ConfigError("--window", f"must be >= 1, got {window}")
    med, lo, hi = [], [], []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        med.append(statistics.median(chunk))
        lo.append(min(chunk))
        hi.append(max(chunk))
    return med, lo, hi


def plot_runs(runs: Sequence[Run], out: str | Path, window: int = 10) -> Path:
    """Draw every run (one color each) on shared panels and save a PNG to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if window < 1:
        raise ConfigError("--window", f"must be >= 1, got {window}")
    _disambiguate(runs)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    panels = list(axes.flat)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        for ax, (key, _) in zip(panels, PANELS):
            steps, values = run.series(key)
            if values:
                ax.plot(steps, values, color=color, marker="o" if key == "val_loss" else None, markersize=3, linewidth=1.2, label=run.label)
        steps, values = run.series("cd_js")
        if values:
            med, lo, hi = windowed_stats(values, window)
            panels[4].fill_between(steps, lo, hi, color=color, alpha=0.25, linewidth=0)
            panels[4].plot(steps, med, color=color, linewidth=1.5, label=run.label)
    for ax, (_, title) in zip(panels, PANELS):
        ax.set_title(title)
    panels[4].set_title(f"CD_JS: median and min-max over {window} records")
    for ax in panels[:5]:
        ax.set_xlabel("inner step")
        ax.grid(alpha=0.3)
    legend = panels[5]
    legend.axis("off")
    handles, labels = _legend_entries(panels[:5])
    legend.legend(handles, labels, loc="center", title="run", frameon=False)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _legend_entries(axes) -> tuple[list, list[str]]:
    """One entry per run (the first axis that drew it)."""
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    return list(seen.values()), list(seen)


def _disambiguate(runs: Sequence[Run]) -> None:
    """Runs with the same label (peer-0 of two swarms) get their parent directory's name prepended."""
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            run.label = f"{run.path.resolve().parent.name}/{run.label}"
