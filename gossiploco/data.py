"""Corpus (tokenized text or .bin tokens), per-worker token streams and fixed held-out batches.

Nothing is downloaded. The default corpus is the Python standard library's source files on
this machine (deterministic sorted file list). User data is either text files / globs, encoded
with the configured tokenizer (``data.tokenizer``: bytes by default, or a BPE file; see
``gossiploco.tokenizer``), or pre-tokenized ``.bin`` files of uint16 / uint32 tokens (memory-mapped).

Text is split into train and validation *by document* with a stable hash of each document's
path, so the split does not depend on file order or on which other files exist. ``.bin``
files have no document boundaries: the last ``val_fraction`` of each file is validation.

Each worker reads its own deterministic stream of random windows from the training tokens,
seeded by (run seed, worker index): workers see different data, and the same seed always
gives the same batches.

A prepared folder (``gossiploco data prepare``; ``data.paths = [DIR]`` with ``DIR/manifest.json``) is
memory-mapped, never read in full (``gossiploco.prepared_corpus``); its vocabulary is the manifest's, and
its workers walk the training windows epoch by epoch, each its own slice (``gossiploco.window_stream``)
instead of random windows (``make_stream``).
"""

from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gossiploco.builtin_corpus import stdlib_files, stdlib_root
from gossiploco.config import DataConfig
from gossiploco.errors import DataError
from gossiploco.prepared_corpus import ShardedTokens, is_prepared, open_split, read_manifest
from gossiploco.tokenizer import BYTE_SPECS, BYTE_VOCAB, ByteTokenizer, load_tokenizer
from gossiploco.window_stream import WindowStream

__all__ = ["BYTE_VOCAB", "DOC_SEPARATOR", "ByteTokenizer", "Corpus", "TokenStream", "fixed_batches", "heldout_batch",
           "expand_paths", "load_corpus", "make_stream", "validation_batches"]
DOC_SEPARATOR = ByteTokenizer.separator_id  # NUL never occurs in text; it marks document boundaries in the byte stream
_STREAM_SALT = 0x5EED
_HELDOUT_SALT = 0x4E1D
_VAL_SALT = 0x7A1


@dataclass
class Corpus:
    """Training and validation token arrays (1-D, any unsigned dtype, or a prepared folder's memory-mapped
    shards) and the vocabulary size."""

    train: np.ndarray | ShardedTokens
    val: np.ndarray | ShardedTokens
    vocab_size: int
    description: str
    prepared: bool = False
    """Whether the tokens come from a prepared folder (its workers then walk epochs of windows: ``make_stream``)."""


def expand_paths(paths: list[str]) -> list[Path]:
    """The files ``paths`` name (globs expanded, sorted per entry); ``DataError`` for an entry matching none."""
    found: list[Path] = []
    for entry in paths:
        matches = sorted(glob.glob(entry, recursive=True)) if glob.has_magic(entry) else [entry]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise DataError(f"data.paths: {entry!r} matches no file")
        found += [Path(m) for m in matches]
    return found


def _is_val(key: str, fraction: float) -> bool:
    digest = hashlib.blake2b(key.encode(), digest_size=8, salt=_VAL_SALT.to_bytes(2, "little")).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def load_corpus(cfg: DataConfig) -> Corpus:
    """Load and split the corpus named by ``cfg``; raise ``DataError`` when unusable."""
    if any(is_prepared(p) for p in cfg.paths):
        corpus = _load_prepared(cfg)
    elif cfg.paths and all(p.endswith(".bin") for p in cfg.paths):
        corpus = _load_bin(cfg)
    elif any(p.endswith(".bin") for p in cfg.paths):
        raise DataError("data.paths: mix of .bin and text files; use one kind")
    else:
        corpus = _load_text(cfg)
    need = cfg.seq_len + 2
    for split in ("train", "val"):
        n = len(getattr(corpus, split))
        if n < need:
            raise DataError(f"{corpus.description}: {split} split has {n} tokens, need at least {need} (seq_len + 2)")
    return corpus


def _load_text(cfg: DataConfig) -> Corpus:
    tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.paths:
        files = expand_paths(cfg.paths)
        keys = [str(p) for p in files]
        description = f"{len(files)} text file(s)"
    else:
        files = stdlib_files()
        if not files:
            raise DataError("built-in corpus: found no .py files in the standard library")
        root = stdlib_root()
        keys = [p.relative_to(root).as_posix() for p in files]
        description = "stdlib sources"
    budget = int(cfg.max_corpus_mb * 2**20) if cfg.max_corpus_mb else None
    train_docs: list[bytes] = []
    val_docs: list[bytes] = []
    used = 0
    for path, key in zip(files, keys):
        try:
            doc = path.read_bytes()
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc}") from exc
        doc = doc.replace(b"\x00", b"")
        if not doc:
            continue
        (val_docs if _is_val(key, cfg.val_fraction) else train_docs).append(doc)
        used += len(doc)
        if budget is not None and used >= budget:
            break
    if not train_docs and not val_docs:
        raise DataError(f"{description}: every file is empty")
    if cfg.tokenizer:
        description += f", {Path(cfg.tokenizer).name} ({tokenizer.vocab_size} ids)"
    if not val_docs or not train_docs:
        # Too few documents for a split by document: split the concatenation (without its last separator).
        joined = tokenizer.encode_documents(train_docs + val_docs)[:-1]
        cut = int(len(joined) * (1 - cfg.val_fraction))
        sep = np.array([tokenizer.separator_id], dtype=joined.dtype)
        train, val = np.concatenate([joined[:cut], sep]), np.concatenate([joined[cut:], sep])
    else:
        train, val = tokenizer.encode_documents(train_docs), tokenizer.encode_documents(val_docs)
    return Corpus(train=train, val=val, vocab_size=tokenizer.vocab_size, description=description)


def _load_prepared(cfg: DataConfig) -> Corpus:
    if len(cfg.paths) != 1:
        raise DataError(f"data.paths: a prepared folder is the only entry, got {len(cfg.paths)} entries")
    folder = cfg.paths[0]
    manifest = read_manifest(folder)
    tokenizer = manifest["tokenizer"]
    if cfg.tokenizer not in BYTE_SPECS and load_tokenizer_sha(cfg.tokenizer) != tokenizer["sha256"]:
        raise DataError(f"{folder}: prepared with the tokenizer sha256 {tokenizer['sha256'][:12]}..., data.tokenizer "
                        f"{cfg.tokenizer} is another file; leave data.tokenizer empty (the folder holds its tokenizer)")
    if cfg.vocab_size and cfg.vocab_size != tokenizer["vocab_size"]:
        raise DataError(f"{folder}: vocabulary {tokenizer['vocab_size']} (manifest), data.vocab_size says {cfg.vocab_size}")
    train, val = open_split(folder, manifest, "train"), open_split(folder, manifest, "val")
    description = (f"prepared folder {folder} ({len(train):,} training tokens in {len(train.shards)} shard(s), "
                   f"vocabulary {tokenizer['vocab_size']})")
    return Corpus(train=train, val=val, vocab_size=tokenizer["vocab_size"], description=description, prepared=True)


def load_tokenizer_sha(path: str) -> str:
    """SHA-256 hex of a tokenizer file (``DataError`` if unreadable)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        raise DataError(f"data.tokenizer: cannot read {path} ({exc.strerror or exc})") from exc


def _load_bin(cfg: DataConfig) -> Corpus:
    if cfg.vocab_size <= 0:
        raise DataError("data.vocab_size: required for pre-tokenized .bin files")
    files = expand_paths(cfg.paths)
    dtype = np.dtype(cfg.bin_dtype)
    train_parts, val_parts = [], []
    for path in files:
        if path.stat().st_size % dtype.itemsize:
            raise DataError(f"{path}: size {path.stat().st_size} is not a multiple of {dtype.itemsize} ({cfg.bin_dtype})")
        if path.stat().st_size == 0:
            raise DataError(f"{path}: empty file")
        tokens = np.memmap(path, dtype=dtype, mode="r")
        cut = int(len(tokens) * (1 - cfg.val_fraction))
        train_parts.append(tokens[:cut])
        val_parts.append(tokens[cut:])
    # One file: keep the memory maps (no copy). Several: concatenate (copies).
    train = train_parts[0] if len(files) == 1 else np.concatenate(train_parts)
    val = val_parts[0] if len(files) == 1 else np.concatenate(val_parts)
    sample = np.asarray(train[: 1 << 20])
    if sample.size and int(sample.max()) >= cfg.vocab_size:
        raise DataError(f"{files[0]}: token {int(sample.max())} >= data.vocab_size {cfg.vocab_size}")
    return Corpus(train=train, val=val, vocab_size=cfg.vocab_size, description=f"{len(files)} .bin file(s)")


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[o : o + seq_len + 1], dtype=np.int64) for o in offsets])
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]  # inputs (B, T), targets (B, T)


class TokenStream:
    """Worker ``worker``'s deterministic stream of (inputs, targets) batches of random windows."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, worker: int):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rng = np.random.default_rng([seed, worker, _STREAM_SALT])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        return _windows(self.tokens, offsets, self.seq_len)

    def state(self) -> dict:
        """The stream's position (its generator's state), as JSON (goes in a checkpoint)."""
        return self.rng.bit_generator.state

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or "bit_generator" not in state:
            raise DataError("the checkpoint's data stream is not a random-window stream (the run's data changed?)")
        self.rng.bit_generator.state = state


def make_stream(corpus: Corpus, cfg: DataConfig, seed: int, worker: int, workers: int) -> TokenStream | WindowStream:
    """Worker ``worker``'s training stream (of a run of ``workers``): random windows, or, from a prepared folder,
    its slice of each epoch's windows (``WindowStream``: no window twice in an epoch, none shared between
    workers whose indices differ modulo ``workers``)."""
    if corpus.prepared:
        return WindowStream(corpus.train, cfg.seq_len, cfg.batch_size, seed, worker, workers)
    return TokenStream(corpus.train, cfg.seq_len, cfg.batch_size, seed, worker)


def fixed_batches(tokens: np.ndarray, seq_len: int, batch_size: int, count: int, seed: int, salt: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches sampled once from ``tokens`` with a fixed generator (same on every peer)."""
    rng = np.random.default_rng([seed, salt])
    return [
        _windows(tokens, rng.integers(0, len(tokens) - seq_len - 1, size=batch_size), seq_len) for _ in range(count)
    ]


def heldout_batch(corpus: Corpus, cfg: DataConfig, seed: int) -> torch.Tensor:
    """The held-out input batch for the JS monitor: sampled once from validation data, reused."""
    inputs, _ = fixed_batches(corpus.val, cfg.seq_len, cfg.heldout_batch_size, 1, seed, _HELDOUT_SALT)[0]
    return inputs


def validation_batches(corpus: Corpus, cfg: DataConfig, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return fixed_batches(corpus.val, cfg.seq_len, cfg.batch_size, cfg.val_batches, seed, _VAL_SALT)
