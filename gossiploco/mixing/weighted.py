"""Weighted means over the existing collectives: the value and its weight travel as one flat vector.

A worker's weight is what it contributed (Decoupled DiLoCo: the tokens it processed this round). Both
collectives send ``[w * x, w]``, the packed values times the weight with the weight appended as one more
element, so they run over every ``Exchange`` (in memory, ZeroMQ) with no change to the protocol:

* ``weighted_all_reduce``: the all-reduce mean of ``[w x, w]`` is ``[sum(w x) / M, sum(w) / M]``; their
  ratio is the weighted mean ``sum(w x) / sum(w)``, the same on every member.
* ``push_sum_swap``: a gossip pair swaps ``[w x, w]`` and both take value ``(w_a x_a + w_b x_b) / (w_a + w_b)``
  and weight ``(w_a + w_b) / 2``. Invariant (push-sum): the swarm's ``sum(w)`` and ``sum(w x)`` do not change
  (the pair's weights add to ``w_a + w_b``, their weighted values to ``w_a x_a + w_b x_b``), so the weighted
  mean ``sum(w x) / sum(w)`` is kept and repeated rounds converge to it. Both partners add the two vectors
  in the same IEEE operation (addition commutes), so they hold identical results.

Compressed mixes cannot carry the weight inside the payload (the codec would quantize it with the values),
so they learn the weights first and scale instead: ``group_scale`` is an all-gather of the members' weights
(4 bytes each; every member then sees, and checks, every weight and sums them in member order, so all get
the same total W), ``pair_scale`` a swap of the pair's two. A member then sends ``s x`` with
``s = M w / W`` (a pair: ``2 w / (w_a + w_b)``) through the ordinary compressed mean, whose result
``sum(s x) / M = sum(w x) / W`` is the weighted mean. Error feedback keeps what the compressed mean lost of
``s x + e`` as it is, so the next round adds it back at the scale it was lost at (its share of the mean is
then exactly what was missing). One extra exchange of a few bytes (a round trip) per mix.

With every weight 1.0 all of these reduce bit for bit to the unweighted collectives (``x * 1`` and ``/ 1`` are exact,
the weight element's mean is exactly 1, a pair's is exactly 2), which is why callers express weights in
units of a full round's tokens (and the scales of the compressed means are then exactly 1.0).

A weight arrives from other peers, so it is checked like any received value: a partner's weight, or a group's
mean weight, outside ``(0, MAX_WEIGHT]`` (or not finite) fails the mix with ``PeerFailed`` (the operator
falls back to identity and counts it), so a peer cannot claim a thousand rounds of tokens to outweigh
everyone, nor divide the mean by zero. A worker's own weight is capped at ``MAX_WEIGHT`` by its caller. In an
all-reduce only the members' sum is seen (of the weights as of the values): a member lying within the range
bends the mean no more than it could through its values in an unweighted all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gossiploco.errors import PeerFailed
from gossiploco.mixing.exchange import Exchange

MAX_WEIGHT = 64.0
"""The largest weight a worker may contribute: 64 full rounds' tokens (a time budget's fastest peer runs a few)."""


def with_weight(flat: torch.Tensor, weight: float) -> torch.Tensor:
    """``[weight * flat, weight]``: one new fp32 vector, one element longer than ``flat``."""
    out = torch.empty(flat.numel() + 1, dtype=torch.float32)
    torch.mul(flat, weight, out=out[:-1])
    out[-1] = weight
    return out


def checked_weight(weight: float, whose: str, largest: float = MAX_WEIGHT) -> float:
    """``weight`` when it is in ``(0, largest]`` (NaN is not); else ``PeerFailed`` saying ``whose`` it was."""
    if not 0.0 < weight <= largest:
        raise PeerFailed(f"{whose} weight {weight!r} received, outside (0, {largest:g}]")
    return weight


def split_weight(combined: torch.Tensor, whose: str, largest: float = MAX_WEIGHT) -> tuple[torch.Tensor, float]:
    """Inverse of ``with_weight`` on a sum or mean: the weighted mean (a view of ``combined``) and the weight,
    checked (``checked_weight``)."""
    weight = checked_weight(float(combined[-1]), whose, largest)
    return combined[:-1].div_(weight), weight


def weighted_all_reduce(key: str, flat: torch.Tensor, weight: float, members: Sequence[int],
                        exchange: Exchange) -> tuple[torch.Tensor, float]:
    """``sum(w x) / sum(w)`` over ``members`` and the members' mean weight; blocks like ``all_reduce_mean``."""
    mean = exchange.all_reduce_mean(key, with_weight(flat, weight), members, inplace=True)
    return split_weight(mean, "the group's mean")


def _weight_bytes(weight: float) -> torch.Tensor:
    return torch.tensor([weight], dtype=torch.float32).view(torch.uint8)


def _received_weight(payload: torch.Tensor, sender: int) -> float:
    if payload.dtype != torch.uint8 or payload.numel() != 4:
        raise PeerFailed(f"peer {sender} sent {payload.numel()} {payload.dtype} values for its weight, expected 4 bytes")
    return checked_weight(float(payload.view(torch.float32)[0]), f"peer {sender}'s")


def group_scale(key: str, weight: float, members: Sequence[int], exchange: Exchange) -> tuple[float, float]:
    """``(M w / W, W / M)``: this member's scale for a compressed weighted group mean, and the group's mean
    weight; every member's weight is gathered and checked (``PeerFailed`` for one out of range)."""
    mine = _weight_bytes(weight)
    own = float(mine.view(torch.float32)[0])  # as the others receive it
    got = exchange.all_to_all(f"{key}/weights", {m: mine for m in members if m != exchange.rank}, members,
                              {m: 4 for m in members if m != exchange.rank})
    total = 0.0
    for m in members:  # in member order: every member adds the same numbers in the same order
        total += own if m == exchange.rank else _received_weight(got[m], m)
    return len(members) * own / total, total / len(members)


def pair_scale(key: str, weight: float, partner: int, exchange: Exchange) -> tuple[float, float]:
    """``(2 w / (w_a + w_b), (w_a + w_b) / 2)``: this side's scale for a compressed weighted pair mean and the
    pair's new weight (push-sum); the partner's weight is checked."""
    mine = _weight_bytes(weight)
    own = float(mine.view(torch.float32)[0])  # as the partner receives it
    theirs = _received_weight(exchange.swap(f"{key}/weights", partner, mine), partner)
    total = own + theirs  # the same IEEE sum on both sides
    return 2 * own / total, total / 2


def push_sum_swap(key: str, partner: int, flat: torch.Tensor, weight: float,
                  exchange: Exchange) -> tuple[torch.Tensor, float]:
    """One push-sum exchange with ``partner``: the pair's weighted mean and the new weight ``(w_a + w_b) / 2``."""
    ours = with_weight(flat, weight)
    theirs = exchange.swap(key, partner, ours)
    if theirs.shape != ours.shape:
        raise PeerFailed(f"partner {partner} sent shape {tuple(theirs.shape)}, expected {tuple(ours.shape)}")
    checked_weight(float(theirs[-1]), f"partner {partner}'s")  # in range, or the swap fails
    mean, total = split_weight(theirs.add_(ours), "the pair's", 2 * MAX_WEIGHT)
    return mean, total / 2
