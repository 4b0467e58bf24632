"""The hivemind-DHT ``Directory`` (the contract: ``gossiploco.membership.directory``).

Records in the DHT
------------------

All records of run ``R`` live under one DHT key, ``f"gossiploco/{R}/peers"``, one subkey per peer, each
with its own expiration; ``gossiploco.membership.dht_entries`` tells how entries are stored and read
(validated, bad ones dropped, counted and logged once).

* ``announce()`` stores the record at once (bounded by ``timeout_s``), expiring ``ttl_s`` later;
  a daemon heartbeat thread re-stores the current record every ``heartbeat_s`` with a fresh
  expiration. ``update()`` only changes the local copy; the next heartbeat publishes it.
* hivemind has no delete. A DHT node keeps, per subkey, the value with the *latest* expiration
  and rejects stores whose expiration is already past. So ``withdraw()`` stores a tombstone
  (value ``None``) whose expiration is later than that of any record this directory stored;
  it replaces the record on every replica it reaches, readers skip it, and it expires itself
  after about ``ttl_s``. Expirations this directory uses only grow, so a later ``announce()``
  wins over its own tombstone again.
* A peer that crashes stores no tombstone: its record vanishes when its last expiration passes,
  at most ``ttl_s`` after its last heartbeat. ``ttl_s`` should be a few heartbeats long so one
  slow store does not make a live peer disappear.
* ``peers()`` reads the valid, unexpired records (``DhtEntries.read``), waiting at most ``timeout_s``;
  bad ones are counted in ``malformed_records`` and ``incompatible_records``. When the DHT does not
  answer in time, ``peers()`` logs why and returns the last records it knew that have not expired.

The swarm's list of runs (``gossiploco.membership.runs``): besides its record, a peer announces
one ``RunEntry`` (its run id and settings) under a key of the whole swarm, with the same subkey,
expirations, heartbeat and tombstone as its record (``announce_run``, ``runs``), so a peer about to
start can see the runs already going and whether its settings differ from theirs.

Bootstrap restarts: a node that fails to answer is dropped from hivemind's routing tables, and a
restarted bootstrap node starts with an empty table, so after a restart the swarm and the
bootstrap node would not know each other, and a peer joining through it would find nobody. Two
things reconnect them. The restarted bootstrap node pings the peers it saved before
(``gossiploco.membership.bootstrap``), which is immediate. And every ``REJOIN_HEARTBEATS``
heartbeats a directory checks whether each initial peer is in its routing table and if not dials
and pings it (``reconnect``, in the DHT process, bounded by ``timeout_s``, never two at once);
this one is slowed by libp2p's dial backoff, which after failed dials refuses to dial the same
address again for 5 s + 1 s x (failed dials)^2, up to 5 minutes. Either way the two nodes then
know each other again and hand each other the records the other should keep (hivemind does
that when two nodes meet).

Errors: ``DirectoryError`` (a ``GossiplocoError``) when a DHT node cannot be started or cannot
join through any of its initial peers within ``timeout_s``; ``DirectoryClosed`` (a
``DirectoryError``) for calls after ``close()``; ``ConfigError`` for bad arguments (the message
names the argument). Network trouble after joining never raises: it is logged, the heartbeat
retries, ``peers()`` returns what it knows.

    GossiplocoError
    └── DirectoryError          the DHT could not be started or joined (remote or environment fault)
        └── DirectoryClosed     the directory was closed; the call cannot proceed (local)

hivemind is imported on first use of the DHT (about 1.3 s), so code that only uses
``MemoryDirectory`` does not pay for it.

Trust (``trust``, always given by ``gossiploco peer``): the run's records live under a key derived
from the swarm key, every node validates every record with ``SwarmRecordValidator``
(``gossiploco.membership.record_validator``: signed by the peer whose entry it is, sealed with the swarm key
in a private run), and a record counts only if its data-plane ``key`` is that of its peer id. So
nobody without the swarm key can read, write, overwrite, tombstone or replace the run's records,
and no member can write another member's. Without ``trust`` records are unauthenticated (unit
tests of the directory mechanics only). A ``DHT`` node runs in a process forked from this one, which
runs ``p2pd``; both die with this process, even when it is SIGKILLed, and p2pd dies with the DHT
process when that one has to be killed (it did not shut down within 3 s); see
``gossiploco.membership.lifeline``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gossiploco.errors import ConfigError
from gossiploco.membership.beacon import check_beacon
from gossiploco.membership.dht_entries import DhtEntries, dht_time
from gossiploco.membership.dht_node import (check_announce_maddrs, check_initial_peers, host_maddr, reconnect, start_dht,
                                            visible_maddrs)
from gossiploco.membership.directory import Directory, check_run_id, check_ttl
from gossiploco.membership.record import PeerRecord
from gossiploco.membership.runs import RunEntry, runs_key
from gossiploco.membership.status import status_key
from gossiploco.security.identity import peer_id_of

if TYPE_CHECKING:
    from gossiploco.security.trust import Trust

log = logging.getLogger(__name__)

CLOSE_WITHDRAW_S = 3.0
"""Deadline of the tombstone ``close()`` stores, and of each wait for the heartbeat thread there."""
REJOIN_HEARTBEATS = 3
"""The heartbeat re-dials initial peers missing from the routing table at most every this many heartbeats."""


def dht_key(run_id: str) -> str:
    """The DHT key under which run ``run_id`` keeps its peer records."""
    return f"gossiploco/{check_run_id(run_id)}/peers"


class DhtDirectory(Directory):
    """A ``Directory`` over a hivemind DHT node of its own; see the module docstring for the design.

    Construction starts the node (about 0.2 s on loopback) listening on ``host:port`` (0: any free
    port) and joins the swarm through ``initial_peers`` (bootstrap multiaddrs; empty: start a new
    swarm). ``announce_maddrs`` are the multiaddrs to advertise instead of the listening ones
    (behind NAT or port forwarding). Raises ``ConfigError`` for bad arguments and
    ``DirectoryError`` when the node cannot start or reach any initial peer within ``timeout_s``.

    ``ttl_s``: a record of a crashed peer disappears at most this long after its last heartbeat.
    ``heartbeat_s``: how often the current record is re-published (must be below ``ttl_s``).
    ``timeout_s``: deadline of joining and of every DHT operation (``announce``, ``peers``,
    ``withdraw``); ``close`` takes at most about 3 x ``CLOSE_WITHDRAW_S`` plus the DHT's shutdown.
    ``shared_node``: instead of starting a node, use the one another process of this machine serves at this
    ``ipc://`` address (``membership.shared_node``; the node re-joins its own initial peers).
    """

    def __init__(self, run_id: str, *, initial_peers: Sequence[str], host: str = "127.0.0.1", port: int = 0,
                 announce_maddrs: Sequence[str] | None = None, ttl_s: float = 15.0, heartbeat_s: float = 5.0,
                 timeout_s: float = 10.0, trust: Trust | None = None, behind_nat: bool = False,
                 relays: Sequence[str] = (), shared_node: str | None = None):
        check_ttl(ttl_s, heartbeat_s)
        from gossiploco.membership.dht_storage import MAX_TTL_S

        if ttl_s > MAX_TTL_S:  # every DHT node refuses a record that expires that far ahead (``dht_storage``)
            raise ConfigError("ttl_s", f"must be at most {MAX_TTL_S:g} s (DHT nodes keep no record longer), got {ttl_s}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError("timeout_s", f"must be a positive number of seconds, got {timeout_s!r}")
        self.run_id = check_run_id(run_id)
        self.trust = trust
        self.key = trust.swarm.dht_key(run_id) if trust is not None and trust.swarm is not None else dht_key(run_id)
        self.runs_key = runs_key(trust.swarm if trust is not None else None)
        """The DHT key of the swarm's list of runs (``membership.runs``)."""
        self.status_key = status_key(trust.swarm if trust is not None else None)
        """The DHT key of the swarm's peer statuses (``membership.status``)."""
        self._status_source: Callable[[], dict | None] | None = None
        self.ttl_s, self.heartbeat_s, self.timeout_s = float(ttl_s), float(heartbeat_s), float(timeout_s)
        self.initial_peers = check_initial_peers(initial_peers)
        announce_maddrs = check_announce_maddrs(announce_maddrs)
        listen = host_maddr(host, port)

        self._lock = threading.Lock()  # guards the fields below
        self._record: PeerRecord | None = None
        self._run_entry: RunEntry | None = None
        self._known_runs: dict[int, tuple[RunEntry, float]] = {}  # last run entries read
        self._last_expiration = -math.inf  # latest expiration this directory stored; only grows
        self._known: dict[int, tuple[PeerRecord, float]] = {}  # last records read: peer -> (record, expiration)
        self._publish_failing_since: float | None = None
        """When storing this peer's record began to fail (``time.monotonic``); None while it works."""
        self._publish_failure_warned = False
        self._duplicates_reported: set[str] = set()  # endpoints seen announcing our peer id
        self._rejoining: Any = None  # the pending reconnect future, if any
        self._closed = False
        self._stop = threading.Event()

        started = time.monotonic()
        validator = None
        if trust is not None:
            from gossiploco.membership.record_validator import SwarmRecordValidator

            validator = SwarmRecordValidator(trust.identity, trust.swarm)
        self.shared_node = shared_node
        """The address of the shared DHT node this directory uses (``membership.shared_node``), or None: its own."""
        if shared_node is not None:
            from gossiploco.membership.shared_node_client import NodeClient

            client = NodeClient(shared_node, timeout_s=self.timeout_s, identity=trust.identity if trust else None,
                                swarm=trust.swarm if trust else None)
            self._dht, self._visible_maddrs, self._p2p_id = client, client.maddrs, ""
            self.run_in_node: Callable[[Callable[[Any, Any], Any]], Any] | None = None
            """``run_in_node(fn)`` runs ``fn(dht, node)`` (a picklable coroutine function) in this directory's DHT
            process and returns its result (``DirectoryError`` when it fails or misses the deadline); None on a
            shared node, which runs no code for its peers."""
        else:
            self._dht = start_dht(initial_peers=self.initial_peers, host_maddrs=[listen],
                                  announce_maddrs=announce_maddrs, timeout_s=self.timeout_s, record_validator=validator,
                                  behind_nat=behind_nat, relays=list(relays) or self.initial_peers, run=self.run_id)
            self._p2p_id = self._dht.peer_id.to_base58()
        self.entries = DhtEntries(self._dht, run_id=self.run_id, timeout_s=self.timeout_s, trust=trust)
        """This node's entries: every store and read of the DHT goes through it."""
        if shared_node is None:
            self.run_in_node = self.entries.run
            try:
                self._visible_maddrs = visible_maddrs(self._dht, self.timeout_s)
            except BaseException:
                self._dht.shutdown()
                raise
        log.info("run %s: %s in %.2f s at %s", run_id, "DHT node up" if shared_node is None else
                 f"using the shared DHT node {shared_node}", time.monotonic() - started, ", ".join(self._visible_maddrs))
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name=f"directory-heartbeat-{run_id}",
                                           daemon=True)
        self._heartbeat.start()

    @property
    def p2p_id(self) -> str:
        """This node's libp2p peer id (base58); empty on a shared node, which relays and tunnels nothing for
        this peer (others then reach it directly or by reverse connection, never through a relay)."""
        return self._p2p_id

    @property
    def dht(self) -> Any:
        """This node's hivemind ``DHT`` handle, for tests that store raw entries as a misbehaving node
        would (this directory's own records go through ``announce``)."""
        return self._dht

    @property
    def malformed_records(self) -> int:
        """Distinct malformed entries (records, run entries, statuses) seen in the DHT (each logged once)."""
        return self.entries.malformed

    @property
    def incompatible_records(self) -> int:
        """Distinct entries of another ``PROTOCOL_VERSION`` seen in the DHT (each logged once)."""
        return self.entries.incompatible

    @property
    def visible_maddrs(self) -> list[str]:
        """This node's multiaddrs with ``/p2p/<peer id>``; other nodes may join through any of them."""
        return list(self._visible_maddrs)

    def _next_expiration(self) -> float:
        """A fresh expiration, later than any this directory stored before (called with ``_lock`` held)."""
        self._last_expiration = max(dht_time() + self.ttl_s, self._last_expiration + 1e-3)
        return self._last_expiration

    def _store(self, peer: int, value: dict | None, expiration: float, timeout_s: float | None = None) -> bool:
        """Store one subkey of the run's key within ``timeout_s`` (default: the directory's); True when at
        least one DHT node accepted it. Logs, never raises."""
        return self.entries.store_each([(self.key, peer, value)], expiration, timeout_s)[0]

    def _publish(self) -> None:
        """Store the current record and run entry with a fresh expiration (if one is announced)."""
        with self._lock:
            record, entry = self._record, self._run_entry
            if record is None and entry is None:
                return
            expiration = self._next_expiration()
        items = [(self.runs_key, entry.peer, entry.to_wire())] if entry is not None else []
        if record is not None:
            items += self._status_items(record.peer)
            items.append((self.key, record.peer, record.to_wire()))
        accepted = self.entries.store_each(items, expiration)
        if record is None:
            return
        self._publish_outcome(record.peer, accepted[-1], time.monotonic())

    def _publish_outcome(self, peer: int, ok: bool, now: float) -> None:
        """Say how publishing this peer's record goes. A store that fails once (a DHT node slow to answer on a
        loaded machine) is retried at the next heartbeat and said at info; failing for half the record's
        lifetime is a warning: the record expires soon after, and the other peers then stop seeing this one."""
        since = self._publish_failing_since
        if ok:
            if since is not None:
                level = logging.WARNING if self._publish_failure_warned else logging.INFO
                log.log(level, "run %s: publishing peer %d's record works again (it failed for %.0f s)", self.run_id,
                        peer, now - since)
            self._publish_failing_since, self._publish_failure_warned = None, False
            return
        if since is None:
            self._publish_failing_since = since = now
            log.info("run %s: could not publish peer %d's record to the DHT; retrying every %g s", self.run_id, peer,
                     self.heartbeat_s)
        if not self._publish_failure_warned and now - since >= self.ttl_s / 2:
            self._publish_failure_warned = True
            log.warning("run %s: publishing peer %d's record to the DHT has failed for %.0f s; it expires %.0f s after "
                        "the last success, and the other peers then stop seeing this peer (is the DHT reachable?)",
                        self.run_id, peer, now - since, self.ttl_s)

    def set_status_source(self, source: Callable[[], dict | None]) -> None:
        self._status_source = source

    def _status_items(self, peer: int) -> list[tuple[str, int, dict | None]]:
        """The status entry to store beside peer ``peer``'s record (none without a source, or if it fails)."""
        try:
            value = self._status_source() if self._status_source is not None else None
        except Exception:  # noqa: BLE001 - a status is for observers; the record must still go out
            log.exception("run %s: building this peer's status failed", self.run_id)
            return []
        return [(self.status_key, peer, value)] if value is not None else []

    def _heartbeat_loop(self) -> None:
        beats = 0
        while not self._stop.wait(self.heartbeat_s):
            beats += 1
            try:
                self._publish()
                if self.initial_peers and self.shared_node is None and beats % REJOIN_HEARTBEATS == 0:
                    self._start_rejoin()
            except Exception:  # the heartbeat must outlive any surprise; it is logged
                log.exception("run %s: directory heartbeat failed", self.run_id)

    def _start_rejoin(self) -> None:
        """Start ``reconnect`` to the initial peers in the DHT process (does not wait; one at a time)."""
        from functools import partial

        previous = self._rejoining
        if (previous is not None and not previous.done()) or not self.entries.alive():
            return
        if previous is not None and previous.exception() is None and previous.result():
            log.info("run %s: reconnected to %d initial peer(s)", self.run_id, previous.result())
        self._rejoining = self.entries.start(partial(reconnect, addresses=self.initial_peers, timeout_s=self.timeout_s))

    def announce(self, record: PeerRecord) -> None:
        with self._lock:
            old = self._swap_record(record)
            tombstone = self._next_expiration() if old is not None and old.peer != record.peer else None
        if tombstone is not None:
            self._store(old.peer, None, tombstone)
        self._publish()

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._record = self._updated_record(fields)

    def announce_run(self, entry: RunEntry) -> None:
        with self._lock:
            self._check_open()
            self._run_entry = entry
        self._publish()

    def publish_now(self) -> None:
        """Store the current record now instead of at the next heartbeat (bounded by the deadline)."""
        self._publish()

    def _fetch(self) -> dict[int, tuple[PeerRecord, float]] | None:
        """The run's valid, unexpired records from the DHT, or None when the DHT did not answer."""
        def key_of_its_peer(record: PeerRecord) -> str | None:
            if self.trust is not None and (not record.key or peer_id_of(record.key) != record.peer):
                return "its key is not that peer's"
            return None

        return self.entries.read(self.key, "peer record", PeerRecord.from_wire, key_of_its_peer)

    def runs(self) -> dict[int, RunEntry]:
        with self._lock:
            self._check_open()
        entries = self.entries.read(self.runs_key, "run entry", RunEntry.from_wire)
        now = dht_time()
        if entries is not None:
            with self._lock:
                self._known_runs = entries
        with self._lock:
            live = {peer: entry for peer, (entry, expiration) in self._known_runs.items() if expiration > now}
            if self._run_entry is not None:
                live[self._run_entry.peer] = self._run_entry
        return dict(sorted(live.items()))

    def confirm_swarm(self) -> None:
        """Check that the DHT joined holds this run's swarm beacon, which only a bootstrap node holding
        the same swarm key publishes; ``DirectoryError`` saying so if it does not (a wrong key).
        Nothing to check in an open run or without ``trust``."""
        if self.trust is None or self.trust.swarm is None:
            return
        check_beacon(self.entries, self.trust.swarm, self.initial_peers)

    def peers(self) -> dict[int, PeerRecord]:
        with self._lock:
            self._check_open()
        fetched = self._fetch()
        now = dht_time()
        with self._lock:
            if fetched is not None:
                self._known = fetched
            live = {peer: record for peer, (record, expiration) in self._known.items() if expiration > now}
            own = self._record
        if own is not None:
            other = live.get(own.peer)
            if other is not None and other.endpoint != own.endpoint and other.endpoint not in self._duplicates_reported:
                self._duplicates_reported.add(other.endpoint)
                log.warning("run %s: peer id %d is also announced by %s (this peer is %s); peer ids must be unique",
                            self.run_id, own.peer, other.endpoint, own.endpoint)
            live[own.peer] = own  # the local copy is the freshest
        return dict(sorted(live.items()))

    def withdraw(self) -> None:
        with self._lock:
            self._check_open()
        self._withdraw()

    def _withdraw(self, timeout_s: float | None = None) -> None:
        with self._lock:
            record, self._record = self._record, None
            entry, self._run_entry = self._run_entry, None
            if record is None and entry is None:
                return
            expiration = self._next_expiration()
            if record is not None:
                self._known.pop(record.peer, None)
        items = [(self.runs_key, entry.peer, None)] if entry is not None else []
        if record is not None:
            items += [(self.status_key, record.peer, None)] if self._status_source is not None else []
            items.append((self.key, record.peer, None))
        if not self.entries.store_each(items, expiration, timeout_s)[-1] and record is not None:
            log.warning("run %s: could not withdraw peer %d's record; it expires within %g s",
                        self.run_id, record.peer, self.ttl_s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Closing is how a peer leaves (Ctrl+C): it must be quick, so the tombstone gets a short
        # deadline (a record that misses it still expires within ttl_s), and a heartbeat stuck in a
        # store is not waited for: shutting the DHT down fails its request.
        try:
            self._withdraw(min(self.timeout_s, CLOSE_WITHDRAW_S))
        finally:
            self._stop.set()
            self._heartbeat.join(timeout=CLOSE_WITHDRAW_S)
            self.entries.shutdown()
            self._heartbeat.join(timeout=CLOSE_WITHDRAW_S)
            if self._heartbeat.is_alive():
                log.error("run %s: directory heartbeat thread did not stop", self.run_id)
