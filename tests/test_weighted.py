"""Token-weighted merging (Decoupled DiLoCo) and time-budget rounds, against references written here."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gossiploco.errors import ConfigError
from gossiploco.mixing import GlobalMix, GossipMix, MemoryHub
from gossiploco.mixing.compression import build_codec
from gossiploco.round_budget import RoundBudget
from gossiploco.runtime.common import measure_due
from gossiploco.runtime.virtual import VirtualSwarm


def mix_weighted(mixers, values, weights, round_index=0):
    """Every worker's ``mix`` at once over a fresh in-memory hub; ``weights`` None: the unweighted call."""
    hub = MemoryHub(len(values), 10.0)
    with ThreadPoolExecutor(max_workers=len(values)) as pool:
        futures = [pool.submit(m.mix, [v], round_index, hub.exchange(r), weight=None if weights is None else weights[r])
                   for r, (m, v) in enumerate(zip(mixers, values))]
        return [f.result(timeout=60) for f in futures]


def random_values(count, size=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(size, generator=gen)} for _ in range(count)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_all_reduce_is_the_weighted_mean(seed):
    M = 5
    values = random_values(M, seed=seed)
    weights = (torch.rand(M, generator=torch.Generator().manual_seed(seed + 10), dtype=torch.float64) * 3 + 0.1).tolist()
    out = mix_weighted([GlobalMix("mix2", ["w"], 0) for _ in range(M)], values, weights)
    reference = sum(w * v["w"].double() for w, v in zip(weights, values)) / sum(weights)
    for o in out:
        assert o.ok
        assert torch.allclose(o.values[0]["w"].double(), reference, rtol=0, atol=1e-5)
        assert torch.equal(o.values[0]["w"], out[0].values[0]["w"])  # every member holds the same mean
        assert o.weight == pytest.approx(sum(weights) / M, rel=1e-6)


@pytest.mark.parametrize("workers", [8, 7])
def test_push_sum_gossip_keeps_the_weighted_mean_and_total_weight_and_converges_to_it(workers):
    values = random_values(workers, size=64, seed=workers)
    weights = (torch.rand(workers, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4 + 0.25).tolist()
    total_weight = sum(weights)
    weighted_sum = sum(w * v["w"].double() for w, v in zip(weights, values))
    target = weighted_sum / total_weight
    for r in range(40):
        out = mix_weighted([GossipMix("mix2", ["w"], seed=5) for _ in range(workers)], values, weights, round_index=r)
        values, weights = [o.values[0] for o in out], [o.weight for o in out]
        # push-sum's invariants: sum(w) and sum(w x) (hence sum(w x) / sum(w)) unchanged by every matching
        assert sum(weights) == pytest.approx(total_weight, rel=1e-6)
        assert torch.allclose(sum(w * v["w"].double() for w, v in zip(weights, values)), weighted_sum, rtol=0, atol=1e-4)
        assert sum(o.partner is None for o in out) == workers % 2
    spread = max(float((v["w"].double() - target).abs().max()) for v in values)
    assert spread < 1e-3  # every worker near the weighted mean (the unweighted mean is far: checked next)
    assert float((sum(v["w"].double() for v in random_values(workers, size=64, seed=workers)) / workers - target).abs().max()) > 1e-2


@pytest.mark.parametrize("kind", [GlobalMix, GossipMix])
@pytest.mark.parametrize("lie", [1e6, -5.0, float("nan")])
def test_a_weight_out_of_range_fails_the_mix_instead_of_outweighing_everyone(kind, lie):
    """A peer claiming a million rounds of tokens (or a negative or NaN count): its partner (gossip: its own
    weight is seen) or the whole group (all-reduce: the group's mean weight is out of range) refuses the mix
    (identity, counted as a failure with the cause), and nobody divides by zero. Within an all-reduce only the
    sum of the weights is seen, as only the sum of the values is: a member can bend the mean through either,
    which robust aggregation, not this check, would have to address."""
    values = random_values(4, seed=7)
    out = mix_weighted([kind("mix2", ["w"], 3) for _ in values], values, [1.0, 1.0, 1.0, lie])
    failed = {r for r, o in enumerate(out) if not o.ok}
    if kind is GossipMix:  # the liar and its partner; the other pair mixes
        assert len(failed) == 2 and 3 in failed and all(out[r].ok for r in range(4) if r not in failed)
    else:
        assert failed == {0, 1, 2, 3}
    for r in failed:
        assert "weight" in out[r].cause and "outside" in out[r].cause
        assert torch.equal(out[r].values[0]["w"], values[r]["w"])  # identity: its own values back


@pytest.mark.parametrize("kind", [GlobalMix, GossipMix])
def test_unit_weights_give_the_unweighted_mix_bit_for_bit(kind):
    values = random_values(6, seed=4)
    plain = mix_weighted([kind("mix2", ["w"], 3) for _ in values], values, None, round_index=2)
    weighted = mix_weighted([kind("mix2", ["w"], 3) for _ in values], values, [1.0] * len(values), round_index=2)
    for p, w in zip(plain, weighted):
        assert torch.equal(p.values[0]["w"], w.values[0]["w"]) and p.partner == w.partner
    equal = mix_weighted([kind("mix2", ["w"], 3) for _ in values], values, [0.7] * len(values), round_index=2)
    for p, e in zip(plain, equal):  # any equal weights: the same mean up to rounding
        assert torch.allclose(p.values[0]["w"], e.values[0]["w"], rtol=0, atol=1e-6)


def test_time_budget_gives_a_slow_worker_fewer_steps_and_less_weight_in_mix2(make_config, corpus):
    cfg = make_config("globalm1-localm2", workers=2, rounds=1, **{
        "mix2.kind": "global", "round.budget": "time", "round.weights": "tokens", "round.step_time_factors": [1.0, 2.0]})
    swarm = VirtualSwarm(cfg, corpus=corpus)
    assert swarm.round_steps == [cfg.inner_steps, cfg.inner_steps // 2]
    zs = [dict(a.z) for a in swarm.algos]
    for algo in swarm.algos:
        algo.begin_round(0)
    for algo, steps in zip(swarm.algos, swarm.round_steps):
        for _ in range(steps):
            algo.inner_step()
    deltas = [{n: p - z[n] for n, p in a.trainer.params_cpu().items()} for a, z in zip(swarm.algos, zs)]
    reports = list(swarm.pool.map(lambda a: a.end_round(0), swarm.algos))
    swarm.close()
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert [rep.steps for rep in reports] == [4, 2]
    assert [rep.tokens for rep in reports] == [4 * tokens_per_step, 2 * tokens_per_step]
    for n in deltas[0]:  # Delta_hat = (1 * Delta_0 + 0.5 * Delta_1) / 1.5, written out
        reference = (deltas[0][n].double() + 0.5 * deltas[1][n].double()) / 1.5
        for rep in reports:
            assert torch.allclose(rep.mix2.values[0][n].double(), reference, rtol=0, atol=1e-6), n
    assert not torch.allclose(reports[0].mix2.values[0]["lm_head.weight"],
                              (deltas[0]["lm_head.weight"] + deltas[1]["lm_head.weight"]) / 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("preset", ["globalm1-localm2", "globalm1s"])
def test_time_budget_with_equal_factors_is_the_steps_budget_bit_for_bit(make_config, corpus, preset):
    small = {"workers": 2, "rounds": 2, "monitor.enabled": False}
    steps = VirtualSwarm(make_config(preset, **small), corpus=corpus).run()
    timed = VirtualSwarm(make_config(preset, **small, **{"round.budget": "time", "round.weights": "tokens",
                                                         "round.step_time_factors": [1.0, 1.0]}), corpus=corpus).run()
    for n, v in steps.final_params.items():
        assert torch.equal(v, timed.final_params[n]), n
    assert timed.summary["worker_steps"] == steps.summary["worker_steps"] == [8, 8]


def test_time_budget_records_each_workers_steps_and_tokens(make_config, corpus):
    cfg = make_config("globalm1-localm2", workers=2, rounds=2, **{
        "round.budget": "time", "round.weights": "tokens", "round.step_time_factors": [1.0, 3.0]})
    result = VirtualSwarm(cfg, corpus=corpus).run()
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    rounds = [r for r in result.records if "tokens" in r]
    assert len(rounds) == 2 and all(r["steps"] == [4, 1] for r in rounds)
    assert all(r["tokens"] == [4 * tokens_per_step, tokens_per_step] for r in rounds)
    assert result.summary["worker_tokens"] == [8 * tokens_per_step, 2 * tokens_per_step]
    assert result.summary["mix1_failures"] == result.summary["mix2_failures"] == 0


@pytest.mark.parametrize(("overrides", "field"), [
    ({"round.budget": "hours"}, "round.budget"),
    ({"round.weights": "flops"}, "round.weights"),
    ({"round.length_s": -1.0}, "round.length_s"),
    ({"round.step_time_factors": [1.0, 2.0]}, "round.step_time_factors"),  # 4 workers
    ({"round.step_time_factors": [1.0, 0.0, 1.0, 1.0]}, "round.step_time_factors"),
    ({"compute.slowdown": 0.5}, "compute.slowdown"),
])
def test_round_config_errors_name_the_field(make_config, overrides, field):
    with pytest.raises(ConfigError) as info:
        make_config("globalm1-localm2", **overrides)
    assert info.value.field == field


def test_sync_dp_refuses_a_time_budget(make_config):
    with pytest.raises(ConfigError) as info:
        make_config("sync-dp", **{"round.budget": "time"})
    assert info.value.field == "round.budget"


def test_a_network_peer_with_a_time_budget_needs_a_round_length(make_config):
    from gossiploco.runtime.peer import NetworkPeer

    with pytest.raises(ConfigError) as info:
        NetworkPeer(make_config("globalm1-localm2", workers=1, **{"round.budget": "time"}), 0, ["tcp://127.0.0.1:1"])
    assert info.value.field == "round.length_s" and "--set round.length_s=" in str(info.value)


def test_the_steps_and_simulated_budgets_count_steps_whatever_the_clock(make_config):
    steps = RoundBudget(make_config("globalm1-localm2", **{"round.length_s": 5.0}), 0, real_clock=True)
    simulated = RoundBudget(make_config("globalm1-localm2", **{"round.budget": "time", "round.step_time_factors": [1, 1, 3, 1]}),
                            2, real_clock=True)
    for budget, count in ((steps, 4), (simulated, 1)):  # a steps budget ignores length_s; factor 3 of 4 base steps: 1
        assert not budget.real
        budget.begin(100.0)
        assert [budget.another(h, 1e9) for h in range(count + 1)] == [True] * count + [False]


def test_the_real_clock_budget_stops_before_a_step_that_would_pass_the_deadline(make_config):
    budget = RoundBudget(make_config("globalm1-localm2", **{"round.budget": "time", "round.length_s": 10.0}), 0, real_clock=True)
    assert budget.real
    budget.begin(100.0)
    assert budget.another(0, 1e9)  # the first step of a round always runs: every worker has a pseudo-gradient
    budget.step_took(3.0)
    assert budget.another(1, 103.0) and budget.another(2, 107.0) and not budget.another(2, 107.1)  # 107 + 3 <= 110
    budget.step_took(6.0)  # the expected step time follows: 0.3 * 6 + 0.7 * 3 = 3.9
    assert budget.step_s == pytest.approx(3.9)
    budget.begin(200.0)  # a new round: a new deadline, the expected time kept
    assert budget.another(1, 206.1) and not budget.another(1, 206.2)
    budget.pause(2.0)  # a measurement's 2 s do not count
    assert budget.another(1, 208.1) and not budget.another(1, 208.2)


def test_a_time_budget_keeps_every_worker_on_the_rounds_schedule(make_config, corpus):
    """Round r's steps take the rates of steps r H, r H + 1, ...: a slow worker's next round starts where everyone's
    does, a fast worker's steps beyond H keep the round's last rate."""
    cfg = make_config("globalm1-localm2", workers=2, rounds=3, **{
        "round.budget": "time", "round.step_time_factors": [0.5, 2.0], "inner.warmup_steps": 0})
    swarm = VirtualSwarm(cfg, corpus=corpus)
    positions = {0: [], 1: []}
    for m, algo in enumerate(swarm.algos):
        opt = algo.trainer.inner_opt
        step = opt._step
        opt._step = lambda opt=opt, step=step, m=m: (positions[m].append(opt.schedule_position()), step())[1]
    swarm.run()
    swarm.close()
    H = cfg.inner_steps
    assert positions[0] == [r * H + min(h, H - 1) for r in range(3) for h in range(2 * H)]
    assert positions[1] == [r * H + h for r in range(3) for h in range(H // 2)]


def test_a_time_budget_measures_consensus_at_the_rounds_start_only(make_config):
    steps = make_config("globalm1-localm2", **{"monitor.every": 2})
    timed = make_config("globalm1-localm2", **{"monitor.every": 2, "round.budget": "time", "round.length_s": 1.0})
    assert [measure_due(steps, h)[0] for h in range(4)] == [True, False, True, False]
    assert [measure_due(timed, h)[0] for h in range(4)] == [True, False, False, False]


# -- compressed weighted means: the weights gathered first, each member sends s x -----------------------------


def mix_compressed(mixers, values, weights, round_index=0):
    hub = MemoryHub(len(values), 10.0)
    with ThreadPoolExecutor(max_workers=len(values)) as pool:
        futures = [pool.submit(m.mix, [{"w": v}], round_index, hub.exchange(r), weight=None if weights is None else weights[r])
                   for r, (m, v) in enumerate(zip(mixers, values))]
        return [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("kind", [GlobalMix, GossipMix])
@pytest.mark.parametrize("codec", ["int8", "4bit", "bf16"])
def test_compressed_weighted_means_are_the_weighted_means_up_to_the_codec(kind, codec):
    M = 4
    values = [v["w"] for v in random_values(M, size=512, seed=11)]
    weights = [1.0, 0.25, 2.0, 0.75]
    out = mix_compressed([kind("mix2", ["w"], 5, build_codec(codec, block=32)) for _ in range(M)], values, weights)
    exact = mix_compressed([kind("mix2", ["w"], 5) for _ in range(M)], values, weights)  # the fp32 weighted means
    for m, (o, e) in enumerate(zip(out, exact)):
        assert o.ok and o.partner == e.partner and o.weight == pytest.approx(e.weight, rel=1e-6)
        if kind is GlobalMix:  # written out: sum(w x) / sum(w)
            reference = sum(w * v.double() for w, v in zip(weights, values)) / sum(weights)
        else:
            p = o.partner
            reference = (weights[m] * values[m].double() + weights[p] * values[p].double()) / (weights[m] + weights[p])
        error = float((o.values[0]["w"].double() - reference).norm() / reference.norm())
        assert error < {"bf16": 0.01, "int8": 0.03, "4bit": 0.3}[codec], error
        # against the unweighted compressed mean: the weights moved it (far more than the codec's error)
        plain = float((e.values[0]["w"].double() - sum(values).double() / M).norm() / reference.norm())
        assert kind is GossipMix or plain > 3 * error


@pytest.mark.parametrize("kind", [GlobalMix, GossipMix])
def test_compressed_unit_weights_are_the_unweighted_compressed_mix_bit_for_bit(kind):
    values = [v["w"] for v in random_values(4, size=300, seed=12)]
    plain = mix_compressed([kind("mix2", ["w"], 5, build_codec("int8", block=32)) for _ in values], values, None)
    unit = mix_compressed([kind("mix2", ["w"], 5, build_codec("int8", block=32)) for _ in values], values, [1.0] * 4)
    for p, u in zip(plain, unit):
        assert torch.equal(p.values[0]["w"], u.values[0]["w"]) and u.weight == 1.0


@pytest.mark.parametrize("kind", ["global", "gossip"])
@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_weighted_error_feedback_loses_nothing_over_rounds_but_the_last_residual(kind, codec):
    """Each member sends v = s x + e (s = M w / W; a pair: 2 w / (w_a + w_b)) and keeps what the mean lost of v:
    summed over rounds, the mixes give the weighted means' sum less the final residuals' mean (global), or
    (gossip) the members' mixed values sum to the sum of the s x less the final residuals."""
    from gossiploco.mixing.operators import pair_matching

    workers, n, rounds = 4, 600, 10
    mixer = GlobalMix if kind == "global" else GossipMix
    mixers = [mixer("mix2", ["w"], 7, build_codec(codec, block=32, density=0.05, chunk=128), error_feedback=True)
              for _ in range(workers)]
    mixed, reference = [torch.zeros(n, dtype=torch.float64) for _ in range(workers)], torch.zeros(n, dtype=torch.float64)
    for r in range(rounds):
        xs = [v["w"] * 0.01 for v in random_values(workers, size=n, seed=100 + r)]
        ws = [0.5 + ((3 * r + m) % 5) / 4 for m in range(workers)]
        out = mix_compressed(mixers, xs, ws, round_index=r)
        assert all(o.ok for o in out)
        for m, o in enumerate(out):
            mixed[m] += o.values[0]["w"].double()
        if kind == "global":
            reference += sum(w * x.double() for w, x in zip(ws, xs)) / sum(ws)
        else:
            pairs = pair_matching(7, r, "mix2", range(workers))
            reference += sum(2 * ws[m] / (ws[m] + ws[pairs[m]]) * xs[m].double() for m in range(workers))
    final = [mixers[m].residual["w"].double() for m in range(workers)]
    if kind == "global":
        for m in range(workers):
            assert torch.allclose(mixed[m], reference - sum(final) / workers, atol=1e-5)
    else:
        assert torch.allclose(sum(mixed), reference - sum(final), atol=1e-5)


def test_a_weighted_compressed_mix1_against_its_reference_gives_the_weighted_mean():
    """Mix1 on z: round 0 sends fp32 (no common reference yet), later rounds Q(s (z - ref)); every round the
    result is the weighted mean of the z up to the codec, and the same on every member."""
    mixers = [GlobalMix("mix1", ["w"], 0, build_codec("int8", block=64)) for _ in range(3)]
    for r in range(3):
        zs = [v["w"] for v in random_values(3, size=256, seed=20 + r)]
        ws = [1.0 + r, 0.5, 2.0]
        out = mix_compressed(mixers, zs, ws, round_index=r)
        reference = sum(w * z.double() for w, z in zip(ws, zs)) / sum(ws)
        for o in out:
            assert o.ok and torch.equal(o.values[0]["w"], out[0].values[0]["w"])
            error = float((o.values[0]["w"].double() - reference).norm() / reference.norm())
            assert error < (1e-6 if r == 0 else 0.05), (r, error)
