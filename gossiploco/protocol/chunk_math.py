"""A collective's arithmetic on one chunk (add, divide, copy), on the calling thread alone.

torch runs an elementwise op over a chunk of a few MiB on a team of OpenMP threads, one per core, and the team's
threads then spin, waiting for the next op: a receiving thread that reduces each chunk as it arrives kept every
core busy between chunks. Measured here (2 cores, 2 peers, `bench/allreduce.py --threads 2`, torch's default for
this machine and what a peer runs): a 100 MB all-reduce took 0.166 s and 0.14 s of CPU a peer, 0.069 s and 0.05 s
through numpy (``bench/results/chunk-math.md``). So these go through numpy, which runs them on the calling
thread with the GIL released, bit for bit what torch computes (IEEE addition and division, element by element).
A tensor numpy cannot view (bfloat16, or not on the CPU) goes through torch.
"""

from __future__ import annotations

import numpy as np
import torch


def _array(tensor: torch.Tensor) -> np.ndarray | None:
    """``tensor``'s memory as a numpy array, or None where numpy cannot view it."""
    if tensor.device.type != "cpu" or tensor.dtype == torch.bfloat16 or tensor.requires_grad:
        return None
    return tensor.numpy()


def add_(into: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``into += values``; returns ``into``."""
    a, b = _array(into), _array(values)
    if a is None or b is None or a.dtype != b.dtype:
        return into.add_(values)
    np.add(a, b, out=a)
    return into


def div_(into: torch.Tensor, divisor: int | float) -> torch.Tensor:
    """``into /= divisor``; returns ``into``."""
    a = _array(into)
    if a is None:
        return into.div_(divisor)
    np.divide(a, a.dtype.type(divisor), out=a)
    return into


def copy_(into: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``into[:] = values`` (same shape); returns ``into``."""
    a, b = _array(into), _array(values)
    if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
        return into.copy_(values)
    np.copyto(a, b)
    return into
