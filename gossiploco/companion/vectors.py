"""Reused fp32 vectors in shared memory: what a trainer packs its parameters into before a collective.

A fresh shared-memory vector per Mix1 costs the training process page faults on fill and an unmapping when freed
(TLB shootdowns that interrupt the training thread): measured +18% on a training loop beside back-to-back packing of
100M values into new shared memory, against +2% packing into reused memory. So a vector handed out here goes back
to the pool once nothing holds it any more (its storage's only owner is the pool), and a later ``take`` of the same
size reuses it, its pages already mapped. At most ``keep`` vectors of each size are kept (more in flight at once
are made and freed as needed).
"""

from __future__ import annotations

import threading

import torch

KEEP = 2
"""Vectors kept per size: Mix1's (held until the outer step) and the next one in flight."""


def _use_count(storage: torch.UntypedStorage) -> int | None:
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(storage._cdata)


class SharedVectors:
    """See the module docstring. Thread-safe."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._pool: dict[int, list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()
        self.made = 0
        """Vectors allocated so far (a reuse allocates none)."""

    def take(self, numel: int) -> torch.Tensor:
        """An fp32 vector of ``numel`` values in shared memory (its contents are whatever was there)."""
        with self._lock:
            kept = self._pool.setdefault(numel, [])
            for storage in kept:
                if _use_count(storage) == 1:  # only the pool holds it: free to reuse
                    return _view(storage, numel)
            storage = torch.UntypedStorage._new_shared(numel * 4)
            self.made += 1
            if len(kept) < self.keep:
                kept.append(storage)
            return _view(storage, numel)


def _view(storage: torch.UntypedStorage, numel: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32).set_(storage, 0, (numel,), (1,))
