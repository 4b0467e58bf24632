"""bench/netem.py: namespaces and shaped links are built and always removed; a short real run.

Skipped unless root with ``ip netns`` and ``tc`` (the benchmark's own preflight). Every test uses
its own name prefix, so it never touches a benchmark run in progress (prefix ``gln``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_netem", ROOT / "bench" / "netem.py")
netem = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = netem  # its dataclasses look their module up
_spec.loader.exec_module(netem)

PROBLEM = netem.preflight()
needs_netns = pytest.mark.skipif(PROBLEM is not None, reason=f"bench/netem.py cannot run here: {PROBLEM}")
PREFIX = f"gt{os.getpid() % 10**7}"


@pytest.mark.timeout(10)
def test_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    assert netem.main(["--presets", "diloco", "--prefix", PREFIX]) == netem.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "cannot run here" in err and ("root" in err or "Linux" in err)


@needs_netns
@pytest.mark.timeout(40)
def test_shaped_link_rate_and_cleanup(tmp_path):
    net = netem.Network(f"{PREFIX}a", 2)
    try:
        net.build()
        assert netem.list_namespaces(net.prefix) == [f"{net.prefix}-p0", f"{net.prefix}-p1", f"{net.prefix}-sw"]
        assert net.set_congestion_control("auto") in ("cubic", "reno")
        net.shape(50)
        net.shape(20)  # shaping again replaces the earlier rate
        text = net.qdisc_text(0)
        assert text.count("rate 20Mbit") == 2 and "50Mbit" not in text  # upload and download
        tcp = netem.probe_tcp(net, tmp_path, seconds=2.0)
        # One TCP flow carries at most 1448 / 1514 = 95.6% of the frame rate tc enforces.
        assert 0.80 * 20 < tcp["mbps"] < 0.99 * 20, tcp
    finally:
        net.destroy()
    assert netem.list_namespaces(net.prefix) == []


@needs_netns
@pytest.mark.timeout(20)
def test_leftovers_of_a_crashed_run_are_removed():
    prefix = f"{PREFIX}b"
    ns = f"{prefix}-p0"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    # A process that just stays alive inside the namespace, for remove_namespaces to kill.
    proc = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "60"], start_new_session=True)
    try:
        assert wait_until(lambda: str(proc.pid) in netem.sh(["ip", "netns", "pids", ns], check=False).stdout.split(), 5)
        assert netem.remove_namespaces(prefix) == [ns]
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert netem.list_namespaces(prefix) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@contextlib.contextmanager
def _bench(prefix: str, out: Path, *extra: str):
    """The benchmark as a subprocess in its own process group; stopped on exit if still running:
    Ctrl+C first (it removes its namespaces), SIGKILL to the group if that does not end it in 20 s."""
    cmd = [sys.executable, str(ROOT / "bench" / "netem.py"), "--prefix", prefix, "--workers", "2", "--model", "tiny",
           "--presets", "globalm1", "--bandwidths", "50", "--tcp-seconds", "0", "--out", str(out), *extra]
    bench = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        yield bench
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGINT)
            try:
                bench.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(bench.pid, signal.SIGKILL)
                bench.wait(timeout=10)


@needs_netns
@pytest.mark.timeout(60)
def test_short_run_measures_and_cleans_up(tmp_path):
    prefix = f"{PREFIX}c"
    with _bench(prefix, tmp_path, "--step-time", "0.05", "--inner-steps", "4", "--rounds", "2", "--ring-repeats", "0") as bench:
        out, _ = bench.communicate(timeout=55)
    assert bench.returncode == 0, out
    assert netem.list_namespaces(prefix) == []
    results = json.loads((tmp_path / "results.json").read_text())
    (run,) = results["runs"]
    assert run["preset"] == "globalm1" and len(run["peers"]) == 2 and run["failures"] == 0
    assert 0 < run["measured_median_pct"] <= 100 and 0 < run["predicted_pct"] <= 100
    assert "| globalm1 | 50 |" in (tmp_path / "table.md").read_text()


@needs_netns
@pytest.mark.timeout(60)
def test_interrupt_stops_peers_and_removes_namespaces(tmp_path):
    prefix = f"{PREFIX}d"

    def peers_running() -> bool:
        return all(netem.sh(["ip", "netns", "pids", f"{prefix}-p{r}"], check=False).stdout.split() for r in range(2))

    try:
        with _bench(prefix, tmp_path, "--step-time", "0.2", "--inner-steps", "10", "--rounds", "100", "--ring-repeats", "0") as bench:
            assert wait_until(peers_running, 30), "the peers never started"
            pids = [int(p) for r in range(2) for p in netem.sh(["ip", "netns", "pids", f"{prefix}-p{r}"]).stdout.split()]
            os.killpg(bench.pid, signal.SIGINT)  # Ctrl+C in the benchmark's terminal
            out, _ = bench.communicate(timeout=30)
    finally:
        netem.remove_namespaces(prefix)
    assert bench.returncode == 130, out
    assert "namespaces removed" in out
    assert netem.list_namespaces(prefix) == []
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
