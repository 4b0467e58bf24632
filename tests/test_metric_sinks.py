"""TensorBoard and W&B sinks (``gossiploco.metric_sinks``): every record of ``metrics.jsonl`` read back, with the same
names and steps, by TensorBoard's own reader (``EventAccumulator``) and from W&B's offline run file (``run-ID.wandb``,
read with W&B's own protobuf schema, ``wandb.proto.wandb_internal_pb2.Record``: wandb 0.31 ships no Python reader of
its offline files, so ``wandb_history`` below walks the file's LevelDB-log framing itself).

TensorBoard stores a scalar as a float32 (``simple_value``), so a value read back equals the record's rounded to
float32: compared exactly after that rounding. W&B keeps float64 (as JSON text): compared exactly."""

from __future__ import annotations

import json
import logging
import struct
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from gossiploco.checkpoint import config_digest
from gossiploco.config import load_config
from gossiploco.errors import ConfigError
from gossiploco.metric_sinks import MetricSinks, SinkTarget, parse_sink_list, scalars
from gossiploco.metrics import MetricsSink
from gossiploco.runtime.peer import run_id_for
from gossiploco.runtime.run_lifecycle import RunLifecycle

WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
             "WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9"}
"""No network: offline, and an unreachable loopback server should anything try."""


def record(step: int, **extra) -> dict:
    """A record shaped like the virtual swarm's (``runtime.virtual``: consensus, per-block CD_L2, losses, the last
    round's communication figures, per-worker steps and tokens)."""
    r = {"round": step // 4, "h": step % 4, "step": step, "cd_l2": 0.01 * step + 1e-7, "cd_l2_sq": 1e-4 * step,
         "cd_js": 3e-4 * step + 1e-9, "cd_l2_blocks": {"embed": 0.002 * step, "layers.0.mlp": 0.005 * step},
         "loss": 5.5 - 0.01 * step, "val_loss": 5.6 - 0.01 * step, "mix1_bytes": 700757, "mix2_bytes": 350378,
         "mix1_failures": step % 2, "mix2_failures": 0, "mix1_wait_s": 1.5e-5, "steps": [4, 4, 3],
         "tokens": [4096, 4096, 3072]}
    r.update(extra)
    return r


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard's own reader finds in ``run_dir``: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_tensorboard_holds(run_dir: Path, records: list[dict],
                             names=("cd_l2", "cd_js", "loss", "val_loss", "mix1_bytes", "mix1_failures", "tokens/0")) -> None:
    """Every numeric value of every record is in TensorBoard under its metrics.jsonl name, at the record's step."""
    seen = tensorboard_scalars(run_dir)
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for name, value in scalars(r)[0].items():
            expected.setdefault(name, []).append((r["step"], float(np.float32(value))))
    for name, points in expected.items():
        assert sorted(seen.get(name, [])) == sorted(points), name
    for name in names:
        assert name in seen, sorted(seen)
    assert any(name.startswith("cd_l2_blocks/") for name in seen)


def wandb_records(run_dir: Path) -> list:
    """The protobuf records of the one offline W&B run in ``run_dir/wandb``. The file: a 7-byte header
    (``:W&B``, magic, version), then LevelDB-log blocks of 32 KiB whose chunks (crc32 4, length 2, type 1:
    full, first, middle, last) carry one serialized ``Record`` each."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def wandb_history(run_dir: Path) -> list[dict]:
    """The rows the run logged (``run.log``), user keys only, values parsed from their JSON."""
    rows = []
    for rec in wandb_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in rec.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def assert_wandb_holds(run_dir: Path, records: list[dict]) -> None:
    rows = {row["step"]: row for row in wandb_history(run_dir)}
    assert sorted(rows) == sorted(r["step"] for r in records)
    for r in records:
        row = rows[r["step"]]
        values = scalars(r)[0]
        assert {k: v for k, v in row.items() if k != "step"} == values, r["step"]
    assert all("cd_l2" in row and "cd_js" in row for row in rows.values())


def lifecycle(tmp_path: Path, make_config, sinks: list[str], *, resume: bool = False) -> RunLifecycle:
    cfg = make_config("globalm1-localm2", **{"logging.sinks": sinks})
    return RunLifecycle.open(cfg, tmp_path / "run", tmp_path / "run", resume=resume, say=lambda line: None)


class Result:
    def __init__(self, summary: dict):
        self.summary = summary
        self.final_params = {"w": torch.ones(2)}


class Runner:
    """Writes ``records`` through the run's sink, as ``VirtualSwarm.run`` does."""

    start_round = 0

    def __init__(self, records: list[dict]):
        self.records = records

    def resume(self, checkpoint) -> None:
        raise AssertionError("nothing to resume")

    def summary_so_far(self) -> dict:
        return {"interrupted": True}

    def run(self, sink, writer) -> Result:
        for r in self.records:
            sink.write(r)
        return Result({"final_val_loss": self.records[-1]["val_loss"], "wall_s": 1.5})


# -- fast: the records, the options ----------------------------------------------------------------------


def test_scalars_are_the_numeric_leaves_under_their_jsonl_names():
    values, dropped = scalars({"step": 8, "round": 2, "h": 0, "loss": float("nan"), "cd_l2": 0.5, "ok": True,
                               "cd_l2_blocks": {"embed": 0.25, "norm": float("inf")}, "tokens": [10, 12],
                               "monitor_cause": "late", "val_loss": None, "_val_loss_due": True,
                               "mix2_decision": {"blocks": ["embed"], "js": 0.125}})
    assert values == {"round": 2.0, "h": 0.0, "cd_l2": 0.5, "ok": 1.0, "cd_l2_blocks/embed": 0.25, "tokens/0": 10.0,
                      "tokens/1": 12.0, "mix2_decision/js": 0.125}
    assert sorted(dropped) == ["cd_l2_blocks/norm", "loss"]


def test_log_option_fills_logging_sinks_and_stays_out_of_the_run_identity():
    assert parse_sink_list(["tensorboard,wandb"]) == parse_sink_list(["tensorboard", " WandB ", "tensorboard"]) \
        == ["tensorboard", "wandb"]
    assert parse_sink_list(None) is None
    plain = load_config("globalm1-localm2")
    logged = load_config("globalm1-localm2", {"logging.sinks": ["tensorboard", "wandb"], "logging.wandb_mode": "offline"})
    assert logged.logging.sinks == ["tensorboard", "wandb"] and plain.logging.sinks == []
    assert config_digest(plain.to_dict()) == config_digest(logged.to_dict())  # a peer's own choice, like [checkpoint]
    with pytest.raises(ConfigError, match="logging.sinks: unknown sink 'mlflow'"):
        load_config("globalm1-localm2", {"logging.sinks": ["mlflow"]})
    with pytest.raises(ConfigError, match="logging.wandb_mode"):
        load_config("globalm1-localm2", {"logging.wandb_mode": "sometimes"})


def test_wandb_missing_is_refused_at_start_naming_the_extra(tmp_path, make_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as where the extra is not installed
    run = lifecycle(tmp_path, make_config, ["tensorboard", "wandb"])
    with pytest.raises(ConfigError, match=r"pip install 'gossiploco\[wandb\]'"):
        run.start(Runner([record(0)]))
    assert not list((tmp_path / "run").glob("events.out.tfevents.*"))  # refused before anything was written


# -- fast: TensorBoard through the run lifecycle -----------------------------------------------------------


def test_every_record_reaches_tensorboard_with_its_step_and_the_summary_counts_it(tmp_path, make_config):
    records = [record(s) for s in (0, 2, 4, 6, 8)]
    run, runner = lifecycle(tmp_path, make_config, ["tensorboard"]), Runner(records)
    run.start(runner)
    # a simulation's dashboards are grouped by the run id a network peer of the same config would have
    assert run.sink.forward.target.group == run_id_for(run.cfg) and run.sink.forward.target.name == "run"
    run.finish(run.train(runner.run))
    assert_tensorboard_holds(tmp_path / "run", records)
    assert tensorboard_scalars(tmp_path / "run")["summary/final_val_loss"] == [(8, float(np.float32(records[-1]["val_loss"])))]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metric_sinks"] == {"records": {"tensorboard": 5}, "failures": {"tensorboard": 0}, "non_finite_dropped": 0,
                                       "backlog_dropped": 0}


def test_a_resumed_run_replaces_the_events_from_its_first_step_on(tmp_path, make_config):
    target = SinkTarget(tmp_path, group="g", name="run", config={})
    cfg = make_config("globalm1-localm2", **{"logging.sinks": ["tensorboard"]}).logging
    first = MetricSinks(cfg, target)
    for s in (0, 4, 8):
        first.write(record(s))
    first.close()
    resumed = MetricSinks(cfg, SinkTarget(tmp_path, group="g", name="run", config={}, first_step=4))
    for s in (4, 8):
        resumed.write(record(s, cd_l2=100.0 + s))
    resumed.close()
    assert tensorboard_scalars(tmp_path)["cd_l2"] == [(0, float(np.float32(1e-7))), (4, 104.0), (8, 108.0)]


# -- fast: failures never stop the run ---------------------------------------------------------------------


class FullDisk:
    kind = "tensorboard"

    def write(self, step, values):
        raise OSError(28, "No space left on device")

    def write_summary(self, values):
        raise OSError(28, "No space left on device")

    def close(self):
        raise OSError(28, "No space left on device")


def test_a_failing_sink_is_logged_once_counted_and_the_records_still_reach_the_file(tmp_path, make_config, caplog,
                                                                                    monkeypatch):
    monkeypatch.setattr(MetricSinks, "_build", lambda self, kind: FullDisk())  # opens, then the disk is full
    sinks = MetricSinks(make_config("globalm1-localm2", **{"logging.sinks": ["tensorboard"]}).logging,
                        SinkTarget(tmp_path, group="g", name="run", config={}))
    jsonl = MetricsSink(tmp_path, forward=sinks)
    with caplog.at_level(logging.WARNING, logger="gossiploco.metric_sinks"):
        for s in (0, 4, 8):
            jsonl.write(record(s))
        jsonl.write_summary({"wall_s": 1.0})
        jsonl.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert sinks.failures == {"tensorboard": 5} and sinks.records == {"tensorboard": 0}  # 3 records, summary, close
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "step 0" in warnings[0], warnings
    assert json.loads((tmp_path / "summary.json").read_text())["metric_sinks"]["failures"] == {"tensorboard": 4}


class Stuck:
    """A sink whose writes hang until ``release`` (a W&B server that does not answer)."""

    kind = "tensorboard"

    def __init__(self):
        self.entered, self.release, self.steps = threading.Event(), threading.Event(), []

    def write(self, step, values):
        self.entered.set()
        assert self.release.wait(30)
        self.steps.append(step)

    def write_summary(self, values):
        pass

    def close(self):
        pass


@pytest.mark.timeout(30)
def test_a_stuck_sink_never_holds_up_the_writer_and_a_full_backlog_is_dropped_and_counted(tmp_path, make_config,
                                                                                        monkeypatch, caplog):
    stuck = Stuck()
    monkeypatch.setattr(MetricSinks, "_build", lambda self, kind: stuck)
    sinks = MetricSinks(make_config("globalm1-localm2", **{"logging.sinks": ["tensorboard"]}).logging,
                        SinkTarget(tmp_path, group="g", name="run", config={}), backlog=2)
    sinks.write(record(0))
    assert stuck.entered.wait(10)  # the sinks' thread is inside the first write, stuck
    with caplog.at_level(logging.WARNING, logger="gossiploco.metric_sinks"):
        for s in (4, 8, 12, 16):  # returns at once: 2 wait in the queue, 2 find it full
            sinks.write(record(s))
    assert sinks.backlog_dropped == 2 and any("dropping new records" in r.getMessage() for r in caplog.records)
    stuck.release.set()
    sinks.close()
    assert stuck.steps == [0, 4, 8] and sinks.records == {"tensorboard": 3}


def test_a_sink_that_cannot_open_is_counted_and_not_tried_again(tmp_path, make_config, caplog):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the event files should go")
    sinks = MetricSinks(make_config("globalm1-localm2", **{"logging.sinks": ["tensorboard"]}).logging,
                        SinkTarget(blocked, group="g", name="run", config={}))
    with caplog.at_level(logging.WARNING, logger="gossiploco.metric_sinks"):
        for s in (0, 4):
            sinks.write(record(s))
        sinks.close()
    assert sinks.failures == {"tensorboard": 1} and sinks.records == {"tensorboard": 0}
    assert any("could not be opened" in r.getMessage() for r in caplog.records)


def test_non_finite_values_are_left_out_logged_once_per_name_and_counted(tmp_path, make_config, caplog):
    sinks = MetricSinks(make_config("globalm1-localm2", **{"logging.sinks": ["tensorboard"]}).logging,
                        SinkTarget(tmp_path, group="g", name="run", config={}))
    with caplog.at_level(logging.WARNING, logger="gossiploco.metric_sinks"):
        sinks.write(record(0))
        sinks.write(record(4, loss=float("nan")))
        sinks.write(record(8, loss=float("inf")))
        sinks.close()
    assert sinks.non_finite_dropped == 2
    assert [m for m in (r.getMessage() for r in caplog.records) if "not finite" in m] == [
        "metric loss is not finite at step 4: left out of tensorboard (metrics.jsonl has null; further ones are "
        "counted in summary.json, metric_sinks.non_finite_dropped)"]
    seen = tensorboard_scalars(tmp_path)
    assert [step for step, _ in seen["loss"]] == [0] and [step for step, _ in seen["cd_l2"]] == [0, 4, 8]


# -- slow: the commands ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_peer_logs_its_own_records_into_its_own_directory_and_wandb_groups_them_by_run(tmp_path):
    from conftest import tiny_peer_args
    from gossiploco.runtime.launch import LocalPeers

    args = [*tiny_peer_args("globalm1-localm2", rounds=2, inner_steps=3), "--log", "tensorboard,wandb"]
    with LocalPeers(2, tmp_path, args, env={"OMP_NUM_THREADS": "1", **WANDB_ENV}) as peers:
        peers.start()
        codes = peers.wait(150)
    assert codes == {0: 0, 1: 0}, peers.log(0)[-3000:] + peers.log(1)[-3000:]
    groups = set()
    for rank in (0, 1):
        out = peers.peer_dir(rank)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(records) >= 3 and all("cd_l2" in r for r in records)
        assert_tensorboard_holds(out, records, names=("cd_l2", "cd_js", "loss", "val_loss", "bytes_sent"))
        assert_wandb_holds(out, records)
        (run,) = [r.run for r in wandb_records(out) if r.WhichOneof("record_type") == "run"]
        assert run.display_name == f"peer-{rank}"
        groups.add(run.run_group)
        assert json.loads((out / "summary.json").read_text())["metric_sinks"]["failures"] == {"tensorboard": 0, "wandb": 0}
    assert len(groups) == 1 and groups.pop().startswith("globalm1-localm2-")  # the run id both peers share
