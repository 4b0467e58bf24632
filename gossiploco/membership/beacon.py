"""A private swarm's beacon: how a peer tells that the DHT it joined is its swarm's.

A bootstrap node started with a swarm key publishes the beacon (``store_beacon``, refreshed by a ``BeaconKeeper``
for as long as the node serves: ``gossiploco dht`` and ``gossiploco swarm``): an entry under a key derived from the
swarm key, sealed with it like every record of the swarm (``record_validator``), so only holders of the key can
write or read it. A peer that joined checks it is there (``check_beacon``, called by
``DhtDirectory.confirm_swarm``); a peer given another swarm key than its bootstrap node's finds none and stops with
an error that says so.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from gossiploco.errors import DirectoryError

if TYPE_CHECKING:
    from gossiploco.membership.dht_entries import DhtEntries
    from gossiploco.security.swarm_key import SwarmKey

log = logging.getLogger(__name__)

BEACON_TTL_S = 540.0  # = dht_storage.MAX_TTL_S: no DHT node keeps a record that expires more than 600 s ahead
"""How long a swarm's beacon stays in the DHT after its bootstrap node last published it."""


def beacon_key(swarm: SwarmKey) -> str:
    """The DHT key of a swarm's beacon."""
    return swarm.dht_key("*", "beacon")


def store_beacon(dht: Any, swarm: SwarmKey, signer_id: int, timeout_s: float) -> bool:
    """Publish the swarm's beacon through hivemind ``DHT`` ``dht``, signed by ``signer_id``, valid for
    ``BEACON_TTL_S``. Blocks at most ``timeout_s``; logs, never raises; True if a node stored it."""
    from hivemind.utils import get_dht_time

    from gossiploco.membership.record_validator import entry_subkey

    try:
        future = dht.store(beacon_key(swarm), {"fingerprint": swarm.fingerprint}, subkey=entry_subkey(swarm, signer_id),
                           expiration_time=get_dht_time() + BEACON_TTL_S, return_future=True)
        return bool(future.result(timeout=timeout_s))
    except Exception as exc:  # noqa: BLE001 - a missing beacon is reported by the peers that look for it
        log.warning("could not publish the swarm's beacon: %r", exc)
        return False


class BeaconKeeper:
    """Publishes a swarm's beacon again every ``every_s`` (a quarter of its lifetime), for as long as its node
    serves: a peer that joins an hour into a run must find it. ``tick`` is called from the node's serving loop;
    ``lock`` is the one every user of the node's pipe takes (it is not thread-safe)."""

    def __init__(self, dht: Any, swarm: SwarmKey, signer_id: int, *, lock: threading.Lock, timeout_s: float,
                 every_s: float = BEACON_TTL_S / 4):
        if not 0 < every_s < BEACON_TTL_S:
            raise ValueError(f"the beacon must be published again within its lifetime ({BEACON_TTL_S} s), got {every_s}")
        self.dht, self.swarm, self.signer_id = dht, swarm, signer_id
        self.lock, self.timeout_s, self.every_s = lock, timeout_s, every_s
        self.next_s = time.monotonic() + every_s
        self.published = 0
        """Times it was published again and a node stored it (a failure is logged by ``store_beacon``)."""

    def tick(self) -> None:
        if time.monotonic() < self.next_s:
            return
        with self.lock:
            self.published += store_beacon(self.dht, self.swarm, self.signer_id, self.timeout_s)
        self.next_s = time.monotonic() + self.every_s


BEACON_TRIES = 3
"""How many times a peer asks for the beacon when the DHT does not answer (an overloaded machine: a read that
times out says nothing about the key)."""


def check_beacon(entries: DhtEntries, swarm: SwarmKey, initial_peers: Sequence[str], tries: int = BEACON_TRIES) -> None:
    """Check that the DHT behind ``entries`` (joined through ``initial_peers``) holds ``swarm``'s beacon; blocks
    at most ``tries`` times the entries' deadline. ``DirectoryError`` saying so if it does not (a wrong key, or no
    bootstrap node running), or that the DHT never answered (then nothing is known of the key)."""
    where = ", ".join(initial_peers) or "(none)"
    failures = []
    for attempt in range(1, tries + 1):
        try:
            found = entries.get(beacon_key(swarm))
        except Exception as exc:  # noqa: BLE001 - a read that failed: ask again, then say so below
            failures.append(type(exc).__name__)
            log.warning("reading the swarm's beacon from the DHT failed (%r), try %d of %d", exc, attempt, tries)
            continue
        if found is None or not isinstance(found.value, dict) or not found.value:
            raise DirectoryError(
                f"the DHT at {where} does not know this peer's swarm key {swarm.fingerprint}: the --swarm-key "
                "differs from the one its bootstrap node was started with (`gossiploco dht` printed the right one), "
                "or the bootstrap node is not running")
        return
    raise DirectoryError(f"the DHT at {where} did not answer the swarm key check {tries} times ({', '.join(failures)}): "
                         "it is unreachable or overloaded; this peer's swarm key is not known to be wrong")
