"""The in-memory ``Directory``: instances on one ``MemoryDirectoryHub`` with the same run id see each other.
For unit tests of the runtime: no network, no threads, a clock the test controls. The contract is
``gossiploco.membership.directory``'s; ``tests/test_directory.py`` runs the same conformance tests against it
and the DHT one."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from gossiploco.membership.directory import Directory, check_run_id, check_ttl
from gossiploco.membership.record import PeerRecord
from gossiploco.membership.runs import RunEntry


class MemoryDirectoryHub:
    """The shared board of ``MemoryDirectory`` instances (one per test swarm); thread-safe.

    ``clock`` (seconds, monotonic) decides expiry; tests pass a fake clock to expire records
    without sleeping.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, int], tuple[PeerRecord | RunEntry, float]] = {}
        """(run id, peer id) -> (record, expiry time on ``clock``; ``inf`` while its owner is alive); the
        swarm's list of runs is the run ``RUNS_BOARD``."""

    def _put(self, run_id: str, record: PeerRecord | RunEntry, expires_at: float = math.inf) -> None:
        with self._lock:
            self._entries[run_id, record.peer] = (record, expires_at)

    def _remove(self, run_id: str, peer: int) -> None:
        with self._lock:
            self._entries.pop((run_id, peer), None)

    def _live(self, run_id: str) -> dict[int, Any]:
        now = self.clock()
        with self._lock:
            for key in [k for k, (_, expires_at) in self._entries.items() if expires_at <= now]:
                del self._entries[key]
            return dict(sorted((peer, record) for (run, peer), (record, _) in self._entries.items() if run == run_id))


RUNS_BOARD = ""
"""A ``MemoryDirectoryHub`` keeps the swarm's list of runs as the entries of this run id (no run's id
is empty)."""


class MemoryDirectory(Directory):
    """A ``Directory`` in process memory: instances on one ``hub`` with the same ``run_id`` see each other.

    A record stays until ``withdraw()``/``close()``; ``simulate_crash()`` stops it from being
    refreshed without withdrawing it, so it expires ``ttl_s`` later on the hub's clock, as a
    crashed ``DhtDirectory``'s record does. Nothing blocks.
    """

    def __init__(self, hub: MemoryDirectoryHub, run_id: str = "run", *, ttl_s: float = 15.0):
        check_ttl(ttl_s)
        self.hub = hub
        self.run_id = check_run_id(run_id)
        self.ttl_s = float(ttl_s)
        self._lock = threading.Lock()
        self._record: PeerRecord | None = None
        self._run_entry: RunEntry | None = None
        self._closed = False

    def announce(self, record: PeerRecord) -> None:
        with self._lock:
            old = self._swap_record(record)
            if old is not None and old.peer != record.peer:
                self.hub._remove(self.run_id, old.peer)
            self.hub._put(self.run_id, record)

    def announce_run(self, entry: RunEntry) -> None:
        with self._lock:
            self._check_open()
            self._run_entry = entry
            self.hub._put(RUNS_BOARD, entry)

    def runs(self) -> dict[int, RunEntry]:
        with self._lock:
            self._check_open()
        return self.hub._live(RUNS_BOARD)

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._record = self._updated_record(fields)
            self.hub._put(self.run_id, self._record)

    def publish_now(self) -> None:
        """Records are visible at once here: nothing to do."""

    def peers(self) -> dict[int, PeerRecord]:
        with self._lock:
            self._check_open()
        return self.hub._live(self.run_id)

    def withdraw(self) -> None:
        with self._lock:
            self._check_open()
            self._withdraw_locked()

    def _withdraw_locked(self) -> None:
        if self._record is not None:
            self.hub._remove(self.run_id, self._record.peer)
            self._record = None
        if self._run_entry is not None:
            self.hub._remove(RUNS_BOARD, self._run_entry.peer)
            self._run_entry = None

    def simulate_crash(self) -> None:
        """Stop refreshing the record without withdrawing it (it expires ``ttl_s`` from now); closes this directory."""
        with self._lock:
            self._check_open()
            self._closed = True
            if self._record is not None:
                self.hub._put(self.run_id, self._record, self.hub.clock() + self.ttl_s)
            if self._run_entry is not None:
                self.hub._put(RUNS_BOARD, self._run_entry, self.hub.clock() + self.ttl_s)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._withdraw_locked()
                self._closed = True
