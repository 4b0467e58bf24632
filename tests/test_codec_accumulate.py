"""``Codec.decode_add``: a payload decoded and added into a vector in one pass (issue 28, item 3: fused codecs).

Reference, for a payload P of n values and an fp32 vector a:

    decode_add(P, n, a)  ==  a + D(P)      (every value's fp32 sum, bit for bit)

with ``D`` the codec's own ``decode``; a payload ``decode`` refuses is refused, and ``a`` keeps every bit it had.
"""

from __future__ import annotations

import pytest
import torch

from gossiploco.errors import PeerFailed
from gossiploco.mixing import compression
from gossiploco.mixing.compression import build_codec

CODECS = [("none", {}), ("bf16", {}), ("int8", {"block": 16}), ("4bit", {"block": 16}), ("4bit", {"block": 15}),
          ("e3m0", {"block": 16}), ("topk", {"density": 0.25, "chunk": 16}), ("topk", {"density": 0.02, "chunk": 256}),
          ("topk", {"density": 0.1, "chunk": 64, "bits": 4})]


def vec(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 1001, 4096])
@pytest.mark.parametrize("name,options", CODECS)
def test_decode_add_gives_the_bits_of_decode_then_add(monkeypatch, name, options, n, threads):
    monkeypatch.setattr(compression, "PIECE_VALUES", 64)  # many pieces, on several threads
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        codec = build_codec(name, **options)
        payload = codec.encode(vec(n, 1))
        acc = vec(n, 2)
        expected = acc + codec.decode(payload, n)
        got = acc.clone()
        assert codec.decode_add(payload, n, got) is got
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(got), bits(expected))


@pytest.mark.parametrize("name,options", CODECS)
def test_decode_add_into_a_strided_vector_and_refusing_other_vectors(name, options):
    codec = build_codec(name, **options)
    payload = codec.encode(vec(300, 3))
    strided = vec(600, 4)[::2]
    expected = strided + codec.decode(payload, 300)
    codec.decode_add(payload, 300, strided)
    assert torch.equal(bits(strided), bits(expected))
    for wrong in (torch.zeros(300, dtype=torch.float64), torch.zeros(299), torch.zeros(3, 100)):
        with pytest.raises(ValueError):
            codec.decode_add(payload, 300, wrong)


def spoiled_payloads(name: str, codec, payload: torch.Tensor):
    """Payloads no encoder makes, each of a kind ``decode`` refuses."""
    yield payload[:-1]  # truncated
    if name == "bf16":
        for high in (0x7F, 0xFF):  # +NaN and +Inf, then -NaN and -Inf, as a value in the middle
            for low in (0xC0, 0x80):
                bad = payload.clone()
                bad[20:22] = torch.tensor([low, high], dtype=torch.uint8)
                yield bad
        return
    nan_first = payload.clone()
    nan_first[:4] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # a NaN value, scale or bound
    yield nan_first
    if name == "int8":
        bad = payload.clone()
        bad[-1] = 255  # code 255: outside [0, 254]
        yield bad
    if name == "4bit":
        bad = payload.clone()
        bad[-3] = 0x7F  # code 15 in a low nibble
        yield bad
    if name == "topk":
        n, k = codec._shape(64)
        bad = payload.clone()
        bad[8 * n:8 * n + 2] = torch.tensor([0xFF, 0x00], dtype=torch.uint8)  # a position outside its chunk
        yield bad
        low_above_high = payload.clone()
        low_above_high[:4] = torch.tensor([0x00, 0x00, 0x80, 0x7F], dtype=torch.uint8)  # low bound infinite
        yield low_above_high


@pytest.mark.parametrize("name,options", CODECS)
def test_a_refused_payload_leaves_the_vector_as_it_was(name, options):
    codec = build_codec(name, **options)
    payload = codec.encode(vec(64, 5))
    acc = vec(64, 6)
    before = acc.clone()
    refused = 0
    for bad in spoiled_payloads(name, codec, payload):
        with pytest.raises(PeerFailed):
            codec.decode(bad, 64)
        with pytest.raises(PeerFailed):
            codec.decode_add(bad, 64, acc)
        assert torch.equal(bits(acc), bits(before))
        refused += 1
    assert refused >= 2


def test_summing_top_k_payloads_gives_the_dense_decodes_sum():
    """What the sparse group mean does: a zero vector plus each member's payload, in member order, equals the dense
    decodes' sum, bit for bit, signed zeros included."""
    codec = build_codec("topk", density=0.05, chunk=128)
    payloads = [codec.encode(vec(5000, seed)) for seed in range(6)]
    dense = torch.full((5000,), -0.0)
    fused = dense.clone()
    for payload in payloads:
        dense += codec.decode(payload, 5000)
        codec.decode_add(payload, 5000, fused)
    assert torch.equal(bits(fused), bits(dense))
