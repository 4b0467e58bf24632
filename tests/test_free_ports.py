"""Ports picked for peers to bind later (``gossiploco.runtime.launch.free_ports``) never collide with the
ports the kernel hands out meanwhile (p2pd listeners, tunnels, outgoing connections)."""

from __future__ import annotations

import socket

import pytest

from gossiploco.runtime import launch
from gossiploco.runtime.launch import ephemeral_ports, free_ports


def test_picked_ports_are_distinct_bindable_and_outside_the_kernels_range():
    ephemeral = ephemeral_ports()
    ports = free_ports(32)
    assert len(set(ports)) == 32
    assert not [p for p in ports if p in ephemeral]
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ports_the_kernel_hands_out_meanwhile_are_never_the_picked_ones():
    picked = set(free_ports(64))
    handed_out = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            handed_out.append(s)
        assert not picked & {s.getsockname()[1] for s in handed_out}
    finally:
        for s in handed_out:
            s.close()


def test_a_port_in_use_is_skipped_and_finding_none_is_an_error(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # just closed: the kernel moves on through its range before reusing it
    try:
        used = taken.getsockname()[1]
        monkeypatch.setattr(launch, "ephemeral_ports", lambda: range(0, 65536))  # no room outside: any port
        monkeypatch.setattr(launch.random, "Random", lambda: Scripted([used, used, free]))
        assert free_ports(1) == [free]
        monkeypatch.setattr(launch.random, "Random", lambda: Scripted([used] * 64))
        with pytest.raises(OSError, match="found only 0 of 1 free ports"):
            free_ports(1)
    finally:
        taken.close()


class Scripted:
    """A ``random.Random`` whose ``randrange`` returns the given ports in turn."""

    def __init__(self, ports: list[int]):
        self.ports = list(ports)

    def randrange(self, *_) -> int:
        return self.ports.pop(0)


def test_an_exchange_on_a_port_another_process_holds_says_so_with_its_own_error():
    from gossiploco.errors import AddressInUse
    from gossiploco.transport.zmq_exchange import ZmqExchange

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(AddressInUse, match="cannot bind"):
            ZmqExchange(0, [endpoint, "tcp://127.0.0.1:1"], "ports-test", 5.0)


def test_a_peer_picking_its_own_port_picks_again_when_another_process_took_it_first(monkeypatch, caplog):
    """Its whole start is made again on a new port (the reachability check dials the port the data plane binds); a port
    the user gave is never changed; after ``PORT_PICKS`` taken ports the error is raised."""
    from gossiploco.errors import AddressInUse
    from gossiploco.runtime import dht_peer

    picks = iter([4101, 4102, 4103, 4104])
    monkeypatch.setattr(dht_peer, "free_ports", lambda count, host: [next(picks)])
    taken = {4101}
    started: list[int] = []

    def joined_node(cfg, trust, stream, join, host, port, *args, **kwargs):
        started.append(port)
        if port in taken:
            raise AddressInUse(f"rank 1: cannot bind tcp://{host}:{port}: Address already in use")
        return f"peer on {port}"

    monkeypatch.setattr(dht_peer, "joined_node", joined_node)
    trust = type("T", (), {"peer_id": 1})()
    assert dht_peer.joined_peer(None, trust, None, [], "127.0.0.1", 0, None, "run") == "peer on 4102"
    assert started == [4101, 4102] and "port 4101 was taken" in caplog.text
    taken.update({4103, 4104, 7000})
    with pytest.raises(AddressInUse):
        dht_peer.joined_peer(None, trust, None, [], "127.0.0.1", 7000, None, "run")  # the user's port: not changed
    assert started[-1] == 7000
    picks = iter([4201, 4202, 4203])
    taken.update({4201, 4202, 4203})
    with pytest.raises(AddressInUse):
        dht_peer.joined_peer(None, trust, None, [], "127.0.0.1", 0, None, "run")
    assert started[-3:] == [4201, 4202, 4203] and dht_peer.PORT_PICKS == 3
