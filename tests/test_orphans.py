"""No orphaned processes: a peer or a bootstrap node that dies, even by SIGKILL, takes its hivemind
DHT process and that process's p2pd with it (``gossiploco.membership.lifeline``).

Process trees are read from /proc (Linux). A process counts as gone when its /proc entry is
missing, is a zombie (dead, waiting to be reaped by whoever adopted it), or belongs to a newer
process that reused the pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import tiny_peer_args, wait_until
from testbed.processes import process_tree, still_running

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process trees from /proc (Linux)"),
]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
GONE_WITHIN_S = 10.0
"""The requirement: every process of a SIGKILLed process's tree is gone within this long."""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid``, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def alive(tree: dict[int, int]) -> list[str]:
    """The processes of a ``process_tree`` snapshot that still run, as 'PID command' lines."""
    return [f"{pid} {_cmdline(pid)[:160]}" for pid in still_running(tree)]


def dht_processes(root: int) -> tuple[int, int] | None:
    """(DHT process, its p2pd) among ``root``'s descendants once both run, else None."""
    tree = process_tree(root)
    for pid in tree:
        stat = _stat(pid)
        if "p2pd" in _cmdline(pid) and stat is not None and stat[1] in tree and stat[1] != root:
            return stat[1], pid
    return None


def kill_tree(tree: dict[int, int]) -> None:
    """Clean-up after a failed test: SIGKILL what is left of a snapshot (only processes this test started)."""
    for line in alive(tree):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_tree_dies_with_sigkill(proc: subprocess.Popen, tree: dict[int, int]) -> None:
    proc.kill()
    proc.wait(timeout=GONE_WITHIN_S)
    try:
        assert wait_until(lambda: not alive(tree), GONE_WITHIN_S, poll_s=0.1), \
            f"still running {GONE_WITHIN_S:g} s after the SIGKILL of {proc.pid}:\n" + "\n".join(alive(tree))
    finally:
        kill_tree(tree)


@pytest.mark.timeout(120)
def test_a_sigkilled_peer_leaves_no_process_behind(tmp_path, bootstrap):
    out = tmp_path / "peer"
    command = [sys.executable, "-m", "gossiploco", "peer", "--rank", "0", "--join", bootstrap.address,
               "--swarm-key", str(bootstrap.swarm_key), "--host", "127.0.0.1",
               "--workers", "1", "--out", str(out), *tiny_peer_args("diloco", rounds=100_000)]
    with open(tmp_path / "peer.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    tree: dict[int, int] = {}
    try:
        # Running: training (a first metrics record), with its DHT process and p2pd up.
        running = lambda: (out / "metrics.jsonl").exists() and dht_processes(proc.pid) is not None
        wait_until(lambda: proc.poll() is not None or running(), 90, poll_s=0.2)
        assert proc.poll() is None and running(), (tmp_path / "peer.log").read_text()[-3000:]
        tree = process_tree(proc.pid)
        dht, p2pd = dht_processes(proc.pid)
        assert {proc.pid, dht, p2pd} <= set(tree)
        assert_tree_dies_with_sigkill(proc, tree)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_tree(tree)


@pytest.mark.timeout(120)
def test_a_sigkilled_bootstrap_node_leaves_no_process_behind(tmp_path):
    command = [sys.executable, "-m", "gossiploco", "dht", "--host", "127.0.0.1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True,
                            start_new_session=True)
    tree: dict[int, int] = {}
    try:
        lines = []
        for line in proc.stdout:  # ends when the node prints its --join lines (or exits)
            lines.append(line)
            if "--join /ip4/127.0.0.1/" in line:
                break
        assert "--join" in "".join(lines), "".join(lines)
        assert wait_until(lambda: dht_processes(proc.pid) is not None, 10)
        tree = process_tree(proc.pid)
        assert_tree_dies_with_sigkill(proc, tree)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        kill_tree(tree)


HELPER = textwrap.dedent("""
    import os, sys, threading, time, logging
    logging.basicConfig(level=logging.WARNING)
    from gossiploco.membership import lifeline
    from gossiploco.membership.dht_node import start_dht, visible_maddrs
    mode = sys.argv[1]
    if mode == "no-prctl":
        lifeline._prctl = None  # as on an OS without PR_SET_PDEATHSIG
    start = lambda: start_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=None,
                              timeout_s=30)
    if mode == "thread":  # started from a thread that then ends: the DHT must outlive the thread
        box = []
        thread = threading.Thread(target=lambda: box.append(start()))
        thread.start()
        thread.join()
        dht = box[0]
    else:
        dht = start()
    assert visible_maddrs(dht, 30)
    print("ready", dht.pid, flush=True)
    threading.Event().wait(600)  # parked until the test SIGKILLs this process
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["main", "thread", "no-prctl"])
def test_a_stopped_dht_process_and_p2pd_die_with_their_sigkilled_parent(mode):
    """The mechanisms one by one, with the DHT process and p2pd frozen by SIGSTOP so neither can
    notice anything by itself: "main", the kernel's parent-death signals alone; "thread", a DHT
    started from a thread that then ended (no parent-death signal, which would have fired with the
    thread); "no-prctl", no parent-death signal at all (non-Linux): the watchdog kills p2pd."""
    proc = subprocess.Popen([sys.executable, "-c", HELPER, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV, text=True, start_new_session=True)
    tree: dict[int, int] = {}
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("ready"), ready + proc.stderr.read()
        dht = int(ready.split()[1])
        assert wait_until(lambda: (dht_processes(proc.pid) or (None,))[0] == dht, 10)
        p2pd = dht_processes(proc.pid)[1]
        tree = process_tree(proc.pid)
        stopped = [dht, p2pd] if mode == "main" else [p2pd]  # the watchdog needs its process running
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        assert wait_until(lambda: all((_stat(pid) or ("",))[0] == "T" for pid in stopped), 5)
        assert_tree_dies_with_sigkill(proc, tree)
        if mode == "no-prctl":
            assert "no parent-death signal" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        kill_tree(tree)
