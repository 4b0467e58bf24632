"""The consensus monitors estimated from one group of the swarm: what a group's measurement says about the swarm.

Above ``[groups] size`` members a network peer measures with its bucket of the exchange ``monitor/r/h``
(``protocol.groups``): ``g`` of the ``M`` members of its view, not all of them. This module turns the group's
averages into estimates of the swarm-wide monitors (``gossiploco.consensus``: eqs. 34, 40, 46) and states their error.
Pure arithmetic: no sockets, no model.

**Sampling.** A bucket of a fixed index is each member independently with probability 1/n, so *given its size g*
it is a uniform random g-subset of the M members (simple random sampling without replacement, SRS); a peer's own
bucket is itself plus a uniform (g - 1)-subset of the others, which averaged over which peer reports is the same
SRS. Everything below is over that draw, the members' parameters x_1..x_M held fixed.

Notation: x_bar the swarm mean, x_G the group mean, d_i = ||x_i - x_bar||, and

    sigma^2 = CD_L2^2 = 1/M sum_i d_i^2            (eq. 40)        L = CD_L2 = 1/M sum_i d_i      (eq. 34)
    h_ij = ||x_i - x_j||^2 / 2,   theta = mean of h_ij over ordered pairs i != j of the swarm,   sigma^2 = (M-1)/M theta

(the identity sum_{i,j} ||x_i - x_j||^2 = 2 M sum_i d_i^2 gives the last equality; the same identity in the group
gives  1/g sum_{i in G} ||x_i - x_G||^2 = (g-1)/g U  with U the mean of h_ij over the group's ordered pairs).

**CD_L2^2: unbiased.** The group's own mean squared distance to its mean, ``q = 1/g sum_G ||x_i - x_G||^2``, is
biased low: E[q] = (g-1)/g * M/(M-1) * sigma^2 (E[U] = theta for an SRS; equivalently E[sum_G ||x_i - x_G||^2 /
(g-1)] = S^2 = M/(M-1) sigma^2, the textbook SRS sample variance). The estimate written is

    T = c q,    c = correction(g, M) = g (M-1) / (M (g-1)) = (M-1)/M U,      E[T] = sigma^2  (unbiased; g >= 2)

and T = q exactly when g = M (c = 1: the whole swarm, nothing estimated). At g = 16, M = 1000 the uncorrected q
reads 6.2% low (1/c = 0.938). **Its error** is exact and computable from the swarm (``variance_sq``): with p_s =
(g)_s / (M)_s the chance that s given members are all in the group (falling factorials) and sums over ordered
pairs of distinct members,

    E[U^2] = (p_2 A_2 + p_3 A_3 + p_4 A_4) / (g (g-1))^2,      Var(T) = ((M-1)/M)^2 (E[U^2] - theta^2)
    A_2 = 2 sum h_ij^2,   A_3 = 4 sum_i (r_i^2 - sum_j h_ij^2) with r_i = sum_j h_ij,   A_4 = (sum h_ij)^2 - A_2 - A_3

(pairs of pairs sharing both, one or no member). To leading order in 1/g, T ~ c (mean over G of d_i^2 minus
||x_G - x_bar||^2), so Var(T) ~ (1 - g/M) / g * Var_i(d_i^2): the standard error shrinks as 1/sqrt(g), falls to 0 at
g = M, and is small when the members' distances to the mean are alike. By Chebyshev a single group's T lies within
k standard deviations of sigma^2 with probability at least 1 - 1/k^2 (k = 3: 8/9, whatever the swarm).

**CD_L2: biased, bounded.** The estimate written is ``sqrt(c) * 1/g sum_G ||x_i - x_G||``: in the regime of model
parameters (many coordinates, so every ||x_i - x_G||^2 concentrates near (1 - 1/g) tau^2 and d_i^2 near (1 - 1/M)
tau^2) sqrt(c) is exactly the ratio of the two, and the estimate reads L without bias; otherwise it has no exact
correction (a mean of square roots). For any swarm its root mean squared error is bounded (``l2_rmse_bound``): by
the triangle inequality | ||x_i - x_G|| - d_i | <= ||x_G - x_bar||, by Cauchy-Schwarz E[(1/g sum_G ||x_i - x_G||)^2]
<= sigma^2 / c, E||x_G - x_bar||^2 = (M-g)/(g(M-1)) sigma^2 and the SRS mean of the d_i has variance (M-g)/(g M) S_d^2
(S_d^2 the d_i's variance with M - 1), so

    RMSE(CD_L2 estimate) <= sigma (1 - 1/sqrt(c) + sqrt((M-g)/(g(M-1)))) + sqrt((M-g)/(g M)) S_d.

The per-block CD_L2 values are estimated the same way, block by block.

**CD_JS: the group's, bias bounded.** A group knows the output p_G of its *group*-averaged model, not the swarm's
p_bar; the value written is eq. 46 over the group against p_G, uncorrected. d_JS is a metric (the square root of the
JS divergence; with the full vocabulary, ``js_top_k`` >= the vocabulary), so per held-out position
|d_JS(p_i, p_G) - d_JS(p_i, p_bar)| <= d_JS(p_G, p_bar): the group's value differs from the SRS mean of the members'
swarm terms (itself unbiased for CD_JS, variance (M-g)/(g M) S_js^2) by at most the mean JS distance between the
group's and the swarm's averaged models, which vanishes at g = M.

Records say which they are: ``cd_scope`` ("swarm" when the group is the whole view, "group" otherwise),
``cd_group_size`` (g) and ``cd_swarm_size`` (M, the members of this peer's view in that round).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def correction(g: int, swarm: int) -> float:
    """c = g (M - 1) / (M (g - 1)): multiplies a group's mean squared distance to its mean into an unbiased estimate
    of the swarm's CD_L2^2. 1 when the group is the swarm (``g >= M``). Raises ``ValueError`` for g < 2 < M (a group
    of one says nothing about the others)."""
    if g >= swarm:
        return 1.0
    if g < 2:
        raise ValueError(f"a group of {g} of {swarm} members estimates nothing")
    return g * (swarm - 1) / (swarm * (g - 1))


def scope(g: int, swarm: int) -> str:
    """"swarm" when the group is the whole view (exact values), "group" when they are estimates."""
    return "swarm" if g >= swarm else "group"


def estimate(group_mean_sq: float, group_mean_norm: float, block_mean_norms: Mapping[str, float], g: int,
             swarm: int) -> dict:
    """The swarm's CD_L2, CD_L2^2 and per-block CD_L2 estimated from a group's means (over its ``g`` members) of the
    squared distance to the group mean, of the distance, and of each block's distance; ``swarm``: M. Returns the
    record's fields, ``cd_scope``/``cd_group_size``/``cd_swarm_size`` included (module docstring)."""
    swarm = max(swarm, g)
    c = correction(g, swarm)
    root = math.sqrt(c)
    return {"cd_l2": root * group_mean_norm, "cd_l2_sq": c * group_mean_sq,
            "cd_l2_blocks": {b: root * v for b, v in block_mean_norms.items()},
            "cd_scope": scope(g, swarm), "cd_group_size": g, "cd_swarm_size": swarm}


# -- the stated error, from a whole swarm (what the tests check the estimates against) -----------------------------

def pairwise_halved_sq(points: torch.Tensor) -> torch.Tensor:
    """h_ij = ||x_i - x_j||^2 / 2 for the rows of ``points`` (M, D), in float64."""
    x = points.to(torch.float64)
    return torch.cdist(x, x).pow(2) / 2


def falling(n: int, s: int) -> float:
    """(n)_s = n (n-1) ... (n-s+1)."""
    return math.prod(range(n - s + 1, n + 1)) if s <= n else 0.0


def variance_sq(points: torch.Tensor, g: int) -> float:
    """Var of the CD_L2^2 estimate ``T`` over uniform g-subsets of the M rows of ``points``: exact (module
    docstring)."""
    h = pairwise_halved_sq(points)
    m = h.shape[0]
    if g >= m:
        return 0.0
    total = float(h.sum())
    theta = total / (m * (m - 1))
    sq = float((h * h).sum())
    rows = h.sum(dim=1)
    a2 = 2 * sq
    a3 = 4 * (float((rows * rows).sum()) - sq)
    a4 = total * total - a2 - a3
    p = {s: falling(g, s) / falling(m, s) for s in (2, 3, 4)}
    second = (p[2] * a2 + p[3] * a3 + p[4] * a4) / (g * (g - 1)) ** 2
    return ((m - 1) / m) ** 2 * max(second - theta * theta, 0.0)


def l2_rmse_bound(points: torch.Tensor, g: int) -> float:
    """The bound on the CD_L2 estimate's root mean squared error for groups of ``g`` of the rows of ``points``
    (module docstring)."""
    x = points.to(torch.float64)
    m = x.shape[0]
    if g >= m:
        return 0.0
    d = (x - x.mean(dim=0)).norm(dim=1)
    sigma = math.sqrt(float(d.pow(2).mean()))
    s_d = float(d.var(unbiased=True)) ** 0.5
    c = correction(g, m)
    return sigma * (1 - 1 / math.sqrt(c) + math.sqrt((m - g) / (g * (m - 1)))) + math.sqrt((m - g) / (g * m)) * s_d


def group_estimate(points: torch.Tensor, members: list[int]) -> dict:
    """``estimate`` for the group ``members`` of the rows of ``points``, computed directly (the reference a network
    group's measurement is checked against)."""
    x = points.to(torch.float64)
    group = x[members]
    dist = (group - group.mean(dim=0)).norm(dim=1)
    return estimate(float(dist.pow(2).mean()), float(dist.mean()), {}, len(members), x.shape[0])
