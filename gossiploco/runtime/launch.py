"""Start peer processes on this machine (tests, benchmarks, local swarms) and always stop them.

``LocalPeers`` runs ``python -m gossiploco peer`` once per rank, each with its own output
directory and log file: with a static peer list on loopback ports, or (``join``) through a DHT
bootstrap address, each peer binding a free port of its own. The run is private: a swarm key
(``swarm_key``, default: a new one in ``out_dir/swarm.key``) goes to every peer; with ``join``
each rank gets an identity file whose peer ids increase with the rank (``ordered_identities``),
and ``--rank`` picks its data stream, so a local run matches the virtual swarm's order.

``stop()`` asks every process still running to leave (SIGINT, like Ctrl+C), waits a bounded time,
then kills what is left, so no process outlives its owner; it is also what the context manager
runs on exit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free a moment ago (all held open together while probing)."""
    held = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


class LocalPeers:
    """``count`` peer processes on ``host``; extra CLI arguments go to every peer (``args``) or one (``per_rank``)."""

    def __init__(self, count: int, out_dir: str | Path, args: Sequence[str] = (), *, host: str = "127.0.0.1",
                 per_rank: dict[int, Sequence[str]] | None = None, env: dict[str, str] | None = None,
                 join: str | None = None, swarm_key: Path | None = None):
        """``env``: extra environment for every peer (``start`` adds per-rank extras). ``join``: a
        bootstrap multiaddr; the peers find each other through the DHT instead of a static list.
        ``swarm_key``: the run's key file (default: created in ``out_dir``)."""
        self.count = count
        self.out_dir = Path(out_dir)
        self.args = list(args)
        self.per_rank = per_rank or {}
        self.join = join
        self.host = host
        self.endpoints = [] if join else [f"tcp://{host}:{p}" for p in free_ports(count, host)]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.procs: dict[int, subprocess.Popen] = {}
        self._logs: dict[int, object] = {}
        self.swarm_key = Path(swarm_key) if swarm_key is not None else self.out_dir / "swarm.key"
        if swarm_key is None and not self.swarm_key.exists():
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
        return [sys.executable, "-m", "gossiploco", "peer", "--rank", str(rank), *where, "--swarm-key", str(self.swarm_key),
                "--out", str(self.peer_dir(rank)), *self.args, *self.per_rank.get(rank, ())]

    def start(self, ranks: Sequence[int] | None = None, env: dict[int, dict[str, str]] | None = None) -> LocalPeers:
        """Start ``ranks`` (default: ``range(count)``; with ``join`` any peer id), with extra environment ``env[rank]``. A rank started again
        (a restart) appends to its log."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.join:
            from gossiploco.security.options import ordered_identities

            ordered_identities(self.count, self.out_dir)
        for rank in range(self.count) if ranks is None else ranks:
            old = self._logs.pop(rank, None)
            if old is not None:
                old.close()
            log = self.log_path(rank).open("a")
            self._logs[rank] = log
            self.procs[rank] = subprocess.Popen(self.command(rank), stdout=log, stderr=subprocess.STDOUT,
                                                env={**self.env, **(env or {}).get(rank, {})}, start_new_session=True)
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

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGINT every live peer (resuming frozen ones), wait up to ``grace_s``, then SIGKILL. Idempotent.
        A peer's graceful leave tells the others, withdraws its DHT record (at most 3 s) and shuts its
        DHT node down, which on a loaded machine takes several seconds."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for proc in live:
            for sig in (signal.SIGCONT, signal.SIGINT):
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for log in self._logs.values():
            log.close()

    def log(self, rank: int) -> str:
        path = self.log_path(rank)
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> LocalPeers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
