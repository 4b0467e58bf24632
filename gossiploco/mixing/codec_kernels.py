"""The compressed codecs' loops, compiled (numba): each value comes from memory once, each byte is written once.

``mixing.compression`` owns the formats and the checks; these kernels are its inner loops, on numpy views of its
tensors. Written with torch operations, a block codec made several passes over memory (the absmax, the division,
the rounding, the conversion, the packing) and top-k a selection over each chunk: 0.5 to 5 ns a value on one thread
here (``bench/results/codecs.md``). Here a block's values come into cache once and every step runs while they are
there.

Arithmetic is the formats' exactly, in float32 (every constant is a float32 before it meets a value), so a kernel
sends the bytes the plain formulas give (``tests/test_compression.py`` holds those formulas) and decodes to the same
bits. Magnitudes are compared as the int32 bits of ``|x|``: for non-negative floats that order is the floats', and a
NaN's bits are above infinity's, so a NaN is the largest magnitude (as ``torch.amax`` and ``torch.topk`` have it):
its block's scale, or its chunk's high bound, is then not finite and ``decode`` refuses the payload, the sender's
own decode included.

Every kernel releases the GIL (``nogil``), so ``compression`` codes pieces of a long vector on several threads at
once. Kernels compile on first use (``Codec.prepare``: when the algorithm is built) and are cached on disk
(``cache=True``: ``__pycache__`` beside this file, or numba's per-user cache where that is read-only); this module
is imported only when a codec first runs.
"""

from __future__ import annotations

import numba
import numpy as np

F32 = np.float32
ABS_MASK = np.int32(0x7FFFFFFF)
MANTISSA = np.int32(0x7FFFFF)
HALF_MANTISSA = np.int32(0x400000)
SAMPLE_STRIDE = 16
"""Top-k reads a threshold for each chunk off every this-many-th magnitude of it."""
CROWDED = 8
"""A chunk with more than this many times ``k`` candidates (many equal magnitudes: zeros, say) is selected in full."""
GROUP_VALUES = 1 << 15
"""A block codec reads this many values' absmaxes in one stream (128 KB: they are still in cache for their codes)."""

kernel = numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")


# -- block codecs (int8, 4bit, e3m0) ------------------------------------------------------------------


@kernel
def _absmax_bits(bits):
    """The largest of ``bits & 0x7FFFFFFF`` (``bits``: float32 values' int32 bits; a NaN's are above all numbers')."""
    top = np.int32(0)
    for i in range(bits.size):
        top = max(top, bits[i] & ABS_MASK)
    return top


@kernel
def _round_codes(x, step, codes):
    """``codes[i] = round(x[i] / step)``, to nearest with ties to even, into int8 (it is in [-127, 127])."""
    for i in range(x.size):
        codes[i] = np.int32(np.rint(x[i] / step))


@kernel
def _e3m0_codes(x, scale, units, codes):
    """E3M0 codes of ``x / scale`` (values in [-1, 1]) less 8, into int8 (in [-8, 7]): the grid value nearest,
    halfway between two the lower, from the float's bits instead of a search.

    A value at or below 0 takes the negative side (0 is the midpoint between -2^-7 and 2^-7: the lower). For a
    magnitude a = (1 + f) 2^e (f from its 23 mantissa bits) the nearest power of two is 2^e, or 2^(e+1) when f > 1/2;
    at f = 1/2 (a tie) the lower value is the smaller magnitude for a positive value and the larger for a negative one,
    which is what the next float up from a gives with the positive rule. The exponent's code k = -e (or -e - 1) is
    clamped to 0..7 (everything below 2^-7 is 2^-7); the negative side's codes are k + 8. ``units``: float32 scratch,
    as long as ``x``."""
    for i in range(x.size):
        units[i] = x[i] / scale
    bits = units.view(np.int32)
    for i in range(x.size):
        negative = np.int32(units[i] <= F32(0.0))
        magnitude = (bits[i] & ABS_MASK) + negative
        k = np.int32(127) - (magnitude >> 23) - np.int32((magnitude & MANTISSA) > HALF_MANTISSA)
        codes[i] = min(max(k, np.int32(0)), np.int32(7)) + 8 * negative - 8


@kernel
def _pack_pairs(codes, offset, out):
    """``out[j] = (codes[2j] + offset) | (codes[2j + 1] + offset) << 4``: two 4-bit codes a byte, the first low."""
    for j in range(out.size):
        out[j] = np.uint8((codes[2 * j] + offset) | ((codes[2 * j + 1] + offset) << 4))


@kernel
def _round_offset_codes(x, step, codes):
    """8-bit codes: ``codes[i] = round(x[i] / step) + 127`` (to nearest, ties to even), as uint8."""
    for i in range(x.size):
        codes[i] = np.uint8(np.int32(np.rint(x[i] / step)) + np.int32(127))


@kernel
def block_encode(x, block, levels, scale_bits, scales, codes, work, units):
    """Encode ``x`` (float32, starting at a block's first value, and at an even value for 4-bit codes) block by block:
    each block's absmax into ``scales`` (``scale_bits`` is the same memory as int32) and its codes into ``codes``.
    ``levels``: 127 (int8: one code a byte), 7 (4bit: two a byte) or 0 (e3m0: two a byte). 4-bit codes pair values,
    not blocks' values (a block may be odd); an odd count's last byte has a high nibble of 0. ``work``: int8 scratch
    of ``x.size + 1`` values; ``units``: float32 scratch of ``block``."""
    bits = x.view(np.int32)
    n = x.size
    level = F32(levels)
    offset = 8 if levels == 0 else levels
    packed = 0  # values whose 4-bit codes are in ``codes`` (even, but at the end)
    blocks = (n + block - 1) // block
    group = max(1, GROUP_VALUES // block)
    for b in range(blocks):
        if b % group == 0:  # the absmaxes of a group of blocks in one stream from memory, then their codes from cache
            for g in range(b, min(blocks, b + group)):
                scale_bits[g] = _absmax_bits(bits[g * block:min(n, g * block + block)])
        start, end = b * block, min(n, b * block + block)
        scale = scales[b]
        step = scale / level if scale > F32(0.0) else F32(1.0)
        if levels == 127:
            _round_offset_codes(x[start:end], step, codes[start:end])
            continue
        if levels == 0:
            _e3m0_codes(x[start:end], scale if scale > F32(0.0) else F32(1.0), units[:end - start], work[start:end])
        else:
            _round_codes(x[start:end], step, work[start:end])
        if end == n and n % 2:
            work[n] = -offset  # the pad nibble: 0
            end += 1
        ready = end - end % 2
        _pack_pairs(work[packed:ready], offset, codes[packed // 2:ready // 2])
        packed = ready


@kernel
def bfloat16_finite(bits):
    """Whether no bfloat16 of ``bits`` (their uint16 bits) is a NaN or an infinity (all eight exponent bits set)."""
    bad = 0
    for i in range(bits.size):
        bad |= (np.int32(bits[i]) & 0x7F80) == 0x7F80
    return bad == 0


@kernel
def bfloat16_add(bits, scratch, acc):
    """``acc += float32(bfloat16)`` of ``bits`` (their uint16 bits): each widened exactly (its bits, shifted up 16)
    into ``scratch`` (int32; a piece of it at a time, in cache) and added from there (torch's mixed-type add: 1.8 ns a
    value here)."""
    widened = scratch.view(np.float32)
    for start in range(0, acc.size, scratch.size):
        end = min(acc.size, start + scratch.size)
        into, source = acc[start:end], bits[start:end]  # (indexing views vectorizes)
        for i in range(into.size):
            scratch[i] = np.int32(source[i]) << 16
        for i in range(into.size):
            into[i] += widened[i]


@kernel
def block_codes_valid(codes, levels, numel):
    """Whether every code of ``numel`` values is one an encoder makes: at most ``2 levels`` (int8, 4bit; e3m0's 16
    codes are all valid). The pad nibble of an odd 4-bit count is not read."""
    if levels == 0:
        return True
    worst = 0
    if levels == 127:
        for i in range(codes.size):
            worst = max(worst, np.int32(codes[i]))
        return worst <= 2 * levels
    whole = numel // 2
    for j in range(whole):
        byte = np.int32(codes[j])
        worst = max(worst, max(byte & 15, byte >> 4))
    if numel % 2:
        worst = max(worst, np.int32(codes[whole]) & 15)
    return worst <= 2 * levels


@kernel
def _decode_linear(codes, levels, step, out):
    """``out[i] = (codes[i] - levels) * step`` (8-bit codes)."""
    for i in range(out.size):
        out[i] = F32(np.int32(codes[i]) - levels) * step


@kernel
def _unpack_linear_pairs(codes, levels, out):
    """``out[2j] = low nibble - levels``, ``out[2j + 1] = high nibble - levels`` (as floats), for ``out.size // 2``
    bytes of ``codes``."""
    for j in range(out.size // 2):
        byte = np.int32(codes[j])
        out[2 * j] = F32((byte & 15) - levels)
        out[2 * j + 1] = F32((byte >> 4) - levels)


@kernel
def _e3m0_bits(code):
    """The float bits of E3M0 code ``code``'s unit value ``(-1)^(c >> 3) 2^-(c & 7)``: exponent ``127 - (c & 7)``,
    sign ``c >> 3``."""
    return ((np.int32(127) - (code & 7)) << 23) | ((code >> 3) << 31)


@kernel
def _decode_e3m0_pairs(codes, out):
    """E3M0's unit values of ``out.size // 2`` bytes of 4-bit codes, built as float bits, into ``out``."""
    bits = out.view(np.int32)
    for j in range(out.size // 2):
        byte = np.int32(codes[j])
        bits[2 * j] = _e3m0_bits(byte & 15)
        bits[2 * j + 1] = _e3m0_bits(byte >> 4)


@kernel
def _scale(values, scale):
    """``values *= scale``."""
    for i in range(values.size):
        values[i] *= scale


@kernel
def block_decode(scales, codes, block, levels, out):
    """Decode ``out.size`` values (starting at a block's first value, and at an even value for 4-bit codes) from each
    block's scale and its codes (checked by ``block_codes_valid``): ``(code - levels) * (scale / levels)`` (0 for a
    zero scale) on a linear grid, ``grid[code] * scale`` for e3m0 (``levels`` 0). 4-bit codes are unpacked into
    ``out`` first (codes pair values, not blocks' values: a block may be odd), as the grid's values, which are then
    scaled block by block."""
    n = out.size
    level = np.int32(levels)
    if levels == 127:
        for b in range((n + block - 1) // block):
            start, end = b * block, min(n, b * block + block)
            scale = scales[b]
            _decode_linear(codes[start:end], level, scale / F32(levels) if scale > F32(0.0) else F32(0.0),
                           out[start:end])
        return
    if levels == 0:
        _decode_e3m0_pairs(codes, out)
        if n % 2:
            out[n - 1:].view(np.int32)[0] = _e3m0_bits(np.int32(codes[n // 2]) & 15)
        for b in range((n + block - 1) // block):
            _scale(out[b * block:min(n, b * block + block)], scales[b])
        return
    _unpack_linear_pairs(codes, level, out)
    if n % 2:
        out[n - 1] = F32((np.int32(codes[n // 2]) & 15) - level)
    for b in range((n + block - 1) // block):
        scale = scales[b]
        _scale(out[b * block:min(n, b * block + block)], scale / F32(levels) if scale > F32(0.0) else F32(0.0))


@kernel
def block_decode_add(scales, codes, block, levels, scratch, acc):
    """``acc += block_decode(...)``: the piece decoded into ``scratch`` (``acc.size`` values, small enough to stay in
    cache) and added from there, so the decoded values never go to memory."""
    block_decode(scales, codes, block, levels, scratch)
    for i in range(acc.size):
        acc[i] += scratch[i]


# -- top-k ------------------------------------------------------------------------------------------------


@kernel
def _kth_largest(values, count, k):
    """The ``k``-th largest of ``values[:count]`` (``1 <= k <= count``), reordering them: quickselect with a
    three-way partition, so that a run of equal values costs one pass, not one pass per value."""
    lo, hi, target = 0, count - 1, k - 1
    while lo < hi:
        a, b, c = values[lo], values[(lo + hi) // 2], values[hi]
        pivot = max(min(a, b), min(max(a, b), c))  # the median of three
        above, i, below = lo, lo, hi  # [lo, above): > pivot; [above, i): == pivot; (below, hi]: < pivot
        while i <= below:
            value = values[i]
            if value > pivot:
                values[i], values[above] = values[above], value
                above += 1
                i += 1
            elif value < pivot:
                values[i], values[below] = values[below], value
                below -= 1
            else:
                i += 1
        if target < above:
            hi = above - 1
        elif target > below:
            lo = below + 1
        else:
            return pivot
    return values[lo]


@kernel
def select_row(row_bits, k, candidates, columns, scratch, positions):
    """The columns of the ``k`` largest magnitudes of one chunk (``row_bits``: its values' int32 bits), ascending, into
    ``positions``; returns (the k-th largest's bits, the largest's). Exact, as a full selection is, but with one
    comparison a value for most of the chunk: a threshold read off a strided sample (its ``2 k / SAMPLE_STRIDE +
    1``-th largest sampled magnitude: about twice the k-th of the chunk) picks the candidates, among which the k-th
    largest is found. A chunk with fewer candidates than ``k`` (the sample said too little) or far more (many equal
    magnitudes) is selected in full. Which of several magnitudes equal to the k-th largest are kept: the first."""
    width = row_bits.size
    count = 0
    if width >= 64 * SAMPLE_STRIDE and 4 * k <= width:
        samples = 0
        for i in range(0, width, SAMPLE_STRIDE):
            scratch[samples] = row_bits[i] & ABS_MASK
            samples += 1
        threshold = _kth_largest(scratch, samples, 2 * k // SAMPLE_STRIDE + 1)
        for i in range(width):
            magnitude = row_bits[i] & ABS_MASK
            if magnitude >= threshold:
                if count < CROWDED * k:
                    candidates[count] = magnitude
                    columns[count] = i
                count += 1
    if count < k or count > CROWDED * k:
        count = width
        for i in range(width):
            candidates[i] = row_bits[i] & ABS_MASK
            columns[i] = i
    top = np.int32(0)
    for i in range(count):
        scratch[i] = candidates[i]
        top = max(top, candidates[i])
    kth = _kth_largest(scratch, count, k)
    ties = k
    for i in range(count):
        if candidates[i] > kth:
            ties -= 1
    kept = 0
    for i in range(count):
        magnitude = candidates[i]
        if magnitude > kth or (magnitude == kth and ties > 0):
            if magnitude == kth:
                ties -= 1
            positions[kept] = columns[i]
            kept += 1
    return kth, top


@kernel
def topk_encode(x, numel, chunk, k, bits, first_code, bound_bits, bounds, positions, packed, padded, candidates,
                columns, scratch, kept):
    """Encode the chunks of ``x`` (its first ``numel`` values; the last chunk may be cut, and is zero-padded): each
    chunk's k largest magnitudes' columns (ascending) into ``positions`` (``k`` a chunk), their low and high
    magnitude into ``bounds`` (two a chunk; ``bound_bits`` is the same memory as int32), and their ``bits``-bit codes
    (bit 0 the sign, the rest the level: the bin of ``levels`` equal bins from low to high) ORed into ``packed``
    (zeroed by the caller) from code ``first_code`` of the payload on, ``8 / bits`` a byte, lowest bits first.
    Scratch: ``padded`` (float32, ``chunk``), ``candidates``, ``columns``, ``scratch`` (int32, ``chunk``) and ``kept``
    (``k``)."""
    levels = 1 << (bits - 1)
    level = F32(levels)
    per_byte = 8 // bits
    for c in range((numel + chunk - 1) // chunk):
        start, end = c * chunk, min(numel, c * chunk + chunk)
        row = x[start:end]
        if end - start < chunk:
            padded[:] = 0.0
            padded[:end - start] = row
            row = padded
        low_bits, high_bits = select_row(row.view(np.int32), k, candidates, columns, scratch, kept)
        bound_bits[2 * c] = low_bits
        bound_bits[2 * c + 1] = high_bits
        low, high = bounds[2 * c], bounds[2 * c + 1]
        span = high - low if high > low else F32(1.0)
        for j in range(k):
            column = kept[j]
            positions[c * k + j] = column
            value = row[column]
            bin_ = np.floor((abs(value) - low) / span * level)
            code = (np.int32(min(max(bin_, F32(0.0)), level - F32(1.0))) << 1) | np.int32(value < F32(0.0))
            index = first_code + c * k + j
            packed[index // per_byte] |= np.uint8(code << ((index % per_byte) * bits))


@kernel
def topk_positions_valid(positions, chunk, k):
    """Whether every chunk's ``k`` positions (uint16) are inside it and strictly ascending."""
    for c in range(positions.size // k):
        previous = -1
        for j in range(k):
            position = np.int32(positions[c * k + j])
            if position >= chunk or position <= previous:
                return False
            previous = position
    return True


@kernel
def topk_decode(bounds, positions, packed, chunk, k, bits, first_code, out):
    """Decode ``out.size`` values (from a chunk's first value on; the last chunk may be cut) from the chunks' bounds,
    positions (checked by ``topk_positions_valid``) and codes (from code ``first_code`` of the payload on): zeros but
    at the positions, where the value is ``±(low + (high - low) (level + 1/2) / levels)``. ``bits`` is 1, 2, 4 or 8,
    so a code's byte and place in it are shifts and masks (a division by a variable costs tens of cycles a value)
    and ``/ levels`` is ``* (1 / levels)``, the same float32 since ``levels`` is a power of two."""
    shift = 3 if bits == 1 else 2 if bits == 2 else 1 if bits == 4 else 0  # log2 of the codes a byte holds
    slot, mask = (1 << shift) - 1, (1 << bits) - 1
    per_level = F32(1.0) / F32(1 << (bits - 1))
    numel = out.size
    for c in range((numel + chunk - 1) // chunk):
        start, end = c * chunk, min(numel, c * chunk + chunk)
        out[start:end] = 0.0
        low, high = bounds[2 * c], bounds[2 * c + 1]
        for j in range(k):
            column = np.int32(positions[c * k + j])
            if start + column < end:
                index = first_code + c * k + j
                code = (np.int32(packed[index >> shift]) >> ((index & slot) * bits)) & mask
                fraction = (F32(code >> 1) + F32(0.5)) * per_level
                magnitude = low + (high - low) * fraction
                out[start + column] = -magnitude if code & 1 else magnitude


@kernel
def topk_decode_add(bounds, positions, packed, chunk, k, bits, first_code, scratch, acc):
    """``acc += topk_decode(...)``: each chunk decoded into ``scratch`` (``chunk`` values: in cache) and added from
    there, one stream over ``acc``."""
    numel = acc.size
    for c in range((numel + chunk - 1) // chunk):
        start, end = c * chunk, min(numel, c * chunk + chunk)
        part, into = scratch[:end - start], acc[start:end]  # (indexing a view vectorizes; acc[start + i] did not)
        topk_decode(bounds[2 * c:2 * c + 2], positions[c * k:c * k + k], packed, chunk, k, bits, first_code + c * k,
                    part)
        for i in range(into.size):
            into[i] += part[i]
