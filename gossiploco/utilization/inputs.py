"""The simulator's inputs filled in from a run config and the command line.

``comm_plan`` is what a run config communicates (Mix fractions measured on the model's real block sizes,
the codecs' bytes, the consensus measurements); ``resolve_scenario`` is the model size, schedule and network
from ``gossiploco utilization``'s options, missing ones taken from the config; ``preset_plans`` the plan of
every preset in ``peers/``. Errors are ``ConfigError`` naming the CLI flag. The model they feed:
``gossiploco.utilization.model``.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

from gossiploco.config import RunConfig
from gossiploco.errors import ConfigError
from gossiploco.utilization.model import CommPlan, MixLoad, Scenario, require_positive, require_positive_int

BYTES_PER_VALUE_NAMES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "8bit": 1.0, "int8": 1.0, "4bit": 0.5, "int4": 0.5}
"""Names accepted by ``--bytes-per-value`` besides a number."""

FLOPS_PER_PARAM_TOKEN = 6
"""Forward (2) plus backward (4) FLOPs per parameter per token."""


def comm_plan(cfg: RunConfig, vocab_size: int, subset_fraction: float | None = None,
              with_monitors: bool = False) -> CommPlan:
    """The plan of a run config. Mix fractions come from ``mixK.blocks`` on the real block sizes
    of ``cfg.model.size`` with ``vocab_size``. ``subset_fraction`` replaces Mix2's fraction.
    ``with_monitors``: also model the config's consensus measurements (``[monitor]``)."""
    if cfg.mode == "sync-dp":
        if subset_fraction is not None:
            raise ConfigError("--subset-fraction", "sync-dp exchanges whole gradients; there is no Mix2 to subset")
        return CommPlan(cfg.name, cfg.mode, MixLoad("identity"), MixLoad("global"))
    if subset_fraction is not None:
        if cfg.mix2.kind == "identity":
            raise ConfigError("--subset-fraction", f"{cfg.name} has no Mix2 (mix2.kind = identity)")
        if not (math.isfinite(subset_fraction) and 0.0 < subset_fraction <= 1.0):
            raise ConfigError("--subset-fraction", f"must be in (0, 1], got {subset_fraction}")
    mix2_fraction = subset_fraction if subset_fraction is not None else block_fraction(cfg.model.size, vocab_size, cfg.mix2.blocks)
    return CommPlan(
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
    require_positive("--params", params)
    require_positive_int("--tokens-per-step", tokens_per_step)
    require_positive("--peak-tflops", peak_tflops)
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
    require_positive("--bytes-per-value", value)
    return value


@functools.lru_cache(maxsize=16)
def block_sizes(model_size: str, vocab_size: int) -> dict[str, int]:
    """Parameters per block (``gossiploco.blocks`` names) of a named model size, counted on the meta device."""
    from gossiploco.blocks import block_of
    from gossiploco.model import meta_model

    require_positive_int("--vocab-size", vocab_size)
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
        plan = comm_plan(cfg, vocab_size)
        if subset_fraction is not None and plan.mode == "factored" and plan.mix2.fraction < 1.0:
            plan = comm_plan(cfg, vocab_size, subset_fraction)
        plans.append(plan)
    return plans
