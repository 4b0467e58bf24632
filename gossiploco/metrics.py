"""Metrics output: one JSON object per measurement in ``metrics.jsonl``, and ``summary.json``; each also goes to
the run's other metric sinks (TensorBoard, W&B: ``gossiploco.metric_sinks``) when it has some."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gossiploco.errors import GossiplocoError

if TYPE_CHECKING:
    from gossiploco.metric_sinks import MetricSinks


class MetricsError(GossiplocoError):
    """A metrics file cannot be continued."""


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsSink:
    """Keeps every record and, when given a directory, appends it to ``DIR/metrics.jsonl``.

    ``resume_bytes``: continue a run whose checkpoint was taken when the file was that long: what was
    written after it (the records of a round cut short) is cut off, the records before it are read
    back, and new ones are appended. None: a new file.

    ``forward``: the run's other sinks; every record written (not those read back) and the summary go to them
    after the file has them, and ``close`` closes them (their failures never raise: ``MetricSinks``)."""

    def __init__(self, out_dir: str | Path | None, resume_bytes: int | None = None,
                 forward: MetricSinks | None = None):
        self.records: list[dict] = []
        self.forward = forward
        self.out_dir = Path(out_dir) if out_dir else None
        self._file = None
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / "metrics.jsonl"
            if resume_bytes is None:
                self._file = path.open("w")
            else:
                self._file = path.open("a+")
                size = self._file.seek(0, 2)
                if size < resume_bytes:
                    raise MetricsError(f"{path} has {size} bytes, fewer than the {resume_bytes} its checkpoint saw "
                                       "(it was replaced or truncated); move it away to resume without the earlier records")
                self._file.truncate(resume_bytes)
                self._file.seek(0)
                self.records = [json.loads(line) for line in self._file.read().splitlines() if line.strip()]
                self._file.seek(0, 2)

    @property
    def bytes_written(self) -> int:
        """The length of metrics.jsonl so far (0 without a file)."""
        return self._file.tell() if self._file else 0

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(_clean(record), sort_keys=True) + "\n")
            self._file.flush()
        if self.forward is not None:
            self.forward.write(record)

    def write_summary(self, summary: dict) -> None:
        """``summary.json`` (and the summary's figures to the other sinks, whose counters it then holds as
        ``metric_sinks``)."""
        if self.forward is not None:
            self.forward.write_summary({k: v for k, v in summary.items() if k != "run_config"})
            self.forward.drain()  # the counters complete
            summary = {**summary, "metric_sinks": self.forward.stats()}
        if self.out_dir:
            from gossiploco.files import atomic_write_bytes

            text = json.dumps(_clean(summary), indent=2, sort_keys=True) + "\n"
            atomic_write_bytes(self.out_dir / "summary.json", text.encode())

    def close(self) -> None:
        """Close the file and the other sinks (flushing them). Idempotent."""
        if self._file:
            self._file.close()
            self._file = None
        if self.forward is not None:
            self.forward.close()
