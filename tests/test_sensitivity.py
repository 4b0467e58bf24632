"""Per-block JS sensitivity (appendix D.3): the measurement against its definition, the ranking,
the subset proposal rule, the preset it writes, and the command end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from gossiploco import consensus
from gossiploco import sensitivity as sens
from gossiploco.blocks import group_by_block
from gossiploco.cli import app
from gossiploco.config import load_config
from gossiploco.data import Corpus
from gossiploco.errors import ConfigError
from gossiploco.runtime.common import build_trainer
from gossiploco.runtime.virtual import VirtualSwarm
from testbed.overrides import set_args
from conftest import TINY, tiny_config

TOP_K = 100


def make_evaluator(cfg=None):
    """A tiny scratch model on a synthetic byte corpus (no corpus loading)."""
    cfg = cfg or tiny_config("globalm1")
    tokens = (np.arange(4096) % 256).astype(np.uint8)
    corpus = Corpus(train=tokens, val=tokens, vocab_size=256, description="synthetic")
    return build_trainer(cfg, corpus, torch.device("cpu"), -1)


@pytest.fixture
def setup():
    evaluator = make_evaluator()
    base = evaluator.params_cpu()
    groups = group_by_block(evaluator.names)
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return evaluator, base, groups, batch


def two_workers_differing_in(base, names, scale=0.05, seed=1):
    """Two copies of ``base``, +noise and -noise on ``names`` only."""
    gen = torch.Generator().manual_seed(seed)
    plus, minus = dict(base), dict(base)
    for n in names:
        noise = scale * torch.randn(base[n].shape, generator=gen)
        plus[n], minus[n] = base[n] + noise, base[n] - noise
    return [plus, minus]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("block", ["embed", "layers.0.mlp", "layers.1.attention", "lm_head"])
def test_only_the_block_that_differs_is_nonzero(setup, block):
    evaluator, base, groups, batch = setup
    workers = two_workers_differing_in(base, groups[block])
    s = sens.block_sensitivity(workers, None, evaluator, batch, groups, TOP_K)
    assert list(s) == list(groups)
    assert s[block] > 1e-4
    # Every other block: all worker copies equal the average, so it contributes exactly 0.
    assert all(s[b] == 0.0 for b in groups if b != block), s


@pytest.mark.timeout(60)
def test_identical_workers_contribute_exactly_zero(setup):
    evaluator, base, groups, batch = setup
    s = sens.block_sensitivity([base, dict(base), dict(base)], None, evaluator, batch, groups, TOP_K)
    assert s == dict.fromkeys(groups, 0.0)


@pytest.mark.timeout(60)
def test_matches_the_definition_and_the_per_worker_terms(setup):
    """s_b = 1/M sum_m mean_u d_JS(f(avg[b <- x_m,b]), f(avg)), computed here with fresh full loads."""
    evaluator, base, groups, batch = setup
    gen = torch.Generator().manual_seed(3)
    workers = [{n: v + 0.02 * torch.randn(v.shape, generator=gen) for n, v in base.items()} for _ in range(3)]
    avg = consensus.average(workers)
    s = sens.block_sensitivity(workers, avg, evaluator, batch, groups, top_k=20)

    fresh = make_evaluator()
    fresh.load_params(avg)
    avg_logits = fresh.logits(batch)
    for block, names in groups.items():
        terms = []
        for w in workers:
            fresh.load_params({**avg, **{n: w[n] for n in names}})
            terms.append(consensus.js_term(fresh.logits(batch), avg_logits, 20))
        assert s[block] == pytest.approx(sum(terms) / len(terms), rel=1e-9, abs=1e-12)
    # A network peer computes its own term against the swarm average; the mean of the terms is s_b.
    terms = [sens.block_sensitivity_term(w, avg, evaluator, batch, groups, 20) for w in workers]
    for block in groups:
        assert s[block] == pytest.approx(sum(t[block] for t in terms) / 3, rel=1e-12)
    # The evaluator is left holding the average.
    assert all(torch.equal(evaluator.params_cpu()[n], avg[n]) for n in avg)


@pytest.mark.timeout(10)
def test_ranking_orders_by_the_measured_value():
    blocks = ["embed", "layers.0.attention", "layers.0.mlp", "norm", "lm_head"]
    trace = sens.SensitivityTrace(blocks, dict.fromkeys(blocks, 10))
    trace.add(0, 0, dict.fromkeys(blocks, 0.0))
    trace.add(1, 4, {"embed": 0.25, "layers.0.attention": 0.875, "layers.0.mlp": 0.125, "norm": 0.0, "lm_head": 0.375})
    trace.add(2, 8, {"embed": 0.5, "layers.0.attention": 0.0, "layers.0.mlp": 0.125, "norm": 0.0, "lm_head": 0.375})
    assert trace.mean() == {"embed": 0.25, "layers.0.attention": 0.875 / 3, "layers.0.mlp": 0.25 / 3, "norm": 0.0, "lm_head": 0.25}
    assert trace.max() == {"embed": 0.5, "layers.0.attention": 0.875, "layers.0.mlp": 0.125, "norm": 0.0, "lm_head": 0.375}
    # embed and lm_head tie on the mean (dyadic values: exact): model order breaks the tie.
    assert trace.ranking("mean") == ["layers.0.attention", "embed", "lm_head", "layers.0.mlp", "norm"]
    assert trace.ranking("max") == ["layers.0.attention", "embed", "lm_head", "layers.0.mlp", "norm"]
    trace.add(3, 12, {"embed": 0.0, "layers.0.attention": 0.0, "layers.0.mlp": 0.0, "norm": 0.0, "lm_head": 1.0})
    assert trace.ranking("max") == ["lm_head", "layers.0.attention", "embed", "layers.0.mlp", "norm"]
    assert trace.ranking("mean") == ["lm_head", "layers.0.attention", "embed", "layers.0.mlp", "norm"]  # 0.4375, 0.21875, 0.1875
    report = trace.to_dict("mean")
    assert report["ranking"] == trace.ranking("mean")
    assert report["blocks"]["lm_head"]["rank"] == 1 and report["blocks"]["lm_head"]["series"] == [0.0, 0.375, 0.375, 1.0]
    with pytest.raises(ConfigError, match="--rank-by"):
        trace.ranking("median")


def result(label, size, peak):
    blocks = ["*"] if size is None else [f"b{i}" for i in range(size or 0)]
    return sens.SubsetResult(label, size, blocks, 0.1 * (size or 0) if size is not None else 1.0, peak, None)


@pytest.mark.timeout(10)
def test_proposal_is_the_smallest_subset_within_tolerance():
    results = [result("no Mix2", 0, 0.5), result("top-4", 4, 1.02), result("top-1", 1, 1.5),
               result("top-2", 2, 1.08), result("full Mix2", None, 1.0)]
    assert sens.propose(results, 0.10).label == "top-2"
    assert sens.propose(results, 0.05).label == "top-4"
    assert sens.propose(results, 0.60).label == "top-1"
    assert sens.propose([result("top-1", 1, 1.1), result("full Mix2", None, 1.0)], 0.1).label == "top-1"  # the bound is inclusive
    # Nothing qualifies: full Mix2. The no-Mix2 run is never proposed, however low its peak.
    assert sens.propose(results, 0.0).label == "full Mix2"
    with pytest.raises(ConfigError, match="--tolerance"):
        sens.propose(results, -0.1)


@pytest.mark.timeout(10)
def test_sweep_sizes():
    assert sens.sweep_sizes(7) == [1, 2, 4, 6]
    assert sens.sweep_sizes(4) == [1, 2]
    assert sens.sweep_sizes(7, [4, 1, 4]) == [1, 4]
    with pytest.raises(ConfigError, match="--sweep-sizes: each size must be in 1..6"):
        sens.sweep_sizes(7, [7])


@pytest.mark.timeout(10)
def test_preset_is_loadable(tmp_path):
    cfg = load_config("globalm1s", {"model.size": "small"})
    text = sens.preset_toml(cfg, ["lm_head", "embed", "layers.0.attention"], "my-subset", ["a comment", "another"])
    path = tmp_path / "my-subset.toml"
    path.write_text(text)
    loaded = load_config(path)
    assert loaded.name == "my-subset" and loaded.mode == "factored" and loaded.model.size == "small"
    assert loaded.mix1 == cfg.mix1 and loaded.mix1.state
    assert (loaded.mix2.kind, loaded.mix2.blocks) == ("gossip", ["lm_head", "embed", "layers.0.attention"])
    assert text.startswith("# a comment\n# another\n")


@pytest.mark.slow  # 2.2 s: in the slow set, so that the fast subset keeps its margin under 2 minutes
@pytest.mark.timeout(120)
def test_tracking_leaves_training_unchanged():
    cfg = tiny_config("globalm1", workers=2, rounds=2)

    def strip(records):
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]

    plain = VirtualSwarm(cfg).run().records
    tracked, trace = sens.track(VirtualSwarm(cfg))
    assert strip(tracked.records) == strip(plain)
    assert trace.rounds == [0, 1, 2] and trace.steps == [0, 4, 8]
    assert all(trace.series[b][0] == 0.0 for b in trace.blocks)  # identical init: no disagreement yet
    assert all(len(v) == 3 for v in trace.series.values())
    assert max(trace.max().values()) > 0.0


def tiny_args(**overrides):
    return set_args({**TINY, "rounds": 2, **overrides})


@pytest.mark.slow  # a 3 s end-to-end run: keeps the fast subset under its 2 minutes
@pytest.mark.timeout(240)
def test_cli_end_to_end_writes_report_and_loadable_preset(tmp_path):
    out, preset, runs = tmp_path / "sens.json", tmp_path / "peers" / "auto-subset.toml", tmp_path / "runs"
    result = CliRunner().invoke(app, ["sensitivity", "--config", "globalm1", *tiny_args(workers=3), "--sweep-sizes", "1,2",
                                      "--out", str(out), "--preset-out", str(preset), "--runs-dir", str(runs)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    blocks = sens.model_blocks(load_config("globalm1", {"model.size": "tiny"}))
    assert sorted(report["ranking"]) == sorted(blocks) and set(report["blocks"]) == set(blocks)
    means = [report["blocks"][b]["mean"] for b in report["ranking"]]
    assert means == sorted(means, reverse=True)
    assert report["rounds"] == [0, 1, 2]
    for b in blocks:
        entry = report["blocks"][b]
        assert len(entry["series"]) == 3 and entry["max"] == max(entry["series"])
        assert entry["mean"] == pytest.approx(sum(entry["series"]) / 3)
    sweep = {r["label"]: r for r in report["sweep"]}
    assert list(sweep) == ["no Mix2", "top-1", "top-2", "full Mix2"]
    assert sweep["top-2"]["blocks"] == report["ranking"][:2] and sweep["full Mix2"]["mix2_fraction"] == 1.0
    assert sweep["no Mix2"]["peak_cd_js"] == report["ranking_run"]["max_cd_js"]  # globalm1 has no Mix2: its run is reused
    chosen = report["proposal"]
    full_peak = sweep["full Mix2"]["peak_cd_js"]
    qualifying = [sweep[k] for k in ("top-1", "top-2") if sweep[k]["peak_cd_js"] <= 1.1 * full_peak]
    assert chosen["label"] == (qualifying[0]["label"] if qualifying else "full Mix2")
    cfg = load_config(preset)
    assert cfg.name == "auto-subset" and cfg.mix1.kind == "global" and cfg.mix2.kind == "gossip"
    assert cfg.mix2.blocks == chosen["blocks"]
    assert preset.read_text() == report["preset_toml"]
    assert "Per-block JS sensitivity" in result.output and "peak CD_JS" in result.output
    assert f"mix2.blocks=[{','.join(chosen['blocks'])}]" in "".join(result.output.split())
    for label in ("ranking", "top-1", "top-2", "full-mix2"):
        assert (runs / label / "metrics.jsonl").is_file() and (runs / label / "summary.json").is_file()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "globalm1", "--sweep-sizes", "7"], "--sweep-sizes: each size must be in 1..6"),
        (["--config", "globalm1", "--sweep-sizes", "one"], "--sweep-sizes: expected comma-separated integers"),
        (["--config", "globalm1", "--tolerance", "-1"], "--tolerance: must be a finite number >= 0"),
        (["--config", "globalm1", "--rank-by", "median"], "--rank-by: must be one of mean, max"),
        (["--config", "sync-dp"], "mode: sensitivity needs factored mode"),
        (["--config", "globalm1", "--workers", "1"], "workers: sensitivity needs at least 2 workers"),
        (["--config", "globalm1", "--set", "monitor.enabled=false"], "monitor.enabled: sensitivity is measured alongside the monitors"),
    ],
)
def test_cli_rejects_bad_options_before_training(tmp_path, args, message):
    result = CliRunner().invoke(app, ["sensitivity", "--model", "tiny", "--out", str(tmp_path / "s.json"), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "s.json").exists()
