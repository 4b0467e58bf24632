"""``gossiploco export``, ``generate`` and ``eval``: using a trained model from the command line.

Each takes what ``model_file.load_model_source`` does: a run or swarm directory, a checkpoint's
JSON, a ``model.safetensors``, or an exported folder. ``register(app)`` adds the commands to the
``gossiploco`` app; this module does not import ``gossiploco.cli``, so either can be loaded first.
Results go to stdout (``generate``: the generated text and nothing else); diagnostics to stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from gossiploco.errors import GossiplocoError

console = Console(stderr=True)
SOURCE = typer.Argument(..., help="A run or swarm directory, a checkpoint's round-NNNNNN.json, a model.safetensors, or an exported folder.")


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def export(
    source: Path = SOURCE,
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write (Hugging Face layout: config.json, model.safetensors, tokenizer files, README.md)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out if it exists and is not empty (never a training run)."),
) -> None:
    """Export a trained model as a Hugging Face folder: transformers' LlamaForCausalLM and AutoTokenizer load it offline."""
    from gossiploco.export import export_hf

    try:
        folder = export_hf(source, out, overwrite=overwrite)
    except GossiplocoError as exc:
        _fail(exc)
    console.print(f"exported {source} to {folder}/ (LlamaForCausalLM.from_pretrained({str(folder)!r}))",
                  markup=False, highlight=False, soft_wrap=True)


def generate(
    source: Path = SOURCE,
    prompt: str = typer.Option(..., "--prompt", "-p", help="Text to continue."),
    max_new_tokens: int = typer.Option(100, "--max-new-tokens", "-n", help="Tokens to generate at most (fewer when the model ends the text)."),
    temperature: float = typer.Option(1.0, "--temperature", "-t", help="Sampling temperature; 0: greedy (always the likeliest token)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample only among the K likeliest tokens."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the sampling: the same seed, the same text."),
) -> None:
    """Continue --prompt with a trained model; prints only the generated text on stdout."""
    from gossiploco import inference
    from gossiploco.model_file import load_model_source

    try:
        loaded = load_model_source(source)
        console.print(f"model: {loaded.description}", markup=False, highlight=False, soft_wrap=True)
        text = inference.generate(loaded, prompt, max_new_tokens, temperature, top_k, seed)
    except GossiplocoError as exc:
        _fail(exc)
    typer.echo(text)


def eval_model(
    source: Path = SOURCE,
    data: Optional[list[str]] = typer.Option(None, "--data", help="Text files, globs or .bin files to evaluate on (default: the run's own validation batches)."),
    batches: Optional[int] = typer.Option(None, "--batches", help="Evaluate on the first N batches only (default: all)."),
) -> None:
    """Loss and perplexity of a trained model: on the run's validation batches (its final val loss), or on --data files."""
    from gossiploco import inference
    from gossiploco.model_file import load_model_source

    try:
        loaded = load_model_source(source)
        result = inference.evaluate(loaded, data, batches)
    except GossiplocoError as exc:
        _fail(exc)
    print(f"model: {loaded.description}")
    print(f"data: {result['data']}")
    print(f"loss {result['loss']:.4f}  perplexity {result['ppl']:.3f}  tokens {result['tokens']}")


def register(app: typer.Typer) -> None:
    """Add ``export``, ``generate`` and ``eval`` to ``app``."""
    from gossiploco.runtime.stopping import stops_cleanly

    app.command("export")(stops_cleanly("export")(export))
    app.command("generate")(stops_cleanly("generate")(generate))
    app.command("eval")(stops_cleanly("eval")(eval_model))
