"""Metrics output: one JSON object per measurement in ``metrics.jsonl``, and ``summary.json``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


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
    """Keeps every record and, when given a directory, appends it to ``DIR/metrics.jsonl``."""

    def __init__(self, out_dir: str | Path | None):
        self.records: list[dict] = []
        self.out_dir = Path(out_dir) if out_dir else None
        self._file = None
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = (self.out_dir / "metrics.jsonl").open("w")

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(_clean(record), sort_keys=True) + "\n")
            self._file.flush()

    def write_summary(self, summary: dict) -> None:
        if self.out_dir:
            (self.out_dir / "summary.json").write_text(json.dumps(_clean(summary), indent=2, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
