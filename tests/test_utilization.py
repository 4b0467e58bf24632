"""The compute-utilization simulator: its equations, the paper's Table 1 / Table 3, and the CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from gossiploco.blocks import block_of, select_parameters
from gossiploco.cli import app
from gossiploco.config import load_config, preset_names
from gossiploco.errors import ConfigError
from gossiploco.utilization import (
    CommPlan,
    MixLoad,
    Scenario,
    attempt_seconds,
    block_fraction,
    comm_plan,
    estimate_step_time,
    expected_overrun,
    parse_bytes_per_value,
    preset_plans,
    simulate,
    wire_factor,
)

# The paper's setup (section 5.1): about 1.5B parameters, M = 8, fp32.
PAPER_N, PAPER_M = 1.5e9, 8
# Section 5.2: "the minimum H for full Mix1 overlap is H = 180 at 100Mbps and H = 90 at 200Mbps".
PAPER_MIN_H = {100: 180, 200: 90}
# Appendix D.3: the Mix2 subset (embeddings, LM head, layers 0-1) is 43% of the parameters.
PAPER_SUBSET = 0.43


def paper_step_time(bandwidth_mbps: int) -> float:
    """T from the overlap statement: one Mix1 ring all-reduce takes exactly H_min inner steps."""
    mix1_s = wire_factor("global", PAPER_M) * PAPER_N * 4 * 8 / (bandwidth_mbps * 1e6)
    return mix1_s / PAPER_MIN_H[bandwidth_mbps]


def plan(preset: str, subset_fraction: float | None = None) -> CommPlan:
    return comm_plan(load_config(preset), 256, subset_fraction)


def scenario(**overrides) -> Scenario:
    base = dict(params=PAPER_N, workers=PAPER_M, inner_steps=100, step_time_s=paper_step_time(100), bandwidth_mbps=100.0)
    return Scenario(**{**base, **overrides})


# ---------------------------------------------------------------------------------------
# The paper


@pytest.mark.timeout(10)
def test_the_two_overlap_statements_give_one_step_time():
    assert paper_step_time(100) == pytest.approx(paper_step_time(200))
    assert paper_step_time(100) == pytest.approx(14 / 3)  # 840 s / 180 = 420 s / 90


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bandwidth", [100, 200])
def test_min_inner_steps_for_full_mix1_overlap_matches_the_paper(bandwidth):
    result = simulate(plan("globalm1"), scenario(bandwidth_mbps=bandwidth))
    assert result.min_inner_steps_hiding_mix1 == pytest.approx(PAPER_MIN_H[bandwidth])


# (preset, subset fraction, Table 1 / Table 3 compute utilization at 100 and 200 Mbps), M = 8, H = 100.
PAPER_ROWS = [
    ("sync-dp", None, 1, 1),
    ("diloco", None, 36, 53),
    ("localm1m2", None, 49, 66),
    ("globalm1", None, 56, 100),
    ("globalm1-localm2", None, 36, 66),
    ("globalm1-localm2-subset", PAPER_SUBSET, 45, 82),
    ("globalm1s", None, 28, 56),  # Table 3
    ("globalm1s-localm2", None, 22, 43),  # Table 3
    ("globalm1s-localm2", PAPER_SUBSET, 25, 50),  # Table 3, GlobalM1SLocalM2-subset
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("preset", "subset", "paper_100", "paper_200"), PAPER_ROWS)
def test_table1_utilization_at_m8_h100_within_two_points(preset, subset, paper_100, paper_200):
    p = plan(preset, subset)
    step = paper_step_time(100)
    for bandwidth, paper in ((100, paper_100), (200, paper_200)):
        ours = 100 * simulate(p, scenario(step_time_s=step, bandwidth_mbps=bandwidth)).compute_utilization
        assert abs(ours - paper) <= 2.0, f"{preset} at {bandwidth} Mbps: ours {ours:.1f}%, paper {paper}%"


# ---------------------------------------------------------------------------------------
# Volumes and payloads


@pytest.mark.timeout(10)
@pytest.mark.parametrize("workers", [1, 2, 3, 8, 16])
def test_wire_factors(workers):
    assert wire_factor("global", workers) == pytest.approx(2 * (workers - 1) / workers)
    assert wire_factor("gossip", workers) == (0.0 if workers == 1 else 1.0)
    assert wire_factor("identity", workers) == 0.0


@pytest.mark.timeout(10)
def test_attempt_seconds_ring_and_gossip_volumes():
    sc = Scenario(params=1e9, workers=8, inner_steps=1, step_time_s=1.0, bandwidth_mbps=1000.0)
    # 1e9 fp32 values = 32e9 bits = 32 s at 1 Gbps.
    assert attempt_seconds(MixLoad("gossip"), sc) == pytest.approx(32.0)
    assert attempt_seconds(MixLoad("global"), sc) == pytest.approx(32.0 * 2 * 7 / 8)
    assert attempt_seconds(MixLoad("identity"), sc) == 0.0


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("name", "value"), [("4", 4.0), ("fp32", 4.0), ("bf16", 2.0), ("2", 2.0), ("8bit", 1.0), ("int4", 0.5), ("0.5", 0.5)])
def test_parse_bytes_per_value(name, value):
    assert parse_bytes_per_value(name) == value


@pytest.mark.timeout(10)
def test_communication_time_scales_with_bytes_per_value():
    sc = scenario()
    fp32 = simulate(plan("globalm1-localm2"), sc)
    for b in (2.0, 1.0, 0.5):
        low = simulate(plan("globalm1-localm2"), replace(sc, bytes_per_value=b))
        assert low.mix1_attempt_s == pytest.approx(fp32.mix1_attempt_s * b / 4)
        assert low.mix2_attempt_s == pytest.approx(fp32.mix2_attempt_s * b / 4)
        assert low.compute_utilization >= fp32.compute_utilization


@pytest.mark.timeout(10)
def test_mix1_with_outer_state_doubles_the_payload():
    sc = scenario()
    assert simulate(plan("globalm1s"), sc).mix1_attempt_s == pytest.approx(2 * simulate(plan("globalm1"), sc).mix1_attempt_s)


@pytest.mark.timeout(30)
def test_subset_fraction_comes_from_the_real_block_sizes():
    import torch

    from gossiploco.model import MODEL_SIZES, ModelArgs, Transformer

    blocks = load_config("globalm1-localm2-subset").mix2.blocks
    for size in ("tiny", "1.5b"):
        with torch.device("meta"):
            model = Transformer(ModelArgs(**{**MODEL_SIZES[size].__dict__, "vocab_size": 256, "max_seq_len": 8}))
        numel = {name: p.numel() for name, p in model.named_parameters()}
        chosen = select_parameters(list(numel), blocks)
        assert {block_of(n) for n in chosen} == {"embed", "lm_head", "layers.0.attention", "layers.0.mlp", "layers.1.attention", "layers.1.mlp"}
        expected = sum(numel[n] for n in chosen) / sum(numel.values())
        assert block_fraction(size, 256, blocks) == pytest.approx(expected)
        assert 0 < expected < 1
    assert block_fraction("1.5b", 256, ["*"]) == 1.0


@pytest.mark.timeout(10)
def test_subset_fraction_defaults_and_override():
    assert plan("globalm1-localm2").mix2.fraction == 1.0
    assert plan("globalm1-localm2-subset").mix2.fraction == pytest.approx(block_fraction("tiny", 256, ["embed", "lm_head", "layers.0", "layers.1"]))
    sub = plan("globalm1-localm2-subset", 0.25)
    assert sub.mix2.fraction == 0.25
    sc = scenario()
    assert simulate(sub, sc).mix2_attempt_s == pytest.approx(0.25 * simulate(plan("globalm1-localm2"), sc).mix2_attempt_s)


# ---------------------------------------------------------------------------------------
# The round: overlap, link sharing, sync-DP


@pytest.mark.timeout(10)
def test_mix1_is_hidden_until_it_outlasts_the_inner_steps():
    p = plan("globalm1-localm2")
    for h in (50, 179, 181, 400):
        r = simulate(p, scenario(inner_steps=h))
        assert r.mix1_exposed_s == pytest.approx(max(0.0, r.mix1_attempt_s - r.compute_s))
        assert r.mix1_hidden_s == pytest.approx(min(r.mix1_attempt_s, r.compute_s))
        # Work-conserving link sharing: leftover Mix1 and all of Mix2 follow the inner steps back to back.
        assert r.wall_s == pytest.approx(r.compute_s + r.mix1_exposed_s + r.mix2_attempt_s)
        assert r.blocking_comm_s == pytest.approx(r.wall_s - r.compute_s)
    assert simulate(plan("globalm1"), scenario(inner_steps=181)).compute_utilization == 1.0


@pytest.mark.timeout(10)
def test_diloco_blocks_on_a_full_all_reduce_and_the_outer_step_adds_wall_time():
    sc = scenario(outer_step_s=5.0)
    r = simulate(plan("diloco"), sc)
    assert r.mix1_s == 0.0
    assert r.blocking_comm_s == pytest.approx(r.mix2_attempt_s)
    assert r.mix2_attempt_s == pytest.approx(2 * 7 / 8 * PAPER_N * 32 / 100e6)
    assert r.compute_utilization == pytest.approx(r.compute_s / (r.compute_s + r.mix2_attempt_s + 5.0))


@pytest.mark.timeout(10)
def test_sync_dp_all_reduces_gradients_every_step():
    sc = scenario()
    r = simulate(plan("sync-dp"), sc)
    grad_s = 2 * 7 / 8 * PAPER_N * 32 / 100e6
    assert r.mix2_attempt_s == pytest.approx(grad_s)
    assert r.compute_utilization == pytest.approx(sc.step_time_s / (sc.step_time_s + grad_s))
    assert r.wall_s == pytest.approx(sc.inner_steps * (sc.step_time_s + grad_s))


@pytest.mark.timeout(30)
def test_utilization_is_in_unit_interval_and_rises_with_bandwidth():
    plans = preset_plans("tiny", 256, PAPER_SUBSET)
    assert {p.name for p in plans} == set(preset_names())
    bandwidths = [1, 10, 50, 100, 150, 200, 500, 1000, 1e4, 1e6]
    for p in plans:
        for rate in (0.0, 0.05, 0.5):
            utils = [simulate(p, scenario(bandwidth_mbps=b, failure_rate=rate)).compute_utilization for b in bandwidths]
            assert all(0.0 < u <= 1.0 for u in utils), (p.name, rate, utils)
            assert all(a <= b + 1e-12 for a, b in zip(utils, utils[1:])), (p.name, rate, utils)


# ---------------------------------------------------------------------------------------
# Failures


@pytest.mark.timeout(10)
@pytest.mark.parametrize("rate", [0.05, 0.3, 0.8])
@pytest.mark.parametrize(("attempt", "budget"), [(10.0, 5.0), (10.0, 25.0), (10.0, 30.0), (3.0, 100.0)])
def test_expected_overrun_closed_form_matches_the_sum_over_attempts(rate, attempt, budget):
    explicit = sum((1 - rate) * rate ** (k - 1) * max(0.0, k * attempt - budget) for k in range(1, 2000))
    assert expected_overrun(attempt, "global", rate, budget) == pytest.approx(explicit, rel=1e-9, abs=1e-12)
    assert expected_overrun(attempt, "gossip", rate, budget) == max(0.0, attempt - budget)


@pytest.mark.timeout(10)
def test_failures_restart_all_reduce_but_not_gossip():
    for bandwidth in (10, 100, 200, 1000, 10000):
        clean, failing = scenario(bandwidth_mbps=bandwidth), scenario(bandwidth_mbps=bandwidth, failure_rate=0.05)
        diloco, diloco_f = simulate(plan("diloco"), clean), simulate(plan("diloco"), failing)
        assert diloco_f.mix2_s == pytest.approx(diloco.mix2_s / 0.95)
        assert diloco_f.compute_utilization < diloco.compute_utilization
        local, local_f = simulate(plan("localm1m2"), clean), simulate(plan("localm1m2"), failing)
        assert local_f == local
        sync, sync_f = simulate(plan("sync-dp"), clean), simulate(plan("sync-dp"), failing)
        assert sync_f.compute_utilization < sync.compute_utilization


@pytest.mark.timeout(10)
def test_failures_cost_a_global_mix1_nothing_while_retries_stay_hidden():
    # Mix1 takes 42 s at 2 Gbps against 467 s of compute: up to 11 attempts fit.
    clean, failing = scenario(bandwidth_mbps=2000), scenario(bandwidth_mbps=2000, failure_rate=0.05)
    r, rf = simulate(plan("globalm1"), clean), simulate(plan("globalm1"), failing)
    assert r.compute_utilization == 1.0
    assert rf.compute_utilization == pytest.approx(1.0, abs=1e-12)
    assert rf.mix1_s == pytest.approx(r.mix1_s / 0.95)


# ---------------------------------------------------------------------------------------
# Inputs


@pytest.mark.timeout(10)
def test_step_time_estimate_from_flops():
    # 6 * 1.5e9 * 65536 FLOPs at 40% of 312 TFLOP/s.
    assert estimate_step_time(1.5e9, 65536, 312.0, 0.4) == pytest.approx(6 * 1.5e9 * 65536 / (312e12 * 0.4))
    with pytest.raises(ConfigError, match="--mfu"):
        estimate_step_time(1.5e9, 65536, 312.0, 1.5)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"params": 0}, "--params"),
        ({"workers": 0}, "--workers"),
        ({"inner_steps": 0}, "--inner-steps"),
        ({"step_time_s": -1.0}, "--step-time"),
        ({"bandwidth_mbps": 0.0}, "--bandwidth-mbps"),
        ({"bandwidth_mbps": math.inf}, "--bandwidth-mbps"),
        ({"bytes_per_value": 0.0}, "--bytes-per-value"),
        ({"failure_rate": 1.0}, "--failure-rate"),
        ({"failure_rate": -0.1}, "--failure-rate"),
        ({"outer_step_s": -1.0}, "--outer-step-time"),
    ],
)
def test_scenario_validation_names_the_option(overrides, flag):
    with pytest.raises(ConfigError) as info:
        scenario(**overrides)
    assert info.value.field == flag


@pytest.mark.timeout(10)
def test_plan_validation_names_the_option():
    with pytest.raises(ConfigError, match="--subset-fraction"):
        plan("globalm1-localm2-subset", 1.5)
    with pytest.raises(ConfigError, match="--subset-fraction"):
        plan("globalm1", 0.5)  # no Mix2
    with pytest.raises(ConfigError, match="--subset-fraction"):
        plan("sync-dp", 0.5)
    with pytest.raises(ConfigError, match="--bytes-per-value"):
        parse_bytes_per_value("fp64ish")


# ---------------------------------------------------------------------------------------
# The command line

PAPER_ARGS = ["--params", "1.5e9", "--workers", "8", "--inner-steps", "100", "--step-time", "4.6667"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["utilization", *args])


@pytest.mark.timeout(60)
def test_cli_prints_the_utilization():
    result = invoke("--config", "diloco", *PAPER_ARGS, "--bandwidth-mbps", "100")
    assert result.exit_code == 0, result.output
    assert "compute utilization 35.7%" in result.stdout
    assert "mix2 global" in result.stdout


@pytest.mark.timeout(60)
def test_cli_json_matches_the_library():
    result = invoke("--config", "globalm1-localm2-subset", *PAPER_ARGS, "--bandwidth-mbps", "200",
                    "--subset-fraction", "0.43", "--bytes-per-value", "bf16", "--failure-rate", "0.05", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert 0.0 <= data["compute_utilization"] <= 1.0
    expected = simulate(plan("globalm1-localm2-subset", 0.43),
                        scenario(step_time_s=4.6667, bandwidth_mbps=200.0, bytes_per_value=2.0, failure_rate=0.05))
    assert data["compute_utilization"] == pytest.approx(expected.compute_utilization)
    for key in ("compute_s", "blocking_comm_s", "mix1_hidden_s", "mix1_exposed_s", "mix2_s", "wall_s", "min_inner_steps_hiding_mix1"):
        assert key in data
    assert data["mix2"]["fraction"] == 0.43 and data["scenario"]["bytes_per_value"] == 2.0


@pytest.mark.timeout(60)
def test_cli_defaults_params_from_the_model_size_and_estimates_the_step_time():
    from gossiploco.model import count_parameters

    result = invoke("--config", "globalm1", "--model", "small", "--workers", "4", "--inner-steps", "10",
                    "--tokens-per-step", "4096", "--peak-tflops", "1", "--mfu", "0.5", "--bandwidth-mbps", "10", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    n = count_parameters("small")
    assert data["scenario"]["params"] == n
    assert data["scenario"]["step_time_s"] == pytest.approx(6 * n * 4096 / (1e12 * 0.5))


@pytest.mark.timeout(120)
def test_cli_plot_writes_a_png(tmp_path):
    out = tmp_path / "fig3.png"
    result = invoke("--config", "globalm1", *PAPER_ARGS, "--bandwidth-mbps", "100", "--failure-rate", "0.05",
                    "--subset-fraction", "0.43", "--plot", str(out))
    assert result.exit_code == 2  # globalm1 has no Mix2 to subset
    assert "--subset-fraction" in result.output
    result = invoke("--config", "globalm1-localm2-subset", *PAPER_ARGS, "--bandwidth-mbps", "100", "--failure-rate", "0.05",
                    "--subset-fraction", "0.43", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bandwidth-mbps", "0", "--step-time", "1"], "--bandwidth-mbps: must be a finite number > 0"),
        (["--bandwidth-mbps", "100"], "--step-time: give the inner-step seconds"),
        (["--bandwidth-mbps", "100", "--step-time", "1", "--failure-rate", "1"], "--failure-rate: must be in [0, 1)"),
        (["--bandwidth-mbps", "100", "--step-time", "1", "--bytes-per-value", "huge"], "--bytes-per-value: expected a number"),
        (["--bandwidth-mbps", "100", "--step-time", "1", "--workers", "0"], "--workers: must be an integer >= 1"),
        (["--bandwidth-mbps", "100", "--step-time", "1", "--config", "nope"], "config: no such file or preset 'nope'"),
    ],
)
def test_cli_bad_input_exits_2_with_a_clear_message(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_monitor_all_reduces_block_and_share_the_link_with_mix1():
    from gossiploco.utilization import CommPlan, MixLoad, Scenario, attempt_seconds, simulate

    sc = Scenario(params=1e8, workers=4, inner_steps=10, step_time_s=0.3, bandwidth_mbps=100)
    m = attempt_seconds(MixLoad("global"), sc)  # one all-reduce of every parameter
    for mix1_fraction in (1.0, 0.25):  # Mix1 longer than the measurement, and shorter
        bare = CommPlan("p", "factored", MixLoad("global", mix1_fraction), MixLoad("gossip", 0.1))
        monitored = CommPlan("p", "factored", MixLoad("global", mix1_fraction), MixLoad("gossip", 0.1), monitors=1)
        r0, r = simulate(bare, sc), simulate(monitored, sc)
        a1, a2, c = r.mix1_attempt_s, r.mix2_attempt_s, r.compute_s
        # Reference: fair sharing from t = 0; the measurement returns at m + min(a1, m), Mix1 has
        # advanced min(a1, m) by then, the inner steps run, then whatever Mix1 has left, then Mix2.
        start = m + min(a1, m)
        mix1_left = a1 - min(a1, m)
        assert r.monitor_s == pytest.approx(start)
        assert r.wall_s == pytest.approx(start + c + max(0.0, mix1_left - c) + a2)
        assert r0.monitor_s == 0.0 and r.wall_s > r0.wall_s


def test_monitors_per_round_follow_the_measurement_schedule(make_config):
    from gossiploco.utilization import comm_plan, monitors_per_round

    assert monitors_per_round(make_config("globalm1", **{"inner_steps": 10, "monitor.every": 0})) == 1
    assert monitors_per_round(make_config("globalm1", **{"inner_steps": 10, "monitor.every": 4})) == 3  # h = 0, 4, 8
    assert monitors_per_round(make_config("globalm1", **{"monitor.enabled": False})) == 0
    assert monitors_per_round(make_config("sync-dp")) == 0
    # with a global Mix1 of every parameter the h = 0 measurement takes Mix1's average: no all-reduce
    assert monitors_per_round(make_config("globalm1", **{"inner_steps": 10, "monitor.every": 4}), 1.0) == 2
    cfg = make_config("globalm1-adaptive", **{"monitor.every": 0})
    assert comm_plan(cfg, 256).monitors == 0  # not modelled unless asked (the paper's tables)
    assert comm_plan(cfg, 256, with_monitors=True).monitors == 0
    cfg = make_config("diloco", **{"monitor.every": 0})
    assert comm_plan(cfg, 256, with_monitors=True).monitors == 1
