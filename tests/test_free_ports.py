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


def test_peers_launched_to_join_get_distinct_ports_kept_across_restarts(tmp_path):
    """``LocalPeers`` with ``join`` gives every rank its own ``--port`` (peers picking their own could pick the same one:
    one of 32 in a ``gossiploco swarm`` run exited with "Address already in use"); a rank started again keeps its
    port, a rank beyond the count gets one no other rank has, and a port a rank's own arguments give wins."""
    from gossiploco.runtime.launch import LocalPeers

    def port_of(cmd: list[str]) -> int:
        return int(cmd[len(cmd) - 1 - cmd[::-1].index("--port") + 1])  # the last --port: the one the CLI takes

    peers = LocalPeers(32, tmp_path, join="/ip4/127.0.0.1/tcp/1/p2p/x", per_rank={3: ["--port", "7000"]})
    ports = [port_of(peers.command(rank)) for rank in range(32)]
    assert ports[3] == 7000
    others = [p for rank, p in enumerate(ports) if rank != 3]
    assert len(set(others)) == 31 and not [p for p in others if p in ephemeral_ports()]
    assert [port_of(peers.command(rank)) for rank in range(32)] == ports  # restarts keep theirs
    assert port_of(peers.command(40)) not in ports and port_of(peers.command(40)) == port_of(peers.command(40))
    assert "--port" not in LocalPeers(2, tmp_path / "static").command(0)  # a static list names every endpoint
