"""Peer discovery for one training run: who takes part, where to reach them, how far along they are.

A ``Directory`` is one peer's handle on the run's list of peers. Each peer announces one
``PeerRecord`` (its peer id, the ``tcp://HOST:PORT`` of its ZeroMQ data-plane socket, the round
it is in, the tokens it has processed) and reads everybody's records with ``peers()``. The
directory only *finds* peers; every tensor moves over the ZeroMQ data plane
(``gossiploco.transport.zmq_exchange``), never through the DHT.

Two implementations share the contract below (``tests/test_directory.py`` runs the same
conformance tests against both):

* ``MemoryDirectory`` (``memory_directory``): instances sharing one ``MemoryDirectoryHub`` see each
  other; for unit tests of the runtime, no network and no threads.
* ``DhtDirectory`` (``dht_directory``, which tells how the records live in the DHT): a hivemind DHT node (a background process running the ``p2pd`` daemon) that
  joins the swarm through one or more bootstrap multiaddrs (``gossiploco.membership.bootstrap``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from gossiploco.errors import ConfigError, DirectoryClosed, DirectoryError
from gossiploco.membership.record import PeerRecord
from gossiploco.membership.runs import RunEntry

MAX_RUN_ID_CHARS = 256


class Directory(ABC):
    """One peer's handle on the run's peer list; see the module docstring for the design.

    Contract for implementations:

    * Every method is thread-safe.
    * ``announce`` and ``withdraw`` may block for a bounded time (at most the directory's
      deadline); ``update`` never blocks on the network; ``peers`` blocks at most the deadline.
    * Network trouble never raises from these methods: it is logged, and ``peers`` returns the
      last records it knew. After ``close()`` every method but ``close`` raises ``DirectoryClosed``.
    """

    @abstractmethod
    def announce(self, record: PeerRecord) -> None:
        """Publish this peer's record, replacing the one announced before (if its peer id differs,
        the old one is withdrawn). The record stays visible until ``withdraw()`` or ``close()``."""

    @abstractmethod
    def update(self, **fields: Any) -> None:
        """Change ``round``, ``tokens``, ``reverse`` and/or ``joined`` of the announced record. Others see the change after
        the next heartbeat. Raises ``TypeError`` for other fields, ``ValueError`` for invalid values,
        ``DirectoryError`` when nothing is announced."""

    @abstractmethod
    def publish_now(self) -> None:
        """Make the current record visible now rather than at the next heartbeat (bounded by the deadline)."""

    @abstractmethod
    def peers(self) -> dict[int, PeerRecord]:
        """The live records of this run by peer id, this peer's own included."""

    @abstractmethod
    def announce_run(self, entry: RunEntry) -> None:
        """Publish this peer's line in the swarm's list of runs; it is refreshed, withdrawn and expires
        with the peer's record. Blocks like ``announce``."""

    @abstractmethod
    def runs(self) -> dict[int, RunEntry]:
        """The swarm's live run entries by peer id, every run's (this peer's own included); blocks like ``peers``."""

    def set_status_source(self, source: Callable[[], dict | None]) -> None:
        """Publish ``source()`` (a ``membership.status`` entry in wire form) as this peer's live status with
        each record (``DhtDirectory``); called from the heartbeat thread. Here: statuses are not kept."""

    @abstractmethod
    def withdraw(self) -> None:
        """Remove this peer's record and run entry now (best effort). A no-op when nothing is announced."""

    @abstractmethod
    def close(self) -> None:
        """Withdraw and release every resource. Idempotent."""

    # State every implementation keeps, and the checks on it they share (call with ``_lock`` held).
    run_id: str
    _lock: threading.Lock
    _record: PeerRecord | None
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise DirectoryClosed(f"directory of run {self.run_id!r} is closed")

    def _swap_record(self, record: PeerRecord) -> PeerRecord | None:
        """Make ``record`` the announced one; returns the one it replaces."""
        if not isinstance(record, PeerRecord):
            raise TypeError(f"announce() takes a PeerRecord, got {type(record).__name__}")
        self._check_open()
        old, self._record = self._record, record
        return old

    def _updated_record(self, fields: dict[str, Any]) -> PeerRecord:
        """The announced record with ``fields`` changed (``update``'s checks)."""
        self._check_open()
        if self._record is None:
            raise DirectoryError("update() before announce(): there is no record to change")
        return updated_record(self._record, fields)

    def __enter__(self) -> Directory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def updated_record(record: PeerRecord, fields: dict[str, Any]) -> PeerRecord:
    """``record`` with ``round``/``tokens``/``reverse``/``joined`` replaced (``TypeError`` for any other field)."""
    unknown = sorted(set(fields) - UPDATABLE)
    if unknown:
        raise TypeError(f"update() can change {', '.join(sorted(UPDATABLE))} only, got {unknown}")
    return dataclasses.replace(record, **fields)


UPDATABLE = frozenset({"round", "tokens", "reverse", "joined"})


def check_run_id(run_id: Any) -> str:
    if not isinstance(run_id, str) or not run_id or len(run_id) > MAX_RUN_ID_CHARS or not run_id.isprintable():
        raise ConfigError("run_id", f"must be a non-empty printable string of at most {MAX_RUN_ID_CHARS} "
                                    f"characters, got {run_id!r}")
    return run_id


def check_ttl(ttl_s: float, heartbeat_s: float | None = None) -> None:
    if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
        raise ConfigError("ttl_s", f"must be a positive number of seconds, got {ttl_s!r}")
    if heartbeat_s is not None:
        if not (isinstance(heartbeat_s, (int, float)) and math.isfinite(heartbeat_s) and heartbeat_s > 0):
            raise ConfigError("heartbeat_s", f"must be a positive number of seconds, got {heartbeat_s!r}")
        if heartbeat_s >= ttl_s:
            raise ConfigError("heartbeat_s", f"must be shorter than ttl_s={ttl_s} (a few heartbeats per ttl), "
                                             f"got {heartbeat_s}")
