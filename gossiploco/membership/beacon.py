"""A private swarm's beacon: how a peer tells that the DHT it joined is its swarm's.

A bootstrap node started with a swarm key publishes the beacon (``store_beacon``, refreshed by
``bootstrap.serve_bootstrap``): an entry under a key derived from the swarm key, sealed with it like every
record of the swarm (``record_validator``), so only holders of the key can write or read it. A peer that
joined checks it is there (``check_beacon``, called by ``DhtDirectory.confirm_swarm``); a peer given another
swarm key than its bootstrap node's finds none and stops with an error that says so.
"""

from __future__ import annotations

import logging
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
