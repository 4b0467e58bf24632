"""What the ``gossiploco`` commands share: the training options (one definition, the same flags everywhere),
turning them and ``--set`` into config overrides, and the error exit. Imports no command module, so every
``cli*`` module can use it."""

from __future__ import annotations

import typer
from rich.console import Console

from gossiploco.errors import ConfigError

console = Console(stderr=True)

DEFAULT_PRESET = "globalm1-localm2"

# Options shared by every command that runs training (one definition, the same flags everywhere).
CONFIG = typer.Option(DEFAULT_PRESET, "--config", "-c", help="Preset TOML file, or a preset name from peers/.")
WORKERS = typer.Option(None, "--workers", "-m", help="Number of workers M.")
INNER_STEPS = typer.Option(None, "--inner-steps", help="Inner steps H per round.")
ROUNDS = typer.Option(None, "--rounds", help="Outer rounds R.")
SEED = typer.Option(None, "--seed", help="Seed for init, data and matchings.")
MODEL = typer.Option(None, "--model", help="Model size: tiny, small, 125m, 1.5b.")
DEVICE = typer.Option(None, "--device", help="auto, cpu, cuda or cuda:N.")
DATA = typer.Option(None, "--data", help="Text files, globs, .bin files, or a prepared folder (gossiploco data prepare) (default: stdlib sources).")
INIT = typer.Option(None, "--init", help="Start from a Hugging Face Llama-family checkpoint folder (config.json, safetensors, tokenizer.json): its shape, weights and tokenizer (model.init).")
SETS = typer.Option(None, "--set", help="Override any config field: --set inner.lr=3e-4 (TOML value).")
LOG = typer.Option(None, "--log", help="Also send the metrics to: tensorboard (event files in the output directory), wandb (a W&B run, offline unless you are logged in; --set logging.wandb_mode/wandb_project/wandb_entity). Repeatable or comma-separated.")
RESUME = typer.Option(False, "--resume", help="Continue the run in --out from its newest checkpoint (same command otherwise); metrics are appended.")


def training_overrides(*, workers=None, inner_steps=None, rounds=None, seed=None, model=None, device=None,
                       data=None, init=None, sets=None, log=None) -> dict:
    """The dotted config overrides of the shared training options (None: keep the preset's)."""
    from gossiploco.metric_sinks import parse_sink_list

    overrides = {"workers": workers, "inner_steps": inner_steps, "rounds": rounds, "seed": seed,
                 "model.size": model, "device": device, "data.paths": data,
                 "model.init": str(init) if init is not None else None, "logging.sinks": parse_sink_list(log)}
    overrides.update(parse_sets(sets or []))
    return overrides


def fail(exc: Exception) -> None:
    from rich.markup import escape

    # a message's "[true, false]" is text, not a style; not wrapped, so the paths and commands in it copy whole
    console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(code=2)


def parse_sets(items: list[str]) -> dict:
    """``["inner.lr=3e-4", "mix2.blocks=['embed']"]`` -> dotted overrides; values parse as TOML, else strings."""
    import tomllib

    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
        try:
            parsed[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed[key.strip()] = value
    return parsed
