"""The command line, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import wait_until
from gossiploco.cli import app

FAST = ["--workers", "3", "--inner-steps", "4", "--rounds", "2", "--model", "tiny", "--device", "cpu", "--quiet"]


def small_data(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(3000)))
    return ["--data", str(text)]


def run(args):
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    return result


def test_simulate_writes_metrics_and_summary(tmp_path):
    out = tmp_path / "run"
    result = run(["simulate", "--config", "peers/globalm1-localm2.toml", *FAST, *small_data(tmp_path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("round" in r and "h" in r for r in records)
    assert all({"cd_l2", "cd_l2_sq", "cd_js"} <= set(r) for r in records)
    assert any("loss" in r for r in records) and any("val_loss" in r for r in records)
    assert [r["round"] for r in records if r["h"] == 0] == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("config", "workers", "inner_steps", "rounds", "final_val_loss", "final_val_ppl", "max_cd_l2", "max_cd_js", "wall_s"):
        assert key in summary
    assert summary["config"] == "globalm1-localm2" and summary["workers"] == 3 and summary["rounds"] == 2
    assert "val loss" in result.output


@pytest.mark.slow
def test_same_seed_gives_the_same_metrics(tmp_path):
    def metrics(name, seed):
        out = tmp_path / name
        assert run(["simulate", "-c", "localm1m2", *FAST, *small_data(tmp_path), "--seed", str(seed), "--out", str(out)]).exit_code == 0
        return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")} for line in (out / "metrics.jsonl").read_text().splitlines()]

    first = metrics("a", 1)
    assert first == metrics("b", 1)
    assert first != metrics("c", 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "0"], "workers: must be > 0"),
        (["--model", "huge"], "model.size: unknown size 'huge'"),
        (["--config", "nope"], "config: no such file or preset 'nope'"),
        (["--device", "tpu"], "device: must be auto, cpu, cuda or cuda:N"),
        (["--data", "/nonexistent/*.txt"], "data.paths: '/nonexistent/*.txt' matches no file"),
        (["--set", "inner.lr=-1"], "inner.lr: must be > 0"),
        (["--set", "mix2.blocks=['layers.9']"], "mix2.blocks: no block matches 'layers.9'"),
        (["--set", "nonsense"], "--set: expected KEY=VALUE"),
    ],
)
def test_bad_flags_fail_with_an_error_naming_the_field(tmp_path, args, message):
    import gc

    result = CliRunner().invoke(app, ["simulate", *FAST, "--out", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert gc.isenabled()  # its start-up turned the collector off and failed: on again (``runtime.collector``)


def test_start_up_runs_without_collections_and_the_run_with_them_on_what_start_up_made_frozen():
    import gc

    from gossiploco.runtime import collector

    frozen = gc.get_freeze_count()
    try:
        collector.pause()
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # start-up's objects
        collector.resume()
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)
        collector.resume()  # idempotent
        gc.disable()  # someone else's choice is kept: pause did nothing, nor does resume
        collector.pause()
        collector.resume()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


@pytest.mark.slow
def test_console_script_runs_as_a_subprocess(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gossiploco", "simulate", "-c", "diloco", *FAST, *small_data(tmp_path), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    # Measured only at h = 0 (monitor.every = 10 > H = 4), where DiLoCo is in exact consensus.
    assert summary["config"] == "diloco" and summary["max_cd_l2"] == 0.0 and summary["final_val_loss"] < 5.6


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["peer", "--no-such-flag"], 2)])
def test_the_command_freezes_what_is_left_before_the_interpreter_exits(args, code):
    """``gossiploco.__main__``: the shutdown's last garbage collection took a peer 2-3 s of CPU after its run; every
    object left is frozen before it, on every exit through the CLI (an atexit handler, run after, sees it), and the
    exit code is kept."""
    script = ("import atexit, gc, sys; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 1000)); "
              f"sys.argv = ['gossiploco', *{args!r}]; from gossiploco.__main__ import main; main()")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.strip().endswith("frozen True"), proc.stdout[-500:]


@pytest.mark.slow
def test_ctrl_c_stops_a_simulation_cleanly(tmp_path):
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-m", "gossiploco", "simulate", "-c", "globalm1-localm2", "--workers", "4", "--inner-steps", "50",
         "--rounds", "100", "--model", "tiny", "--device", "cpu", "--quiet", *small_data(tmp_path), "--out", str(tmp_path / "o")],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        header = proc.stderr.readline()  # printed once the swarm is built, right before training starts
        assert "4 workers x 100 rounds" in header
        metrics = tmp_path / "o" / "metrics.jsonl"
        assert wait_until(lambda: proc.poll() is not None or (metrics.exists() and metrics.read_text()), 60)
        assert proc.poll() is None, "the simulation ended before it was interrupted"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert "gossiploco simulate: stopped (SIGINT); newest checkpoint: " in proc.stderr.read()
    finally:
        proc.kill()


def test_keygen_writes_a_private_key_file_and_never_overwrites_one(tmp_path):
    from gossiploco.security.swarm_key import SwarmKey

    path = tmp_path / "swarm.key"
    made = run(["keygen", "--out", str(path)])
    key = SwarmKey.load(path)
    assert made.exit_code == 0 and key.fingerprint in made.output and path.stat().st_mode & 0o777 == 0o600
    again = run(["keygen", "--out", str(path)])
    assert again.exit_code == 2 and "never overwritten" in again.output and SwarmKey.load(path) == key


def test_a_peer_without_a_swarm_key_or_open_is_told_how_to_join(tmp_path):
    result = run(["peer", "--join", "/ip4/127.0.0.1/tcp/1/p2p/QmNope", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--swarm-key" in result.output and "--open" in result.output


def test_peer_needs_exactly_one_way_to_find_the_others(tmp_path):
    both = run(["peer", "--join", "/ip4/127.0.0.1/tcp/1/p2p/QmNope", "--peers", "tcp://127.0.0.1:1", "--rank", "0",
                "--out", str(tmp_path)])
    assert both.exit_code == 2 and "either --join" in both.output
    neither = run(["peer", "--rank", "0", "--out", str(tmp_path)])
    assert neither.exit_code == 2 and "either --join" in neither.output


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_peer_with_an_unreachable_bootstrap_address_says_what_to_check(tmp_path):
    from gossiploco.runtime.launch import free_ports

    port = free_ports(1)[0]
    proc = subprocess.run([sys.executable, "-m", "gossiploco", "peer", "--join",
                           f"/ip4/127.0.0.1/tcp/{port}/p2p/QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupGHp",
                           "--host", "127.0.0.1", "--open", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error:" in proc.stderr and str(port) in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_dht_command_prints_join_lines_and_stops_on_ctrl_c(tmp_path):
    import signal

    from gossiploco.security.swarm_key import SwarmKey

    proc = subprocess.Popen([sys.executable, "-m", "gossiploco", "dht", "--host", "127.0.0.1", "--identity",
                             str(tmp_path / "id.key"), "--swarm-key", str(tmp_path / "swarm.key")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the node is up (the test's timeout bounds it)
        assert "--join /ip4/127.0.0.1/tcp/" in line and "/p2p/" in line, line
        key = SwarmKey.load(tmp_path / "swarm.key")  # created, and carried by the printed command
        assert f"--swarm-key {key.text}" in line and (tmp_path / "swarm.key").stat().st_mode & 0o777 == 0o600
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130  # stopped (``runtime.stopping``)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "id.key").exists()
