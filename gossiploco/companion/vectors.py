"""Reused vectors in shared memory: what a trainer hands its companion for a collective, and how it names them.

A fresh shared-memory vector per Mix1 costs the training process page faults on fill and an unmapping when freed
(TLB shootdowns that interrupt the training thread): measured +18% on a training loop beside back-to-back packing of
100M values into new shared memory, against +2% packing into reused memory. Moving a tensor from the heap into
shared memory (what the pipe's pickler does) costs more: 19 ms for 7 MB, against 0.6 ms for a reused vector. So a
vector handed out here (``take``) goes back to the pool once nothing holds it any more (its storage's only owner is
the pool), and a later ``take`` of the same dtype and size reuses it, its pages already mapped. At most ``keep``
vectors of each dtype and size are kept (more in flight at once are made and freed as needed).

Each kept vector has an id (``ident``): the first time one goes to the companion it travels whole (its file
descriptor, once) and the companion keeps it (``Registry``); afterwards a ``Ref`` (id, offset, shape) names it,
which pickles in a few bytes and passes no descriptor.

For a trainer whose state is on a GPU (``take(numel, device=cuda)``: what ``pack`` asks for) a kept vector is also
page-locked: registered with CUDA (``cudaHostRegister``) the first time, kept registered while the pool holds it. The
copies from the GPU into it and back are then DMA, asynchronous, as from the caching allocator's pinned memory the
in-process exchange uses. Before, the trainer packed into pinned memory, this module copied that into shared
memory, and the result went back to the GPU from pageable memory: the likely cause of the 0.2-0.4 s the companion
added to Mix2 on an H200 (``bench/results/gpu.md``; not measured on a GPU since). What the caching allocator does for its blocks (an event per asynchronous
copy, waited for before reuse) is done here by waiting for the device's queued work before a registered vector is
handed out again: an asynchronous copy from it (a result going back to the GPU) may still be running. A vector
that cannot be registered stays pageable: logged and counted (``unpinned``), never an error.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

KEEP = 2
"""Vectors kept per dtype and size: Mix1's (held until the outer step) and the next one in flight."""
PORTABLE = 1
"""``cudaHostRegisterPortable``: the registration holds for every CUDA context, not only the current device's."""


def _use_count(storage: torch.UntypedStorage) -> int | None:
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(storage._cdata)


@dataclass(frozen=True)
class Ref:
    """A view of kept vector ``ident`` (``offset`` and ``shape`` in elements of ``dtype``, contiguous)."""

    ident: int
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Register:
    """Kept vector ``ident`` (the whole of it, ``base``), sent once; ``ref`` is the view meant this time."""

    base: torch.Tensor
    ref: Ref


class SharedVectors:
    """The trainer's side; see the module docstring. Thread-safe."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._pool: dict[tuple[torch.dtype, int], list[tuple[int, torch.UntypedStorage]]] = {}
        self._ids: dict[int, tuple[int, torch.dtype, int]] = {}  # storage address -> (id, dtype, numel)
        self._sent: set[int] = set()  # ids the companion holds
        self._lock = threading.Lock()
        self._next = itertools.count()
        self.made = 0
        """Vectors allocated so far (a reuse allocates none)."""
        self._registered: set[int] = set()
        """Kept vectors (by id) registered with CUDA."""
        self._refused: set[int] = set()
        """Kept vectors CUDA would not register (not tried again)."""
        self._used_by: dict[int, set[torch.device]] = {}
        """Kept vector id -> the GPUs it was handed out for since it was last drained (whose queued work may still
        copy from it)."""
        self.unpinned = 0
        """Vectors asked for a GPU that stayed pageable (registration failed, or more in flight than are kept)."""

    def take(self, numel: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
        """A vector of ``numel`` values of ``dtype`` in shared memory (its contents are whatever was there). With a
        CUDA ``device`` (whose tensors will be copied into it and back) it is page-locked as well; see the module
        docstring."""
        gpu = device if device is not None and torch.device(device).type == "cuda" else None
        with self._lock:
            kept = self._pool.setdefault((dtype, numel), [])
            for ident, storage in kept:
                if _use_count(storage) == 1:  # only the pool holds it: free to reuse
                    self._drain(ident)
                    if gpu is not None:
                        self._pin(ident, storage, torch.device(gpu))
                    return _view(storage, dtype, numel)
            storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
            self.made += 1
            if len(kept) < self.keep:
                ident = next(self._next)
                kept.append((ident, storage))
                self._ids[storage.data_ptr()] = (ident, dtype, numel)
                if gpu is not None:
                    self._pin(ident, storage, torch.device(gpu))
            elif gpu is not None:
                self._unpinned(numel * dtype.itemsize, f"more than {self.keep} vectors of this size are in use")
            return _view(storage, dtype, numel)

    def _pin(self, ident: int, storage: torch.UntypedStorage, gpu: torch.device) -> None:
        """Register kept vector ``ident`` with CUDA (once) and note ``gpu`` as one that may copy from it."""
        if ident in self._refused:
            return
        if ident not in self._registered:
            error = torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), PORTABLE)
            if int(error) != 0:  # pageable: its copies are synchronous, so nothing to wait for before a reuse
                self._refused.add(ident)
                self._unpinned(storage.nbytes(), f"cudaHostRegister failed: {error}")
                return
            self._registered.add(ident)
        self._used_by.setdefault(ident, set()).add(gpu)

    def _drain(self, ident: int) -> None:
        """Before kept vector ``ident`` is handed out again: wait for the work queued on the GPUs it was handed out
        for since (an asynchronous copy from it may still be running: the caching allocator's event)."""
        for gpu in self._used_by.pop(ident, ()):
            torch.cuda.synchronize(gpu)

    def _unpinned(self, nbytes: int, why: str) -> None:
        self.unpinned += 1
        log.warning("a shared vector of %d bytes for a GPU stays pageable (%s): its copies to and from the GPU are "
                    "synchronous, slower", nbytes, why)

    def release(self) -> None:
        """Unregister the registered vectors (the exchange closes; views of them stay usable, pageable)."""
        with self._lock:
            for ident, storage in ((i, s) for kept in self._pool.values() for i, s in kept):
                self._drain(ident)
                if ident in self._registered:
                    torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())
            self._registered.clear()

    def wire(self, tensor: torch.Tensor) -> torch.Tensor | Ref | Register:
        """What goes on the pipe for CPU ``tensor``: a ``Ref`` to a kept vector the companion holds, the vector with
        its registration the first time, or ``tensor`` itself (the pickler moves it to shared memory)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return tensor
        storage = tensor.untyped_storage()
        with self._lock:
            kept = self._ids.get(storage.data_ptr())
            if kept is None or kept[1] != tensor.dtype:
                return tensor
            ident, dtype, numel = kept
            ref = Ref(ident, dtype, tensor.storage_offset(), tuple(tensor.shape))
            if ident in self._sent:
                return ref
            self._sent.add(ident)
        return Register(_view(storage, dtype, numel), ref)

    def shared(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` if it is in shared memory already (or not on the CPU), else a copy in a kept vector (the copy
        runs without the interpreter's lock; the pickler's move to shared memory holds it)."""
        if tensor.device.type != "cpu" or tensor.is_shared():
            return tensor
        copy = self.take(tensor.numel(), tensor.dtype)
        copy.copy_(tensor.reshape(-1))
        return copy.view(tensor.shape)


class Registry:
    """The companion's side: the kept vectors it was sent, by id, and the views ``Ref``s name."""

    def __init__(self) -> None:
        self._bases: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def resolve(self, item):
        """A tensor for ``item`` (a ``Ref``, a ``Register`` or anything else, returned as it is)."""
        if isinstance(item, Register):
            with self._lock:
                self._bases[item.ref.ident] = item.base
            item = item.ref
        if isinstance(item, Ref):
            with self._lock:
                base = self._bases.get(item.ident)
            if base is None or base.dtype != item.dtype:
                raise ValueError(f"the trainer named shared vector {item.ident}, which this companion was not sent")
            numel = 1
            for size in item.shape:
                numel *= size
            return base[item.offset:item.offset + numel].view(item.shape)
        return item


def _view(storage: torch.UntypedStorage, dtype: torch.dtype, numel: int) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))
