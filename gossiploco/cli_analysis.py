"""The commands that study runs rather than train: ``presets`` (the ready-made configurations),
``utilization`` (the compute-utilization simulator, paper section 5.2), ``sensitivity`` (per-block JS
sensitivity and the Mix2 subset sweep) and ``plot``. ``register(app)`` adds them to the ``gossiploco``
app; this module does not import ``gossiploco.cli``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from gossiploco.cli_options import (CONFIG, DATA, DEVICE, INNER_STEPS, MODEL, ROUNDS, SEED, SETS, WORKERS, console, fail,
                                    parse_sets, training_overrides)
from gossiploco.errors import ConfigError, GossiplocoError
from gossiploco.runtime.stopping import stops_cleanly


def register(app: typer.Typer) -> None:
    @app.command()
    @stops_cleanly("presets")
    def presets() -> None:
        """List the ready-made configurations in peers/."""
        from gossiploco.config import load_config, preset_names

        for name in preset_names():
            cfg = load_config(name)
            print(f"{name:28s} mode={cfg.mode:9s} mix1={cfg.mix1.kind}{'+state' if cfg.mix1.state else ''}"
                  f" mix2={cfg.mix2.kind} blocks={','.join(cfg.mix2.blocks)}")

    @app.command()
    @stops_cleanly("utilization")
    def utilization(
        config: str = CONFIG,
        bandwidth_mbps: float = typer.Option(..., "--bandwidth-mbps", help="Bandwidth of the link between any two peers, Mbit/s."),
        params: Optional[float] = typer.Option(None, "--params", help="Parameters N (default: the config's model size)."),
        model: Optional[str] = MODEL,
        vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="Vocabulary for block sizes and the default N (default: data.vocab_size, else 256)."),
        workers: Optional[int] = typer.Option(None, "--workers", "-m", help="Number of workers M (default: the config's)."),
        inner_steps: Optional[int] = INNER_STEPS,
        step_time: Optional[float] = typer.Option(None, "--step-time", help="Seconds per inner step (else estimated from --tokens-per-step, --peak-tflops, --mfu)."),
        tokens_per_step: Optional[int] = typer.Option(None, "--tokens-per-step", help="Tokens per inner step on one worker, to estimate --step-time."),
        peak_tflops: Optional[float] = typer.Option(None, "--peak-tflops", help="Peak TFLOP/s of one worker's device, to estimate --step-time."),
        mfu: float = typer.Option(0.4, "--mfu", help="Model FLOPs utilization, to estimate --step-time."),
        outer_step_time: float = typer.Option(0.0, "--outer-step-time", help="Seconds of the outer step."),
        subset_fraction: Optional[float] = typer.Option(None, "--subset-fraction", help="Fraction of the parameters Mix2 sends (default: from mix2.blocks); with --plot, for the subset presets."),
        bytes_per_value: str = typer.Option("4", "--bytes-per-value", help="4 (fp32), 2 (bf16), 1 (8-bit), 0.5 (4-bit), or one of those names."),
        failure_rate: float = typer.Option(0.0, "--failure-rate", help="Probability that one attempt of a collective fails (all-reduce restarts, gossip is lost)."),
        with_monitors: bool = typer.Option(False, "--with-monitors", help="Also model the config's consensus measurements: a blocking all-reduce of the whole parameters each (off in the paper's tables)."),
        json_: bool = typer.Option(False, "--json", help="Print one JSON object."),
        plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw utilization against bandwidth for every preset to this PNG."),
        sets: Optional[list[str]] = typer.Option(None, "--set", help="Override a config field, e.g. --set mix1.compression=4bit (the mixes' compression sets their bytes)."),
    ) -> None:
        """Compute utilization of a configuration on a network of fixed per-link bandwidth (paper section 5.2)."""
        import json

        from gossiploco import utilization as util
        from gossiploco.config import load_config

        try:
            cfg = load_config(config, {"model.size": model, **parse_sets(sets or [])})
            vocab = util.default_vocab_size(cfg, vocab_size)
            scenario = util.resolve_scenario(
                cfg, bandwidth_mbps=bandwidth_mbps, params=params, vocab_size=vocab, workers=workers, inner_steps=inner_steps,
                step_time_s=step_time, tokens_per_step=tokens_per_step, peak_tflops=peak_tflops, mfu=mfu,
                outer_step_s=outer_step_time, bytes_per_value=bytes_per_value, failure_rate=failure_rate)
            plan = util.comm_plan(cfg, vocab, subset_fraction, with_monitors)
            plans = util.preset_plans(cfg.model.size, vocab, subset_fraction) if plot else []
        except GossiplocoError as exc:
            fail(exc)
        result = util.simulate(plan, scenario)
        print(json.dumps(util.report(plan, scenario, result), indent=2) if json_ else util.describe(plan, scenario, result))
        if plot:
            util.plot_bandwidth_sweep(plot, plans, scenario)
            console.print(f"plot: {plot}")

    @app.command()
    @stops_cleanly("sensitivity")
    def sensitivity(
        config: str = CONFIG,
        workers: Optional[int] = WORKERS,
        inner_steps: Optional[int] = INNER_STEPS,
        rounds: Optional[int] = ROUNDS,
        seed: Optional[int] = SEED,
        model: Optional[str] = MODEL,
        device: Optional[str] = DEVICE,
        data: Optional[list[str]] = DATA,
        out: Path = typer.Option(Path("runs/sensitivity.json"), "--out", "-o", help="JSON report: per-block series, mean, max, ranking, sweep, proposal."),
        sweep_sizes: Optional[str] = typer.Option(None, "--sweep-sizes", help="Subset sizes to sweep, comma-separated: 1,2,4 (default 1,2,4,6, those below the number of blocks)."),
        no_sweep: bool = typer.Option(False, "--no-sweep", help="Only rank the blocks; train no subset runs."),
        tolerance: float = typer.Option(0.1, "--tolerance", help="Propose the smallest subset whose peak CD_JS is at most (1 + tolerance) x full Mix2's."),
        rank_by: str = typer.Option("mean", "--rank-by", help="Rank blocks by their mean or max sensitivity over training."),
        preset_out: Optional[Path] = typer.Option(None, "--preset-out", help="Write the proposed configuration as a preset TOML (e.g. peers/my-subset.toml)."),
        runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help="Also keep every training run's metrics.jsonl and summary.json under this directory."),
        set_: Optional[list[str]] = SETS,
    ) -> None:
        """Per-block JS sensitivity and Mix2 subset sweep (paper appendix D.3, Figure 7, Table 6) on the virtual swarm."""
        from gossiploco import sensitivity as sens
        from gossiploco.config import load_config

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        try:
            overrides = training_overrides(workers=workers, inner_steps=inner_steps, rounds=rounds, seed=seed, model=model,
                                           device=device, data=data, sets=set_)
            sizes = None
            if sweep_sizes is not None:
                try:
                    sizes = [int(k) for k in sweep_sizes.split(",") if k.strip()]
                except ValueError:
                    raise ConfigError("--sweep-sizes", f"expected comma-separated integers, got {sweep_sizes!r}") from None
            cfg = load_config(config, overrides)
            report = sens.analyze(cfg, out, sizes=sizes, sweep_subsets=not no_sweep, tolerance=tolerance, rank_by=rank_by,
                                  preset_name=preset_out.stem if preset_out else None, runs_dir=runs_dir,
                                  show=lambda text: print(text + "\n"), progress=console.print)
        except GossiplocoError as exc:
            fail(exc)
        if "proposal" in report:
            proposal = report["proposal"]
            verdict = "within" if proposal["within_tolerance"] else "no subset within"
            console.print(f"proposed: {proposal['label']} ({verdict} {100 * tolerance:g}% of full Mix2's peak CD_JS): "
                          f"mix2.blocks = [{', '.join(proposal['blocks'])}]", markup=False, soft_wrap=True)
            if preset_out:
                preset_out.parent.mkdir(parents=True, exist_ok=True)
                preset_out.write_text(report["preset_toml"])
                console.print(f"preset: {preset_out}")
            else:
                print(report["preset_toml"])
        console.print(f"report: {out}")

    @app.command()
    @stops_cleanly("plot")
    def plot(
        run_dirs: list[Path] = typer.Argument(..., help="Output directories of simulate runs, network peers (each with metrics.jsonl) or swarms (all their peers)."),
        out: Optional[Path] = typer.Option(None, "--out", "-o", help="PNG to write (default: RUN_DIR/metrics.png for one run, plot.png for several)."),
        window: int = typer.Option(10, "--window", help="Records per rolling window of the CD_JS median/min/max panel (Figure 4, right)."),
    ) -> None:
        """Plot loss, validation loss, CD_L2 and CD_JS over steps for one or several runs (PNG)."""
        from gossiploco import plots

        out = out or (run_dirs[0] / "metrics.png" if len(run_dirs) == 1 else Path("plot.png"))
        try:
            runs = plots.load_runs(run_dirs)
            plots.plot_runs(runs, out, window)
        except GossiplocoError as exc:
            fail(exc)
        console.print(f"plot: {out}")
