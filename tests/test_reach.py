"""Reachability and paths on loopback: the dial-back check, and a swarm whose peers say they are
behind NAT (``--reachability nat``), so each pair takes the path it would across the internet:
reverse connections between a reachable and a NAT'd peer, libp2p streams through the bootstrap
node's relay between two NAT'd peers. The real NAT testbed is tests/test_nat.py."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest
import torch

from conftest import tiny_peer_args
from gossiploco.membership.bootstrap import start_bootstrap
from gossiploco.reach.dialback import REFUSED, UNREACHED, DialbackService, SourceLimits, parse_request, source_address
from gossiploco.reach.reachability import check_reachability, describe, read_answer
from gossiploco.reach.paths import DIRECT, RELAYED, REVERSE, MemoryPaths, Reach, pair_path, path_between, path_class
from gossiploco.protocol.agreement import ring_order
from gossiploco.runtime.launch import LocalPeers, free_ports
from gossiploco.runtime.path_planner import PathPlanner
from test_exchange import Libp2pCarrier, ZmqGroup, run_all
from test_peer import ENV, assert_matches_virtual_swarm, summary


def test_path_between_follows_who_can_be_dialed():
    assert path_between(True, True) == path_between(False, True) == DIRECT
    assert path_between(True, False) == REVERSE
    assert path_between(False, False) == RELAYED
    assert pair_path(True, True) == DIRECT and pair_path(True, False) == pair_path(False, True) == REVERSE
    assert pair_path(False, False) == RELAYED


@pytest.mark.parametrize("reachable, natted", [(4, 0), (3, 3), (4, 2), (2, 5), (0, 3), (1, 1)])
def test_ring_order_keeps_peers_behind_nat_apart(reachable, natted):
    members = list(range(100, 100 + reachable + natted))
    behind = set(members[reachable:])
    order = ring_order(set(members), behind)
    assert sorted(order) == members
    n = len(order)
    nat_neighbours = sum(order[i] in behind and order[(i + 1) % n] in behind for i in range(n)) if n > 1 else 0
    assert nat_neighbours == (max(0, natted - reachable) if natted != n else n), order  # the fewest possible
    if not natted:
        assert order == members  # nobody behind NAT: by id, as before


def test_every_member_gets_the_leaders_ring_order_and_the_ring_averages_over_it():
    g = ZmqGroup(4, 10.0)
    try:
        for ex in g.exchanges:  # as every peer reads from the records; the exchange's leader (drawn per key) orders it
            ex.set_behind_nat({1, 2})
        groups = run_all([lambda r=r: g.exchanges[r].group("mix2/0", 0) for r in range(4)])
        assert groups == [[0, 1, 3, 2]] * 4
        values = [torch.full((1000,), float(r)) for r in range(4)]
        out = run_all([lambda r=r: g.exchanges[r].all_reduce_mean("mix2/0", values[r], groups[r]) for r in range(4)])
        assert all(torch.allclose(o, torch.full((1000,), 1.5)) for o in out)
    finally:
        g.close()


@pytest.mark.parametrize("raw", [b"", b"\x80", b"\x91\x01", b"x" * 300])
def test_a_malformed_dialback_request_is_refused(raw):
    with pytest.raises(Exception):
        parse_request(raw)


def test_source_limits_bound_requests_per_peer_per_address_and_in_all():
    limits = SourceLimits(per_source=2, total=3)
    a1, a2 = ("peer A", "address 10.0.0.1"), ("peer B", "address 10.0.0.1")
    assert limits.admit(a1) is None and limits.admit(a1) is None
    assert "too many requests from peer A" in limits.admit(a1)
    assert "too many requests from address 10.0.0.1" in limits.admit(a2)  # another id, the same machine
    assert limits.admit(("peer C", "address 10.0.0.2")) is None
    assert "checker busy" in limits.admit(("peer D", "address 10.0.0.3"))  # 3 in all
    limits.release(a1)
    assert limits.admit(a2) is None and limits.count == 3
    assert source_address("2001:db8::1") == source_address("2001:db8::ffff") == "2001:db8::/64"
    assert source_address("::ffff:10.0.0.1") == "10.0.0.1" and source_address("10.0.0.1") == "10.0.0.1"


def _stream(data: bytes = b"", eof: bool = False) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def _request(port: int, nonce: bytes = b"n" * 16) -> bytes:
    raw = msgpack.packb({"port": port, "nonce": nonce})
    return len(raw).to_bytes(8, "big") + raw


def test_the_checker_refuses_a_huge_length_prefix_before_reading_the_body():
    async def scenario():
        service = DialbackService()
        body = b"\x00" * 4096
        reader = _stream((1 << 40).to_bytes(8, "big") + body)  # a 1 TiB request announced
        answer = await service.answer(SimpleNamespace(peer_id="p", addr="/ip4/10.0.0.1/tcp/4"), reader)
        return answer, len(await reader.read(1 << 20)), service

    answer, left, service = asyncio.run(scenario())
    assert answer["outcome"] == REFUSED and "1099511627776 bytes announced" in answer["detail"]
    assert left == 4096  # nothing of the body was read
    assert service.stats.refused == {"malformed": 1} and service.limits.count == 0


def test_the_checker_answers_a_stranger_beyond_its_share_at_once_and_dials_back_for_others():
    """Two requests in flight from one source (here never finishing) hold its share; a third from the same
    peer id, or from another id at the same address, is refused at once; another source is dialled back."""
    closed = free_ports(1)[0]

    async def scenario():
        service = DialbackService(per_source=2, dial_s=2.0)
        stranger = SimpleNamespace(peer_id="stranger", addr="/ip4/127.0.0.1/tcp/4001")
        held = [asyncio.ensure_future(service.answer(stranger, _stream())) for _ in range(2)]
        await asyncio.sleep(0)  # both admitted, now waiting for their requests
        again = await service.answer(stranger, _stream(_request(closed)))
        same_host = await service.answer(SimpleNamespace(peer_id="other", addr="/ip4/127.0.0.1/tcp/4002"),
                                         _stream(_request(closed)))
        relayed = await service.answer(SimpleNamespace(peer_id="x", addr="/p2p/Qm/p2p-circuit"), _stream())
        honest = await service.answer(SimpleNamespace(peer_id="honest", addr="/ip4/127.0.0.2/tcp/4003"),
                                      _stream(_request(closed)))
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        return again, same_host, relayed, honest, service

    again, same_host, relayed, honest, service = asyncio.run(scenario())
    assert again["outcome"] == REFUSED and "too many requests from peer stranger" in again["detail"]
    assert same_host["outcome"] == REFUSED and "address 127.0.0.1" in same_host["detail"]
    assert relayed["outcome"] == REFUSED and "not a direct connection" in relayed["detail"]
    assert honest["outcome"] == UNREACHED and honest["ip"] == "127.0.0.2"  # dialled: nothing listens there
    assert service.stats.as_dict() == {"requests": 6, "reached": 0, "unreached": 1,
                                       "refused": {"per source": 2, "relayed": 1}, "gone": 0}
    assert service.limits.count == 0 and not service.limits.in_flight  # the held slots came back


@pytest.mark.parametrize("answer, expected", [
    ({"outcome": "reached", "reachable": True, "ip": "203.0.113.5", "detail": "dialed", "time": 1.0},
     ("reached", "203.0.113.5", "dialed", 1.0)),
    ({"outcome": "unreached", "reachable": False, "ip": "203.0.113.5", "detail": "no answer", "time": 2},
     ("unreached", "203.0.113.5", "no answer", 2.0)),
    ({"outcome": "refused", "reachable": False, "ip": "", "detail": "checker busy", "time": 1.0},
     ("refused", None, "checker busy", 1.0)),
    # the first version said "not reachable" when it was busy too: its "no" is no verdict
    ({"reachable": False, "ip": "203.0.113.5", "detail": "checker busy", "time": 1.0},
     ("refused", "203.0.113.5", "checker busy", 1.0)),
    ({"reachable": True, "ip": "203.0.113.5", "detail": "dialed", "time": True}, ("reached", "203.0.113.5", "dialed", None)),
    ({"outcome": "unreached", "reachable": False, "ip": "", "detail": "", "time": 1.0}, ValueError),
    ({"outcome": "maybe", "reachable": False}, ValueError), ({"reachable": "yes"}, ValueError), ([1], ValueError),
])
def test_an_answer_is_a_verdict_only_when_the_checker_dialled(answer, expected):
    if expected is ValueError:
        with pytest.raises(ValueError):
            read_answer(msgpack.packb(answer))
    else:
        assert read_answer(msgpack.packb(answer)) == expected


def test_the_dialback_check_reaches_a_listening_port_and_reports_a_dead_checker():
    dht, addresses = start_bootstrap("127.0.0.1")
    try:
        port = free_ports(1)[0]
        found = check_reachability(addresses, port, timeout_s=10, host="127.0.0.1")
        assert found.reachable is True and found.address == f"tcp://127.0.0.1:{port}", found
        assert found.observed_ip == "127.0.0.1" and abs(found.clock_skew_s) < 1 and found.rtt_s < 5
        assert describe(found) == f"reachable at tcp://127.0.0.1:{port}"
    finally:
        dht.shutdown()
    gone = check_reachability(addresses, free_ports(1)[0], timeout_s=3, host="127.0.0.1")
    assert gone.reachable is None and gone.detail and "behind NAT" in describe(gone)


def test_without_a_verdict_a_peer_acts_as_behind_nat_unless_it_announces_an_address_and_says_why():
    from gossiploco.reach.reachability import Reachability
    from gossiploco.runtime.dht_peer import reachable_as

    unknown = Reachability(None, None, None, "a1: checker busy; b2: TimeoutError", "QmA", 0.1, 0.01, no_verdict=2)
    acts, told = reachable_as(unknown, None)
    assert acts is False and "no checker gave a verdict (2 busy or unreachable" in told
    assert "acting as behind NAT" in told and "--reachability public --announce" in told
    acts, told = reachable_as(unknown, "203.0.113.9:7000")
    assert acts is True and "acting as reachable at --announce 203.0.113.9:7000, unverified" in told
    from gossiploco.runtime.dht_peer import verified_by_join

    join = ["/ip4/198.51.100.1/tcp/4000/p2p/QmA"]
    reached = Reachability(True, "tcp://203.0.113.9:7000", "203.0.113.9", "dialed", "QmA", 0.1, 0.01)
    assert verified_by_join(reached, join) and not verified_by_join(unknown, join)
    assert not verified_by_join(dataclasses.replace(reached, checker="QmStranger"), join)  # checks itself first
    dialled = Reachability(False, None, "203.0.113.9", "no answer", "QmA", 0.1, 0.01)
    assert reachable_as(dialled, "203.0.113.9:7000") == (False, "behind NAT: using reverse connections and "
                                                                "relays (no answer)")  # a verdict is followed


class JammedChecker:
    """Real libp2p daemons, from an event loop on its own thread: a dial-back checker that waits ``dial_s``
    for a request, a stranger's daemon holding ``streams`` silent requests open to it, and another
    checker nobody jams (``other_address``)."""

    def __init__(self, streams: int, dial_s: float = 30.0):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = DialbackService(dial_s=dial_s)
        self.address, self.answered = self.run(self._start(streams))

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self, streams: int):
        from hivemind.p2p import P2P

        from gossiploco.reach.dialback import DIALBACK_PROTOCOL

        self.checker, self.other = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
        await self.checker.add_binary_stream_handler(DIALBACK_PROTOCOL, self.service.handle)
        await self.other.add_binary_stream_handler(DIALBACK_PROTOCOL, DialbackService().handle)
        address = f"{(await self.checker.get_visible_maddrs())[0]}/p2p/{self.checker.peer_id}"
        self.other_address = f"{(await self.other.get_visible_maddrs())[0]}/p2p/{self.other.peer_id}"
        self.stranger = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[address])
        opened = [await self.stranger.call_binary_stream_handler(self.checker.peer_id, DIALBACK_PROTOCOL)
                  for _ in range(streams)]
        self.writers = [writer for _, _, writer in opened]
        answered = 0  # the streams refused at once (those admitted wait for a request that never comes)
        for _, reader, _ in opened:
            try:
                await asyncio.wait_for(reader.read(1), 0.5)
                answered += 1
            except asyncio.TimeoutError:
                pass
        return address, answered

    async def _stop(self):
        for writer in self.writers:
            writer.close()
        for daemon in (self.stranger, self.checker, self.other):
            await daemon.shutdown()

    def close(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.mark.slow
def test_a_stranger_jamming_a_checker_gets_its_share_and_an_honest_peer_asks_another_never_behind_nat():
    """24 dial-back requests held open by one stranger: the checker admits 2 (its share per source) and
    refuses the rest at once. An honest peer at the stranger's address (loopback: the same one) is refused
    there too, asks the next checker and is reachable; with only the jammed checker it is "unknown", and
    ``doctor`` says so (not "behind NAT")."""
    from gossiploco.runtime import doctor

    jam = JammedChecker(24)
    try:
        assert jam.answered == 22 and jam.service.stats.refused == {"per source": 22}
        port = free_ports(1)[0]
        found = check_reachability([jam.address, jam.other_address], port, timeout_s=5, host="127.0.0.1")
        assert found.reachable is True and found.address == f"tcp://127.0.0.1:{port}", found
        assert found.checker == jam.other_address.rsplit("/p2p/", 1)[1] and found.no_verdict == 1
        assert jam.service.stats.refused == {"per source": 23} and jam.service.limits.count == 2
        check = {c.name: c for c in doctor.check_reachability([jam.address], port, 5.0)}["reachability"]
        assert check.status == "warn" and check.detail.startswith("unknown (") and "too many requests" in check.detail
        assert "busy/unreachable)" in check.detail and "behind NAT" not in check.detail, check
    finally:
        jam.close()


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



@pytest.mark.slow
def test_a_tunnel_hands_its_connection_over_to_new_streams_before_the_relays_time_limit_byte_exactly():
    """A relay that cuts every stream after 5 s: a connection carrying bursts with quiet gaps (like
    exchanges between inner steps) moves to a new stream before each cut, and not one byte is lost.
    (A connection is handed over once quiet for a whole second past half the limit: between 2.5 s
    and 5 s there is always such a second when bursts come every 2.5 s.)"""
    from gossiploco.reach.tunnel import tunnel_stats

    carrier = Libp2pCarrier(2, relay_limits=(64 << 20, 5.0))
    server = socket.create_server(("127.0.0.1", carrier.ports[1]))
    received = bytearray()

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 16):
                received.extend(chunk)

    reader = threading.Thread(target=sink, daemon=True)
    reader.start()
    try:
        host, port = carrier.views[0][1].removeprefix("tcp://").split(":")
        sent = bytearray()
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            for burst in range(8):  # 8 bursts of 256 KiB, 2.5 s apart: 20 s, 4 relay limits
                data = bytes([burst]) * (256 << 10)
                conn.sendall(data)
                sent.extend(data)
                time.sleep(2.5)
        reader.join(timeout=20)
        assert bytes(received) == bytes(sent)
        client, target = (node.run_coroutine(tunnel_stats) for node in carrier.nodes[1:])
        relay = carrier.nodes[0].run_coroutine(tunnel_stats)
        assert client["renewed"] >= 3 and target["resumed"] == client["renewed"], (client, target)
        assert relay["limit_cuts"] == 0 and client["failed"] == 0, relay
    finally:
        server.close()
        carrier.close()


def test_deadlines_learned_from_direct_pairs_do_not_cut_exchanges_over_a_relay():
    from gossiploco.transport.deadlines import AdaptiveDeadlines

    deadlines = AdaptiveDeadlines(120.0, min_s=1.0, factor=4.0)
    for _ in range(3):
        deadlines.observe("mix2/0", 1.0)
    assert deadlines.deadline_s("mix2/1") == 4.0
    assert deadlines.deadline_s("mix2/1", "relayed") == 120.0  # nothing seen over a relay yet
    for _ in range(3):
        deadlines.observe("mix2/2", 9.0, "relayed")
    assert deadlines.deadline_s("mix2/3", "relayed") == 36.0 and deadlines.deadline_s("mix2/3") == 4.0
    assert path_class([0, 2], {2, 3}) == "" and path_class([2, 3], {2, 3}) == "relayed"
    assert path_class([0, 2, 1, 3], {2, 3}) == "" and path_class([0, 1, 2, 3], {2, 3}) == "relayed"  # the 2 -> 3 hop
    assert path_class([3, 0, 1, 2], {2, 3}) == "relayed" and path_class([2], {2}) == ""  # the 2 -> 3 wrap-around
    g = ZmqGroup(4, 10.0)
    try:
        ex = g.exchanges[0]
        ex.set_behind_nat({2, 3})  # what the exchange's deadlines then use
        assert ex.path_class([0, 2, 1, 3]) == "" and ex.path_class([0, 1, 2, 3]) == "relayed"
    finally:
        g.close()


def test_a_reverse_connection_that_never_comes_up_falls_back_to_the_relay_but_one_that_worked_stays():
    from gossiploco.membership.record import PeerRecord

    now = [0.0]
    relay = "/ip4/10.88.0.10/tcp/4100/p2p/12D3KooWR2vs2x1D1rzjgXzywmXTrDSDDai57ecyh9in4CVNiao4"
    nat = {p: PeerRecord(p, f"tcp://192.168.{p}.2:7000", 0, 0, reachable=False, p2p=relay.rsplit("/", 1)[1],
                         relays=(relay,)) for p in (5, 6)}
    ex = MemoryPaths(1)
    planner = PathPlanner(1, Reach(reachable=True), ex, run_in_node=lambda fn: 41000, reverse_wait_s=20.0,
                          clock=lambda: now[0])
    planner.sync(nat)
    assert ex.added[5][1] and ex.added[6][1]  # both offered a reverse connection
    ex.up.add(5)
    now[0] = 10.0
    planner.sync(nat)
    ex.up.discard(5)  # 5's connection drops later: a fault, not a reason to change its path
    now[0] = 25.0
    planner.sync(nat)
    assert ex.added[5] == ("tcp://192.168.5.2:7000", True, False)
    assert ex.added[6] == ("tcp://127.0.0.1:41000", False, True) and planner.fell_back == {6}
    assert planner.summary()["per_peer"] == {"5": "reverse", "6": "relayed"}


def test_the_planner_connects_each_pair_by_its_path_and_publishes_offers_only_when_they_change():
    """Path selection over ``MemoryPaths`` (the in-memory twin of the exchange's ``PathControl``)."""
    from gossiploco.membership.record import PeerRecord

    relay = "/ip4/10.88.0.10/tcp/4100/p2p/12D3KooWR2vs2x1D1rzjgXzywmXTrDSDDai57ecyh9in4CVNiao4"
    p2p = relay.rsplit("/", 1)[1]
    records = {1: PeerRecord(1, "tcp://10.0.0.1:7000", 0, 0),
               2: PeerRecord(2, "tcp://10.0.0.2:7000", 0, 0, joined=4),
               3: PeerRecord(3, "tcp://192.168.3.2:7000", 0, 0, reachable=False, p2p=p2p, relays=(relay,))}
    here = MemoryPaths(1)
    planner = PathPlanner(1, Reach(reachable=True), here, run_in_node=None)
    offers = planner.sync(records)
    assert here.added == {2: ("tcp://10.0.0.2:7000", False, False), 3: ("tcp://192.168.3.2:7000", True, False)}
    assert here.joined == {2: 4, 3: -1}  # each record's join round goes to the carrier (``PeerTable.add``)
    assert here.behind_nat == {3} and offers == here.reverse_offers() and [o[0] for o in offers] == [3]
    assert planner.sync(records) is None  # nothing changed: nothing to republish
    # Peer 3's side: behind NAT, it dials the ports peer 1 offers it, relays to no one without a DHT node.
    behind = MemoryPaths(3)
    nat_planner = PathPlanner(3, Reach(reachable=False), behind, run_in_node=None, topology_ring=False)
    seen_by_3 = {**records, 1: PeerRecord(1, "tcp://10.0.0.1:7000", 0, 0, reverse=offers),
                 4: PeerRecord(4, "tcp://192.168.4.2:7000", 0, 0, reachable=False, p2p=p2p, relays=(relay,))}
    nat_planner.sync(seen_by_3)
    assert behind.added[1] == ("tcp://10.0.0.1:7000", False, False)  # it dials the reachable peer
    assert behind.dialed == {1: tuple(f"tcp://10.0.0.1:{port}" for port in offers[0][1:])}  # 2 offers nothing
    assert 4 not in behind.added and nat_planner.unconnectable == {4}  # two NAT'd peers need a relay
    assert behind.order_rings is False and nat_planner.summary()["paths"] == {"direct": 2}


def test_a_peer_behind_nat_awaits_each_reachable_members_offer_until_it_is_read_or_the_reverse_wait_is_over():
    """What makes its paced directory reads come every period again (``membership.read_pacing``): an offer of a
    reverse connection is learnt from the offering member's record only."""
    from gossiploco.membership.record import PeerRecord

    now = [0.0]
    records = {1: PeerRecord(1, "tcp://10.0.0.1:7000", 0, 0), 2: PeerRecord(2, "tcp://10.0.0.2:7000", 0, 0)}
    behind = MemoryPaths(3)
    planner = PathPlanner(3, Reach(reachable=False), behind, run_in_node=None, reverse_wait_s=20.0,
                          clock=lambda: now[0])
    planner.sync(records)
    assert planner.awaiting_offers()  # neither has offered yet
    now[0] = 5.0
    offered = {**records, 1: PeerRecord(1, "tcp://10.0.0.1:7000", 0, 0, reverse=((3, 41001, 41002),))}
    planner.sync(offered)
    assert planner.awaiting_offers()  # peer 2's is still awaited
    now[0] = 20.0
    assert not planner.awaiting_offers()  # peer 2 relays to this peer by now: nothing more to wait for
    planner.sync(offered)
    assert not planner.awaiting_offers()  # not awaited anew (until it is forgotten and found again)
    reachable = PathPlanner(1, Reach(reachable=True), MemoryPaths(1), run_in_node=None)
    reachable.sync(records)
    assert not reachable.awaiting_offers()


def test_the_planner_forgets_a_peer_whose_record_is_gone_unless_it_is_still_connected():
    """A peer that left (tombstone) or died (record expired) is forgotten with its tunnel, so what a peer keeps
    is bounded by the run's members now; a connected one is kept (a read that missed its record)."""
    from gossiploco.membership.record import PeerRecord

    relay = "/ip4/10.88.0.10/tcp/4100/p2p/12D3KooWR2vs2x1D1rzjgXzywmXTrDSDDai57ecyh9in4CVNiao4"
    p2p = relay.rsplit("/", 1)[1]
    records = {1: PeerRecord(1, "tcp://192.168.1.2:7000", 0, 0, reachable=False, p2p=p2p, relays=(relay,)),
               2: PeerRecord(2, "tcp://10.0.0.2:7000", 0, 0),
               3: PeerRecord(3, "tcp://192.168.3.2:7000", 0, 0, reachable=False, p2p=p2p, relays=(relay,)),
               4: PeerRecord(4, "tcp://10.0.0.4:7000", 0, 0)}
    calls = []

    def run_in_node(fn):
        calls.append((fn.func.__name__, fn.keywords))
        return 40000 + len(calls) if fn.func.__name__ == "open_tunnel" else True

    here, now = MemoryPaths(1), [0.0]
    planner = PathPlanner(1, Reach(reachable=False), here, run_in_node=run_in_node, clock=lambda: now[0],
                          forget_after_s=30.0)
    planner.sync(records)
    assert sorted(here.added) == [2, 3, 4] and here.added[3][2] is True  # 3 through a relay
    here.up = {4}
    planner.sync({1: records[1]})  # 2, 3 and 4 gone from the directory (a read may miss records for a moment)
    now[0] = 29.0
    planner.sync({1: records[1], 2: records[2]})  # 2 was only missed by one read: seen again, it starts over
    assert sorted(here.added) == [2, 3, 4] and planner.summary()["forgotten"] == 0
    now[0] = 30.0
    planner.sync({1: records[1]})  # 3 and 4 missing for 30 s; 4 still connected; 2 missing for 0 s
    assert sorted(here.added) == [2, 4] and sorted(planner.paths) == [2, 4] and planner.summary()["forgotten"] == 1
    assert ("close_tunnel", {"peer_id": p2p}) in calls
    here.up = set()
    now[0] = 60.0
    planner.sync({1: records[1], 3: records[3]})  # 3 is back (a new process); 2 and 4 are now gone for good
    assert sorted(here.added) == [3] and sorted(planner.paths) == [3] and planner.summary()["forgotten"] == 3
    assert [name for name, _ in calls].count("open_tunnel") == 2  # a fresh tunnel for the new 3


@pytest.mark.parametrize("carrier", ["memory", "zmq"])
def test_path_control_conformance(carrier):
    """``MemoryPaths`` answers as ``ZmqExchange`` does (the twin stays true to the real one)."""
    from gossiploco.transport.zmq_exchange import ZmqExchange

    ex = MemoryPaths(0) if carrier == "memory" else ZmqExchange(0, {0: "tcp://127.0.0.1:0"}, "paths", 5.0)
    try:
        assert not ex.add_peer(0, "tcp://127.0.0.1:9")  # itself
        assert ex.add_peer(1, "tcp://127.0.0.1:9") and not ex.add_peer(1, "tcp://127.0.0.1:9")
        assert ex.reverse_offers() == ()
        assert ex.add_peer(2, "tcp://127.0.0.1:9", listen=True)  # a reverse connection: this peer listens for 2
        (peer, data, control), = ex.reverse_offers()
        assert peer == 2 and data > 0 and control > 0 and data != control
        assert ex.add_peer(2, "tcp://127.0.0.1:9")  # back to dialing it: the offer goes
        assert ex.reverse_offers() == ()
        assert ex.dial_reverse(3, ["tcp://127.0.0.1:9"]) and not ex.dial_reverse(3, ["tcp://127.0.0.1:9"])
        assert ex.dial_reverse(3, []) and ex.connected() == []
        ex.set_behind_nat({2, 3})
        assert ex.forget_peer(2) and not ex.forget_peer(2) and not ex.forget_peer(0) and not ex.forget_peer(5)
        assert ex.add_peer(2, "tcp://127.0.0.1:9")  # forgotten: connected anew when it comes back
    finally:
        if carrier == "zmq":
            ex.close()
