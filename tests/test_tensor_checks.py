"""``tensor_checks.all_finite``: the compiled check of large float32 vectors agrees with numpy's ``isfinite`` on
every class of bit pattern (NaNs with any payload and sign, both infinities, the extremes of the finite range)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossiploco.tensor_checks import COMPILED_MIN, all_finite


def _finite_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random float32 bit patterns whose exponent is never all ones: every finite value, subnormals and -0 included."""
    bits = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    exponent_all_ones = (bits & 0x7F800000) == 0x7F800000
    bits[exponent_all_ones] &= np.uint32(0xFF7FFFFF)  # clear the exponent's lowest bit: finite
    return bits


@pytest.mark.parametrize("n", [COMPILED_MIN - 1, COMPILED_MIN, 3 * COMPILED_MIN + 7])
def test_the_check_agrees_with_numpy_on_every_kind_of_value(n):
    rng = np.random.default_rng(n)
    for trial in range(40):
        bits = _finite_bits(rng, n)
        values = bits.view(np.float32)
        assert all_finite(torch.from_numpy(values)) and np.isfinite(values).all()
        bad = np.uint32(0x7F800000) | np.uint32(rng.integers(0, 1 << 23)) * np.uint32(trial % 2)  # inf or a NaN
        bad |= np.uint32(0x80000000) * np.uint32(rng.integers(0, 2))  # either sign
        bits[rng.integers(0, n)] = bad
        assert not all_finite(torch.from_numpy(bits.view(np.float32))), hex(int(bad))
    extremes = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, np.finfo(np.float32).smallest_subnormal,
                         -0.0], dtype=np.float32)
    assert all_finite(torch.from_numpy(np.resize(extremes, n)))


def test_a_view_that_is_not_contiguous_is_checked_whole():
    values = torch.zeros(4 * COMPILED_MIN)
    values[1] = float("nan")
    assert not all_finite(values[1::2]) and all_finite(values[::2])
