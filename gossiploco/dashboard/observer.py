"""The dashboard's observer: a DHT node that joins a run's swarm without training and follows the peers.

``SwarmState`` is what the page shows, built from the peers' status entries (``membership.status``)
and the swarm's list of runs (``membership.runs``): each peer's latest status, its measurements
merged over every read (so the curves grow longer than one entry's history), its traffic (bytes sent
and received, and the rate, at each step it was read: the observer's own series, since an entry carries
only the latest counters), whether it is still live, and each run's shared config. It has no I/O: ``update`` takes what was read. Thread-safe;
``version`` grows with every change and ``wait_change`` blocks (bounded) until it does, or until ``release``.

``SwarmObserver`` reads the entries every ``poll_s`` through a ``DhtDirectory`` of its own that
announces nothing (``open_directory``), and feeds them to its ``SwarmState``. With a swarm key it
reads a private run (a wrong key is refused at start: ``confirm_swarm``); without one (``--open``)
only an open run's entries, which anybody can read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gossiploco.membership.status import SERIES, StatusEntry, read_statuses

if TYPE_CHECKING:
    from gossiploco.membership.dht_directory import DhtDirectory
    from gossiploco.security.swarm_key import SwarmKey

log = logging.getLogger(__name__)

POLL_S = 1.0
RUNS_EVERY = 5
"""The list of runs (and their configs) is read every this many polls."""
MAX_POINTS = 4096
"""Measurements kept per peer (the oldest are dropped)."""


class SwarmState:
    """What the dashboard shows; see the module docstring. Every method is thread-safe."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self._cond = threading.Condition()
        self.version = 0
        self._peers: dict[int, dict] = {}  # peer -> latest status wire form (no history), plus "live"
        self._points: dict[int, dict[int, list]] = {}  # peer -> step -> [step, loss, val_loss, cd_l2, cd_js]
        self._traffic: dict[int, dict[int, list]] = {}  # peer -> step -> [step, MiB sent, MiB received, MiB/s]
        self._runs: dict[str, dict] = {}
        self.reads = 0
        self.failed_reads = 0
        self.released = False
        """Set by ``release``: nobody should wait for changes any more."""

    def update(self, entries: dict[int, StatusEntry] | None, runs: dict[str, dict] | None = None) -> None:
        """Take one read: the live entries by peer (None: the read failed, nothing changes) and, when read,
        each run's config by run id."""
        with self._cond:
            if entries is None:
                self.failed_reads += 1
                return
            self.reads += 1
            changed = False
            for peer, entry in entries.items():
                wire = entry.to_wire()
                history = wire.pop("history")
                wire["live"] = True
                if self._peers.get(peer) != wire:
                    self._peers[peer] = wire
                    changed = True
                points = self._points.setdefault(peer, {})
                for row in history:
                    if points.get(row[0]) != row:
                        points[row[0]] = row
                        changed = True
                traffic = self._traffic.setdefault(peer, {})
                row = [entry.step, entry.bytes_sent / 2**20, entry.bytes_received / 2**20, entry.rate / 2**20]
                if traffic.get(entry.step) != row:
                    traffic[entry.step] = row
                    changed = True
                for series in (points, traffic):
                    for step in sorted(series)[:max(0, len(series) - MAX_POINTS)]:
                        del series[step]
            for peer, wire in self._peers.items():
                if peer not in entries and wire["live"]:
                    wire["live"] = False
                    changed = True
            if runs is not None and runs != self._runs:
                self._runs = runs
                changed = True
            if changed:
                self.version += 1
                self._cond.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """The state as plain JSON-able data: ``version``, ``peers`` (by peer id as text: the latest status
        and ``points``, the merged measurements in step order, and ``traffic``, ``[step, MiB sent, MiB received,
        MiB/s]`` in step order), ``runs`` (config by run id), ``series``."""
        def ordered(series: dict[int, list]) -> list[list]:
            return [series[s] for s in sorted(series)]

        with self._cond:
            peers = {str(peer): {**wire, "points": ordered(self._points.get(peer, {})),
                                 "traffic": ordered(self._traffic.get(peer, {}))}
                     for peer, wire in sorted(self._peers.items())}
            return {"version": self.version, "time": self.clock(), "peers": peers, "runs": dict(self._runs),
                    "series": list(SERIES)}

    def wait_change(self, seen: int, timeout_s: float) -> int:
        """Block until ``version`` differs from ``seen``, ``timeout_s`` passes or ``release`` is called (at once if
        it was); the version then."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen or self.released, timeout=timeout_s)
            return self.version

    def release(self) -> None:
        """Wake every ``wait_change``, now and from now on (the dashboard's server ends its event streams)."""
        with self._cond:
            self.released = True
            self._cond.notify_all()


def open_directory(join: Sequence[str], swarm: SwarmKey | None, *, host: str = "127.0.0.1",
                   timeout_s: float = 10.0) -> DhtDirectory:
    """A DHT node joined through ``join`` that reads ``swarm``'s entries (None: an open run's) and announces
    nothing; ``DirectoryError`` when the DHT cannot be joined or does not know the swarm key."""
    from gossiploco.membership.dht_directory import DhtDirectory
    from gossiploco.security.identity import Identity
    from gossiploco.security.trust import Trust

    # A throwaway identity: the validator needs one, and an observer never signs anything with it.
    directory = DhtDirectory("dashboard", initial_peers=list(join), host=host, timeout_s=timeout_s,
                             trust=Trust(Identity.generate(), swarm))
    try:
        directory.confirm_swarm()
    except BaseException:
        directory.close()
        raise
    return directory


class SwarmObserver:
    """Reads the swarm's statuses every ``poll_s`` through ``directory`` into ``state``, on a daemon thread.
    ``close`` stops the thread (bounded) and closes the directory."""

    def __init__(self, directory: DhtDirectory, state: SwarmState | None = None, poll_s: float = POLL_S):
        self.directory = directory
        self.state = state or SwarmState()
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dashboard-observer", daemon=True)

    def start(self) -> SwarmObserver:
        self._thread.start()
        return self

    def _loop(self) -> None:
        polls = 0
        while not self._stop.is_set():
            try:
                runs = None
                if polls % RUNS_EVERY == 0:
                    runs = {e.run_id: e.config for e in self.directory.runs().values()}
                self.state.update(read_statuses(self.directory), runs)
            except Exception:  # noqa: BLE001 - the observer must outlive surprises; they are logged
                if self._stop.is_set():
                    return
                log.exception("dashboard: reading the swarm's statuses failed; retrying")
            polls += 1
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.directory.timeout_s + 1.0)
        if self._thread.is_alive():
            log.error("dashboard: the observer thread did not stop")
        self.directory.close()
