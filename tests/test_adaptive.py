"""Adaptive Mix2: the controller's hysteresis against hand-computed decisions, and the swarm obeying it."""

from __future__ import annotations

import pytest

from gossiploco.adaptive import AdaptiveMix2
from gossiploco.blocks import select_parameters
from gossiploco.errors import ConfigError
from gossiploco.runtime.virtual import VirtualSwarm

pytestmark = pytest.mark.timeout(120)


def controller(make_config, **adaptive):
    cfg = make_config("globalm1-adaptive", **{f"adaptive.{k}": v for k, v in adaptive.items()})
    return AdaptiveMix2(cfg)


def test_default_order_grows_through_the_layers_then_the_norm_above_the_floor(make_config):
    c = controller(make_config)
    assert c.floor == ["embed", "lm_head"] and c.blocks == ["embed", "lm_head"]
    assert c.order == ["layers.0.attention", "layers.0.mlp", "layers.1.attention", "layers.1.mlp", "norm"]
    c = controller(make_config, order=["layers.1", "embed", "norm"])  # patterns, floor blocks skipped
    assert c.order == ["layers.1.attention", "layers.1.mlp", "norm"]


def test_spikes_grow_calm_streaks_shrink_and_the_rest_holds(make_config):
    c = controller(make_config, grow_factor=1.5, calm_factor=1.1, shrink_after=2, window=3, warmup_rounds=2)
    actions = []
    for r, signal in enumerate([1.0, 1.0, 2.0, 1.3, 1.0, 1.0, 1.0, 1.0, None]):
        d = c.decide(r, signal)
        actions.append((d.action, len(d.blocks)))
    # levels: -, 1, 1, med(1,1,2)=1, med(1,2,1.3)=1.3, med(2,1.3,1)=1.3, med(1.3,1,1)=1, med(1,1,1)=1, -
    assert actions == [("warmup", 2), ("warmup", 2), ("grow", 3), ("hold", 3), ("hold", 3),
                       ("shrink", 2), ("hold", 2), ("hold", 2), ("hold", 2)]
    assert c.decide(9, 100.0).reason.startswith("CD_JS 100 > 1.5 x level 1")


def test_the_subset_never_leaves_its_bounds(make_config):
    c = controller(make_config, grow_factor=1.01, calm_factor=1.0, shrink_after=1, window=1, warmup_rounds=1,
                   grow_step=2)
    signal = 1.0
    for r in range(10):  # ever larger signals: grows to everything and stops there
        signal *= 2
        c.decide(r, signal)
    assert c.blocks == c.floor + c.order
    for r in range(10, 30):  # constant signals: shrinks back to the floor and stops there
        c.decide(r, 1.0)
    assert c.blocks == c.floor
    c.adopt(99)
    assert c.size == len(c.order)
    c.adopt(-3)
    assert c.size == 0


def test_adaptive_needs_monitors_and_a_mixing_kind(make_config):
    with pytest.raises(ConfigError, match="monitor.enabled"):
        make_config("globalm1-adaptive", **{"monitor.enabled": False})
    with pytest.raises(ConfigError, match="mix2.mode"):
        make_config("globalm1-adaptive", **{"mix2.kind": "identity"})
    with pytest.raises(ConfigError, match="adaptive.calm_factor"):
        make_config("globalm1-adaptive", **{"adaptive.calm_factor": 2.0})
    with pytest.raises(ConfigError, match="mix1.mode"):
        make_config("globalm1", **{"mix1.mode": "adaptive"})


@pytest.mark.slow  # a virtual swarm of several rounds (4 s): the fast subset keeps its margin
def test_the_swarm_mixes_exactly_the_blocks_each_decision_names(make_config, corpus):
    cfg = make_config("globalm1-adaptive", rounds=6, **{"adaptive.grow_factor": 1.01, "adaptive.calm_factor": 1.0,
                                                        "adaptive.warmup_rounds": 1})
    swarm = VirtualSwarm(cfg, corpus=corpus)
    sizes = {n: p.numel() for n, p in swarm.trainers[0].model.named_parameters()}
    records = swarm.run().records
    decisions = [r for r in records if "mix2_decision" in r]
    assert [r["mix2_decision"]["round"] for r in decisions] == list(range(6))
    for record in decisions:
        names = select_parameters(list(sizes), record["mix2_decision"]["blocks"])
        assert record["mix2_bytes"] == 4 * sum(sizes[n] for n in names)
    assert any(r["mix2_decision"]["action"] == "grow" for r in decisions)
