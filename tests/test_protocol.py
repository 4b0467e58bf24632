"""The sans-I/O protocol on its own: no sockets, threads or clocks; messages passed by hand."""

from __future__ import annotations

import pytest
import torch

from gossiploco.errors import MalformedMessage, PeerFailed
from gossiploco.protocol.agreement import Follow
from gossiploco.protocol.groups import leader_of
from gossiploco.protocol.collectives import RingAllReduce, Swap
from gossiploco.protocol.mailbox import Mailbox
from gossiploco.protocol.messages import (Abort, Data, Decision, Hello, Leading, Ready, Send, StateRequest, from_wire,
                                          to_wire)
from gossiploco.protocol.node import PeerNode
from gossiploco.protocol.ring import ring_steps


def _nodes(n: int, **options) -> list[PeerNode]:
    return [PeerNode(r, range(n), grace_s=1.0, chunk_elems=options.get("chunk_elems", 5), mailbox_bytes=1 << 20)
            for r in range(n)]


def _run_ring(values: list[torch.Tensor], chunk_elems: int) -> list[torch.Tensor]:
    """Every member's ring machine, messages delivered in FIFO order by hand (no network)."""
    n = len(values)
    nodes = _nodes(n, chunk_elems=chunk_elems)
    calls = [RingAllReduce("mix1/0", r, list(range(n)), values[r].clone(), chunk_elems, 0.0, 10.0) for r in range(n)]
    queue: list[tuple[int, Send]] = []
    for r in range(n):
        queue += [(r, s) for s in calls[r].start(nodes[r])]
    while queue:
        src, send = queue.pop(0)
        nodes[send.peer].receive(src, send.message, 0.0)
        call, node = calls[send.peer], nodes[send.peer]
        while True:
            step = call.poll(node, 0.0)
            if step.mail is None:
                break
            queue += [(send.peer, s) for s in call.feed(step.mail)]
    assert all(c.poll(node, 0.0).done for c, node in zip(calls, nodes))
    return [c.outcome() for c in calls]


@pytest.mark.parametrize("n, total, chunk", [(2, 7, 3), (3, 10_007, 250), (5, 64, 1), (8, 100, 64)])
def test_the_ring_gives_every_member_the_mean_eq7(n, total, chunk):
    values = [torch.randn(total, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    # Paper eq. (7) with W = (1/M) 1 1^T: every worker gets x_m <- sum_n (1/M) x_n.
    W = torch.full((n, n), 1.0 / n, dtype=torch.float64)
    reference = (W @ torch.stack([v.double() for v in values]))[0].float()
    out = _run_ring(values, chunk)
    for o in out:
        assert torch.allclose(o, reference, atol=1e-6)
        assert torch.equal(o, out[0])  # each segment was summed once: every member has the same bits


@pytest.mark.parametrize("n, total, chunk", [(2, 7, 3), (3, 10_007, 250), (5, 64, 1), (4, 100, 9)])
def test_the_ring_mean_is_each_segments_float32_sum_in_ring_order_divided_once(n, total, chunk):
    """Bit for bit: segment k is summed along the ring from member k, ((x_k + x_k+1) + x_k+2) + ..., in float32, and
    divided by n once, by the member that completes it (the all-gather carries means, not sums)."""
    values = [torch.randn(total, generator=torch.Generator().manual_seed(10 + r)) for r in range(n)]
    bounds = [total * k // n for k in range(n + 1)]
    reference = torch.empty(total)
    for k in range(n):
        seg = slice(bounds[k], bounds[k + 1])
        acc = values[k][seg].clone()
        for j in range(1, n):
            acc = acc + values[(k + j) % n][seg]
        reference[seg] = acc / n
    for o in _run_ring(values, chunk):
        assert torch.equal(o, reference)


def test_the_ring_schedule_sends_each_segment_once_per_phase():
    n = 5
    for me in range(n):
        steps = ring_steps(n, me)
        assert len(steps) == 2 * (n - 1)
        assert sorted(s.send_segment for s in steps[: n - 1]) == sorted((me - s) % n for s in range(n - 1))
        assert all(s.reduce for s in steps[: n - 1]) and not any(s.reduce for s in steps[n - 1:])
        assert steps[n - 2].recv_segment == (me + 1) % n  # after reduce-scatter it holds the sum of segment me + 1


def test_a_chunk_from_a_peer_that_is_not_the_partner_is_refused_at_once():
    node = _nodes(4)[1]
    swap = Swap("mix2/3", 1, 2, torch.ones(4), 5, 0.0, 10.0)
    swap.start(node)
    actions = node.receive(3, Data("mix2/3", 0, (4, 0, 1), torch.zeros(4)), 0.1)
    assert actions == [Send(3, Abort("mix2/3"))]  # peer 3 learns at once that 1 is not its partner
    assert node.receive(3, Data("mix2/3", 1, (4, 0, 1), torch.zeros(4)), 0.2) == []  # told once
    assert node.mailbox.senders("mix2/3") == set()


def test_early_chunks_from_strangers_are_refused_when_the_call_starts():
    node = _nodes(4)[0]
    node.receive(3, Data("mix2/0", 0, (4, 0, 0), torch.zeros(4)), 0.0)
    node.receive(2, Data("mix2/0", 0, (4, 0, 0), torch.zeros(4)), 0.0)
    sends = Swap("mix2/0", 0, 2, torch.ones(4), 5, 0.0, 10.0).start(node)
    assert Send(3, Abort("mix2/0")) in sends and node.mailbox.senders("mix2/0") == {2}


@pytest.mark.parametrize("early", [False, True])
def test_a_member_running_the_all_reduce_over_another_list_fails_it_saying_so(early):
    """Ranks 0 and 1 run it over [0, 1, 2], rank 2 over [1, 2] (it missed that 0 is back). Rank 2's first chunk goes to
    rank 1, which expects chunks only from its left (0): refused, whether it came before or after the call began.
    Rank 1's call must fail at once naming the cause, even if rank 2's answer to the refusal (an Abort) came too."""
    node = _nodes(3)[1]
    ring = RingAllReduce("mix1/3", 1, [0, 1, 2], torch.ones(30), 5, 0.0, 10.0)
    stray = RingAllReduce("mix1/3", 2, [1, 2], torch.ones(30), 5, 0.0, 10.0).start(_nodes(3)[2])
    assert stray[0].peer == 1
    if early:
        node.receive(2, stray[0].message, 0.0)
    sends = ring.start(node)
    if not early:
        sends = node.receive(2, stray[0].message, 0.1)
    assert Send(2, Abort("mix1/3")) in sends
    node.receive(2, Abort("mix1/3"), 0.2)
    step = ring.poll(node, 0.3)
    assert isinstance(step.error, PeerFailed) and "[2] run this exchange over another member list" in str(step.error)
    assert {s.peer for s in step.sends} == {0, 2}  # both other members learn at once


def test_a_stranger_chunk_over_another_list_does_not_fail_a_call_it_is_not_part_of():
    node = _nodes(4)[0]
    ring = RingAllReduce("mix1/3", 0, [0, 1], torch.ones(10), 5, 0.0, 10.0)
    ring.start(node)
    node.receive(3, Data("mix1/3", 0, (10, 0, b"another"), torch.zeros(5)), 0.1)  # 3 is no member of [0, 1]
    step = ring.poll(node, 0.2)
    assert step.error is None and step.wait_until == 10.0


def test_a_follower_that_gives_up_tells_its_whole_view():
    leader = leader_of(0, "mix1/0", range(4))  # drawn per exchange from the run's seed (protocol.groups)
    me = next(p for p in range(4) if p != leader)
    node = _nodes(4)[me]
    follow = node.group_call("mix1/0", 0, 0.0)
    assert isinstance(follow, Follow) and follow.leader == leader
    node.disconnected(leader, 0.5) if leader in node.peers.connected else node.peers.on_leave(leader, 0.5)
    step = follow.poll(node, 0.6)
    assert step.error is not None and "leader" in str(step.error)
    assert sorted(s.peer for s in step.sends) == [p for p in range(4) if p != me]
    assert all(s.message == Abort("mix1/0") for s in step.sends)


def test_a_late_leader_costs_its_followers_one_grace_window_and_a_control_send():
    """The leader never comes (still computing, frozen, gone without a word): its followers give up one window and a
    control send after their Ready, not two windows (the issue's bound: a late peer costs others one window)."""
    from gossiploco.protocol.agreement import CONTROL_SEND_S

    leader = leader_of(0, "mix2/0", range(4))
    me = next(p for p in range(4) if p != leader)
    node = _nodes(4)[me]
    node.connected(leader, 0.0)
    follow = node.group_call("mix2/0", 0, 0.0)
    follow.start(node)
    assert follow.deadline == 1.0 + CONTROL_SEND_S
    assert follow.poll(node, 0.5).sends == [Send(leader, Ready("mix2/0", 0))]  # asked again at half a window
    step = follow.poll(node, 1.0 + CONTROL_SEND_S)
    assert step.error is not None and "never said it was there" in str(step.error)


def test_a_leader_that_is_there_says_so_when_asked_again_and_is_waited_for_two_windows():
    """A leader waiting for slow members of its bucket answers a repeated Ready with Leading; its window may have
    begun at its own start, after the follower's Ready, so the follower then waits two windows, as before."""
    from gossiploco.protocol.agreement import CONTROL_SEND_S

    chief = leader_of(0, "mix2/0", range(3))
    a, b = (p for p in range(3) if p != chief)
    nodes = _nodes(3)
    for p in (a, b):
        nodes[chief].connected(p, 0.0)
    nodes[a].connected(chief, 0.0)
    follow = nodes[a].group_call("mix2/0", 0, 0.0)
    follow.start(nodes[a])
    assert nodes[chief].receive(a, Ready("mix2/0", 0), 0.0) == []  # before the leader starts: kept, not answered
    assert nodes[chief].receive(a, Ready("mix2/0", 0), 0.2) == []  # asked again, still not leading: nothing to say
    lead = nodes[chief].group_call("mix2/0", 0, 0.4)
    lead.start(nodes[chief])
    answer = nodes[chief].receive(a, Ready("mix2/0", 0), 0.6)  # asked again while leading
    assert [s.message for s in answer] == [Leading("mix2/0", nodes[chief].current_round)]
    nodes[a].receive(chief, answer[0].message, 0.6)
    assert not follow.poll(nodes[a], 1.5).error and follow.deadline == 2.0 + CONTROL_SEND_S
    step = lead.poll(nodes[chief], 1.4)  # one window from the first Ready (0.0): b never came
    assert step.done and sorted(lead.outcome()) == sorted([chief, a])
    assert nodes[chief].receive(a, Ready("mix2/0", 0), 1.5)[0].message.group == tuple(lead.outcome())  # decided
    assert "mix2/0" not in nodes[chief].leading_now


def _leading(key: str):
    """Three connected peers and the agreement call of the one that leads ``key``: (leader, the two others, its node,
    its call)."""
    chief = leader_of(0, key, range(3))
    a, b = (p for p in range(3) if p != chief)
    node = _nodes(3)[chief]
    for p in (a, b):
        node.connected(p, 0.0)
    return chief, a, b, node, node.group_call(key, 0, 0.0)


def test_a_leader_stops_waiting_for_a_member_that_abandoned_the_exchange():
    """Views differ for a moment after a peer dies: a member that still counted the dead peer in followed it, failed
    ("the leader disconnected") and told its whole view (Abort). The leader by the new view decides at once instead
    of waiting out its window for a Ready that will not come (a cascade seen in a real swarm: the late decision
    then made this leader late for the next exchange, and the two surviving peers kept missing each other)."""
    chief, a, b, node, lead = _leading("monitor/1/2")
    lead.start(node)
    node.receive(a, Ready("monitor/1/2", 0), 0.1)
    assert lead.poll(node, 0.2).wait_until == 1.0  # b has said nothing yet: waited for
    node.receive(b, Abort("monitor/1/2"), 0.3)
    step = lead.poll(node, 0.3)
    assert step.done and sorted(lead.outcome()) == sorted([chief, a])
    assert [s.peer for s in step.sends] == [a]


def test_a_peer_that_caught_up_and_leads_by_its_own_view_stops_waiting_once_told_the_group_went_on():
    """A peer caught up into a round whose Mix1 began without it counts itself in, so by its view it may lead that
    Mix1 while the others' leader decided without it: on its join news that leader sends it the decision, and the
    peer stops waiting for the group's members at once, where it waited a whole grace window (a real restart)."""
    key = "mix1/3"
    newcomer = next(p for p in range(4) if leader_of(0, key, range(4)) == p)  # leads by a view that counts it in
    others = [p for p in range(4) if p != newcomer]
    chief = leader_of(0, key, others)  # the others' leader, by their view without it
    leader = _nodes(4)[chief]
    for p in others:
        if p != chief:
            leader.connected(p, 0.0)
            leader.receive(p, Hello(0, 3), 0.0)
    leader.receive(newcomer, Hello(4, 3), 0.0)  # the newcomer is in later rounds only, for now
    leader.current_round = 3
    lead = leader.group_call(key, 3, 0.0)
    lead.start(leader)
    for p in others:
        if p != chief:
            leader.receive(p, Ready(key, 3), 0.1)
    assert lead.poll(leader, 0.2).done and newcomer not in lead.outcome()
    leader.current_round = 4  # the leader went on to round 4 before the news came
    sends = leader.receive(newcomer, Hello(3, 3), 0.3)  # its news: it caught up into round 3
    assert Send(newcomer, Decision(key, 4, tuple(lead.outcome()))) in sends
    assert leader.receive(newcomer, Hello(3, 3), 0.4) == []  # said once: a repeated hello is no news
    # News of a later round: the newcomer counts itself in no exchange decided already
    assert not [s for s in leader.receive(newcomer, Hello(5, 3), 0.45) if isinstance(s.message, Decision)]
    # The same leader's decision of an exchange the newcomer follows by its view is not sent: its Ready gets it anyway
    other = next(k for k in (f"monitor/3/{h}" for h in range(100))
                 if leader_of(0, k, others) == chief and leader_of(0, k, range(4)) != newcomer)
    leader.decided.put(other, (others, 0.2))
    sends = leader.receive(newcomer, Hello(3, 3), 0.47)  # news again (it said 5 last)
    assert [s.message.key for s in sends if isinstance(s.message, Decision)] == [key]
    # News claiming an old round gets this round's and the last's decisions only, never every decision kept
    old = next(k for k in (f"monitor/1/{h}" for h in range(100)) if leader_of(0, k, range(4)) == newcomer)
    leader.decided.put(old, (others, 0.1))
    sends = leader.receive(newcomer, Hello(1, 3), 0.48)
    assert [s.message.key for s in sends if isinstance(s.message, Decision)] == [key]

    node = _nodes(4)[newcomer]
    for p in others:
        node.connected(p, 0.0)
        node.receive(p, Hello(0, 3), 0.0)
    mine = node.group_call(key, 3, 0.5)
    assert type(mine).__name__ in ("Lead", "PairLead")
    mine.start(node)
    assert mine.poll(node, 0.6).wait_until == 1.5  # waits for the members of its view
    node.receive(chief, Decision(key, 3, tuple(lead.outcome())), 0.7)
    step = mine.poll(node, 0.7)
    assert step.done and mine.outcome() == [newcomer]  # they went on: nobody is waited for


def test_a_peer_told_that_a_later_rounds_exchange_went_on_without_it_re_aligns_at_its_next_round():
    """A peer that joined round 0 just as the others moved into round 1 (its question reached them before their
    round's start, its news after) trails by a round: each of its exchanges misses theirs, and no leader is a whole
    round ahead of it at any round start to say so. The others' leader sends it the decision of round 1 it made
    without it (its join news): that it already has, in round 0, marks it a straggler at round 1's start, so it
    re-aligns there (chaos seed 1316173, where it missed every exchange until round 4)."""
    node = _nodes(2)[0]
    node.connected(1, 0.0)
    node.receive(1, Hello(0, 0), 0.0)
    node.current_round = 0
    assert not node.straggling(1)
    node.receive(1, Decision("mix1/1", 1, (1,)), 0.1)  # round 1, without it: it is a round behind
    assert node.straggling(1)

    for group, key, when in (((0, 1), "mix1/1", "a later round, with it"), ((), "mix1/1", "not leading"),
                             ((1,), "mix1/0", "this round: its own Follow counts it")):
        node = _nodes(2)[0]
        node.connected(1, 0.0)
        node.receive(1, Hello(0, 0), 0.0)
        node.current_round = 0
        node.receive(1, Decision(key, 1, group), 0.1)
        assert not node.straggling(1), when


def test_a_peer_that_abandoned_an_exchange_is_not_waited_for_in_its_later_phases():
    """Seen in a real swarm (a peer killed mid-measurement): one peer finished the monitor's first all-reduce while
    the others failed it and told everyone (Abort 'monitor/0/2'); it then waited a whole deadline in the second phase
    ('monitor/0/2/terms') for a chunk from a peer that would never run it."""
    node = PeerNode(1, range(3), grace_s=1.0, chunk_elems=4, mailbox_bytes=1 << 20)
    for p in (0, 2):
        node.connected(p, 0.0)
    assert node.fault("monitor/0/2/terms", 0, [0, 2], 0.0, 0.1)[0] is None
    node.receive(0, Abort("monitor/0/2"), 0.2)
    error, _ = node.fault("monitor/0/2/terms", 0, [0, 2], 0.0, 0.3)
    assert isinstance(error, PeerFailed) and "[0] abandoned" in str(error)
    assert node.fault("monitor/0/20/terms", 0, [0, 2], 0.0, 0.3)[0] is None  # another exchange: not its phase
    assert node.fault("monitor/0", 0, [0, 2], 0.0, 0.3)[0] is None  # nor the exchange it is a phase of


def test_a_restarted_peers_ready_gets_the_group_without_it():
    chief, a, b, leader, lead = _leading("mix1/0")
    leader.receive(a, Ready("mix1/0", 0), 0.1)
    leader.receive(b, Ready("mix1/0", 0), 0.1)
    assert lead.poll(leader, 0.2).done and lead.outcome() == [0, 1, 2]
    assert leader.receive(a, Ready("mix1/0", 0), 0.3)[0].message.group == (0, 1, 2)  # a duplicate: same answer
    leader.disconnected(b, 0.5)  # peer b crashed; its new incarnation asks again
    answer = leader.receive(b, Ready("mix1/0", 0), 0.9)[0].message
    assert answer.group == tuple(sorted({chief, a}))


def test_the_mailbox_evicts_idle_keys_then_drops_and_stays_bounded():
    box = Mailbox(limit_bytes=100)
    for i in range(6):  # 20 bytes each: the sixth does not fit
        box.put(1, Data(f"k{i}", 0, (5, 0), torch.zeros(5)), float(i), active=())
    assert box.bytes == 100 and box.senders("k0") == set() and box.dropped == 1  # the oldest idle key went
    notes = box.put(1, Data("big", 0, (30, 0), torch.zeros(30)), 9.0, active={f"k{i}" for i in range(1, 6)})
    assert box.dropped == 2 and notes and box.bytes == 100  # nothing idle to evict: the newcomer is dropped


def test_one_sender_cannot_fill_the_mailbox_and_stale_or_unasked_chunks_are_dropped_at_once():
    box = Mailbox(limit_bytes=100, sender_limit_bytes=40)
    for i in range(3):
        box.put(7, Data(f"mix2/{i}", 0, (5, 0), torch.zeros(5)), float(i), active={"mix2/0", "mix2/1", "mix2/2"})
    box.put(8, Data("mix2/0", 0, (5, 0), torch.zeros(5)), 3.0, active=())
    assert box.bytes == 60 and box.senders("mix2/2") == set() and box.dropped == 1  # 7 holds its 40 bytes, 8 is in
    node = PeerNode(0, {0: "a", 1: "b"}, grace_s=1.0, chunk_elems=4, mailbox_bytes=1 << 20)
    node.current_round = 5
    for key in ("mix1/3", "monitor/1/0", "state/rep/abc"):  # over long ago, or a state reply nobody asked for
        assert node.receive(1, Data(key, 0, (4, 0), torch.zeros(4)), 0.0) == []
    node.receive(1, Data("mix1/5", 0, (4, 0), torch.zeros(4)), 0.0)  # the current round: kept for its exchange
    node.receive(1, Data("monitor/2/0", 0, (4, 0), torch.zeros(4)), 0.0)  # a background measurement may trail 3 rounds
    assert node.unexpected_chunks == 3 and len(node.mailbox) == 2


@pytest.mark.parametrize("message", [
    Data("mix1/3", 2, (10, 0, 77), torch.arange(4.0)), Hello(5, 4, ask=3), Hello(-2, 9), Hello(-1, 2, echo=7), Ready("mix2/1", 1),
    Decision("mix2/1", 3, (0, 2, 5)), Decision("mix2/1", 3, ()), Leading("mix2/1", 3), Abort("monitor/2/0"),
    StateRequest("abc123")])
def test_every_message_survives_the_wire(message):
    header, tensors = to_wire(message, sender=4, run_id="r")
    back = from_wire(header, tensors)
    if isinstance(message, Data):
        assert (back.key, back.chunk, back.meta) == (message.key, message.chunk, message.meta)
        assert torch.equal(back.data, message.data)
    else:
        assert back == message


def test_only_answers_to_the_latest_question_count_as_reported_rounds():
    node = _nodes(3)[0]
    node.connected(1, 0.0)
    stale_probe = Hello(-1, -1, ask=5)  # peer 1 asked us on its handshake, before we asked it
    node.announce(-1)
    asked = node.probe_id
    assert node.receive(1, stale_probe, 0.1)[0].message == Hello(0, -1, echo=5)  # answered, echoing its id
    assert node.peers.reported == {}  # its own question says nothing about our latest one
    node.receive(1, Hello(0, 7, echo=asked - 1), 0.2)
    assert node.peers.reported == {}  # an answer to an older question
    node.receive(1, Hello(0, 7, echo=asked), 0.3)
    assert node.peers.reported == {1: 7}


def test_a_decision_with_a_wrong_digest_is_malformed():
    header, tensors = to_wire(Decision("k", 0, (1, 2)), sender=1, run_id="r")
    tensors[0][2] += 1
    with pytest.raises(MalformedMessage, match="digest"):
        from_wire(header, tensors)


def test_unreachable_peers_are_the_known_ones_with_no_connection_that_did_not_leave():
    from gossiploco.protocol.peer_table import PeerTable

    table = PeerTable(0, [1, 2, 3], join_round=0)
    table.on_connected(1, 0.0)
    assert table.unreachable() == [2, 3]
    table.on_leave(3, now=1.0)
    assert table.unreachable() == [2]
    table.on_connected(3, 0.0)
    table.on_disconnected(3, now=2.0)  # dropped without a goodbye: cut off, not gone
    assert table.unreachable() == [2, 3]


def test_a_leader_takes_at_most_twice_the_group_size_and_tells_the_rest_they_were_left_out():
    from gossiploco.protocol.agreement import Lead
    from gossiploco.protocol.groups import lead_order
    node = PeerNode(0, range(7), grace_s=1.0, chunk_elems=4, mailbox_bytes=1 << 20)
    for p in range(1, 7):
        node.connected(p, 0.0)
    r = next(r for r in range(100) if leader_of(0, f"mix2/{r}", range(7)) == 0)  # an exchange peer 0 leads
    key = f"mix2/{r}"
    lead = Lead(key, list(range(7)), 0.0, 1.0, buckets=1)  # one bucket of seven (group size 16)...
    for p in range(1, 7):
        assert node.receive(p, Ready(key, r), 0.1) == []
    node.group_size = 2  # ... far above a group size of 2: at most 4 go on
    step = lead.poll(node, 0.2)
    order = lead_order(0, key, range(7))
    assert step.done and sorted(lead.outcome()) == sorted(order[:4])
    told = {s.peer: s.message.group for s in step.sends}
    assert set(told) == set(range(1, 7)) and all(g == tuple(lead.outcome()) for g in told.values())


def test_a_peer_asked_to_lead_an_exchange_of_a_round_it_left_answers_at_once_that_it_does_not():
    """A straggler (a thawed peer, two rounds behind) asks the leader of its view for ``mix2/2``; that peer is in
    round 3, never decided ``mix2/2`` (it followed another leader by the view it had then) and never will: it says
    "not leading" at once, instead of keeping the Ready until the straggler's wait runs out (chaos seed 840767). A
    measurement of an earlier round may still start (they trail), and this round's exchange is about to."""
    chief = leader_of(0, "mix2/2", range(3))
    other = next(p for p in range(3) if p != chief)
    node = _nodes(3)[chief]
    for p in range(3):
        node.connected(p, 0.0) if p != chief else None
    node.begin_round(3, 0.0)
    answer = node.receive(other, Ready("mix2/2", 2), 0.1)
    assert [s.message for s in answer] == [Decision("mix2/2", 3, ())]
    monitor = next(k for k in (f"monitor/2/{h}" for h in range(50)) if leader_of(0, k, range(3)) == chief)
    assert node.receive(other, Ready(monitor, 2), 0.1) == []
    now = next(k for k in (f"mix2/3/{h}" for h in range(50)) if leader_of(0, k, range(3)) == chief)
    assert node.receive(other, Ready(now, 3), 0.1) == []
