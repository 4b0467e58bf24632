"""``BoundedStorage``: what one DHT node keeps, bounded per writer, in lifetime and in total.

hivemind keeps every record a node accepts (``DHTProtocol.rpc_store``) in two ``DHTLocalStorage`` objects,
``protocol.storage`` and ``protocol.cache`` (the requester chooses which with ``in_cache``), without a limit.
The record validator (``record_validator.SwarmRecordValidator``) proves who wrote a record but cannot bound
how much: in an open run anyone can make an identity, and one identity stored 48,200 records with a
one-year expiry on an open bootstrap node in 43 s (its DHT process grew from 204 to 973 MiB; issue 25).

The bounds are applied where records are stored, not in the validator: the validator also checks every
record a search returns, and a dictionary with one refused subkey is dropped whole by hivemind, so a
time-dependent or per-node rule there would let one writer hide the run's other records from readers.
``install_storage_bounds`` (run in the DHT process by ``dht_node.start_dht``) replaces both objects with
a ``BoundedStorage``, which refuses a record (``store`` returns False: the writer sees the store fail)
when:

* it expires more than ``MAX_LIFETIME_S`` from now (members refresh their entries every
  ``timeouts.discovery_s`` with an expiry ``announce_ttl_s`` ahead, 20 s by default; the swarm's beacon
  ``beacon.BEACON_TTL_S`` ahead);
* its writer already has live entries under ``MAX_KEYS_PER_WRITER`` other keys. The validator binds a
  dictionary entry's subkey to its signer (``record_validator.entry_subkey``), so the subkey *is* the
  writer, and one writer holds at most one entry per key. A member writes exactly three keys: its
  record (the run's key, ``dht_directory.dht_key``), its run entry (``runs.runs_key``) and its status
  (``status.status_key``); a bootstrap node of a private run one (``beacon.beacon_key``). A tombstone
  replaces the entry under the same key; a peer that moves to another run holds the old run's key
  until its tombstone expires. Refreshing an entry already held is always allowed;
* the node holds ``MAX_ENTRIES`` live entries or ``MAX_BYTES`` of values already (a swarm of many
  identities: new writers wait for entries to expire, while the entries already held keep being refreshed).

Every refusal is counted by reason in ``refused`` and logged once per reason (then at powers of two).
The accounting follows each entry's expiration (``forget_expired``), so its memory is bounded by the
limits too. Regular (non-dictionary) values, which gossiploco's validator refuses anyway, name no writer:
each counts as its own (``REGULAR``), bounded by the totals.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hivemind.dht.storage import DHTLocalStorage
from hivemind.utils import get_dht_time

log = logging.getLogger(__name__)

MAX_LIFETIME_S = 600.0
"""A record may expire at most this far in the future (when it is stored)."""
MAX_TTL_S = MAX_LIFETIME_S - 60.0
"""The longest ``announce_ttl_s`` a directory may use (a minute of clock skew between nodes to spare)."""
MAX_KEYS_PER_WRITER = 8
"""Keys one writer may hold live entries under (a member needs 3)."""
MAX_ENTRIES = 20_000
"""Live entries one storage holds, all writers together (about 6,000 members of 3 entries each)."""
MAX_BYTES = 64 << 20
"""Bytes of values one storage holds, all writers together."""
REGULAR = "regular value"
"""Regular values are counted under the writer ``(REGULAR, key)``: one per key, bounded by the totals only."""


@dataclass(frozen=True)
class StorageLimits:
    lifetime_s: float = MAX_LIFETIME_S
    keys_per_writer: int = MAX_KEYS_PER_WRITER
    entries: int = MAX_ENTRIES
    bytes: int = MAX_BYTES


class BoundedStorage(DHTLocalStorage):
    """A ``DHTLocalStorage`` that refuses records past ``limits`` (module docstring). ``name`` labels log lines."""

    def __init__(self, limits: StorageLimits = StorageLimits(), maxsize: int | None = None, name: str = "storage"):
        super().__init__(maxsize=maxsize)
        self.limits = limits
        self.name = name
        self.refused: Counter[str] = Counter()
        """Records refused, by reason."""
        self.bytes = 0
        """Bytes of the live entries' values."""
        self._live: dict[tuple[Any, Any], tuple[float, int]] = {}  # (key, writer) -> (expiration, value bytes)
        self._keys_of: dict[Any, set[Any]] = {}  # writer -> keys it holds live entries under
        self._expiring: list[tuple[float, int, Any, Any]] = []  # (expiration, tie, key, writer), lazily pruned
        self._tie = 0

    @property
    def entries(self) -> int:
        """Live entries held (all writers)."""
        return len(self._live)

    def writers(self) -> int:
        return len(self._keys_of)

    def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        writer = (REGULAR, key)  # nobody is named: each key its own writer, bounded by the totals
        if not self._admit(key, writer, value, expiration_time):
            return False
        stored = super().store(key, value, expiration_time)
        if stored:
            self._account(key, writer, value, expiration_time)
        return stored

    def store_subkey(self, key: Any, subkey: Any, value: Any, expiration_time: float) -> bool:
        if not self._admit(key, subkey, value, expiration_time):
            return False
        stored = super().store_subkey(key, subkey, value, expiration_time)
        if stored:
            self._account(key, subkey, value, expiration_time)
        return stored

    # -- the limits -----------------------------------------------------------------------------

    def _admit(self, key: Any, writer: Any, value: Any, expiration_time: float) -> bool:
        now = get_dht_time()
        self.forget_expired(now)
        limits = self.limits
        if expiration_time > now + limits.lifetime_s:
            return self._refuse("expires too far ahead", f"expires {expiration_time - now:.0f} s ahead, "
                                f"at most {limits.lifetime_s:g} s allowed")
        held = self._live.get((key, writer))
        if held is not None:  # a refresh (or a tombstone) of an entry already held: bounded already
            if self.bytes - held[1] + _size(value) > limits.bytes:
                return self._refuse("node full (bytes)", f"{self.bytes} bytes held, at most {limits.bytes}")
            return True
        keys = self._keys_of.get(writer, ())
        if len(keys) >= limits.keys_per_writer:
            return self._refuse("too many keys for one writer",
                                f"writer {str(writer)[:24]} holds entries under {len(keys)} keys already, "
                                f"at most {limits.keys_per_writer}")
        if len(self._live) >= limits.entries:
            return self._refuse("node full (entries)", f"{len(self._live)} entries held, at most {limits.entries}")
        if self.bytes + _size(value) > limits.bytes:
            return self._refuse("node full (bytes)", f"{self.bytes} bytes held, at most {limits.bytes}")
        return True

    def _refuse(self, reason: str, detail: str) -> bool:
        self.refused[reason] += 1
        n = self.refused[reason]
        if n & (n - 1) == 0:  # once, then at powers of two: a flood is one line a doubling
            log.warning("DHT %s refused a record: %s (%d refused for this reason so far)", self.name, detail, n)
        return False

    def _account(self, key: Any, writer: Any, value: Any, expiration_time: float) -> None:
        old = self._live.get((key, writer))
        self.bytes += _size(value) - (old[1] if old is not None else 0)
        self._live[(key, writer)] = (expiration_time, _size(value))
        self._keys_of.setdefault(writer, set()).add(key)
        self._tie += 1
        heapq.heappush(self._expiring, (expiration_time, self._tie, key, writer))

    def forget_expired(self, now: float) -> None:
        """Drop the accounting of entries that expired (hivemind drops the entries themselves)."""
        while self._expiring and self._expiring[0][0] < now:
            expiration, _, key, writer = heapq.heappop(self._expiring)
            held = self._live.get((key, writer))
            if held is None or held[0] != expiration:
                continue  # refreshed since: a newer heap item stands for it
            del self._live[(key, writer)]
            self.bytes -= held[1]
            keys = self._keys_of[writer]
            keys.discard(key)
            if not keys:
                del self._keys_of[writer]

    def counts(self) -> dict[str, Any]:
        self.forget_expired(get_dht_time())
        return {"entries": self.entries, "bytes": self.bytes, "writers": self.writers(), "refused": dict(self.refused)}


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (bytes, bytearray)) else 0


async def install_storage_bounds(_dht: Any, node: Any, limits: StorageLimits = StorageLimits()) -> None:
    """Run in a DHT node's process (``dht_node.start_dht``): bound its storage and its cache (module docstring).
    Records stored before (none: it runs as the node starts) are carried over through the limits."""
    protocol = node.protocol
    for name in ("storage", "cache"):
        old = getattr(protocol, name)
        if isinstance(old, BoundedStorage):
            continue
        maxsize = old.maxsize if old.maxsize != float("inf") else None
        bounded = BoundedStorage(limits, maxsize=maxsize, name=name)
        for key, (value, expiration) in list(old.items()):
            if hasattr(value, "items"):  # a dictionary value: carry each subkey
                for subkey, (item, item_expiration) in list(value.items()):
                    bounded.store_subkey(key, subkey, item, item_expiration)
            else:
                bounded.store(key, value, expiration)
        setattr(protocol, name, bounded)


async def storage_counts(_dht: Any, node: Any) -> dict[str, dict[str, Any]]:
    """Run in a DHT node's process: what its storage and cache hold and refused (``BoundedStorage.counts``)."""
    out = {}
    for name in ("storage", "cache"):
        store = getattr(node.protocol, name)
        out[name] = store.counts() if isinstance(store, BoundedStorage) else {"entries": len(store), "bounded": False}
    return out
