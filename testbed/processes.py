"""Processes of the test bed: the one process manager, waits with deadlines, and what /proc says about processes.

The manager is ``gossiploco.runtime.launch.ProcessGroup`` (``LocalPeers`` runs on it too): every child
leads its own session, ``stop()`` interrupts, waits a bounded time, kills, and then kills whatever is
left in the children's process groups. ``testbed.spawned`` drives ``multiprocessing`` children with it.

Here besides: ``wait_until`` (a condition with a deadline, never a fixed sleep), ``shielded`` (a clean-up
that a second Ctrl+C cannot cut short), the environment children get, a process table read from
/proc (Linux) to find what a process left behind (``descendants``), and what one process holds
(``resources``: memory, threads, file descriptors).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gossiploco.runtime.launch import ProcessGroup, signal_group

__all__ = ["ProcInfo", "ProcessGroup", "child_env", "cmdline", "descendants", "once_free", "process_table",
           "resources", "shielded", "signal_group", "signal_pid", "tail", "wait_until"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0, poll_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passes (False): a condition with a
    deadline, never a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def once_free(bind: Callable[[], T], timeout_s: float = 5.0) -> T:
    """``bind()``'s result once the address it binds is free (a process closed it a moment ago): ``bind`` is tried
    again while it raises ``OSError``, until ``timeout_s``; then its last error is raised."""
    made: list[T] = []
    errors: list[OSError] = []

    def bound() -> bool:
        try:
            made.append(bind())
        except OSError as exc:
            errors.append(exc)
        return bool(made)

    if not wait_until(bound, timeout_s):
        raise errors[-1]
    return made[0]


def child_env(**extra: str) -> dict[str, str]:
    """A child's environment: this one's, unbuffered output, one math thread (peers share the machine's cores)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **extra}


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log ("" when it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def signal_pid(pid: int, sig: int) -> None:
    """Send ``sig`` to process ``pid``; one that is gone (or not ours) is ignored."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ignore SIGINT, SIGTERM and SIGHUP inside (a clean-up that must finish); restore them after."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- the process table ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcInfo:
    """One process as /proc/PID/stat describes it; (pid, start) names it even after the pid is reused."""

    pid: int
    ppid: int
    pgrp: int
    session: int
    state: str
    start: int
    """Start time, clock ticks after boot."""
    comm: str


def process_table() -> dict[int, ProcInfo]:
    """Every process of the machine from /proc (pid -> parent, group, session, state, start time)."""
    table: dict[int, ProcInfo] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        head, _, rest = raw.rpartition(")")  # the command name may hold spaces and ')'
        comm = head.partition("(")[2]
        fields = rest.split()
        try:  # after the name: state ppid pgrp session ...; the start time is field 22 overall
            table[int(entry.name)] = ProcInfo(int(entry.name), int(fields[1]), int(fields[2]), int(fields[3]),
                                              fields[0], int(fields[19]), comm)
        except (IndexError, ValueError):
            continue
    return table


def descendants(table: dict[int, ProcInfo], root: int) -> list[ProcInfo]:
    """Every process below ``root`` in ``table`` (``root`` itself not included)."""
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    out, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid in table:
            out.append(table[pid])
            stack += children.get(pid, [])
    return out


def process_tree(root: int) -> dict[int, int]:
    """``root`` and its living descendants now: pid -> start time (to tell a reused pid apart later)."""
    table = process_table()
    live = [info for info in [table.get(root), *descendants(table, root)] if info is not None and info.state != "Z"]
    return {info.pid: info.start for info in live}


def still_running(tree: dict[int, int]) -> list[int]:
    """The processes of a ``process_tree`` snapshot that still run (same pid and start time, not a zombie)."""
    table = process_table()
    return [pid for pid, start in tree.items()
            if (info := table.get(pid)) is not None and info.state != "Z" and info.start == start]


def cmdline(pid: int, limit: int = 160) -> str:
    """Process ``pid``'s command line, cut to ``limit`` characters ("" when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resources(pid: int | str = "self") -> dict[str, int]:
    """What process ``pid`` holds now, from /proc (Linux; fields it cannot read are absent): ``rss`` (bytes
    resident, shared library pages included), ``pss`` (its proportional share of them: what the processes of a
    swarm on one machine add up to), ``threads``, ``fds`` (open file descriptors) and ``sockets`` (those that are
    sockets: TCP connections, listeners, and ZeroMQ's internal signalling pairs)."""
    out: dict[str, int] = {}
    base = f"/proc/{pid}"
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"{base}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss"] = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"{base}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                out["pss"] = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError):
        fds, sockets = 0, 0
        for fd in os.listdir(f"{base}/fd"):
            fds += 1
            with contextlib.suppress(OSError):
                sockets += os.readlink(f"{base}/fd/{fd}").startswith("socket:")
        out["fds"], out["sockets"] = fds, sockets
    return out
