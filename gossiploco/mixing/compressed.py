"""Compressed mixing: the mean of a group and of a pair, exchanging codec payloads, with fp32 sums.

The arithmetic lives here, once; an ``Exchange`` only moves bytes (``swap``, ``all_to_all``), so the
virtual swarm and the network peers compute the same bits.

**Group mean of a dense codec** (``int8``, ``4bit``, ...): a quantized reduce-scatter by direct
sends, then a quantized all-gather. With ``M`` members in the agreed order and the vector cut into
``M`` segments (``protocol.ring.segment_bounds``), member ``k`` owns segment ``k``:

1. every member sends ``Q(v[S_k])`` to owner ``k`` (``all_to_all``);
2. owner ``k`` sums, in fp32 and in member order, its own exact ``v[S_k]`` and the others' decoded
   values, divides by ``M``, and sends ``Q(mean_k)`` to everyone (``all_to_all``, the same bytes to
   all); it keeps ``D(Q(mean_k))`` itself, so every member ends with the same bits.

Each value is quantized at most twice (once by its sender, once by its owner), whatever ``M`` is;
a ring that re-quantized its running sums would quantize ``M`` times. Each member sends and receives
``2 (M - 1) / M`` payloads, as the ring does.

**Top-k** (a sparse vector): summing in a ring densifies it, so the group mean is a sparse
all-gather (each member's payload to every other; the mean of the decoded payloads in member order).
A pair swaps its payloads and takes the mean of the two decoded vectors (IEEE addition commutes:
both sides get the same bits).

**Error feedback** (for a pseudo-gradient, ``residual`` given): the vector sent is ``v = x + e``
and the new residual is what the mean lost of it, so that summed over rounds the mixed updates
lose nothing but the last residual (``mean_t(x) = mean(v - e')``; tested in
tests/test_compression_mixes.py):

* a pair, top-k: ``e' = v - D(Q(v))``;
* a group mean: ``e'[S_k] = v[S_k] - D(Q(v[S_k]))`` for the segments sent to others and, on the
  owner's own segment, ``M (mean_k - D(Q(mean_k)))``: its re-quantization error, which every member
  received, counted once (times ``M``) so the group's mean recovers it next round.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gossiploco.errors import PeerFailed
from gossiploco.mixing.compression import Codec, TopKCodec
from gossiploco.mixing.exchange import Exchange
from gossiploco.protocol.ring import segment_bounds


def group_mean(key: str, v: torch.Tensor, members: Sequence[int], exchange: Exchange, codec: Codec, tag: int = 0,
               *, feedback: bool = False, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``(mean over members, residual, bytes sent)`` of the fp32 vector ``v`` (module docstring); ``tag``
    names the reference ``v`` is relative to (every member must give the same, see ``all_to_all``).
    ``feedback``: also compute the error-feedback residual (else None). ``inplace``: the caller hands ``v``
    over, and the mean is written into it (no vector-sized buffer besides)."""
    members = list(members)
    if isinstance(codec, TopKCodec):
        return _sparse_all_gather(key, v, members, exchange, codec, feedback)
    n, me = len(members), members.index(exchange.rank)
    bounds = segment_bounds(v.numel(), n)

    def seg(t: torch.Tensor, k: int) -> torch.Tensor:
        return t[bounds[k]:bounds[k + 1]]

    def size(k: int) -> int:
        return codec.encoded_bytes(bounds[k + 1] - bounds[k])

    residual = torch.empty_like(v) if feedback else None
    parts = {}
    for k, m in enumerate(members):
        if k != me:
            parts[m] = codec.encode(seg(v, k))
            if residual is not None:  # e = v - D(Q(v)) on the segments sent
                torch.sub(seg(v, k), codec.decode(parts[m], bounds[k + 1] - bounds[k], out=seg(residual, k)),
                          out=seg(residual, k))
    got = exchange.all_to_all(f"{key}/scatter", parts, members, {m: size(me) for m in members if m != exchange.rank}, tag)
    total = seg(v, me).clone()
    for m in members:  # in member order: the owner's sum is one fixed sequence of fp32 additions
        if m != exchange.rank:
            codec.decode_add(got[m], total.numel(), total)
    mean = total.div_(n)
    payload = codec.encode(mean)
    mean_sent = codec.decode(payload, mean.numel())
    if residual is not None:
        torch.sub(mean, mean_sent, out=seg(residual, me)).mul_(n)
    got = exchange.all_to_all(f"{key}/gather", {m: payload for m in members if m != exchange.rank}, members,
                              {m: size(k) for k, m in enumerate(members) if k != me}, tag)
    out = v.view(-1) if inplace else torch.empty_like(v)  # (a new tensor object either way)
    for k, m in enumerate(members):
        if k == me:
            seg(out, k).copy_(mean_sent)
        else:
            codec.decode(got[m], bounds[k + 1] - bounds[k], out=seg(out, k))
    sent_bytes = sum(p.numel() for p in parts.values()) + payload.numel() * (n - 1)
    return out, residual, sent_bytes


def _sparse_all_gather(key: str, v: torch.Tensor, members: list[int], exchange: Exchange, codec: Codec,
                       feedback: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    payload, mine = codec.roundtrip(v)
    others = [m for m in members if m != exchange.rank]
    got = exchange.all_to_all(f"{key}/gather", {m: payload for m in others}, members,
                              {m: payload.numel() for m in others})
    total = torch.zeros_like(v)
    for m in members:
        if m == exchange.rank:
            total += mine
        else:
            codec.decode_add(got[m], v.numel(), total)
    return total.div_(len(members)), v - mine if feedback else None, payload.numel() * len(others)


def pair_mean(key: str, v: torch.Tensor, partner: int, exchange: Exchange, codec: Codec,
              feedback: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``(mean of the pair, residual (with ``feedback``, else None), bytes sent)``: swap payloads, average
    the decoded vectors."""
    payload, mine = codec.roundtrip(v)
    theirs = exchange.swap(key, partner, payload)
    if theirs.dtype != torch.uint8 or theirs.numel() != payload.numel():
        raise PeerFailed(f"partner {partner} sent {theirs.numel()} {theirs.dtype} values, expected {payload.numel()} bytes")
    return codec.decode(theirs, v.numel()).add_(mine).div_(2), v - mine if feedback else None, payload.numel()
