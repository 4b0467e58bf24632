"""Gossip pairing as members become ready (``protocol.pairing``), in memory: the real ``PeerNode`` and its calls,
messages handed over by hand. The simulator runs the same code over its faults (``test_simulation``), the real
transport over sockets (``test_group_mix``)."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from gossiploco.protocol import groups
from gossiploco.protocol.agreement import Follow
from gossiploco.protocol.groups import leader_of
from gossiploco.protocol.messages import Abort, Decision, Ready
from gossiploco.protocol.node import PeerNode
from gossiploco.protocol.pairing import PairLead

KEY = "mix2/0"


def _swarm(n: int, key: str = KEY) -> tuple[int, list[int], list[PeerNode]]:
    """``n`` connected peers whose gossip Mix2 pairs as members become ready: (the leader of ``key``, the others, the
    nodes)."""
    nodes = [PeerNode(r, range(n), grace_s=1.0, chunk_elems=4, mailbox_bytes=1 << 20) for r in range(n)]
    for node in nodes:
        node.paired = frozenset({"mix2"})
        for p in range(n):
            if p != node.rank:
                node.connected(p, 0.0)
    chief = leader_of(0, key, range(n))
    return chief, [p for p in range(n) if p != chief], nodes


def _told(sends) -> dict[int, tuple[int, ...]]:
    """Who was told which group, from a leader's sends."""
    return {s.peer: s.message.group for s in sends if isinstance(s.message, Decision)}


def test_the_next_member_ready_is_paired_at_once_even_while_the_leader_still_computes():
    chief, (a, b, c), nodes = _swarm(4)
    leader = nodes[chief]
    assert leader.receive(a, Ready(KEY, 0), 0.1) == []  # the first waits
    pair = tuple(sorted((a, b)))
    assert _told(leader.receive(b, Ready(KEY, 0), 0.3)) == {a: pair, b: pair}  # leader has not reached Mix2
    assert leader.receive(c, Ready(KEY, 0), 0.5) == []  # waits: the leader itself is still to come
    lead = leader.group_call(KEY, 0, 1.2)  # within c's grace window
    assert isinstance(lead, PairLead)
    mine = tuple(sorted((chief, c)))
    assert _told(lead.start(leader)) == {c: mine}
    step = lead.poll(leader, 1.2)
    assert step.done and lead.outcome() == list(mine)
    assert _told(leader.receive(a, Ready(KEY, 0), 1.5)) == {a: pair}  # asked again: the same pair


def test_a_pairing_never_matches_members_across_a_change_of_view():
    """Found by the simulator (chaos seed 2802: a leader's view shrank while a follower's Ready was on its way, and the
    leader was paired with a member of another bucket by its own call's view). The pairing's members are the bucket
    it started with: one whose Ready comes by another view is told it is alone (identity, at once), and nobody is
    paired with a member that the arriving one's view does not hold."""
    from gossiploco.protocol import pairing

    chief, (a, b, c), nodes = _swarm(4)
    leader = nodes[chief]
    assert pairing.ready(leader, KEY, a, [chief, a, b], 0.1) == []  # started with bucket {chief, a, b}: a waits
    assert _told(pairing.ready(leader, KEY, c, [chief, a, c], 0.2)) == {c: (c,)}  # c is not of it: alone at once
    assert pairing.ready(leader, KEY, chief, [chief, b], 0.3) == []  # the leader's view has lost a: not paired with it
    assert leader.pairings.get(KEY).waiting == chief
    assert _told(pairing.ready(leader, KEY, b, [chief, a, b], 0.4)) == {b: tuple(sorted((chief, b)))}


def test_a_member_that_waited_a_whole_grace_window_is_not_paired_any_more():
    """Its own grace window is over (it does identity, or is about to): pairing a newcomer with it would leave that
    newcomer waiting for a partner who is gone."""
    chief, (a, b, c), nodes = _swarm(4)
    leader = nodes[chief]
    assert leader.receive(a, Ready(KEY, 0), 0.0) == []
    assert leader.receive(b, Ready(KEY, 0), 1.0) == []  # a's window is over: b waits instead
    assert _told(leader.receive(c, Ready(KEY, 0), 1.1)) == {b: tuple(sorted((b, c))), c: tuple(sorted((b, c)))}


def test_a_follower_runs_the_pair_it_is_told():
    chief, (a, b, c), nodes = _swarm(4)
    follow = nodes[a].group_call(KEY, 0, 0.0)
    assert isinstance(follow, Follow) and follow.leader == chief
    assert [s.message for s in follow.start(nodes[a])] == [Ready(KEY, 0)]
    told = _told(nodes[chief].receive(a, Ready(KEY, 0), 0.1) + nodes[chief].receive(b, Ready(KEY, 0), 0.2))
    nodes[a].receive(chief, Decision(KEY, 0, told[a]), 0.3)
    step = follow.poll(nodes[a], 0.3)
    assert step.done and follow.outcome() == sorted((a, b))


def test_the_last_member_is_told_it_is_alone_as_soon_as_nobody_else_can_come():
    """An odd member out waits for nobody: once every other member of its bucket is paired or gone, it is released
    (identity for that exchange) at once, not after a grace window."""
    chief, (a, b, c), nodes = _swarm(4)
    leader = nodes[chief]
    lead = leader.group_call(KEY, 0, 0.0)
    lead.start(leader)
    assert _told(leader.receive(a, Ready(KEY, 0), 0.1)) == {a: tuple(sorted((chief, a)))}
    assert lead.poll(leader, 0.1).done
    leader.disconnected(c, 0.2)  # c crashed before it was ready
    assert _told(leader.receive(b, Ready(KEY, 0), 0.3)) == {b: (b,)}  # nobody else can come: alone, at once


def test_a_member_waiting_is_released_when_the_others_give_up_and_never_paired_with_one_that_did():
    chief, (a, b, c), nodes = _swarm(4)
    leader = nodes[chief]
    lead = leader.group_call(KEY, 0, 0.0)
    lead.start(leader)
    assert _told(leader.receive(a, Ready(KEY, 0), 0.1)) == {a: tuple(sorted((chief, a)))}
    assert leader.receive(b, Ready(KEY, 0), 0.2) == []  # c may still come
    assert leader.receive(b, Abort(KEY), 0.3) == []  # b gave up (its grace window is its own)
    assert _told(leader.receive(c, Ready(KEY, 0), 0.4)) == {c: (c,)}  # not paired with b; nobody else can come


def test_a_restarted_member_asking_again_is_not_given_its_predecessors_pair():
    chief, (a, b, c), nodes = _swarm(4)
    leader = nodes[chief]
    leader.receive(a, Ready(KEY, 0), 0.1)
    leader.receive(b, Ready(KEY, 0), 0.2)
    leader.disconnected(b, 0.5)  # b's process died after it was paired; its new process asks again
    assert _told(leader.receive(b, Ready(KEY, 0), 0.9)) == {b: (a,)}  # that pair was its predecessor's: not in it


def test_a_leader_that_nobody_joins_does_identity_after_its_grace_window():
    chief, others, nodes = _swarm(3)
    leader = nodes[chief]
    lead = leader.group_call(KEY, 0, 0.0)
    lead.start(leader)
    assert lead.poll(leader, 0.5).wait_until == 1.0
    step = lead.poll(leader, 1.0)
    assert step.done and lead.outcome() == [chief]


@pytest.mark.parametrize("size", [4, 5, 6])
def test_arrivals_in_a_random_order_give_a_uniform_matching_with_the_stated_rho(size):
    """When the order in which members become ready is exchangeable (time-budget rounds: i.i.d. overshoots), pairing
    consecutive arrivals is a uniform random matching of the bucket: every pair of members equally likely
    (``groups.gossip_rho``'s assumption). Tolerance from the math: each pair's count is Binomial(trials, q)
    with q = P(a given pair is matched), allowed 5 standard deviations."""
    trials, rng = 2000, random.Random(7)
    counts: Counter = Counter()
    alone = 0
    for t in range(trials):
        key = f"mix2/{t}"
        chief, others, nodes = _swarm(size, key)
        leader = nodes[chief]
        order = list(range(size))
        rng.shuffle(order)
        told: dict[int, tuple[int, ...]] = {}
        lead = None
        for p in order:
            if p == chief:
                lead = leader.group_call(key, t, 0.0)
                told.update(_told(lead.start(leader)))
            else:
                told.update(_told(leader.receive(p, Ready(key, t), 0.0)))
        lead.poll(leader, 0.0)
        told[chief] = tuple(lead.outcome())
        pairs = {g for g in told.values() if len(g) == 2}
        assert len(pairs) == size // 2 and all(told[m] == g for g in pairs for m in g)  # mutual, disjoint
        alone += sum(1 for g in told.values() if len(g) == 1)
        counts.update(pairs)
    assert alone == trials * (size % 2)  # an odd bucket leaves exactly one member out
    q = (size // 2) / math.comb(size, 2)  # each of the C(size, 2) pairs equally likely among the size // 2 drawn
    for pair in itertools.combinations(range(size), 2):
        assert abs(counts[pair] - trials * q) <= 5 * math.sqrt(trials * q * (1 - q)), (pair, counts[pair], trials * q)
    matched = 2 * (size // 2) / size  # the share of members paired: p in rho = 1 - p M / (2 (M - 1))
    assert groups.matched_probability(size, 16) == pytest.approx(matched)


@pytest.mark.slow  # 1.4-2.7 s: in the slow set, so that the fast subset keeps its margin under 2 minutes
def test_in_the_simulator_pairing_as_members_come_blocks_far_less_once_rounds_keep_to_a_shared_clock():
    """What ``[groups] pairing = "ready"`` gives and needs, in the seeded simulator (the real protocol; consumer
    links, 1% churn, 20 s rounds whose compute overshoots by up to 2 s, as time-budget rounds do). With rounds on a
    shared clock, members wait for the next one ready instead of their whole bucket: the blocking time falls to a
    fraction and Mix1 completes as often. Without the shared clock nothing realigns the round starts that
    pairing spreads apart: the next Mix1 leaves the late ones out (why it is not the default)."""
    from gossiploco.simulation.runs import simulate_scale

    def run(pairing: str, period: float) -> dict:
        result = simulate_scale(1, 32, rounds=5, inner_spread=0.0, round_jitter=2.0, round_period=period,
                                pairing=pairing)
        assert not result.violations and min(result.finished.values()) == 5, result.violations[:3]
        return result.stats["per_peer"]

    bucket, ready, unanchored = run("bucket", 24.0), run("ready", 24.0), run("ready", 0.0)
    assert ready["blocking_s"] < 0.4 * bucket["blocking_s"], (ready, bucket)
    assert ready["blocking_p90_s"] < 0.4 * bucket["blocking_p90_s"], (ready, bucket)
    assert ready["mix1_completion"] >= bucket["mix1_completion"] - 0.02, (ready, bucket)
    assert ready["control_per_round"] <= 1.2 * bucket["control_per_round"], (ready, bucket)
    assert unanchored["mix1_completion"] < ready["mix1_completion"] - 0.05, (unanchored, ready)


def test_the_setting_names_gossip_exchanges_only_and_refuses_other_values():
    from gossiploco.config_sections import GroupConfig
    from gossiploco.errors import ConfigError

    assert GroupConfig().pairing == "bucket" and GroupConfig().paired({"mix1": "global", "mix2": "gossip"}) == set()
    ready = GroupConfig(pairing="ready")
    assert ready.paired({"mix1": "global", "mix2": "gossip"}) == {"mix2"}
    assert ready.paired({"mix1": "global", "mix2": "global"}) == set()
    with pytest.raises(ConfigError, match="ready or bucket"):
        GroupConfig(pairing="fastest").check("groups")
