"""Tokenizers: the byte-level default and a byte-level BPE trained locally with Hugging Face ``tokenizers``.

Both map any text to ids without unknowns, and both keep one id, ``separator_id``, for the boundary
between documents (the end of text): the corpus is every document's tokens followed by the separator.

* ``ByteTokenizer``: a UTF-8 byte is its own id (0..255); id 0 (NUL, which text files do not contain)
  is the separator. Needs no file, and is what runs use unless ``data.tokenizer`` names one.
* ``BPETokenizer``: a ``tokenizers`` JSON file written by ``train_bpe`` (``gossiploco tokenizer train``):
  the ByteLevel pre-tokenizer turns text into bytes first, so any text encodes; ``<|endoftext|>`` is
  id 0 and the separator. A checkpoint's tokenizer (``--init``: Llama 3's, SmolLM's, TinyLlama's...) loads
  too, with its own end of text as the separator (``END_OF_TEXT_TOKENS``). The file's SHA-256 names the tokenizer in the run's identity (not its path:
  peers keep it wherever they like; see ``tokenizer_digest`` and ``checkpoint.shared_config``).

Both serialize to Hugging Face ``tokenizers`` JSON (``to_hf_json``), so an exported model can be used
with ``transformers.PreTrainedTokenizerFast(tokenizer_file=...)``. ``encode`` reads its text as text:
a literal ``<|endoftext|>`` in a document is encoded as characters, never as the separator, which
only the caller puts between documents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from gossiploco.errors import ConfigError, DataError

BYTE_VOCAB = 256
BYTE_SPECS = ("", "bytes")
"""Values of ``data.tokenizer`` that mean the byte-level tokenizer."""
END_OF_TEXT = "<|endoftext|>"
"""The BPE tokenizer's special token: id 0, the document separator."""
END_OF_TEXT_TOKENS = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>")
"""A tokenizer file's document separator: the first of these it has as a special token (ours, GPT-2's,
SmolLM's and Qwen's; Llama 3's; Llama 2's, TinyLlama's and Mistral's; Gemma's)."""
TOKENIZER_FILE = "tokenizer.json"
"""The tokenizer's copy in a run directory (``save_tokenizer_copy``) and in an exported model folder."""
MAX_VOCAB = 1 << 20
_ENCODE_BATCH = 256
"""Documents per ``encode_batch`` call: large enough to use every core, small enough to bound memory."""
_PROBE = "Grüße, 世界! ✓ \t\r\n  x = [1, 2]  # <|endoftext|> \u0100 😀"
"""Text a usable tokenizer must encode and decode back unchanged (unicode, whitespace, the special token)."""


class Tokenizer(Protocol):
    """What the corpus loader, the exporter and inference need from a tokenizer. Methods are pure and
    thread-safe."""

    vocab_size: int
    """Ids are 0..vocab_size-1 (the model's embedding rows)."""
    separator_id: int
    """The id between documents (end of text)."""
    sha256: str | None
    """SHA-256 hex of the tokenizer file; None for the byte-level tokenizer (no file)."""

    def encode(self, text: str) -> np.ndarray:
        """Ids of ``text`` (unsigned integers), read as plain text."""

    def decode(self, ids) -> str:
        """The text of ``ids``, separators left out."""

    def encode_documents(self, documents: list[bytes]) -> np.ndarray:
        """Every document (UTF-8 file contents) encoded and followed by the separator, in one array."""

    def to_hf_json(self) -> str:
        """This tokenizer as Hugging Face ``tokenizers`` JSON (``tokenizers.Tokenizer.from_str`` loads it)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table, which ``tokenizers``' ByteLevel pre-tokenizer applies: printable
    bytes stand for themselves, the others are shifted to characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; token 0 (NUL) separates documents."""

    vocab_size = BYTE_VOCAB
    separator_id = 0
    sha256 = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(t) for t in ids if t != self.separator_id).decode("utf-8", errors="replace")

    def encode_documents(self, documents: list[bytes]) -> np.ndarray:
        sep = bytes([self.separator_id])
        return np.frombuffer(sep.join(documents) + sep, dtype=np.uint8)

    def to_hf_json(self) -> str:
        """A BPE model with the 256 byte tokens and no merges behind the ByteLevel pre-tokenizer, so an id is
        exactly its byte. Byte 0 is registered as the special end-of-text token under its own text, NUL
        (not the ByteLevel character standing for it, U+0100, which real text may contain): NUL in a text
        is matched as the special token before pre-tokenization and still gets id 0."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        chars = _bytes_to_unicode()
        vocab = {chars[b]: b for b in range(1, 256)}
        vocab["\x00"] = 0
        tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([AddedToken("\x00", special=True, normalized=False)])
        return tokenizer.to_str()


class BPETokenizer:
    """A byte-level BPE tokenizer from a ``tokenizers`` JSON file (see the module docstring).

    Raises ``DataError`` when the file is missing, unreadable, not a tokenizer, has no end-of-text token
    (``END_OF_TEXT_TOKENS``), or cannot encode any text losslessly."""

    def __init__(self, path: Path | str):
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise DataError(f"tokenizer {self.path}: cannot read it ({exc.strerror or exc}); train one with "
                            "`gossiploco tokenizer train`") from exc
        try:
            self._json = raw.decode("utf-8")
            self._tokenizer = HFTokenizer.from_str(self._json)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for every parse error
            raise DataError(f"tokenizer {self.path}: not a Hugging Face tokenizers JSON file ({exc})") from exc
        separator = end_of_text_id(self._tokenizer)
        if separator is None:
            raise DataError(f"tokenizer {self.path}: has no end-of-text token (the document separator: one of "
                            f"{', '.join(END_OF_TEXT_TOKENS)}, as a special token); train one with `gossiploco "
                            "tokenizer train`")
        self.separator_id = separator
        self._tokenizer.encode_special_tokens = True  # text is text: the separator only comes from the caller
        self.vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        self.sha256 = hashlib.sha256(raw).hexdigest()
        if self.decode(self.encode(_PROBE)) != _PROBE:
            raise DataError(f"tokenizer {self.path}: does not encode text losslessly (not byte-level BPE?); "
                            "train one with `gossiploco tokenizer train`")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(t) for t in ids if t != self.separator_id], skip_special_tokens=True)

    def encode_documents(self, documents: list[bytes]) -> np.ndarray:
        parts = []
        separator = np.array([self.separator_id], dtype=self.dtype)
        for start in range(0, len(documents), _ENCODE_BATCH):
            texts = [d.decode("utf-8", errors="replace") for d in documents[start:start + _ENCODE_BATCH]]
            for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False):
                parts += [np.asarray(encoding.ids, dtype=self.dtype), separator]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def to_hf_json(self) -> str:
        """The file's text, unchanged (so its SHA-256 is still ``sha256``)."""
        return self._json

    def __repr__(self) -> str:
        return f"BPETokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def end_of_text_id(tokenizer) -> int | None:
    """The id of the first of ``END_OF_TEXT_TOKENS`` that ``tokenizer`` (a ``tokenizers.Tokenizer``) has as a
    special token, or None."""
    special = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()
               if token.special}
    return next((special[name] for name in END_OF_TEXT_TOKENS if name in special), None)


def load_tokenizer(spec: str | Path | None) -> ByteTokenizer | BPETokenizer:
    """The tokenizer ``data.tokenizer`` names: "" / None / "bytes" the byte-level one, else a JSON file's path."""
    if spec is None or str(spec) in BYTE_SPECS:
        return ByteTokenizer()
    return BPETokenizer(spec)


_DIGESTS: dict[str, tuple[tuple[int, int, int], str]] = {}
"""Digests already computed in this process: path -> ((inode, size, mtime), "sha256:<hex>")."""


def tokenizer_digest(spec: str) -> str | None:
    """How a run's identity names the tokenizer ``spec``: None for bytes, ``sha256:<hex>`` of the file
    otherwise (a spec already in that form is returned as is). ``ConfigError`` if the file is unreadable.

    Remembered per path while the file is unchanged, and kept when it disappears: a run's checkpoints
    (which record the digest) go on after its tokenizer file was moved or deleted mid-run."""
    if spec in BYTE_SPECS:
        return None
    if spec.startswith("sha256:"):
        return spec
    path = Path(spec)
    try:
        stat = path.stat()
        signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        known = _DIGESTS.get(spec)
        if known is None or known[0] != signature:
            known = signature, "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
            _DIGESTS[spec] = known
        return known[1]
    except OSError as exc:
        if spec in _DIGESTS:
            return _DIGESTS[spec][1]
        raise ConfigError("data.tokenizer", f"cannot read {spec}: {exc.strerror or exc}") from exc


# -- training ----------------------------------------------------------------------------------------


def _documents(files: list[Path], max_mb: float) -> Iterator[str]:
    budget = int(max_mb * 2**20) if max_mb else None
    used = 0
    for path in files:
        try:
            doc = path.read_bytes().replace(b"\x00", b"")
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if not doc:
            continue
        yield doc.decode("utf-8", errors="replace")
        used += len(doc)
        if budget is not None and used >= budget:
            return


def train_bpe(files: list[Path] | None, vocab_size: int, out: Path, *, max_mb: float = 0.0,
              overwrite: bool = False) -> BPETokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens (``<|endoftext|>`` = id 0, the 256 bytes,
    then merges) on ``files`` (default: the built-in corpus, the stdlib's sources), reading at most
    ``max_mb`` MB of text (0: all), and write it atomically to ``out``. A small corpus may give fewer
    tokens than asked. ``ConfigError`` for a bad vocabulary size or an existing ``out`` (unless
    ``overwrite``), ``DataError`` when no text can be read."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from gossiploco.files import atomic_write_bytes

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not BYTE_VOCAB + 1 <= vocab_size <= MAX_VOCAB:
        raise ConfigError("--vocab-size", f"must be an integer in {BYTE_VOCAB + 1}..{MAX_VOCAB} (the 256 bytes, "
                                        f"{END_OF_TEXT} and merges), got {vocab_size!r}")
    if max_mb < 0:
        raise ConfigError("--max-mb", f"must be >= 0, got {max_mb}")
    out = Path(out)
    if out.exists() and not overwrite:
        raise ConfigError("--out", f"{out} exists; a tokenizer is not overwritten unless asked (--overwrite): runs "
                                 "trained with it would no longer match it")
    if not files:
        from gossiploco.builtin_corpus import stdlib_files

        files = stdlib_files()
    seen = [0]

    def counted(docs: Iterator[str]) -> Iterator[str]:
        for doc in docs:
            seen[0] += 1
            yield doc

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(counted(_documents([Path(f) for f in files], max_mb)), trainer)
    if not seen[0]:
        raise DataError(f"tokenizer training: no text in {len(files)} file(s) (every one is empty)")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, tokenizer.to_str(pretty=True).encode("utf-8"))
    return BPETokenizer(out)


# -- a run's tokenizer -------------------------------------------------------------------------------


def save_tokenizer_copy(tokenizer: ByteTokenizer | BPETokenizer, out_dir: Path) -> Path | None:
    """Keep the run's tokenizer in its output directory (``OUT/tokenizer.json``, written atomically), so the
    model can be used after the original file moved. Nothing for the byte-level tokenizer (returns None)."""
    if tokenizer.sha256 is None:
        return None
    from gossiploco.files import atomic_write_bytes

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy = out_dir / TOKENIZER_FILE
    if not (copy.is_file() and hashlib.sha256(copy.read_bytes()).hexdigest() == tokenizer.sha256):
        atomic_write_bytes(copy, tokenizer.to_hf_json().encode("utf-8"))
    return copy


def data_tokenizer_file(spec: str, paths: list[str]) -> Path | None:
    """The file the data is tokenized with, given ``data.tokenizer`` (``spec``) and ``data.paths``: the tokenizer
    file, or a prepared folder's copy; None for byte-level text and ``.bin`` files."""
    if str(spec) not in BYTE_SPECS:
        return Path(spec)
    from gossiploco.prepared_corpus import TOKENIZER_FILE, prepared_folder

    folder = prepared_folder([str(p) for p in paths])
    return folder / TOKENIZER_FILE if folder is not None and (folder / TOKENIZER_FILE).is_file() else None


def data_tokenizer_spec(data: dict) -> str:
    """A run's ``data.tokenizer``, or, when it is empty and ``data.paths`` is a prepared folder, the folder's
    tokenizer in the shared form ``sha256:<hex>`` (``prepared_corpus.prepared_tokenizer_spec``)."""
    spec = str(data.get("tokenizer", ""))
    if spec in BYTE_SPECS:
        from gossiploco.prepared_corpus import prepared_tokenizer_spec

        spec = prepared_tokenizer_spec([str(p) for p in data.get("paths") or []]) or spec
    return spec


def run_tokenizer(run_dir: Path, config: dict, sha256: str | None = None) -> ByteTokenizer | BPETokenizer:
    """The tokenizer a run (or exported model folder) ``run_dir`` was trained with, given its stored config
    dict: bytes when ``data.tokenizer`` is empty, else ``run_dir/tokenizer.json`` if present, else the
    configured path. The file's SHA-256 must match ``sha256`` (hex, or ``sha256:<hex>``) or, without it, a
    ``sha256:<hex>`` the config holds in place of the path (its shared form). A run on a prepared folder
    (``data_tokenizer_spec``; or, the folder gone, a model file recording ``sha256``) uses its copy
    ``run_dir/tokenizer.json``. ``DataError`` if it cannot be found or differs."""
    spec = data_tokenizer_spec(config.get("data") or {})
    if spec in BYTE_SPECS and sha256:
        spec = "sha256:" + sha256.removeprefix("sha256:")  # a byte-level run's model file records no tokenizer digest
    if spec in BYTE_SPECS:
        return ByteTokenizer()
    expected = sha256 or (spec if spec.startswith("sha256:") else None)
    expected = expected.removeprefix("sha256:") if expected else None
    candidates = [Path(run_dir) / TOKENIZER_FILE] + ([] if spec.startswith("sha256:") else [Path(spec)])
    found = [p for p in candidates if p.is_file()]
    if not found:
        raise DataError(f"{run_dir}: trained with the tokenizer {spec}, but neither "
                        + " nor ".join(str(p) for p in candidates) + " exists; put the tokenizer file there")
    tokenizer = BPETokenizer(found[0])
    if expected is not None and tokenizer.sha256 != expected:
        raise DataError(f"{found[0]}: SHA-256 {tokenizer.sha256[:12]}... differs from the run's tokenizer "
                        f"{expected[:12]}...: another tokenizer than the one the model was trained with")
    return tokenizer

