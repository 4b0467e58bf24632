"""A network peer's live status, built from its metrics records (what ``gossiploco dashboard`` shows).

``PeerStatus.add`` takes each metrics record the peer writes (``NetworkPeer._record_end``);
``PeerStatus.wire`` is the directory's status source: the latest ``StatusEntry`` in wire form, which
the directory's heartbeat publishes (``membership.status``). Thread-safe: records come from the
training thread, ``wire`` is called from the heartbeat thread.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque

from gossiploco.membership.status import (MAX_CAUSES, MAX_HISTORY, MAX_MIX2_BLOCKS, MAX_PATHS, MAX_TEXT_CHARS, SERIES,
                                          StatusEntry)

CAUSE_FIELDS = ("mix1_cause", "mix2_cause", "monitor_cause", "grad_cause")
RATE_RECORDS = 16
"""The transfer rate is measured over this many recent records (exchanges happen at round ends, not every record)."""


def _finite(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        else None


def _printable(text: str, limit: int) -> str:
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class PeerStatus:
    """Peer ``peer`` of run ``run_id``'s live status; ``mix2``: the block patterns Mix2 covers at start."""

    def __init__(self, peer: int, run_id: str, mix2: list[str], clock=time.time):
        self.peer, self.run_id, self.clock = peer, run_id, clock
        self._lock = threading.Lock()
        self._started = clock()
        self._latest: dict = {}
        self._history: deque[list] = deque(maxlen=MAX_HISTORY)
        self._failures: Counter[str] = Counter()
        self._causes: deque[str] = deque(maxlen=MAX_CAUSES)
        self._compute_s = 0.0
        self._rate = 0.0
        self._moved: deque[tuple[float, int]] = deque(maxlen=RATE_RECORDS)  # (time, bytes moved) of recent records
        self._paths: dict[str, str] = {}
        self._tokens = 0
        self._mix2 = [_printable(str(p), 64) for p in mix2][:MAX_MIX2_BLOCKS]

    def add(self, record: dict, paths: dict[int, str] | None = None, tokens: int | None = None) -> None:
        """Take one metrics record (and the current path to each partner, and the training tokens processed over
        the run). Never raises on odd fields."""
        now = self.clock()
        with self._lock:
            self._latest = record
            if isinstance(tokens, int) and tokens >= 0:
                self._tokens = tokens
            self._compute_s += _finite(record.get("compute_s")) or 0.0
            step = record.get("step")
            if isinstance(step, int) and step >= 0:
                self._history.append([step] + [_finite(record.get(name)) for name in SERIES])
            for name in CAUSE_FIELDS:
                cause = record.get(name)
                if cause:
                    kind = name.removesuffix("_cause")
                    self._failures[kind] += 1
                    self._causes.append(_printable(f"round {record.get('round')}: {kind}: {cause}", MAX_TEXT_CHARS))
            moved = int(record.get("bytes_sent") or 0) + int(record.get("bytes_received") or 0)
            self._moved.append((now, moved))
            (t0, first), (t1, last) = self._moved[0], self._moved[-1]
            self._rate = max(0.0, (last - first) / (t1 - t0)) if t1 > t0 else 0.0
            decision = record.get("mix2_decision")
            if isinstance(decision, dict) and isinstance(decision.get("blocks"), list):
                self._mix2 = [_printable(str(p), 64) for p in decision["blocks"]][:MAX_MIX2_BLOCKS]
            if paths is not None:
                self._paths = {str(p): _printable(str(kind), 16) for p, kind in sorted(paths.items())[:MAX_PATHS]}

    def entry(self) -> StatusEntry:
        """The current status (validated like an entry read from the network)."""
        with self._lock:
            r = self._latest
            wall = self.clock() - self._started
            return StatusEntry(
                peer=self.peer, run_id=self.run_id, round=max(-1, int(r.get("round", -1))), h=max(0, int(r.get("h", 0))),
                step=max(0, int(r.get("step", 0))), members=max(0, int(r.get("members", 0))), time=self.clock(),
                loss=_finite(r.get("loss")), val_loss=_finite(r.get("val_loss")), cd_l2=_finite(r.get("cd_l2")),
                cd_js=_finite(r.get("cd_js")), bytes_sent=max(0, int(r.get("bytes_sent") or 0)),
                bytes_received=max(0, int(r.get("bytes_received") or 0)), rate=self._rate,
                failures=dict(self._failures), causes=list(self._causes), paths=dict(self._paths),
                utilization=min(1.0, self._compute_s / wall) if wall > 0 and self._latest else None,
                mix2=list(self._mix2), history=[list(row) for row in self._history], tokens=self._tokens)

    def wire(self) -> dict:
        """``entry()`` in wire form: the directory's status source."""
        return self.entry().to_wire()
