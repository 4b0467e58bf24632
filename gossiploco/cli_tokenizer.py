"""``gossiploco tokenizer``: train a byte-level BPE tokenizer on local text (nothing is downloaded).

A sub-app of the ``gossiploco`` command line (registered in ``gossiploco.cli``); it does not import
that module, so either can be loaded first.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from gossiploco.errors import GossiplocoError
from gossiploco.runtime.stopping import stops_cleanly

tokenizer_app = typer.Typer(add_completion=False, no_args_is_help=True,
                            help="Train a byte-level BPE tokenizer for text data (data.tokenizer).")
console = Console(stderr=True)
SAMPLE_BYTES = 1 << 20
"""Text measured for the tokens-per-byte ratio that training prints."""


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(code=2)


def _sample(files: list[Path], limit: int) -> str:
    """Up to ``limit`` bytes of text from the start of ``files``, for the compression ratio."""
    parts, used = [], 0
    for path in files:
        if used >= limit:
            break
        chunk = path.read_bytes()[: limit - used].replace(b"\x00", b"")
        parts.append(chunk.decode("utf-8", errors="replace"))
        used += len(chunk)
    return "\n".join(parts)


@tokenizer_app.command()
@stops_cleanly("tokenizer train")
def train(
    data: Optional[list[str]] = typer.Option(None, "--data", help="Text files or globs to train on (default: the built-in corpus, the stdlib's sources)."),
    vocab_size: int = typer.Option(..., "--vocab-size", help="Tokens in the vocabulary: <|endoftext|> (id 0), the 256 bytes, then merges."),
    out: Path = typer.Option(..., "--out", "-o", help="The tokenizer JSON file to write (Hugging Face tokenizers format)."),
    max_mb: float = typer.Option(0.0, "--max-mb", help="Read at most this many MB of text (0: all of it)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out if it exists (runs trained with the old file will no longer match it)."),
) -> None:
    """Train a byte-level BPE tokenizer; use it with --set data.tokenizer=PATH."""
    from gossiploco.builtin_corpus import stdlib_files
    from gossiploco.data import expand_paths
    from gossiploco.tokenizer import train_bpe

    start = time.perf_counter()
    try:
        files = expand_paths(data) if data else stdlib_files()
        tokenizer = train_bpe(files, vocab_size, out, max_mb=max_mb, overwrite=overwrite)
        sample = _sample(files, SAMPLE_BYTES)
    except GossiplocoError as exc:
        _fail(exc)
    sample_bytes = len(sample.encode("utf-8"))
    ratio = len(tokenizer.encode(sample)) / max(sample_bytes, 1)
    source = f"{len(files)} file(s)" if data else f"the stdlib's sources ({len(files)} files)"
    console.print(f"trained a byte-level BPE tokenizer of {tokenizer.vocab_size} tokens on {source}"
                  f"{f' (first {max_mb:g} MB)' if max_mb else ''} in {time.perf_counter() - start:.1f} s")
    console.print(f"{ratio:.3f} tokens per byte on {sample_bytes} bytes of that text ({1 / max(ratio, 1e-9):.2f} bytes "
                  f"per token; byte-level: 1)")
    console.print(f"written to {out} (sha256 {tokenizer.sha256[:12]}...)")
    console.print(f"use it: gossiploco simulate --set data.tokenizer={out}  (every peer of a run needs the same file; "
                  "its hash is part of the run id)", soft_wrap=True)
