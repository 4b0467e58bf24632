"""The monitors estimated from one group (gossiploco.consensus_sample) against the swarm's exact values.

The reference is the paper's definitions over the whole swarm (eqs. 34, 40, 46: ``gossiploco.consensus``); every
claim of the module docstring is checked either exactly, over every group of a small swarm (enumeration: no
randomness, tolerances at float64 rounding), or over the buckets ``protocol.groups`` really draws for M = 32, with a
tolerance derived from the stated variance."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from gossiploco import consensus
from gossiploco import consensus_sample as cs
from gossiploco.protocol import groups


def swarm(m: int, dim: int, seed: int, outlier: float = 0.0) -> torch.Tensor:
    """M members' parameters with unequal spreads (so the members' distances to the mean differ), optionally one
    member far away."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, dim, generator=gen, dtype=torch.float64) * (0.2 + 3 * torch.rand(m, 1, generator=gen, dtype=torch.float64))
    x[0] += outlier
    return x


def exact(points: torch.Tensor) -> dict:
    """The whole swarm's values, written from the paper in float64: CD_L2 = 1/M sum_m ||x_m - x_bar|| (eq. 34),
    CD_L2^2 = 1/M sum_m ||x_m - x_bar||^2 (eq. 40)."""
    x = points.to(torch.float64)
    dist = (x - x.mean(dim=0)).norm(dim=1)
    return {"cd_l2": float(dist.mean()), "cd_l2_sq": float(dist.pow(2).mean())}


def every_group(points: torch.Tensor, g: int) -> list[dict]:
    return [cs.group_estimate(points, list(members)) for members in itertools.combinations(range(points.shape[0]), g)]


@pytest.mark.parametrize("outlier", [0.0, 25.0])
def test_the_cd_l2_sq_estimate_is_unbiased_and_its_variance_is_the_stated_one_over_every_group(outlier):
    x = swarm(10, 3, seed=1, outlier=outlier)
    sigma_sq = exact(x)["cd_l2_sq"]
    m = x.shape[0]
    for g in (2, 3, 5, 9, 10):
        t = torch.tensor([e["cd_l2_sq"] for e in every_group(x, g)], dtype=torch.float64)
        assert float(t.mean()) == pytest.approx(sigma_sq, rel=1e-12)  # E[T] = sigma^2
        assert float(t.var(unbiased=False)) == pytest.approx(cs.variance_sq(x, g), rel=1e-9, abs=1e-12 * sigma_sq ** 2)
        # the uncorrected group value reads low by (g-1)/g * M/(M-1), as stated
        q = t / cs.correction(g, m)
        assert float(q.mean()) == pytest.approx(sigma_sq * (g - 1) / g * m / (m - 1) if g < m else sigma_sq, rel=1e-12)
    assert cs.variance_sq(x, m) == 0.0


@pytest.mark.parametrize("outlier", [0.0, 25.0])
def test_the_cd_l2_estimate_stays_within_its_stated_rms_error_bound_over_every_group(outlier):
    x = swarm(11, 4, seed=2, outlier=outlier)
    cd_l2 = exact(x)["cd_l2"]
    for g in (2, 4, 6, 10):
        est = torch.tensor([e["cd_l2"] for e in every_group(x, g)], dtype=torch.float64)
        rmse = float((est - cd_l2).pow(2).mean().sqrt())
        assert rmse <= cs.l2_rmse_bound(x, g) * (1 + 1e-12), (g, rmse, cs.l2_rmse_bound(x, g))
    whole = cs.group_estimate(x, list(range(11)))
    assert whole["cd_l2"] == pytest.approx(cd_l2, rel=1e-12) and whole["cd_scope"] == "swarm"


def test_a_single_groups_estimate_lies_within_k_standard_errors_with_probability_at_least_one_minus_one_over_k_sq():
    x = swarm(12, 2, seed=3, outlier=10.0)  # heavy-tailed distances: the bound is tested where it is tightest
    sigma_sq = exact(x)["cd_l2_sq"]
    for g in (3, 6):
        sd = math.sqrt(cs.variance_sq(x, g))
        t = np.array([e["cd_l2_sq"] for e in every_group(x, g)])
        for k in (1.5, 2.0, 3.0):
            outside = float(np.mean(np.abs(t - sigma_sq) >= k * sd))
            assert outside <= 1 / k ** 2, (g, k, outside)


def test_over_the_buckets_protocol_groups_draws_for_32_members_the_mean_estimate_is_the_swarms_value():
    """M = 32 at ``[groups] size`` 8: four buckets of Binomial(32, 1/4) members per key. Given its size a bucket is a
    uniform subset, so every bucket's estimate is unbiased. Keys are independent, and a key's mean over its buckets
    has a standard deviation at most the mean of theirs (Minkowski), each the stated one for its size: so the mean
    over N keys is within 4 of the resulting standard errors. The uncorrected group values, biased by
    (g-1)/g * M/(M-1), fall outside that band: the test tells the two apart."""
    x = swarm(32, 64, seed=4)
    truth = exact(x)["cd_l2_sq"]
    members = list(range(32))
    n = groups.bucket_count(32, 8)
    assert n == 4
    sd = {g: math.sqrt(cs.variance_sq(x, g)) for g in range(2, 33)}
    per_key, uncorrected, key_variances = [], [], []
    keys = 200
    for k in range(keys):
        key = f"monitor/{k}/0"
        buckets = groups.scores(7, key, "bucket", members) % np.uint64(n)
        estimates, raw, sds = [], [], []
        for b in range(n):
            group = [m for m in members if buckets[m] == b]
            if len(group) >= 2:
                assert groups.group_of(7, key, members, group[0], 8) == group  # a peer's group is its bucket
                estimates.append(cs.group_estimate(x, group)["cd_l2_sq"])
                raw.append(estimates[-1] / cs.correction(len(group), 32))
                sds.append(sd[len(group)])
        per_key.append(sum(estimates) / len(estimates))
        uncorrected.append(sum(raw) / len(raw))
        key_variances.append((sum(sds) / len(sds)) ** 2)
    standard_error = math.sqrt(sum(key_variances)) / keys
    assert abs(float(np.mean(per_key)) - truth) <= 4 * standard_error
    assert abs(float(np.mean(uncorrected)) - truth) > 4 * standard_error


def test_the_groups_cd_js_differs_from_its_members_swarm_terms_by_at_most_the_distance_of_the_two_averaged_models():
    """d_JS is a metric (full vocabulary): per position |d(p_i, p_G) - d(p_i, p_bar)| <= d(p_G, p_bar). A model
    whose logits are linear in its parameters makes the averaged model's logits the average of the logits."""
    gen = torch.Generator().manual_seed(5)
    m, vocab, feat = 16, 20, 6
    weights = torch.randn(m, vocab, feat, generator=gen, dtype=torch.float64) * (0.5 + torch.rand(m, 1, 1, generator=gen, dtype=torch.float64))
    inputs = torch.randn(2, 7, feat, generator=gen, dtype=torch.float64)
    logits = torch.einsum("btf,mvf->mbtv", inputs, weights)
    swarm_avg = logits.mean(dim=0)
    swarm_terms = [consensus.js_term(logits[i], swarm_avg, vocab) for i in range(m)]
    for members in ([0, 1], [2, 5, 9], list(range(0, 16, 2)), list(range(16))):
        group_avg = logits[members].mean(dim=0)
        group_js = consensus.consensus_js([logits[i] for i in members], group_avg, vocab)
        bound = consensus.js_term(group_avg, swarm_avg, vocab)
        assert abs(group_js - sum(swarm_terms[i] for i in members) / len(members)) <= bound + 1e-12
    assert bound <= 1e-15  # the whole swarm: the same model (up to the order of a float64 sum)


def test_estimate_scopes_and_refusals():
    assert cs.correction(16, 16) == 1.0 and cs.correction(20, 16) == 1.0
    assert cs.correction(16, 1000) == pytest.approx(16 * 999 / (1000 * 15))
    out = cs.estimate(2.0, 1.0, {"b": 0.5}, 4, 4)
    assert out == {"cd_l2": 1.0, "cd_l2_sq": 2.0, "cd_l2_blocks": {"b": 0.5}, "cd_scope": "swarm",
                   "cd_group_size": 4, "cd_swarm_size": 4}
    out = cs.estimate(2.0, 1.0, {"b": 0.5}, 4, 8)
    c = 4 * 7 / (8 * 3)
    assert out["cd_scope"] == "group" and out["cd_l2_sq"] == pytest.approx(2 * c)
    assert out["cd_l2"] == pytest.approx(math.sqrt(c)) and out["cd_l2_blocks"]["b"] == pytest.approx(0.5 * math.sqrt(c))
    with pytest.raises(ValueError, match="estimates nothing"):
        cs.correction(1, 8)
