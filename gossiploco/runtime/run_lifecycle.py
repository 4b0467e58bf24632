"""One run's life on disk, the same for ``gossiploco simulate`` (the virtual swarm) and ``gossiploco peer`` (one
network peer): the output directory (never over a run without ``--resume``: ``run_dir``), the checkpoint
``--resume`` continues from, the tokenizer's copy, the metrics sink (and the run's TensorBoard / W&B sinks:
``metric_sinks``), the checkpoint writer, stopping on SIGTERM
as on Ctrl+C, and at the end the summary and the final model. In order::

    run = RunLifecycle.open(cfg, out, default, resume=resume, say=console.print)  # directory, checkpoint
    runner = VirtualSwarm(cfg)                                   # or a NetworkPeer (built before ``open``)
    run.start(runner)                                            # resumed, sink and writer open, signals handled
    result = run.train(lambda sink, writer: runner.run(sink, callback, writer))
    model_path = run.finish(result)                              # summary.json, model.safetensors

Stopped (Ctrl+C, SIGTERM: ``runtime.stopping``) while it trains, ``train`` keeps what the run measured (a
summary marked ``interrupted``), lets the checkpoint being written finish, and ends the command with the stop
line saying how to continue (``stopping.exit_stopped``). A run that fails with a ``GossiplocoError`` closes
the same way and raises it. With ``forget_unstarted`` (a peer), a run stopped before its first record leaves
no run behind, so the same command (corrected) can use the directory again.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from gossiploco.checkpoint import Checkpoint, CheckpointWriter, checkpoint_files, run_checkpoints
from gossiploco.config import RunConfig
from gossiploco.errors import GossiplocoError
from gossiploco.metric_sinks import MetricSinks, SinkTarget
from gossiploco.metrics import MetricsSink
from gossiploco.runtime import collector
from gossiploco.runtime.run_dir import output_dir, resume_checkpoint
from gossiploco.runtime.stopping import exit_stopped


class Runner(Protocol):
    """What a run trains with: ``VirtualSwarm`` or ``NetworkPeer``."""

    start_round: int

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint`` (configuration already checked)."""

    def summary_so_far(self) -> dict:
        """The summary of a run stopped before its end."""


class RunResult(Protocol):
    summary: dict
    final_params: dict[str, torch.Tensor]


R = TypeVar("R", bound=RunResult)


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's stack (SIGINT and SIGTERM: ``runtime.stopping``, installed by
    the command)."""
    if sys.__stderr__ is not None:  # the process's own stderr: a replaced sys.stderr may have no file descriptor
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


class RunLifecycle:
    """Build with ``open`` (checks the directory, finds the checkpoint), then ``start``, ``train``, ``finish`` in
    that order, on the main thread. ``say``: prints one line to the user (rich markup)."""

    def __init__(self, cfg: RunConfig, out: Path, *, resume: bool, checkpoint: Checkpoint | None,
                 say: Callable[[str], None], forget_unstarted: bool = False, command: str | None = None):
        self.cfg = cfg
        self.out = out
        self.resume = resume
        self.checkpoint = checkpoint
        """What the run continues from (None: a new run, or a resumed one that stopped before its first checkpoint)."""
        self.say = say
        self.forget_unstarted = forget_unstarted
        self.command = command
        """The command's name in its stop line (``gossiploco COMMAND: stopped ...``)."""
        self.sink: MetricsSink | None = None
        self.writer: CheckpointWriter | None = None
        self._runner: Runner | None = None

    @classmethod
    def open(cls, cfg: RunConfig, out: Path | None, default: Path, *, resume: bool, say: Callable[[str], None],
             forget_unstarted: bool = False, command: str | None = None) -> RunLifecycle:
        """The run's directory (``run_dir.output_dir``: ``out``, else ``default`` or its first free ``-N``; with
        ``resume``, the run to continue), its newest checkpoint when resuming (checked against ``cfg``), and
        ``OUT/tokenizer.json``. Raises ``ConfigError``/``CheckpointError`` (nothing is written then)."""
        from gossiploco.prepared_corpus import copy_tokenizer, prepared_folder
        from gossiploco.tokenizer import BYTE_SPECS, load_tokenizer, save_tokenizer_copy

        out = output_dir(out, default, resume)
        checkpoint = resume_checkpoint(out, cfg.to_dict()) if resume else None
        save_tokenizer_copy(load_tokenizer(cfg.data.tokenizer), out)  # OUT/tokenizer.json: the model's tokenizer
        if (folder := prepared_folder(cfg.data.paths)) is not None and cfg.data.tokenizer in BYTE_SPECS:
            copy_tokenizer(folder, out)  # a prepared folder's tokenizer is the model's
        return cls(cfg, out, resume=resume, checkpoint=checkpoint, say=say, forget_unstarted=forget_unstarted,
                   command=command)

    def start(self, runner: Runner) -> None:
        """Resume ``runner`` from the checkpoint, open the metrics (a resumed file is cut where its checkpoint
        was taken; the other sinks of ``[logging]`` are opened at the first record, grouped by the runner's
        ``run_id`` when it has one, else the config's), start the checkpoint writer (and
        ``dump_stacks_on_sigusr1``). ``ConfigError`` when a sink's package is missing."""
        self._runner = runner
        collector.resume()  # start-up is over (``runtime.collector``)
        checkpoint = self.checkpoint
        if checkpoint is not None:
            runner.resume(checkpoint)
            self.say(f"resuming {self.out} at round {checkpoint.round} from {checkpoint.path.name}")
        self.sink = MetricsSink(self.out, resume_bytes=checkpoint.meta["metrics_bytes"] if checkpoint
                                else (0 if self.resume else None), forward=self._metric_sinks(runner))
        cfg = self.cfg
        if cfg.checkpoint.enabled:
            self.writer = CheckpointWriter(run_checkpoints(self.out), cfg.to_dict(), cfg.checkpoint.keep)
        dump_stacks_on_sigusr1()

    def _metric_sinks(self, runner: Runner) -> MetricSinks | None:
        """The ``[logging]`` sinks of this run directory (None without any)."""
        cfg = self.cfg
        if not cfg.logging.sinks:
            return None
        from gossiploco.checkpoint import config_digest

        run_id = getattr(runner, "run_id", None) or f"{cfg.name}-{config_digest(cfg.to_dict())[:12]}"  # runtime.peer.run_id_for
        first_step = self.checkpoint.round * cfg.inner_steps if self.checkpoint else (0 if self.resume else None)
        return MetricSinks(cfg.logging, SinkTarget(self.out, group=run_id, name=self.out.resolve().name,
                                                   config=cfg.to_dict(), first_step=first_step))

    def train(self, work: Callable[[MetricsSink, CheckpointWriter | None], R], *,
              before_report: Callable[[], None] | None = None) -> R:
        """``work(sink, writer)``: the run itself. Stopped (``KeyboardInterrupt``) or failed (``GossiplocoError``),
        the run is closed as the module docstring says and the exception raised again; ``before_report`` (a
        progress display to stop) is called before the lines that say so."""
        assert self.sink is not None and self._runner is not None, "start() first"
        try:
            return work(self.sink, self.writer)
        except KeyboardInterrupt:
            exit_stopped(self.command, self._interrupted(before_report))
        except GossiplocoError:
            self.sink.close()
            self._stop_checkpoints(interrupted=False)
            self._forget_unstarted_run()
            raise

    def finish(self, result: R) -> Path:
        """After a finished run: the last checkpoint written, ``summary.json`` (with the run's config and the
        checkpoints' counters) and the final model; returns the model's path."""
        from gossiploco.model_file import save_model

        assert self.sink is not None
        self._stop_checkpoints(interrupted=False)
        result.summary.update(run_config=self.cfg.to_dict(), **(self.writer.stats() if self.writer is not None else {}))
        self.sink.write_summary(result.summary)
        self.sink.close()
        return save_model(result.final_params, self.out, self.cfg.to_dict())

    def _interrupted(self, before_report: Callable[[], None] | None) -> str | None:
        """Close a stopped run; returns what its stop line adds (where things are, how to continue)."""
        assert self.sink is not None and self._runner is not None
        if self._forget_unstarted_run():
            self._stop_checkpoints(interrupted=False)  # nothing was submitted: this only stops its thread
            return f"before the first round: nothing kept in {self.out}"
        self.sink.write_summary({**self._runner.summary_so_far(), "run_config": self.cfg.to_dict()})
        self.sink.close()
        if before_report is not None:
            before_report()
        return self._stop_checkpoints(interrupted=True)

    def _forget_unstarted_run(self) -> bool:
        """With ``forget_unstarted``: a run stopped before its first record (refused at start, or Ctrl+C while it
        waited for the others, to restart it with other settings) leaves no run in ``out``, so the corrected
        command may use it again. True when it removed it."""
        assert self.sink is not None
        if not self.forget_unstarted or self.resume or self.sink.records:
            return False
        self.sink.close()
        (self.out / "metrics.jsonl").unlink(missing_ok=True)
        return True

    def _stop_checkpoints(self, interrupted: bool) -> str | None:
        """Finish writing checkpoints (a second Ctrl+C abandons the one being written: the previous one stays); for
        an interrupted run, return how to continue it."""
        writer, out = self.writer, self.out
        if writer is None:
            if interrupted:
                return f"checkpoints are off (checkpoint.enabled = false): metrics so far are in {out / 'metrics.jsonl'}"
            return None
        try:
            writer.close()
        except KeyboardInterrupt:
            self.say("[yellow]interrupted again[/]: the checkpoint being written was abandoned")
        if writer.failures:
            self.say(f"[bold red]{writer.failures} checkpoint(s) could not be written[/] (see the errors above)")
        if interrupted:
            files = checkpoint_files(run_checkpoints(out))
            last = files[0].name if files else "none"
            return f"newest checkpoint: {last} in {out / 'checkpoints'}; continue with the same command plus --resume --out {out}"
        return None
