"""The relay against strangers and greedy members: who may ask (members of the run, to members of the run),
per-asker and total slots, idle cuts, and length prefixes checked before anything is read.

The slow tests run a real relay DHT node, member DHT nodes with sealed records (``testbed.members``)
and an outsider's bare hivemind node (``testbed.outsider``), all on loopback."""

from __future__ import annotations

import asyncio
import socket
from functools import partial

import msgpack
import pytest

from gossiploco.membership.relay_admission import RunMembers, proof_of
from gossiploco.reach.relay import RELAY_PROTOCOL, TUNNEL_PROTOCOL, Refused, parse_request
from gossiploco.reach.streams import splice
from gossiploco.reach.tunnel import tunnel_stats
from testbed.sink import Sink
from gossiploco.security.swarm_key import SwarmKey
from testbed.outsider import memory_kib
from testbed.processes import wait_until
from testbed.stream_outsider import announce_huge_frame, ask_relay, hold_splices, release_splices


@pytest.mark.parametrize("raw", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"target": "x"}),
                                 msgpack.packb({"target": 1, "run": "r", "proof": b""}),
                                 msgpack.packb({"target": "x", "run": "r", "proof": b"", "more": 1})])
def test_a_malformed_relay_request_is_refused(raw):
    with pytest.raises(Refused, match="^malformed"):
        parse_request(raw)


def test_without_the_swarm_keys_proof_nothing_is_looked_up():
    swarm = SwarmKey.generate()
    members = RunMembers(swarm)
    asker = "12D3KooWR2vs2x1D1rzjgXzywmXTrDSDDai57ecyh9in4CVNiao4"
    for proof in (b"", proof_of(SwarmKey.generate(), asker), proof_of(swarm, asker[:-1] + "5")):
        refusal = asyncio.run(members.refuse(None, asker=asker, target="t", run="run", proof=proof))
        assert refusal.startswith("not a member: no proof"), refusal
    assert members.reads == 0  # node=None: any read would have failed loudly
    assert members.proof("run", asker) == proof_of(swarm, asker) and RunMembers(None).proof("run", asker) == b""


def test_a_splice_is_cut_when_idle_or_past_its_bytes_and_ends_with_its_ends():
    async def pair_of_pairs():
        accepted: asyncio.Queue = asyncio.Queue()
        server = await asyncio.start_server(lambda r, w: accepted.put_nowait((r, w)), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ends = []
        for _ in range(2):
            near = await asyncio.open_connection("127.0.0.1", port)
            ends.append((near, await accepted.get()))
        server.close()
        return ends  # [(client side, server side)] x 2; the splice joins the server sides

    async def scenario(kind: str) -> tuple[str, bytes]:
        (a, a_far), (b, b_far) = await pair_of_pairs()
        task = asyncio.ensure_future(splice(a_far, b_far, data_limit=1000, idle_limit=0.2))
        got = b""
        if kind == "data":
            a[1].write(b"x" * 5000)
            await a[1].drain()
        if kind == "ended":
            a[1].write(b"hello")
            await a[1].drain()
            got = await b[0].readexactly(5)
            a[1].close()
        why = await asyncio.wait_for(task, 5)
        for end in (a, b):
            end[1].close()
        return why, got

    assert asyncio.run(scenario("idle"))[0] == "idle"
    assert asyncio.run(scenario("data"))[0] == "data"
    assert asyncio.run(scenario("ended")) == ("ended", b"hello")


PER_ASKER = 4


@pytest.fixture(scope="module")
def private_run():
    """A relay of a private run (4 relayed connections per asker), members a, b, c behind NAT (c serves a
    tunnel to a sink), and an outsider's bare hivemind node joined to the relay."""
    from testbed.members import MemberNode, relay_address, relay_node
    from testbed.outsider import outsider_dht

    swarm, run = SwarmKey.generate(), "relay-test"
    relay = relay_node(swarm, relay_limits=(64 << 20, 60.0, 60.0, PER_ASKER, 256))
    address = relay_address(relay)
    members, nodes = [], [relay]
    try:
        for _ in range(3):
            members.append(MemberNode(swarm, run, address))
            nodes.append(members[-1].dht)
        outsider = outsider_dht(address)
        nodes.append(outsider)
        sink = Sink()
        members[2].serve_tunnel(sink.port)
        yield dict(swarm=swarm, run=run, relay=relay, address=address, a=members[0], b=members[1], c=members[2],
                   outsider=outsider, sink=sink)
    finally:
        for node in nodes:
            node.shutdown()


def refusals(node) -> dict:
    return node.run_coroutine(tunnel_stats)["refusals"]


@pytest.mark.slow
def test_the_relay_splices_only_members_of_the_run_to_members_of_the_run(private_run):
    r = private_run
    a, c, outsider, address, run, swarm = r["a"], r["c"], r["outsider"], r["address"], r["run"], r["swarm"]
    stranger = outsider.peer_id.to_base58()

    def ask(node, target, proof=None):
        return node.run_coroutine(partial(ask_relay, relay=address, target=target, run=run, proof=proof))

    before = refusals(r["relay"])
    assert ask(outsider, c.p2p, b"").startswith("not a member: no proof")
    assert ask(outsider, c.p2p, proof_of(swarm, a.p2p)).startswith("not a member: no proof")  # a's proof, copied
    # a swarm-key holder that never announced itself in the run (a stranger cannot make this proof):
    assert ask(outsider, c.p2p, proof_of(swarm, stranger)).startswith("not a member: no valid record")
    assert ask(a.dht, stranger).startswith("unknown target")  # a member cannot make it a proxy to a non-member
    assert ask(a.dht, c.p2p) == "ok"
    after = refusals(r["relay"])
    assert after.get("not a member", 0) - before.get("not a member", 0) == 3, after
    assert after.get("unknown target", 0) - before.get("unknown target", 0) == 1, after
    # the stranger, dialing the member's tunnel handler directly, is not served either
    served = c.dht.run_coroutine(tunnel_stats)["served"]
    said = outsider.run_coroutine(partial(announce_huge_frame, address=c.dht_address, protocol=TUNNEL_PROTOCOL,
                                          header=b"GLT1" + b"\0" * 8, send_bytes=1 << 16, send_s=2.0))
    assert refusals(c.dht).get("tunnel not from a relay") == 1, said
    assert c.dht.run_coroutine(tunnel_stats)["served"] == served


@pytest.mark.slow
def test_a_slot_flood_by_one_member_leaves_another_members_tunnel_open(private_run):
    r = private_run
    a, b, c, address, sink = r["a"], r["b"], r["c"], r["address"], r["sink"]
    try:
        statuses = a.dht.run_coroutine(partial(hold_splices, relay=address, target=c.p2p, count=PER_ASKER + 6))
        assert statuses.count("ok") == PER_ASKER, statuses
        assert all(s.startswith("asker limit") for s in statuses if s != "ok"), statuses
        assert wait_until(lambda: len(sink.received) >= PER_ASKER, 10)  # the flood's streams are held at c
        port = b.open_tunnel(c, address)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"through the flood")
            assert wait_until(lambda: any(bytes(d) == b"through the flood" for d in sink.received), 10)
    finally:
        a.dht.run_coroutine(release_splices)


@pytest.mark.slow
def test_a_terabyte_length_prefix_is_refused_before_anything_is_read(private_run):
    r = private_run
    relay, outsider, address = r["relay"], r["outsider"], r["address"]
    said = outsider.run_coroutine(partial(announce_huge_frame, address=address, protocol=RELAY_PROTOCOL,
                                          send_bytes=0))
    assert said["answer"].startswith("malformed: a frame of 1099511627776 bytes announced"), said
    rss = memory_kib(relay.pid, "VmRSS")
    flood = outsider.run_coroutine(partial(announce_huge_frame, address=address, protocol=RELAY_PROTOCOL,
                                           send_bytes=64 << 20, send_s=5.0))
    assert flood["cut_off"] or flood["sent"] < (64 << 20), flood
    assert memory_kib(relay.pid, "VmRSS") - rss < 16 << 10, (rss, memory_kib(relay.pid, "VmRSS"), flood)


@pytest.mark.slow
def test_a_tunnel_counts_a_target_the_relay_cannot_reach_apart_from_relays_that_fail(private_run):
    """A relay that answers "unknown target" (a peer that left the run: no valid record names it) works: that
    session counts as unreachable, not as a relay failure. A relay nobody can connect to is a failure."""
    from gossiploco.reach.tunnel import open_tunnel

    r = private_run
    b, address, outsider = r["b"], r["address"], r["outsider"]
    gone = outsider.peer_id.to_base58()  # a libp2p id no record of the run names
    dead_relay = f"/ip4/127.0.0.1/tcp/1/p2p/{gone}"  # nothing listens on port 1
    before = b.dht.run_coroutine(tunnel_stats)
    cases = (([address], "unreachable"), ([dead_relay], "failed"), ([dead_relay, address], "unreachable"))
    for relays, counter in cases:
        port = b.dht.run_coroutine(partial(open_tunnel, peer_id=gone, relays=relays))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.settimeout(30)
            assert conn.recv(1) == b""  # the tunnel closes the connection: nobody to carry it to
        after = b.dht.run_coroutine(tunnel_stats)
        moved = sum(after[k] - before[k] for k in ("failed", "unreachable"))
        assert after[counter] == before[counter] + 1 and moved == 1, (relays, before, after)
        before = after
