from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from gossiploco.mixing import GlobalMix, GossipMix, IdentityMix, MemoryHub, pair_matching


def mix_all(mixer_factory, values, round_index=0, hub=None, timeout_s=10.0):
    """Run one mixer per worker concurrently over an in-memory hub; returns the MixResults."""
    hub = hub or MemoryHub(len(values), timeout_s)
    mixers = [mixer_factory() for _ in values]
    with ThreadPoolExecutor(max_workers=len(values)) as pool:
        futures = [pool.submit(m.mix, [v], round_index, hub.exchange(r)) for r, (m, v) in enumerate(zip(mixers, values))]
        return [f.result(timeout=60) for f in futures]


def test_pair_matching_is_a_deterministic_perfect_matching():
    for members in ([0, 1, 2, 3, 4, 5, 6, 7], [3, 9, 4, 1, 7]):
        m = pair_matching(seed=1, round_index=5, salt="mix2", members=members)
        assert m == pair_matching(1, 5, "mix2", list(reversed(members)))  # order of the list is irrelevant
        assert set(m) == set(members)
        for a, b in m.items():
            assert b is None or (m[b] == a and a != b)
        assert sum(b is None for b in m.values()) == len(members) % 2
    draws = {tuple(sorted(pair_matching(0, r, "mix2", range(8)).items())) for r in range(50)}
    assert len(draws) > 30  # a fresh random matching each round (105 exist for 8 peers)
    # Mix1 and Mix2 draw independent matchings in the same round.
    assert sum(pair_matching(0, r, "mix1", range(8)) != pair_matching(0, r, "mix2", range(8)) for r in range(20)) > 15


def test_global_mix_is_the_average_and_identity_is_identity():
    values = [{"w": torch.full((2, 2), float(r))} for r in range(4)]
    out = mix_all(lambda: GlobalMix("mix1", ["w"], 0), values)
    assert all(o.ok and torch.equal(o.values[0]["w"], torch.full((2, 2), 1.5)) for o in out)
    out = mix_all(lambda: IdentityMix("mix2"), values)
    assert all(o.values[0]["w"] is v["w"] and o.bytes == 0 for o, v in zip(out, values))


@pytest.mark.parametrize("workers", [8, 7])
def test_gossip_preserves_the_mean_exactly(workers):
    # Values whose pair sums and halves are exact in fp32: the mean must not move by a single bit.
    gen = torch.Generator().manual_seed(0)
    values = [{"w": torch.randint(-2**12, 2**12, (500,), generator=gen).float() * 2.0**-4} for _ in range(workers)]
    before = sum(v["w"].double() for v in values)
    for r in range(5):
        out = mix_all(lambda: GossipMix("mix2", ["w"], seed=3), values, round_index=r)
        values = [o.values[0] for o in out]
        assert torch.equal(sum(v["w"].double() for v in values), before)
        assert sum(o.partner is None for o in out) == workers % 2


def test_gossip_preserves_the_mean_of_random_values_to_fp32_rounding():
    gen = torch.Generator().manual_seed(0)
    values = [{"w": torch.randn(500, generator=gen)} for _ in range(8)]
    before = sum(v["w"].double() for v in values) / 8
    for r in range(5):
        values = [o.values[0] for o in mix_all(lambda: GossipMix("mix2", ["w"], seed=3), values, round_index=r)]
    assert torch.allclose(sum(v["w"].double() for v in values) / 8, before, rtol=0, atol=1e-6)


def test_gossip_contraction_matches_theory_for_m8():
    M, d = 8, 64
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(M, d, dtype=torch.float64, generator=gen)
    X = X - X.mean(0)
    ratios = []
    for r in range(2000):
        partners = pair_matching(seed=0, round_index=r, salt="mix2", members=range(M))
        mixed = torch.stack([(X[m] + X[partners[m]]) / 2 for m in range(M)])
        ratios.append(float((mixed - mixed.mean(0)).pow(2).sum() / X.pow(2).sum()))
    assert abs(np.mean(ratios) - (M - 2) / (2 * (M - 1))) < 0.02


@pytest.mark.slow  # seconds: the fast subset keeps its margin under 2 minutes
def test_gossip_operator_contraction_over_the_exchange():
    """Same measurement through the real operator and exchange, fewer draws."""
    M = 8
    gen = torch.Generator().manual_seed(2)
    base = [torch.randn(32, dtype=torch.float64, generator=gen) for _ in range(M)]
    mean = sum(base) / M
    dist = sum((b - mean).pow(2).sum() for b in base)
    ratios = []
    for r in range(300):
        out = mix_all(lambda: GossipMix("mix2", ["w"], seed=5), [{"w": b.float()} for b in base], round_index=r)
        ratios.append(float(sum((o.values[0]["w"].double() - mean).pow(2).sum() for o in out) / dist))
    assert abs(np.mean(ratios) - (M - 2) / (2 * (M - 1))) < 0.05


def test_odd_worker_keeps_its_value():
    values = [{"w": torch.full((3,), float(r))} for r in range(5)]
    out = mix_all(lambda: GossipMix("mix2", ["w"], seed=0), values)
    alone = [r for r, o in enumerate(out) if o.partner is None]
    assert len(alone) == 1 and torch.equal(out[alone[0]].values[0]["w"], values[alone[0]]["w"])
    assert out[alone[0]].bytes == 0


def test_only_selected_blocks_are_mixed():
    values = [{"a": torch.full((2,), float(r)), "b": torch.full((2,), float(r))} for r in range(4)]
    out = mix_all(lambda: GlobalMix("mix2", ["a"], 0), values)
    for r, o in enumerate(out):
        assert torch.equal(o.values[0]["a"], torch.full((2,), 1.5))
        assert o.values[0]["b"] is values[r]["b"]
        assert o.bytes == 2 * 3 * 8 // 4  # a ring member sends 2 (M - 1) / M of the 8 payload bytes


def test_failed_peer_means_identity_with_the_cause_recorded():
    hub = MemoryHub(4, timeout_s=5.0)
    hub.fail(3)
    values = [{"w": torch.full((2,), float(r))} for r in range(4)]
    mixers = [GlobalMix("mix1", ["w"], 0) for _ in range(3)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        # Members are read from the exchange: the failed peer is excluded, survivors average.
        out = list(pool.map(lambda r: mixers[r].mix([values[r]], 0, hub.exchange(r)), range(3)))
    assert all(o.ok and torch.equal(o.values[0]["w"], torch.full((2,), 1.0)) for o in out)
    # A peer that fails mid-swap: its partner falls back to identity and says why.
    hub = MemoryHub(2, timeout_s=0.2)
    result = GossipMix("mix2", ["w"], 0).mix([values[0]], 0, hub.exchange(0))
    assert not result.ok and result.values[0]["w"] is values[0]["w"]
    assert "ExchangeTimeout" in result.cause


def test_non_finite_values_from_a_peer_never_reach_the_model():
    values = [{"w": torch.zeros(3)}, {"w": torch.tensor([1.0, float("nan"), 2.0])}]
    out = mix_all(lambda: GossipMix("mix2", ["w"], 0), values)
    assert not out[0].ok and "non-finite" in out[0].cause
    assert torch.equal(out[0].values[0]["w"], torch.zeros(3))


@pytest.mark.parametrize("state", [False, True])
def test_mixing_several_dicts_in_one_exchange(state):
    values = [[{"w": torch.full((2,), float(r))}, {"w": torch.full((2,), 10.0 * r)}] for r in range(2)]
    hub = MemoryHub(2, 5.0)
    with ThreadPoolExecutor(max_workers=2) as pool:
        out = list(pool.map(lambda r: GlobalMix("mix1", ["w"], 0).mix(values[r], 0, hub.exchange(r)), range(2)))
    assert torch.equal(out[0].values[0]["w"], torch.full((2,), 0.5))
    assert torch.equal(out[1].values[1]["w"], torch.full((2,), 5.0))
