"""``gossiploco data``: prepare a corpus once (``gossiploco.prepare``) so peers train from it with ``--data DIR``.

A sub-app of the ``gossiploco`` command line (registered in ``gossiploco.cli``); it does not import that module.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gossiploco.errors import GossiplocoError
from gossiploco.runtime.stopping import exit_stopped, stops_cleanly

data_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="Prepare training data: tokenize Parquet, JSON Lines, text or datasets folders once.")
console = Console(stderr=True)


class _Rates:
    """The progress bar's documents/s and tokens/s since the command started."""

    def __init__(self, progress: Progress, task: int):
        self.progress, self.task, self.start = progress, task, time.perf_counter()
        self.documents = self.tokens = 0

    def __call__(self, documents: int, tokens: int, done_bytes: float, total_bytes: float) -> None:
        self.documents, self.tokens = documents, tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.progress.update(self.task, completed=done_bytes, total=total_bytes,
                             rates=f"{documents:,} docs ({documents / elapsed:,.0f}/s)  {tokens:,} tokens "
                                   f"({tokens / elapsed:,.0f}/s)")


@data_app.command()
@stops_cleanly("data prepare")
def prepare(
    sources: list[str] = typer.Argument(..., help="Parquet, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst), text files, globs, folders, or datasets folders (save_to_disk)."),
    tokenizer: Path = typer.Option(..., "--tokenizer", help="A Hugging Face tokenizer.json (GPT-2, Llama 3, Qwen, Mistral, or `gossiploco tokenizer train`'s)."),
    out: Path = typer.Option(..., "--out", "-o", help="The folder to write: manifest.json, train-*.bin, val-*.bin, tokenizer.json."),
    text_column: str = typer.Option("text", "--text-column", help="The column (Parquet, datasets) or key (JSON Lines) holding the text."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Fraction of documents held out for validation (by a stable hash of file name and row)."),
    shard_tokens: int = typer.Option(50_000_000, "--shard-tokens", help="Tokens per training shard (closed at the next document boundary)."),
    workers: int = typer.Option(0, "--workers", help="Tokenizer threads (0: one per core)."),
    eot_token: Optional[str] = typer.Option(None, "--eot-token", help="The end-of-text token, when the tokenizer names none of the usual ones."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Prepare again into a folder that holds a finished or other preparation."),
) -> None:
    """Tokenize SOURCES into a prepared folder; peers train from it with --data OUT. Rerun the same command to continue an interrupted run."""
    from gossiploco.prepare import PrepareOptions
    from gossiploco.prepare import prepare as run_prepare

    start = time.perf_counter()
    columns = [TextColumn("[bold]prepare"), BarColumn(), TextColumn("{task.percentage:>5.1f}% of the sources' bytes"),
               TextColumn("{task.fields[rates]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    try:
        options = PrepareOptions(text_column=text_column, val_fraction=val_fraction, shard_tokens=shard_tokens,
                                 workers=workers, eot_token=eot_token)
        with Progress(*columns, console=console, transient=False) as progress:
            rates = _Rates(progress, progress.add_task("prepare", total=None, rates=""))
            manifest = run_prepare(sources, tokenizer, out, options, overwrite=overwrite, progress=rates)
    except KeyboardInterrupt:
        exit_stopped("data prepare", f"the finished shards are kept; run the same command again to continue in {out}")
    except GossiplocoError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=2) from None
    elapsed = time.perf_counter() - start
    splits = manifest["splits"]
    console.print(f"prepared {len(manifest['sources'])} source(s) into {out} in {elapsed:.1f} s: train "
                  f"{splits['train']['tokens']:,} tokens ({splits['train']['documents']:,} documents, "
                  f"{splits['train']['shards']} shard(s)), val {splits['val']['tokens']:,} tokens; "
                  f"{manifest['dtype']}, vocabulary {manifest['tokenizer']['vocab_size']}, end of text "
                  f"{manifest['tokenizer']['eot_token']!r} = {manifest['tokenizer']['eot_id']}")
    if manifest["skipped"]["empty"]:
        console.print(f"skipped {manifest['skipped']['empty']} empty or null document(s)")
    console.print(f"train from it: gossiploco simulate --data {out}", soft_wrap=True)
