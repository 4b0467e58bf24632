"""Packing the mixed parameters of one or more state dicts into one flat fp32 vector, and back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

TensorDict = dict[str, torch.Tensor]


def pack(dicts: Sequence[TensorDict], names: Sequence[str],
         new: Callable[[int, torch.device | None], torch.Tensor] | None = None) -> torch.Tensor:
    """The selected entries of every dict, flattened into one fp32 CPU vector, made by ``new(numel, gpu)`` when
    given (``Exchange.vector``: shared memory where the exchange is in another process; ``gpu`` is the GPU the
    entries are on, or None).

    Entries may live on a GPU (the outer state, gossiploco.outer_state): they are copied straight into
    one page-locked vector on the current CUDA stream (DMA, no staging copy), which is waited for once;
    mixing in place in it and copying the result back to the GPU are then asynchronous too."""
    parts = [d[n].detach().reshape(-1) for d in dicts for n in names]
    if not parts:
        return torch.empty(0)
    gpu = next((p.device for p in parts if p.device.type == "cuda"), None)
    numel = sum(p.numel() for p in parts)
    flat = (new or host_vector)(numel, gpu)
    offset = 0
    for part in parts:
        flat[offset:offset + part.numel()].copy_(part, non_blocking=gpu is not None)
        offset += part.numel()
    if gpu is not None:
        torch.cuda.current_stream(gpu).synchronize()
    return flat


def host_vector(numel: int, device: torch.device | None = None) -> torch.Tensor:
    """A new fp32 CPU vector of ``numel`` values, page-locked when ``device`` is a GPU (copies to it and back are DMA,
    asynchronous)."""
    pinned = device is not None and torch.device(device).type == "cuda"
    return torch.empty(numel, dtype=torch.float32, pin_memory=pinned)


def unpack(flat: torch.Tensor, dicts: Sequence[TensorDict], names: Sequence[str]) -> list[TensorDict]:
    """Inverse of ``pack``: new dicts whose selected entries are views of ``flat``."""
    out, offset = [], 0
    for d in dicts:
        mixed = dict(d)
        for n in names:
            size = d[n].numel()
            mixed[n] = flat[offset : offset + size].view_as(d[n])
            offset += size
        out.append(mixed)
    return out
