"""Robust aggregation of the members' values of one segment: screening, bounded weights, CenteredClip.

In an open run any member may lie. A mean lets one member put the group anywhere (a pseudo-gradient
scaled by 1000 moves the mean by 250 honest updates in a group of four). Here the owner of a segment
(``gossiploco.mixing.robust_mean``) aggregates the ``M`` rows it received with:

1. **screening** (``screen``): a row with a non-finite value is dropped; a row farther from the
   coordinate-wise median than ``outlier_factor`` times the median of the rows' distances, or pointing
   against the median (cosine below ``min_cosine``, measured from ``anchor``: the previous mean for
   parameters, zero for pseudo-gradients), fails the screen. Failing it costs a strike
   (``gossiploco.mixing.screen``), not the row: CenteredClip bounds the row's pull anyway, and an honest
   outlier keeps its say. Distances and directions are judged only among ``MIN_SCREENED_ROWS`` rows or more.
2. **bounded weights** (``bounded_weights``): a claimed weight above ``weight_cap`` times the median claim
   counts as that cap (and fails the screen): nobody outweighs ``weight_cap`` honest members by claiming tokens.
3. **CenteredClip** (Karimireddy, He and Jaggi 2021; BTARD-SGD's aggregator, Gorbunov et al. 2021)::

       v_0 = coordinate-wise median of the rows
       tau = radius_factor * median_m ||x_m - v_0||          (the radius follows the honest spread)
       v_{l+1} = v_l + sum_m w_m clip(x_m - v_l, tau) / sum_m w_m,   clip(d, tau) = d min(1, tau / ||d||)

   for ``iterations`` steps. With no outlier every row lies within ``tau`` of ``v_0`` (the rows of honest
   members are spread about alike), nothing is clipped and ``v_1`` is the exact weighted mean; a liar's
   row moves the result by at most ``w_liar tau / sum(w)`` per step, whatever it sent. With fewer than
   3 rows nothing can be told apart: the weighted mean (a pair's robustness is ClippedGossip's, in
   ``operators``).

All arithmetic is fp32 in member order, so two owners of a segment given the same rows compute the same bits
on the same machine type (``robust_mean`` compares them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


MIN_SCREENED_ROWS = 4
"""Rows (members not excluded) a segment needs before distances and directions can convict anyone: with three,
one honest member that mixed with a liar before everyone excluded it is as far from the median as the liar
was (seen: an open run of 4 peers excluding an honest one after the liar). Fewer rows are still clipped."""


@dataclass(frozen=True)
class RobustSettings:
    """How robust mixing aggregates and screens (``[robust]`` of the run config fills it in)."""

    iterations: int = 3
    radius_factor: float = 2.0
    outlier_factor: float = 3.0
    min_cosine: float = -0.2
    weight_cap: float = 2.0


@dataclass
class SegmentVerdict:
    """What screening one segment found, per member (in the order of the rows given)."""

    failed: dict[int, str] = field(default_factory=dict)
    """Row index -> why it failed the screen."""
    dropped: set[int] = field(default_factory=set)
    """Rows left out of the aggregate (non-finite values)."""


def coordinate_median(rows: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of ``rows`` (M, n); for an even M the mean of the two middle values."""
    m = rows.shape[0]
    ordered = rows.sort(dim=0).values
    if m % 2:
        return ordered[m // 2].clone()
    return (ordered[m // 2 - 1] + ordered[m // 2]) / 2


def bounded_weights(claims: list[float], cap: float) -> tuple[list[float], list[int]]:
    """Each claim capped at ``cap`` times the median claim, and the indices of the claims that were above it."""
    ordered = sorted(claims)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    limit = cap * median
    return [min(c, limit) for c in claims], [i for i, c in enumerate(claims) if c > limit]


def screen(rows: torch.Tensor, settings: RobustSettings, anchor: torch.Tensor | None = None) -> SegmentVerdict:
    """Screen the rows of one segment (module docstring, step 1)."""
    verdict = SegmentVerdict()
    finite = torch.isfinite(rows).all(dim=1)
    for i in (~finite).nonzero().flatten().tolist():
        verdict.dropped.add(i)
        verdict.failed[i] = "non-finite values"
    kept = [i for i in range(rows.shape[0]) if i not in verdict.dropped]
    if len(kept) < MIN_SCREENED_ROWS:
        return verdict
    sub = rows[kept]
    center = coordinate_median(sub)
    distances = (sub - center).norm(dim=1)
    typical = float(distances.median())
    base = center if anchor is None else center - anchor
    base_norm = float(base.norm())
    for j, i in enumerate(kept):
        d = float(distances[j])
        if typical > 0 and d > settings.outlier_factor * typical:
            verdict.failed[i] = f"{d / typical:.1f}x the group's typical distance from its median"
            continue
        own = sub[j] if anchor is None else sub[j] - anchor
        own_norm = float(own.norm())
        if base_norm > 0 and own_norm > 0:
            cosine = float(own @ base) / (own_norm * base_norm)
            if cosine < settings.min_cosine:
                verdict.failed[i] = f"points against the group's median (cosine {cosine:.2f})"
    return verdict


def centered_clip(rows: torch.Tensor, weights: torch.Tensor, settings: RobustSettings) -> torch.Tensor:
    """CenteredClip of ``rows`` (M, n) with ``weights`` (M,) (module docstring, step 3); a new fp32 vector."""
    total = weights.sum()
    if rows.shape[0] < 3:
        return (weights.unsqueeze(1) * rows).sum(dim=0).div_(total)
    v = coordinate_median(rows)
    tau = settings.radius_factor * float((rows - v).norm(dim=1).median())
    if tau == 0.0:
        return v
    for _ in range(settings.iterations):
        diff = rows - v
        norms = diff.norm(dim=1)
        scale = torch.clamp(tau / norms.clamp_min(torch.finfo(torch.float32).tiny), max=1.0)
        v = v + (weights * scale) @ diff / total
    return v


def aggregate(rows: torch.Tensor, weights: list[float], settings: RobustSettings,
              anchor: torch.Tensor | None = None) -> tuple[torch.Tensor, SegmentVerdict]:
    """Screen, then CenteredClip over the rows that are kept: ``(aggregate, verdict)``. ``weights`` are already
    bounded (``bounded_weights``); a row whose weight is 0 (an excluded member) takes no part."""
    verdict = screen(rows, settings, anchor)
    kept = [i for i in range(rows.shape[0]) if i not in verdict.dropped and weights[i] > 0]
    if not kept:
        raise ValueError("no row left to aggregate")
    w = torch.tensor([weights[i] for i in kept], dtype=torch.float32)
    return centered_clip(rows[kept], w, settings), verdict
