"""Codecs for compressed exchanges: a flat fp32 vector to bytes and back.

Every codec maps ``numel`` values to exactly ``encoded_bytes(numel)`` bytes (a uint8 vector), so
both sides of an exchange know the size of what they will receive, and ``decode`` checks a payload
from the network before using it (a wrong size, a non-finite or negative scale, an index out of its
chunk: ``PeerFailed``). Decoding is exact arithmetic on what was sent: ``decode(encode(x))`` is the
value every receiver reconstructs, so the sender uses it too (for its own share of a mean and for
its error feedback) and every member of an exchange ends with the same bits.

* ``none``: the fp32 bytes (4 bytes a value).
* ``bf16``: round to nearest even bfloat16 (2 bytes a value).
* ``int8``: blockwise absmax: each block of ``block`` values gets one fp32 scale ``max |x| / 127``
  and values ``round(x / scale)`` in [-127, 127] (8 + 32 / block bits a value).
* ``4bit``: blockwise linear int4: scale ``max |x| / 7``, values in [-7, 7] (4 + 32 / block bits).
* ``e3m0``: Streaming DiLoCo's 4-bit float (a sign and a 3-bit exponent, no mantissa): magnitudes
  ``scale * 2^-k``, k = 0..7, rounded to the nearest, with a blockwise absmax scale. It has no zero:
  tiny values become ``scale / 128``. ``tests/test_compression.py`` measures both 4-bit formats: on
  the pseudo-gradients this trainer exchanges (sums of AdamW updates, flatter than a Gaussian) the
  linear grid loses a third of E3M0's error, so ``4bit`` means it; E3M0 wins on heavy tails.
* ``topk``: SparseLoCo's chunk-wise top-k. Each chunk of ``chunk`` values keeps its
  ``k = ceil(density * chunk)`` largest magnitudes: their positions (uint16) and ``bits``-bit values
  (default 2: a sign and one of ``2^(bits-1)`` magnitudes evenly spread between the chunk's k-th
  largest and largest magnitude, whose two fp32 bounds go with it); the rest are zero. About
  ``2 + bits / 8 + 8 / k`` bytes per kept value: 2% density in chunks of 4096 is 85x fewer bytes.

Rounding is deterministic (to nearest), so two peers encoding the same vector send the same bytes.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod

import torch

from gossiploco.errors import PeerFailed
from gossiploco.tensor_checks import all_finite

COMPRESSIONS = ("none", "bf16", "int8", "4bit", "e3m0", "topk")
LITTLE_ENDIAN = sys.byteorder == "little"
PIECE_VALUES = 1 << 18
"""Values a block codec encodes or decodes at a time (1 MB of fp32)."""


class Codec(ABC):
    """A lossy (or lossless) map from an fp32 vector to a fixed number of bytes."""

    name: str

    @abstractmethod
    def encoded_bytes(self, numel: int) -> int:
        """Bytes ``encode`` makes of ``numel`` values (every peer computes the same)."""

    @abstractmethod
    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The uint8 payload of the fp32 CPU vector ``flat``."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 vector of ``numel`` values ``payload`` holds (written into ``out`` when given, and
        returned); ``PeerFailed`` for a payload no encoder makes."""

    def roundtrip(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(payload, decode(payload))``: what is sent and what every receiver makes of it."""
        payload = self.encode(flat)
        return payload, self.decode(payload, flat.numel())

    def _check_size(self, payload: torch.Tensor, numel: int) -> None:
        expected = self.encoded_bytes(numel)
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
            raise PeerFailed(f"{self.name} payload of {payload.numel()} {payload.dtype} values for {numel} values; "
                             f"expected {expected} bytes")


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class Float32Codec(Codec):
    name = "none"

    def encoded_bytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, flat):
        return _as_bytes(flat.to(torch.float32)).clone()

    def decode(self, payload, numel, out=None):
        self._check_size(payload, numel)
        values = payload.view(torch.float32)
        _check_finite(values, self.name)
        return values.clone() if out is None else out.copy_(values)


class BFloat16Codec(Codec):
    name = "bf16"

    def encoded_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, flat):
        return _as_bytes(flat.to(torch.bfloat16))

    def decode(self, payload, numel, out=None):
        self._check_size(payload, numel)
        values = payload.view(torch.bfloat16)
        out = values.to(torch.float32) if out is None else out.copy_(values)
        _check_finite(out, self.name)  # on the fp32 values: a bfloat16 NaN or Inf stays one
        return out


def _pad(values: torch.Tensor, size: int) -> torch.Tensor:
    """``values`` with zeros appended up to ``size`` (itself when it has that size already: no copy)."""
    return values if values.numel() == size else torch.nn.functional.pad(values, (0, size - values.numel()))


def _check_finite(values: torch.Tensor, what: str) -> None:
    if not all_finite(values):
        raise PeerFailed(f"{what} payload holds NaN or Inf")


class BlockCodec(Codec):
    """Blockwise absmax quantization onto a symmetric grid (``int8``, ``4bit``, ``e3m0``).

    Payload: ``ceil(numel / block)`` fp32 scales, then the codes (one byte each, or two 4-bit codes a
    byte, low nibble first). A block's values are ``scale * grid[code]``."""

    def __init__(self, name: str, block: int):
        if block < 1:
            raise ValueError(f"block size must be at least 1, got {block}")
        self.name, self.block = name, block
        if name == "int8":
            self.bits, self.levels = 8, 127
        elif name == "4bit":
            self.bits, self.levels = 4, 7
        elif name == "e3m0":
            self.bits, self.levels = 4, 0
            # codes 0..7: +2^-k; 8..15: -2^-k (sign bit, 3-bit exponent, no mantissa); ``_e3m0_codes`` and
            # ``decode`` work on the floats' bits rather than on this table
            magnitudes = torch.tensor([2.0 ** -k for k in range(8)])
            self.grid = torch.cat([magnitudes, -magnitudes])
        else:
            raise ValueError(f"unknown block codec {name!r}")

    def _blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def _code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def encoded_bytes(self, numel: int) -> int:
        return 4 * self._blocks(numel) + self._code_bytes(numel)

    def _pieces(self, numel: int) -> list[tuple[int, int]]:
        """Value ranges of about ``PIECE_VALUES`` (whole blocks, an even count), coded one at a time: the
        temporaries stay small and in cache instead of several vector-sized ones."""
        step = max(1, PIECE_VALUES // self.block) * self.block
        step *= 1 + step % 2  # 4-bit codes pair values: every piece but the last holds an even count
        return [(s, min(s + step, numel)) for s in range(0, numel, step)]

    def _code_range(self, start: int, end: int) -> slice:
        return slice(start, end) if self.bits == 8 else slice(start // 2, (end + 1) // 2)

    def encode(self, flat):
        flat = flat.detach().reshape(-1).to(torch.float32)
        numel, nb = flat.numel(), self._blocks(flat.numel())
        payload = torch.empty(self.encoded_bytes(numel), dtype=torch.uint8)
        scales, codes_out = payload[:4 * nb].view(torch.float32), payload[4 * nb:]
        pieces = self._pieces(numel)
        room = max(end - start for start, end in pieces) if pieces else 0
        room = self._blocks(room) * self.block + 1  # whole blocks, and one more code for an odd 4-bit count
        work, sums = torch.empty(room), torch.empty((room + 1) // 2)  # reused by every piece
        for start, end in pieces:
            n, first = end - start, start // self.block
            blocks = self._blocks(n)
            padded = _pad(flat[start:end], blocks * self.block).view(blocks, self.block)
            # max |x| without writing |x|: the larger of the block's max and -min (abs_: +0.0 for a block of zeros)
            scale = torch.maximum(padded.amax(dim=1), padded.amin(dim=1).neg_()).abs_()
            scales[first:first + blocks] = scale
            unit = work[:blocks * self.block].view(blocks, self.block)
            if self.levels:  # a linear grid: code = round(x / step) + levels, step = absmax / levels
                step = torch.where(scale > 0, scale / self.levels, torch.ones_like(scale))
                torch.div(padded, step[:, None], out=unit).round_()  # |x / step| <= levels: nothing to clamp
                into = codes_out[self._code_range(start, end)].view(torch.int8)  # written in the payload directly
                if self.bits == 4:
                    self._linear_pairs(work, n, into, sums)  # ``work``: ``unit`` and a spare for an odd count
                else:
                    self._linear_codes(unit.view(-1)[:n], into)
            else:  # a table: the nearest grid value (halfway between two: the lower)
                torch.div(padded, torch.where(scale > 0, scale, torch.ones_like(scale))[:, None], out=unit)
                codes = self._e3m0_codes(unit.view(-1)[:n])
                if n % 2:
                    codes = torch.nn.functional.pad(codes, (0, 1))
                codes_out[self._code_range(start, end)] = _pack_nibbles(codes)
        return payload

    def _linear_codes(self, rounded: torch.Tensor, into: torch.Tensor) -> None:
        """8-bit codes ``rounded + levels`` of integral values in [-levels, levels], written into ``into`` (int8, as
        long): converted to int8 (a fast conversion; uint8 is several times slower from fp32) and offset in 8-bit
        arithmetic, which wraps modulo 256 (-127 + 127 as uint8: 129 + 127 = 0)."""
        into.copy_(rounded)
        into.view(torch.uint8).add_(self.levels)

    def _linear_pairs(self, rounded: torch.Tensor, n: int, into: torch.Tensor, sums: torch.Tensor) -> None:
        """The bytes of ``n`` 4-bit codes ``rounded + levels`` (integral values in [-levels, levels], at least ``n + 1``
        of them: a spare for an odd count), two a byte, the first in the low nibble, built in one pass over pairs of
        floats: ``a + 16 b`` is in [-17 levels, 17 levels], an int8, and adding ``17 levels`` in 8-bit arithmetic
        (which wraps modulo 256) gives ``(a + levels) + 16 (b + levels)``. An odd count's last byte has a high
        nibble of 0 (its spare is set to ``-levels``). Written into ``into`` (int8, ``ceil(n / 2)`` long); ``sums``: a
        float buffer at least as long, reused."""
        if n % 2:
            rounded[n] = -self.levels
        pairs = rounded[:n + n % 2].view(-1, 2)
        into.copy_(torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=sums[:into.numel()]))
        into.view(torch.uint8).add_(17 * self.levels)

    def _e3m0_codes(self, unit: torch.Tensor) -> torch.Tensor:
        """E3M0 codes of ``unit`` (values in [-1, 1]): the grid value nearest, halfway between two the lower, as
        ``bucketize`` onto the sorted grid's midpoints gives, from the float's bits instead of a search.

        A value at or below 0 takes the negative side (0 is the midpoint between -2^-7 and 2^-7: the lower).
        For a magnitude a = (1 + f) 2^e (f from its 23 mantissa bits) the nearest power of two is 2^e, or 2^(e+1)
        when f > 1/2; at f = 1/2 (a tie) the lower value is the smaller magnitude for a positive value and the
        larger for a negative one, which is what the next float up from a gives with the positive rule. The
        exponent's code k = -e (or -e - 1) is clamped to 0..7 (everything below 2^-7 is 2^-7)."""
        negative = unit <= 0
        # the next float up from a magnitude is its bit pattern plus one (0 becomes the smallest subnormal)
        bits = unit.abs().view(torch.int32).add_(negative.to(torch.int32))
        k = (bits >> 23).neg_().add_(127).sub_(((bits & 0x7FFFFF) > 0x400000).to(torch.int32)).clamp_(0, 7)
        return k.to(torch.uint8).add_(negative.to(torch.uint8).mul_(8))  # codes 8..15: the negative side

    def decode(self, payload, numel, out=None):
        self._check_size(payload, numel)
        nb = self._blocks(numel)
        scales = payload[:4 * nb].clone().view(torch.float32)
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise PeerFailed(f"{self.name} payload has a negative or non-finite block scale")
        steps = torch.where(scales > 0, scales / self.levels, torch.zeros_like(scales)) if self.levels else scales
        codes_in = payload[4 * nb:]
        if self.levels and codes_in.numel() and self.bits == 8 and int(codes_in.max()) > 2 * self.levels:
            raise PeerFailed(f"{self.name} payload has a code outside [0, {2 * self.levels}]")
        out = torch.empty(numel, dtype=torch.float32) if out is None else out
        for start, end in self._pieces(numel):
            n, first = end - start, start // self.block
            blocks = self._blocks(n)
            codes = codes_in[self._code_range(start, end)]
            if self.levels and self.bits == 4:
                self._decode_linear_pairs(codes, n, out[start:end], steps[first:first + blocks])
                continue
            if self.bits == 4:  # E3M0: every 4-bit code is a grid value
                codes = _unpack_nibbles(codes)[:n]
            if self.levels:
                unit = codes.to(torch.float32).sub_(self.levels)
            else:  # code c: (-1)^(c >> 3) 2^-(c & 7), its float's bits built directly (the grid, exactly)
                wide = codes.to(torch.int32)
                unit = (wide & 7).neg_().add_(127).bitwise_left_shift_(23).bitwise_or_(
                    (wide >> 3).bitwise_left_shift_(31)).view(torch.float32)
            piece_steps = steps[first:first + blocks, None]
            if n == blocks * self.block:  # whole blocks: straight into ``out``
                torch.mul(unit.view(blocks, self.block), piece_steps, out=out[start:end].view(blocks, self.block))
            else:
                out[start:end] = _pad(unit, blocks * self.block).view(blocks, self.block).mul_(piece_steps).reshape(-1)[:n]
        return out


    def _decode_linear_pairs(self, packed: torch.Tensor, n: int, out: torch.Tensor, steps: torch.Tensor) -> None:
        """``n`` values of 4-bit linear codes (``packed``: two a byte, low nibble first) into ``out``: each nibble
        less ``levels`` in 8-bit arithmetic (exact), converted straight into its place (the low nibbles to the even
        positions, the high to the odd), then multiplied by its block's step in place. ``PeerFailed`` for a code
        above ``2 levels`` (the pad nibble of an odd count is not read)."""
        low = torch.bitwise_and(packed, 0x0F).view(torch.int8).sub_(self.levels)
        high = torch.bitwise_right_shift(packed, 4).view(torch.int8).sub_(self.levels)[:n // 2]
        if int(low.max()) > self.levels or (high.numel() and int(high.max()) > self.levels):
            raise PeerFailed(f"{self.name} payload has a code outside [0, {2 * self.levels}]")
        out[0::2].copy_(low)
        out[1::2].copy_(high)
        whole = n // self.block
        if whole:
            out[:whole * self.block].view(whole, self.block).mul_(steps[:whole, None])
        if whole * self.block < n:
            out[whole * self.block:].mul_(steps[whole])


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pairs of 4-bit codes (uint8 values 0..15, an even count) into one byte each, the first in the low nibble.
    On a little-endian machine a pair is one int16 (the first code its low byte): two shifts and masks on half as
    many elements, instead of two strided gathers."""
    if LITTLE_ENDIAN:
        pairs = codes.view(torch.int16)
        return ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).to(torch.uint8)
    return codes[0::2] | (codes[1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``_pack_nibbles`` undone: two uint8 codes per byte, the low nibble first."""
    if LITTLE_ENDIAN:
        wide = packed.to(torch.int16)
        return ((wide & 0x0F) | ((wide << 4) & 0x0F00)).view(torch.uint8)
    return torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)


TOPK_BITS = (1, 2, 4, 8)


SAMPLE_STRIDE = 16
"""``largest`` estimates each row's threshold from every this-many-th value."""


def largest(magnitudes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest values and their columns (in no order): ``magnitudes.topk(k, dim=1)``, exactly, but
    without a full selection over every row (``torch.topk`` costs about 8-13 ns a value here, most of top-k's encode).

    A threshold per row is read off a strided sample (its ``2 k / SAMPLE_STRIDE + 1``-th largest sampled value: about
    twice the k-th of the row), every value not below it is a candidate (one comparison a value), and the k largest
    candidates are selected among a few ``k``. That is exact whenever a row has at least ``k`` candidates, since then its
    k-th largest value is one of them; a row with fewer, or with far more (many equal values: zeros, say), is selected
    in full. A NaN is never below the threshold, so it is kept as ``topk`` keeps it. Which of several values equal to
    the k-th largest are kept is not specified, as with ``topk``."""
    rows, width = magnitudes.shape
    if width < 64 * SAMPLE_STRIDE or 4 * k > width or rows == 0:  # small or dense rows: the sample says too little
        top = magnitudes.topk(k, dim=1, sorted=False)
        return top.values, top.indices
    magnitudes = magnitudes.contiguous()
    picks = 2 * k // SAMPLE_STRIDE + 1
    threshold = magnitudes[:, ::SAMPLE_STRIDE].topk(picks, dim=1).values[:, -1:]
    candidate = torch.lt(magnitudes, threshold).logical_not_()
    flat = candidate.view(-1).nonzero().view(-1)  # ascending: each row's candidates together, in column order
    row = flat.div(width, rounding_mode="floor")
    counts = torch.bincount(row, minlength=rows)
    crowded = counts > 8 * k  # a row of many equal values: selected in full, its candidates left out of the pool
    if bool(crowded.any()):
        keep = ~crowded[row]
        flat, row = flat[keep], row[keep]
        counts = counts * ~crowded
    column = flat - row * width
    pool_width = max(int(counts.max()), k)
    # each candidate's place in its row of the pool: its rank among its row's candidates
    place = row * pool_width + torch.arange(row.numel()) - (torch.cumsum(counts, 0) - counts)[row]
    pool = torch.full((rows * pool_width,), -math.inf)  # -inf: a padded slot is never among the k largest
    pool_columns = torch.zeros(rows * pool_width, dtype=torch.int64)
    pool[place] = magnitudes.view(-1)[flat]
    pool_columns[place] = column
    top = pool.view(rows, pool_width).topk(k, dim=1, sorted=False)
    values, columns = top.values, pool_columns.view(rows, pool_width).gather(1, top.indices)
    rest = ((counts < k) | crowded).nonzero(as_tuple=True)[0]  # too few candidates (or left out): in full
    if rest.numel():
        full = magnitudes[rest].topk(k, dim=1, sorted=False)
        values[rest], columns[rest] = full.values, full.indices
    return values, columns


class TopKCodec(Codec):
    """Chunk-wise top-k with ``bits``-bit values (module docstring). Payload: per chunk two fp32
    bounds (low, high magnitude), then every chunk's ``k`` uint16 positions (ascending), then their
    codes packed ``8 / bits`` a byte, lowest bits first (bit 0 the sign, the rest the magnitude's level)."""

    name = "topk"

    def __init__(self, density: float, chunk: int, bits: int = 2):
        if not 0 < density <= 1:
            raise ValueError(f"top-k density must be in (0, 1], got {density}")
        if not 1 <= chunk <= 1 << 16:
            raise ValueError(f"top-k chunk must be 1 to 65536 values (uint16 positions), got {chunk}")
        if bits not in TOPK_BITS:
            raise ValueError(f"top-k value width must be one of {TOPK_BITS} bits, got {bits}")
        self.density, self.chunk, self.bits = density, chunk, bits
        self.levels = 1 << (bits - 1)
        """Magnitudes a kept value may take."""

    def _shape(self, numel: int) -> tuple[int, int]:
        """(chunks, kept values per chunk); the last chunk is zero-padded to ``chunk`` values."""
        return math.ceil(numel / self.chunk), min(self.chunk, math.ceil(self.density * self.chunk))

    def encoded_bytes(self, numel: int) -> int:
        n, k = self._shape(numel)
        per_byte = 8 // self.bits
        return 8 * n + 2 * n * k + (n * k + per_byte - 1) // per_byte

    def encode(self, flat):
        flat = flat.detach().reshape(-1).to(torch.float32)
        n, k = self._shape(flat.numel())
        # A piece of rows at a time (a few MB): the magnitudes and masks stay in cache and their memory is reused,
        # where whole-vector temporaries cost a page fault per 4 KiB (half the encode at 16M values)
        rows = max(1, 4 * PIECE_VALUES // self.chunk)
        pieces = []
        for first in range(0, n, rows):
            last = min(n, first + rows)
            piece = flat[first * self.chunk:last * self.chunk]
            if piece.numel() < (last - first) * self.chunk:  # the last chunk, cut: zero-padded
                piece = torch.nn.functional.pad(piece, (0, (last - first) * self.chunk - piece.numel()))
            piece = piece.view(last - first, self.chunk)
            magnitudes, positions = largest(piece.abs(), k)
            positions = positions.sort(dim=1).values  # ascending: a canonical order
            pieces.append((magnitudes, positions, piece.gather(1, positions)))
        magnitudes, positions, values = (torch.cat(parts) for parts in zip(*pieces))
        low, high = magnitudes.amin(dim=1), magnitudes.amax(dim=1)
        # the levels are the midpoints of ``levels`` equal bins of [low, high]: the nearest is the bin's
        span = torch.where(high > low, high - low, torch.ones_like(high))
        level = ((values.abs() - low[:, None]) / span[:, None] * self.levels).floor().clamp_(0, self.levels - 1)
        codes = ((values < 0).to(torch.uint8) | (level.to(torch.uint8) << 1)).reshape(-1)
        per_byte = 8 // self.bits
        codes = torch.nn.functional.pad(codes, (0, (-codes.numel()) % per_byte)).view(-1, per_byte)
        packed = torch.zeros(codes.shape[0], dtype=torch.uint8)
        for j in range(per_byte):
            packed |= codes[:, j] << (j * self.bits)
        bounds = torch.stack([low, high], dim=1)
        return torch.cat([_as_bytes(bounds), _as_bytes(positions.to(torch.int16)), packed])

    def _magnitudes(self, bounds: torch.Tensor) -> torch.Tensor:
        """Each chunk's ``levels`` magnitudes: the midpoints of equal bins from its low to its high bound."""
        steps = (torch.arange(self.levels, dtype=torch.float32) + 0.5) / self.levels
        return bounds[:, 0:1] + (bounds[:, 1:2] - bounds[:, 0:1]) * steps

    def decode(self, payload, numel, out=None):
        self._check_size(payload, numel)
        n, k = self._shape(numel)
        bounds = payload[:8 * n].clone().view(torch.float32).view(n, 2)
        if not bool((torch.isfinite(bounds) & (bounds >= 0)).all()) or bool((bounds[:, 0] > bounds[:, 1]).any()):
            raise PeerFailed("topk payload has bad magnitude bounds (negative, non-finite or low above high)")
        positions = payload[8 * n:8 * n + 2 * n * k].clone().view(torch.int16).view(n, k).to(torch.int64) & 0xFFFF
        if bool((positions >= self.chunk).any()) or (k > 1 and bool((positions[:, 1:] <= positions[:, :-1]).any())):
            raise PeerFailed("topk payload has positions out of order or outside their chunk")
        packed = payload[8 * n + 2 * n * k:]
        mask = (1 << self.bits) - 1
        codes = torch.stack([(packed >> (j * self.bits)) & mask for j in range(8 // self.bits)], dim=1)
        codes = codes.reshape(-1)[:n * k].view(n, k)
        magnitude = self._magnitudes(bounds).gather(1, (codes >> 1).long())
        values = torch.where((codes & 1).bool(), -magnitude, magnitude)
        # straight into ``out``: zeroing memory already in use costs a fraction of a fresh zeroed chunk matrix
        out = torch.zeros(numel, dtype=torch.float32) if out is None else out.zero_()
        full = numel // self.chunk  # chunks wholly inside the vector; the last may be cut (zero-padded when encoded)
        if full:
            out[:full * self.chunk].view(full, self.chunk).scatter_(1, positions[:full], values[:full])
        if full < n:
            last = torch.zeros(self.chunk, dtype=torch.float32).scatter_(0, positions[full], values[full])
            out[full * self.chunk:] = last[:numel - full * self.chunk]
        return out


def build_codec(name: str, *, block: int = 4096, density: float = 0.02, chunk: int = 4096, bits: int = 2) -> Codec:
    """The codec a mix's ``compression`` setting names (``block`` for int8/4bit/e3m0; ``density``,
    ``chunk`` and ``bits`` for topk)."""
    if name == "none":
        return Float32Codec()
    if name == "bf16":
        return BFloat16Codec()
    if name in ("int8", "4bit", "e3m0"):
        return BlockCodec(name, block)
    if name == "topk":
        return TopKCodec(density, chunk, bits)
    raise ValueError(f"unknown compression {name!r}; choose one of {COMPRESSIONS}")
