"""The hivemind DHT directory's own behaviour: peers finding each other through one bootstrap address,
a killed peer's record expiring, malformed records and run entries dropped and counted, clear errors for
bad arguments and unreachable peers, a bootstrap node restarting with its address (identity and peers
files), and publish failures retried. The conformance suite it shares with the in-memory directory is
in tests/test_directory.py.

DHT tests run real hivemind nodes on 127.0.0.1 with random ports, short ttl and heartbeat, and a
deadline on every wait (``wait_until`` polls a condition; nothing sleeps a fixed time). Every
directory and bootstrap node is closed in teardown, and ``no_leaked_processes`` fails a test
whose DHT processes (or their ``p2pd`` daemons) outlive it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import wait_until
from gossiploco.errors import ConfigError, GossiplocoError
from gossiploco.membership import (
    DirectoryError,
    load_or_create_identity,
    serve_bootstrap,
    start_bootstrap,
)
from gossiploco.membership.bootstrap import load_saved_peers, usable_maddrs
from gossiploco.membership.runs import RunEntry
from gossiploco.runtime.launch import free_ports
from tests.test_directory import (  # noqa: F401 - fixtures shared with the conformance suite, used by name
    HEARTBEAT_S, TTL_S, dht_dirs, keys_of, no_leaked_processes, record)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bootstrap() -> Iterator[list[str]]:
    """A bootstrap node on loopback; yields its multiaddrs."""
    dht, addresses = start_bootstrap("127.0.0.1")
    try:
        yield addresses
    finally:
        dht.shutdown()


# -- hivemind DHT ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_three_directories_find_each_other_through_one_bootstrap_address(bootstrap, dht_dirs):
    assert len(bootstrap) == 1 and bootstrap[0].startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in bootstrap[0]
    members = [dht_dirs("run", bootstrap) for _ in range(3)]
    for i, member in enumerate(members):
        assert member.visible_maddrs and all("/p2p/" in a for a in member.visible_maddrs)
        member.announce(record(i))
    for member in members:
        assert wait_until(lambda: keys_of(member) == [0, 1, 2]), keys_of(member)
    started = time.monotonic()
    members[2].peers()
    assert time.monotonic() - started < 1.0


CRASH_SCRIPT = textwrap.dedent("""
    import sys
    from gossiploco.membership import DhtDirectory, PeerRecord
    ttl_s, heartbeat_s = float(sys.argv[2]), float(sys.argv[3])
    directory = DhtDirectory("run", initial_peers=[sys.argv[1]], ttl_s=ttl_s, heartbeat_s=heartbeat_s)
    directory.announce(PeerRecord(peer=9, endpoint="tcp://127.0.0.1:6009", round=-1, tokens=0))
    print("announced", flush=True)
    sys.stdin.read()  # until killed
""")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_record_of_a_killed_peer_disappears_after_its_ttl(bootstrap, dht_dirs):
    watcher = dht_dirs("run", bootstrap)
    watcher.announce(record(0))
    victim = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, bootstrap[0], str(TTL_S), str(HEARTBEAT_S)],
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_until(lambda: 9 in watcher.peers(), 30.0), "the peer in a subprocess never showed up"
        os.killpg(victim.pid, signal.SIGKILL)  # the peer, its DHT process and its p2pd: no withdraw
        killed = time.monotonic()
        assert wait_until(lambda: 9 not in watcher.peers(), TTL_S + 3.0), "crashed peer's record outlived its ttl"
        assert time.monotonic() - killed > HEARTBEAT_S  # it was not withdrawn: it had to expire
        assert keys_of(watcher) == [0]
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)
        victim.stdin.close()
        victim.stdout.close()


@pytest.mark.timeout(60)
def test_malformed_and_incompatible_records_are_dropped_and_counted(bootstrap, dht_dirs, caplog):
    reader, writer = dht_dirs("run", bootstrap), dht_dirs("run", bootstrap)
    reader.announce(record(0))
    expiration = time.time() + 30  # distinct per store: hivemind orders equal expirations by subkey
    writer.dht.store(writer.key, {**record(1).to_wire(), "version": 99}, expiration, subkey=1)
    writer.dht.store(writer.key, {**record(2).to_wire(), "peer": -2}, expiration + 0.1, subkey=2)
    writer.dht.store(writer.key, record(3).to_wire(), expiration + 0.2, subkey=4)  # under another peer's subkey
    writer.dht.store(writer.key, "x" * 10_000, expiration + 0.3, subkey="junk")

    def all_seen() -> bool:
        reader.peers()
        return (reader.malformed_records, reader.incompatible_records) == (3, 1)

    assert wait_until(all_seen), (reader.malformed_records, reader.incompatible_records)
    assert keys_of(reader) == [0]
    assert (reader.malformed_records, reader.incompatible_records) == (3, 1)  # each counted once
    assert "protocol version 99" in caplog.text and "peer must be in" in caplog.text


@pytest.mark.timeout(60)
def test_forged_and_malformed_run_entries_are_dropped_and_counted(bootstrap, dht_dirs, caplog):
    reader, writer = dht_dirs("red", bootstrap), dht_dirs("blue", bootstrap)
    good = RunEntry(0, "red", {"workers": 2})
    reader.announce_run(good)
    expiration = time.time() + 30  # distinct per store: hivemind orders equal expirations by subkey
    wire = RunEntry(1, "blue", {"workers": 3}).to_wire()
    writer.dht.store(writer.runs_key, {**wire, "version": 7}, expiration, subkey=1)
    writer.dht.store(writer.runs_key, {**wire, "peer": 2, "config": {"a": "x" * 5000}}, expiration + 0.1, subkey=2)
    writer.dht.store(writer.runs_key, {**wire, "peer": 3}, expiration + 0.2, subkey=4)  # under another peer's subkey
    writer.dht.store(writer.runs_key, "x" * 10_000, expiration + 0.3, subkey="junk")

    def all_seen() -> bool:
        reader.runs()
        return (reader.malformed_records, reader.incompatible_records) == (3, 1)

    assert wait_until(all_seen), (reader.malformed_records, reader.incompatible_records)
    assert reader.runs() == {0: good}
    assert "printable text" in caplog.text and "stored under subkey" in caplog.text


@pytest.mark.timeout(30)
def test_unreachable_initial_peer_raises_a_clear_error_within_the_timeout(dht_dirs):
    dht, addresses = start_bootstrap("127.0.0.1")
    dht.shutdown()  # a valid address of a node that is gone
    started = time.monotonic()
    with pytest.raises(DirectoryError, match="could not join the DHT through /ip4/127.0.0.1") as caught:
        dht_dirs("run", addresses, timeout_s=3.0)
    assert time.monotonic() - started < 3.0 + 4.0
    assert "bootstrap node is running" in str(caught.value) and isinstance(caught.value, GossiplocoError)


@pytest.mark.parametrize("address", ["/ip4/127.0.0.1/tcp/1", "tcp://127.0.0.1:5555", "garbage"])
def test_malformed_initial_peer_is_a_config_error(dht_dirs, address):
    with pytest.raises(ConfigError, match="--join.*gossiploco dht"):
        dht_dirs("run", [address])


def test_dht_directory_rejects_bad_arguments(dht_dirs):
    with pytest.raises(ConfigError, match="heartbeat_s: must be shorter than ttl_s"):
        dht_dirs(ttl_s=1.0, heartbeat_s=1.0)
    with pytest.raises(ConfigError, match="host"):
        dht_dirs(host="localhost")
    with pytest.raises(ConfigError, match="announce_maddrs.*explicit port"):
        dht_dirs(announce_maddrs=["/ip4/203.0.113.7/tcp/0"])


class ServedBootstrap:
    """``serve_bootstrap`` on a thread, as ``gossiploco bootstrap`` runs it; ``stop()`` ends it."""

    def __init__(self, port: int, identity_file: Path, host: str = "127.0.0.1"):
        self.ready: list[list[str]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=serve_bootstrap, kwargs=dict(
            host=host, port=port, identity_file=identity_file, on_ready=self.ready.append, stop=self.stopping))
        self.thread.start()
        if not wait_until(lambda: bool(self.ready) or not self.thread.is_alive(), 20.0) or not self.ready:
            self.stop()
            raise AssertionError("serve_bootstrap did not become ready")
        self.addresses = self.ready[0]

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(15.0)
        assert not self.thread.is_alive(), "serve_bootstrap did not stop"


@pytest.mark.slow  # restarts a bootstrap DHT node (3 s): the fast subset stays under 2 minutes
@pytest.mark.timeout(90)
def test_bootstrap_restart_keeps_its_address_and_the_swarm_keeps_working(tmp_path, dht_dirs):
    identity, (port,) = tmp_path / "bootstrap.key", free_ports(1)
    served = ServedBootstrap(port, identity)
    try:
        members = [dht_dirs("run", served.addresses) for _ in range(3)]
        for i, member in enumerate(members):
            member.announce(record(i))
        assert wait_until(lambda: all(keys_of(m) == [0, 1, 2] for m in members))
    finally:
        served.stop()  # saves the peers it is connected to next to its identity
    assert (tmp_path / "bootstrap.key.peers").stat().st_mode & 0o777 == 0o600

    # the bootstrap node is down: the peers are DHT nodes themselves
    members[0].update(round=4)
    members[2].withdraw()
    assert wait_until(lambda: members[1].peers() == {0: record(0, 4), 1: record(1)}), members[1].peers()

    served = ServedBootstrap(port, identity)
    try:
        assert served.addresses == [a for a in members[0].initial_peers]  # the same multiaddr
        late = dht_dirs("run", served.addresses)
        late.announce(record(3))
        # the restarted node pinged the saved peers: no waiting out libp2p's dial backoff
        assert wait_until(lambda: keys_of(late) == [0, 1, 3], 3.0), keys_of(late)
        assert wait_until(lambda: keys_of(members[0]) == [0, 1, 3]), keys_of(members[0])
    finally:
        served.stop()


def test_identity_file_is_created_private_and_reused(tmp_path):
    path = tmp_path / "id.key"
    peer_id = load_or_create_identity(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_identity(path) == peer_id
    assert load_or_create_identity(tmp_path / "other.key") != peer_id
    (tmp_path / "bad.key").write_bytes(b"not a key")
    (tmp_path / "bad.key").chmod(0o600)  # private, as a key file must be (a readable one is refused first)
    with pytest.raises(DirectoryError, match="does not hold a libp2p private key"):
        load_or_create_identity(tmp_path / "bad.key")
    with pytest.raises(ConfigError, match="does not exist"):
        load_or_create_identity(tmp_path / "missing" / "id.key")


@pytest.mark.timeout(30)
def test_serve_bootstrap_on_all_interfaces_reports_usable_addresses(tmp_path, dht_dirs):
    identity = tmp_path / "id.key"
    served = ServedBootstrap(free_ports(1, "0.0.0.0")[0], identity, host="0.0.0.0")
    try:
        addresses = served.addresses
        assert addresses and not any("/0.0.0.0/" in a for a in addresses)
        assert addresses[-1].startswith("/ip4/127.0.0.1/")  # loopback listed last
        assert all(a.endswith("/p2p/" + load_or_create_identity(identity)) for a in addresses)
        assert identity.stat().st_mode & 0o777 == 0o600
        member = dht_dirs("run", addresses[-1:])
        member.announce(record(0))
        assert keys_of(member) == [0]
    finally:
        served.stop()


def test_unroutable_addresses_are_replaced_and_loopback_listed_last():
    peer = "/p2p/QmPwfHkqPK6keQcEbUZ55nUirAbVJUsnAhsDcNaLjcB2qa"
    assert usable_maddrs([f"/ip4/127.0.0.1/tcp/1{peer}", f"/ip4/0.0.0.0/tcp/1{peer}", f"/ip4/192.0.2.2/tcp/1{peer}"]) \
        == [f"/ip4/192.0.2.2/tcp/1{peer}", f"/ip4/127.0.0.1/tcp/1{peer}"]
    assert usable_maddrs([f"/ip4/0.0.0.0/tcp/1{peer}"]) == [f"/ip4/127.0.0.1/tcp/1{peer}"]


def test_peers_file_is_read_as_data_and_bad_entries_are_skipped(tmp_path):
    good = "/ip4/127.0.0.1/tcp/5/p2p/QmPwfHkqPK6keQcEbUZ55nUirAbVJUsnAhsDcNaLjcB2qa"
    path = tmp_path / "id.key.peers"
    path.write_text(json.dumps([good, "garbage", 5, None]))
    assert load_saved_peers(path) == [good]
    path.write_text("{not json")
    assert load_saved_peers(path) == []
    assert load_saved_peers(tmp_path / "missing") == []


def test_a_record_that_fails_to_publish_once_is_retried_quietly_and_warned_about_as_it_nears_expiry(caplog):
    """A store that fails once (a DHT node slow to answer on a loaded machine) is info; failing for half the
    record's lifetime (others stop seeing this peer soon after) is a warning, said once; recovery is said at
    the level the failure reached."""
    import logging

    from gossiploco.membership.dht_directory import DhtDirectory

    directory = object.__new__(DhtDirectory)  # the outcome logic alone: no DHT process
    directory.run_id, directory.ttl_s, directory.heartbeat_s = "run-a", 20.0, 2.0
    directory._publish_failing_since, directory._publish_failure_warned = None, False

    def levels(*outcomes):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gossiploco.membership.dht_directory"):
            for ok, now in outcomes:
                directory._publish_outcome(7, ok, now)
        return [(r.levelno, r.getMessage().split(";")[0].split(" (")[0]) for r in caplog.records]

    assert levels((False, 100.0), (True, 102.0)) == [
        (logging.INFO, "run run-a: could not publish peer 7's record to the DHT"),
        (logging.INFO, "run run-a: publishing peer 7's record works again")]
    assert levels((True, 103.0)) == []
    failing = [(False, 200.0 + 2 * k) for k in range(8)]  # 14 s of failures: half the 20 s lifetime is passed at 210
    assert [level for level, _ in levels(*failing, (True, 216.0))] == [logging.INFO, logging.WARNING, logging.WARNING]
    assert "has failed for 10 s" in caplog.records[1].getMessage()
