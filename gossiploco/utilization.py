"""Compute-utilization simulator: the paper's section 5.2, Figure 3 and Table 1's "Compute Util." columns.

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
(forward plus backward costs 6 FLOPs per parameter per token).

Payloads and wire volume
------------------------
Mix1 sends ``P1 = f1 N (1 + s)`` values and Mix2 sends ``P2 = f2 N``. Here ``f`` is the
fraction of the parameters in that Mix's blocks (``mixK.blocks``, measured on the model's real
block sizes; ``--subset-fraction`` overrides ``f2``). ``s = 1`` when Mix1 also averages the
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

import functools
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from gossiploco.config import MIX_KINDS, MODES, RunConfig
from gossiploco.errors import ConfigError

BYTES_PER_VALUE_NAMES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "8bit": 1.0, "int8": 1.0, "4bit": 0.5, "int4": 0.5}
"""Names accepted by ``--bytes-per-value`` besides a number."""

FLOPS_PER_PARAM_TOKEN = 6
"""Forward (2) plus backward (4) FLOPs per parameter per token."""


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
    """The communication of one configuration: what Mix1 and Mix2 send, or sync-DP's gradient."""

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

    @classmethod
    def from_config(cls, cfg: RunConfig, vocab_size: int, subset_fraction: float | None = None,
                    with_monitors: bool = False) -> CommPlan:
        """The plan of a run config. Mix fractions come from ``mixK.blocks`` on the real block sizes
        of ``cfg.model.size`` with ``vocab_size``. ``subset_fraction`` replaces Mix2's fraction.
        ``with_monitors``: also model the config's consensus measurements (``[monitor]``)."""
        if cfg.mode == "sync-dp":
            if subset_fraction is not None:
                raise ConfigError("--subset-fraction", "sync-dp exchanges whole gradients; there is no Mix2 to subset")
            return cls(cfg.name, cfg.mode, MixLoad("identity"), MixLoad("global"))
        if subset_fraction is not None:
            if cfg.mix2.kind == "identity":
                raise ConfigError("--subset-fraction", f"{cfg.name} has no Mix2 (mix2.kind = identity)")
            if not (math.isfinite(subset_fraction) and 0.0 < subset_fraction <= 1.0):
                raise ConfigError("--subset-fraction", f"must be in (0, 1], got {subset_fraction}")
        mix2_fraction = subset_fraction if subset_fraction is not None else block_fraction(cfg.model.size, vocab_size, cfg.mix2.blocks)
        return cls(
            cfg.name,
            cfg.mode,
            MixLoad(cfg.mix1.kind, block_fraction(cfg.model.size, vocab_size, cfg.mix1.blocks), cfg.mix1.state,
                    compression_scale(cfg.mix1, cfg.workers)),
            MixLoad(cfg.mix2.kind, mix2_fraction, scale=compression_scale(cfg.mix2, cfg.workers)),
            monitors_per_round(cfg, block_fraction(cfg.model.size, vocab_size, cfg.mix1.blocks)) if with_monitors else 0,
        )


def compression_scale(mix, workers: int) -> float:
    """``MixLoad.scale`` of a ``[mixK]`` config: its codec's bytes per fp32 byte (on a long vector)."""
    values = 1 << 24
    scale = mix.codec().encoded_bytes(values) / (4 * values)
    if mix.compression == "topk" and mix.kind == "global":
        scale *= workers / 2
    return scale


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
        _positive("--params", self.params)
        _positive_int("--workers", self.workers)
        _positive_int("--inner-steps", self.inner_steps)
        _positive("--step-time", self.step_time_s)
        _positive("--bandwidth-mbps", self.bandwidth_mbps)
        _positive("--bytes-per-value", self.bytes_per_value)
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


# ---------------------------------------------------------------------------------------
# Filling the inputs in


def monitors_per_round(cfg: RunConfig, mix1_fraction: float = 0.0) -> int:
    """Consensus measurements per round of ``cfg`` that all-reduce the parameters (``runtime.common.measure_due``:
    h = 0, then every ``monitor.every`` inner steps); 0 when the monitors are off or in sync-dp mode. The
    one at h = 0 sends none when Mix1 is a global mean of every parameter (``mix1_fraction`` 1): it takes
    Mix1's average (``runtime.common.monitor_reuses_mix1``)."""
    from gossiploco.runtime.common import measure_due

    if cfg.mode != "factored":
        return 0
    reuse = cfg.mix1.kind == "global" and mix1_fraction >= 1.0
    return sum(measure_due(cfg, h)[0] for h in range(cfg.inner_steps) if not (reuse and h == 0))


def estimate_step_time(params: float, tokens_per_step: int, peak_tflops: float, mfu: float) -> float:
    """Inner-step seconds from FLOPs: ``T = 6 N tokens / (peak FLOP/s * MFU)``."""
    _positive("--params", params)
    _positive_int("--tokens-per-step", tokens_per_step)
    _positive("--peak-tflops", peak_tflops)
    if not (math.isfinite(mfu) and 0.0 < mfu <= 1.0):
        raise ConfigError("--mfu", f"must be in (0, 1], got {mfu}")
    return FLOPS_PER_PARAM_TOKEN * params * tokens_per_step / (peak_tflops * 1e12 * mfu)


def parse_bytes_per_value(text: str) -> float:
    """``"4"``, ``"0.5"``, ``"bf16"``, ``"int4"``... as bytes per value."""
    name = text.strip().lower()
    if name in BYTES_PER_VALUE_NAMES:
        return BYTES_PER_VALUE_NAMES[name]
    try:
        value = float(name)
    except ValueError:
        raise ConfigError("--bytes-per-value", f"expected a number or one of {', '.join(BYTES_PER_VALUE_NAMES)}; got {text!r}") from None
    _positive("--bytes-per-value", value)
    return value


@functools.lru_cache(maxsize=16)
def block_sizes(model_size: str, vocab_size: int) -> dict[str, int]:
    """Parameters per block (``gossiploco.blocks`` names) of a named model size, counted on the meta device."""
    from gossiploco.blocks import block_of
    from gossiploco.model import meta_model

    _positive_int("--vocab-size", vocab_size)
    sizes: dict[str, int] = {}
    for name, param in meta_model(model_size, vocab_size).named_parameters():
        sizes[block_of(name)] = sizes.get(block_of(name), 0) + param.numel()
    return sizes


def block_fraction(model_size: str, vocab_size: int, patterns: Sequence[str]) -> float:
    """Fraction of the parameters in the blocks ``patterns`` selects (1.0 for ``["*"]``)."""
    from gossiploco.blocks import block_names, select_blocks
    from gossiploco.model import MODEL_SIZES

    names = block_names(MODEL_SIZES[model_size].n_layers)
    chosen = select_blocks(names, patterns)
    if len(chosen) == len(names):
        return 1.0
    sizes = block_sizes(model_size, vocab_size)
    return sum(sizes[b] for b in chosen) / sum(sizes.values())


def resolve_scenario(
    cfg: RunConfig,
    *,
    bandwidth_mbps: float,
    params: float | None = None,
    vocab_size: int | None = None,
    workers: int | None = None,
    inner_steps: int | None = None,
    step_time_s: float | None = None,
    tokens_per_step: int | None = None,
    peak_tflops: float | None = None,
    mfu: float = 0.4,
    outer_step_s: float = 0.0,
    bytes_per_value: str = "4",
    failure_rate: float = 0.0,
) -> Scenario:
    """A scenario from command-line options. A missing option comes from ``cfg``: N is the model
    size's parameter count, M and H are the config's. T comes from ``--step-time``, or else it is
    estimated from ``--tokens-per-step`` and ``--peak-tflops``."""
    if params is None:
        params = float(sum(block_sizes(cfg.model.size, default_vocab_size(cfg, vocab_size)).values()))
    if step_time_s is None:
        if tokens_per_step is None or peak_tflops is None:
            raise ConfigError("--step-time", "give the inner-step seconds, or --tokens-per-step and --peak-tflops to estimate them")
        step_time_s = estimate_step_time(params, tokens_per_step, peak_tflops, mfu)
    return Scenario(
        params=params,
        workers=cfg.workers if workers is None else workers,
        inner_steps=cfg.inner_steps if inner_steps is None else inner_steps,
        step_time_s=step_time_s,
        bandwidth_mbps=bandwidth_mbps,
        bytes_per_value=parse_bytes_per_value(bytes_per_value),
        failure_rate=failure_rate,
        outer_step_s=outer_step_s,
    )


def default_vocab_size(cfg: RunConfig, vocab_size: int | None = None) -> int:
    """``vocab_size`` if given, else the config's ``data.vocab_size`` (.bin data), else its tokenizer's (text)."""
    if vocab_size is not None:
        return vocab_size
    if cfg.data.vocab_size:
        return cfg.data.vocab_size
    from gossiploco.tokenizer import load_tokenizer

    return load_tokenizer(cfg.data.tokenizer).vocab_size


def preset_plans(model_size: str, vocab_size: int, subset_fraction: float | None = None) -> list[CommPlan]:
    """The plan of every preset in ``peers/`` for one model size. ``subset_fraction`` replaces Mix2's
    fraction in the presets whose Mix2 covers only some blocks."""
    from gossiploco.config import load_config, preset_names

    plans = []
    for name in preset_names():
        cfg = load_config(name, {"model.size": model_size})
        plan = CommPlan.from_config(cfg, vocab_size)
        if subset_fraction is not None and plan.mode == "factored" and plan.mix2.fraction < 1.0:
            plan = CommPlan.from_config(cfg, vocab_size, subset_fraction)
        plans.append(plan)
    return plans


# ---------------------------------------------------------------------------------------
# Reports


def report(plan: CommPlan, sc: Scenario, result: RoundTime) -> dict[str, Any]:
    """One JSON-ready object: every field of ``result``, then the inputs and payloads."""
    return {
        "config": plan.name,
        "mode": plan.mode,
        **asdict(result),
        "mix1": {**asdict(plan.mix1), "payload_bytes": plan.mix1.payload_values(sc.params) * sc.bytes_per_value * plan.mix1.scale},
        "mix2": {**asdict(plan.mix2), "payload_bytes": plan.mix2.payload_values(sc.params) * sc.bytes_per_value * plan.mix2.scale},
        "monitors_per_round": plan.monitors,
        "scenario": asdict(sc),
    }


def describe(plan: CommPlan, sc: Scenario, result: RoundTime) -> str:
    """A few lines for a terminal."""

    def row(label: str, seconds: float, note: str = "") -> str:
        return f"  {label:24s}{seconds:10.1f} s{note}"

    lines = [
        f"{plan.name}: N = {sc.params:.4g}, M = {sc.workers}, H = {sc.inner_steps}, T = {sc.step_time_s:.4g} s, "
        f"{sc.bandwidth_mbps:g} Mbps, {sc.bytes_per_value:g} B/value, failure rate {sc.failure_rate:g}",
        f"compute utilization {100 * result.compute_utilization:.1f}%  (per round:)",
        row("compute", result.compute_s),
    ]
    if plan.mode == "sync-dp":
        lines.append(row("gradient all-reduces", result.mix2_s, f"  blocking, {result.mix2_attempt_s:.1f} s per attempt"))
    else:
        lines += [
            row(f"mix1 {_mix_label(plan.mix1)}", result.mix1_s,
                f"  hidden {result.mix1_hidden_s:.1f} s, exposed {result.mix1_exposed_s:.1f} s"),
            row(f"mix2 {_mix_label(plan.mix2)}", result.mix2_s, "  blocking"),
            row("outer step", result.outer_step_s),
        ]
        if plan.monitors:
            lines.insert(-1, row(f"monitors x{plan.monitors}", result.monitor_s, "  blocking, sharing the link with Mix1"))
    lines.append(row("wall", result.wall_s))
    if plan.mode == "factored" and plan.mix1.kind != "identity":
        lines.append(f"Mix1 is fully hidden from H = {result.min_inner_steps_hiding_mix1:.1f} inner steps (without failures)")
    return "\n".join(lines)


def _mix_label(mix: MixLoad) -> str:
    label = mix.kind + ("+state" if mix.state else "") + (f" x{mix.scale:.3g} bytes" if mix.scale != 1.0 and mix.kind != "identity" else "")
    return label if mix.fraction == 1.0 or mix.kind == "identity" else f"{label} ({100 * mix.fraction:.0f}%)"


def plot_bandwidth_sweep(path: Path, plans: Sequence[CommPlan], sc: Scenario, bandwidths_mbps: Sequence[float] | None = None) -> None:
    """Utilization against bandwidth for each plan, like the paper's Figure 3, as a PNG.

    Solid lines: no failures. Dotted lines: ``sc.failure_rate``, when it is above 0.
    Headless (matplotlib's Agg backend).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if bandwidths_mbps is None:
        bandwidths_mbps = [10 * 10 ** (i / 40) for i in range(121)]  # 10 Mbps .. 10 Gbps, log-spaced
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, plan in enumerate(plans):
        color = f"C{i % 10}"
        for rate, style in ((0.0, "-"), (sc.failure_rate, ":")):
            if style == ":" and rate == 0.0:
                continue
            util = [100 * simulate(plan, replace(sc, bandwidth_mbps=b, failure_rate=rate)).compute_utilization for b in bandwidths_mbps]
            ax.plot(bandwidths_mbps, util, style, color=color, label=plan.name if style == "-" else None)
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth per link (Mbps)")
    ax.set_ylabel("compute utilization (%)")
    ax.set_ylim(0, 102)
    title = f"N = {sc.params:.3g}, M = {sc.workers}, H = {sc.inner_steps}, T = {sc.step_time_s:.3g} s, {sc.bytes_per_value:g} B/value"
    if sc.failure_rate > 0:
        title += f"; dotted: failure rate {sc.failure_rate:g}"
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(name, f"must be a finite number > 0, got {value}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
