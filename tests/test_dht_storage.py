"""A DHT node's storage is bounded per writer, in lifetime and in total (``membership.dht_storage``), so a
stranger in an open run cannot grow a bootstrap node without limit (issue 25), and members still work."""

from __future__ import annotations

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from gossiploco.membership.dht_storage import BoundedStorage, StorageLimits

VALUE = b"x" * 100


def _key(i: int) -> DHTID:
    return DHTID.generate(source=f"key-{i}")


def test_a_writer_holds_entries_under_a_few_keys_and_may_always_refresh_them():
    store = BoundedStorage(StorageLimits(keys_per_writer=3))
    now = get_dht_time()
    assert [store.store_subkey(_key(i), 7, VALUE, now + 20) for i in range(5)] == [True] * 3 + [False] * 2
    assert store.store_subkey(_key(0), 7, VALUE + b"!", now + 30)  # a refresh of an entry it holds
    assert store.store_subkey(_key(4), 8, VALUE, now + 20)  # another writer has its own budget
    assert store.refused == {"too many keys for one writer": 2}
    assert store.entries == 4 and store.bytes == 4 * 100 + 1
    store.forget_expired(now + 25)  # the entries of 20 s expired: the writer may use other keys again
    assert store.entries == 1 and store.writers() == 1 and store.store_subkey(_key(3), 7, VALUE, now + 40)


def test_a_record_that_expires_too_far_ahead_is_refused():
    store = BoundedStorage(StorageLimits(lifetime_s=600))
    now = get_dht_time()
    assert not store.store_subkey(_key(0), 1, VALUE, now + 365 * 86400)  # the one-year records of the finding
    assert store.store_subkey(_key(0), 1, VALUE, now + 500)
    assert store.refused == {"expires too far ahead": 1}


def test_the_node_holds_at_most_its_total_and_keeps_refreshing_what_it_holds():
    store = BoundedStorage(StorageLimits(entries=10, bytes=1 << 20))
    now = get_dht_time()
    accepted = sum(store.store_subkey(_key(w), w, VALUE, now + 20) for w in range(50))  # 50 identities
    assert accepted == 10 and store.refused["node full (entries)"] == 40
    assert store.store_subkey(_key(3), 3, VALUE, now + 40)  # a member already held refreshes its entry
    small = BoundedStorage(StorageLimits(bytes=250))
    assert [small.store_subkey(_key(w), w, VALUE, now + 20) for w in range(3)] == [True, True, False]
    assert small.store(_key(9), VALUE, now + 20) is False and small.refused["node full (bytes)"] == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stranger_flooding_an_open_bootstrap_is_refused_after_the_cap_and_members_still_work():
    """A real open bootstrap node; a throwaway identity stores 250 signed records under distinct keys, with a
    one-year expiry and then a short one: the node keeps at most ``MAX_KEYS_PER_WRITER`` of them; a member's
    directory still announces and reads its record and run entry."""
    from functools import partial

    from gossiploco.membership.bootstrap import start_bootstrap
    from gossiploco.membership.dht_directory import DhtDirectory
    from gossiploco.membership.dht_storage import MAX_KEYS_PER_WRITER, storage_counts
    from gossiploco.membership.record import PeerRecord
    from gossiploco.membership.runs import RunEntry
    from gossiploco.security.identity import Identity
    from gossiploco.security.trust import Trust
    from testbed.outsider import store_signed, stranger_dht

    dht, addresses = start_bootstrap("127.0.0.1", 0, open_run=True)
    stranger = directory = None
    try:
        identity = Identity.generate()
        stranger = stranger_dht(addresses[0], identity)
        keys = [f"junk/{i}" for i in range(200)]
        assert store_signed(stranger, keys[:50], identity.peer_id, {"junk": "y" * 200}, get_dht_time() + 365 * 86400) == 0
        accepted = store_signed(stranger, keys, identity.peer_id, {"junk": "y" * 200}, get_dht_time() + 60)
        assert accepted == MAX_KEYS_PER_WRITER
        counts = dht.run_coroutine(storage_counts)["storage"]
        assert counts["entries"] == MAX_KEYS_PER_WRITER and counts["refused"]["expires too far ahead"] == 50
        assert counts["refused"]["too many keys for one writer"] == 200 - MAX_KEYS_PER_WRITER
        member = Trust(Identity.generate(), None)  # an open run's member
        directory = DhtDirectory("run-open", initial_peers=addresses, ttl_s=20, heartbeat_s=5, timeout_s=10, trust=member)
        me = member.peer_id
        directory.announce_run(RunEntry(me, "run-open", {"workers": 2}))
        directory.announce(PeerRecord(me, "tcp://127.0.0.1:9", round=-1, tokens=0, key=member.identity.curve_public))
        assert me in directory.peers() and me in directory.runs()
        after = dht.run_coroutine(partial(storage_counts))["storage"]
        assert after["entries"] >= MAX_KEYS_PER_WRITER + 2
    finally:
        for node in (directory, stranger, dht):
            if node is not None:
                (node.close if node is directory else node.shutdown)()
