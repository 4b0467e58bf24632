"""Metrics output: one JSON object per measurement in ``metrics.jsonl``, and ``summary.json``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gossiploco.errors import GossiplocoError


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
    back, and new ones are appended. None: a new file."""

    def __init__(self, out_dir: str | Path | None, resume_bytes: int | None = None):
        self.records: list[dict] = []
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

    def write_summary(self, summary: dict) -> None:
        if self.out_dir:
            from gossiploco.files import atomic_write_bytes

            text = json.dumps(_clean(summary), indent=2, sort_keys=True) + "\n"
            atomic_write_bytes(self.out_dir / "summary.json", text.encode())

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
