"""The robust group mean: a direct-send reduce-scatter whose segment owners aggregate robustly, each segment
owned twice so that a lying owner is detected (counted, logged) and its damage bounded.

With ``M >= 3`` members in the agreed order and the vector cut into ``M`` segments
(``protocol.ring.segment_bounds``), segment ``k`` has two owners, members ``k`` and ``k + 1 (mod M)``:

1. (weighted) every member's claimed weight goes to everyone (``KEY/weights``, 4 bytes each); each is
   bounded (``robust.bounded_weights``: at most ``weight_cap`` times the median claim);
2. every member sends its value of segment ``k`` (``codec``-encoded) to both owners of ``k``
   (``KEY/scatter``: member ``j`` receives segments ``j`` and ``j - 1``);
3. each owner screens and aggregates its two segments in fp32 (``robust.aggregate``: CenteredClip, members
   it excluded left out, screen failures struck in the ``Ledger``) and sends both results to everyone
   (``KEY/gather``);
4. every member takes, per segment, the coordinate-wise **median of the two owners' results and its own
   value**. Honest owners send the same result, which the median returns; a lying owner can move the
   segment no further than to this member's own value (as if that segment were not mixed this round).
   Results that differ by more than rounding are a disagreement: counted and logged, not struck. Honest
   owners disagree too while their exclusions differ (each peer excludes a liar when its own screen says so,
   not all in the same round), and a lying sender that sends the two owners different values makes honest
   owners disagree: a disagreement convicts nobody. The median bounds the damage either way: a lying owner
   can at most keep its two segments unmixed, and its own contributions are screened as everyone's.

Each member sends and receives twice what the plain reduce-scatter moves: the price of checking every owner.
With ``M = 2`` both members own both segments (a swap, then each takes the median of the two results and
its own: the pair's mean); with ``M = 1`` nothing is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gossiploco.errors import PeerFailed
from gossiploco.mixing.compression import Codec
from gossiploco.mixing.exchange import Exchange
from gossiploco.mixing.robust import RobustSettings, aggregate, bounded_weights
from gossiploco.mixing.screen import Ledger
from gossiploco.mixing.weighted import MAX_WEIGHT
from gossiploco.protocol.ring import segment_bounds

@dataclass(frozen=True)
class Robust:
    """A peer's robust mixing: how it aggregates, and its ledger of strikes and exclusions (shared by its mixes)."""

    settings: RobustSettings
    ledger: Ledger


DISAGREEMENT = 1e-3
"""Owners' results further apart than this times how far the mix moves this member's value (plus ``ROUNDING``
times the result's own size) disagree. Honest owners on one machine type compute the same bits; the slack
covers another CPU's vector units rounding the same sums differently."""
ROUNDING = 1e-5


def owned(j: int, n: int) -> list[int]:
    """The segments member ``j`` (an index in the member order) owns: ``j``, then ``j - 1`` (with ``n = 2``: both)."""
    return [j] if n == 1 else list(dict.fromkeys([j, (j - 1) % n]))


def owners(k: int, n: int) -> tuple[int, int]:
    """The indices of segment ``k``'s two owners."""
    return k, (k + 1) % n


def _gather_weights(key: str, weight: float, members: list[int], exchange: Exchange, round_index: int,
                    ledger: Ledger, cap: float) -> list[float]:
    """Every member's claimed weight (an unreadable or out-of-range claim counts as the smallest valid one and is
    struck), then bounded."""
    mine = torch.tensor([weight], dtype=torch.float32).view(torch.uint8)
    others = [m for m in members if m != exchange.rank]
    got = exchange.all_to_all(f"{key}/weights", {m: mine for m in others}, members, {m: 4 for m in others})
    claims = []
    for m in members:
        if m == exchange.rank:
            claims.append(float(mine.view(torch.float32)[0]))
            continue
        claim = float(got[m].view(torch.float32)[0]) if got[m].numel() == 4 else float("nan")
        if not 0.0 < claim <= MAX_WEIGHT:
            ledger.strike(round_index, m, f"claimed weight {claim!r}, outside (0, {MAX_WEIGHT:g}]")
            claim = 0.0
        claims.append(claim)
    valid = [c for c in claims if c > 0]
    bounded, over = bounded_weights([c if c > 0 else min(valid) for c in claims], cap)
    for i in over:
        ledger.strike(round_index, members[i], f"claimed weight {claims[i]:g}, above the bound of the group's claims")
    return [b if c > 0 else 0.0 for b, c in zip(bounded, claims)]


def robust_group_mean(key: str, v: torch.Tensor, members: Sequence[int], exchange: Exchange, codec: Codec,
                      settings: RobustSettings, ledger: Ledger, round_index: int, *, weight: float | None = None,
                      tag: int = 0, anchor: torch.Tensor | None = None,
                      judge: bool = True) -> tuple[torch.Tensor, float | None, int]:
    """``(robust mean over members, the members' mean bounded weight (None unweighted), bytes sent)`` of the fp32
    vector ``v`` (module docstring). ``anchor``: where the screen measures directions from (the previous mean
    of parameters; None: zero). ``tag`` as in ``all_to_all``. ``judge``: strike the members that fail the screen
    (False: a measurement's average, which convicts nobody; exclusions still apply). ``v`` is not modified."""
    members = list(members)
    n, me = len(members), members.index(exchange.rank)
    sent = 0
    if n == 1:
        return v.clone(), weight, 0
    if weight is not None:
        weights = _gather_weights(key, weight, members, exchange, round_index, ledger, settings.weight_cap)
        sent += 4 * (n - 1)
    else:
        weights = [1.0] * n
    excluded = ledger.excluded()
    weights = [0.0 if m in excluded else w for m, w in zip(members, weights)]
    bounds = segment_bounds(v.numel(), n)

    def seg(t: torch.Tensor, k: int) -> torch.Tensor:
        return t[bounds[k]:bounds[k + 1]]

    def length(k: int) -> int:
        return bounds[k + 1] - bounds[k]

    parts = {m: torch.cat([codec.encode(seg(v, k)) for k in owned(j, n)]) for j, m in enumerate(members) if j != me}
    mine_owned = owned(me, n)
    expected = sum(codec.encoded_bytes(length(k)) for k in mine_owned)
    got = exchange.all_to_all(f"{key}/scatter", parts, members, {m: expected for m in members if m != exchange.rank}, tag)
    sent += sum(p.numel() for p in parts.values())

    results: dict[int, torch.Tensor] = {}
    payloads = []
    for slot, k in enumerate(mine_owned):
        offset = sum(codec.encoded_bytes(length(q)) for q in mine_owned[:slot])
        size = codec.encoded_bytes(length(k))
        rows = torch.empty(n, length(k), dtype=torch.float32)
        for i, m in enumerate(members):  # in member order
            if m == exchange.rank:
                rows[i].copy_(seg(v, k))
            else:
                try:
                    codec.decode(got[m][offset:offset + size], length(k), out=rows[i])
                except PeerFailed:  # unreadable or non-finite: the screen drops the row and strikes the member
                    rows[i].fill_(float("nan"))
        taking = [i for i in range(n) if weights[i] > 0]
        agg, verdict = aggregate(rows[taking], [weights[i] for i in taking], settings,
                                 None if anchor is None else seg(anchor, k))
        for row, why in verdict.failed.items():
            if judge and members[taking[row]] != exchange.rank:
                ledger.strike(round_index, members[taking[row]], why)
        payload = codec.encode(agg)
        payloads.append(payload)
        results[k] = codec.decode(payload, length(k))
    mine_payload = torch.cat(payloads)
    gather_sizes = {m: sum(codec.encoded_bytes(length(k)) for k in owned(j, n)) for j, m in enumerate(members) if j != me}
    got = exchange.all_to_all(f"{key}/gather", {m: mine_payload for m in members if m != exchange.rank}, members,
                              gather_sizes, tag)
    sent += mine_payload.numel() * (n - 1)
    candidates: dict[int, dict[int, torch.Tensor]] = {k: {} for k in range(n)}  # segment -> owner -> its result
    for j, m in enumerate(members):
        offset = 0
        for k in owned(j, n):
            size = codec.encoded_bytes(length(k))
            if m == exchange.rank:
                candidates[k][m] = results[k]
            else:
                try:
                    candidates[k][m] = codec.decode(got[m][offset:offset + size], length(k))
                except PeerFailed:  # an owner's unreadable result counts as this member's own value
                    ledger.strike(round_index, m, f"sent an unreadable result for {key} segment {k}")
                    candidates[k][m] = seg(v, k).clone()
            offset += size
    out = torch.empty_like(v)
    for k in range(n):
        first, second = (members[i] for i in owners(k, n))
        a, b = candidates[k][first], candidates[k][second]
        own = seg(v, k)
        if first in excluded and second in excluded:  # nobody this member trusts aggregated it: its own value
            seg(out, k).copy_(own)
            continue
        if first in excluded or second in excluded:  # the trusted owner's result
            seg(out, k).copy_(b if first in excluded else a)
            continue
        if float((a - b).norm()) > DISAGREEMENT * float((a - own).norm()) + ROUNDING * float(a.norm()):
            ledger.disagreement(round_index, (first, second), f"{key} segment {k}")
        seg(out, k).copy_(torch.stack([a, b, own]).median(dim=0).values)
    mean_weight = None if weight is None else sum(weights) / max(1, sum(w > 0 for w in weights))
    return out, mean_weight, sent
