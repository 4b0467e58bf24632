"""Reading documents from corpus files, streamed: Parquet, JSON Lines, text files and ``datasets`` folders.

A *source* is one file (or one ``datasets`` folder); its documents are numbered by *row* from 0, and a
reader can start at any row (``read(start_row)``), which is how an interrupted ``gossiploco data prepare``
continues where its last finished shard ended. Nothing reads a whole source into memory:

* Parquet (``.parquet``): one row group at a time with pyarrow, only the text column; rows before the
  start are skipped by whole row groups (from the file's metadata, without reading them).
* JSON Lines (``.jsonl``, ``.json``, ``.ndjson``, optionally ``.gz`` or ``.zst``): one object per line,
  decompressed as a stream (gzip; zstd with ``zstandard``); row = line number - 1. Rows before the start
  are read and dropped (a compressed stream cannot seek).
* Text files (any other file): the whole file is one document, row 0, decoded as UTF-8.
* ``datasets`` folders written by ``Dataset.save_to_disk`` (a directory with ``state.json`` or
  ``dataset_dict.json``): ``datasets.load_from_disk`` (memory-mapped Arrow), read in slices;
  ``datasets`` is imported only for them (``pip install 'gossiploco[datasets]'``).

A row whose value is null, or the empty string, yields None (the caller counts and skips it). Anything
else that is not text, a missing column, an unreadable or malformed file raises ``DataError`` naming
the file and the row.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gossiploco.errors import DataError

__all__ = ["Document", "Source", "find_sources"]

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSIONS = ("", ".gz", ".zst")
DATASETS_MARKERS = ("state.json", "dataset_dict.json")
"""Files that make a directory a ``datasets`` folder (a Dataset, or a DatasetDict, saved with ``save_to_disk``)."""
DATASETS_EXTRA = "pip install 'gossiploco[datasets]'"
_SLICE_ROWS = 1024
"""Rows read at once from a ``datasets`` folder."""
_FRACTION_EVERY = 256
"""A JSON Lines reader looks at its file position every this many lines (for the progress bar)."""


@dataclass(frozen=True)
class Document:
    """One row of a source: its text (None for a null or empty value) and how much of the source is read."""

    row: int
    text: str | None
    fraction: float
    """Approximate fraction of the source read so far (0..1), for progress bars."""


@dataclass(frozen=True)
class Source:
    """One corpus file or ``datasets`` folder, and how to read it."""

    path: Path
    kind: str
    """``parquet``, ``jsonl``, ``text`` or ``datasets``."""

    @property
    def key(self) -> str:
        """The source's name in the train/validation split hash: its file (or folder) name, so a moved corpus
        splits the same way."""
        return self.path.name

    def files(self) -> list[Path]:
        """The files the source is made of (sorted), for its size and digest."""
        if self.kind != "datasets":
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file())

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.files())

    def sha256(self) -> str:
        """SHA-256 hex of the file's bytes; of a ``datasets`` folder, of its files' relative names and bytes."""
        digest = hashlib.sha256()
        try:
            for path in self.files():
                if self.kind == "datasets":
                    digest.update(path.relative_to(self.path).as_posix().encode() + b"\0")
                with open(path, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
        except OSError as exc:
            raise DataError(f"{self.path}: cannot read it ({exc.strerror or exc})") from exc
        return digest.hexdigest()

    def read(self, column: str, start_row: int = 0) -> Iterator[Document]:
        """The source's documents from row ``start_row`` on (the text of ``column``; text files have none)."""
        reader = {"parquet": _read_parquet, "jsonl": _read_jsonl, "text": _read_text, "datasets": _read_datasets}
        return reader[self.kind](self.path, column, start_row)


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if any(name.endswith(s + c) for s in JSONL_SUFFIXES for c in COMPRESSIONS):
        return "jsonl"
    return "text"


def _is_datasets_folder(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in DATASETS_MARKERS)


def find_sources(specs: list[str]) -> list[Source]:
    """The sources ``specs`` name, in order: files, globs (sorted), ``datasets`` folders, and other directories
    (every file under them, sorted). ``DataError`` for an entry that names nothing."""
    sources: list[Source] = []
    for spec in specs:
        matches = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
        found: list[Source] = []
        for match in map(Path, matches):
            if _is_datasets_folder(match):
                found.append(Source(match, "datasets"))
            elif match.is_dir():
                found += [Source(p, _kind(p)) for p in sorted(match.rglob("*")) if p.is_file()]
            elif match.is_file():
                found.append(Source(match, _kind(match)))
        if not found:
            raise DataError(f"{spec}: no such file, folder or matching file")
        sources += found
    return sources


def _check_text(path: Path, row: int, value: object, what: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise DataError(f"{path}: {what} {row}: the text column holds a {type(value).__name__}, not text "
                        f"({str(value)[:60]!r})")
    return value


def _read_parquet(path: Path, column: str, start_row: int) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: cannot read it as Parquet ({exc})") from exc
    names = parquet.schema_arrow.names
    if column not in names:
        raise DataError(f"{path}: row 0: no column {column!r} (columns: {', '.join(names)}); choose one with --text-column")
    total = max(parquet.metadata.num_rows, 1)
    first = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if first + rows <= start_row:
            first += rows
            continue
        try:
            values = parquet.read_row_group(group, columns=[column]).column(0).to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{path}: rows {first}..{first + rows - 1} (row group {group}): cannot read them ({exc})") from exc
        for i, value in enumerate(values):
            row = first + i
            if row >= start_row:
                yield Document(row, _check_text(path, row, value, "row"), (row + 1) / total)
        first += rows


def _open_stream(path: Path, raw: io.BufferedReader):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw)
    return raw


def _read_jsonl(path: Path, column: str, start_row: int) -> Iterator[Document]:
    try:
        raw = open(path, "rb")
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    size = max(path.stat().st_size, 1)
    fraction = 0.0
    with raw:
        lines = io.TextIOWrapper(_open_stream(path, raw), encoding="utf-8", newline="\n")
        row = -1
        try:
            for row, line in enumerate(lines):
                if row % _FRACTION_EVERY == 0:
                    fraction = min(raw.tell() / size, 1.0)
                if row < start_row:
                    continue
                if not line.strip():
                    yield Document(row, None, fraction)
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {row + 1} (row {row}): not JSON ({exc})") from exc
                if not isinstance(record, dict):
                    raise DataError(f"{path}: line {row + 1} (row {row}): a JSON {type(record).__name__}, not an object")
                if column not in record:
                    raise DataError(f"{path}: line {row + 1} (row {row}): no key {column!r} (keys: "
                                    f"{', '.join(list(record)[:10])}); choose one with --text-column")
                yield Document(row, _check_text(path, row, record[column], "row"), fraction)
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - a corrupt stream (gzip, zstd) or not UTF-8: each library its own kind
            raise DataError(f"{path}: line {row + 2} (row {row + 1}): cannot read it ({exc})") from exc


def _read_text(path: Path, column: str, start_row: int) -> Iterator[Document]:
    if start_row > 0:
        return
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: row 0: not UTF-8 text (byte {exc.start}); a text file is one document") from exc
    yield Document(0, text or None, 1.0)


def _read_datasets(path: Path, column: str, start_row: int) -> Iterator[Document]:
    try:
        import datasets
    except ImportError as exc:
        raise DataError(f"{path}: a datasets folder needs the datasets library: {DATASETS_EXTRA}") from exc
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds for a broken folder
        raise DataError(f"{path}: cannot load it with datasets.load_from_disk ({exc})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(loaded)}); give "
                            "the split's folder instead")
        loaded = loaded["train"]
    if column not in loaded.column_names:
        raise DataError(f"{path}: row 0: no column {column!r} (columns: {', '.join(loaded.column_names)}); choose "
                        "one with --text-column")
    table = loaded.select_columns([column])
    total = max(len(table), 1)
    for first in range(start_row, len(table), _SLICE_ROWS):
        values = table[first:first + _SLICE_ROWS][column]
        for i, value in enumerate(values):
            row = first + i
            yield Document(row, _check_text(path, row, value, "row"), (row + 1) / total)
