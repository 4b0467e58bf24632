"""Streamed Mix1 (issue 16): fragments of about equal size, started across the round, give the same mean."""

from __future__ import annotations

import pytest
import torch

from gossiploco.blocks import split_fragments
from gossiploco.data import load_corpus
from gossiploco.factored import FactoredDiLoCo
from gossiploco.mixing import MemoryHub
from gossiploco.runtime.common import build_trainer
from gossiploco.runtime.virtual import VirtualSwarm


def test_fragments_cover_every_parameter_once_in_runs_of_about_equal_size():
    names = [f"p{i}" for i in range(20)]
    sizes = {n: 1 + (7 * i) % 5 for i, n in enumerate(names)}
    for count in (1, 2, 3, 7, 20, 50):
        for order in ("forward", "backward"):
            parts = split_fragments(names, sizes, count, order)
            flat = [n for part in parts for n in part]
            assert flat == (names if order == "forward" else names[::-1])  # consecutive, in order, each once
            assert len(parts) == min(count, len(names)) and all(parts)
            share = sum(sizes.values()) / len(parts)
            assert all(sum(sizes[n] for n in part) <= share + max(sizes.values()) for part in parts)
    with pytest.raises(ValueError):
        split_fragments(names, sizes, 2, "sideways")


@pytest.mark.parametrize("overrides", [
    # 3 s each: in the slow set, so that the fast subset keeps its margin under 2 minutes
    pytest.param({"mix1.fragments": 3}, marks=pytest.mark.slow),
    pytest.param({"mix1.fragments": 4, "mix1.fragment_order": "backward"}, marks=pytest.mark.slow),
    pytest.param({"mix1.fragments": 3, "mix1.compression": "4bit"}, marks=pytest.mark.slow),
])
def test_a_streamed_mix1_trains_the_same_model(make_config, overrides):
    """z does not change during a round, so mixing it in fragments started later gives the same mean: with
    fp32 the very same bits as one exchange (the in-memory hub sums every value in rank order). Compressed,
    the quantization blocks fall elsewhere (each fragment's start at its own start), so the rounding
    differs: the same loss, not the same bits."""
    base = {k: v for k, v in overrides.items() if not k.startswith("mix1.fragment")}
    reference = VirtualSwarm(make_config("globalm1-localm2", **base)).run()
    streamed = VirtualSwarm(make_config("globalm1-localm2", **overrides)).run()
    assert [r.get("mix1_failures") for r in streamed.records] == [r.get("mix1_failures") for r in reference.records]
    if "mix1.compression" in overrides:
        assert streamed.records[-1]["val_loss"] == pytest.approx(reference.records[-1]["val_loss"], rel=2e-3)
    else:
        for name, value in reference.final_params.items():
            assert torch.equal(streamed.final_params[name], value), name
    sent = [r["mix1_bytes"] for r in streamed.records if "mix1_bytes" in r]
    assert sent == [r["mix1_bytes"] for r in reference.records if "mix1_bytes" in r] or "mix1.compression" in overrides


def test_fragment_j_starts_at_inner_step_j_h_over_f(make_config):
    cfg = make_config("globalm1-localm2", inner_steps=6, workers=1, **{"mix1.fragments": 3})
    trainer = build_trainer(cfg, load_corpus(cfg.data), torch.device("cpu"), 0)
    algo = FactoredDiLoCo(trainer, cfg, MemoryHub(1, 5.0).exchange(0))
    try:
        algo.begin_round(0)
        launched = [len(algo._mix1)]
        for _ in range(cfg.inner_steps):
            algo.inner_step()
            launched.append(len(algo._mix1))
        assert launched == [1, 1, 2, 2, 3, 3, 3]  # at steps 0, 2 and 4 of 6
        report = algo.end_round(0)
        assert report.mix1.ok
    finally:
        algo.close()
