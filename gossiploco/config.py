"""Run configuration: one typed dataclass per component, combined into ``RunConfig``.

A config is filled from a TOML preset (``peers/<name>.toml``) plus command-line overrides.
Every field has a one-line docstring. ``RunConfig.__post_init__`` validates every component
and raises ``ConfigError`` naming the offending field (``mix2.blocks: no block matches
'layers.99'``). Runtime objects (models, sockets) never live here.

TOML layout: run-level keys at the top (``name``, ``mode``, ``workers``, ``inner_steps``,
``rounds``, ``seed``, ``device``) and one table per component: ``[model]``, ``[compute]``, ``[data]``,
``[inner]``, ``[outer]``, ``[mix1]``, ``[mix2]``, ``[monitor]``, ``[timeouts]``, ``[transport]``,
``[adaptive]``, ``[checkpoint]``, ``[round]``, ``[logging]``.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossiploco.config_sections import (
    MIX_KINDS, AdaptiveConfig, CheckpointConfig, ComputeConfig, DataConfig, InnerOptConfig, MixConfig, ModelConfig,
    GroupConfig, MonitorConfig, OuterOptConfig, RobustConfig, TimeoutConfig, TransportConfig, _choice, _positive)
from gossiploco.config_round import RoundConfig
from gossiploco.errors import ConfigError
from gossiploco.metric_sinks import LoggingConfig

__all__ = ["MIX_KINDS", "MODES", "PRESETS_DIR", "TINY_OVERRIDES", "AdaptiveConfig", "CheckpointConfig", "ComputeConfig",
           "DataConfig", "GroupConfig", "InnerOptConfig", "LoggingConfig", "MixConfig", "ModelConfig", "MonitorConfig", "OuterOptConfig", "RobustConfig", "RoundConfig",
           "RunConfig", "TimeoutConfig", "TransportConfig", "config_from_dict", "load_config", "preset_names",
           "resolve_preset"]
"""The sections are defined in ``gossiploco.config_sections`` (``[logging]``: ``gossiploco.metric_sinks``) and imported from here."""

PRESETS_DIR = Path(__file__).resolve().parent.parent / "peers"
MODES = ("factored", "sync-dp")
TINY_OVERRIDES: dict[str, Any] = {
    "model.size": "tiny",
    "inner_steps": 4,
    "rounds": 3,
    "seed": 0,
    "device": "cpu",
    "data.seq_len": 32,
    "data.batch_size": 4,
    "data.heldout_batch_size": 4,
    "data.val_batches": 2,
    "data.max_corpus_mb": 2.0,
    "monitor.every": 2,
    "timeouts.exchange_s": 30.0,
    "inner.warmup_steps": 2,
    "inner.lr": 3e-3,
}
"""Overrides that scale any preset down to seconds on a CPU (tiny model, short sequences, a 2 MB
slice of the stdlib corpus): the tests' and the attack bench's configuration."""


@dataclass
class RunConfig:
    name: str = "custom"
    """Preset name (the paper's configuration this run reproduces)."""
    mode: str = "factored"
    """factored (Algorithm 1) or sync-dp (gradient all-reduce every inner step)."""
    workers: int = 4
    """Number of workers M."""
    inner_steps: int = 50
    """Inner steps H per round (for sync-dp: steps between measurements of a 'round')."""
    rounds: int = 10
    """Outer rounds R."""
    seed: int = 0
    """Seed for model init, data streams, gossip matchings."""
    device: str = "auto"
    """auto (CUDA when present), cpu, cuda or cuda:N."""
    model: ModelConfig = field(default_factory=ModelConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerOptConfig = field(default_factory=InnerOptConfig)
    outer: OuterOptConfig = field(default_factory=OuterOptConfig)
    mix1: MixConfig = field(default_factory=MixConfig)
    mix2: MixConfig = field(default_factory=lambda: MixConfig(kind="global"))
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    round: RoundConfig = field(default_factory=RoundConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    groups: GroupConfig = field(default_factory=GroupConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES)
        _positive("workers", self.workers)
        _positive("inner_steps", self.inner_steps)
        _positive("rounds", self.rounds)
        if self.seed < 0:
            raise ConfigError("seed", f"must be >= 0, got {self.seed}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        self._tokenizer_of_init()
        for name in ("model", "compute", "data", "inner", "outer", "mix1", "mix2", "monitor", "timeouts", "transport", "adaptive",
                     "checkpoint", "round", "robust", "groups", "logging"):
            getattr(self, name).check(name)
        micro = self.compute.micro_batch_size
        if micro and self.data.batch_size % micro:
            raise ConfigError("compute.micro_batch_size", f"must divide data.batch_size = {self.data.batch_size}, got {micro}")
        if self.mix2.state:
            raise ConfigError("mix2.state", "only Mix1 can average the outer optimizer state")
        if self.mix1.mode != "fixed":
            raise ConfigError("mix1.mode", "only Mix2 can be adaptive (Mix1 is non-blocking)")
        if self.mix2.mode == "adaptive":
            if self.mix2.kind == "identity":
                raise ConfigError("mix2.mode", "adaptive needs mix2.kind gossip or global")
            if not self.monitor.enabled:
                raise ConfigError("mix2.mode", "adaptive is driven by the monitors: monitor.enabled must be true")
        from gossiploco.blocks import block_names, select_blocks

        shape = self.model.architecture(self.data.seq_len)
        names = block_names(shape.n_layers, tied=shape.tie_embeddings)
        for mix in ("mix1", "mix2"):
            select_blocks(names, getattr(self, mix).blocks, field=f"{mix}.blocks")
        if self.adaptive.order:
            select_blocks(names, self.adaptive.order, field="adaptive.order")
        self._check_round()

    def _tokenizer_of_init(self) -> None:
        """A run from a checkpoint (``model.init``) on text data with no ``data.tokenizer`` tokenizes with the
        checkpoint's ``tokenizer.json``: ``data.tokenizer`` is set to it (.bin files and prepared folders are
        already tokenized and are left alone)."""
        if not self.model.init:
            return
        self.model.architecture(self.data.seq_len)  # a checkpoint it cannot use is the first thing to hear of
        if self.data.tokenizer or any(p.endswith(".bin") or Path(p).is_dir() for p in self.data.paths):
            return
        from gossiploco.hf_checkpoint import tokenizer_path

        path = tokenizer_path(self.model.init)
        if not path.is_file():
            raise ConfigError("model.init", f"{self.model.init} has no tokenizer.json for the text data; give "
                                            "data.tokenizer (the checkpoint's tokenizer file) or tokenized data")
        self.data.tokenizer = str(path)

    def _check_round(self) -> None:
        """The [round] combinations that cannot work (each error names the field to change)."""
        factors = self.round.step_time_factors
        if factors and len(factors) != self.workers:
            raise ConfigError("round.step_time_factors", f"one factor per worker: {self.workers} workers, got {len(factors)}")
        if self.mode == "sync-dp" and self.round.budget != "steps":
            raise ConfigError("round.budget", "sync-dp reduces gradients every inner step in lockstep: use budget = \"steps\"")

    @property
    def total_inner_steps(self) -> int:
        return self.inner_steps * self.rounds

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------
# Loading


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def resolve_preset(path_or_name: str | Path) -> Path:
    """A TOML path as given, or a preset name looked up in ``peers/``."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    candidate = PRESETS_DIR / f"{path_or_name}.toml"
    if candidate.is_file():
        return candidate
    raise ConfigError("config", f"no such file or preset {str(path_or_name)!r}; presets: {', '.join(preset_names())}")


def load_config(path_or_name: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a TOML preset, apply dotted-key ``overrides`` (``{"model.size": "small"}``), validate."""
    path = resolve_preset(path_or_name)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path}: invalid TOML: {exc}") from exc
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        *parents, leaf = key.split(".")
        table = raw
        for part in parents:
            table = table.setdefault(part, {})
        table[leaf] = value
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, raw, prefix="")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip(".") or "config", f"expected a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            raise ConfigError(f"{prefix}{key}", f"unknown field; known fields: {', '.join(sorted(known))}")
    kwargs = {}
    for key, value in raw.items():
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            kwargs[key] = _build(kind, value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", kind, value)
    return cls(**kwargs)


def _coerce(name: str, kind: Any, value: Any) -> Any:
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        (item,) = typing.get_args(kind)[:1]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(name, f"expected a list, got {value!r}")
        return [_coerce(name, item, v) for v in value]
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"expected an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(name, f"expected a finite number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(name, f"expected a string, got {value!r}")
        return value
    raise ConfigError(name, f"unsupported field type {kind!r}")  # pragma: no cover
