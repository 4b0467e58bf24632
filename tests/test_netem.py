"""bench/netem.py on the test bed's network (testbed.netns, testbed.links): namespaces and shaped links are
built and always removed; the link probes (testbed.probes); a short real run.

The tests that build namespaces need root, ``ip`` and ``tc`` (iproute2), ``sysctl`` (procps) and a
kernel with network namespaces, veth, bridge and htb (``testbed.netns.preflight``). Where those
are missing they skip, with the reason; with ``GOSSIPLOCO_REQUIRE_NETNS=1`` (set by ``.ci/run``, which
runs as root and installs the tools) they fail instead, so CI never skips them silently. Every test
uses its own name prefix, so it never touches a benchmark run in progress (prefix ``gln``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import netem
from conftest import wait_until
from testbed.netns import list_namespaces, namespace_pids, preflight, remove_namespaces

ROOT = Path(__file__).resolve().parent.parent
PROBLEM = preflight()
REQUIRE_ENV = "GOSSIPLOCO_REQUIRE_NETNS"
PREFIX = f"gt{os.getpid() % 10**7}"


@pytest.fixture
def netns_available():
    """Skip (or fail, under ``GOSSIPLOCO_REQUIRE_NETNS=1``) where bench/netem.py cannot build its network."""
    if PROBLEM is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1, but bench/netem.py cannot run here: {PROBLEM}")
    pytest.skip(f"bench/netem.py cannot run here: {PROBLEM} (set {REQUIRE_ENV}=1 to fail instead)")


needs_netns = pytest.mark.usefixtures("netns_available")


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks after boot), or None if it is gone or a zombie (exited,
    waiting to be reaped). With the pid it names one process, even if the pid is reused later."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold ')'
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


@pytest.mark.timeout(10)
def test_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    assert netem.main(["--presets", "diloco", "--prefix", PREFIX]) == netem.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "cannot run here" in err and ("root" in err or "Linux" in err)


@pytest.mark.timeout(10)
def test_ring_security_table_compares_plaintext_and_curve(capsys):
    link = {"bandwidth_mbps": 50.0, "tcp": {"mbps": 47.9}, "ring_mbps": 47.2,
            "ring": {"durations_s": [1.7, 1.8], "by_security": {
                "plain": {"durations_s": [1.7, 1.8], "median_s": 1.75, "mbps": 47.2, "cpu_s": 0.03},
                "curve": {"durations_s": [1.8, 1.8], "median_s": 1.8, "mbps": 45.9, "cpu_s": 0.05}}}}
    table = netem.markdown({"runs": [], "links": [link]})
    assert "| 50 | 47.90 (95.8%) | 1.750 | 47.20 (94.4%) | 1.800 | 45.90 (91.8%) | 1.029 | 1.06, 1.00 | 0.030 / 0.050 |" in table
    assert netem.main(["--ring-security", "plain,tls", "--presets", "none"]) == 1
    assert "--ring-security" in capsys.readouterr().err


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_shaped_link_rate_ring_probe_and_cleanup(tmp_path):
    net = netem.Network(f"{PREFIX}a", 2)
    try:
        net.build()
        assert list_namespaces(net.prefix) == [f"{net.prefix}-p0", f"{net.prefix}-p1", f"{net.prefix}-sw"]
        assert net.set_congestion_control("auto") in ("cubic", "reno")
        net.shape(50)
        net.shape(20)  # shaping again replaces the earlier rate
        text = net.qdisc_text(0)
        assert text.count("rate 20Mbit") == 2 and "50Mbit" not in text  # upload and download
        tcp = netem.probe_tcp(net, tmp_path / "tcp", seconds=2.0)
        # One TCP flow carries at most 1448 / 1514 = 95.6% of the frame rate tc enforces.
        assert 0.80 * 20 < tcp["mbps"] < 0.99 * 20, tcp
        # The project's ring all-reduce (the probe checks the mean itself): 2.5 MB, about 1 s at 20 Mbit/s,
        # plaintext and over CurveZMQ (a swarm key of its own), alternately in the same probe processes.
        numel = 625_000
        ring = netem.probe_ring(net, tmp_path / "ring", numel, repeats=1, timeout_s=30.0, chunk_mb=1.0,
                                security=("plain", "curve"))
        assert ring["security"] == ["plain", "curve"] and (tmp_path / "ring" / "swarm.key").is_file()
        assert ring["durations_s"] == ring["by_security"]["plain"]["durations_s"]
        for mode in ("plain", "curve"):
            (seconds,) = ring["by_security"][mode]["durations_s"]
            assert 0.5 * 20 < netem.ring_rate_mbps(4 * numel, 2, seconds) < 20, (mode, ring)
    finally:
        net.destroy()
    assert list_namespaces(net.prefix) == []


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_swap_probe_shows_a_heartbeat_shorter_than_one_chunk_dropping_a_healthy_link(tmp_path):
    net = netem.Network(f"{PREFIX}s", 2)
    try:
        net.build()
        net.set_congestion_control("auto")
        net.shape(8)  # one 1 MiB chunk takes 1.05 s on the wire
        dropped = netem.probe_swap(net, tmp_path / "short", mb=2.0, chunk_mb=1.0, heartbeat_s=0.3, timeout_s=20.0)
        assert not dropped["ok"] and any("error" in side for side in dropped["sides"]), dropped
        kept = netem.probe_swap(net, tmp_path / "long", mb=2.0, chunk_mb=1.0, heartbeat_s=10.0, timeout_s=20.0)
        assert kept["ok"] and kept["heartbeat_s"] == 10.0, kept
        # 2 MB each way at 8 Mbit/s: at least 2 s, whatever the start-up.
        assert 1.8 < kept["seconds"] < 20.0, kept
        assert "FAILED" in netem.swap_line(dropped, 8) and "ok in" in netem.swap_line(kept, 8)
    finally:
        net.destroy()
    assert list_namespaces(net.prefix) == []


@needs_netns
@pytest.mark.timeout(20)
def test_leftovers_of_a_crashed_run_are_removed():
    prefix = f"{PREFIX}b"
    ns = f"{prefix}-p0"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    # A process that just stays alive inside the namespace, for remove_namespaces to kill.
    proc = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "60"], start_new_session=True)
    try:
        assert wait_until(lambda: proc.pid in namespace_pids(ns), 5)
        assert remove_namespaces(prefix) == [ns]
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert list_namespaces(prefix) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@contextlib.contextmanager
def _bench(prefix: str, out: Path, *extra: str):
    """The benchmark as a subprocess in its own process group. On exit, whatever the test saw: Ctrl+C
    if it still runs (SIGKILL to its group if that does not end it in 20 s), then removal of any
    namespace with ``prefix`` left behind. Tests check the benchmark's own clean-up before that."""
    cmd = [sys.executable, "-m", "bench.netem", "--prefix", prefix, "--workers", "2", "--model", "tiny",
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
        remove_namespaces(prefix)


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_short_run_measures_and_cleans_up(tmp_path):
    prefix = f"{PREFIX}c"
    with _bench(prefix, tmp_path, "--step-time", "0.05", "--inner-steps", "4", "--rounds", "2", "--ring-repeats", "0") as bench:
        out, _ = bench.communicate(timeout=80)
        assert bench.returncode == 0, out
        assert list_namespaces(prefix) == []
    results = json.loads((tmp_path / "results.json").read_text())
    (run,) = results["runs"]
    assert run["preset"] == "globalm1" and len(run["peers"]) == 2 and run["failures"] == 0
    assert 0 < run["measured_median_pct"] <= 100 and 0 < run["predicted_pct"] <= 100
    assert "| globalm1 | 50 |" in (tmp_path / "table.md").read_text()
    # Peers are encrypted: the run's own swarm key, and with the DHT an identity per peer.
    run_dir = tmp_path / "globalm1-50mbit"
    assert (run_dir / "swarm.key").is_file() and all((run_dir / f"peer-{r}" / "identity.key").is_file() for r in range(2))


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_interrupt_stops_peers_and_removes_namespaces(tmp_path):
    prefix = f"{PREFIX}d"
    peer_namespaces = [f"{prefix}-p0", f"{prefix}-p1"]
    run_dir = tmp_path / "globalm1-50mbit"
    started: dict[int, int] = {}  # pid -> start time of every process seen in the peers' namespaces

    def peers_training() -> bool:
        """Both peers run in their namespaces, past start-up: a peer opens its metrics.jsonl once it has
        joined, right before its first round."""
        return (all(namespace_pids(ns) for ns in peer_namespaces)
                and all((run_dir / f"peer-{r}" / "metrics.jsonl").is_file() for r in range(2)))

    def still_running() -> list[int]:
        return sorted(pid for pid, start in started.items() if process_start(pid) == start)

    with _bench(prefix, tmp_path, "--step-time", "0.2", "--inner-steps", "10", "--rounds", "100", "--ring-repeats", "0") as bench:
        assert wait_until(lambda: bench.poll() is not None or peers_training(), 60), "the peers never started training"
        assert bench.poll() is None, bench.communicate()[0]
        # The peers, the bootstrap node (in p0's namespace) and their DHT helper processes.
        for pid in [pid for ns in peer_namespaces for pid in namespace_pids(ns)]:
            if (start := process_start(pid)) is not None:
                started[pid] = start
        assert len(started) >= 2, started
        os.killpg(bench.pid, signal.SIGINT)  # Ctrl+C in the benchmark's terminal; the peers lead their own sessions
        out, _ = bench.communicate(timeout=60)
        # Checked before _bench's own clean-up runs, so only the benchmark can have stopped and removed these.
        assert bench.returncode == 130, out
        assert "interrupted (SIGINT); peers stopped, namespaces removed" in out, out
        assert list_namespaces(prefix) == [], out
        assert wait_until(lambda: not still_running(), 5), f"still running after the benchmark exited: {still_running()}\n{out}"
