"""ZeroMQ exchange: group agreement, buckets and gossip pairing over real sockets, discovery, liveness (heartbeats, a
dead receiver thread, views that heal), in-place and large all-reduces.

Every call has a deadline of a few seconds, ports are random, sockets linger 0, and every exchange
is closed in teardown (the ``groups`` fixture, ``conftest.py``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zmq

from conftest import wait_until
from gossiploco.mixing import GlobalMix
from gossiploco.errors import ExchangeTimeout, PeerFailed
from gossiploco.transport.zmq_exchange import ZmqExchange
from tests.test_exchange import free_ports, run_all
from tests.test_zmq_exchange import _outcome


def test_group_agreement_gives_every_member_the_same_list_without_waiting(groups):
    g = groups(3, grace_s=5.0)
    start = time.monotonic()
    got = run_all([lambda r=r: g.exchanges[r].group("mix1/0", 0) for r in range(3)])
    assert got == [[0, 1, 2]] * 3
    assert time.monotonic() - start < 2.0, "all ready: nobody waits for the grace window"


@pytest.mark.slow  # seconds: the fast subset keeps its margin under 2 minutes
def test_a_straggler_is_left_out_after_the_grace_window_and_told_so(groups):
    g = groups(3, grace_s=0.5)
    ex = g.exchanges

    def late():
        threading.Event().wait(1.5)  # the straggler's compute: it is ready after the others decided
        return _outcome(lambda: ex[2].group("mix2/2", 2))

    start = time.monotonic()
    # (key "mix2/2": peer 0 leads it, ``protocol.groups.leader_of(0, "mix2/2", [0, 1, 2])``)
    got = run_all([lambda: ex[0].group("mix2/2", 2), lambda: ex[1].group("mix2/2", 2), late])
    assert got[0] == got[1] == [0, 1]
    assert isinstance(got[2], ExchangeTimeout) and "grace window" in str(got[2]), got[2]
    assert time.monotonic() - start < 3.0, "the straggler is told at once, not after its own deadline"
    # The two that agreed mix over exactly their list.
    out = run_all([lambda r=r: ex[r].all_reduce_mean("mix2/2", torch.full((8,), float(r)), got[r]) for r in (0, 1)])
    assert all(torch.equal(o, torch.full((8,), 0.5)) for o in out)


def test_peers_whose_views_name_different_leaders_never_mix_up():
    endpoints = dict(enumerate(f"tcp://127.0.0.1:{p}" for p in free_ports(3)))
    # Rank 2's view lacks rank 0 (it missed that rank 0 is back): it thinks rank 1 leads.
    views = [endpoints, endpoints, {r: e for r, e in endpoints.items() if r != 0}]
    ex = [ZmqExchange(r, views[r], "views", 10.0, grace_s=0.5) for r in range(3)]
    try:
        assert wait_until(lambda: ex[0].connected() == [1, 2] and ex[1].connected() == [0, 2] and ex[2].connected() == [1])
        assert ex[2].members(9) == [1, 2] and ex[0].members(9) == ex[1].members(9) == [0, 1, 2]
        # key "mix1/9": peer 0 leads it in a view of 0, 1, 2 and peer 1 in rank 2's view of 1, 2 (``groups.leader_of``)
        got = run_all([lambda r=r: _outcome(lambda: ex[r].group("mix1/9", 9)) for r in range(3)])
        assert got[0] == got[1] == [0, 1], got
        assert isinstance(got[2], PeerFailed) and "does not lead" in str(got[2]), got[2]
    finally:
        for e in ex:
            e.close()


@pytest.mark.slow  # seconds: the fast subset keeps its margin under 2 minutes
def test_a_leader_that_never_comes_costs_a_bounded_wait_and_then_fails_fast(groups):
    g = groups(3, grace_s=0.3)
    ex = g.exchanges
    start = time.monotonic()
    # (key "mix1/6": peer 0 leads it, ``groups.leader_of``)
    got = run_all([lambda r=r: _outcome(lambda: ex[r].group("mix1/6", 6)) for r in (1, 2)])
    assert all(isinstance(res, ExchangeTimeout) for res in got), got
    assert time.monotonic() - start < 3.0  # one window + the control-send allowance: the leader never said Leading
    # The late leader still sees their ``ready``s, but they abandoned the key: it goes on alone
    # (identity), and an exchange with them would fail at once.
    assert wait_until(lambda: ex[0].inspect(lambda node: node.aborted.get("mix1/6")) == {1, 2})
    assert ex[0].group("mix1/6", 6) == [0]
    start = time.monotonic()
    with pytest.raises(PeerFailed, match="abandoned"):
        ex[0].all_reduce_mean("mix1/6", torch.ones(10), [0, 1, 2])
    assert time.monotonic() - start < 2.0


def _two_strangers(run_id: str) -> tuple[dict[int, str], ZmqExchange, ZmqExchange]:
    """Peers 3 and 11 on free ports, each knowing only itself: (their endpoints, 3's exchange, 11's)."""
    endpoints = {r: f"tcp://127.0.0.1:{p}" for r, p in zip((3, 11), free_ports(2))}
    return (endpoints, ZmqExchange(3, {3: endpoints[3]}, run_id, 10.0, grace_s=2.0),
            ZmqExchange(11, {11: endpoints[11]}, run_id, 10.0, grace_s=2.0))


def test_a_discovered_peer_is_probed_and_joins_the_group():
    endpoints, a, b = _two_strangers("test-discovery")
    try:
        assert a.members(0) == [3] and a.known() == [3]
        assert a.add_peer(11, endpoints[11]) and not a.add_peer(11, endpoints[11])
        assert b.add_peer(3, endpoints[3])
        assert wait_until(lambda: a.members(0) == [3, 11] and b.members(0) == [3, 11], 10.0)
        got = run_all([lambda: a.group("mix1/0", 0), lambda: b.group("mix1/0", 0)])
        assert got == [[3, 11], [3, 11]]
        out = run_all([lambda: a.all_reduce_mean("mix1/0", torch.zeros(5), got[0]),
                       lambda: b.all_reduce_mean("mix1/0", torch.full((5,), 2.0), got[1])])
        assert all(torch.equal(o, torch.ones(5)) for o in out)
    finally:
        a.close()
        b.close()


@pytest.mark.slow  # 1.4-2.7 s: in the slow set, so that the fast subset keeps its margin under 2 minutes
def test_an_idle_receiving_thread_sleeps_and_new_work_wakes_it_at_once(monkeypatch):
    """Idle, the receiving thread sleeps in its poll (which covers every connection's monitor: a cost growing with
    the peers) instead of waking ten times a second; a peer added, or a close, wakes it at once. Its idle sleep is
    made 10 s here, so that a missed wake-up shows as seconds, whatever the machine's load."""
    from gossiploco.transport import zmq_receiver

    monkeypatch.setattr(zmq_receiver, "IDLE_POLL_MS", 10_000)
    endpoints, a, b = _two_strangers("test-wake")
    try:
        receiving = a._receiver_work  # noqa: SLF001 - the thread's poll count is what is under test
        wait_until(lambda: receiving.polls > 0, 5.0)
        before = receiving.polls
        time.sleep(2.0)  # nothing to do: what it does meanwhile is what is measured
        assert receiving.polls - before <= 1, f"{receiving.polls - before} polls in 2 s of idling"
        added = time.monotonic()
        assert a.add_peer(11, endpoints[11]) and b.add_peer(3, endpoints[3])
        assert wait_until(lambda: a.members(0) == [3, 11] and b.members(0) == [3, 11], 20.0)
        assert time.monotonic() - added < 5.0, "adding a peer must wake the thread, not wait for its next poll"
    finally:
        closing = time.monotonic()
        a.close()
        b.close()
    assert time.monotonic() - closing < 5.0, "closing must wake the thread, not wait for its next poll"


def test_adaptive_deadlines_follow_observed_durations():
    from gossiploco.transport.deadlines import AdaptiveDeadlines

    d = AdaptiveDeadlines(100.0, min_s=2.0, factor=4.0, window=3, warmup=2)
    assert d.deadline_s("mix1/0") == 100.0  # nothing seen yet: the configured maximum
    d.observe("mix1/0", 1.0)
    assert d.deadline_s("mix1/1") == 100.0
    d.observe("mix1/1", 3.0)
    assert d.deadline_s("mix1/2") == 12.0 and d.deadline_s("mix2/2") == 100.0  # kinds are separate
    for _ in range(3):
        d.observe("mix1/x", 0.1)
    assert d.deadline_s("mix1/9") == 2.0  # the slow one left the window; never below min_s
    for _ in range(3):
        d.observe("mix1/x", 60.0)
    assert d.deadline_s("mix1/9") == 100.0  # never above the maximum


def test_state_chunks_carry_a_hash_and_a_corrupted_chunk_is_refused(groups, monkeypatch):
    from gossiploco.protocol import collectives

    g = groups(2, chunk_bytes=1024, max_message_bytes=1 << 20)
    donor, newcomer = g.exchanges
    state = torch.randn(3000)
    donor.serve_state(lambda: (4, state))
    round_index, got = newcomer.fetch_state(0)
    assert round_index == 4 and torch.equal(got, state)
    real = collectives.chunk_hash
    calls = []

    def lying_hash(chunk):  # the donor labels its third chunk with a wrong hash
        calls.append(1)
        return real(chunk) + (1 if len(calls) == 3 else 0)

    monkeypatch.setattr(collectives, "chunk_hash", lying_hash)
    with pytest.raises(PeerFailed, match="hash check"):
        newcomer.fetch_state(0)


def test_a_leaving_peer_is_dropped_at_once_not_after_a_deadline(groups):
    g = groups(3, timeout_s=30.0)
    ex = g.exchanges
    assert ex[0].members(0) == [0, 1, 2]
    ex[2].leave(linger_s=0.2)
    assert wait_until(lambda: ex[0].members(1) == [0, 1] and ex[1].members(1) == [0, 1], 3.0)
    start = time.monotonic()
    with pytest.raises(PeerFailed):
        ex[0].all_reduce_mean("mix1/1", torch.ones(4), [0, 1, 2])  # a stale list fails fast
    assert time.monotonic() - start < 3.0


def test_reachability_check_tells_a_listening_endpoint_from_a_dead_one():
    good = ZmqExchange(0, {0: "tcp://127.0.0.1:0"}, "reach", 5.0)
    port = free_ports(1)[0]
    bad = ZmqExchange(0, {0: f"tcp://127.0.0.1:{port}"}, "reach", 5.0, bind="tcp://127.0.0.1:0")
    try:
        assert not good.endpoints[0].endswith(":0")  # the OS-picked port is what peers are told
        assert good.check_reachable(3.0)
        assert not bad.check_reachable(0.5)  # advertised somewhere nothing listens
    finally:
        good.close()
        bad.close()


def test_heartbeat_timeout_comes_from_the_config_for_slow_links():
    ex = ZmqExchange(0, {0: "tcp://127.0.0.1:0"}, "hb", 5.0, heartbeat_s=30.0)
    try:
        ex.add_peer(1, "tcp://127.0.0.1:1")
        assert ex.sockets.dealers[1][0].getsockopt(zmq.HEARTBEAT_TIMEOUT) == 30000
        assert ex.sockets.dealers[1][0].getsockopt(zmq.HEARTBEAT_IVL) == 10000  # a PING every third of the timeout
        # the ROUTER has no ZMTP heartbeat (libzmq aborts on it, see zmq_sockets); TCP keepalive instead
        assert ex.sockets.router.getsockopt(zmq.HEARTBEAT_IVL) == 0
        assert ex.sockets.router.getsockopt(zmq.TCP_KEEPALIVE) == 1
    finally:
        ex.close()


def test_a_heartbeat_pings_every_third_of_its_timeout_and_never_more_than_once_a_second():
    from gossiploco.transport.zmq_send import heartbeat

    ctx = zmq.Context()
    try:
        for timeout_ms, ivl_ms in ((5000, 1666), (30000, 10000), (20000, 6666), (1500, 1000), (500, 1000)):
            sock = ctx.socket(zmq.DEALER)
            heartbeat(sock, timeout_ms)
            assert (sock.getsockopt(zmq.HEARTBEAT_IVL), sock.getsockopt(zmq.HEARTBEAT_TIMEOUT)) == (ivl_ms, timeout_ms)
            sock.close(0)
    finally:
        ctx.term()


def test_inplace_all_reduce_reduces_in_the_callers_buffer_and_matches_the_copying_one(groups):
    g = groups(3, chunk_bytes=4096)
    values = [torch.randn(20_001, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    copied = run_all([lambda r=r: g.exchanges[r].all_reduce_mean("a/0", values[r], [0, 1, 2]) for r in range(3)])
    given = [v.clone() for v in values]
    inplace = run_all([lambda r=r: g.exchanges[r].all_reduce_mean("a/1", given[r], [0, 1, 2], inplace=True)
                       for r in range(3)])
    for r in range(3):
        assert torch.equal(inplace[r], copied[r])  # same bits as the copying path
        assert inplace[r].data_ptr() == given[r].data_ptr()  # no second buffer
        assert not torch.equal(values[r], copied[r])  # the copying path left its input alone


def test_all_finite_checks_every_chunk():
    from gossiploco.tensor_checks import all_finite

    flat = torch.zeros(10_000)
    assert all_finite(flat, chunk=1000)
    flat[9_999] = float("nan")
    assert not all_finite(flat, chunk=1000)
    assert not all_finite(torch.tensor([0.0, float("inf")], dtype=torch.float64))


def test_an_advertised_address_with_port_zero_gets_the_bound_port():
    ex = ZmqExchange(7, {7: "tcp://127.0.0.1:0"}, "adv", 5.0, bind="tcp://0.0.0.0:0")
    try:
        host, port = ex.endpoints[7].rsplit(":", 1)
        assert host == "tcp://127.0.0.1" and int(port) > 0  # the advertised host, the OS-picked port
        assert ex.check_reachable(3.0)
    finally:
        ex.close()


def test_views_heal_when_a_connection_comes_back(groups):
    g = groups(3)
    ex0, ex1 = g.exchanges[0], g.exchanges[1]
    g.crash(2)
    assert wait_until(lambda: ex0.members() == [0, 1] and ex1.members() == [0, 1])
    # A peer that comes back still taking part from round 0 (as one whose connections dropped
    # while it kept running): the others probe it on the handshake and re-admit it, no announce.
    g.exchanges[2] = ZmqExchange(2, g.endpoints, g.run_id, g.timeout_s, **g.options)
    assert wait_until(lambda: ex0.members(0) == [0, 1, 2] and ex1.members(0) == [0, 1, 2], 10.0)


def test_a_leader_still_starting_up_keeps_the_ready_it_gets_early():
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    # Rank 0 has not decided when it takes part (its runtime is still starting, as ``NetworkPeer`` builds
    # it); rank 1 knows it from the static list, so it takes rank 0 for the leader.
    ex0 = ZmqExchange(0, endpoints, "early", 10.0, grace_s=5.0, join_round=None)
    ex1 = ZmqExchange(1, endpoints, "early", 10.0, grace_s=5.0)
    try:
        assert ex0.wait_connected(10.0) and ex1.wait_connected(10.0)
        assert ex0.members(0) == [0] and ex1.members(0) == [0, 1]
        with ThreadPoolExecutor(max_workers=1) as pool:
            follower = pool.submit(ex1.group, "mix1/0", 0)
            assert wait_until(lambda: ex0.inspect(lambda node: "mix1/0" in node.ready))  # kept, not answered "not leading"
            ex0.announce(0)
            assert ex0.group("mix1/0", 0) == [0, 1]
            assert follower.result(timeout=10) == [0, 1]
    finally:
        ex0.close()
        ex1.close()


def test_a_dead_receiver_thread_breaks_the_exchange_loudly(groups, monkeypatch, caplog):
    """Never silent identity: a crashed driver thread makes every later call raise ExchangeBroken."""
    from gossiploco.errors import ExchangeBroken
    from gossiploco.transport import zmq_receiver

    g = groups(2, timeout_s=20.0)
    ex = g.exchanges[0]

    real = zmq_receiver.from_wire
    receiver_0 = next(t for t in ex.threads if t.name.endswith("-recv"))

    def explode(header, tensors):  # rank 0's receiver only: rank 1 stays healthy (its disconnect would race the test)
        if threading.current_thread() is receiver_0:
            raise RuntimeError("bug in the receive path")
        return real(header, tensors)

    monkeypatch.setattr(zmq_receiver, "from_wire", explode)  # an error validation does not expect: the thread dies
    with pytest.raises(ExchangeBroken, match="receiver thread died"):
        run_all([lambda: ex.swap("s/1", 1, torch.ones(3)), lambda: g.exchanges[1].swap("s/1", 0, torch.ones(3))])
    assert any("receiver thread died" in r.message for r in caplog.records if r.levelname == "CRITICAL")
    with pytest.raises(ExchangeBroken):
        ex.group("mix1/0", 0)


@pytest.mark.slow
def test_a_large_payload_all_reduce_over_four_peers_never_stalls(groups):
    """Hundreds of MB per peer (the 125m model's Mix2 is 510 MB): every round completes, exactly,
    far within its deadline, at a rate recorded in the output (loopback, 4 peers in one process)."""
    import time

    g = groups(4, timeout_s=120.0)
    n = 64 << 20  # 256 MB of float32 per peer
    values = [torch.full((n,), float(r)) for r in range(4)]
    for round_index in range(2):
        start = time.monotonic()
        out = run_all([lambda r=r: g.exchanges[r].all_reduce_mean(f"mix2/{round_index}", values[r], [0, 1, 2, 3])
                       for r in range(4)])
        took = time.monotonic() - start
        assert all(o[0].item() == 1.5 and o[-1].item() == 1.5 and o.shape == (n,) for o in out)
        print(f"round {round_index}: 256 MB per peer all-reduced in {took:.2f}s ({256 / took:.0f} MB/s per peer)")
        assert took < 60, f"a 256 MB all-reduce took {took:.1f}s: stalled"
    assert max(ex.protocol_state()["mailbox_bytes"] for ex in g.exchanges) == 0


def test_a_peer_that_knows_others_but_reaches_none_fails_its_mixes_as_isolated():
    """A group of one is a mix only for a swarm of one: a peer cut off from the peers it knows (its relays
    refused, say) fails every exchange with the cause, counted, instead of "mixing" alone."""
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]  # peer 1 never starts
    alone = ZmqExchange(0, endpoints, "run-isolated", timeout_s=0.5, grace_s=0.5)
    try:
        mixer = GlobalMix("mix1", ["w"], 0)
        result = mixer.mix([{"w": torch.ones(4)}], 0, alone)
        assert not result.ok and "isolated: 1 known peer(s) unreachable (1)" in result.cause
        assert alone.isolated_mixes == 1
    finally:
        alone.close()


def test_a_large_view_exchanges_in_buckets_over_real_sockets(groups):
    """The buckets of ``protocol.groups`` on the real transport: six peers, group size 2 (four buckets): every
    peer's agreed group is its whole bucket, nobody waits for a peer of another bucket, and a Mix1 is the bucket's
    exact mean."""
    from gossiploco.protocol.groups import group_of
    g = groups(6, grace_s=5.0)
    for ex in g.exchanges:
        ex.set_grouping(11, 2)
    start = time.monotonic()
    got = run_all([lambda r=r: g.exchanges[r].group("mix1/3", 3) for r in range(6)])
    assert time.monotonic() - start < 2.0, "all ready: nobody waits for the grace window"
    for r in range(6):
        assert sorted(got[r]) == group_of(11, "mix1/3", list(range(6)), r, 2)
    assert len({tuple(sorted(x)) for x in got}) > 1  # split into several buckets
    values = [torch.full((5,), float(r)) for r in range(6)]
    out = run_all([lambda r=r: g.exchanges[r].all_reduce_mean("mix1/3", values[r], got[r]) if len(got[r]) > 1
                   else values[r] for r in range(6)])
    for r in range(6):
        assert torch.equal(out[r], torch.full((5,), sum(got[r]) / len(got[r])))


def test_gossip_pairs_members_as_they_come_over_real_sockets(groups):
    """``[groups] pairing = "ready"`` on the real transport: the leader of a gossip exchange pairs each member with
    the next one ready. Members that come together are paired at once while the slowest one is still computing
    (nobody waits for it: no grace window), the slow one is then paired with the last one left, or does identity,
    and every pair swaps exactly."""
    g = groups(5, grace_s=5.0)
    for ex in g.exchanges:
        ex.set_grouping(11, 16, {"mix2"})
    key = "mix2/4"
    from gossiploco.protocol.groups import leader_of
    slow = next(p for p in range(5) if p != leader_of(11, key, range(5)))  # a follower that comes late
    release = threading.Event()

    def member(r: int) -> tuple[list[int], float]:
        if r == slow:
            release.wait(10.0)
        began = time.monotonic()
        return g.exchanges[r].group(key, 4), time.monotonic() - began

    with ThreadPoolExecutor(max_workers=5) as pool:
        early = {r: pool.submit(member, r) for r in range(5) if r != slow}
        paired = [r for r, f in early.items() if len(f.result(timeout=10.0)[0]) == 2]
        assert len(paired) >= 2, {r: f.result() for r, f in early.items()}  # paired while the slow one computes
        assert all(early[r].result()[1] < 2.0 for r in paired), "a paired member waited for the slow one"
        release.set()
        late = pool.submit(member, slow).result(timeout=15.0)
    groups_by_member = {r: f.result()[0] for r, f in early.items()} | {slow: late[0]}
    for r, group in groups_by_member.items():
        assert r in group and all(groups_by_member[m] == group for m in group), groups_by_member  # mutual
    values = [torch.full((7,), float(r)) for r in range(5)]
    out = run_all([lambda r=r: g.exchanges[r].swap(key, next(m for m in groups_by_member[r] if m != r),
                                                  values[r].clone())
                   if len(groups_by_member[r]) == 2 else values[r] for r in range(5)])
    for r in range(5):
        group = groups_by_member[r]
        if len(group) == 2:
            assert torch.equal(out[r], values[next(m for m in group if m != r)])  # the partner's vector


def test_a_process_starting_far_into_the_others_round_waits_for_its_end_and_takes_the_next_rounds_state(groups, caplog):
    """Over real ZeroMQ: the members' answers say how long ago they began their round (``Hello.began_ms_ago``, from
    ``current_round``'s setter); a process starting past ``late_join_s`` into it takes no part in it (its Mix2 would
    come that much after theirs) but waits for the boundary and downloads the next round's state."""
    from gossiploco.protocol import lifecycle

    g = groups(3)
    a, b, _ = g.exchanges
    state = torch.arange(6, dtype=torch.float32)
    for member in (a, b):
        member.current_round = 0
        member.serve_state(lambda: (1, state))
    began = time.monotonic()
    joiner = g.restart(2)
    assert joiner.wait_connected(10.0)
    life = lifecycle.Settings(rounds=5, hello_s=2.0, connect_s=2.0, boundary_s=20.0, state_s=10.0, state_size=6,
                              nonce=lambda: f"n{time.monotonic_ns()}", late_join_s=0.05)
    assert wait_until(lambda: time.monotonic() - began > 0.1, 1.0)  # the others' round is 0.1 s along: too far
    with caplog.at_level("INFO", logger="gossiploco"), ThreadPoolExecutor(1) as pool:
        joining = pool.submit(joiner.join_swarm, life, 0, 1, None)
        assert wait_until(lambda: "began round 0" in caplog.text, 10.0), "it did not see the round was far along"
        assert not joining.done()  # waiting for the boundary, not training round 0
        for member in (a, b):
            member.current_round = 1
        position = joining.result(timeout=20.0)
    assert position.round == 1 and torch.equal(position.state, state) and position.fresh_join
    assert joiner.members(1) == [0, 1, 2] and 2 not in a.members(0)
