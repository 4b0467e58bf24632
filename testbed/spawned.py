"""Python functions run as a group of spawned processes (``bench/allreduce.py``, ``bench/allreduce_overlap.py``).

``run_group`` starts the peer processes (multiprocessing ``spawn``), collects their messages and
guarantees that nothing outlives it: every peer calls ``become_session_leader`` first, and the
process manager (``gossiploco.runtime.launch.ProcessGroup``) SIGKILLs each peer's whole process
group on the way out (error, timeout, Ctrl+C or success), which also reaps helper processes a
library started (hivemind's averager and p2pd).

``load_impl`` loads the exchange class under test (``--zmq-impl``), in the driver and in the peers;
the rest is what a peer measures of itself (memory, CPU time, per-thread CPU time).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gossiploco.runtime.launch import ProcessGroup


class GroupFailed(RuntimeError):
    """A peer reported an error, died, or the group stopped making progress."""


def load_impl(spec: str):
    """``module:attr`` or ``/path/file.py:attr`` (to benchmark an experimental exchange)."""
    module, _, attr = spec.rpartition(":")
    if module.endswith(".py"):
        loaded = importlib.util.spec_from_file_location(Path(module).stem, module)
        mod = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    return getattr(mod, attr)


def become_session_leader() -> None:
    """Put this peer (and whatever it starts) in a session and process group of its own, for ``run_group``'s
    clean-up."""
    with contextlib.suppress(OSError):
        os.setsid()
    if os.environ.get("BENCH_DEBUG"):  # periodic stack dumps of a peer that seems stuck
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["BENCH_DEBUG"]), repeat=True)


class _Spawned:
    """A ``multiprocessing`` process seen as ``ProcessGroup`` sees a child: ``pid``, ``poll()``, ``wait(timeout)``."""

    def __init__(self, proc):
        self.proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.proc.name, timeout)
        return self.proc.exitcode


def finish(results, code: int) -> None:
    """Flush the result queue, then exit at once: a library thread that hangs must not keep the peer alive."""
    with contextlib.suppress(Exception):
        results.close()
        results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def close_within(close: Callable[[], None], timeout_s: float) -> bool:
    """Run ``close`` on a daemon thread; False if it failed or has not returned within ``timeout_s``."""
    import threading

    errors: list[BaseException] = []

    def run():
        try:
            close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive() and not errors


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in bytes; 0 where unavailable."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss(trim: bool = True) -> int:
    """Free what can be freed (gc; with ``trim`` also malloc_trim, which gives every free page of malloc's heaps back
    to the system, so the next allocations fault in fresh ones), reset VmHWM to the current RSS; returns that RSS."""
    import ctypes

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        if trim:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return proc_status("VmRSS")


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def thread_cpu() -> dict[str, tuple[str, float, float, int]]:
    """Per thread of this process: (name, user s, system s, minor faults), from /proc (a debugging aid)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            out[tid] = (stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) / tick, int(fields[12]) / tick,
                        int(fields[7]))
    return out


def thread_cpu_delta(before: dict, after: dict) -> str:
    rows = []
    for tid, (name, user, system, faults) in after.items():
        _, u0, s0, f0 = before.get(tid, (name, 0.0, 0.0, 0))
        if user - u0 + system - s0 > 0:
            rows.append(f"{name}[{tid}] user {user - u0:.2f} sys {system - s0:.2f} faults {faults - f0}")
    return ", ".join(rows)


def run_group(target, world: int, cfg: dict, idle_timeout_s: float, label: str,
              on_message: Callable[[tuple], None] | None = None, close_timeout_s: float = 15.0,
              shared: Callable | None = None) -> list[tuple]:
    """Start ``world`` spawn processes running ``target(rank, world, cfg, barrier, results, info_q,
    extra)``; collect their messages until every one sent ``("done", rank, ...)``, then give them
    ``close_timeout_s`` to send ``("closed", rank, ...)``. ``extra`` is ``shared(ctx)`` (or None):
    synchronisation objects the peers need beyond the barrier and queues.

    Raises ``GroupFailed`` on an ``("error", rank, text)`` message, a peer exiting early, or no
    message for ``idle_timeout_s``. Whatever happens, every peer's process group is killed before
    this returns or raises.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results, info_q = ctx.Barrier(world), ctx.Queue(), ctx.Queue()
    extra = shared(ctx) if shared else None
    procs = [ctx.Process(target=target, args=(rank, world, cfg, barrier, results, info_q, extra),
                         name=f"{label}-{rank}") for rank in range(world)]
    messages: list[tuple] = []
    done: set[int] = set()
    ok = False
    group = ProcessGroup()
    try:
        for p in procs:
            p.start()
            group.adopt(_Spawned(p))
        last = time.monotonic()
        while len(done) < world:
            try:
                msg = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done]
                if dead:
                    deadline = time.monotonic() + 2.0  # let a last error message arrive
                    while time.monotonic() < deadline:
                        with contextlib.suppress(queue.Empty):
                            m = results.get(timeout=0.2)
                            if m[0] == "error":
                                raise GroupFailed(f"{label}: rank {m[1]} failed:\n{m[2]}")
                    raise GroupFailed(f"{label}: rank(s) {dead} exited (codes {[procs[r].exitcode for r in dead]})")
                if time.monotonic() - last > idle_timeout_s:
                    raise GroupFailed(f"{label}: no progress for {idle_timeout_s:.0f}s")
                continue
            last = time.monotonic()
            if msg[0] == "error":
                raise GroupFailed(f"{label}: rank {msg[1]} failed:\n{msg[2]}")
            if msg[0] == "done":
                done.add(msg[1])
            messages.append(msg)
            if on_message:
                on_message(msg)
        closed = {m[1] for m in messages if m[0] == "closed"}
        deadline = time.monotonic() + close_timeout_s + 5
        while len(closed) < world and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                msg = results.get(timeout=0.5)
                messages.append(msg)
                if msg[0] == "closed":
                    closed.add(msg[1])
        ok = True
        return messages
    finally:
        if ok:
            group.wait(5)  # they are leaving: give them a moment
        group.stop(grace_s=0)  # SIGKILL what is left, whole process groups: also what a peer's libraries started
        results.cancel_join_thread()
        info_q.cancel_join_thread()
