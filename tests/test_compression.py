"""Compression codecs (issue 16): each codec against its definition (its bytes written out plainly here), the
payloads no encoder makes refused, and coding on threads, in pieces and in a forked child. The compressed means
and mixes built on the codecs are tested in tests/test_compression_mixes.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gossiploco.errors import PeerFailed
from gossiploco.mixing.compression import BlockCodec, TopKCodec, build_codec


def vec(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale

# -- codecs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,bits", [("none", 32), ("bf16", 16), ("int8", 8), ("4bit", 4), ("e3m0", 4)])
def test_dense_codecs_have_their_size_and_round_to_their_grid(name, bits):
    codec = build_codec(name, block=64)
    for n in (1, 63, 64, 1001):
        x = vec(n, n, 0.01)
        payload, decoded = codec.roundtrip(x)
        blocks = math.ceil(n / 64)
        expected = {32: 4 * n, 16: 2 * n, 8: 4 * blocks + n, 4: 4 * blocks + (n + 1) // 2}[bits]
        assert payload.dtype == torch.uint8 and payload.numel() == codec.encoded_bytes(n) == expected
        assert torch.equal(codec.decode(payload, n), decoded)  # decoding is a function of the bytes
        if name == "none":
            assert torch.equal(decoded, x)
        elif name == "bf16":
            assert torch.equal(decoded, x.to(torch.bfloat16).float())
        else:  # the nearest point of scale * grid, scale = the block's absmax
            padded = torch.nn.functional.pad(x, (0, blocks * 64 - n)).view(blocks, 64)
            scale = padded.abs().amax(dim=1, keepdim=True)
            grid = {"int8": torch.arange(-127, 128) / 127, "4bit": torch.arange(-7, 8) / 7,
                    "e3m0": torch.tensor([s * 2.0 ** -k for s in (1, -1) for k in range(8)])}[name]
            points = scale[..., None] * grid  # (blocks, 64 values, grid)
            best = (padded[..., None] - points).abs().min(dim=-1).values.reshape(-1)[:n]
            assert torch.allclose((decoded - x).abs(), best, rtol=1e-4, atol=1e-8)  # fp32 rounding of x / step * step


def reference_block_payload(name: str, x: torch.Tensor, block: int) -> torch.Tensor:
    """The block codecs' bytes written plainly (the module docstring's formulas, as they were first coded): scale =
    max |x| of each zero-padded block; int8/4bit: code = clamp(round(x / (scale / levels)), -levels, levels) + levels
    (round half to even); e3m0: the index of the nearest grid value, halfway between two the lower (``bucketize``
    onto the sorted grid's midpoints); 4-bit codes two a byte, the first in the low nibble."""
    n = x.numel()
    blocks = math.ceil(n / block)
    padded = torch.nn.functional.pad(x, (0, blocks * block - n)).view(blocks, block)
    scale = padded.abs().amax(dim=1)
    if name == "e3m0":
        grid = torch.tensor([2.0 ** -k for k in range(8)] + [-(2.0 ** -k) for k in range(8)])
        ordered = torch.sort(grid)
        midpoints = (ordered.values[1:] + ordered.values[:-1]) / 2
        unit = padded / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        codes = ordered.indices[torch.bucketize(unit, midpoints)].to(torch.uint8)
    else:
        levels = 127 if name == "int8" else 7
        step = torch.where(scale > 0, scale / levels, torch.ones_like(scale))
        codes = (padded / step[:, None]).round().clamp(-levels, levels).add(levels).to(torch.uint8)
    codes = codes.reshape(-1)[:n]
    if name != "int8":
        codes = torch.nn.functional.pad(codes, (0, n % 2))
        codes = codes[0::2] | (codes[1::2] << 4)
    return torch.cat([scale.view(torch.uint8), codes])


def awkward_values(n: int, seed: int) -> torch.Tensor:
    """Random values with what breaks a fast path planted: a block of zeros, -0.0, ties halfway between two levels
    of both grids (of both signs), E3M0's midpoints 0.75 2^-j and values beside them, subnormals, the block's
    absmax on either sign."""
    x = vec(n, seed)
    x[:64] = 0.0
    x[64:70] = -0.0
    x[70] = 4.0  # the absmax of block 1 (64..127): ties at half steps of 4/7 and 4/127, and E3M0's midpoints of 4
    ties = [4.0 / 7 * (i + 0.5) for i in range(-7, 7)] + [4.0 / 127 * (i + 0.5) for i in range(-30, 30, 7)]
    midpoints = [s * 4.0 * 0.75 * 2.0 ** -j for j in range(7) for s in (1, -1)]
    beside = [torch.nextafter(torch.tensor(m), torch.tensor(m * 2)).item() for m in midpoints]
    planted = torch.tensor(ties + midpoints + beside + [1e-40, -1e-40, 4.0 * 2.0 ** -9, -4.0 * 2.0 ** -9])
    x[71:71 + planted.numel()] = planted
    x[200] = -5.0  # a negative absmax (block 3)
    return x


@pytest.mark.parametrize("name", ["int8", "4bit", "e3m0"])
def test_the_fast_block_codecs_send_the_bytes_of_the_plain_formulas(name):
    """The codecs avoid passes over memory (no |x| written, int8 conversion, nibbles packed as int16, E3M0 from the
    float's bits): what they send must be, byte for byte, what the formulas give, on awkward values and odd sizes;
    and decoding must be the grid value times the step, whatever the code."""
    for n, block in ((1, 64), (4097, 64), (1 << 18, 4096), ((1 << 18) + 7, 4096), (1001, 5)):
        x = awkward_values(n, n) if n >= 300 else vec(n, n)
        codec = build_codec(name, block=block)
        payload = codec.encode(x)
        assert torch.equal(payload, reference_block_payload(name, x, block)), (name, n, block)
    codec = build_codec(name, block=16)
    codes = torch.arange(15 if name != "int8" else 255, dtype=torch.uint8)  # every code, one block of 16 each
    numel = codes.numel() * 16
    every = codes.repeat_interleave(16)
    scales = torch.linspace(0.5, 3.0, codes.numel())
    packed = every if name == "int8" else every[0::2] | (every[1::2] << 4)
    decoded = codec.decode(torch.cat([scales.view(torch.uint8), packed]), numel)
    if name == "e3m0":
        grid = torch.tensor([2.0 ** -k for k in range(8)] + [-(2.0 ** -k) for k in range(8)])
        expected = grid[every.long()] * scales.repeat_interleave(16)
    else:
        levels = 127 if name == "int8" else 7
        expected = (every.float() - levels) * (scales / levels).repeat_interleave(16)
    assert torch.equal(decoded, expected)


def test_topk_decodes_into_a_given_vector_as_into_a_new_one():
    codec = TopKCodec(density=0.05, chunk=100, bits=2)
    for n in (1050, 1100, 37):
        payload, decoded = codec.roundtrip(vec(n, n))
        into = torch.full((n,), float("nan"))
        assert codec.decode(payload, n, out=into) is into and torch.equal(into, decoded)


@pytest.mark.slow  # trains a swarm to collect pseudo-gradients (3 s): the fast subset stays under 2 minutes
def test_the_4bit_format_is_the_linear_grid_because_it_loses_less_than_e3m0_on_pseudo_gradients(make_config):
    """The issue asks for E3M0 or a blockwise 4-bit format shown better. A pseudo-gradient is the sum
    of H AdamW updates, each about the learning rate in size: its values are flatter than a Gaussian's
    (kurtosis about 1.7 on the tiny and small models), and the linear grid loses about a third of
    E3M0's error at the same bytes. E3M0's log grid wins on heavy tails (Student-t), which is why it
    stays available as ``e3m0``."""
    from gossiploco.data import load_corpus
    from gossiploco.runtime.common import build_trainer

    cfg = make_config("globalm1-localm2")
    trainer = build_trainer(cfg, load_corpus(cfg.data), torch.device("cpu"), 0)
    start = {n: p.detach().clone() for n, p in trainer.params().items()}
    for _ in range(cfg.inner_steps):
        trainer.inner_step()
    delta = torch.cat([(trainer.params()[n] - start[n]).reshape(-1) for n in start])
    kurtosis = float(((delta - delta.mean()) ** 4).mean() / delta.var() ** 2)
    assert kurtosis < 3
    int4, e3m0 = build_codec("4bit", block=4096), build_codec("e3m0", block=4096)

    def error(codec, x):
        return float((codec.roundtrip(x)[1] - x).norm() / x.norm())

    assert error(int4, delta) < 0.5 * error(e3m0, delta)
    assert error(int4, vec(1 << 16, 0)) < error(e3m0, vec(1 << 16, 0))
    heavy = torch.distributions.StudentT(3.0).sample((1 << 16,))
    assert error(e3m0, heavy) < error(int4, heavy)


@pytest.mark.parametrize("rows, width, k", [(64, 4096, 82), (3, 4096, 123), (5, 1024, 21), (7, 2048, 2),
                                           (2, 65536, 1311), (4, 512, 11), (3, 4096, 1024)])
def test_the_sampled_selection_keeps_exactly_each_rows_k_largest(rows, width, k):
    """Top-k's selection (``codec_kernels.select_row``: a threshold from a sample, then a selection among the
    candidates) against ``torch.topk`` over each whole row, on rows that defeat the sample: all zeros, a run of equal
    values, a NaN, three nonzero values, and a heavy tail. Its columns come ascending, and it returns the bits of the
    k-th largest and of the largest magnitude."""
    from gossiploco.mixing.codec_kernels import select_row

    def check(magnitudes):
        reference = magnitudes.topk(k, dim=1, sorted=False).values
        for r in range(rows):
            bits = magnitudes[r].contiguous().numpy().view(np.int32)
            kept = np.empty(k, np.int32)
            kth, top = select_row(bits, k, *(np.empty(width, np.int32) for _ in range(3)), kept)
            columns = torch.from_numpy(kept.astype(np.int64))
            assert bool((columns[1:] > columns[:-1]).all()) and 0 <= int(columns[0]) and int(columns[-1]) < width
            values = magnitudes[r, columns].sort().values.nan_to_num(9.0)
            assert torch.equal(values, reference[r].sort().values.nan_to_num(9.0))
            as_float = torch.tensor([kth, top], dtype=torch.int32).view(torch.float32).nan_to_num(9.0)
            assert torch.equal(as_float, torch.stack([values[0], values[-1]]))

    generator = torch.Generator().manual_seed(rows * width + k)
    magnitudes = torch.randn(rows, width, generator=generator).abs()
    check(magnitudes)
    check(torch.distributions.StudentT(1.5).sample((rows, width)).abs())
    magnitudes[0] = 0.0
    magnitudes[-1, :3 * k] = 5.0  # more values equal to the k-th largest than k
    check(magnitudes)
    magnitudes[-1, 17] = float("nan")
    check(magnitudes)
    sparse = torch.zeros(rows, width)
    sparse[:, :3] = 1.0
    check(sparse)


def test_topk_keeps_each_chunks_largest_values_with_their_sign():
    codec = TopKCodec(density=0.05, chunk=100, bits=2)
    x = vec(1050, 3)
    payload, decoded = codec.roundtrip(x)
    n, k = 11, 5
    assert payload.numel() == codec.encoded_bytes(1050) == 8 * n + 2 * n * k + math.ceil(n * k / 4)
    padded = torch.nn.functional.pad(x, (0, n * 100 - 1050)).view(n, 100)
    dec = torch.nn.functional.pad(decoded, (0, n * 100 - 1050)).view(n, 100)
    for c in range(n):
        top = set(padded[c].abs().topk(k).indices.tolist())
        kept = set(dec[c].nonzero().reshape(-1).tolist())
        assert kept <= top and len(kept) >= k - (1 if c == n - 1 else 0)  # a padding zero may be among the last chunk's
        low, high = padded[c].abs().topk(k).values.min(), padded[c].abs().max()
        for i in kept:
            assert torch.sign(dec[c, i]) == torch.sign(padded[c, i]) and low <= dec[c, i].abs() <= high
            # 2 bits: one of the two magnitudes a quarter and three quarters between low and high, the nearer
            levels = torch.stack([low + (high - low) / 4, low + 3 * (high - low) / 4])
            assert torch.isclose(dec[c, i].abs(), levels[(levels - padded[c, i].abs()).abs().argmin()])
    assert 4 * 1_000_000 / TopKCodec(0.02, 4096, 2).encoded_bytes(1_000_000) > 80  # the default: 85x fewer bytes


def reference_topk_payload(codec: TopKCodec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k's bytes written plainly (the format's formulas, with ``torch.topk`` over each zero-padded chunk): per
    chunk its low and high kept magnitude, its k columns ascending (uint16), and the codes ``sign | level << 1`` with
    level = clamp(floor((|v| - low) / (high - low) * levels), 0, levels - 1) (a span of 0 counts as 1), packed 8 / bits
    a byte over the whole vector, lowest bits first. Returns (payload, decoded: the kept values' grid magnitudes,
    (low + (high - low) (level + 1/2) / levels), with their signs, zero elsewhere)."""
    n, k = codec._shape(x.numel())
    chunks = torch.nn.functional.pad(x, (0, n * codec.chunk - x.numel())).view(n, codec.chunk)
    columns = chunks.abs().topk(k, dim=1).indices.sort(dim=1).values
    values = chunks.gather(1, columns)
    low, high = values.abs().amin(dim=1, keepdim=True), values.abs().amax(dim=1, keepdim=True)
    span = torch.where(high > low, high - low, torch.ones_like(high))
    level = ((values.abs() - low) / span * codec.levels).floor().clamp(0, codec.levels - 1)
    codes = ((values < 0).to(torch.uint8) | (level.to(torch.uint8) << 1)).reshape(-1)
    per_byte = 8 // codec.bits
    codes = torch.nn.functional.pad(codes, (0, (-codes.numel()) % per_byte)).view(-1, per_byte)
    packed = torch.zeros(codes.shape[0], dtype=torch.uint8)
    for j in range(per_byte):
        packed |= codes[:, j] << (j * codec.bits)
    bounds = torch.cat([low, high], dim=1)
    payload = torch.cat([bounds.reshape(-1).view(torch.uint8), columns.to(torch.int16).reshape(-1).view(torch.uint8),
                         packed])
    magnitude = low + (high - low) * ((level + 0.5) / codec.levels)
    decoded = torch.zeros_like(chunks).scatter_(1, columns, torch.where(values < 0, -magnitude, magnitude))
    return payload, decoded.reshape(-1)[:x.numel()]


@pytest.mark.parametrize("density, chunk, bits, n", [(0.02, 4096, 2, (1 << 16) + 100), (0.05, 100, 2, 1050),
                                                     (0.3, 7, 1, 703), (0.01, 2048, 4, 40_000), (0.1, 64, 8, 3000),
                                                     (0.02, 65536, 2, 70_000)])
def test_topk_sends_the_bytes_of_the_plain_formulas(density, chunk, bits, n):
    """The compiled top-k (a sampled threshold, then a selection among candidates, codes packed as they are made)
    sends what ``torch.topk`` and the format's formulas give, byte for byte, and decodes to their values: chunk sizes
    with and without the sample, cut last chunks, every value width (normal values, and cut chunks holding at least k of
    them: no ties at a k-th largest, whose choice is not specified)."""
    codec = TopKCodec(density, chunk, bits)
    x = vec(n, n)
    payload, decoded = codec.roundtrip(x)
    reference, reference_decoded = reference_topk_payload(codec, x)
    assert torch.equal(payload, reference)
    assert torch.equal(decoded, reference_decoded)


@pytest.mark.parametrize("name", ["int8", "4bit", "e3m0", "topk"])
def test_codecs_send_and_decode_the_same_on_any_number_of_threads(name):
    """A long vector is coded in pieces on ``torch.get_num_threads()`` threads: the bytes and the values are those of
    one thread (top-k's pieces are whole bytes of codes: 8 chunks each, with a k that packs unevenly: 3 a chunk)."""
    codec = build_codec(name, block=4095, density=3 / 1000, chunk=1000, bits=2)
    x = vec((1 << 20) + 333, 9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_decoded = codec.roundtrip(x)
        torch.set_num_threads(2)
        two, two_decoded = codec.roundtrip(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one_decoded, two_decoded)


def _encode_on_two_threads() -> None:
    """Code a long vector on two threads of the pieces' pool, and check it against the values decoded on this one.
    No torch operation runs on torch's own threads here: a forked child of a process that used them waits for them
    for good (GNU OpenMP), whatever the codecs do."""
    torch.set_num_threads(2)
    codec = build_codec("4bit")
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((1 << 20) + 1, dtype=np.float32))
    decoded = codec.decode(codec.encode(x), x.numel()).numpy()
    torch.set_num_threads(1)
    assert np.array_equal(decoded, codec.decode(codec.encode(x), x.numel()).numpy())


@pytest.mark.slow  # a fresh interpreter: seconds; the fast subset keeps its margin under 2 minutes
def test_a_forked_child_codes_on_threads_of_its_own():
    """The pieces' threads are a process's own: a child forked after its parent coded on threads (whose pool it
    inherits, without the threads) codes on new ones, where it would wait for its parent's for good."""
    import multiprocessing

    threads = torch.get_num_threads()
    try:
        _encode_on_two_threads()  # the parent's pool of two threads exists now
    finally:
        torch.set_num_threads(threads)
    child = multiprocessing.get_context("fork").Process(target=_encode_on_two_threads)
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0


@pytest.mark.slow  # a fresh interpreter: seconds; the fast subset keeps its margin under 2 minutes
def test_preparing_a_codec_compiles_its_kernels_before_any_exchange():
    """In a fresh interpreter no kernel is compiled until a codec runs; ``prepare`` compiles (or loads) what encode and
    decode run, so the first exchange does not pay for it."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from gossiploco.mixing.compression import build_codec\n"
        "assert 'gossiploco.mixing.codec_kernels' not in sys.modules\n"
        "for name in ('4bit', 'topk'):\n"
        "    build_codec(name, block=64, chunk=64, density=0.1).prepare()\n"
        "from gossiploco.mixing import codec_kernels as k\n"
        "ran = [k.block_encode, k.block_codes_valid, k.block_decode, k.topk_encode, k.topk_positions_valid,"
        " k.topk_decode]\n"
        "assert all(kernel.signatures for kernel in ran), [kernel.__name__ for kernel in ran if not kernel.signatures]\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_algorithm_prepares_both_mixes_codecs_when_it_is_built(make_config, monkeypatch):
    from gossiploco.data import load_corpus
    from gossiploco.factored import FactoredDiLoCo
    from gossiploco.mixing import MemoryHub
    from gossiploco.runtime.common import build_trainer

    prepared = []
    monkeypatch.setattr(BlockCodec, "prepare", lambda self: prepared.append(self.name))
    monkeypatch.setattr(TopKCodec, "prepare", lambda self: prepared.append(self.name))
    cfg = make_config("globalm1-localm2", workers=1, **{"mix1.compression": "4bit", "mix2.compression": "topk"})
    algo = FactoredDiLoCo(build_trainer(cfg, load_corpus(cfg.data), torch.device("cpu"), 0), cfg,
                          MemoryHub(1, 5.0).exchange(0))
    algo.close()
    assert prepared == ["4bit", "topk"]


@pytest.mark.parametrize("name", ["int8", "4bit", "e3m0", "topk"])
def test_decoding_writes_into_any_float_vector_and_refuses_others(name):
    """``out`` may be a strided view (written through a copy); a vector of another type or size is a ``ValueError``
    before anything is written; a vector holding a NaN or an infinity makes a payload every decoder refuses."""
    codec = build_codec(name, block=16, density=0.25, chunk=16)
    x = vec(1001, 4)
    payload, decoded = codec.roundtrip(x)
    strided = torch.full((2002,), float("nan"))[::2]
    assert codec.decode(payload, 1001, out=strided) is strided and torch.equal(strided, decoded)
    for wrong in (torch.zeros(1001, dtype=torch.float64), torch.zeros(1000), torch.zeros(7, 143)):
        with pytest.raises(ValueError):
            codec.decode(payload, 1001, out=wrong)
    for bad in (float("nan"), float("inf")):
        spoiled = x.clone()
        spoiled[500] = bad
        with pytest.raises(PeerFailed):
            codec.roundtrip(spoiled)


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "4bit", "topk"])
def test_decoding_rejects_payloads_no_encoder_makes(name):
    codec = build_codec(name, block=16, density=0.25, chunk=16)
    payload = codec.encode(vec(64, 1))
    with pytest.raises(PeerFailed):
        codec.decode(payload[:-1], 64)  # truncated
    with pytest.raises(PeerFailed):
        codec.decode(payload.view(torch.int8), 64)  # not bytes
    bad = payload.clone()
    bad[:4] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # a NaN as the first value / scale / bound
    if name != "bf16":
        with pytest.raises(PeerFailed):
            codec.decode(bad, 64)
    if isinstance(codec, BlockCodec) and codec.bits == 8:
        bad = payload.clone()
        bad[-1] = 255  # code 255: outside [0, 254]
        with pytest.raises(PeerFailed):
            codec.decode(bad, 64)
    if isinstance(codec, BlockCodec) and codec.bits == 4:
        for byte in (0x7F, 0xF7):  # code 15 (outside [0, 14]) in the low nibble, then in the high one
            bad = payload.clone()
            bad[-3] = byte
            with pytest.raises(PeerFailed):
                codec.decode(bad, 64)
        odd = codec.encode(vec(63, 1))
        assert int(odd[-1]) >> 4 == 0  # an odd count's last high nibble is padding: 0, and never read
        padded = odd.clone()
        padded[-1] |= 0xF0
        assert torch.equal(codec.decode(padded, 63), codec.decode(odd, 63))
    if name == "topk":
        bad = payload.clone()
        bad[8 * 4:8 * 4 + 2] = torch.tensor([0xFF, 0x00], dtype=torch.uint8)  # position 255 in a chunk of 16
        with pytest.raises(PeerFailed):
            codec.decode(bad, 64)


@pytest.mark.parametrize("name,block", [("int8", 64), ("4bit", 3), ("4bit", 4096), ("e3m0", 5)])
def test_coding_piece_by_piece_gives_the_bytes_of_one_piece(monkeypatch, name, block):
    """Block codecs work on pieces of about PIECE_VALUES values (small temporaries): the payload and the
    decoded values are those of coding the whole vector at once, odd block sizes included."""
    from gossiploco.mixing import compression

    codec = build_codec(name, block=block)
    x = vec((1 << 18) * 2 + 7, 5)
    payload, decoded = codec.roundtrip(x)
    monkeypatch.setattr(compression, "PIECE_VALUES", 1 << 30)
    whole, whole_decoded = codec.roundtrip(x)
    assert torch.equal(payload, whole) and torch.equal(decoded, whole_decoded)
    into = torch.full((x.numel(),), float("nan"))
    assert codec.decode(payload, x.numel(), out=into) is into and torch.equal(into, decoded)
