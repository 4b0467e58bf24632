import math

import numpy as np
import torch

from gossiploco.consensus import average, consensus_js, consensus_l2, js_distance, js_term, log_probs


def brute_force_js_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Eqs. 44-45 straight from the definition, in float64, one distribution at a time."""
    m = (p + q) / 2
    kl = lambda a, b: sum(ai * math.log(ai / bi) for ai, bi in zip(a, b) if ai > 0)
    return math.sqrt((0.5 * kl(p, m) + 0.5 * kl(q, m)) / math.log(2))


def random_logits(*shape, scale=3.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def test_js_distance_properties():
    a, b = log_probs(random_logits(50, 30, seed=1)), log_probs(random_logits(50, 30, seed=2))
    assert torch.all(js_distance(a, a) == 0)
    assert torch.allclose(js_distance(a, b), js_distance(b, a), atol=1e-15)
    d = js_distance(a, b)
    assert torch.all(d > 0) and torch.all(d <= 1)
    # Disjoint supports give the maximum, 1.
    p = torch.tensor([[0.0, -math.inf]], dtype=torch.float64)
    q = torch.tensor([[-math.inf, 0.0]], dtype=torch.float64)
    assert torch.allclose(js_distance(p, q), torch.ones(1, dtype=torch.float64))


def test_js_distance_matches_brute_force_reference():
    a, b = log_probs(random_logits(20, 64, seed=3)), log_probs(random_logits(20, 64, seed=4))
    ours = js_distance(a, b)
    for i in range(20):
        ref = brute_force_js_distance(a[i].exp().numpy(), b[i].exp().numpy())
        assert abs(float(ours[i]) - ref) < 1e-12


def test_js_is_stable_in_the_log_domain_for_extreme_logits():
    a = log_probs(random_logits(4, 200, scale=200.0, seed=5))
    b = log_probs(random_logits(4, 200, scale=200.0, seed=6))
    d = js_distance(a, b)
    assert torch.isfinite(d).all() and torch.all((0 <= d) & (d <= 1))


def test_top_k_equals_full_when_vocabulary_is_at_most_k():
    worker, avg = random_logits(2, 5, 100, seed=7), random_logits(2, 5, 100, seed=8)
    full = float(js_distance(log_probs(worker), log_probs(avg)).mean())
    assert js_term(worker, avg, top_k=100) == full
    assert js_term(worker, avg, top_k=1000) == full
    # With a larger vocabulary, top-k is a lower bound that grows with k.
    worker, avg = random_logits(2, 5, 300, seed=9), random_logits(2, 5, 300, seed=10)
    values = [js_term(worker, avg, k) for k in (10, 100, 300)]
    assert values[0] <= values[1] <= values[2]


def test_top_k_uses_the_averaged_models_top_tokens():
    avg = torch.full((1, 1, 200), -10.0, dtype=torch.float64)
    avg[..., :100] = 5.0  # the averaged model's top 100 are tokens 0..99
    worker = avg.clone()
    worker[..., 150] = 5.0  # the worker disagrees only outside them, on token 150
    # Token 150 is outside the averaged model's top 100: only the changed masses of tokens 0..99 count.
    lp_w, lp_a = log_probs(worker), log_probs(avg)
    expected = float(js_distance(lp_w[..., :100], lp_a[..., :100]).mean())
    assert abs(js_term(worker, avg, 100) - expected) < 1e-15


def test_cd_js_is_mean_over_workers_and_positions():
    avg = random_logits(3, 4, 50, seed=11)
    workers = [random_logits(3, 4, 50, seed=s) for s in (12, 13, 14)]
    ref = np.mean([brute_force_js_distance(log_probs(w)[i, j].exp().numpy(), log_probs(avg)[i, j].exp().numpy())
                   for w in workers for i in range(3) for j in range(4)])
    assert abs(consensus_js(workers, avg, 100) - ref) < 1e-12


def test_cd_l2_equations_34_and_40_and_per_block():
    torch.manual_seed(0)
    params = [{"a": torch.randn(3, 4), "b": torch.randn(5)} for _ in range(4)]
    groups = {"A": ["a"], "B": ["b"]}
    stacked = [torch.cat([p["a"].flatten(), p["b"]]).double() for p in params]
    mean = sum(stacked) / 4
    norms = [float((s - mean).norm()) for s in stacked]
    out = consensus_l2(params, groups)
    assert abs(out["cd_l2"] - np.mean(norms)) < 1e-6  # eq. 34
    assert abs(out["cd_l2_sq"] - np.mean(np.square(norms))) < 1e-5  # eq. 40
    mean_a = sum(p["a"].double() for p in params) / 4
    assert abs(out["cd_l2_blocks"]["A"] - np.mean([float((p["a"] - mean_a).norm()) for p in params])) < 1e-6
    same = consensus_l2([params[0]] * 3, groups)
    assert same["cd_l2"] == 0.0 and same["cd_l2_sq"] == 0.0
    assert torch.equal(average([params[0]] * 3)["a"], params[0]["a"])
