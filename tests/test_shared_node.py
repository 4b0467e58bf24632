"""One DHT node shared by the peers of a machine (``membership.shared_node``).

The envelope a peer signs itself and the validator that passes it through (and refuses one it did not sign),
then the real thing: a bootstrap node of a private run serving peers on its ``ipc://`` socket beside a peer with
its own node, malformed and unsigned requests answered and counted, a service that stops or a host process that
dies costing its clients one deadline and never a hang.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import zmq
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from conftest import wait_until
from gossiploco.errors import DirectoryError
from gossiploco.membership.bootstrap import start_bootstrap
from gossiploco.membership.dht_directory import DhtDirectory
from gossiploco.membership.record import PeerRecord
from gossiploco.membership.record_validator import SwarmRecordValidator, entry_subkey, presign
from gossiploco.membership.shared_node import MAX_REQUEST_BYTES, NodeService
from gossiploco.membership.shared_node_client import NodeClient
from gossiploco.security.identity import Identity
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust

TIMEOUT_S = 5.0


def host_record(key: str, subkey: int, value: object, expiration: float) -> DHTRecord:
    """The record a node's ``store`` hands its validator for a value (how hivemind builds it)."""
    return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), expiration)


@pytest.mark.parametrize("swarm", [SwarmKey.generate(), None], ids=["private", "open"])
def test_a_presigned_envelope_is_stored_as_signed_and_only_by_its_peer(swarm):
    writer, stranger = Identity.generate(), Identity.generate()
    subkey, value, expiration = entry_subkey(swarm, writer.peer_id), {"endpoint": "tcp://x:1"}, 1e10
    envelope = presign(writer, swarm, "gossiploco/run/peers", subkey, value, expiration)
    node = SwarmRecordValidator(Identity.generate(), swarm)  # a shared node with a key of its own (a bootstrap's)
    passed = node.sign_value(host_record("gossiploco/run/peers", subkey, envelope, expiration))
    assert passed == envelope  # stored as the peer signed it, not re-signed with the node's key
    stored = dataclasses.replace(host_record("gossiploco/run/peers", subkey, value, expiration), value=passed)
    assert SwarmRecordValidator(None, swarm).validate(stored)
    assert msgpack.unpackb(SwarmRecordValidator(None, swarm).strip_value(stored)) == value
    # Signed by another than the entry's peer, for another expiration or key, or not an envelope at all: refused,
    # never signed over with the node's own key
    forged = [presign(stranger, swarm, "gossiploco/run/peers", subkey, value, expiration),
              presign(writer, swarm, "gossiploco/run/peers", subkey, value, expiration - 1),
              presign(writer, swarm, "gossiploco/other/peers", subkey, value, expiration),
              b"\x93\x01\x02\x03"]
    for envelope in forged:
        with pytest.raises(ValueError):
            node.sign_value(host_record("gossiploco/run/peers", subkey, envelope, expiration))


@pytest.fixture
def private_node():
    """A private run's bootstrap node serving this machine's peers; yields (key, addresses, service)."""
    key = SwarmKey.generate()
    dht, addresses = start_bootstrap("127.0.0.1", 0, swarm=key)
    service = NodeService(dht)
    service.describe(addresses, dht.peer_id.to_base58())
    try:
        yield key, addresses, service
    finally:
        service.close()
        dht.shutdown()


def member(key: SwarmKey, addresses: list[str], made: list, shared: str | None,
           timeout_s: float = TIMEOUT_S) -> DhtDirectory:
    directory = DhtDirectory("run", initial_peers=addresses, ttl_s=30, heartbeat_s=0.5, timeout_s=timeout_s,
                             trust=Trust(Identity.generate(), key), shared_node=shared)
    made.append(directory)
    directory.confirm_swarm()
    t = directory.trust
    directory.announce(PeerRecord(t.peer_id, f"tcp://127.0.0.1:{5000 + len(made)}", round=0, tokens=0,
                                  key=t.identity.curve_public))
    return directory


@pytest.mark.timeout(90)
def test_peers_on_a_shared_node_and_a_peer_with_its_own_see_each_other(private_node):
    key, addresses, service = private_node
    made: list[DhtDirectory] = []
    try:
        shared = [member(key, addresses, made, service.address) for _ in range(2)]
        own = member(key, addresses, made, None)
        everyone = sorted(d.trust.peer_id for d in made)
        assert wait_until(lambda: all(sorted(d.peers()) == everyone for d in made), 20)
        assert shared[0].run_in_node is None and shared[0].p2p_id == ""  # no relays or tunnels through it
        assert own.run_in_node is not None and own.p2p_id
        assert shared[0].visible_maddrs == addresses
        assert service.served["store"] >= 2 and not service.refused
        # A withdrawn shared-node peer disappears for the others, as with its own node
        shared[1].withdraw()
        assert wait_until(lambda: shared[1].trust.peer_id not in own.peers(), 20)
        # A stranger with another swarm key on the same shared node is told its key is wrong, and cannot write
        stranger = DhtDirectory("run", initial_peers=addresses, ttl_s=30, heartbeat_s=0.5, timeout_s=TIMEOUT_S,
                                trust=Trust(Identity.generate(), SwarmKey.generate()), shared_node=service.address)
        made.append(stranger)
        with pytest.raises(DirectoryError, match="does not know this peer's swarm key"):
            stranger.confirm_swarm()
        stranger.key = own.key
        assert not stranger._store(stranger.trust.peer_id, {"peer": 1}, 2e10)
        assert sorted(own.peers()) == sorted(d.trust.peer_id for d in (shared[0], own))
    finally:
        for directory in made:
            directory.close()


def answer(socket: zmq.Socket, payload: bytes) -> dict:
    socket.send(payload)
    assert socket.poll(int(TIMEOUT_S * 1000)), "no answer"
    return msgpack.unpackb(socket.recv(), raw=False)


@pytest.mark.timeout(60)
def test_malformed_unsigned_and_oversized_requests_are_refused_and_counted_and_the_node_serves_on(private_node):
    key, addresses, service = private_node
    context = zmq.Context.instance()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(service.address)
    try:
        refused = [answer(raw, b"\xc1garbage"), answer(raw, msgpack.packb([1, 2])),
                   answer(raw, msgpack.packb({"id": 1, "op": "delete"})),
                   answer(raw, msgpack.packb({"id": 2, "op": "store", "items": [["k", 1, {"v": 1}, 2e10]]})),
                   answer(raw, msgpack.packb({"id": 3, "op": "store", "items": [["k", 1, b"x", 2e10]] * 17})),
                   answer(raw, msgpack.packb({"id": 4, "op": "get", "key": 7}))]
        assert all(not reply["ok"] for reply in refused), refused
        assert "signed by its peer" in refused[3]["error"]
        assert service.refused["malformed"] == len(refused)
        # Over the size limit: libzmq drops the connection unread; the node answers others as before
        big = context.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(service.address)
        big.send(b"\x00" * (MAX_REQUEST_BYTES + 1))
        assert not big.poll(500)
        big.close(0)
        made: list[DhtDirectory] = []
        try:
            directory = member(key, addresses, made, service.address)
            assert wait_until(lambda: directory.trust.peer_id in (directory._fetch() or {}), 10)
        finally:
            for d in made:
                d.close()
    finally:
        raw.close(0)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_stopped_service_costs_its_clients_one_deadline(private_node):
    key, addresses, service = private_node
    made: list[DhtDirectory] = []
    deadline_s = 1.0
    try:
        directory = member(key, addresses, made, service.address, timeout_s=deadline_s)
        assert wait_until(lambda: directory.trust.peer_id in directory.peers(), 10)
        service.close()
        started = time.monotonic()
        assert list(directory.peers()) == [directory.trust.peer_id]  # the last known ones
        assert deadline_s <= time.monotonic() - started < deadline_s + 2
        assert not directory.entries.store_each([(directory.key, directory.trust.peer_id, None)], 2e10, 1.0)[0]
    finally:
        for d in made:
            d.close()
    with pytest.raises(DirectoryError, match="did not answer within"):
        NodeClient(service.address, timeout_s=1.0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_client_knows_when_the_process_serving_its_node_is_killed(tmp_path, caplog):
    host = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from gossiploco.membership.bootstrap import start_bootstrap
        from gossiploco.membership.shared_node import NodeService
        dht, addresses = start_bootstrap("127.0.0.1", 0)
        service = NodeService(dht, directory={str(tmp_path / "node")!r}, signed_only=False)
        print(service.address, flush=True)
        time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        address = host.stdout.readline().strip()
        client = NodeClient(address, timeout_s=TIMEOUT_S)
        assert client.is_alive() and client.host_pid == host.pid
        assert client.store("k", {"v": 1}, expiration_time=time.time() + 60, subkey=1).result(TIMEOUT_S)
        assert client.get("k").result(TIMEOUT_S).value[1].value == {"v": 1}
        host.kill()
        host.wait(10)
        assert not client.is_alive()
        from gossiploco.membership.dht_entries import DhtEntries

        entries = DhtEntries(client, run_id="run", timeout_s=TIMEOUT_S)
        with caplog.at_level("ERROR"):
            assert entries.read("k", "thing", lambda v: v) is None  # at once, not after a deadline
        assert f"the process {host.pid} that served the shared DHT node" in caplog.text
        client.shutdown()
    finally:
        host.kill()
        host.wait(10)


@pytest.mark.slow  # 1.4-2.7 s: in the slow set, so that the fast subset keeps its margin under 2 minutes
@pytest.mark.timeout(60)
def test_reads_of_one_key_coalesce_and_a_store_through_the_node_is_read_back_at_once():
    dht, _ = start_bootstrap("127.0.0.1", 0)
    service = NodeService(dht, signed_only=False)
    clients = []
    try:
        clients = [NodeClient(service.address, timeout_s=TIMEOUT_S) for _ in range(8)]
        assert clients[0].store("k", {"v": 1}, expiration_time=time.time() + 60, subkey=1).result(TIMEOUT_S)
        reads = [client.get("k") for client in clients for _ in range(4)]  # 32 reads at once
        assert all(read.result(TIMEOUT_S).value[1].value == {"v": 1} for read in reads)
        searches = service.served["get"]
        assert searches <= 4 and searches + service.served["get (joined)"] + service.served["get (reused)"] == 32
        # A store through the node drops the reused value: the next read sees it
        assert clients[1].store("k", {"v": 2}, expiration_time=time.time() + 60, subkey=2).result(TIMEOUT_S)
        assert sorted(clients[2].get("k").result(TIMEOUT_S).value) == [1, 2]
    finally:
        for client in clients:
            client.shutdown()
        service.close()
        dht.shutdown()


def test_a_local_swarm_gives_each_peer_one_torch_thread_when_peers_outnumber_the_cores(monkeypatch):
    from gossiploco.runtime.swarm import peer_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert peer_environment(4, None) is None  # fewer peers than cores: torch's own choice
    assert peer_environment(32, {"A": "1"}) == {"A": "1", "OMP_NUM_THREADS": "1"}
    assert peer_environment(32, {"OMP_NUM_THREADS": "3"}) == {"OMP_NUM_THREADS": "3"}  # the caller's word
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert peer_environment(32, None) is None  # the user's environment, inherited


def test_a_socket_directory_too_long_for_a_unix_socket_is_a_clear_error(tmp_path):
    from gossiploco.errors import ConfigError

    with pytest.raises(ConfigError, match="choose a shorter directory"):
        NodeService(object(), directory=str(tmp_path / ("d" * 120)))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_request_the_node_never_answers_fails_by_its_deadline_and_is_forgotten(tmp_path):
    """A node that answers who it is and then nothing: each request fails a little after its deadline, none is
    kept, and the client's thread goes on (a later answer to a forgotten request is ignored)."""
    import os
    import threading

    context = zmq.Context.instance()
    mute = context.socket(zmq.ROUTER)
    mute.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path / 'mute.sock'}"
    mute.bind(address)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if mute.poll(50):
                client, payload = mute.recv_multipart()
                request = msgpack.unpackb(payload)
                if request["op"] == "info":
                    reply = {"id": request["id"], "ok": True, "result": {"pid": os.getpid(), "maddrs": [], "p2p": ""}}
                    mute.send_multipart([client, msgpack.packb(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = NodeClient(address, timeout_s=0.3)
    try:
        futures = [client.store("k", {"v": i}, expiration_time=time.time() + 60, subkey=i) for i in range(5)]
        started = time.monotonic()
        for future in futures:
            with pytest.raises(DirectoryError, match="did not answer in time"):
                future.result(timeout=5)
        assert time.monotonic() - started < 0.3 + 2.0 + 1.0
        assert client.pending() == 0 and client.is_alive()
    finally:
        client.shutdown()
        stop.set()
        thread.join(5)
        mute.close(0)


@pytest.mark.timeout(60)
@pytest.mark.slow  # a real DHT node (the fast subset keeps its margin)
def test_the_service_answers_when_the_node_does_not_on_a_timer(monkeypatch):
    """The service's thread is woken by each finished node request (``Waker``), not by polling: with its idle poll
    set to a minute, a store and a read through it still come back at once, and ``close`` still stops it at once."""
    from gossiploco.membership import shared_node

    monkeypatch.setattr(shared_node, "IDLE_POLL_MS", 60_000)
    dht, addresses = start_bootstrap("127.0.0.1", 0)  # no swarm key: any record (the mechanics alone)
    service = NodeService(dht, signed_only=False)
    client = None
    try:
        client = NodeClient(service.address, timeout_s=TIMEOUT_S)
        stored = client.store("k", {"v": 1}, expiration_time=time.time() + 30, subkey=7).result(timeout=TIMEOUT_S)
        assert stored
        found = client.get("k").result(timeout=TIMEOUT_S)
        assert found.value[7].value == {"v": 1}
    finally:
        if client is not None:
            client.shutdown()
        start = time.monotonic()
        service.close()
        # below the 5 s close() gives the thread before it gives up on it: a close that waited for the poll fails
        assert time.monotonic() - start < 4.0, "close waited for the idle poll"
        dht.shutdown()
