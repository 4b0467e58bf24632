"""Consensus monitors: L2 parameter disagreement and JS functional disagreement (paper 4.4, appendix D).

    CD_L2    = 1/M sum_m ||x_m - x_bar||_2          (eq. 34, mean of norms)
    CD_L2^2  = 1/M sum_m ||x_m - x_bar||_2^2        (eq. 40, mean of squares)
    CD_JS    = 1/(M |U|) sum_m sum_u d_JS(p_m(u), p_bar(u))              (eq. 46)
    d_JS(p, q) = sqrt(JS(p, q) / log 2),  JS = KL(p||m)/2 + KL(q||m)/2,  m = (p + q)/2   (eqs. 44-45)

where p_bar is the output of the *parameter-averaged* model. JS is computed in float64 and in the
log domain, on the ``top_k`` tokens of the averaged model at each position (recomputed at every
measurement); with a vocabulary of at most ``top_k`` tokens it is the full JS distance. The
top-k sum is the sum of the full divergence's terms over those tokens (no renormalisation), so
it is a lower bound of the full distance that tightens as k grows.

Every quantity is written as a per-worker term plus an average over workers, so a network peer
can compute its own term against the swarm average and aggregate the terms with an all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

TensorDict = dict[str, torch.Tensor]
LOG2 = math.log(2.0)


def average(params: Sequence[Mapping[str, torch.Tensor]]) -> TensorDict:
    """Element-wise mean of worker parameter dicts, accumulated in float64 (in worker order), returned as fp32.

    Identical inputs give exactly their common value, so exact consensus measures exactly 0.
    """
    out = {}
    for name in params[0]:
        total = params[0][name].detach().to("cpu", torch.float64).clone()
        for p in params[1:]:
            total += p[name].detach().to("cpu", torch.float64)
        out[name] = (total / len(params)).to(torch.float32)
    return out


def l2_term(x: Mapping[str, torch.Tensor], avg: Mapping[str, torch.Tensor], groups: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """One worker's squared distance to the average, per block: {block: ||x_b - avg_b||^2} (float64)."""
    out = {}
    for block, names in groups.items():
        sq = 0.0
        for n in names:
            diff = x[n].detach().to("cpu", torch.float64) - avg[n].to(torch.float64)
            sq += float(torch.dot(diff.reshape(-1), diff.reshape(-1)))
        out[block] = sq
    return out


def aggregate_l2(terms: Sequence[Mapping[str, float]]) -> dict:
    """CD_L2 (eq. 34), CD_L2^2 (eq. 40) and per-block CD_L2 (eq. 34 on each block) from per-worker terms."""
    m = len(terms)
    total_sq = [sum(t.values()) for t in terms]
    return {
        "cd_l2": sum(math.sqrt(s) for s in total_sq) / m,
        "cd_l2_sq": sum(total_sq) / m,
        "cd_l2_blocks": {b: sum(math.sqrt(t[b]) for t in terms) / m for b in terms[0]},
    }


def consensus_l2(params: Sequence[Mapping[str, torch.Tensor]], groups: Mapping[str, Sequence[str]]) -> dict:
    avg = average(params)
    return aggregate_l2([l2_term(p, avg, groups) for p in params])


def js_distance(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Normalised JS distance (eq. 45) between log-probability tensors over the last axis, in float64.

    Sums over whatever entries are given (a full vocabulary, or a top-k subset); zero-probability
    entries (log = -inf) contribute nothing. Result has the leading shape, values in [0, 1].
    """
    logp, logq = logp.to(torch.float64), logq.to(torch.float64)
    # log(p / m) = log 2 - softplus(log q - log p), written so that p == q gives exactly 0.
    d = logq - logp
    p, q = logp.exp(), logq.exp()
    kl_pm = torch.where(p > 0, p * (LOG2 - _softplus(d)), torch.zeros_like(p)).sum(-1)
    kl_qm = torch.where(q > 0, q * (LOG2 - _softplus(-d)), torch.zeros_like(q)).sum(-1)
    js = 0.5 * (kl_pm + kl_qm)
    return (js / LOG2).clamp(0.0, 1.0).sqrt()


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)) without overflow, exact log 2 at x = 0."""
    return torch.where(x > 0, x + torch.log1p(torch.exp(-x)), torch.log1p(torch.exp(x)))


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float64 log-softmax over the vocabulary."""
    return torch.log_softmax(logits.to(torch.float64), dim=-1)


def js_term(worker_logits: torch.Tensor, avg_logits: torch.Tensor, top_k: int) -> float:
    """One worker's mean d_JS over the held-out positions against the averaged model's output."""
    logp_avg = log_probs(avg_logits)  # (B, T, V)
    logp_w = log_probs(worker_logits)
    if top_k < logp_avg.shape[-1]:
        idx = logp_avg.topk(top_k, dim=-1).indices  # (B, T, k): top tokens of the averaged model
        logp_avg = logp_avg.gather(-1, idx)
        logp_w = logp_w.gather(-1, idx)
    return float(js_distance(logp_w, logp_avg).mean())


def consensus_js(worker_logits: Sequence[torch.Tensor], avg_logits: torch.Tensor, top_k: int) -> float:
    """CD_JS (eq. 46)."""
    return sum(js_term(w, avg_logits, top_k) for w in worker_logits) / len(worker_logits)
