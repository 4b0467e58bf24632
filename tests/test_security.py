"""Trust: identities, swarm keys, signed and sealed DHT records, and the authenticated data plane.

Unit tests of each piece, then real parts: the hivemind DHT with its record validators, and real
ZeroMQ sockets with CurveZMQ and the ZAP handler, against strangers and lying members."""

from __future__ import annotations

import dataclasses
import threading

import msgpack
import pytest
import torch
import zmq
from hivemind.dht.validation import DHTRecord

from conftest import wait_until
from gossiploco.errors import ConfigError, DirectoryError
from gossiploco.membership.bootstrap import start_bootstrap
from gossiploco.membership.dht_directory import DhtDirectory
from gossiploco.membership.record import PeerRecord
from gossiploco.protocol.messages import Hello, to_wire
from gossiploco.runtime.launch import free_ports
from gossiploco.protocol.lifecycle import corroborated
from gossiploco.security.identity import Identity, curve_public_of, peer_id_of
from gossiploco.security.options import ordered_identities, swarm_key_option
from gossiploco.membership.record_validator import SwarmRecordValidator, entry_subkey
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust, routing_id
from gossiploco.protocol import codec
from gossiploco.transport.zmq_exchange import ZmqExchange

# -- identities and keys -------------------------------------------------------------------------


def test_identity_is_created_once_with_mode_0600_and_fixes_the_peer_id(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    first = Identity.load_or_create(path)
    assert path.stat().st_mode & 0o777 == 0o600
    again = Identity.load_or_create(path)
    assert again.peer_id == first.peer_id == peer_id_of(first.curve_public)
    assert curve_public_of(first.sign_public) == first.curve_public
    assert zmq.curve_public(zmq.utils.z85.encode(first.curve_secret)) == zmq.utils.z85.encode(first.curve_public)


def test_a_damaged_identity_file_is_an_error_never_replaced(tmp_path):
    path = tmp_path / "identity.key"
    path.write_text("not a key\n")
    path.chmod(0o600)  # a private file that is damaged (an unsafe one is refused before it is read: test_key_files)
    with pytest.raises(ConfigError, match="not a gossiploco identity key file"):
        Identity.load_or_create(path)
    assert path.read_text() == "not a key\n"


def test_swarm_key_round_trips_through_text_and_file_and_rejects_garbage(tmp_path):
    key = SwarmKey.generate()
    assert SwarmKey.parse(key.text) == key and len(key.text) == 48
    assert SwarmKey.load(key.save(tmp_path / "k")) == key and (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    assert SwarmKey.load(key.text) == key
    for bad in ("gsk1-short", "nope", str(tmp_path / "missing")):
        with pytest.raises(ConfigError, match="--swarm-key"):
            SwarmKey.load(bad)
    assert key.fingerprint not in key.text


def test_swarm_key_seals_and_derives_keys_no_other_key_can_use():
    a, b = SwarmKey.generate(), SwarmKey.generate()
    sealed = a.seal(b"record")
    assert a.unseal(sealed) == b"record" and b"record" not in sealed
    with pytest.raises(ValueError):
        b.unseal(sealed)
    with pytest.raises(ValueError):
        a.unseal(sealed[:-1] + bytes([sealed[-1] ^ 1]))
    assert a.dht_key("run") != b.dht_key("run") != a.dht_key("other")
    assert "run" not in a.dht_key("run")
    assert a.static_identity(1).peer_id != b.static_identity(1).peer_id


def test_a_run_is_private_unless_opened_explicitly(tmp_path):
    with pytest.raises(ConfigError, match="--swarm-key.*--open"):
        swarm_key_option(None, False)
    with pytest.raises(ConfigError, match="not both"):
        swarm_key_option("x", True)
    assert swarm_key_option(None, True) is None


def test_launchers_order_identities_like_ranks(tmp_path):
    paths = ordered_identities(4, tmp_path)
    ids = [Identity.load_or_create(p).peer_id for p in paths]
    assert ids == sorted(ids) and len(set(ids)) == 4
    assert ordered_identities(4, tmp_path) == paths and [Identity.load_or_create(p).peer_id for p in paths] == ids


def test_a_dht_that_does_not_answer_the_key_check_is_asked_again_and_never_called_a_wrong_key():
    """An overloaded DHT (32 peers on 2 cores) timed a beacon read out, and the peer exited saying its swarm key
    was wrong. A read that fails is asked again; a beacon found ends it; one never answered is said so."""
    from gossiploco.membership.beacon import BEACON_TRIES, check_beacon

    class Entries:  # the DHT's answers in turn: an exception (no answer), None (no beacon) or the beacon
        def __init__(self, *answers):
            self.answers, self.asked = list(answers), 0

        def get(self, key):
            self.asked += 1
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    key = SwarmKey.generate()
    beacon = DHTRecord(key=b"k", subkey=b"s", value={"fingerprint": key.fingerprint}, expiration_time=2e10)
    late = Entries(TimeoutError(), TimeoutError(), beacon)
    check_beacon(late, key, ["/ip4/127.0.0.1/tcp/1/p2p/x"])
    assert late.asked == 3
    silent = Entries(*[TimeoutError()] * BEACON_TRIES)
    with pytest.raises(DirectoryError, match=f"did not answer the swarm key check {BEACON_TRIES} times .*not known to be wrong"):
        check_beacon(silent, key, [])
    wrong = Entries(TimeoutError(), None)
    with pytest.raises(DirectoryError, match="does not know this peer's swarm key"):
        check_beacon(wrong, key, [])
    assert wrong.asked == 2


@pytest.mark.slow  # a real DHT node (the fast subset keeps its margin)
def test_a_serving_bootstrap_node_publishes_its_beacon_again_before_it_expires():
    """A peer joining an hour into a run (``gossiploco swarm`` or ``gossiploco dht``) must still find the beacon,
    whose lifetime is 540 s: the node's keeper stores it again, extending its expiration, each time it is due."""
    from gossiploco.membership.beacon import BEACON_TTL_S, beacon_key
    from gossiploco.membership.bootstrap import beacon_keeper

    key = SwarmKey.generate()
    dht, _ = start_bootstrap("127.0.0.1", 0, swarm=key)
    try:
        def expires() -> float:
            (entry,) = dht.get(beacon_key(key), latest=True).value.values()
            return entry.expiration_time

        first = expires()
        idle = beacon_keeper(dht, threading.Lock(), every_s=60.0)
        idle.tick()
        assert idle.published == 0 and expires() == first  # not due yet: nothing stored
        keeper = beacon_keeper(dht, threading.Lock(), every_s=0.05)
        assert wait_until(lambda: keeper.tick() or keeper.published == 1, 5.0)
        assert expires() > first
        with pytest.raises(ValueError, match="within its lifetime"):
            beacon_keeper(dht, threading.Lock(), every_s=BEACON_TTL_S)
    finally:
        dht.shutdown()
    assert beacon_keeper(object(), threading.Lock()) is None  # a node started without a swarm key has no beacon


def test_round_claims_only_count_when_another_member_backs_them():
    assert corroborated({1: 5, 2: 5, 3: 11}) == {1: 5, 2: 5}  # a lone far-ahead claim is dropped
    assert corroborated({1: 5, 2: 6}) == {1: 5, 2: 6}  # a boundary between two answers
    assert corroborated({1: 9}) == {1: 9}  # where one member answered, its claim stands


# -- record validation (the paper trail every DHT node checks) ------------------------------------


def signed(validator: SwarmRecordValidator, peer: int, value: object, key: bytes = b"k", expiration: float = 1e10):
    record = DHTRecord(key, msgpack.packb(entry_subkey(validator.swarm, peer)), msgpack.packb(value), expiration)
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_a_signed_sealed_record_validates_and_strips_to_its_value():
    key, writer = SwarmKey.generate(), Identity.generate()
    validator = SwarmRecordValidator(writer, key)
    record = signed(validator, writer.peer_id, {"endpoint": "tcp://x:1"})
    assert b"tcp://x:1" not in record.value and writer.sign_public not in record.value  # sealed, writer's key too
    assert msgpack.unpackb(record.subkey) != writer.peer_id  # the entry does not name the member either
    assert validator.validate(record) and msgpack.unpackb(validator.strip_value(record)) == {"endpoint": "tcp://x:1"}
    assert SwarmRecordValidator(None, key).validate(record)  # any holder of the key (a bootstrap node) checks it


@pytest.mark.parametrize("forgery", ["other swarm", "other peer's entry", "tampered body", "later expiration",
                                     "other key", "unsigned", "regular value", "garbage"])
def test_forged_records_are_refused_with_a_counted_reason(forgery):
    key, writer, stranger = SwarmKey.generate(), Identity.generate(), Identity.generate()
    honest = SwarmRecordValidator(None, key)
    record = signed(SwarmRecordValidator(writer, key), writer.peer_id, {"round": 1})
    if forgery == "other swarm":
        record = signed(SwarmRecordValidator(writer, SwarmKey.generate()), writer.peer_id, {"round": 1})
    elif forgery == "other peer's entry":  # a member (or stranger) writing under someone else's peer id
        record = signed(SwarmRecordValidator(stranger, key), writer.peer_id, None)
    elif forgery == "tampered body":
        envelope = msgpack.unpackb(record.value)
        envelope[1] = envelope[1][:-1] + bytes([envelope[1][-1] ^ 1])
        record = dataclasses.replace(record, value=msgpack.packb(envelope))
    elif forgery == "later expiration":  # a replay that would outlive the original
        record = dataclasses.replace(record, expiration_time=record.expiration_time + 100)
    elif forgery == "other key":
        record = dataclasses.replace(record, key=b"another key")
    elif forgery == "unsigned":
        record = dataclasses.replace(record, value=msgpack.packb({"round": 1}))
    elif forgery == "regular value":
        record = dataclasses.replace(record, subkey=b"")
    else:
        record = dataclasses.replace(record, value=b"\xc1" * 40)
    assert not honest.validate(record)
    assert sum(honest.rejected.values()) == 1


def test_open_runs_still_need_signatures():
    writer = Identity.generate()
    record = signed(SwarmRecordValidator(writer, None), writer.peer_id, {"round": 1})
    assert SwarmRecordValidator(None, None).validate(record)
    assert not SwarmRecordValidator(None, None).validate(signed(SwarmRecordValidator(Identity.generate(), None),
                                                                writer.peer_id, None))


# -- the real DHT --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_only_swarm_key_holders_see_or_change_a_runs_records_on_the_real_dht():
    key = SwarmKey.generate()
    dht, addresses = start_bootstrap("127.0.0.1", 0, swarm=key)
    made = []

    def directory(trust):
        made.append(DhtDirectory("run", initial_peers=addresses, ttl_s=30, heartbeat_s=1, timeout_s=5, trust=trust))
        return made[-1]

    try:
        members = [directory(Trust(Identity.generate(), key)) for _ in range(2)]
        for member in members:
            member.confirm_swarm()
            t = member.trust
            member.announce(PeerRecord(t.peer_id, "tcp://127.0.0.1:5000", round=0, tokens=0, key=t.identity.curve_public))
        assert wait_until(lambda: len(members[0].peers()) == 2, 20)
        # A stranger with its own key joins the same DHT: it is told its key is wrong ...
        stranger = directory(Trust(Identity.generate(), SwarmKey.generate()))
        with pytest.raises(DirectoryError, match="does not know this peer's swarm key"):
            stranger.confirm_swarm()
        # ... and even knowing the run's DHT key it can neither read nor write nor erase records there.
        stranger.key = members[0].key
        assert stranger.peers() == {}
        victim = members[1].trust.peer_id
        stranger._store(victim, None, 2e10)  # a tombstone for a member
        stranger._store(stranger.trust.peer_id, {"peer": 1}, 2e10)  # a record of its own
        try:  # a regular value: bytes are stored only as an envelope their peer signed, so its own node refuses it
            raw = stranger.dht.store(members[0].key, b"replaced", expiration_time=2e10)
        except ValueError as exc:
            raw = None
            assert "envelope" in str(exc)
        assert not raw
        assert sorted(members[0].peers()) == sorted(m.trust.peer_id for m in members)
    finally:
        for d in made:
            d.close()
        dht.shutdown()


# -- the authenticated data plane ----------------------------------------------------------------


def swap_both(exchanges: list[ZmqExchange]) -> dict[int, torch.Tensor]:
    """Ranks 0 and 1 swap (their rank, five times) at once; each one's result."""
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.update({r: exchanges[r].swap("k/0", 1 - r, torch.full((5,), 1.0 * r))}))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


@pytest.fixture
def pair():
    key = SwarmKey.generate()
    ports = free_ports(2)
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    exchanges = [ZmqExchange(r, endpoints, "run", 5.0, trust=Trust.static(key, r, 2)) for r in range(2)]
    yield key, endpoints, exchanges
    for ex in exchanges:
        ex.close()


def test_members_mix_over_curve_and_strangers_are_refused_and_counted(pair):
    key, endpoints, exchanges = pair
    out = swap_both(exchanges)
    assert out[0].tolist() == [1.0] * 5 and out[1].tolist() == [0.0] * 5
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        plain.connect(endpoints[0])
        wrong = ctx.socket(zmq.DEALER)  # CURVE with a key of no member
        wrong.curve_secretkey, wrong.curve_publickey = Identity.generate().curve_secret, Identity.generate().curve_public
        wrong.curve_serverkey = key.static_identity(0).curve_public
        wrong.connect(endpoints[0])
        for sock in (plain, wrong):  # a send waits (bounded) for the connection to exist, not NOBLOCK's race with it
            sock.setsockopt(zmq.SNDTIMEO, 5000)
            sock.send_multipart(codec.encode(*to_wire(Hello(0, 0), 1, "run")))
        assert wait_until(lambda: sum(exchanges[0].security_counts()["refused_connections"].values()) >= 2, 10)
        assert exchanges[0].members(0) == [0, 1] and exchanges[0].malformed_messages == 0
    finally:
        ctx.destroy(linger=0)


def test_a_member_cannot_speak_for_another_member(pair):
    key, endpoints, exchanges = pair
    liar = Trust.static(key, 1, 2)  # member 1's own key ...
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, routing_id(0, "forged", control=False))  # ... claiming to be member 0
        sock.curve_secretkey, sock.curve_publickey = liar.identity.curve_secret, liar.identity.curve_public
        sock.curve_serverkey = key.static_identity(0).curve_public
        sock.connect(endpoints[0])
        sock.send_multipart(codec.encode(*to_wire(Hello(-2, 0), 0, "run")))  # a forged "leave" of member 0
        rejected = lambda: exchanges[0].security_counts()["rejected_messages"]
        assert wait_until(lambda: any("authenticated as" in reason for reason in rejected()), 10), rejected()
    finally:
        ctx.destroy(linger=0)


def test_an_open_static_list_is_still_encrypted_and_authenticated():
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    exchanges = [ZmqExchange(r, endpoints, "run", 5.0, trust=Trust.static(None, r, 2)) for r in range(2)]
    try:
        out = swap_both(exchanges)
        assert out[0].tolist() == [1.0] * 5 and exchanges[0].sockets.router.getsockopt(zmq.CURVE_SERVER) == 1
    finally:
        for ex in exchanges:
            ex.close()
