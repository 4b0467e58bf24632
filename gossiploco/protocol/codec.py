"""The wire format: one message is a msgpack header frame plus raw tensor frames (bytes in, bytes out).

This module is the reference for the protocol. It knows nothing of sockets: ``encode`` turns a
``Header`` and CPU tensors into frames, ``decode`` validates frames and turns them back.

Frame layout (one multipart message)::

    frame 0      header: a msgpack map (at most MAX_HEADER_BYTES bytes)
    frame 1..n   payload: the raw bytes of tensor i-1, C-contiguous, native (little-endian) byte order

Header fields, all required, no others allowed (``int`` never accepts a msgpack bool):

    v        int        protocol version, PROTOCOL_VERSION
    run      str        run id; a message from another run is rejected
    round    int >= 0   outer round r the message belongs to
    op       str        one of OPS: mix1 (Mix1 outer parameters), mix2 (Mix2 pseudo-gradient),
                        grad (sync-DP gradient), state (outer state transfer), monitor
                        (consensus monitors), hello (membership: "I take part from round
                        r on"), abort (the sender abandoned the exchange ``key``), group
                        (agreeing on who takes part in exchange ``key``)
    chunk    int >= 0   index of this chunk when a payload is split over several messages
    sender   int >= 0   rank of the sending peer
    key      str        the exchange key, e.g. "mix1/12"
    tensors  list       one {"dtype": str, "shape": [int, ...]} per payload frame, in order

Dtypes: the keys of DTYPES (float32, bfloat16, float16, int64, uint8). A payload frame holds
exactly prod(shape) * itemsize bytes. Limits: MAX_TENSORS payload frames, MAX_NDIM dimensions,
and a shape volume (zero-length dimensions counted as 1) of at most MAX_VOLUME elements.

``decode`` checks, in order: frames present; total size <= ``max_bytes`` (before the header is
parsed); header size, msgpack and map; field names and types; version; run id; op; round, chunk
and sender non-negative; one payload frame per tensor; each tensor's dtype, shape and byte
length; and, unless ``allow_non_finite``, that floating payloads hold no NaN or Inf. Any
failure raises ``MalformedMessage``. No Python object serialization is ever decoded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import msgpack
import numpy as np
import torch

from gossiploco.errors import MalformedMessage
from gossiploco.tensor_checks import all_finite

PROTOCOL_VERSION = 1
OPS = frozenset({"mix1", "mix2", "grad", "state", "monitor", "hello", "abort", "group"})
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "uint8": torch.uint8,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 64 * 1024
MAX_TENSORS = 1024
MAX_NDIM = 8
MAX_VOLUME = 2**40  # keeps every stride within int64, even for shapes with a zero-length dimension

_FIELD_TYPES: dict[str, type] = {
    "v": int, "run": str, "round": int, "op": str, "chunk": int, "sender": int, "key": str, "tensors": list,
}


class FrameLike(Protocol):
    """A received frame that exposes its bytes as ``.buffer`` (such as ``zmq.Frame``)."""

    @property
    def buffer(self) -> memoryview: ...


Frame = bytes | bytearray | memoryview | FrameLike


@dataclass(frozen=True)
class TensorSpec:
    """Dtype and shape of one payload frame."""

    dtype: str
    """A key of ``DTYPES``."""
    shape: tuple[int, ...]
    """The tensor's shape; the frame holds prod(shape) * itemsize bytes."""

    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Header:
    """The header frame of one message; the module docstring documents each field."""

    run: str
    round: int
    op: str
    chunk: int
    sender: int
    key: str
    tensors: tuple[TensorSpec, ...] = ()
    """Filled in by ``encode`` from the tensors it is given; whatever the caller put here is replaced."""
    v: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The header as the msgpack map sent on the wire."""
        return {
            "v": self.v, "run": self.run, "round": self.round, "op": self.op, "chunk": self.chunk,
            "sender": self.sender, "key": self.key,
            "tensors": [{"dtype": s.dtype, "shape": list(s.shape)} for s in self.tensors],
        }


def encode(header: Header, tensors: Sequence[torch.Tensor]) -> list[bytes | memoryview]:
    """Frames for one message: the packed header, then one byte view per tensor.

    ``header.tensors`` is replaced by the tensors' dtypes and shapes. A contiguous CPU tensor is
    not copied: its frame is a view of the tensor's memory, so the tensor must not be modified
    until the frames are sent. Non-contiguous tensors are copied once by ``.contiguous()``.
    Raises ``ValueError`` for a tensor not on the CPU, an unsupported dtype, or an invalid header.
    """
    payload: list[memoryview] = []
    specs: list[TensorSpec] = []
    for i, tensor in enumerate(tensors):
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {i} is on {tensor.device}; the codec only encodes CPU tensors")
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {i} has unsupported dtype {tensor.dtype}; allowed: {sorted(DTYPES)}")
        flat = tensor.detach().contiguous().reshape(-1)
        # Viewing as uint8 gives one code path for every dtype, bfloat16 included (numpy lacks it).
        payload.append(memoryview(flat.view(torch.uint8).numpy()))
        specs.append(TensorSpec(DTYPE_NAMES[tensor.dtype], tuple(tensor.shape)))
    header = replace(header, tensors=tuple(specs))
    wire = header.to_dict()
    try:
        _validate(wire, expect_run=header.run, n_payload=len(payload))
    except MalformedMessage as exc:
        raise ValueError(f"invalid header: {exc}") from None
    try:
        packed = msgpack.packb(wire, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:  # e.g. a round beyond 2**64 - 1
        raise ValueError(f"invalid header: {type(exc).__name__}: {exc}") from None
    if len(packed) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
    return [packed, *payload]


def decode(
    frames: Sequence[Frame], *, expect_run: str, max_bytes: int, allow_non_finite: bool = False,
    copy: bool = True,
) -> tuple[Header, list[torch.Tensor]]:
    """Validate one received message and return its header and tensors.

    The checks and their order are listed in the module docstring; any failure raises
    ``MalformedMessage``. With ``copy`` (the default) the returned tensors are fresh CPU tensors
    (one copy out of the frames), so the receive buffers may be reused or freed as soon as this
    returns; with ``copy=False`` they are views of the frames' memory, which they keep alive (for
    frames the caller will not reuse, such as received ``zmq.Frame``s).
    """
    if not frames:
        raise MalformedMessage("empty message: no frames")
    buffers = [_buffer(f) for f in frames]
    total = sum(b.nbytes for b in buffers)
    if total > max_bytes:
        raise MalformedMessage(f"message of {total} bytes exceeds max_bytes={max_bytes}")
    header = _validate(_unpack(buffers[0]), expect_run=expect_run, n_payload=len(buffers) - 1)
    tensors: list[torch.Tensor] = []
    for i, (spec, buf) in enumerate(zip(header.tensors, buffers[1:])):
        if buf.nbytes != spec.nbytes():
            raise MalformedMessage(
                f"tensor {i}: frame has {buf.nbytes} bytes, {spec.dtype} of shape {list(spec.shape)} "
                f"needs {spec.nbytes()}")
        tensor = _copy_out(buf, spec) if copy else _view(buf, spec)
        if tensor.is_floating_point() and not allow_non_finite and not all_finite(tensor):
            raise MalformedMessage(f"tensor {i}: non-finite values (NaN or Inf) in {spec.dtype} payload")
        tensors.append(tensor)
    return header, tensors


def _buffer(frame: Frame) -> memoryview:
    """The frame's bytes as a memoryview, without copying."""
    raw = frame.buffer if hasattr(frame, "buffer") else frame
    return memoryview(raw).cast("B")  # type: ignore[arg-type]


def _unpack(buf: memoryview) -> Any:
    """The header frame's msgpack object (size-checked first)."""
    if buf.nbytes > MAX_HEADER_BYTES:
        raise MalformedMessage(f"header of {buf.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(
            buf, raw=False, strict_map_key=True, use_list=True, max_bin_len=0, max_ext_len=0,
            max_array_len=MAX_TENSORS, max_map_len=4 * len(_FIELD_TYPES))
    except Exception as exc:  # noqa: BLE001 - any parser failure on untrusted bytes is a malformed header
        raise MalformedMessage(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from exc


def _validate(obj: Any, *, expect_run: str, n_payload: int) -> Header:
    """Check a header map field by field; raise ``MalformedMessage`` naming the first problem."""
    if not isinstance(obj, dict):
        raise MalformedMessage(f"header is a msgpack {type(obj).__name__}, not a map")
    # repr: keys of mixed types (str and bytes) do not sort (found by the fuzzer: a TypeError here
    # killed the receiving thread).
    missing, extra = sorted(_FIELD_TYPES.keys() - obj.keys()), sorted(obj.keys() - _FIELD_TYPES.keys(), key=repr)
    if missing:
        raise MalformedMessage(f"header is missing field(s) {missing}")
    if extra:
        raise MalformedMessage(f"header has unknown field(s) {extra}")
    for name, kind in _FIELD_TYPES.items():
        value = obj[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise MalformedMessage(f"header field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    if obj["v"] != PROTOCOL_VERSION:
        raise MalformedMessage(f"protocol version {obj['v']}, expected {PROTOCOL_VERSION}")
    if obj["run"] != expect_run:
        raise MalformedMessage(f"run id {obj['run']!r}, expected {expect_run!r}")
    if obj["op"] not in OPS:
        raise MalformedMessage(f"unknown op {obj['op']!r}; allowed: {sorted(OPS)}")
    for name in ("round", "chunk", "sender"):
        if obj[name] < 0:
            raise MalformedMessage(f"header field {name!r} must be >= 0, got {obj[name]}")
    if len(obj["tensors"]) > MAX_TENSORS:
        raise MalformedMessage(f"{len(obj['tensors'])} tensors exceed the limit of {MAX_TENSORS}")
    if len(obj["tensors"]) != n_payload:
        raise MalformedMessage(f"{n_payload} payload frame(s) for {len(obj['tensors'])} tensor(s) in the header")
    specs = tuple(_spec(i, entry) for i, entry in enumerate(obj["tensors"]))
    return Header(run=obj["run"], round=obj["round"], op=obj["op"], chunk=obj["chunk"],
                  sender=obj["sender"], key=obj["key"], tensors=specs, v=obj["v"])


def _spec(i: int, entry: Any) -> TensorSpec:
    """One entry of the header's ``tensors`` list, validated."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape"}:
        raise MalformedMessage(f"tensor {i}: entry must be a map with exactly 'dtype' and 'shape'")
    dtype, shape = entry["dtype"], entry["shape"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise MalformedMessage(f"tensor {i}: unknown dtype {dtype!r}; allowed: {sorted(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise MalformedMessage(
            f"tensor {i}: shape must be a list of at most {MAX_NDIM} non-negative ints, got {shape!r}")
    if math.prod(max(d, 1) for d in shape) > MAX_VOLUME:
        raise MalformedMessage(f"tensor {i}: shape {shape} exceeds {MAX_VOLUME} elements")
    return TensorSpec(dtype, tuple(shape))


def _copy_out(buf: memoryview, spec: TensorSpec) -> torch.Tensor:
    """A new tensor holding a copy of ``buf`` (whose length was checked against ``spec``)."""
    flat = torch.empty(math.prod(spec.shape), dtype=DTYPES[spec.dtype])
    flat.view(torch.uint8).numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
    return flat.reshape(spec.shape)


def _view(buf: memoryview, spec: TensorSpec) -> torch.Tensor:
    """A tensor over ``buf``'s memory (no copy); it holds a reference to ``buf``."""
    if buf.nbytes == 0:
        return torch.empty(spec.shape, dtype=DTYPES[spec.dtype])
    if buf.readonly:  # torch.frombuffer wants writable memory; read-only input is copied instead
        return _copy_out(buf, spec)
    return torch.frombuffer(buf, dtype=torch.uint8).view(DTYPES[spec.dtype]).reshape(spec.shape)


