"""Compressed exchanges (issue 16): the compressed means against the math written out here, error feedback's
conservation over rounds, a compressed Mix1's differences from a reference every member holds, and a virtual swarm
with each. The codecs themselves are tested in tests/test_compression.py.

References, for members m = 1..M with vectors v_m, a codec's encode Q and decode D:

    group mean, owner k of segment S_k:  mean_k = (v_k[S_k] + sum_{m != k} D(Q(v_m[S_k]))) / M,
                                         every member gets D(Q(mean_k))
    pair mean (a, b):                    (D(Q(v_a)) + D(Q(v_b))) / 2
    top-k group mean:                    sum_m D(Q(v_m)) / M
    error feedback:                      mixed = mean_m (v_m - e'_m), with v_m = x_m + e_m, so that
                                         sum_t mixed_t = sum_t mean_m x_{m,t} - mean_m e_{m,T}
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gossiploco.mixing import GlobalMix, GossipMix, MemoryHub, pair_matching
from gossiploco.mixing.compressed import group_mean, pair_mean
from gossiploco.mixing.compression import build_codec
from gossiploco.protocol.ring import segment_bounds
from tests.test_compression import vec


def run_all(fns):
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn) for fn in fns]]


# -- the compressed means against the references ----------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "4bit", "bf16"])
def test_a_compressed_group_mean_is_the_reference_and_quantizes_each_value_twice(name):
    codec = build_codec(name, block=32)
    members, n = [2, 0, 3, 1], 1001
    values = {m: vec(n, m) for m in members}
    hub = MemoryHub(4, 10.0)
    out = dict(zip(members, run_all([lambda m=m: group_mean("mix2/0", values[m], members, hub.exchange(m), codec, feedback=True)
                                      for m in members])))
    bounds = segment_bounds(n, 4)
    expected = torch.empty(n)
    for k, owner in enumerate(members):
        s = slice(bounds[k], bounds[k + 1])
        total = values[owner][s].clone()
        for m in members:
            if m != owner:
                total += codec.roundtrip(values[m][s])[1]
        expected[s] = codec.roundtrip(total / 4)[1]
    for m in members:
        mean, residual, sent = out[m]
        assert torch.equal(mean, expected)
        # error feedback: the group's mean of (v - e') is exactly what everyone got
        assert sent == sum(codec.encoded_bytes(bounds[k + 1] - bounds[k]) for k in range(4) if members[k] != m) \
            + 3 * codec.encoded_bytes(bounds[members.index(m) + 1] - bounds[members.index(m)])
    conserved = sum(values[m] - out[m][1] for m in members) / 4
    assert torch.allclose(conserved, expected, atol=1e-6)
    exact = sum(values.values()) / 4
    assert float((expected - exact).norm() / exact.norm()) < {"int8": 0.01, "4bit": 0.2, "bf16": 0.005}[name]


def test_topk_group_and_pair_means_are_the_references():
    codec = build_codec("topk", density=0.1, chunk=64)
    members = [0, 1, 2]
    values = [vec(500, 10 + m) for m in members]
    hub = MemoryHub(3, 10.0)
    out = run_all([lambda m=m: group_mean("mix2/0", values[m], members, hub.exchange(m), codec, feedback=True) for m in members])
    expected = torch.zeros(500)
    for m in members:
        expected += codec.roundtrip(values[m])[1]
    expected /= 3
    assert all(torch.equal(mean, expected) for mean, _, _ in out)
    assert all(torch.equal(residual, values[m] - codec.roundtrip(values[m])[1]) for m, (_, residual, _) in enumerate(out))
    hub = MemoryHub(2, 10.0)
    pair = run_all([lambda m=m: pair_mean("mix2/0", values[m], 1 - m, hub.exchange(m), codec) for m in (0, 1)])
    expected = (codec.roundtrip(values[0])[1] + codec.roundtrip(values[1])[1]) / 2
    assert torch.equal(pair[0][0], expected) and torch.equal(pair[1][0], expected)


@pytest.mark.parametrize("kind,name", [("global", "int8"), ("global", "4bit"), ("global", "topk"),
                                       ("gossip", "4bit"), ("gossip", "topk")])
def test_error_feedback_loses_nothing_over_rounds_but_the_last_residual(kind, name):
    """Mix2 with error feedback, 12 rounds over 4 workers: the sum of what the mixes gave equals the
    sum of the exact means minus the mean of the final residuals (global), and each worker's
    residual stays bounded (it is re-sent, not accumulated)."""
    workers, n, rounds = 4, 700, 12
    codec = build_codec(name, block=32, density=0.05, chunk=128)
    mixer = GlobalMix if kind == "global" else GossipMix
    mixers = [mixer("mix2", ["w"], 7, codec, error_feedback=True) for _ in range(workers)]
    hub = MemoryHub(workers, 10.0)
    total_mixed = [torch.zeros(n) for _ in range(workers)]
    total_sent = [torch.zeros(n) for _ in range(workers)]
    for r in range(rounds):
        xs = [vec(n, 100 * r + m, 0.01) for m in range(workers)]
        results = run_all([lambda m=m: mixers[m].mix([{"w": xs[m]}], r, hub.exchange(m)) for m in range(workers)])
        for m, res in enumerate(results):
            expected = codec.encoded_bytes(n) * (1 if kind == "gossip" else workers - 1)
            assert res.ok and (res.bytes == expected if kind == "gossip" or name == "topk" else res.bytes < expected)
            total_mixed[m] += res.values[0]["w"]
            total_sent[m] += xs[m]
        if kind == "gossip":  # a pair's mixed values sum to its inputs less its new residuals
            partners = pair_matching(7, r, "mix2", range(workers))
            assert all(partners[m] is not None for m in range(workers))
    final = [mixers[m].residual["w"] for m in range(workers)]
    if kind == "global":
        for m in range(workers):
            exact = sum(total_sent) / workers - sum(final) / workers
            assert torch.allclose(total_mixed[m], exact, atol=1e-5)
    else:
        assert torch.allclose(sum(total_mixed), sum(total_sent) - sum(final), atol=1e-5)
    scale = max(float(v.abs().max()) for v in total_sent)
    assert all(float(e.abs().max()) < scale for e in final)


def test_a_failed_compressed_mix_is_identity_and_keeps_the_residual():
    codec = build_codec("int8", block=32)
    hub = MemoryHub(2, 0.2)
    mixer = GossipMix("mix2", ["w"], 0, codec, error_feedback=True)
    mixer.residual = {"w": torch.full((64,), 0.5)}
    x = {"w": vec(64, 0)}
    result = mixer.mix([x], 0, hub.exchange(0))  # the partner never comes
    assert not result.ok and result.values[0]["w"] is x["w"] and torch.equal(mixer.residual["w"], torch.full((64,), 0.5))


# -- a compressed Mix1: differences from a reference every member holds -------------------------------------


def test_a_compressed_mix1_sends_differences_from_the_last_mean_and_heals_after_a_newcomer():
    """Reference: round 0 (no common reference yet) is the exact fp32 mean x_0; after it every member
    sends Q(z - x_prev), and gets x_prev + the compressed group mean of those differences. A member
    without the reference (a newcomer) fails the exchange at once for everyone (not after a deadline);
    every member then sends fp32 once, and compression resumes from that exact mean."""
    codec = build_codec("int8", block=64)
    hub = MemoryHub(3, 10.0)
    mixers = [GlobalMix("mix1", ["w"], 0, codec) for _ in range(3)]
    members = [0, 1, 2]

    def mix(r, zs):
        return run_all([lambda m=m: mixers[m].mix([{"w": zs[m]}], r, hub.exchange(m)) for m in members])

    zs = [vec(300, m) for m in members]
    out = mix(0, zs)
    exact = (zs[0] + zs[1] + zs[2]) / 3
    assert all(o.ok and torch.allclose(o.values[0]["w"], exact, atol=1e-6) for o in out)
    assert out[0].bytes == 2 * 2 * 300 * 4 // 3  # fp32, a ring's share
    previous = out[0].values[0]["w"]
    assert all(torch.equal(o.values[0]["w"], previous) for o in out)

    zs = [previous + vec(300, 10 + m, 0.01) for m in members]
    out = mix(1, zs)
    reference = torch.empty(300)
    bounds = segment_bounds(300, 3)
    for k in range(3):
        s = slice(bounds[k], bounds[k + 1])
        total = (zs[k][s] - previous[s]).clone()
        for m in members:
            if m != k:
                total += codec.roundtrip(zs[m][s] - previous[s])[1]
        reference[s] = previous[s] + codec.roundtrip(total / 3)[1]
    assert all(o.ok and torch.equal(o.values[0]["w"], reference) for o in out)
    assert out[0].bytes < 2 * 2 * 300 * 4 // 3 / 3  # int8 with one scale per 64 values
    # the differences are about 0.01: int8 keeps them to about a step of absmax / 127 of theirs, ~100x better
    # than rounding the parameters themselves (about 1 in size)
    error = float((reference - sum(zs) / 3).abs().max())
    raw = float((sum(codec.roundtrip(z)[1] for z in zs) / 3 - sum(zs) / 3).abs().max())
    assert error < 3e-4 and error < raw / 30, (error, raw)

    mixers[2] = GlobalMix("mix1", ["w"], 0, codec)  # a newcomer: no reference
    start = time.monotonic()
    out = mix(2, [reference + vec(300, 20 + m, 0.01) for m in members])
    assert not any(o.ok for o in out) and time.monotonic() - start < 5
    assert all("tag" in o.cause or "bytes" in o.cause for o in out), [o.cause for o in out]
    zs = [reference + vec(300, 30 + m, 0.01) for m in members]
    out = mix(3, zs)  # everyone sends fp32 now
    assert all(o.ok and torch.allclose(o.values[0]["w"], sum(zs) / 3, atol=1e-6) for o in out)
    assert out[0].bytes == 2 * 2 * 300 * 4 // 3
    out = mix(4, [o.values[0]["w"] + vec(300, 40 + m, 0.01) for m, o in enumerate(out)])
    assert all(o.ok for o in out) and out[0].bytes < 2 * 2 * 300 * 4 // 3 / 3


def test_mix1_compression_is_refused_where_it_cannot_work(make_config):
    from gossiploco.errors import ConfigError

    with pytest.raises(ConfigError, match="mix1.compression"):
        make_config("globalm1-localm2", **{"mix1.compression": "topk"})
    with pytest.raises(ConfigError, match="mix1.compression"):
        make_config("localm1m2", **{"mix1.compression": "4bit"})
    with pytest.raises(ConfigError, match="mix2.topk_bits"):
        make_config("globalm1-localm2", **{"mix2.topk_bits": 3})


def test_the_utilization_simulator_sends_what_each_codec_sends(make_config):
    from gossiploco import utilization as util

    cfg = make_config("globalm1-localm2", **{"mix1.compression": "4bit", "mix2.compression": "topk"})
    plan = util.comm_plan(cfg, 256)
    assert plan.mix1.scale == pytest.approx((0.5 + 4 / 4096) / 4)  # 4 bits and one fp32 scale per 4096 values
    assert plan.mix2.scale == pytest.approx(build_codec("topk").encoded_bytes(1 << 24) / (4 << 24))
    sparse = util.comm_plan(make_config("diloco", **{"mix2.compression": "topk"}), 256)
    assert sparse.mix2.scale == pytest.approx(plan.mix2.scale * cfg.workers / 2)  # an all-gather, not a ring
    sc = util.resolve_scenario(cfg, bandwidth_mbps=100, vocab_size=256, step_time_s=0.1)
    fp32 = util.comm_plan(make_config("globalm1-localm2"), 256)
    assert util.attempt_seconds(plan.mix1, sc) == pytest.approx(util.attempt_seconds(fp32.mix1, sc) * plan.mix1.scale)


def test_a_fresh_swarm_compresses_its_first_mix1_against_x0(make_config):
    """Every worker starts from x_0, so it is the first reference: no round is sent as fp32."""
    from gossiploco.runtime.virtual import VirtualSwarm

    cfg = make_config("globalm1-localm2", **{"mix1.compression": "4bit"})
    result = VirtualSwarm(cfg).run()
    sent = [r["mix1_bytes"] for r in result.records if "mix1_bytes" in r]
    fp32 = 2 * 3 * sum(v.numel() for v in result.final_params.values()) * 4 // 4
    assert len(sent) == cfg.rounds and all(b < fp32 / 7 for b in sent), (sent, fp32)
    assert not any(r.get("mix1_failures") for r in result.records)
