"""Start peer processes on this machine (tests, benchmarks, local swarms) and always stop them.

``LocalPeers`` runs ``python -m gossiploco peer`` once per rank, each with its own output
directory and log file: with a static peer list on loopback ports, or (``join``) through a DHT
bootstrap address, each peer binding a free port of its own. The run is private: a swarm key
(``swarm_key``, default: a new one in ``out_dir/swarm.key``) goes to every peer; with ``join``
each rank gets an identity file whose peer ids increase with the rank (``ordered_identities``),
and ``--rank`` picks its data stream, so a local run matches the virtual swarm's order. With
``open_run`` (``join`` only) the peers take part in a public run instead: ``--open``, no swarm key;
the bootstrap must be an open one (``start_bootstrap(open_run=True)``).

``stop()`` asks every process still running to leave (SIGINT, like Ctrl+C), waits a bounded time,
then kills what is left, so no process outlives its owner; it is also what the context manager
runs on exit.

``ProcessGroup`` is the process manager underneath (the test bed's and the benchmarks' too): each
process it starts leads a session of its own, so its whole process group can be signalled (frozen,
resumed, interrupted, killed) and nothing it started is left behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 10000


def ephemeral_ports() -> range:
    """The ports the kernel hands out for ``bind(0)`` and outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports on ``host`` that were free a moment ago, all held open together while probing.

    They are picked at random outside the kernel's ephemeral range: a port the kernel hands out itself
    (to a ``bind(0)`` or an outgoing connection, such as a p2pd daemon's listener or a tunnel started
    between this call and the caller's bind) is never one of them. Seen before this rule: a tunnel's
    listener took a port picked here, and the exchange that was to bind it failed.
    """
    ephemeral = ephemeral_ports()
    below, above = range(LOWEST_PICKED_PORT, max(LOWEST_PICKED_PORT, ephemeral.start)), range(ephemeral.stop, 65536)
    outside = len(below) + len(above)
    rng = random.Random()

    def pick() -> int:  # uniformly outside the ephemeral range (anywhere, where that range leaves too little room)
        if outside < 16 * count:
            return rng.randrange(LOWEST_PICKED_PORT, 65536)
        i = rng.randrange(outside)
        return below[i] if i < len(below) else above[i - len(below)]

    held: list[socket.socket] = []
    try:
        for _ in range(64 * count):
            if len(held) == count:
                break
            port = pick()
            if any(s.getsockname()[1] == port for s in held):
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            held.append(s)
        if len(held) < count:
            raise OSError(f"found only {len(held)} of {count} free ports on {host}")
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


STOP_GRACE_S = 20.0
"""How long ``stop`` waits for interrupted processes to leave before it kills them."""
STACKS_WAIT_S = 1.0
"""How long ``stop`` gives a child that did not leave to write its threads' stacks (``dump_stacks``) before the kill."""


class Child(Protocol):
    """What ``ProcessGroup`` manages: a ``subprocess.Popen``, or anything with the same three members that
    leads its own session (a ``multiprocessing`` process that called ``os.setsid``, wrapped)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; one that is gone (or not ours) is ignored."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class ProcessGroup:
    """Child processes, each the leader of its own session and process group.

    ``start`` and ``adopt`` add children; ``wait`` waits for them with a deadline; ``stop`` (idempotent,
    never raises) resumes and interrupts every live child, waits at most ``grace_s``, SIGKILLs the process
    groups still running, and then SIGKILLs every child's process group whether its leader is alive or
    not: whatever a child started in its session goes with it. Not thread-safe: one owner drives it.
    """

    def __init__(self, *, env: dict[str, str] | None = None, cwd: str | Path | None = None, ctrl_c: bool = False,
                 grace_s: float = STOP_GRACE_S, dump_stacks: bool = False):
        """``env``: the environment of every child (default: this process's). ``ctrl_c``: ``stop`` interrupts
        each child's whole process group, as Ctrl+C in its terminal would, instead of the child alone.
        ``dump_stacks``: the children print their threads' stacks on SIGUSR1 (``gossiploco peer`` does:
        ``run_lifecycle.dump_stacks_on_sigusr1``), so ``stop`` asks one that did not leave for them, into its log,
        before it kills it: a peer stuck on its way out says where."""
        self.env = env
        self.cwd = cwd
        self.ctrl_c = ctrl_c
        self.grace_s = grace_s
        self.dump_stacks = dump_stacks
        self.killed: list[int] = []
        """Pids of the children ``stop`` had to kill (they did not leave within the grace window), each logged."""
        self.children: list[Child] = []

    def start(self, cmd: Sequence[str], log: Path | None = None, *, env: dict[str, str] | None = None,
              append: bool = False, header: bool = False, **popen: Any) -> subprocess.Popen:
        """Start ``cmd`` in a new session, its stdout and stderr into ``log`` (``append``: after what is
        there; ``header``: first a line ``# COMMAND``), or as ``popen`` says when ``log`` is None."""
        env = self.env if env is None else env
        popen.setdefault("stdin", subprocess.DEVNULL)
        if log is None:
            proc = subprocess.Popen(list(cmd), env=env, cwd=self.cwd, start_new_session=True, **popen)
        else:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            with Path(log).open("a" if append else "w") as out:
                if header:
                    out.write(f"# {shlex.join(cmd)}\n")
                    out.flush()
                proc = subprocess.Popen(list(cmd), env=env, cwd=self.cwd, start_new_session=True, stdout=out,
                                        stderr=subprocess.STDOUT, **popen)
        self.children.append(proc)
        return proc

    def adopt(self, child: Child) -> Child:
        """Manage ``child``, started elsewhere, which leads its own session."""
        self.children.append(child)
        return child

    def live(self) -> list[Child]:
        return [child for child in self.children if child.poll() is None]

    def wait(self, timeout_s: float, children: Sequence[Child] | None = None) -> list[int | None]:
        """Exit codes once all of ``children`` (default: every child) have exited; None for any still running
        at the deadline, ``timeout_s`` from now."""
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for child in self.children if children is None else children:
            try:
                codes.append(child.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def stop(self, grace_s: float | None = None) -> None:
        """SIGCONT and SIGINT every live child (its group with ``ctrl_c``), wait up to ``grace_s`` (default: the
        group's), SIGKILL the groups still running; then SIGKILL every child's group. ``grace_s`` 0: SIGKILL at once."""
        grace_s = self.grace_s if grace_s is None else grace_s
        live = self.live()
        if grace_s > 0:
            for child in live:
                signal_group(child.pid, signal.SIGCONT)  # a frozen child could not leave
                if self.ctrl_c:
                    signal_group(child.pid, signal.SIGINT)
                else:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(child.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for child in live:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(child, grace_s)
        for child in self.children:
            signal_group(child.pid, signal.SIGKILL)  # what it left in its group (its leader exited or not)

    def _kill(self, child: Child, grace_s: float) -> None:
        """SIGKILL ``child``'s group. With ``grace_s`` > 0 it did not leave within that long of its SIGINT: first its
        stacks (``dump_stacks``), and the kill is logged and counted (``killed``)."""
        stacks = ""
        if self.dump_stacks and grace_s > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child.pid, signal.SIGUSR1)  # one with no handler yet dies of it: it was to be killed anyway
                stacks = "; its threads' stacks are in its log"
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=STACKS_WAIT_S)  # the dump is written at once; an exit meanwhile ends the wait
        if grace_s > 0:
            log.warning("process %d did not stop within %g s of its SIGINT%s: killed", child.pid, grace_s, stacks)
            self.killed.append(child.pid)
        signal_group(child.pid, signal.SIGKILL)
        if child.poll() is None:  # not a group leader after all
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalPeers:
    """``count`` peer processes on ``host``; extra CLI arguments go to every peer (``args``) or one (``per_rank``)."""

    def __init__(self, count: int, out_dir: str | Path, args: Sequence[str] = (), *, host: str = "127.0.0.1",
                 per_rank: dict[int, Sequence[str]] | None = None, env: dict[str, str] | None = None,
                 join: str | None = None, swarm_key: Path | None = None, open_run: bool = False, niceness: int = 0):
        """``niceness``: added to every peer's scheduling niceness (``os.setpriority``) once it starts, so that a
        process the peers depend on (a shared DHT node) keeps its share of the cores. ``env``: extra environment for
        every peer (``start`` adds per-rank extras). ``join``: a
        bootstrap multiaddr; the peers find each other through the DHT instead of a static list.
        ``swarm_key``: the run's key file (default: created in ``out_dir``). ``open_run``: a public run
        (``--open``, no swarm key; needs ``join``, excludes ``swarm_key``)."""
        if open_run and (not join or swarm_key is not None):
            raise ValueError("open_run: the peers join through a bootstrap (join) and hold no swarm key")
        self.count = count
        self.out_dir = Path(out_dir)
        self.args = list(args)
        self.per_rank = per_rank or {}
        self.join = join
        self.host = host
        self.endpoints = [] if join else [f"tcp://{host}:{p}" for p in free_ports(count, host)]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.procs: dict[int, subprocess.Popen] = {}
        """The latest process of each rank started."""
        self.group = ProcessGroup(env=self.env, dump_stacks=True)
        self.open_run = open_run
        self.niceness = niceness
        self.swarm_key = None if open_run else Path(swarm_key) if swarm_key is not None else self.out_dir / "swarm.key"
        """The private run's key file; None in an open run."""
        if self.swarm_key is not None and swarm_key is None and not self.swarm_key.exists():
            from gossiploco.security.swarm_key import SwarmKey

            SwarmKey.generate().save(self.swarm_key)

    def peer_dir(self, rank: int) -> Path:
        return self.out_dir / f"peer-{rank}"

    def log_path(self, rank: int) -> Path:
        return self.out_dir / f"peer-{rank}.log"

    def identity_path(self, rank: int) -> Path:
        return self.peer_dir(rank) / "identity.key"

    def peer_id(self, rank: int) -> int:
        """The peer id of rank ``rank``: the rank itself in a static list, else its identity's (made by ``start``)."""
        if not self.join:
            return rank
        from gossiploco.security.identity import Identity

        return Identity.load_or_create(self.identity_path(rank)).peer_id

    def command(self, rank: int) -> list[str]:
        if self.join:  # found through the DHT; the first round waits for ``count`` peers
            where = ["--join", self.join, "--host", self.host, "--workers", str(self.count),
                     "--identity", str(self.identity_path(rank))]
        else:
            where = ["--peers", ",".join(self.endpoints)]
        trust = ["--open"] if self.swarm_key is None else ["--swarm-key", str(self.swarm_key)]
        return [sys.executable, "-m", "gossiploco", "peer", "--rank", str(rank), *where, *trust,
                "--out", str(self.peer_dir(rank)), *self.args, *self.per_rank.get(rank, ())]

    def start(self, ranks: Sequence[int] | None = None, env: dict[int, dict[str, str]] | None = None) -> LocalPeers:
        """Start ``ranks`` (default: ``range(count)``; with ``join`` any peer id), with extra environment ``env[rank]``. A rank started again
        (a restart) appends to its log."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.join:
            from gossiploco.security.options import ordered_identities

            ordered_identities(self.count, self.out_dir)
        for rank in range(self.count) if ranks is None else ranks:
            self.procs[rank] = self.group.start(self.command(rank), self.log_path(rank), append=True,
                                                env={**self.env, **(env or {}).get(rank, {})}, stdin=None)
            if self.niceness:
                try:
                    os.setpriority(os.PRIO_PROCESS, self.procs[rank].pid,
                                   os.getpriority(os.PRIO_PROCESS, 0) + self.niceness)
                except OSError as exc:  # it exited already: its exit code says why
                    log.debug("could not renice peer %d: %s", rank, exc)
        return self

    def signal(self, rank: int, sig: int) -> None:
        self.procs[rank].send_signal(sig)

    def wait(self, timeout_s: float, ranks: Sequence[int] | None = None) -> dict[int, int | None]:
        """Exit codes of ``ranks`` (default: all started) once they exit; None for any still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        codes: dict[int, int | None] = {}
        for rank in sorted(self.procs) if ranks is None else ranks:
            try:
                codes[rank] = self.procs[rank].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[rank] = None
        return codes

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGINT every live peer (resuming frozen ones), wait up to ``grace_s``, then SIGKILL; then anything
        left in the peers' process groups (``ProcessGroup.stop``). Idempotent. A peer's graceful leave tells
        the others, withdraws its DHT record (at most 3 s) and shuts its DHT node down, which on a loaded
        machine takes several seconds."""
        self.group.stop(grace_s)

    def log(self, rank: int) -> str:
        path = self.log_path(rank)
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> LocalPeers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
