"""Checkpoints and resume: an interrupted run continued with --resume ends bit for bit where the uninterrupted
run ends; checkpoints are atomic, verified, kept and never silently wrong."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import tiny_config, wait_until
from gossiploco import checkpoint as ckpt
from gossiploco import files
from gossiploco.checkpoint import CheckpointError, CheckpointWriter, Snapshot, latest_checkpoint, run_checkpoints
from gossiploco.errors import ConfigError
from gossiploco.metrics import MetricsError, MetricsSink
from gossiploco.runtime.run_dir import output_dir, resume_checkpoint
from gossiploco.runtime.virtual import VirtualSwarm


def untimed(records):
    """Records without their timings (the fields ending in _s): what the same seed reproduces."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]


def metrics_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def interrupted_then_resumed(cfg, out, stop_after: int):
    """Run ``cfg`` into ``out``, Ctrl+C (a KeyboardInterrupt from the progress callback) after ``stop_after``
    callbacks (inner steps and measurements: mid-round, mid-measurement), then resume from the newest
    checkpoint as ``gossiploco simulate --resume`` does. Returns the resumed run's result."""
    swarm, writer = VirtualSwarm(cfg), CheckpointWriter(run_checkpoints(out), cfg.to_dict(), keep=2)
    calls = [0]

    def on_step(advance, record):
        calls[0] += 1
        if calls[0] >= stop_after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        swarm.run(MetricsSink(out), on_step, writer)
    writer.close()
    checkpoint = resume_checkpoint(out, cfg.to_dict())
    resumed = VirtualSwarm(cfg)
    if checkpoint is not None:
        resumed.resume(checkpoint)
    sink = MetricsSink(out, resume_bytes=checkpoint.meta["metrics_bytes"] if checkpoint else 0)
    writer = CheckpointWriter(run_checkpoints(out), cfg.to_dict(), keep=2)
    result = resumed.run(sink, None, writer)
    writer.close()
    sink.close()
    return result, checkpoint


def assert_same_run(result, out, reference, reference_out):
    assert result.final_params.keys() == reference.final_params.keys()
    for name, value in reference.final_params.items():
        assert torch.equal(result.final_params[name], value), name  # bit for bit
    assert untimed(metrics_of(out)) == untimed(metrics_of(reference_out))


@pytest.mark.parametrize("overrides, stops", [
    pytest.param({}, (26,), marks=pytest.mark.slow),  # 6 s: keeps the fast subset under its 2 minutes
    pytest.param({"mix1.compression": "4bit", "mix2.kind": "global", "mix2.compression": "topk"}, (9, 26),
                 marks=pytest.mark.slow),
])
def test_an_interrupted_simulation_resumed_ends_bit_for_bit_as_an_uninterrupted_one(tmp_path, overrides, stops):
    cfg = tiny_config("globalm1-localm2", rounds=8, **overrides)
    swarm = VirtualSwarm(cfg)  # (building modules draws from torch's generator; init_weights then overwrites them)
    torch_rng = torch.get_rng_state()
    reference = swarm.run(MetricsSink(tmp_path / "reference"))
    assert torch.equal(torch.get_rng_state(), torch_rng)  # training draws nothing from torch's generator: no state to save
    # 4 inner steps and 2 measurements (h = 0 and 2) a round: 6 callbacks per round
    for stop in stops:  # mid-round 1 (after a measurement), mid-round 4
        out = tmp_path / f"stop-{stop}"
        result, checkpoint = interrupted_then_resumed(cfg, out, stop)
        assert checkpoint is not None and 0 < checkpoint.round < 8
        assert_same_run(result, out, reference, tmp_path / "reference")
        assert result.summary["resumed_from"] == checkpoint.round


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["globalm1-adaptive", "sync-dp", "globalm1s", "localm1m2", "diloco"])
def test_resume_is_exact_at_every_moment_for_every_kind_of_run(tmp_path, preset):
    cfg = tiny_config(preset, rounds=7)
    calls = []
    reference = VirtualSwarm(cfg).run(MetricsSink(tmp_path / "reference"), lambda *_: calls.append(1))
    # 6 callbacks a round (4 inner steps, measurements at h = 0 and 2) and a final one: a stop every 7 lands once in
    # each phase of a round, in rounds 0 to 6 (round 0: no checkpoint, starts over)
    assert len(calls) == 6 * 7 + 1
    for stop in range(1, len(calls), 7):
        out = tmp_path / f"stop-{stop}"
        result, _ = interrupted_then_resumed(cfg, out, stop)
        assert_same_run(result, out, reference, tmp_path / "reference")


def simulate_command(out, *extra):
    return [sys.executable, "-m", "gossiploco", "simulate", "-c", "globalm1-localm2", "--workers", "3", "--inner-steps",
            "30", "--rounds", "8", "--model", "tiny", "--device", "cpu", "--quiet", "--set", "data.seq_len=32",
            "--set", "data.max_corpus_mb=2.0", "--set", "checkpoint.every=2", "--out", str(out), *extra]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_then_resume_on_the_command_line_gives_the_uninterrupted_run(tmp_path):
    """The issue's test: ``gossiploco simulate`` of 8 rounds stopped with Ctrl+C mid-round, the same command plus
    --resume, compared with the same command run without interruption: the final checkpoint and the metrics."""
    reference = tmp_path / "reference"
    # The uninterrupted run goes on beside the interrupted one (its own process and directory; CPU results do not
    # depend on what else runs), compared once both are done
    reference_log = tmp_path / "reference.log"
    with reference_log.open("w") as log:
        uninterrupted = subprocess.Popen(simulate_command(reference), stdout=log, stderr=subprocess.STDOUT)
    try:
        out = tmp_path / "run"
        proc = subprocess.Popen(simulate_command(out), stderr=subprocess.PIPE, text=True)
        try:
            metrics = out / "metrics.jsonl"  # 4 records a round (h = 0, 10, 20 and the round's last): stop mid-round 3
            assert wait_until(lambda: proc.poll() is not None or (metrics.exists() and metrics.read_text().count("\n") >= 14), 120)
            assert proc.poll() is None, "the run ended before it was interrupted"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 130
            err = proc.stderr.read()
        finally:
            proc.kill()
        assert "--resume" in err, err
        interrupted = json.loads((out / "summary.json").read_text())
        assert interrupted["interrupted"] and interrupted["round_reached"] >= 3 and interrupted["final_val_loss"] is not None
        stopped_at = latest_checkpoint(run_checkpoints(out)).round
        assert 3 <= stopped_at < 8  # Ctrl+C saved the round it interrupted (checkpoint.every = 2 would give round 2)
        again = subprocess.run(simulate_command(out, "--resume"), capture_output=True, text=True, timeout=240)
        assert again.returncode == 0, again.stderr
        assert uninterrupted.wait(timeout=240) == 0, reference_log.read_text()[-3000:]
    finally:
        uninterrupted.kill()
    assert f"resuming {out} at round {stopped_at}" in " ".join(again.stderr.split())
    assert untimed(metrics_of(out)) == untimed(metrics_of(reference))
    final, expected = latest_checkpoint(run_checkpoints(out)), latest_checkpoint(run_checkpoints(reference))
    assert final.round == expected.round == 8
    assert final.tensors.keys() == expected.tensors.keys()
    assert [k for k in expected.tensors if not torch.equal(final.tensors[k], expected.tensors[k])] == []


# -- the files --------------------------------------------------------------------------------------------


def snapshot(round_index: int, value: float = 1.0) -> Snapshot:
    return Snapshot(round_index, {"w0/z/a": torch.full((3, 2), value), "w0/adam/step/a": torch.tensor(5.0)},
                    {"workers": ["w0"], "note": round_index})


CONFIG = {"name": "t", "workers": 1, "device": "cpu", "compute": {"compile": "off"}, "inner": {"lr": 0.1}}


def written(tmp_path, rounds, keep=2):
    writer = CheckpointWriter(tmp_path, CONFIG, keep=keep)
    for r in rounds:
        writer.submit(snapshot(r, float(r)))
        assert writer.flush(10)
    writer.close()
    return writer


def test_checkpoints_are_written_verified_and_the_newest_kept(tmp_path):
    writer = written(tmp_path, [1, 2, 3, 4], keep=2)
    assert writer.written == [1, 2, 3, 4] and writer.failures == 0
    assert [p.name for p in ckpt.checkpoint_files(tmp_path)] == ["round-000004.json", "round-000003.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000003.json", "round-000003.safetensors",
                                                         "round-000004.json", "round-000004.safetensors"]
    latest = latest_checkpoint(tmp_path)
    assert latest.round == 4 and latest.meta["note"] == 4 and torch.equal(latest.tensors["w0/z/a"], torch.full((3, 2), 4.0))


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete tensors", "garble json"])
def test_a_damaged_newest_checkpoint_is_detected_and_the_previous_one_used(tmp_path, caplog, damage):
    written(tmp_path, [1, 2])
    tensors, meta = ckpt.checkpoint_paths(tmp_path, 2)
    if damage == "flip a byte":
        data = bytearray(tensors.read_bytes())
        data[-3] ^= 0x40
        tensors.write_bytes(bytes(data))
    elif damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:-5])
    elif damage == "delete tensors":
        tensors.unlink()
    else:
        meta.write_text(meta.read_text()[:40])
    with caplog.at_level(logging.WARNING):
        latest = latest_checkpoint(tmp_path)
    assert latest.round == 1
    assert "round-000002" in caplog.text and "older checkpoint" in caplog.text


def test_when_every_checkpoint_is_damaged_the_error_says_so(tmp_path):
    written(tmp_path, [1])
    tensors, _ = ckpt.checkpoint_paths(tmp_path, 1)
    tensors.write_bytes(b"\0" * tensors.stat().st_size)
    with pytest.raises(CheckpointError, match="every checkpoint .* is damaged.*SHA-256"):
        latest_checkpoint(tmp_path)


def test_a_checkpoint_of_another_configuration_is_refused_naming_what_differs(tmp_path):
    written(tmp_path, [1])
    checkpoint = latest_checkpoint(tmp_path)
    ckpt.check_compatible(checkpoint, {**CONFIG, "device": "cuda", "compute": {"compile": "on"}})  # each run's own
    with pytest.raises(CheckpointError, match=r"inner\.lr: checkpoint 0\.1, now 0\.2; workers: checkpoint 1, now 2"):
        ckpt.check_compatible(checkpoint, {**CONFIG, "workers": 2, "inner": {"lr": 0.2}})


def test_a_write_that_fails_leaves_the_previous_file_and_no_partial_one(tmp_path):
    path = tmp_path / "x.json"
    files.atomic_write_bytes(path, b"old")

    def half_then_crash(tmp):
        tmp.write_bytes(b"ne")
        raise OSError("disk full")

    with pytest.raises(OSError):
        files.atomic_write(path, half_then_crash)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_the_training_thread_does_not_wait_for_the_disk(tmp_path, monkeypatch, caplog):
    """A slow disk: submit returns at once; a newer snapshot replaces one still waiting (counted, said)."""
    gate = threading.Event()
    real = ckpt.write_checkpoint

    def slow_write(directory, snap, config):
        gate.wait(10)
        return real(directory, snap, config)

    monkeypatch.setattr(ckpt, "write_checkpoint", slow_write)
    writer = CheckpointWriter(tmp_path, CONFIG, keep=3)
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        writer.submit(snapshot(1))
        assert wait_until(lambda: writer.writing, 5)  # round 1 is on its way to the (slow) disk
        for r in (2, 3):
            writer.submit(snapshot(r))
    assert time.perf_counter() - start < 0.5
    assert not writer.flush(0.05)
    gate.set()
    assert writer.close(10)
    assert writer.written == [1, 3] and writer.replaced == 1 and "round 2 not written" in caplog.text


def test_a_failed_write_is_loud_and_counted_and_the_run_goes_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = CheckpointWriter(blocker / "checkpoints", CONFIG, keep=2)
    with caplog.at_level(logging.ERROR):
        writer.submit(snapshot(1))
        writer.close(10)
    assert writer.failures == 1 and writer.written == [] and "could not be written" in caplog.text


def test_the_model_of_a_checkpoint_is_the_workers_average(tmp_path):
    snap = Snapshot(3, {"w0/z/a": torch.tensor([1.0, 2.0]), "w1/z/a": torch.tensor([3.0, 6.0]),
                        "w0/momentum/a": torch.zeros(2), "w1/momentum/a": torch.ones(2)}, {"workers": ["w0", "w1"]})
    path = ckpt.write_checkpoint(tmp_path / "checkpoints", snap, CONFIG)
    for source in (path, tmp_path):
        params, config = ckpt.load_model_params(source)
        assert torch.equal(params["a"], torch.tensor([2.0, 4.0])) and config == CONFIG
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ckpt.load_model_params(tmp_path / "elsewhere")


# -- the output directory ---------------------------------------------------------------------------------


def test_a_run_is_never_overwritten_and_resume_finds_it(tmp_path):
    default = tmp_path / "runs" / "simulate"
    assert output_dir(None, default, resume=False) == default
    default.mkdir(parents=True)
    (default / "metrics.jsonl").write_text("{}\n")
    assert output_dir(None, default, resume=False) == tmp_path / "runs" / "simulate-2"  # the same command again
    (tmp_path / "runs" / "simulate-2").mkdir()
    (tmp_path / "runs" / "simulate-2" / "checkpoints").mkdir()
    assert output_dir(None, default, resume=False) == tmp_path / "runs" / "simulate-3"
    assert output_dir(None, default, resume=True) == tmp_path / "runs" / "simulate-2"  # the newest
    with pytest.raises(ConfigError, match="already holds a run; add --resume"):
        output_dir(default, default, resume=False)
    with pytest.raises(ConfigError, match="no run to resume"):
        output_dir(None, tmp_path / "none", resume=True)


def test_resumed_metrics_drop_what_came_after_the_checkpoint(tmp_path):
    sink = MetricsSink(tmp_path)
    sink.write({"round": 0})
    cut = sink.bytes_written
    sink.write({"round": 1, "h": 2})  # written after the checkpoint: the round was cut short
    sink.close()
    again = MetricsSink(tmp_path, resume_bytes=cut)
    assert again.records == [{"round": 0}]
    again.write({"round": 1, "h": 0})
    again.close()
    assert metrics_of(tmp_path) == [{"round": 0}, {"round": 1, "h": 0}]
    with pytest.raises(MetricsError, match="fewer than"):
        MetricsSink(tmp_path, resume_bytes=10_000)


def test_a_compressed_mix1_reference_is_kept_with_the_group_that_made_it():
    """A resumed worker holds its Mix1 reference for exactly the members whose mean it is (a group with others
    would compress against another reference and fail the mix for everyone); one whose last mix failed holds none
    (its next Mix1 is fp32, as everyone's in a group that changed); one from a checkpoint that did not keep the
    members sends fp32 once."""
    from gossiploco.mixing.operators import INITIAL_REFERENCE
    from gossiploco.runtime.worker_state import capture, restore

    cfg = tiny_config("globalm1-localm2", **{"mix1.compression": "4bit"})
    swarm = VirtualSwarm(cfg)
    algo, fresh = swarm.algos[0], swarm.algos[1]
    mixer = algo.mix1[0]
    assert mixer.reference_state()[1:] == (INITIAL_REFERENCE, None)  # x_0, for any group
    reference = mixer.reference_state()[0] + 0.5
    mixer.restore_reference(reference.clone(), 12345, [7, 3, 5])
    tensors, meta = capture(algo, "w0")
    meta = json.loads(json.dumps(meta))  # as a checkpoint stores it
    restore(fresh, "w0", tensors, meta)
    held = fresh.mix1[0].reference_state()
    assert torch.equal(held[0], reference) and held[1:] == (12345, [3, 5, 7])

    mixer.forget_reference()  # the last mix failed: the resumed worker must not fall back to x_0
    tensors, meta = capture(algo, "w0")
    restore(fresh, "w0", tensors, json.loads(json.dumps(meta)))
    assert fresh.mix1[0].reference_state() is None

    mixer.restore_reference(reference.clone(), 12345, [3, 5, 7])
    tensors, meta = capture(algo, "w0")
    del meta["mix1_reference_members"]  # written before the members were kept
    restore(fresh, "w0", tensors, json.loads(json.dumps(meta)))
    assert fresh.mix1[0].reference_state() is None
    swarm.close()
