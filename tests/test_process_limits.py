"""``transport.process_limits``: freed message buffers are reused instead of faulting in fresh pages for the next
message, unless the user tuned malloc themselves."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from gossiploco.transport import process_limits

ROOT = Path(__file__).resolve().parents[1]

# Two exchanges in one process all-reduce 64 MB (16 chunks of 4 MiB each way) in place; after two warm-up rounds,
# the page faults of four more, per MiB received.
FAULTS = """
import resource, sys, threading, torch
torch.set_num_threads(1)
from gossiploco.runtime.launch import free_ports
from gossiploco.transport import process_limits
from gossiploco.transport.zmq_exchange import ZmqExchange
endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2, "127.0.0.1")]
exchanges = [ZmqExchange(r, endpoints, "faults", 30.0) for r in range(2)]
assert all(e.wait_connected(20) for e in exchanges)
values = [torch.randn(16_000_000) for _ in range(2)]
def all_reduce(k):
    threads = [threading.Thread(target=lambda r=r: exchanges[r].all_reduce_mean(f"mix1/{k}", values[r], [0, 1],
                                                                                 inplace=True)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
all_reduce(0)
all_reduce(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for k in range(2, 6):
    all_reduce(k)
received_mib = 4 * 2 * 64e6 / 2**20
print(process_limits.reuse_freed_memory(), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / received_mib)
for e in exchanges:
    e.close()
"""


def _faults_per_mib(env: dict[str, str]) -> tuple[bool, float]:
    run = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert run.returncode == 0, run.stderr[-3000:]
    reused, faults = run.stdout.split()[-2:]
    return reused == "True", float(faults)


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc's thresholds are glibc's")
def test_received_chunks_reuse_freed_pages_instead_of_faulting_in_fresh_ones():
    """A page fault per 4 KiB is 256 per MiB received. Measured on the 2-core machine: about 100 per MiB with glibc's
    defaults (the user's malloc settings, here a no-op one, leave them), 6-11 with the exchange's thresholds."""
    reused, tuned = _faults_per_mib({})
    kept, defaults = _faults_per_mib({"GLIBC_TUNABLES": "glibc.malloc.perturb=0"})
    assert reused and not kept
    assert tuned < 40 and 3 * tuned < defaults, (tuned, defaults)


def test_malloc_settings_of_the_users_own_are_left_alone(monkeypatch, caplog):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    monkeypatch.setattr(process_limits.platform, "libc_ver", lambda: ("glibc", "2.36"))
    with caplog.at_level(logging.INFO, logger="gossiploco.transport.process_limits"):
        assert process_limits._set_malloc_thresholds() is False
    assert "malloc left as set in the environment (MALLOC_TRIM_THRESHOLD_)" in caplog.text


def test_outside_glibc_malloc_is_left_alone(monkeypatch):
    monkeypatch.setattr(process_limits.platform, "libc_ver", lambda: ("", ""))
    assert process_limits._set_malloc_thresholds() is False
