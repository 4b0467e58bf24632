"""The ``[round]`` section of a run's configuration: what ends a round, on which clock, and how the workers'
contributions are weighted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gossiploco.config_sections import _choice
from gossiploco.errors import ConfigError


BUDGETS = ("steps", "time")
CLOCKS = ("start", "shared")
WEIGHTS = ("equal", "tokens")


@dataclass
class RoundConfig:
    """What ends a round and how the workers' contributions are weighted when they merge (Decoupled DiLoCo:
    learners contribute what they computed, merges weighted by the tokens each processed).

    ``budget = "time"`` does not force ``weights = "tokens"``: both combinations are valid, because the
    unweighted merge under a time budget is the baseline a heterogeneity study compares against (a slow
    worker's short pseudo-gradient then counts as much as a fast one's). Tokens is the natural choice with
    a time budget; with a steps budget every worker processes the same tokens and the weighted merges equal
    the unweighted ones bit for bit (weights are in units of a full round's tokens, so all are 1.0)."""

    budget: str = "steps"
    """steps: every worker runs inner_steps inner steps a round; time: each runs as many as fit in the round
    (gossiploco.round_budget: on network peers with length_s, until the round's deadline; on the simulated
    clock, a worker whose steps take step_time_factors[m] times the base step runs floor(inner_steps / factor)
    of them, at least 1; a factor-1 worker runs inner_steps)."""
    weights: str = "equal"
    """equal: Mix1 and Mix2 take plain means; tokens: means weighted by the tokens each worker processed
    (Mix2: this round's; Mix1, launched before this round's are known: the previous round's)."""
    length_s: float = 0.0
    """Round length in seconds for a time budget on a real clock (network peers: each runs inner steps until the
    round's deadline; see gossiploco.round_budget and ``clock``). 0: unset (then step_time_factors give a simulated
    clock). The virtual swarm's simulated clock measures a round as inner_steps base steps and ignores it."""
    clock: str = "start"
    """Where a time-budget round's deadline counts from on network peers. start: length_s of training from the
    round's start, which the previous round's Mix2 set (each peer's own clock: with ``[groups] pairing = "ready"``
    the peers drift apart). shared: round r's training ends at the swarm's anchor + (r + 1) * length_s, so length_s
    is the whole round (training and exchanges) and every peer's round ends at the same instant; a peer that came
    out of its last round late trains less (gossiploco.round_clock: how joiners take up the anchor)."""
    step_time_factors: list[float] = field(default_factory=list)
    """The simulated clock: worker m's inner step takes this many base steps (one per worker; empty: all 1;
    network peers are indexed by their data stream). Only a time budget turns them into fewer steps; with a
    steps budget everyone runs inner_steps."""

    def check(self, p: str) -> None:
        _choice(f"{p}.budget", self.budget, BUDGETS)
        _choice(f"{p}.weights", self.weights, WEIGHTS)
        _choice(f"{p}.clock", self.clock, CLOCKS)
        if self.clock == "shared" and self.budget != "time":
            raise ConfigError(f"{p}.clock", "a shared round clock ends rounds by time: it needs budget = \"time\" "
                              "(and length_s, the round's length)")
        if self.length_s < 0:
            raise ConfigError(f"{p}.length_s", f"must be >= 0, got {self.length_s}")
        for factor in self.step_time_factors:
            if not factor > 0:
                raise ConfigError(f"{p}.step_time_factors", f"every factor must be > 0, got {self.step_time_factors}")

    def steps_for(self, worker: int, inner_steps: int) -> int:
        """Inner steps worker ``worker`` runs in one round (the virtual swarm's simulated clock)."""
        if self.budget == "steps" or not self.step_time_factors:
            return inner_steps
        return max(1, math.floor(inner_steps / self.step_time_factors[worker]))
