"""``ProcessGroup.stop``: a child that leaves on SIGINT is left to exit; one that does not is asked for its stacks
(``dump_stacks``), logged and killed, so that a peer stuck on its way out says where."""

from __future__ import annotations

import logging
import sys
import time

from gossiploco.runtime.launch import ProcessGroup

STUCK = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
signal.signal(signal.SIGINT, signal.SIG_IGN)
def stuck_on_the_way_out():
    print("ready", flush=True)
    while True:
        time.sleep(0.01)
stuck_on_the_way_out()
"""

LEAVES = """
import sys, time
print("ready", flush=True)
try:
    while True:
        time.sleep(0.01)
except KeyboardInterrupt:
    sys.exit(130)
"""


def _wait_ready(log, deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    while "ready" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < end, "the child did not start"
        time.sleep(0.01)


def test_a_child_stuck_past_the_grace_window_dumps_its_stacks_into_its_log_and_is_killed(tmp_path, caplog):
    group = ProcessGroup(grace_s=0.3, dump_stacks=True)
    stuck_log, leaves_log = tmp_path / "stuck.log", tmp_path / "leaves.log"
    stuck = group.start([sys.executable, "-c", STUCK], stuck_log)
    leaves = group.start([sys.executable, "-c", LEAVES], leaves_log)
    _wait_ready(stuck_log)
    _wait_ready(leaves_log)
    with caplog.at_level(logging.WARNING, logger="gossiploco.runtime.launch"):
        group.stop()
    assert leaves.returncode == 130 and stuck.returncode == -9
    assert group.killed == [stuck.pid]
    assert "in stuck_on_the_way_out" in stuck_log.read_text()  # faulthandler's line for that frame
    assert [r.getMessage() for r in caplog.records] == [
        f"process {stuck.pid} did not stop within 0.3 s of its SIGINT; its threads' stacks are in its log: killed"]


def test_without_dump_stacks_a_stuck_child_is_killed_and_logged_without_a_signal_for_its_stacks(tmp_path, caplog):
    group = ProcessGroup(grace_s=0.3)
    log = tmp_path / "stuck.log"
    stuck = group.start([sys.executable, "-c", STUCK], log)
    _wait_ready(log)
    with caplog.at_level(logging.WARNING, logger="gossiploco.runtime.launch"):
        group.stop()
    assert stuck.returncode == -9 and group.killed == [stuck.pid]
    assert "stuck_on_the_way_out" not in log.read_text()
    assert [r.getMessage() for r in caplog.records] == [f"process {stuck.pid} did not stop within 0.3 s of its SIGINT: killed"]
