"""Adaptive Mix2: the consensus monitors decide which blocks the blocking Mix2 covers, round by round.

The paper selects the Mix2 subset offline by per-block JS sensitivity (appendix D.3) and names
deciding Mix2 from real-time signals such as JS-distance spikes as future work (section 7). This
controller does that with hysteresis:

    signal_r   = max CD_JS measured during round r (swarm-wide; every peer sees the same values)
    level_r    = median(signal_{r-w} .. signal_{r-1})                    (w = adaptive.window)
    spike      : signal_r > grow_factor * level_r   -> add grow_step blocks (next in the order)
    calm round : signal_r <= calm_factor * level_r  -> after shrink_after calm rounds in a row,
                                                       drop the last added block
    otherwise  : hold (and the calm streak restarts)

The covered set is always ``mix2.blocks`` (the floor) plus a prefix of ``adaptive.order`` (by
default the layers in model order, then the final norm; paste `gossiploco sensitivity`'s ranking
to grow by measured sensitivity). Decisions are a pure function of the signal history, so peers
that saw the same swarm-wide values decide the same; a network peer also re-synchronises the
prefix length through the monitor all-reduce (``adopt``), so one that missed a measurement or
joined late realigns at the next one. Every decision is logged with the signal that caused it.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass

from gossiploco.blocks import block_names, select_blocks
from gossiploco.config import RunConfig

log = logging.getLogger(__name__)


@dataclass
class Decision:
    round: int
    action: str
    """grow, shrink, hold, or warmup (not enough history yet)."""
    blocks: list[str]
    """Mix2's blocks for this round's Mix2 (after the decision)."""
    signal: float | None
    """This round's max CD_JS (None when nothing was measured)."""
    level: float | None
    """The recent level the signal was compared with."""
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


class AdaptiveMix2:
    """The controller for one peer (or the whole virtual swarm)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg.adaptive
        shape = cfg.model.architecture(cfg.data.seq_len)
        names = block_names(shape.n_layers, tied=shape.tie_embeddings)
        self.floor = select_blocks(names, cfg.mix2.blocks, "mix2.blocks")
        if self.cfg.order:
            ordered: list[str] = []
            for pattern in self.cfg.order:  # keep the given order; a pattern may name several blocks
                ordered += [b for b in select_blocks(names, [pattern], "adaptive.order") if b not in ordered]
        else:
            ordered = [b for b in names if b.startswith("layers.")] + ["norm"]
        self.order = [b for b in ordered if b not in self.floor]
        self.size = 0  # how many blocks of ``order`` are covered
        self.history: list[float] = []
        self.calm = 0

    def state(self) -> dict:
        """What ``load_state`` needs to continue these decisions exactly (a checkpoint's JSON)."""
        return {"size": self.size, "history": list(self.history), "calm": self.calm}

    def load_state(self, state: dict) -> None:
        self.size, self.history, self.calm = int(state["size"]), [float(v) for v in state["history"]], int(state["calm"])

    @property
    def blocks(self) -> list[str]:
        return self.floor + self.order[: self.size]

    def adopt(self, size: int) -> None:
        """Take the swarm's agreed prefix length (network peers, after the monitor all-reduce)."""
        size = max(0, min(len(self.order), size))
        if size != self.size:
            log.warning("adaptive Mix2: realigned to the swarm's %d extra block(s) (had %d)", size, self.size)
            self.size = size

    def decide(self, round_index: int, signal: float | None) -> Decision:
        """Mix2's blocks for round ``round_index`` given that round's signal."""
        c = self.cfg
        recent = self.history[-c.window:]
        level = statistics.median(recent) if recent else None
        if signal is None:
            action, reason = "hold", "no consensus measurement this round"
        elif len(self.history) < c.warmup_rounds or level is None:
            action, reason = "warmup", f"{len(self.history)} of {c.warmup_rounds} rounds observed"
        elif signal > c.grow_factor * level and self.size < len(self.order):
            added = self.order[self.size: self.size + c.grow_step]
            self.size += len(added)
            self.calm = 0
            action, reason = "grow", f"CD_JS {signal:.4g} > {c.grow_factor} x level {level:.4g}: added {', '.join(added)}"
        elif signal <= c.calm_factor * level:
            self.calm += 1
            if self.calm >= c.shrink_after and self.size > 0:
                self.size -= 1
                self.calm = 0
                action, reason = "shrink", (f"CD_JS {signal:.4g} <= {c.calm_factor} x level {level:.4g} for "
                                            f"{c.shrink_after} rounds: dropped {self.order[self.size]}")
            elif self.size == 0:
                self.calm = min(self.calm, c.shrink_after)
                action, reason = "hold", "calm, at the floor (mix2.blocks)"
            else:
                action, reason = "hold", f"calm ({self.calm} of {c.shrink_after})"
        else:
            self.calm = 0
            action, reason = "hold", f"CD_JS {signal:.4g} between {c.calm_factor} and {c.grow_factor} x level {level:.4g}"
        if signal is not None:
            self.history.append(signal)
        decision = Decision(round_index, action, self.blocks, signal, level, reason)
        if action in ("grow", "shrink"):
            log.info("adaptive Mix2 round %d: %s (%s)", round_index, action, reason)
        return decision
