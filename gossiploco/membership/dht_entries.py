"""A run's entries in a hivemind DHT node: each stored under its writer's subkey with an expiration, read back validated.

Every kind of entry a peer keeps in the DHT (its ``PeerRecord``, its ``RunEntry``, its ``StatusEntry``) lives
the same way. All entries of one kind live under one DHT key (``dht_directory.dht_key``, ``runs.runs_key``,
``status.status_key``; with ``trust`` in a private run derived from the swarm key) as a hivemind *dictionary
value*: subkey = the writer's peer id (an int; with ``trust`` a keyed hash of it,
``record_validator.entry_subkey``), value = the entry's ``to_wire()`` (a plain msgpack-able dict; hivemind
serializes with msgpack, never pickle). Every subkey carries its own expiration time (hivemind's
``get_dht_time()`` is wall-clock time, so peers' clocks must agree to within a few seconds). Runs with
different ids use different keys, so they never see each other's records even on a shared DHT.

``DhtEntries`` is one node's handle seen as such a store:

* ``store_each`` stores several subkeys at once, all within one deadline, and says which ones at least one
  DHT node accepted. A value ``None`` is a tombstone (hivemind has no delete; ``dht_directory`` tells how
  tombstones are used).
* ``read`` asks for the latest value of a key (``latest=True``: the search visits the nodes nearest to the key
  and merges their subkeys, newest expiration winning) within the deadline, and validates every subkey like
  any data from the network (the kind's ``from_wire``): malformed entries, entries of another
  ``PROTOCOL_VERSION`` and entries stored under a subkey that is not their peer's are dropped with one logged
  warning each (counted in ``malformed`` and ``incompatible``); expired entries and tombstones are skipped.
* Requests to the node are serialized (its pipe is not thread-safe). Once the node's process has died they
  fail at once, said once at ERROR, instead of each timing out.

Network trouble never raises here (it is logged, and the caller sees ``False`` or ``None``), except from
``run``, which raises ``DirectoryError``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gossiploco.errors import DirectoryError
from gossiploco.membership.dht_node import TIMEOUTS
from gossiploco.membership.record import IncompatibleRecord

if TYPE_CHECKING:
    from gossiploco.security.trust import Trust

log = logging.getLogger(__name__)

MAX_REPORTED = 4096
"""How many distinct bad entries a ``DhtEntries`` remembers having warned about."""


def describe_exit(dht: Any) -> str:
    """How a DHT node's end is told: its exit code, or for a shared node (``membership.shared_node``) which
    process served it."""
    host_pid = getattr(dht, "host_pid", None)
    if host_pid is not None:
        return f"the process {host_pid} that served the shared DHT node at {dht.address} is gone"
    return f"exit code {dht.exitcode}"


def dht_time() -> float:
    """hivemind's clock for expirations (wall-clock seconds; peers' clocks must roughly agree)."""
    from hivemind.utils import get_dht_time

    return get_dht_time()


class DhtEntries:
    """The entries of one hivemind DHT node (``dht``, whose owner shuts it down through ``shutdown``).

    ``run_id`` names the run in log lines; ``timeout_s`` bounds every request (a store's may be given);
    ``trust`` (None: unauthenticated entries, for tests of the mechanics) keys the subkeys with the swarm key.
    Thread-safe: any thread may call any method; requests to the node are made one at a time.
    """

    def __init__(self, dht: Any, *, run_id: str, timeout_s: float, trust: Trust | None = None):
        self.dht, self.run_id, self.timeout_s, self.trust = dht, run_id, float(timeout_s), trust
        self.malformed = 0
        """Distinct malformed entries seen (each logged once)."""
        self.incompatible = 0
        """Distinct entries of another ``PROTOCOL_VERSION`` seen (each logged once)."""
        self._lock = threading.Lock()  # guards the counters, _reported and _gone_reported
        self._dht_lock = threading.Lock()  # serializes requests on the DHT's pipe (not thread-safe)
        self._reported: set[tuple[str, float]] = set()  # bad entries already warned about
        self._gone_reported = False

    def alive(self) -> bool:
        """Whether the DHT process runs; logs once when it has died (requests to it would only time out)."""
        if self.dht.is_alive():
            return True
        with self._lock:
            said, self._gone_reported = self._gone_reported, True
        if not said:
            log.error("run %s: the DHT process exited (%s); this peer can no longer publish its record or see "
                      "changes, restart it", self.run_id, describe_exit(self.dht))
        return False

    def subkey(self, peer: int) -> int:
        """The subkey peer ``peer`` writes its entries under."""
        if self.trust is None:
            return peer
        from gossiploco.membership.record_validator import entry_subkey

        return entry_subkey(self.trust.swarm, peer)

    def store_each(self, items: list[tuple[str, int, dict | None]], expiration: float,
                   timeout_s: float | None = None) -> list[bool]:
        """Store peer ``peer``'s subkey of ``key`` with ``value`` for each ``(key, peer, value)``, all at once,
        expiring at ``expiration`` (``dht_time``), within ``timeout_s`` (default: ``self.timeout_s``) in all;
        whether each was accepted by at least one DHT node. Blocks at most the deadline; logs, never raises."""
        if not self.alive():
            return [False] * len(items)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        accepted = []
        try:
            with self._dht_lock:
                futures = [self.dht.store(key, value, expiration_time=expiration, subkey=self.subkey(peer),
                                          return_future=True) for key, peer, value in items]
        except Exception as exc:  # a dead DHT process breaks its pipe; hivemind raises various types
            log.debug("run %s: storing %d entries failed: %r", self.run_id, len(items), exc)
            return [False] * len(items)
        for (key, peer, _), future in zip(items, futures):
            try:
                accepted.append(bool(future.result(timeout=max(0.0, deadline - time.monotonic()))))
                continue
            except TIMEOUTS:
                log.debug("run %s: storing peer %d's entry of %s timed out after %g s", self.run_id, peer, key, timeout_s)
            except Exception as exc:
                log.debug("run %s: storing peer %d's entry of %s failed: %r", self.run_id, peer, key, exc)
            accepted.append(False)
        return accepted

    def get(self, key: str) -> Any:
        """hivemind's ``ValueWithExpiration`` of ``key``'s latest value, or None if it has none. Blocks at most
        ``timeout_s``; raises what hivemind raises (a timeout included): for callers that say why themselves."""
        with self._dht_lock:
            future = self.dht.get(key, latest=True, return_future=True)
        return future.result(timeout=self.timeout_s)

    def _latest(self, key: str, what: str) -> dict | None:
        """The entries of dictionary ``key`` (subkey -> hivemind's ``ValueWithExpiration``; {} if none), or
        None when the DHT did not answer (``what``: how the warning names them)."""
        if not self.alive():
            return None
        try:
            found = self.get(key)
        except TIMEOUTS:
            log.warning("run %s: the DHT did not answer within %g s; using the last known %s",
                        self.run_id, self.timeout_s, what)
            return None
        except Exception as exc:
            log.warning("run %s: reading %s from the DHT failed (%r); using the last known ones", self.run_id, what, exc)
            return None
        if found is None:
            return {}
        if not isinstance(found.value, dict):
            self._report((f"<{key}>", found.expiration_time), "malformed",
                         f"key {key!r} holds a {type(found.value).__name__}, not a dictionary of records")
            return {}
        return found.value

    def read(self, key: str, what: str, parse: Callable[[Any], Any],
             check: Callable[[Any], str | None] = lambda entry: None) -> dict[int, tuple[Any, float]] | None:
        """The valid, unexpired entries of dictionary ``key`` by peer id, with their expirations, or None when the
        DHT did not answer (blocks at most ``timeout_s``). ``parse`` reads one value (``from_wire``:
        ``IncompatibleRecord``, ``ValueError`` or ``TypeError`` for a bad one; the result has a ``peer``); an entry
        stored under another peer's subkey, or one ``check`` finds fault with (its reason), is dropped. Each drop
        is counted and logged once; ``what`` names the entries in the messages."""
        found = self._latest(key, f"{what}s")
        if found is None:
            return None
        now = dht_time()
        entries: dict[int, tuple[Any, float]] = {}
        for subkey, item in found.items():
            value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", None)
            if not isinstance(expiration, (int, float)) or expiration <= now or value is None:
                continue  # expired, or a withdrawn entry's tombstone
            tag = (f"{what}/{repr(subkey)[:64]}", float(expiration))
            try:
                entry = parse(value)
            except IncompatibleRecord as exc:
                self._report(tag, "incompatible", f"ignoring the {what} under subkey {tag[0]}: {exc} "
                                                  "(peers of different gossiploco releases cannot train together)")
                continue
            except (ValueError, TypeError) as exc:
                self._report(tag, "malformed", f"ignoring a malformed {what} under subkey {tag[0]}: {exc}")
                continue
            fault = f"stored under subkey {tag[0]}" if subkey != self.subkey(entry.peer) else check(entry)
            if fault:
                self._report(tag, "malformed", f"ignoring the {what} of peer {entry.peer}: {fault}")
                continue
            entries[entry.peer] = (entry, float(expiration))
        return entries

    def _report(self, tag: tuple[str, float], kind: str, message: str) -> None:
        """Count and log a bad entry once."""
        with self._lock:
            if tag in self._reported:
                return
            if len(self._reported) >= MAX_REPORTED:
                self._reported.clear()
            self._reported.add(tag)
            if kind == "incompatible":
                self.incompatible += 1
            else:
                self.malformed += 1
        log.warning("run %s: %s", self.run_id, message)

    def start(self, fn: Callable[[Any, Any], Any]) -> Any:
        """Start ``fn(dht, node)`` (a picklable coroutine function) in the DHT process; its future (does not wait)."""
        with self._dht_lock:
            return self.dht.run_coroutine(fn, return_future=True)

    def run(self, fn: Callable[[Any, Any], Any]) -> Any:
        """Run ``fn(dht, node)`` (a picklable coroutine function) in the DHT process; its result. Blocks at most
        ``timeout_s``; raises ``DirectoryError`` when it fails or takes longer."""
        try:
            return self.start(fn).result(timeout=self.timeout_s)
        except Exception as exc:
            raise DirectoryError(f"the DHT process could not run {getattr(fn, 'func', fn).__name__}: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def shutdown(self) -> None:
        """Shut the DHT node down (waits for a request in flight to be sent; that request then fails)."""
        with self._dht_lock:
            self.dht.shutdown()
