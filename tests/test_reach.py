"""Reachability and paths on loopback: the dial-back check, and a swarm whose peers say they are
behind NAT (``--reachability nat``), so each pair takes the path it would across the internet:
reverse connections between a reachable and a NAT'd peer, libp2p streams through the bootstrap
node's relay between two NAT'd peers. The real NAT testbed is tests/test_nat.py."""

from __future__ import annotations


import pytest

from conftest import tiny_peer_args
from gossiploco.membership.bootstrap import start_bootstrap
from gossiploco.reach.dialback import check_reachability, describe, free_port, parse_request
from gossiploco.reach.paths import DIRECT, RELAYED, REVERSE, pair_path, path_between
from gossiploco.runtime.launch import LocalPeers
from test_peer import ENV, assert_matches_virtual_swarm, summary


def test_path_between_follows_who_can_be_dialed():
    assert path_between(True, True) == path_between(False, True) == DIRECT
    assert path_between(True, False) == REVERSE
    assert path_between(False, False) == RELAYED
    assert pair_path(True, True) == DIRECT and pair_path(True, False) == pair_path(False, True) == REVERSE
    assert pair_path(False, False) == RELAYED


@pytest.mark.parametrize("raw", [b"", b"\x80", b"\x91\x01", b"x" * 300])
def test_a_malformed_dialback_request_is_refused(raw):
    with pytest.raises(Exception):
        parse_request(raw)


def test_the_dialback_check_reaches_a_listening_port_and_reports_a_dead_checker():
    dht, addresses = start_bootstrap("127.0.0.1")
    try:
        port = free_port("127.0.0.1")
        found = check_reachability(addresses, port, timeout_s=10, host="127.0.0.1")
        assert found.reachable is True and found.address == f"tcp://127.0.0.1:{port}", found
        assert found.observed_ip == "127.0.0.1" and abs(found.clock_skew_s) < 1 and found.rtt_s < 5
        assert describe(found) == f"reachable at tcp://127.0.0.1:{port}"
    finally:
        dht.shutdown()
    gone = check_reachability(addresses, free_port("127.0.0.1"), timeout_s=3, host="127.0.0.1")
    assert gone.reachable is None and gone.detail and "behind NAT" in describe(gone)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nat_paths_on_loopback_train_like_the_virtual_swarm(tmp_path, bootstrap):
    """Peers 0 and 1 reachable, 2 and 3 behind NAT (declared): every path kind is in use, and the
    models equal the virtual swarm's."""
    preset = "globalm1-localm2"
    per_rank = {0: ["--reachability", "public"], 1: ["--reachability", "public"],
                2: ["--reachability", "nat"], 3: ["--reachability", "nat"]}
    with LocalPeers(4, tmp_path, tiny_peer_args(preset), env=ENV, join=bootstrap.address,
                    swarm_key=bootstrap.swarm_key, per_rank=per_rank) as peers:
        peers.start()
        codes = peers.wait(240)
    assert_matches_virtual_swarm(peers, codes, preset)
    ids = {rank: peers.peer_id(rank) for rank in range(4)}
    for rank in range(4):
        reach = summary(peers, rank)["reach"]
        others = {r: ids[r] for r in range(4) if r != rank}
        expected = {str(pid): path_between(rank < 2, r < 2) for r, pid in others.items()}
        assert reach["per_peer"] == expected, (rank, reach, peers.log(rank)[-3000:])
    assert summary(peers, 2)["reach"]["tunnels"]["opened"] >= 2 and summary(peers, 3)["reach"]["tunnels"]["served"] >= 2
