"""The compute-utilization model: the paper's section 5.2, Figure 3 and Table 1's "Compute Util." columns.

Compute utilization is the fraction of wall-clock time a peer spends on inner-step compute.
The simulator has the paper's four components: forward/backward compute, outer-step compute,
Mix1 communication and Mix2 communication. Every pair of peers is joined by a link of the
same fixed bandwidth. The simulator models one round of Algorithm 1 on one peer, in seconds.

Inputs
------
N parameters, M workers, H inner steps of T seconds each (forward, backward, inner optimizer),
an outer step of O seconds, link bandwidth B bits/s (full duplex), b bytes per value on the
wire (4 fp32, 2 bf16, 1 for 8-bit, 0.5 for 4-bit) and a failure rate p per attempt of a collective.
When T is not given it is estimated from the FLOPs: ``T = 6 N tokens / (peak FLOP/s * MFU)``
(forward plus backward costs 6 FLOPs per parameter per token; ``inputs.estimate_step_time``).

Payloads and wire volume
------------------------
Mix1 sends ``P1 = f1 N (1 + s)`` values and Mix2 sends ``P2 = f2 N``. Here ``f`` is the
fraction of the parameters in that Mix's blocks (``mixK.blocks``, measured on the model's real
block sizes, ``inputs.comm_plan``; ``--subset-fraction`` overrides ``f2``). ``s = 1`` when Mix1 also averages the
outer momentum (``mix1.state``, the GlobalM1S presets). The momentum has the size of the
parameters, so the payload doubles. Each peer sends ``v(kind, M)`` times its payload::

    identity   v = 0
    global     v = 2 (M - 1) / M     bandwidth-optimal ring all-reduce: reduce-scatter, then all-gather
    gossip     v = 1                 pairwise swap: each peer sends its payload to its partner once

One attempt of a Mix occupies the peer's link for ``a = v P b 8 / B`` seconds. Latency is
ignored: a few round trips are nothing next to minutes of transfer.

One round (mode ``factored``)
-----------------------------
::

    t = 0        Mix1 launched in the background (Algorithm 1 line 3); it has the link to itself
    t = C = H T  inner steps done; blocking Mix2 starts (line 11) and shares the link with
                 whatever is left of Mix1
    t = E        both done (Mix2 returned, then line 12 waited for Mix1); outer step of O seconds

Link sharing. Before C only Mix1 uses the link. From C until both Mixes are done the link
carries ``R = max(0, a1 - C)`` seconds of leftover Mix1 work and ``a2`` seconds of Mix2 work.
It never idles in between, so for any work-conserving sharing (fair share, either one first)::

    E = C + max(0, a1 - C) + a2                        (independent of the sharing policy)

    wall W = E + O,   utilization U = C / W,   minimum H that hides Mix1: H* = a1 / T

The sharing policy changes only which phase the time is attributed to. Under fair sharing,
Mix2 returns at ``C + 2 a2`` if ``a2 <= R``, else at ``C + R + a2``. The wait for Mix1 after
Mix2 is then ``max(0, R - a2)``. We report the policy-free split: Mix1 hidden
``min(a1, C)``, Mix1 exposed ``max(0, a1 - C)`` (seconds Mix1 adds to the round) and the
blocking communication ``W - C - O``.

Consensus monitors (optional, ``CommPlan.monitors``; off in the paper's tables). A network peer
measures CD_L2/CD_JS by all-reducing its whole parameters (``m`` link seconds, a global Mix of
fraction 1) ``monitors`` times per round, blocking, at h = 0 right after Mix1 was launched, so
the two share the link. With fair sharing (two TCP flows) the measurement returns at
``m + min(a1, m)``; the inner steps start then, Mix1 has advanced by ``min(a1, m)``, so::

    monitor blocking = m + min(a1, m),   Mix1 exposed = max(0, a1 - m - C)

Sync-DP (mode ``sync-dp``) all-reduces the gradient (N values) after every inner step, and
nothing overlaps it::

    W = H (T + a_g),   U = T / (T + a_g)

Communication failures
----------------------
Each attempt of a collective fails independently with probability p. The failure is found
only when the attempt ends (a timeout or a broken ring), so a failed attempt costs its full
link time. This is the pessimistic choice; the paper does not say which one it made.

- all-reduce (``global``): restarted until it succeeds. The number of attempts k is
  geometric, ``P(k) = (1 - p) p^(k-1)``, so ``E[k] = 1 / (1 - p)``, and one Mix takes
  ``k a`` seconds.
- gossip: never retried. A failed swap is lost: that peer mixes with identity this round.
  It costs its one attempt, ``a`` seconds, as a successful swap would.

Rounds are independent, so by the renewal-reward theorem the long-run utilization is
``C / E[W]``, with::

    E[W] = C + E[max(0, k1 a1 - C)] + E[k2] a2 + O
    E[max(0, k a - C)] = p^k0 ((k0 + 1 / (1 - p)) a - C),   k0 = floor(C / a)

The second line holds because the attempts that fit inside C cost nothing extra, and
geometric attempts are memoryless. For sync-DP, ``E[W] = H (T + E[k] a_g)``. Gossip-only
configurations (LocalM1M2) do not depend on p at all. A global Mix1 costs utilization only in
the rounds whose attempts no longer fit inside C, which happens with probability ``p^k0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gossiploco.config import MIX_KINDS, MODES
from gossiploco.errors import ConfigError

# ---------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class MixLoad:
    """What one Mix sends: its operator and the share of the model it carries."""

    kind: str
    """identity, global (ring all-reduce average) or gossip (pairwise swap)."""
    fraction: float = 1.0
    """Fraction of the model's parameters in the mixed blocks, in (0, 1]."""
    state: bool = False
    """Also carries the outer momentum (as large as the mixed parameters): the payload doubles."""
    scale: float = 1.0
    """Wire bytes relative to fp32 by the operator's own schedule: a codec's encoded bytes per fp32 byte
    (``mixK.compression``), times M / 2 for a top-k group mean (a sparse all-gather sends M - 1 payloads,
    not a ring's 2 (M - 1) / M)."""

    def __post_init__(self) -> None:
        if self.kind not in MIX_KINDS:
            raise ConfigError("kind", f"must be one of {', '.join(MIX_KINDS)}; got {self.kind!r}")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError("fraction", f"must be in (0, 1], got {self.fraction}")

    def payload_values(self, params: float) -> float:
        """Values sent in one Mix: ``f N (1 + s)``, or 0 for identity."""
        if self.kind == "identity":
            return 0.0
        return self.fraction * params * (2 if self.state else 1)


@dataclass(frozen=True)
class CommPlan:
    """The communication of one configuration: what Mix1 and Mix2 send, or sync-DP's gradient (a run
    config's: ``inputs.comm_plan``)."""

    name: str
    """Preset name, for reports and plot legends."""
    mode: str
    """factored (Algorithm 1) or sync-dp (blocking gradient all-reduce every inner step)."""
    mix1: MixLoad
    """Non-blocking Mix1 (identity for sync-dp)."""
    mix2: MixLoad
    """Blocking Mix2; for sync-dp, the gradient all-reduce done after every inner step."""
    monitors: int = 0
    """Blocking all-reduces of the whole parameters per round for the consensus monitors (factored
    mode; 0: not modelled, as in the paper)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError("mode", f"must be one of {', '.join(MODES)}; got {self.mode!r}")


@dataclass(frozen=True)
class Scenario:
    """Model size, schedule and network of one simulation. Errors name the matching CLI flag."""

    params: float
    """Parameters N of the model."""
    workers: int
    """Number of workers M."""
    inner_steps: int
    """Inner steps H per round."""
    step_time_s: float
    """Seconds T of one inner step (forward, backward, inner optimizer)."""
    bandwidth_mbps: float
    """Bandwidth of the link between any two peers, Mbit/s, each direction."""
    bytes_per_value: float = 4.0
    """Bytes per communicated value: 4 fp32, 2 bf16, 1 for 8-bit, 0.5 for 4-bit."""
    failure_rate: float = 0.0
    """Probability p that one attempt of a collective fails, in [0, 1)."""
    outer_step_s: float = 0.0
    """Seconds O of the outer step (factored mode only)."""

    def __post_init__(self) -> None:
        require_positive("--params", self.params)
        require_positive_int("--workers", self.workers)
        require_positive_int("--inner-steps", self.inner_steps)
        require_positive("--step-time", self.step_time_s)
        require_positive("--bandwidth-mbps", self.bandwidth_mbps)
        require_positive("--bytes-per-value", self.bytes_per_value)
        if not (math.isfinite(self.failure_rate) and 0.0 <= self.failure_rate < 1.0):
            raise ConfigError("--failure-rate", f"must be in [0, 1), got {self.failure_rate}")
        if not (math.isfinite(self.outer_step_s) and self.outer_step_s >= 0.0):
            raise ConfigError("--outer-step-time", f"must be >= 0, got {self.outer_step_s}")


# ---------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class RoundTime:
    """Expected seconds of one round on one peer, and the compute utilization they give."""

    compute_s: float
    """Inner-step compute C = H T."""
    outer_step_s: float
    """Outer step O (0 for sync-dp)."""
    mix1_attempt_s: float
    """Link seconds a1 of one Mix1 attempt."""
    mix2_attempt_s: float
    """Link seconds a2 of one Mix2 attempt (sync-dp: one gradient all-reduce)."""
    mix1_s: float
    """Expected link seconds of Mix1, retries included: E[k1] a1."""
    mix2_s: float
    """Expected link seconds of Mix2, retries included: E[k2] a2 (sync-dp: H gradient all-reduces)."""
    mix1_hidden_s: float
    """Mix1 link seconds overlapped by the inner steps."""
    mix1_exposed_s: float
    """Seconds Mix1 adds to the round past the inner steps: E[max(0, k1 a1 - C)]."""
    blocking_comm_s: float
    """Seconds in the round not computing: exposed Mix1 plus Mix2 (sync-dp: the gradient all-reduces)."""
    wall_s: float
    """Expected wall-clock seconds of the round: C + blocking + O."""
    compute_utilization: float
    """C / wall, in [0, 1]."""
    min_inner_steps_hiding_mix1: float
    """Smallest H whose compute hides one Mix1 attempt: a1 / T (0 when there is no Mix1)."""
    monitor_s: float = 0.0
    """Seconds the consensus monitors block per round: m + min(a1, m) (0 when not modelled)."""


def wire_factor(kind: str, workers: int) -> float:
    """Bytes a peer sends per byte of payload in one Mix of ``kind`` among ``workers`` peers."""
    if kind not in MIX_KINDS:
        raise ConfigError("kind", f"must be one of {', '.join(MIX_KINDS)}; got {kind!r}")
    if kind == "identity" or workers == 1:
        return 0.0
    if kind == "global":
        return 2.0 * (workers - 1) / workers
    return 1.0


def attempt_seconds(mix: MixLoad, sc: Scenario) -> float:
    """Link seconds of one attempt of ``mix``: ``a = v P b 8 / B``."""
    bits = wire_factor(mix.kind, sc.workers) * mix.payload_values(sc.params) * sc.bytes_per_value * mix.scale * 8
    return bits / (sc.bandwidth_mbps * 1e6)


def restarts(kind: str) -> bool:
    """Whether a failed attempt is restarted: all-reduce yes, gossip no (the exchange is lost)."""
    return kind == "global"


def expected_attempts(kind: str, failure_rate: float) -> float:
    """E[k]: 1 / (1 - p) for a restarted all-reduce, 1 otherwise."""
    return 1.0 / (1.0 - failure_rate) if restarts(kind) else 1.0


def expected_overrun(attempt_s: float, kind: str, failure_rate: float, budget_s: float) -> float:
    """E[max(0, k a - C)]: expected link seconds of a collective beyond a budget of C seconds.

    With geometric k (all-reduce under failures): ``p^k0 ((k0 + 1/(1-p)) a - C)``, ``k0 = floor(C / a)``.
    """
    if attempt_s == 0.0:
        return 0.0
    if not restarts(kind) or failure_rate == 0.0:
        return max(0.0, attempt_s - budget_s)
    p = failure_rate
    k0 = math.floor(budget_s / attempt_s)
    return p**k0 * ((k0 + 1.0 / (1.0 - p)) * attempt_s - budget_s)


def simulate(plan: CommPlan, sc: Scenario) -> RoundTime:
    """Expected time of one round of ``plan`` in scenario ``sc`` (equations in the module docstring)."""
    compute = sc.inner_steps * sc.step_time_s
    p = sc.failure_rate
    monitor = 0.0
    a1, a2 = attempt_seconds(plan.mix1, sc), attempt_seconds(plan.mix2, sc)
    mix1 = expected_attempts(plan.mix1.kind, p) * a1
    if plan.mode == "sync-dp":
        # The gradient all-reduce (plan.mix2) blocks after each of the H inner steps.
        mix2 = sc.inner_steps * expected_attempts(plan.mix2.kind, p) * a2
        exposed, outer = 0.0, 0.0
    else:
        mix2 = expected_attempts(plan.mix2.kind, p) * a2
        m = plan.monitors * expected_attempts("global", p) * attempt_seconds(MixLoad("global"), sc)
        monitor = m + min(a1, m) if m else 0.0  # shares the link with Mix1 from t = 0 (module docstring)
        exposed, outer = expected_overrun(a1, plan.mix1.kind, p, compute + m), sc.outer_step_s
    blocking = exposed + mix2 + monitor
    wall = compute + blocking + outer
    return RoundTime(
        compute_s=compute,
        outer_step_s=outer,
        mix1_attempt_s=a1,
        mix2_attempt_s=a2,
        mix1_s=mix1,
        mix2_s=mix2,
        mix1_hidden_s=mix1 - exposed,
        mix1_exposed_s=exposed,
        blocking_comm_s=blocking,
        wall_s=wall,
        compute_utilization=compute / wall,
        min_inner_steps_hiding_mix1=a1 / sc.step_time_s,
        monitor_s=monitor,
    )


def require_positive(name: str, value: float) -> None:
    """``ConfigError`` naming ``name`` unless ``value`` is a finite number above 0."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(name, f"must be a finite number > 0, got {value}")


def require_positive_int(name: str, value: int) -> None:
    """``ConfigError`` naming ``name`` unless ``value`` is an integer of at least 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
