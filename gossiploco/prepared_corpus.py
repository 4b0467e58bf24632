"""A prepared folder (``gossiploco data prepare``): its manifest, and its token shards memory-mapped.

Layout of a folder::

    manifest.json        what is in the folder (below); written atomically after every shard
    tokenizer.json       a copy of the tokenizer the tokens were made with
    train-00000.bin ...  the training split's shards: token ids, ``dtype`` (uint16 or uint32, native order)
    val-00000.bin ...    the validation split's shards

Every document's tokens are followed by the end-of-text id ``eot_id``; a document is never cut between
two shards. The manifest (``FORMAT``, ``VERSION``) holds: the tokenizer (``sha256`` of its file,
``vocab_size``, ``eot_id``, ``eot_token``), ``dtype``, the preparation's settings, the ``sources`` (path,
kind, bytes, sha256), the ``shards`` (file, split, tokens, documents, and ``end``: the source and row
the next shard starts at), the per-split totals ``splits``, the ``skipped`` counts and ``complete``.

Reading (``load_prepared``) maps the shards without reading them (``ShardedTokens``); only a complete
folder is used for training. ``prepared_digest`` names the folder's data in a run's identity.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from gossiploco.errors import DataError

__all__ = ["FORMAT", "MANIFEST", "VERSION", "ShardedTokens", "copy_tokenizer", "is_prepared", "open_split",
           "prepared_digest", "prepared_folder", "prepared_identity", "prepared_tokenizer_spec", "read_manifest"]

FORMAT = "gossiploco-prepared-tokens"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
"""The copy of the tokenizer in a prepared folder (and in a run directory)."""
SPLITS = ("train", "val")


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a manifest (a prepared folder, complete or not)."""
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder: str | Path, *, complete: bool = True) -> dict:
    """The manifest of ``folder``, checked for its format and version (and, with ``complete``, that the
    preparation finished). ``DataError`` when it is missing, unreadable, of another format or unfinished."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc}); make the folder with `gossiploco data prepare`") from exc
    except ValueError as exc:
        raise DataError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a prepared-data manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") != VERSION:
        raise DataError(f"{path}: format version {manifest.get('version')!r}; this gossiploco reads version {VERSION}")
    if complete and not manifest.get("complete"):
        raise DataError(f"{path}: the preparation did not finish ({len(manifest.get('shards', []))} shard(s) written); "
                        "run the same `gossiploco data prepare` command again to continue it")
    return manifest


class ShardedTokens:
    """One split's shards, memory-mapped, seen as one 1-D token array: ``len`` and contiguous slices
    (``tokens[a:b]``, which may span shards) like a NumPy array's; nothing is read until sliced.

    ``shards`` are the memory maps in order. Thread-safe for reading."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = shards
        lengths = np.array([len(s) for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        """``starts[i]``: the position of shard i's first token; ``starts[-1]``: the total."""
        self.dtype = shards[0].dtype if shards else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("ShardedTokens supports contiguous slices only")
        start, stop, _ = index.indices(len(self))
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < stop:
            offset = start - int(self.starts[first])
            take = min(stop, int(self.starts[first + 1])) - start
            parts.append(self.shards[first][offset:offset + take])
            start += take
            first += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def open_split(folder: str | Path, manifest: dict, split: str) -> ShardedTokens:
    """The shards of ``split`` memory-mapped, each checked against its manifest entry's size."""
    folder = Path(folder)
    dtype = np.dtype(manifest["dtype"])
    maps = []
    for shard in manifest["shards"]:
        if shard["split"] != split or not shard["tokens"]:
            continue
        path = folder / shard["file"]
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise DataError(f"{path}: listed in the manifest, cannot open it ({exc.strerror or exc})") from exc
        if size != shard["tokens"] * dtype.itemsize:
            raise DataError(f"{path}: {size} bytes, the manifest says {shard['tokens']} {dtype.name} tokens "
                            f"({shard['tokens'] * dtype.itemsize} bytes)")
        maps.append(np.memmap(path, dtype=dtype, mode="r"))
    return ShardedTokens(maps)


def prepared_folder(paths: list[str]) -> Path | None:
    """The prepared folder ``data.paths`` names (its only entry, holding a manifest), else None."""
    return Path(paths[0]) if len(paths) == 1 and is_prepared(paths[0]) else None


def prepared_tokenizer_spec(paths: list[str]) -> str | None:
    """The tokenizer of a run on the prepared folder ``data.paths`` names, as ``data.tokenizer``'s shared form
    ``sha256:<hex>`` (the manifest's digest; the run directory's ``tokenizer.json`` is that file's copy), else None."""
    folder = prepared_folder(paths)
    return None if folder is None else "sha256:" + read_manifest(folder, complete=False)["tokenizer"]["sha256"]


def copy_tokenizer(folder: Path, out_dir: Path) -> Path:
    """Keep a prepared folder's tokenizer in a run's directory (``OUT/tokenizer.json``, written atomically when it
    differs), as ``tokenizer.save_tokenizer_copy`` does for ``data.tokenizer``; the file as it is (any
    ``tokenizer.json``). ``DataError`` if the folder has none."""
    from gossiploco.files import atomic_write_bytes

    try:
        data = (folder / TOKENIZER_FILE).read_bytes()
    except OSError as exc:
        raise DataError(f"{folder / TOKENIZER_FILE}: cannot read the prepared folder's tokenizer ({exc.strerror or exc})") from exc
    copy = Path(out_dir) / TOKENIZER_FILE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if not (copy.is_file() and copy.read_bytes() == data):
        atomic_write_bytes(copy, data)
    return copy


_DIGESTS: dict[str, tuple[tuple[int, int, int], str]] = {}
"""Digests already computed in this process: folder -> ((inode, size, mtime) of its manifest, digest)."""


def prepared_identity(path: str) -> str | None:
    """How a run's identity names the ``data.paths`` entry ``path``: ``prepared_digest`` for a prepared folder
    (also one whose digest this process knew and which has since moved or been deleted), the entry itself when
    it already is such a digest, None for anything else (a text or .bin file keeps its path)."""
    if path.startswith("prepared:sha256:"):
        return path
    if path in _DIGESTS or is_prepared(path):
        return prepared_digest(path)
    return None


def prepared_digest(folder: str | Path) -> str:
    """``prepared:sha256:<hex>``: the folder's data as a run's identity names it (the tokenizer's digest, the
    token dtype and every shard's name and token count), not its path. Remembered per folder while its
    manifest is unchanged, and kept when the folder disappears mid-run; ``DataError`` if never readable."""
    key = str(folder)
    path = Path(folder) / MANIFEST
    try:
        stat = path.stat()
    except OSError as exc:
        if key in _DIGESTS:
            return _DIGESTS[key][1]
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    known = _DIGESTS.get(key)
    if known is None or known[0] != signature:
        manifest = read_manifest(folder, complete=False)
        identity = {"tokenizer": manifest["tokenizer"]["sha256"], "eot_id": manifest["tokenizer"]["eot_id"],
                    "dtype": manifest["dtype"], "complete": bool(manifest.get("complete")),
                    "shards": [[s["file"], s["tokens"]] for s in manifest["shards"]]}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        known = signature, f"prepared:sha256:{digest}"
        _DIGESTS[key] = known
    return known[1]
