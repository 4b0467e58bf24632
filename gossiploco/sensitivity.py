"""Per-block JS sensitivity and Mix2 subset selection (paper section 4.4, appendix D.3, Figure 7, Table 6).

Which parameter blocks drive functional disagreement? For block b, worker m's *sensitivity
term* is the JS distance between the averaged model with only block b replaced by worker m's
copy and the averaged model itself, on the shared held-out batch U::

    s_{m,b} = 1/|U| sum_u d_JS( f(x_bar[b <- x_{m,b}], u), f(x_bar, u) )
    s_b     = 1/M sum_m s_{m,b}

with the CD_JS conventions (``consensus.js_term``: float64, log domain, the averaged model's
top-k tokens). A block on which every worker equals the average contributes exactly 0; the
rest of the model is held at the average, so s_b is the disagreement that block alone adds.

``track`` measures s_b at the start of every round of a virtual-swarm run (after the outer
step, where CD_JS spikes: Figure 4) and keeps the series; its mean and max over training rank
the blocks (Figure 7). ``sweep`` then trains one swarm per subset size k with pairwise-gossip
Mix2 on the top-k blocks (plus full Mix2 and no Mix2) and records each run's peak CD_JS
(Table 6); ``propose`` picks the smallest subset whose peak is within a relative tolerance of
full Mix2's, and ``preset_toml`` writes it as a preset (``mix2.blocks = [...]``).

The measurement functions take plain parameter dicts, an evaluation model and a batch, so an
adaptive Mix2 controller or a network peer (its own term against the swarm average) can reuse
them; only ``track``/``run_config``/``sweep`` know about the virtual swarm.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gossiploco import consensus
from gossiploco.config import MixConfig, RunConfig
from gossiploco.errors import ConfigError
from gossiploco.trainer import LocalTrainer

if TYPE_CHECKING:
    from gossiploco.data import Corpus
    from gossiploco.metrics import MetricsSink
    from gossiploco.runtime.virtual import SwarmResult, VirtualSwarm

TensorDict = dict[str, torch.Tensor]
RANK_BY = ("mean", "max")
DEFAULT_SWEEP_SIZES = (1, 2, 4, 6)
"""Subset sizes swept by default (those below the number of blocks)."""


# ---------------------------------------------------------------------------------------------
# Measuring


def block_sensitivity_term(
    own: Mapping[str, torch.Tensor],
    avg: Mapping[str, torch.Tensor],
    evaluator: LocalTrainer,
    batch: torch.Tensor,
    groups: Mapping[str, Sequence[str]],
    top_k: int,
) -> dict[str, float]:
    """One worker's term s_{m,b} for every block: {block: mean d_JS of avg[b <- own_b] against avg}.

    ``evaluator`` is a scratch model of the same architecture; its parameters are overwritten
    (it holds ``avg`` on return). Blocks until all forward passes are done. Not thread-safe
    with other users of ``evaluator``.
    """
    return block_sensitivity([own], avg, evaluator, batch, groups, top_k)


def block_sensitivity(
    workers: Sequence[Mapping[str, torch.Tensor]],
    avg: Mapping[str, torch.Tensor] | None,
    evaluator: LocalTrainer,
    batch: torch.Tensor,
    groups: Mapping[str, Sequence[str]],
    top_k: int,
) -> dict[str, float]:
    """s_b = 1/M sum_m s_{m,b} for every block (in ``groups`` order), from the workers' parameters.

    ``avg`` defaults to ``consensus.average(workers)``. One forward pass of ``batch`` for the
    averaged model plus one per (block, worker). ``evaluator`` holds ``avg`` on return.
    """
    avg = consensus.average(workers) if avg is None else avg
    evaluator.load_params(dict(avg))
    avg_logits = evaluator.logits(batch)
    out = {}
    for block, names in groups.items():
        terms = []
        for own in workers:
            _load_some(evaluator, own, names)  # the average, with only this block taken from the worker
            terms.append(consensus.js_term(evaluator.logits(batch), avg_logits, top_k))
        _load_some(evaluator, avg, names)
        out[block] = sum(terms) / len(terms)
    return out


def _load_some(evaluator: LocalTrainer, values: Mapping[str, torch.Tensor], names: Sequence[str]) -> None:
    """Copy ``values[n]`` into the evaluator's model for the parameters ``names`` only."""
    params = dict(evaluator.model.named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].copy_(values[n])


@dataclass
class SensitivityTrace:
    """s_b measured over training: one value per block per measurement (Figure 7's raw data)."""

    blocks: list[str]
    """Block names in model order."""
    block_params: dict[str, int]
    """Parameters per block."""
    rounds: list[int] = field(default_factory=list)
    """Round of each measurement (taken at inner step h = 0)."""
    steps: list[int] = field(default_factory=list)
    """Global inner step of each measurement."""
    series: dict[str, list[float]] = field(default_factory=dict)
    """{block: s_b at each measurement}."""

    def add(self, r: int, step: int, values: Mapping[str, float]) -> None:
        self.rounds.append(r)
        self.steps.append(step)
        for b in self.blocks:
            self.series.setdefault(b, []).append(values[b])

    def mean(self) -> dict[str, float]:
        return {b: sum(v) / len(v) if v else 0.0 for b, v in self._values().items()}

    def max(self) -> dict[str, float]:
        return {b: max(v, default=0.0) for b, v in self._values().items()}

    def ranking(self, by: str = "mean") -> list[str]:
        """Blocks from most to least sensitive by their ``mean`` or ``max`` over the measurements."""
        if by not in RANK_BY:
            raise ConfigError("--rank-by", f"must be one of {', '.join(RANK_BY)}; got {by!r}")
        return rank_blocks(self.mean() if by == "mean" else self.max(), self.blocks)

    def fraction(self, blocks: Sequence[str]) -> float:
        """Fraction of the model's parameters in ``blocks``."""
        return sum(self.block_params[b] for b in blocks) / sum(self.block_params.values())

    def to_dict(self, by: str = "mean") -> dict:
        mean, peak, ranking = self.mean(), self.max(), self.ranking(by)
        return {
            "rank_by": by,
            "ranking": ranking,
            "rounds": self.rounds,
            "steps": self.steps,
            "blocks": {b: {"rank": ranking.index(b) + 1, "params": self.block_params[b], "fraction": self.fraction([b]),
                           "mean": mean[b], "max": peak[b], "series": self.series.get(b, [])} for b in self.blocks},
        }

    def _values(self) -> dict[str, list[float]]:
        return {b: self.series.get(b, []) for b in self.blocks}


def rank_blocks(values: Mapping[str, float], order: Sequence[str]) -> list[str]:
    """Blocks sorted by ``values`` descending; ties keep model ``order``."""
    position = {b: i for i, b in enumerate(order)}
    return sorted(order, key=lambda b: (-values[b], position[b]))


# ---------------------------------------------------------------------------------------------
# Running (virtual swarm)


@dataclass
class SubsetResult:
    """One run of the subset sweep (a row of Table 6)."""

    label: str
    """``no Mix2``, ``top-k`` or ``full Mix2``."""
    size: int | None
    """Number of top-ranked blocks under Mix2 (0: none; None: all)."""
    blocks: list[str]
    """The mix2.blocks of the run (``["*"]`` for full Mix2, empty for none)."""
    mix2_fraction: float
    """Fraction of the parameters Mix2 exchanges."""
    peak_cd_js: float
    """Largest CD_JS over the run's measurements."""
    final_val_loss: float | None
    """Validation loss of the final averaged model."""


def model_blocks(cfg: RunConfig) -> list[str]:
    """The block names of ``cfg``'s model, in model order."""
    from gossiploco.blocks import block_names

    shape = cfg.model.architecture(cfg.data.seq_len)
    return block_names(shape.n_layers, tied=shape.tie_embeddings)


def check_config(cfg: RunConfig) -> None:
    """Sensitivity needs workers that can disagree: factored mode and at least two workers."""
    if cfg.mode != "factored":
        raise ConfigError("mode", f"sensitivity needs factored mode (in {cfg.mode} the workers never disagree)")
    if cfg.workers < 2:
        raise ConfigError("workers", f"sensitivity needs at least 2 workers, got {cfg.workers}")
    if not cfg.monitor.enabled:
        raise ConfigError("monitor.enabled", "sensitivity is measured alongside the monitors: must be true")


def track(swarm: VirtualSwarm, sink: MetricsSink | None = None,
          on_record: Callable[[dict], None] | None = None) -> tuple[SwarmResult, SensitivityTrace]:
    """Run ``swarm`` (a ``VirtualSwarm``) to the end, measuring s_b at every round start (h = 0,
    including the final measurement after the last round). Returns ``(SwarmResult, SensitivityTrace)``.

    The probe uses only the swarm's scratch evaluation model, so training is unchanged.
    """
    cfg = swarm.cfg
    params = swarm.trainers[0].params_cpu()
    trace = SensitivityTrace(list(swarm.groups), {b: sum(params[n].numel() for n in names) for b, names in swarm.groups.items()})

    def on_step(advance: int, record: dict | None) -> None:
        if record is None:
            return
        if record["h"] == 0:
            workers = [t.params_cpu() for t in swarm.trainers]
            values = block_sensitivity(workers, None, swarm.eval_trainer, swarm.heldout, swarm.groups, cfg.monitor.js_top_k)
            trace.add(record["round"], record["step"], values)
        if on_record:
            on_record(record)

    result = swarm.run(sink, on_step)
    return result, trace


def subset_config(cfg: RunConfig, blocks: Sequence[str], name: str | None = None) -> RunConfig:
    """``cfg`` with pairwise-gossip Mix2 on ``blocks`` (none: Mix2 identity); Mix1 and the rest unchanged."""
    mix2 = MixConfig(kind="gossip", blocks=list(blocks)) if blocks else MixConfig(kind="identity")
    return dataclasses.replace(cfg, mix2=mix2, name=name or cfg.name)


def sweep_sizes(n_blocks: int, requested: Sequence[int] | None = None) -> list[int]:
    """Subset sizes to sweep: ``requested`` (each in 1..n_blocks-1), else the defaults that fit."""
    if requested is None:
        return [k for k in DEFAULT_SWEEP_SIZES if k < n_blocks] or [1]
    for k in requested:
        if not 1 <= k < n_blocks:
            raise ConfigError("--sweep-sizes", f"each size must be in 1..{n_blocks - 1} (the model has {n_blocks} blocks; "
                                               f"all of them is the full-Mix2 run), got {k}")
    return sorted(set(requested))


def run_config(cfg: RunConfig, corpus: Corpus | None = None, out_dir: Path | None = None) -> dict:
    """Train one virtual swarm with ``cfg``; its summary (``peak_cd_js`` = ``max_cd_js``)."""
    from gossiploco.metrics import MetricsSink
    from gossiploco.runtime.virtual import VirtualSwarm

    sink = MetricsSink(out_dir)
    try:
        result = VirtualSwarm(cfg, corpus=corpus).run(sink)
        result.summary["run_config"] = cfg.to_dict()
        sink.write_summary(result.summary)
    finally:
        sink.close()
    return result.summary


def sweep(
    cfg: RunConfig,
    trace: SensitivityTrace,
    ranking: Sequence[str],
    sizes: Sequence[int],
    *,
    base_summary: dict | None = None,
    corpus: Corpus | None = None,
    runs_dir: Path | None = None,
    on_result: Callable[[SubsetResult], None] | None = None,
) -> list[SubsetResult]:
    """Table 6: one swarm per subset (no Mix2, top-k for k in ``sizes``, full Mix2), Mix1 as in ``cfg``.

    ``base_summary`` (the summary of the run of ``cfg`` itself) stands in for the no-Mix2 or the
    full-Mix2 run when ``cfg`` is one of them. With ``runs_dir``, each run writes its metrics to
    ``runs_dir/<label>`` (plot them with ``gossiploco plot``).
    """
    base_blocks = _mix2_subset(cfg, trace.blocks)
    plan: list[tuple[str, int | None, list[str]]] = [("no Mix2", 0, [])]
    plan += [(f"top-{k}", k, list(ranking[:k])) for k in sizes]
    plan.append(("full Mix2", None, ["*"]))
    results = []
    for label, size, blocks in plan:
        selected = trace.blocks if blocks == ["*"] else blocks
        if base_summary is not None and base_blocks is not None and set(base_blocks) == set(selected):
            summary = base_summary
        else:
            run_name = f"{cfg.name}-mix2-{label.replace(' ', '-').lower()}"
            out = runs_dir / label.replace(" ", "-").lower() if runs_dir else None
            summary = run_config(subset_config(cfg, blocks, run_name), corpus, out)
        result = SubsetResult(label, size, blocks, trace.fraction(selected) if selected else 0.0,
                              summary["max_cd_js"], summary.get("final_val_loss"))
        results.append(result)
        if on_result:
            on_result(result)
    return results


def _mix2_subset(cfg: RunConfig, blocks: Sequence[str]) -> list[str] | None:
    """The blocks ``cfg``'s Mix2 exchanges, when it is identity ([]) or pairwise gossip; else None."""
    from gossiploco.blocks import select_blocks

    if getattr(cfg.mix2, "mode", "fixed") != "fixed":
        return None  # an adaptive Mix2 moves its subset during the run
    if cfg.mix2.kind == "identity":
        return []
    if cfg.mix2.kind == "gossip":
        return select_blocks(blocks, cfg.mix2.blocks, "mix2.blocks")
    return None


def propose(results: Sequence[SubsetResult], tolerance: float) -> SubsetResult:
    """The smallest top-k subset whose peak CD_JS is within ``tolerance`` (relative) of full Mix2's:
    ``peak <= (1 + tolerance) * peak_full``. Full Mix2 itself when no subset qualifies."""
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ConfigError("--tolerance", f"must be a finite number >= 0, got {tolerance}")
    full = next((r for r in results if r.size is None), None)
    if full is None:
        raise ValueError("the sweep results have no full-Mix2 run")
    limit = (1.0 + tolerance) * full.peak_cd_js
    subsets = sorted((r for r in results if r.size), key=lambda r: r.size)
    return next((r for r in subsets if r.peak_cd_js <= limit), full)


# ---------------------------------------------------------------------------------------------
# The whole analysis


def analyze(
    cfg: RunConfig,
    out: Path,
    *,
    sizes: Sequence[int] | None = None,
    sweep_subsets: bool = True,
    tolerance: float = 0.1,
    rank_by: str = "mean",
    preset_name: str | None = None,
    runs_dir: Path | None = None,
    show: Callable[[str], None] = print,
    progress: Callable[[str], None] = lambda text: None,
) -> dict:
    """Rank the blocks over a run of ``cfg``, then (``sweep_subsets``) sweep the top-k subsets and
    propose one. Writes the report as JSON to ``out`` after the ranking and again at the end;
    ``show`` gets the readable tables, ``progress`` one line per training run. Returns the report.

    Raises ``ConfigError`` for a config that cannot disagree or a bad size, tolerance or
    ``rank_by``, before any training.
    """
    from gossiploco.metrics import MetricsSink
    from gossiploco.runtime.virtual import VirtualSwarm

    check_config(cfg)
    blocks = model_blocks(cfg)
    sizes = sweep_sizes(len(blocks), sizes) if sweep_subsets else []
    if rank_by not in RANK_BY:
        raise ConfigError("--rank-by", f"must be one of {', '.join(RANK_BY)}; got {rank_by!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ConfigError("--tolerance", f"must be a finite number >= 0, got {tolerance}")

    progress(f"ranking run: {cfg.name}, {cfg.workers} workers x {cfg.rounds} rounds x {cfg.inner_steps} inner steps, model {cfg.model.size}")
    swarm = VirtualSwarm(cfg)
    sink = MetricsSink(runs_dir / "ranking" if runs_dir else None)
    try:
        result, trace = track(swarm, sink)
        result.summary["run_config"] = cfg.to_dict()
        sink.write_summary(result.summary)
    finally:
        sink.close()
    report = {"config": cfg.name, "run_config": cfg.to_dict(), "measure": "round starts (h = 0)",
              "ranking_run": {k: v for k, v in result.summary.items() if k != "run_config"}, **trace.to_dict(rank_by)}
    _write_json(out, report)
    show(describe_ranking(trace, rank_by))
    if not sweep_subsets:
        return report

    ranking = report["ranking"]

    def on_result(r: SubsetResult) -> None:
        progress(f"{r.label:<10} Mix2 on {_percent(r.mix2_fraction):>6} of the parameters: peak CD_JS {r.peak_cd_js:.4g}")

    results = sweep(cfg, trace, ranking, sizes, base_summary=result.summary, corpus=swarm.corpus, runs_dir=runs_dir, on_result=on_result)
    chosen = propose(results, tolerance)
    full = next(r for r in results if r.size is None)
    none = next(r for r in results if r.size == 0)
    name = preset_name or f"{cfg.name}-mix2-subset"
    what = (f"Mix2 on the {chosen.label} blocks by JS sensitivity" if chosen.size
            else f"no subset within tolerance {tolerance:g} of full Mix2, so Mix2 on every block")
    comment = [
        f"Chosen by `gossiploco sensitivity` from {cfg.name} (appendix D.3): {what}",
        f"(ranked by {rank_by} over round starts; model {cfg.model.size}, {cfg.workers} workers, {cfg.rounds} rounds x {cfg.inner_steps} inner steps, seed {cfg.seed}).",
        f"Peak CD_JS {chosen.peak_cd_js:.4g} with Mix2 on {_percent(chosen.mix2_fraction)} of the parameters; "
        f"full Mix2 {full.peak_cd_js:.4g}, no Mix2 {none.peak_cd_js:.4g} (tolerance {tolerance:g}).",
        f"Ranking, most sensitive first: {_toml_value(ranking)}",
    ]
    text = preset_toml(cfg, chosen.blocks, name, comment)
    _check_preset(text)
    report.update(
        tolerance=tolerance,
        sweep=[dataclasses.asdict(r) for r in results],
        proposal={**dataclasses.asdict(chosen), "within_tolerance": chosen.size is not None},
        preset_name=name,
        preset_toml=text,
    )
    _write_json(out, report)
    show(describe_sweep(results, chosen))
    return report


def _write_json(path: Path, report: dict) -> None:
    from gossiploco.metrics import _clean

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(report), indent=2) + "\n")


def _check_preset(text: str) -> None:
    """The preset must load exactly like a file in peers/ (a bug here, not a user error)."""
    import tomllib

    from gossiploco.config import config_from_dict

    config_from_dict(tomllib.loads(text))


# ---------------------------------------------------------------------------------------------
# Output


def preset_toml(cfg: RunConfig, blocks: Sequence[str], name: str, comment: Sequence[str] = ()) -> str:
    """A preset (``peers/<name>.toml``) with ``cfg``'s mode, model size and Mix1, and pairwise-gossip
    Mix2 on ``blocks``; ``load_config`` accepts it. ``comment`` lines go into the header."""
    mix2 = subset_config(cfg, blocks).mix2
    lines = [f"# {line}" for line in comment]
    lines += [f"name = {_toml_value(name)}", f"mode = {_toml_value(cfg.mode)}", "", "[model]", f"size = {_toml_value(cfg.model.size)}"]
    for table, mix in (("mix1", cfg.mix1), ("mix2", mix2)):
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in dataclasses.asdict(mix).items()]
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # strings, ints and finite floats are written alike in JSON and TOML


def describe_ranking(trace: SensitivityTrace, by: str = "mean") -> str:
    """A readable table of the ranking (Figure 7 as numbers)."""
    mean, peak = trace.mean(), trace.max()
    width = max(len(b) for b in trace.blocks)
    lines = [f"Per-block JS sensitivity over {len(trace.rounds)} round starts (ranked by {by})",
             f"{'rank':>4}  {'block':<{width}}  {'params':>7}  {'mean':>10}  {'max':>10}"]
    for i, b in enumerate(trace.ranking(by), 1):
        lines.append(f"{i:>4}  {b:<{width}}  {_percent(trace.fraction([b])):>7}  {mean[b]:10.4g}  {peak[b]:10.4g}")
    return "\n".join(lines)


def describe_sweep(results: Sequence[SubsetResult], chosen: SubsetResult | None = None) -> str:
    """A readable Table 6: peak CD_JS and Mix2 fraction of every subset."""
    full = next((r.peak_cd_js for r in results if r.size is None), None)
    lines = [f"{'subset':<10}  {'Mix2 params':>11}  {'peak CD_JS':>10}  {'vs full':>8}  {'val loss':>8}  blocks"]
    for r in results:
        ratio = f"{r.peak_cd_js / full:7.2f}x" if full else f"{'-':>8}"
        val = f"{r.final_val_loss:8.4f}" if r.final_val_loss is not None else f"{'-':>8}"
        mark = "  <- proposed" if chosen is r else ""
        lines.append(f"{r.label:<10}  {_percent(r.mix2_fraction):>11}  {r.peak_cd_js:10.4g}  {ratio}  {val}  "
                     f"{', '.join(r.blocks) or '-'}{mark}")
    return "\n".join(lines)


def _percent(fraction: float) -> str:
    """``12.5%``; never rounds a partial fraction to 0.0% or 100.0%."""
    text = f"{100 * fraction:.1f}%"
    if 0.0 < fraction < 1.0 and text in ("0.0%", "100.0%"):
        return "<0.1%" if text == "0.0%" else ">99.9%"
    return text
