"""How many inner steps a worker runs in a round (``round.budget``), decided without reading a clock.

Three clocks, one interface (``begin`` at the round's start, ``another`` before each step, ``step_took``
after it), sans-I/O: the caller passes the times it measured, so tests drive it with any times they like.

* steps: exactly ``inner_steps`` steps (the paper's H), whatever they cost.
* simulated (``budget = "time"`` with ``round.step_time_factors``, no ``length_s``): worker m's step takes
  ``factor[m]`` base steps and the round lasts ``inner_steps`` base steps, so it runs
  ``floor(inner_steps / factor[m])`` steps, at least one (``RoundConfig.steps_for``). The virtual swarm runs
  this clock; network peers run it too (indexed by their data stream), which is how a test checks that the
  virtual swarm's unequal workers train the same parameters as network peers with the same step counts.
* real (``budget = "time"`` with ``round.length_s > 0``, network peers): steps until the round's deadline,
  ``length_s`` after the round's start. The start is agreed: it is where the previous round's blocking Mix2
  released every member at once (the run's start barrier for the first round), so the deadlines of all
  peers fall within a network latency of each other and nobody waits at Mix2 for a slow peer's H-th step.
  A step starts only if it is expected to end by the deadline (the expected time: an exponential average of
  the steps measured so far), so a round overshoots by less than one step; the first step of a round
  always runs, so every worker contributes a pseudo-gradient (and a weight > 0). The round's measurement
  (consensus and validation loss at h = 0, the same work on every peer) moves the deadline by its time: the
  length is for training.
* shared (``round.clock = "shared"``, on the real clock): the deadline of round r is the swarm's anchor plus
  (r + 1) ``length_s`` (``round_clock.RoundClock``), whatever the round's start: ``length_s`` is the whole round,
  training and exchanges, and every peer's rounds end together however their exchanges went (ready pairing
  releases each pair on its own: on the start clock the peers would drift apart). A measurement does not move
  this deadline (it would move this peer off the swarm's clock): the round trains for less.

The steps each worker ran are what ``round.weights = "tokens"`` weighs its contribution by.
"""

from __future__ import annotations

from gossiploco.config import RunConfig
from gossiploco.errors import ConfigError
from gossiploco.round_clock import RoundClock

SMOOTHING = 0.3
"""Weight of the newest step in the expected step time (an exponential average: follows a machine that
slows down within a few steps, not fooled by one slow step)."""


class RoundBudget:
    def __init__(self, cfg: RunConfig, worker: int, *, real_clock: bool):
        """``worker``: the index of ``round.step_time_factors`` this worker runs under; ``real_clock``: a runtime
        that can run a real-clock round (network peers; the virtual swarm simulates every worker's clock)."""
        rc = cfg.round
        self.length_s = rc.length_s if rc.budget == "time" and real_clock else 0.0
        if real_clock and rc.budget == "time" and not self.length_s and not rc.step_time_factors:
            raise ConfigError("round.length_s", "a time budget on real peers needs the round's length in seconds "
                              "(for example --set round.length_s=30: the time the fast peers take for inner_steps "
                              "steps); or round.step_time_factors for a simulated clock")
        if rc.budget == "time" and rc.step_time_factors and not 0 <= worker < len(rc.step_time_factors):
            raise ConfigError("round.step_time_factors", f"worker {worker} has no factor: {len(rc.step_time_factors)} given")
        self.fixed = None if self.length_s else rc.steps_for(worker, cfg.inner_steps)
        """Steps per round on the steps or simulated clock; None on the real clock."""
        self.clock = RoundClock(self.length_s) if self.length_s and rc.clock == "shared" else None
        """The swarm's shared round clock (``round.clock = "shared"``); None: deadlines count from each round's start."""
        self.deadline = 0.0
        self.round_index = 0
        self.step_s: float | None = None
        """The expected seconds of one step (None before the first is measured)."""

    @property
    def real(self) -> bool:
        return self.fixed is None

    def begin(self, now: float, round_index: int = 0) -> None:
        """Round ``round_index`` starts at ``now`` (on the start clock: the agreed start; see the module's docstring)."""
        self.round_index = round_index
        self.deadline = self.clock.begin(round_index, now) if self.clock is not None else now + self.length_s

    @property
    def round_ends_at(self) -> float | None:
        """When this round's training ends on the shared clock (told to peers that ask: the clock's, not this peer's
        deadline, which a late start puts later); None on any other clock."""
        return self.clock.ends_at(self.round_index) if self.clock is not None else None

    def adopt(self, clocks, now: float) -> str | None:
        """Take up the swarm's shared clock from what peers said of theirs (``lifecycle.Position.clocks``); returns
        why not, if their clock was refused. No-op on any other clock."""
        return self.clock.adopt(clocks, now) if self.clock is not None else None

    def another(self, steps_done: int, now: float) -> bool:
        """Whether to run one more inner step, ``steps_done`` of this round done, at ``now``."""
        if self.fixed is not None:
            return steps_done < self.fixed
        if steps_done == 0:
            return True
        return now + (self.step_s or 0.0) <= self.deadline

    def pause(self, seconds: float) -> None:
        """``seconds`` not spent training (a measurement: the same on every peer) move the deadline (not on the
        shared clock: the round trains for less)."""
        if self.clock is None:
            self.deadline += seconds

    def step_took(self, seconds: float) -> None:
        """An inner step took ``seconds`` (on the real clock: the next steps' expected time)."""
        self.step_s = seconds if self.step_s is None else SMOOTHING * seconds + (1 - SMOOTHING) * self.step_s
