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
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from gossiploco.errors import PeerFailed
from gossiploco.tensor_checks import all_finite

COMPRESSIONS = ("none", "bf16", "int8", "4bit", "e3m0", "topk")
PIECE_VALUES = 1 << 18
"""Values a block codec codes at a time (1 MB of fp32; top-k: four times as many), one piece a thread."""
_pools: dict[int, ThreadPoolExecutor] = {}
"""The threads that code pieces, by their number (``_run_pieces``); a forked child starts without any."""
_pools_lock = threading.Lock()
_thread_buffers = threading.local()
os.register_at_fork(after_in_child=_pools.clear)  # a child has none of its parent's threads


def _scratch(name: str, size: int, dtype: type) -> np.ndarray:
    """A buffer of at least ``size`` values of this thread's own, kept for its next piece (a fresh one each piece
    costs page faults and, from several threads, the process's memory-map lock)."""
    buffers = _thread_buffers.__dict__.setdefault("buffers", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.size < size or buffer.dtype != dtype:
        buffer = buffers[name] = np.empty(max(size, 1), dtype)
    return buffer[:size]


def _kernels():
    """``codec_kernels``, imported at a codec's first use (numba takes a fifth of a second to import)."""
    from gossiploco.mixing import codec_kernels
    return codec_kernels


def _writable(out: torch.Tensor | None, numel: int) -> torch.Tensor:
    """Where a decode writes: ``out`` (a float32 CPU vector of ``numel`` values), or a new vector. ``ValueError`` for
    any other ``out``; a non-contiguous one is written through a contiguous copy by the caller (``_written``)."""
    if out is None:
        return torch.empty(numel, dtype=torch.float32)
    if out.dtype != torch.float32 or out.device.type != "cpu" or out.numel() != numel or out.dim() != 1:
        raise ValueError(f"decode writes {numel} float32 values on the CPU, not into a {out.dtype} {out.device.type} "
                         f"tensor of shape {tuple(out.shape)}")
    return out.detach() if out.is_contiguous() else torch.empty(numel, dtype=torch.float32)


def _written(out: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    """``out`` holding what was decoded into ``target`` (``_writable``), or ``target`` when no ``out`` was given."""
    if out is None:
        return target
    if target.data_ptr() != out.data_ptr():
        out.copy_(target)
    return out


def _accumulator(acc: torch.Tensor, numel: int) -> np.ndarray | None:
    """``acc`` (a float32 CPU vector of ``numel`` values, ``decode_add``'s) as a numpy view of its memory; None when it
    is not contiguous (it is then added to through a decoded copy). ``ValueError`` for any other ``acc``."""
    if acc.dtype != torch.float32 or acc.device.type != "cpu" or acc.numel() != numel or acc.dim() != 1:
        raise ValueError(f"decode_add adds {numel} float32 values on the CPU, not into a {acc.dtype} {acc.device.type} "
                         f"tensor of shape {tuple(acc.shape)}")
    return acc.detach().numpy() if acc.is_contiguous() else None


def _cpu_values(flat: torch.Tensor) -> np.ndarray:
    """``flat`` as a contiguous float32 numpy vector on the CPU (no copy when it is one already)."""
    return flat.detach().reshape(-1).to("cpu", torch.float32).contiguous().numpy()


def _run_pieces(code: Callable[[int, int], None], pieces: list[tuple[int, int]]) -> None:
    """``code(start, end)`` for every piece, on as many threads as torch's intra-op setting
    (``torch.get_num_threads()``) at once: the kernels release the GIL. One piece, or one thread: on this one.
    The first error raised is raised here, once every piece has ended."""
    threads = min(torch.get_num_threads(), len(pieces))
    if threads <= 1:
        for start, end in pieces:
            code(start, end)
        return
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="codec")
    futures = [pool.submit(code, start, end) for start, end in pieces]
    for future in futures:
        future.exception()  # every piece ends before anything is raised: none still writes the caller's memory
    for future in futures:
        future.result()


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

    def prepare(self) -> None:
        """Make the first exchange as quick as later ones: a compiled codec compiles (or loads from its cache) what
        it runs, here rather than inside a round's exchange, where a first use on a new machine cost about 5 s of
        it (``codec_kernels``). Nothing for the others."""

    def decode_add(self, payload: torch.Tensor, numel: int, acc: torch.Tensor) -> torch.Tensor:
        """``acc += decode(payload, numel)``, returned: the same checks and the same bits, without the decoded vector
        in memory (a compiled codec decodes a piece into cache and adds it from there: one pass over ``acc`` instead
        of a write and two reads). ``acc`` is left as it was when the payload is refused (``PeerFailed``);
        ``ValueError`` for an ``acc`` that is not a float32 CPU vector of ``numel`` values."""
        _accumulator(acc, numel)
        return acc.add_(self.decode(payload, numel))

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

    def decode_add(self, payload, numel, acc):
        _accumulator(acc, numel)
        self._check_size(payload, numel)
        values = payload.view(torch.float32)
        _check_finite(values, self.name)
        return acc.add_(values)


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

    def decode_add(self, payload, numel, acc):
        into = _accumulator(acc, numel)
        if into is None:
            return super().decode_add(payload, numel, acc)
        self._check_size(payload, numel)
        bits, kernels = payload.contiguous().view(torch.uint16).numpy(), _kernels()
        if not kernels.bfloat16_finite(bits):
            raise PeerFailed(f"{self.name} payload holds NaN or Inf")
        kernels.bfloat16_add(bits, _scratch("widened", 4096, np.int32), into)
        return acc


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
            self.bits, self.levels = 4, 0  # codes 0..7: +2^-k; 8..15: -2^-k
        else:
            raise ValueError(f"unknown block codec {name!r}")

    def _blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def _code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def encoded_bytes(self, numel: int) -> int:
        return 4 * self._blocks(numel) + self._code_bytes(numel)

    def _pieces(self, numel: int) -> list[tuple[int, int]]:
        """Value ranges of about ``PIECE_VALUES`` (whole blocks, an even count), coded one at a time and on several
        threads at once (``_run_pieces``)."""
        step = max(1, PIECE_VALUES // self.block) * self.block
        step *= 1 + step % 2  # 4-bit codes pair values: every piece but the last holds an even count
        return [(s, min(s + step, numel)) for s in range(0, numel, step)]

    def _code_range(self, start: int, end: int) -> slice:
        return slice(start, end) if self.bits == 8 else slice(start // 2, (end + 1) // 2)

    def prepare(self) -> None:
        self.roundtrip(torch.linspace(-1.0, 1.0, 2 * self.block + 1))  # whole blocks and a cut one, an odd count

    def encode(self, flat):
        kernels = _kernels()
        x = _cpu_values(flat)
        numel, nb = x.size, self._blocks(x.size)
        payload = torch.empty(self.encoded_bytes(numel), dtype=torch.uint8)
        scale_bits, codes = payload[:4 * nb].view(torch.int32).numpy(), payload[4 * nb:].numpy()
        scales = scale_bits.view(np.float32)

        def encode_piece(start: int, end: int) -> None:
            first, last = start // self.block, self._blocks(end)
            kernels.block_encode(x[start:end], self.block, self.levels, scale_bits[first:last], scales[first:last],
                                 codes[self._code_range(start, end)],
                                 _scratch("codes", 0 if self.bits == 8 else end - start + 1, np.int8),
                                 _scratch("units", self.block if self.levels == 0 else 0, np.float32))

        _run_pieces(encode_piece, self._pieces(numel))
        return payload

    def _checked(self, payload: torch.Tensor, numel: int) -> tuple[np.ndarray, np.ndarray]:
        """The payload's block scales (float32) and codes, once checked (``PeerFailed`` for a payload no encoder
        makes)."""
        self._check_size(payload, numel)
        payload = payload.contiguous()
        nb = self._blocks(numel)
        scales = payload[:4 * nb].clone().view(torch.float32)
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise PeerFailed(f"{self.name} payload has a negative or non-finite block scale")
        codes = payload[4 * nb:].numpy()
        if not _kernels().block_codes_valid(codes, self.levels, numel):
            raise PeerFailed(f"{self.name} payload has a code outside [0, {2 * self.levels}]")
        return scales.numpy(), codes

    def decode(self, payload, numel, out=None):
        scale_values, codes = self._checked(payload, numel)
        target, kernels = _writable(out, numel), _kernels()
        into = target.numpy()

        def decode_piece(start: int, end: int) -> None:
            kernels.block_decode(scale_values[start // self.block:self._blocks(end)],
                                 codes[self._code_range(start, end)], self.block, self.levels, into[start:end])

        _run_pieces(decode_piece, self._pieces(numel))
        return _written(out, target)

    def decode_add(self, payload, numel, acc):
        into = _accumulator(acc, numel)
        if into is None:
            return super().decode_add(payload, numel, acc)
        scale_values, codes = self._checked(payload, numel)
        kernels = _kernels()

        def add_piece(start: int, end: int) -> None:
            kernels.block_decode_add(scale_values[start // self.block:self._blocks(end)],
                                     codes[self._code_range(start, end)], self.block, self.levels,
                                     _scratch("decoded", end - start, np.float32), into[start:end])

        _run_pieces(add_piece, self._pieces(numel))
        return acc


TOPK_BITS = (1, 2, 4, 8)


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

    def _pieces(self, chunks: int) -> list[tuple[int, int]]:
        """Ranges of chunks of about ``4 PIECE_VALUES`` values, coded on several threads at once (``_run_pieces``): a
        multiple of 8 chunks each, so that no byte of packed codes is shared by two pieces."""
        step = max(8, 4 * PIECE_VALUES // self.chunk // 8 * 8)
        return [(c, min(c + step, chunks)) for c in range(0, chunks, step)]

    def prepare(self) -> None:
        self.roundtrip(torch.linspace(-1.0, 1.0, 2 * self.chunk + 1))  # whole chunks and a cut one

    def _sections(self, payload: torch.Tensor, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The payload's bounds (int32 bits, two a chunk), positions (int16, ``k`` a chunk) and packed codes, as numpy
        views of its memory."""
        return (payload[:8 * n].view(torch.int32).numpy(), payload[8 * n:8 * n + 2 * n * k].view(torch.int16).numpy(),
                payload[8 * n + 2 * n * k:].numpy())

    def encode(self, flat):
        kernels = _kernels()
        x = _cpu_values(flat)
        n, k = self._shape(x.size)
        payload = torch.empty(self.encoded_bytes(x.size), dtype=torch.uint8)
        bound_bits, positions, packed = self._sections(payload, n, k)
        packed[:] = 0  # codes are ORed in
        bounds = bound_bits.view(np.float32)

        def encode_piece(first: int, last: int) -> None:
            start, end = first * self.chunk, min(x.size, last * self.chunk)
            kernels.topk_encode(x[start:end], end - start, self.chunk, k, self.bits, first * k,
                                bound_bits[2 * first:2 * last], bounds[2 * first:2 * last],
                                positions[first * k:last * k], packed, _scratch("padded", self.chunk, np.float32),
                                *(_scratch(name, self.chunk, np.int32) for name in ("candidates", "columns", "select")),
                                _scratch("kept", k, np.int32))

        _run_pieces(encode_piece, self._pieces(n))
        return payload

    def _checked(self, payload: torch.Tensor, numel: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The payload's bounds (float32, two a chunk), positions (uint16) and packed codes, once checked
        (``PeerFailed`` for a payload no encoder makes)."""
        self._check_size(payload, numel)
        payload = payload.contiguous()
        n, k = self._shape(numel)
        bounds = payload[:8 * n].clone().view(torch.float32).view(n, 2)
        if not bool((torch.isfinite(bounds) & (bounds >= 0)).all()) or bool((bounds[:, 0] > bounds[:, 1]).any()):
            raise PeerFailed("topk payload has bad magnitude bounds (negative, non-finite or low above high)")
        _, positions, packed = self._sections(payload, n, k)
        positions = positions.view(np.uint16)
        if not _kernels().topk_positions_valid(positions, self.chunk, k):
            raise PeerFailed("topk payload has positions out of order or outside their chunk")
        return bounds.view(-1).numpy(), positions, packed

    def _run_chunks(self, payload: torch.Tensor, numel: int, into: np.ndarray, add: bool) -> None:
        """Decode the checked payload into ``into`` (``topk_decode``), or add it there (``add``: ``topk_decode_add``),
        piece by piece."""
        bound_values, positions, packed = self._checked(payload, numel)
        n, k = self._shape(numel)
        kernels = _kernels()

        def run_piece(first: int, last: int) -> None:
            sections = (bound_values[2 * first:2 * last], positions[first * k:last * k], packed, self.chunk, k,
                        self.bits, first * k)
            piece = into[first * self.chunk:min(numel, last * self.chunk)]
            if add:
                kernels.topk_decode_add(*sections, _scratch("decoded", self.chunk, np.float32), piece)
            else:
                kernels.topk_decode(*sections, piece)

        _run_pieces(run_piece, self._pieces(n))

    def decode(self, payload, numel, out=None):
        target = _writable(out, numel)
        self._run_chunks(payload, numel, target.numpy(), add=False)
        return _written(out, target)

    def decode_add(self, payload, numel, acc):
        into = _accumulator(acc, numel)
        if into is None:
            return super().decode_add(payload, numel, acc)
        self._run_chunks(payload, numel, into, add=True)
        return acc


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
