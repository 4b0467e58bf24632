"""Metric sinks beyond ``metrics.jsonl``: TensorBoard event files and Weights & Biases runs (``--log``).

Every record ``metrics.MetricsSink`` writes to ``metrics.jsonl`` is handed, after the file has it, to the sinks
the run's ``[logging]`` section names, with the same metric names: each numeric leaf of the record is one scalar
(``scalars``: a nested dict's keys and a list's indices joined by ``/``, so ``cd_l2_blocks["layers.0.mlp"]``
is ``cd_l2_blocks/layers.0.mlp`` and worker 2's ``tokens`` is ``tokens/2``), at x = the record's ``step`` (its
global inner step). Texts are not scalars and are left out; booleans are 0 or 1; a value that is not finite
(NaN, inf: ``metrics.jsonl`` writes null for it) is dropped, logged once per metric name and counted.

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` writing event files into the run directory itself
  (``tensorboard --logdir runs/swarm`` shows one run per peer directory), flushed at every record. A resumed run
  purges the events at and after the step it continues from, as ``metrics.jsonl`` is cut there.
- ``wandb``: one W&B run per run directory (``simulate``: one; ``swarm``/``peer``: one per peer), its files in
  ``DIR/wandb/``, grouped by the run id and named after the directory. Records are logged with ``step`` as their
  x-axis metric (``define_metric``), so a peer's records written out of step order (a postponed measurement)
  and a resumed run (a new W&B run in the same group) keep their steps. ``logging.wandb_mode``: ``offline``
  writes only to disk (``wandb sync DIR/wandb/offline-run-*`` uploads it later), ``online`` uploads as it goes
  (the user has run ``wandb login``), ``auto`` (default): ``WANDB_MODE`` when set, else online when an API key
  is configured (``WANDB_API_KEY`` or ``~/.netrc``), else offline. ``wandb`` is an extra: without it the run is
  refused at start with the ``pip install`` line.

Sinks are written by a background thread and open lazily, at the first record, so a slow sink never holds up
training and a peer refused before its first record leaves none of their files. A sink that fails (disk full, a
W&B error) never stops training: ``MetricSinks`` logs the cause (the first failure of each sink with its
traceback), counts it, and goes on with the other sinks and the next record; the counts go into ``summary.json``
(``metric_sinks``). Everything is flushed on ``close``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gossiploco.errors import ConfigError

log = logging.getLogger(__name__)

SINK_KINDS = ("tensorboard", "wandb")
WANDB_MODES = ("auto", "offline", "online", "disabled")
WANDB_EXTRA = "pip install 'gossiploco[wandb]'"


@dataclass
class LoggingConfig:
    """Where a run's records go besides ``metrics.jsonl`` (this module). Each peer's own choice: not part of the
    run id, and a resumed run may change it."""

    sinks: list[str] = field(default_factory=list)
    """Metric sinks: tensorboard, wandb (any of them; ``--log tensorboard,wandb``). Empty: metrics.jsonl only."""
    wandb_project: str = "gossiploco"
    """The W&B project the runs go to."""
    wandb_entity: str = ""
    """The W&B entity (user or team); empty: the account's default."""
    wandb_mode: str = "auto"
    """offline (to disk only), online (uploaded as it goes), disabled, or auto: WANDB_MODE when set, else online
    when a W&B API key is configured, else offline."""

    def check(self, p: str) -> None:
        for kind in self.sinks:
            if kind not in SINK_KINDS:
                raise ConfigError(f"{p}.sinks", f"unknown sink {kind!r}; choose from {', '.join(SINK_KINDS)}")
        if len(set(self.sinks)) != len(self.sinks):
            raise ConfigError(f"{p}.sinks", f"a sink is named twice: {self.sinks}")
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"{p}.wandb_mode", f"must be one of {', '.join(WANDB_MODES)}; got {self.wandb_mode!r}")
        if not self.wandb_project:
            raise ConfigError(f"{p}.wandb_project", "must not be empty")


def parse_sink_list(items: list[str] | None) -> list[str] | None:
    """``--log`` values (repeatable, each comma-separated) as one list: ``["tensorboard,wandb"]`` ->
    ``["tensorboard", "wandb"]``; a sink named twice counts once. None: the option was not given."""
    if items is None:
        return None
    kinds: list[str] = []
    for item in items:
        for kind in (k.strip().lower() for k in item.split(",")):
            if kind and kind not in kinds:
                kinds.append(kind)
    return kinds


# -- records as scalars ----------------------------------------------------------------------------


def scalars(record: dict) -> tuple[dict[str, float], list[str]]:
    """The record's numeric leaves as ``{name: value}`` (module docstring) and the names of the non-finite ones,
    left out. ``step`` is the x-axis, not a scalar; texts and ``None`` are not numbers; keys starting with ``_``
    are the monitor's private notes, not metrics."""
    values: dict[str, float] = {}
    dropped: list[str] = []

    def visit(name: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                visit(f"{name}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{name}/{i}", item)
        elif isinstance(value, (bool, int, float)):
            number = float(value)
            if math.isfinite(number):
                values[name] = number
            else:
                dropped.append(name)

    for key, value in record.items():
        if key != "step" and not str(key).startswith("_"):
            visit(str(key), value)
    return values, dropped


# -- the sinks ---------------------------------------------------------------------------------------


class MetricSink(Protocol):
    """One destination of the records. Built and called by ``MetricSinks``'s thread only; any method may raise,
    which ``MetricSinks`` counts and logs."""

    kind: str

    def write(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` at x = ``step``."""

    def write_summary(self, values: dict[str, float]) -> None:
        """The run's final figures (``summary.json``'s numeric leaves)."""

    def close(self) -> None:
        """Flush everything and release the files; called once."""


class TensorBoardSink:
    """Event files in ``run_dir`` (``SummaryWriter``); ``purge_step``: a resumed run's first step (the events
    from there on, of the run before, are dropped by TensorBoard's readers)."""

    kind = "tensorboard"

    def __init__(self, run_dir: Path, purge_step: int | None = None):
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        self._summary = Summary
        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step, flush_secs=30)
        self._last_step = 0

    def _add(self, step: int, values: dict[str, float]) -> None:
        """One event holding every value (what ``add_scalar`` writes per value: a ``simple_value``; built here in one
        protobuf, ~50x cheaper than a call per scalar), flushed: a live TensorBoard sees it, a crash loses none."""
        Value = self._summary.Value
        summary = self._summary(value=[Value(tag=name, simple_value=value) for name, value in values.items()])
        self.writer.file_writer.add_summary(summary, global_step=step)
        self.writer.flush()

    def write(self, step: int, values: dict[str, float]) -> None:
        self._add(step, values)
        self._last_step = max(self._last_step, step)

    def write_summary(self, values: dict[str, float]) -> None:
        self._add(self._last_step, {f"summary/{name}": value for name, value in values.items()})

    def close(self) -> None:
        self.writer.close()  # flushes


def wandb_mode(configured: str) -> str:
    """The W&B mode ``configured`` (``LoggingConfig.wandb_mode``) stands for: ``auto`` resolved as the field says."""
    if configured != "auto":
        return configured
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


def require_wandb() -> None:
    """``ConfigError`` naming the extra to install when ``wandb`` is not importable."""
    try:
        found = importlib.util.find_spec("wandb") is not None
    except ValueError:  # a module entry without a spec (None: an import that is blocked)
        found = False
    if not found:
        raise ConfigError("--log", f"wandb is not installed: {WANDB_EXTRA} (or pip install wandb)")


class WandbSink:
    """One W&B run (``wandb.init``) with its files in ``run_dir/wandb``; ``config``: the run's configuration."""

    kind = "wandb"

    def __init__(self, run_dir: Path, *, project: str, entity: str, mode: str, group: str, name: str, config: dict):
        import wandb

        self.run = wandb.init(project=project, entity=entity or None, mode=mode, dir=str(run_dir), group=group,
                              name=name, config=config,
                              settings=wandb.Settings(console="off"))  # the command's own output stays the terminal's
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "step": step})

    def write_summary(self, values: dict[str, float]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in values.items()})

    def close(self) -> None:
        self.run.finish()


@dataclass
class SinkTarget:
    """What the sinks of one run directory need to open: where, which run, from which step."""

    run_dir: Path
    group: str
    """The run id (W&B groups a swarm's peers by it)."""
    name: str
    """This directory's name in the dashboards (``peer-3``, ``simulate-2``)."""
    config: dict
    """The run's configuration (W&B shows it with the run)."""
    first_step: int | None = None
    """A resumed run's first step (earlier events of steps from there on are superseded); None: a new run."""


class MetricSinks:
    """The sinks of one run, fed by one background thread (``metric-sinks``), so neither opening them (``wandb.init``
    takes 0.3 to 2 s offline, longer online) nor writing to them ever holds up training. ``write``/``write_summary``
    turn the record into scalars on the caller's thread (a snapshot: the caller may change the dict afterwards) and
    queue it; the thread opens the sinks at the first item and writes each item to every sink, in order.

    Never raises from ``write``/``write_summary``/``drain``/``close``: a failure (opening included) is logged with its
    cause and counted in ``failures``; a sink that failed to open is not tried again; a record that finds the queue
    full (``backlog`` items waiting: a sink stuck) is dropped and counted (``backlog_dropped``). Thread-safe."""

    def __init__(self, cfg: LoggingConfig, target: SinkTarget, *, backlog: int = 10_000, close_timeout_s: float = 60.0):
        if "wandb" in cfg.sinks:
            require_wandb()
        self.cfg = cfg
        self.target = target
        self.close_timeout_s = close_timeout_s
        """How long ``drain`` and ``close`` wait for the thread to write what is queued (then they log and go on)."""
        self._sinks: list[MetricSink] = []
        self._queue: queue.Queue = queue.Queue(maxsize=backlog)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.records = {kind: 0 for kind in cfg.sinks}
        """Records each sink took without failing (written by the thread)."""
        self.failures = {kind: 0 for kind in cfg.sinks}
        """Calls to each sink that raised (opening, writing, closing; written by the thread)."""
        self.non_finite_dropped = 0
        """Values left out because they were NaN or infinite."""
        self.backlog_dropped = 0
        """Records and summaries dropped because the queue was full."""
        self._non_finite_names: set[str] = set()

    @property
    def kinds(self) -> list[str]:
        return list(self.cfg.sinks)

    # -- the caller's side ----------------------------------------------------------------------------------

    def write(self, record: dict) -> None:
        """Queue ``record`` (as written to metrics.jsonl) for every sink, at its ``step``."""
        values, dropped = scalars(record)
        step = int(record.get("step", 0))
        self._count_dropped(dropped, step)
        self._submit(("record", step, values))

    def write_summary(self, summary: dict) -> None:
        """Queue the numeric leaves of ``summary`` for every sink (as ``summary/NAME``)."""
        values, dropped = scalars(summary)
        self._count_dropped(dropped, None)
        self._submit(("summary", 0, values))

    def drain(self) -> bool:
        """Wait (at most ``close_timeout_s``) until everything queued so far is written; False (logged) if not."""
        if self._thread is None:
            return True
        done = threading.Event()
        if not self._submit(done):
            return False
        if not done.wait(self.close_timeout_s):
            log.warning("metric sinks %s: still writing after %.0f s (%d items queued); going on without waiting",
                        ", ".join(self.kinds), self.close_timeout_s, self._queue.qsize())
            return False
        return True

    def stats(self) -> dict:
        """What ``summary.json`` says of the sinks (after ``drain``, complete): records taken and failures per
        sink, values and records dropped."""
        return {"records": dict(self.records), "failures": dict(self.failures),
                "non_finite_dropped": self.non_finite_dropped, "backlog_dropped": self.backlog_dropped}

    def close(self) -> None:
        """Write what is queued, flush and close every opened sink, stop the thread (waiting at most
        ``close_timeout_s``; a sink still stuck then is logged and left to the daemon thread). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._queue.put(None)  # blocks while the queue is full: the thread is taking items off it
        thread.join(self.close_timeout_s)
        if thread.is_alive():
            log.warning("metric sinks %s: not closed after %.0f s (%d items queued); their last records may be "
                        "lost", ", ".join(self.kinds), self.close_timeout_s, self._queue.qsize())

    def _submit(self, item: Any) -> bool:
        with self._lock:
            if self._closed:
                log.debug("metric sinks closed: %s not written", type(item).__name__)
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="metric-sinks", daemon=True)
                self._thread.start()
            try:
                self._queue.put_nowait(item)
                return True
            except queue.Full:
                self.backlog_dropped += 1
                if self.backlog_dropped == 1:
                    log.warning("metric sinks %s: %d items wait to be written (a sink is stuck); dropping new "
                                "records, counted in summary.json (metric_sinks.backlog_dropped)",
                                ", ".join(self.kinds), self._queue.maxsize)
                return False

    def _count_dropped(self, names: list[str], step: int | None) -> None:
        with self._lock:
            self.non_finite_dropped += len(names)
            new = [name for name in names if name not in self._non_finite_names]
            self._non_finite_names.update(new)
        for name in new:
            log.warning("metric %s is not finite%s: left out of %s (metrics.jsonl has null; further ones are "
                        "counted in summary.json, metric_sinks.non_finite_dropped)", name,
                        f" at step {step}" if step is not None else " in the summary", ", ".join(self.kinds))

    # -- the thread's side ----------------------------------------------------------------------------------

    def _run(self) -> None:
        """The ``metric-sinks`` thread: open the sinks, then write each queued item until the closing ``None``."""
        for kind in self.cfg.sinks:
            try:
                self._sinks.append(self._build(kind))
            except Exception as exc:  # noqa: BLE001 - a dashboard never stops training
                self._failed(kind, "could not be opened", exc)
        while True:
            item = self._queue.get()
            if item is None:
                break
            if isinstance(item, threading.Event):
                item.set()
                continue
            what, step, values = item
            for sink in self._sinks:
                try:
                    if what == "record":
                        sink.write(step, values)
                        self.records[sink.kind] += 1
                    else:
                        sink.write_summary(values)
                except Exception as exc:  # noqa: BLE001 - a dashboard never stops training
                    self._failed(sink.kind, f"could not write the {what}" + (f" of step {step}" if what == "record"
                                                                              else ""), exc)
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                self._failed(sink.kind, "could not be closed (its last records may be lost)", exc)

    def _build(self, kind: str) -> MetricSink:
        t = self.target
        if kind == "tensorboard":
            return TensorBoardSink(t.run_dir, purge_step=t.first_step)
        cfg = self.cfg
        mode = wandb_mode(cfg.wandb_mode)
        sink = WandbSink(t.run_dir, project=cfg.wandb_project, entity=cfg.wandb_entity, mode=mode, group=t.group,
                         name=t.name, config=t.config)
        if mode == "offline":
            log.info("W&B run %s is offline, in %s/wandb: upload it with `wandb sync`", t.name, t.run_dir)
        return sink

    def _failed(self, kind: str, what: str, exc: BaseException) -> None:
        self.failures[kind] += 1
        if self.failures[kind] == 1:
            log.warning("metric sink %s %s (%s: %s); training goes on, failures are counted in summary.json "
                        "(metric_sinks)", kind, what, type(exc).__name__, exc, exc_info=exc)
        else:
            log.debug("metric sink %s %s again (%d failures): %s", kind, what, self.failures[kind], exc)
