"""Peer directory: the record's wire format, and a conformance suite run against the in-memory and the
hivemind DHT directories (the DHT's own behaviour is in tests/test_directory_dht.py).

DHT tests run real hivemind nodes on 127.0.0.1 with random ports, short ttl and heartbeat, and a
deadline on every wait (``wait_until`` polls a condition; nothing sleeps a fixed time). Every
directory and bootstrap node is closed in teardown, and ``no_leaked_processes`` fails a test
whose DHT processes (or their ``p2pd`` daemons) outlive it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import wait_until
from gossiploco.errors import ConfigError
from gossiploco.membership import (
    PROTOCOL_VERSION,
    DhtDirectory,
    Directory,
    DirectoryClosed,
    DirectoryError,
    IncompatibleRecord,
    MemoryDirectory,
    MemoryDirectoryHub,
    PeerRecord,
    start_bootstrap,
)
from gossiploco.membership.runs import RunEntry

TTL_S = 2.0
HEARTBEAT_S = 0.3
TIMEOUT_S = 5.0


def record(peer: int, round_index: int = -1, tokens: int = 0) -> PeerRecord:
    return PeerRecord(peer=peer, endpoint=f"tcp://127.0.0.1:{6000 + peer}", round=round_index, tokens=tokens)


def descendants() -> set[int]:
    """Pids of every live descendant of this process (read from /proc; zombies excluded).

    torch's ``torch_shm_manager`` is left out: torch starts one per process the first time a tensor
    goes to shared memory (hivemind's ``MPFuture`` does that) and keeps it for the process's life.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = set(), [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return {pid for pid in found if not _cmdline(pid).startswith(b"torch_shm_manager")}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
    except OSError:
        return b""


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    before = descendants()
    yield
    if not wait_until(lambda: not descendants() - before, 10.0):
        leaked = {pid: _cmdline(pid) for pid in descendants() - before}
        pytest.fail(f"leaked processes: {leaked}")


@pytest.fixture
def dht_dirs() -> Iterator[Callable[..., DhtDirectory]]:
    """Factory of ``DhtDirectory`` with test timings; closes them all in teardown."""
    made: list[DhtDirectory] = []

    def make(run_id: str = "run", initial_peers: list[str] | None = None, **options) -> DhtDirectory:
        options = {"ttl_s": TTL_S, "heartbeat_s": HEARTBEAT_S, "timeout_s": TIMEOUT_S, **options}
        directory = DhtDirectory(run_id, initial_peers=initial_peers or [], **options)
        made.append(directory)
        return directory

    try:
        yield make
    finally:
        for directory in made:
            directory.close()


# -- PeerRecord --------------------------------------------------------------------------------


def test_record_round_trips_through_the_wire_format():
    original = PeerRecord(peer=7, endpoint="tcp://node-3.example:5555", round=12, tokens=1 << 40, key=bytes(range(32)))
    wire = original.to_wire()
    assert wire == {"version": PROTOCOL_VERSION, "peer": 7, "endpoint": "tcp://node-3.example:5555",
                    "round": 12, "tokens": 1 << 40, "key": bytes(range(32)), "reachable": True, "p2p": "",
                    "relays": [], "reverse": [], "joined": -1}
    assert all(type(v) in (int, str, bytes, bool, list) for v in wire.values())
    assert PeerRecord.from_wire(wire) == original
    relay = "/ip4/10.88.0.2/tcp/4001/p2p/12D3KooWR2vs2x1D1rzjgXzywmXTrDSDDai57ecyh9in4CVNiao4"
    nat = PeerRecord(peer=9, endpoint="tcp://192.168.1.2:5555", round=0, tokens=0, reachable=False,
                     p2p=relay.rsplit("/", 1)[1], relays=(relay,), reverse=((4, 40001, 40002),))
    assert PeerRecord.from_wire(nat.to_wire()) == nat
    assert nat.reverse_for(4) == (40001, 40002) and nat.reverse_for(5) is None and nat.host == "192.168.1.2"
    assert PeerRecord.from_wire(record(0).to_wire()).round == -1
    joined = PeerRecord(peer=3, endpoint="tcp://10.0.0.3:5555", round=40, tokens=9, joined=37)
    assert PeerRecord.from_wire(joined.to_wire()).joined == 37


@pytest.mark.parametrize("change, reason", [
    ({"peer": -1}, "peer must be in"),
    ({"peer": 2**31}, "peer must be in"),
    ({"peer": "3"}, "peer must be an int"),
    ({"peer": True}, "peer must be an int"),
    ({"peer": 3.0}, "peer must be an int"),
    ({"round": -2}, "round must be in"),
    ({"round": 2**63}, "round must be in"),
    ({"tokens": -1}, "tokens must be in"),
    ({"tokens": None}, "tokens must be an int"),
    ({"joined": -2}, "joined must be in"),
    ({"joined": 2**63}, "joined must be in"),
    ({"joined": "5"}, "joined must be an int"),
    ({"joined": False}, "joined must be an int"),
    ({"endpoint": "127.0.0.1:5555"}, "tcp://HOST:PORT"),
    ({"endpoint": "tcp://127.0.0.1"}, "tcp://HOST:PORT"),
    ({"endpoint": "tcp://127.0.0.1:55/x"}, "tcp://HOST:PORT"),
    ({"endpoint": "tcp://bad host:5555"}, "tcp://HOST:PORT"),
    ({"endpoint": "tcp://127.0.0.1:5555\n"}, "tcp://HOST:PORT"),
    ({"endpoint": "tcp://127.0.0.1:\u0665\u0665\u0665\u0665"}, "tcp://HOST:PORT"),
    ({"endpoint": "tcp://127.0.0.1:0"}, "port must be in"),
    ({"endpoint": "tcp://127.0.0.1:70000"}, "port must be in"),
    ({"endpoint": b"tcp://127.0.0.1:5555"}, "endpoint must be a str"),
    ({"endpoint": "tcp://" + "a" * 100_000 + ":5555"}, "characters long"),
    ({"extra": "x" * 1_000_000}, "unknown 'extra'"),
    ({"version": "1"}, "version must be an int"),
    ({"reachable": 1}, "reachable must be a bool"),
    ({"p2p": "not base58 0OIl"}, "p2p must be"),
    ({"relays": ["/ip4/1.2.3.4/tcp/1"]}, "relay must look like"),
    ({"relays": "/ip4/1.2.3.4/tcp/1/p2p/x"}, "relays must be a list"),
    ({"relays": ["/ip4/1.2.3.4/tcp/1/p2p/" + "a" * 40] * 9}, "at most 8"),
    ({"reverse": [[1, 2]]}, "a reverse entry"),
    ({"reverse": [[1, 0, 5]]}, "reverse port must be in"),
    ({"reverse": [[-1, 5, 5]]}, "reverse peer must be in"),
    ({"reverse": [5]}, "a reverse entry must be a list"),
    ({"reverse": [[1, 5, 5]] * 513}, "at most 512"),
])
def test_record_from_the_wire_rejects_invalid_data(change, reason):
    wire = {**record(3).to_wire(), **change}
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace("[", r"\[")):
        PeerRecord.from_wire(wire)


@pytest.mark.parametrize("obj", [None, [], "peer", 5, [3, "tcp://127.0.0.1:5555", 0, 0, 1]])
def test_record_from_the_wire_rejects_non_dicts(obj):
    with pytest.raises(ValueError, match="record must be a dict"):
        PeerRecord.from_wire(obj)


def test_record_from_the_wire_rejects_missing_fields_and_names_them():
    wire = record(3).to_wire()
    del wire["tokens"]
    with pytest.raises(ValueError, match=r"wrong fields \(missing tokens\)"):
        PeerRecord.from_wire(wire)


def test_record_of_another_protocol_version_is_told_apart():
    wire = {**record(3).to_wire(), "version": PROTOCOL_VERSION + 1, "new_field": 1}
    with pytest.raises(IncompatibleRecord, match=f"protocol version {PROTOCOL_VERSION + 1}") as caught:
        PeerRecord.from_wire(wire)
    assert caught.value.version == PROTOCOL_VERSION + 1


def test_records_are_validated_at_construction_too():
    with pytest.raises(ValueError, match="endpoint"):
        PeerRecord(peer=0, endpoint="localhost", round=0, tokens=0)


# -- conformance suite: memory and DHT ---------------------------------------------------------


@pytest.fixture(params=["memory", pytest.param("dht", marks=pytest.mark.slow)])  # the DHT: 7 s, out of the fast subset
def swarm(request, dht_dirs) -> Callable[..., Directory]:
    """``join(run_id)`` makes one more directory of a swarm; memory or DHT (through one bootstrap)."""
    if request.param == "memory":
        hub = MemoryDirectoryHub()
        made: list[MemoryDirectory] = []
        request.addfinalizer(lambda: [d.close() for d in made])

        def join_memory(run_id: str = "run") -> Directory:
            made.append(MemoryDirectory(hub, run_id, ttl_s=TTL_S))
            return made[-1]

        return join_memory
    dht, addresses = start_bootstrap("127.0.0.1")
    request.addfinalizer(dht.shutdown)
    return lambda run_id="run": dht_dirs(run_id, addresses)


def keys_of(directory: Directory) -> list[int]:
    return sorted(directory.peers())


@pytest.mark.timeout(60)
def test_members_find_every_record_of_their_run_including_their_own(swarm):
    members = [swarm() for _ in range(3)]
    for i, member in enumerate(members):
        member.announce(record(i))
        assert i in member.peers() and member.peers()[i] == record(i)
    for member in members:
        assert wait_until(lambda: keys_of(member) == [0, 1, 2]), keys_of(member)
    assert members[0].peers()[2] == record(2)


@pytest.mark.timeout(60)
def test_updates_reach_the_others_and_own_view_at_once(swarm):
    a, b = swarm(), swarm()
    a.announce(record(0))
    b.announce(record(1))
    a.update(round=5, tokens=1000)
    assert a.peers()[0] == record(0, 5, 1000)
    assert wait_until(lambda: b.peers().get(0) == record(0, 5, 1000)), b.peers()
    a.update(tokens=2000)
    assert wait_until(lambda: b.peers().get(0) == record(0, 5, 2000)), b.peers()


@pytest.mark.timeout(60)
def test_withdrawn_record_disappears_quickly_and_can_come_back(swarm):
    a, b = swarm(), swarm()
    a.announce(record(0))
    b.announce(record(1))
    assert wait_until(lambda: keys_of(b) == [0, 1])
    a.withdraw()
    assert 0 not in a.peers()
    assert wait_until(lambda: keys_of(b) == [1], TTL_S / 2), "withdraw took longer than half a ttl"
    a.withdraw()  # a no-op now
    a.announce(record(0, 3))
    assert wait_until(lambda: b.peers().get(0) == record(0, 3))


@pytest.mark.timeout(60)
def test_announcing_under_another_peer_id_replaces_the_old_record(swarm):
    a, b = swarm(), swarm()
    a.announce(record(0))
    assert wait_until(lambda: keys_of(b) == [0])
    a.announce(record(4))
    assert wait_until(lambda: keys_of(b) == [4], TTL_S / 2), keys_of(b)


@pytest.mark.timeout(60)
def test_two_runs_on_one_swarm_never_see_each_other(swarm):
    red = [swarm("red") for _ in range(2)]
    blue = [swarm("blue") for _ in range(2)]
    for i, member in enumerate(red + blue):
        member.announce(record(i))
    assert wait_until(lambda: keys_of(red[0]) == [0, 1] and keys_of(blue[0]) == [2, 3])
    assert wait_until(lambda: keys_of(red[1]) == [0, 1] and keys_of(blue[1]) == [2, 3])
    # several heartbeats later still apart
    tick = threading.Event()
    tick.wait(2 * HEARTBEAT_S)
    assert keys_of(red[0]) == [0, 1] and keys_of(blue[1]) == [2, 3]


@pytest.mark.slow  # 3 to 4 s per directory: keeps the fast subset under its 2 minutes
@pytest.mark.timeout(60)
def test_every_run_of_a_swarm_sees_each_runs_entry_while_its_peer_is_there(swarm):
    red, blue = swarm("red"), swarm("blue")
    entries = {0: RunEntry(0, "red", {"workers": 2}), 1: RunEntry(1, "blue", {"workers": 3}, separate=True)}
    for peer, directory in ((0, red), (1, blue)):
        directory.announce(record(peer))
        directory.announce_run(entries[peer])
        assert directory.runs()[peer] == entries[peer]  # its own at once
    assert wait_until(lambda: red.runs() == entries and blue.runs() == entries), (red.runs(), blue.runs())
    assert keys_of(blue) == [1]  # the runs' peer records stay apart
    deadline = time.monotonic() + 1.5 * TTL_S  # refreshed with the record: still there after its ttl
    while time.monotonic() < deadline:
        assert blue.runs() == entries
    red.close()  # leaving withdraws the entry with the record
    assert wait_until(lambda: list(blue.runs()) == [1], TTL_S / 2), blue.runs()
    with pytest.raises(DirectoryClosed):
        red.runs()


@pytest.mark.timeout(60)
def test_misuse_and_closed_directories_raise_clear_errors(swarm):
    a, b = swarm(), swarm()
    with pytest.raises(DirectoryError, match="before announce"):
        a.update(round=1)
    a.announce(record(0))
    with pytest.raises(TypeError, match="reverse, round, tokens only"):
        a.update(endpoint="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="round must be in"):
        a.update(round=-5)
    with pytest.raises(TypeError, match="PeerRecord"):
        a.announce(record(1).to_wire())
    assert a.peers()[0] == record(0)  # the failed update changed nothing
    assert wait_until(lambda: keys_of(b) == [0])
    a.close()
    a.close()  # idempotent
    for call in (a.peers, a.withdraw, lambda: a.announce(record(0)), lambda: a.update(round=1)):
        with pytest.raises(DirectoryClosed):
            call()
    assert wait_until(lambda: keys_of(b) == [], TTL_S / 2), "close() did not withdraw"


# -- in memory ---------------------------------------------------------------------------------


def test_memory_record_of_a_crashed_peer_expires_after_its_ttl():
    now = [100.0]
    hub = MemoryDirectoryHub(clock=lambda: now[0])
    a, b = MemoryDirectory(hub, ttl_s=10.0), MemoryDirectory(hub, ttl_s=10.0)
    a.announce(record(0))
    b.announce(record(1))
    now[0] += 1000.0  # live records never expire: their owners keep them fresh
    assert keys_of(b) == [0, 1]
    a.simulate_crash()
    with pytest.raises(DirectoryClosed):
        a.peers()
    now[0] += 9.9
    assert keys_of(b) == [0, 1]
    now[0] += 0.2
    assert keys_of(b) == [1]


def test_memory_directory_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="ttl_s"):
        MemoryDirectory(MemoryDirectoryHub(), ttl_s=0)
    with pytest.raises(ConfigError, match="run_id"):
        MemoryDirectory(MemoryDirectoryHub(), "")
