"""``gossiploco data prepare``: corpus sources tokenized once into a prepared folder (``gossiploco.prepared_corpus``).

``prepare`` reads the sources' documents in order (``gossiploco.corpus_sources``; a background thread reads
and decodes while the tokenizer works), tokenizes them in batches with Hugging Face ``tokenizers``
(``encode_batch``: parallel over the batch, on ``workers`` threads), appends the end-of-text id after each
document, and sends each document whole to the training or the validation split by a stable hash of
(source file name, row): the split does not depend on the order or number of sources, nor on where an
interrupted run stopped.

Shards are closed at document boundaries: when the training buffer holds ``shard_tokens`` tokens, it is
written as the next training shard and whatever the validation buffer holds as the next validation
shard, each atomically (temporary file, fsync, rename), then the manifest is rewritten atomically with
the new shards and the *position*, the source and row the next shard starts at. So after an
interruption the folder holds finished shards only, the manifest names exactly those, and running the
same command again continues at the position (a shard file not yet in the manifest is written again
under the same name): the result equals an uninterrupted run's, with no shard twice.

An existing folder is continued only when its manifest is unfinished and of the same settings (tokenizer
digest, sources' sizes and digests, column, split fraction, shard size); a finished one, one of other
settings, or a non-empty folder without a manifest is refused unless ``overwrite``, which deletes the
prepared files (manifest, tokenizer copy, shards, temporary files) and nothing else.

Null and empty documents are skipped and counted (``skipped`` in the manifest, and a warning); anything
else wrong with the input raises ``DataError`` naming the file and the row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gossiploco.corpus_sources import Source, find_sources
from gossiploco.errors import ConfigError, DataError
from gossiploco.files import atomic_write, atomic_write_bytes
from gossiploco.prepared_corpus import FORMAT, MANIFEST, SPLITS, TOKENIZER_FILE, VERSION, read_manifest

__all__ = ["EOT_CANDIDATES", "PrepareOptions", "PreparedTokenizer", "prepare"]
log = logging.getLogger(__name__)

EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
"""End-of-text tokens looked for, in this order, when ``--eot-token`` does not name one (GPT-2 / Qwen /
our own BPE; Llama 3; Llama 2 / Mistral / TinyLlama; Gemma; others), before the post-processor's."""
BATCH_BYTES = 4 << 20
"""Text per ``encode_batch`` call: enough documents to keep every thread busy, little memory."""
BATCH_DOCUMENTS = 4096
_QUEUED_BATCHES = 4
"""Batches the reading thread may be ahead of the tokenizer."""
TOKENIZER_COPY = TOKENIZER_FILE
_SPLIT_SALT = b"gossiploco-split"


@dataclass(frozen=True)
class PrepareOptions:
    """How ``prepare`` reads, splits and shards (the CLI's flags)."""

    text_column: str = "text"
    """The column (Parquet, datasets) or key (JSON Lines) holding each document's text."""
    val_fraction: float = 0.01
    """Fraction of documents sent to the validation split (by a stable hash of source name and row)."""
    shard_tokens: int = 50_000_000
    """A training shard is closed at the first document boundary at or after this many tokens."""
    workers: int = 0
    """Tokenizer threads (0: one per core); set through RAYON_NUM_THREADS, so it applies when set before this
    process first tokenized anything in parallel."""
    eot_token: str | None = None
    """The end-of-text token's text, when the tokenizer does not name one itself."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError("--val-fraction", f"must be in [0, 1), got {self.val_fraction}")
        if self.shard_tokens < 1:
            raise ConfigError("--shard-tokens", f"must be >= 1, got {self.shard_tokens}")
        if self.workers < 0:
            raise ConfigError("--workers", f"must be >= 0 (0: one per core), got {self.workers}")
        if not self.text_column:
            raise ConfigError("--text-column", "must not be empty")


class PreparedTokenizer:
    """A ``tokenizer.json`` as ``prepare`` uses it: any Hugging Face ``tokenizers`` file, its digest, vocabulary
    size and end-of-text id. ``DataError`` when unreadable or when it names no end-of-text token."""

    def __init__(self, path: str | Path, eot_token: str | None = None):
        from tokenizers import Tokenizer

        self.path = Path(path)
        try:
            self.raw = self.path.read_bytes()
            self.tokenizer = Tokenizer.from_str(self.raw.decode("utf-8"))
        except OSError as exc:
            raise DataError(f"tokenizer {self.path}: cannot read it ({exc.strerror or exc})") from exc
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for every parse error
            raise DataError(f"tokenizer {self.path}: not a Hugging Face tokenizer.json ({exc})") from exc
        self.tokenizer.encode_special_tokens = True  # text is text: a literal "</s>" in a document is not a separator
        self.sha256 = hashlib.sha256(self.raw).hexdigest()
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.dtype = np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)
        self.eot_token, self.eot_id = self._end_of_text(eot_token)

    def _end_of_text(self, name: str | None) -> tuple[str, int]:
        if name is not None:
            found = self.tokenizer.token_to_id(name)
            if found is None:
                raise DataError(f"tokenizer {self.path}: --eot-token {name!r} is not one of its tokens")
            return name, found
        for candidate in EOT_CANDIDATES:
            found = self.tokenizer.token_to_id(candidate)
            if found is not None:
                return candidate, found
        named = _post_processor_end(json.loads(self.raw).get("post_processor"))
        if named is not None and self.tokenizer.token_to_id(named) is not None:
            return named, self.tokenizer.token_to_id(named)
        raise DataError(f"tokenizer {self.path}: names no end-of-text token (none of {', '.join(EOT_CANDIDATES)}, "
                        "nor a special token ending its post-processor's template); name it with --eot-token")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text (no special tokens added), in parallel; without character offsets where the
        library can (``encode_batch_fast``, tokenizers >= 0.20: measured twice as fast)."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]


def _post_processor_end(processor: dict | None) -> str | None:
    """The special token a ``TemplateProcessing`` post-processor puts after a single sequence, if any."""
    if not isinstance(processor, dict):
        return None
    if processor.get("type") == "Sequence":
        for inner in reversed(processor.get("processors") or []):
            if (found := _post_processor_end(inner)) is not None:
                return found
        return None
    if processor.get("type") != "TemplateProcessing" or not processor.get("single"):
        return None
    last = processor["single"][-1]
    return last["SpecialToken"]["id"] if isinstance(last, dict) and "SpecialToken" in last else None


def is_val(key: str, row: int, fraction: float) -> bool:
    """Whether row ``row`` of the source named ``key`` goes to the validation split (stable across runs)."""
    digest = hashlib.blake2b(f"{key}\0{row}".encode(), digest_size=8, key=_SPLIT_SALT).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


@dataclass
class _Batch:
    rows: list[tuple[int, int, str | None]]
    """(source index, row, text or None) of each document, in order."""
    done_bytes: float
    """Source bytes read up to this batch's end (an estimate inside a source)."""


def _read_batches(sources: list[Source], column: str, position: dict, sizes: list[int]) -> Iterator[_Batch]:
    rows: list[tuple[int, int, str | None]] = []
    size = 0
    for index in range(position["source"], len(sources)):
        start = position["row"] if index == position["source"] else 0
        before = sum(sizes[:index])
        for doc in sources[index].read(column, start):
            rows.append((index, doc.row, doc.text))
            size += len(doc.text) if doc.text else 0
            if size >= BATCH_BYTES or len(rows) >= BATCH_DOCUMENTS:
                yield _Batch(rows, before + doc.fraction * sizes[index])
                rows, size = [], 0
    if rows:
        yield _Batch(rows, float(sum(sizes)))


def _in_background(batches: Iterator[_Batch]) -> Iterator[_Batch]:
    """``batches`` produced by a daemon thread, at most ``_QUEUED_BATCHES`` ahead; its error is raised here."""
    waiting: queue.Queue = queue.Queue(maxsize=_QUEUED_BATCHES)
    stop = threading.Event()
    end = object()

    def offer(item: object) -> bool:
        """Queue ``item`` unless the consumer stopped (then False: the thread ends and its files close)."""
        while not stop.is_set():
            try:
                waiting.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not offer(batch):
                    return
            offer(end)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            offer(exc)

    thread = threading.Thread(target=produce, name="prepare-reader", daemon=True)
    thread.start()
    try:
        while (item := waiting.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


class _Shards:
    """The folder's shards and manifest: buffers documents per split, writes shards and the manifest atomically."""

    def __init__(self, out: Path, manifest: dict, dtype: np.dtype, shard_tokens: int):
        self.out, self.manifest, self.dtype, self.shard_tokens = out, manifest, dtype, shard_tokens
        self.buffers: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
        self.buffered = {split: 0 for split in SPLITS}
        self.documents = {split: 0 for split in SPLITS}

    def add(self, split: str, ids: np.ndarray) -> None:
        self.buffers[split].append(ids)
        self.buffered[split] += len(ids)
        self.documents[split] += 1

    def full(self) -> bool:
        return self.buffered["train"] >= self.shard_tokens

    def flush(self, position: dict, *, complete: bool = False) -> None:
        """Write the buffered documents as the next shard of each split that has any, then the manifest (whose
        position says where the next shard starts)."""
        manifest = self.manifest
        for split in SPLITS:
            if not self.buffers[split]:
                continue
            tokens = np.concatenate(self.buffers[split])
            number = sum(1 for s in manifest["shards"] if s["split"] == split)
            name = f"{split}-{number:05d}.bin"
            atomic_write(self.out / name, tokens.tofile)
            manifest["shards"].append({"file": name, "split": split, "tokens": int(len(tokens)),
                                       "documents": self.documents[split], "end": dict(position)})
            totals = manifest["splits"][split]
            totals["tokens"] += int(len(tokens))
            totals["documents"] += self.documents[split]
            totals["shards"] += 1
            self.buffers[split], self.buffered[split], self.documents[split] = [], 0, 0
        manifest["position"] = dict(position)
        manifest["complete"] = complete
        write_manifest(self.out, manifest)


def write_manifest(out: Path, manifest: dict) -> None:
    atomic_write_bytes(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))


def _prepared_files(out: Path) -> list[Path]:
    """The files ``prepare`` writes in ``out`` (what ``overwrite`` deletes)."""
    names = {MANIFEST, TOKENIZER_COPY}
    return [p for p in out.iterdir() if p.is_file() and (
        p.name in names or (p.name.startswith(".") and p.name.endswith(".tmp"))
        or (p.suffix == ".bin" and p.name.split("-")[0] in SPLITS))]


def _open_folder(out: Path, settings: dict, overwrite: bool) -> dict:
    """The manifest to continue from: a new one, or the unfinished one of the same settings in ``out``."""
    fresh = {"format": FORMAT, "version": VERSION, **settings, "shards": [], "position": {"source": 0, "row": 0},
             "splits": {s: {"tokens": 0, "documents": 0, "shards": 0} for s in SPLITS}, "skipped": {"empty": 0},
             "complete": False}
    if not out.exists():
        out.mkdir(parents=True)
        return fresh
    if not out.is_dir():
        raise ConfigError("--out", f"{out} is a file, not a folder")
    if overwrite:
        for path in _prepared_files(out):
            path.unlink()
        return fresh
    if not (out / MANIFEST).is_file():
        if any(out.iterdir()):
            raise ConfigError("--out", f"{out} is not empty and holds no prepared data; choose another folder "
                                       "(--overwrite deletes only prepared files: manifest, shards, tokenizer copy)")
        return fresh
    old = read_manifest(out, complete=False)
    if old.get("complete"):
        raise ConfigError("--out", f"{out} holds a finished preparation ({old['splits']['train']['tokens']} training "
                                   "tokens); use another folder, or --overwrite to prepare it again")
    differ = [k for k in settings if old.get(k) != settings[k]]
    if differ:
        raise ConfigError("--out", f"{out} holds an unfinished preparation with other settings ({', '.join(differ)} "
                                   "differ); rerun with the same sources, tokenizer and flags to continue it, or "
                                   "--overwrite to start again")
    listed = {s["file"] for s in old["shards"]}
    for path in _prepared_files(out):  # shards written after the manifest's last update, and temporary files
        if path.suffix == ".bin" and path.name not in listed or path.name.endswith(".tmp"):
            path.unlink()
    return old


ProgressFn = Callable[[int, int, float, float], None]
"""``progress(documents, tokens, source bytes read, source bytes in all)``: called after each batch."""


def prepare(specs: list[str], tokenizer_file: str | Path, out: str | Path, options: PrepareOptions = PrepareOptions(),
            *, overwrite: bool = False, progress: ProgressFn | None = None) -> dict:
    """Tokenize the sources ``specs`` name into the prepared folder ``out`` (see the module docstring) and
    return its manifest. Continues an unfinished folder of the same settings. ``DataError`` for bad input
    (naming file and row), ``ConfigError`` for a bad option or a folder it may not write."""
    out = Path(out)
    if options.workers:
        os.environ["RAYON_NUM_THREADS"] = str(options.workers)
    tokenizer = PreparedTokenizer(tokenizer_file, options.eot_token)
    sources = find_sources(specs)
    sizes = [source.size() for source in sources]
    settings = {
        "tokenizer": {"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
                      "eot_token": tokenizer.eot_token},
        "dtype": tokenizer.dtype.name, "text_column": options.text_column, "val_fraction": options.val_fraction,
        "shard_tokens": options.shard_tokens,
        "sources": [{"path": str(s.path), "kind": s.kind, "bytes": size, "sha256": s.sha256()}
                    for s, size in zip(sources, sizes)],
    }
    manifest = _open_folder(out, settings, overwrite)
    write_manifest(out, manifest)  # at once: a folder stopped before its first shard is an unfinished preparation too
    if not (out / TOKENIZER_COPY).is_file():
        atomic_write_bytes(out / TOKENIZER_COPY, tokenizer.raw)
    shards = _Shards(out, manifest, tokenizer.dtype, options.shard_tokens)
    position = dict(manifest["position"])
    documents = sum(t["documents"] for t in manifest["splits"].values())
    tokens = sum(t["tokens"] for t in manifest["splits"].values())
    skipped = manifest["skipped"]
    eot = np.array([tokenizer.eot_id], dtype=tokenizer.dtype)
    if manifest["shards"]:
        log.info("%s: continuing an unfinished preparation at %s row %d (%d shard(s) done)", out,
                 sources[position["source"]].path if position["source"] < len(sources) else "the end",
                 position["row"], len(manifest["shards"]))
    for batch in _in_background(_read_batches(sources, options.text_column, position, sizes)):
        encoded = iter(tokenizer.encode_batch([text for _, _, text in batch.rows if text is not None]))
        for index, row, text in batch.rows:
            position = {"source": index, "row": row + 1}
            if text is None:
                skipped["empty"] += 1
                log.debug("%s: row %d: empty or null, skipped", sources[index].path, row)
                continue
            ids = np.concatenate([np.asarray(next(encoded), dtype=tokenizer.dtype), eot])
            shards.add("val" if is_val(sources[index].key, row, options.val_fraction) else "train", ids)
            documents += 1
            tokens += len(ids)
            if shards.full():
                shards.flush(position)
        if progress is not None:
            progress(documents, tokens, batch.done_bytes, float(sum(sizes)))
    shards.flush({"source": len(sources), "row": 0}, complete=True)
    if skipped["empty"]:
        log.warning("%s: skipped %d empty or null document(s) (counted in the manifest's 'skipped')", out, skipped["empty"])
    if not manifest["splits"]["val"]["tokens"]:
        log.warning("%s: the validation split is empty (%d documents, --val-fraction %g); training needs one",
                    out, documents, options.val_fraction)
    return manifest
