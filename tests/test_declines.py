"""A member that completed a Mix1 its group then lost a member of declines the exchange run again
(``protocol.declines``): the survivors' second attempt neither waits for it nor follows it, and a follower whose
drawn leader declines follows the next leader of the lead order (or leads). The sans-I/O nodes, messages passed by
hand; the effect on a swarm of 1,000: ``bench/results/scale.md``."""

from __future__ import annotations

import pytest

from gossiploco.protocol import keys
from gossiploco.protocol.agreement import Follow, Lead
from gossiploco.protocol.groups import leader_of, lead_order
from gossiploco.protocol.messages import Abort, Decision, Ready
from gossiploco.protocol.node import PeerNode

FIRST = "mix1/0"
AGAIN = keys.again_key(FIRST)
GRACE_S = 1.0


def _swarm(n: int, labels=("mix1",)) -> list[PeerNode]:
    """``n`` connected peers that all take part from round 0, Mix1 allowed to run again."""
    nodes = [PeerNode(r, range(n), grace_s=GRACE_S, chunk_elems=5, mailbox_bytes=1 << 20) for r in range(n)]
    for node in nodes:
        node.declines.labels = frozenset(labels)
        for p in range(n):
            if p != node.rank:
                node.connected(p, 0.0)
                node.peers.on_join(p, 0)
    return nodes


def _pump(nodes: list[PeerNode], calls: dict, sends: list, now: float) -> None:
    """Deliver every message (and the ones they cause) and poll every running agreement call at ``now``, until
    nothing moves. Finished calls stay in ``calls`` with ``finished`` set."""
    queue = list(sends)
    while True:
        for rank, call in calls.items():
            while not call.finished:
                step = call.poll(nodes[rank], now)
                queue += [(rank, s) for s in step.sends]
                if step.error is not None or step.done:
                    call.error = step.error
                    call.finished = True
                    break
                if step.wait_until is None or step.wait_until > now:
                    break
        if not queue:
            return
        src, send = queue.pop(0)
        queue += [(send.peer, s) for s in nodes[send.peer].receive(src, send.message, now)]


def _start(nodes, ranks, now: float):
    calls, sends = {}, []
    for r in ranks:
        call = nodes[r].group_call(AGAIN, 0, now)
        call.error = None
        calls[r] = call
        sends += [(r, s) for s in call.start(nodes[r])]
    return calls, sends


def test_the_survivors_skip_a_drawn_leader_that_completed_the_first_attempt_within_a_round_trip():
    """Five peers; the second attempt's drawn leader F completed the first (it got every chunk before the crash),
    and member X crashed (gone from every view). The three survivors follow F, which declines each of them at
    once; they all move to the next leader of the order, which leads them without waiting for F: their group, at
    the time of their start, with no grace window spent."""
    n = 5
    nodes = _swarm(n)
    f = leader_of(0, AGAIN, range(n))
    x = next(p for p in lead_order(0, AGAIN, range(n)) if p != f)  # the crashed member: the next leader, for good measure
    survivors = [p for p in range(n) if p not in (f, x)]
    for node in nodes:
        node.grouped.put(FIRST, frozenset(range(n)))
        if node.rank != x:
            node.peers.on_leave(x, 0.0)
    nodes[f].completed(FIRST)
    calls, sends = _start(nodes, survivors, 0.1)
    assert all(isinstance(c, Follow) and c.leader == f for c in calls.values())  # nobody heard F decline yet
    _pump(nodes, calls, sends, 0.1)
    groups = {r: tuple(c.outcome()) for r, c in calls.items()}
    assert all(c.error is None for c in calls.values()), {r: c.error for r, c in calls.items()}
    assert set(groups.values()) == {groups[survivors[0]]} and sorted(groups[survivors[0]]) == survivors
    leader = leader_of(0, AGAIN, survivors)
    assert calls[leader].lead is not None and calls[leader].what.startswith(f"group {AGAIN!r} (leading")
    assert nodes[f].declines.sent == len(survivors)  # one decline each, to the Readys it was sent
    assert all(AGAIN not in node.leading_now for node in nodes)


def test_a_member_that_completed_declines_to_each_member_that_abandons_the_first_attempt_once():
    """F completed the first attempt but is not the drawn leader of the second: each member whose ring broke tells
    every member it abandons the first attempt, and F answers each of them that it takes no part in the second,
    once; the second attempt's leader then decides without waiting a grace window for F's Ready."""
    n = 4
    nodes = _swarm(n)
    chief = leader_of(0, AGAIN, range(n))
    f = next(p for p in range(n) if p != chief)
    survivors = [p for p in range(n) if p != f]
    for node in nodes:
        node.grouped.put(FIRST, frozenset(range(n)))
    nodes[f].completed(FIRST)
    told = nodes[f].receive(survivors[0], Abort(FIRST), 0.0)
    assert [(s.peer, s.message) for s in told] == [(survivors[0], Abort(AGAIN))]
    assert nodes[f].receive(survivors[0], Abort(FIRST), 0.0) == []  # once
    assert nodes[f].receive(survivors[0], Abort("mix1/1"), 0.0) == []  # nor for an exchange it did not complete
    calls, sends = _start(nodes, survivors, 0.2)
    assert isinstance(calls[chief], Lead)
    broke = [(s, a) for s in survivors[1:] for a in nodes[s].aborts(FIRST, [f])]  # the others' rings broke too
    _pump(nodes, calls, [(f, s) for s in told] + sends + broke, 0.2)
    assert sorted(calls[chief].outcome()) == survivors
    assert nodes[f].declines.sent == len(survivors)


def test_nothing_is_declined_unless_it_may_run_again_and_a_follower_all_declined_to_leads_itself_alone_at_once():
    """No declines for labels that never run again; a follower whose every other member declined (told by its own
    ring's failure, or asked to lead) ends alone at once (a group of one: identity), not after a window."""
    n = 3
    plain = _swarm(n, labels=())
    f = leader_of(0, AGAIN, range(n))
    a = next(p for p in range(n) if p != f)
    plain[f].grouped.put(FIRST, frozenset(range(n)))
    plain[f].completed(FIRST)
    assert plain[f].receive(a, Abort(FIRST), 0.0) == []
    assert plain[f].receive(a, Ready(AGAIN, 0), 0.0) == []  # kept: F leads it, by its view
    assert plain[f].declines.sent == 0

    nodes = _swarm(n)
    for node in nodes:
        node.grouped.put(FIRST, frozenset(range(n)))
    for p in range(n):
        if p != a:
            nodes[p].completed(FIRST)
    calls, sends = _start(nodes, [a], 0.0)
    assert calls[a].leader == f
    broke = [(a, s) for s in nodes[a].aborts(FIRST, range(n))]  # its ring's failure, told to the group
    _pump(nodes, calls, sends + broke, 0.0)
    assert calls[a].error is None and calls[a].outcome() == [a]
    # Each of the two that completed answered a's abandonment, and F a's Ready too
    assert [nodes[p].declines.sent for p in range(n)] == [2 if p == f else 0 if p == a else 1 for p in range(n)]


def test_a_ready_for_a_key_run_again_is_kept_by_a_member_not_leading_it_yet_and_refused_for_a_first_attempt():
    """A member asked to lead a key run again while, by its view, a leader before it has not declined yet keeps the
    Ready (that leader's decline may not have reached it yet); for any other key the answer is "not leading"."""
    n = 4
    nodes = _swarm(n)
    order = lead_order(0, AGAIN, range(n))
    second, asker = order[1], order[2]
    assert nodes[second].receive(asker, Ready(AGAIN, 0), 0.0) == []
    assert asker in nodes[second].ready.get(AGAIN)
    not_first = next(p for p in range(n) if p != leader_of(0, FIRST, range(n)))
    answer = nodes[not_first].receive(asker if asker != not_first else second, Ready(FIRST, 0), 0.0)
    assert [s.message for s in answer] == [Decision(FIRST, -1, ())]


def test_over_real_sockets_the_survivors_run_again_at_once_without_the_member_that_completed(groups):
    """Four ZeroMQ peers agree on Mix1's group; the one drawn to lead the exchange run again completed the first
    attempt. The other three run it again: F declines over the wire, and they agree on their three and get their
    exact mean well within the grace window (5 s), where they would otherwise wait it out and fail."""
    import time

    import torch

    from tests.test_exchange import run_all

    g = groups(4, grace_s=5.0)
    for ex in g.exchanges:
        ex.set_grouping(11, 16, (), {"mix1"})
    assert run_all([lambda r=r: g.exchanges[r].group(FIRST, 0) for r in range(4)]) == [[0, 1, 2, 3]] * 4
    f = leader_of(11, AGAIN, range(4))
    g.exchanges[f].completed(FIRST)
    survivors = [r for r in range(4) if r != f]
    start = time.monotonic()
    got = run_all([lambda r=r: g.exchanges[r].group(AGAIN, 0) for r in survivors])
    assert time.monotonic() - start < 2.0, "the survivors waited for the member that completed"
    assert all(sorted(x) == survivors for x in got) and len({tuple(x) for x in got}) == 1
    out = run_all([lambda r=r, m=m: g.exchanges[r].all_reduce_mean(AGAIN, torch.full((6,), float(r)), m)
                   for r, m in zip(survivors, got)])
    assert all(torch.equal(o, torch.full((6,), sum(survivors) / 3)) for o in out)


def test_a_leader_that_never_decided_is_neither_followed_nor_waited_for_when_its_bucket_runs_again():
    """The first attempt's leader D is silent (dead behind an idle link, frozen): its followers' waits run out
    (``NoDecision``), and each counts D as declining the run again, so the second attempt skips it even where the
    draw would name it, and its leader decides as soon as the others are ready."""
    from gossiploco.errors import NoDecision
    from gossiploco.protocol.agreement import CONTROL_SEND_S

    n = 4
    nodes = _swarm(n)
    d = leader_of(0, FIRST, range(n))
    followers = [p for p in range(n) if p != d]
    calls = {r: nodes[r].group_call(FIRST, 0, 0.0) for r in followers}
    for r, call in calls.items():
        call.start(nodes[r])
        step = call.poll(nodes[r], GRACE_S + CONTROL_SEND_S)
        assert isinstance(step.error, NoDecision), step.error
    for r in followers:
        assert d in nodes[r].aborted.get(AGAIN)
    again, sends = _start(nodes, followers, 3.0)
    assert all(isinstance(c, Lead) or c.leader != d for c in again.values())
    _pump(nodes, again, sends, 3.0)
    assert {tuple(c.outcome()) for c in again.values()} == {tuple(again[leader_of(0, AGAIN, followers)].outcome())}
    assert sorted(again[followers[0]].outcome()) == followers
    plain = _swarm(n, labels=())
    call = plain[followers[0]].group_call(FIRST, 0, 0.0)
    call.start(plain[followers[0]])
    assert isinstance(call.poll(plain[followers[0]], GRACE_S + CONTROL_SEND_S).error, NoDecision)
    assert plain[followers[0]].aborted.get(AGAIN) is None  # no exchange of it runs again: nothing noted


@pytest.mark.slow  # a grace window and a control send (2 s)
def test_over_real_sockets_a_bucket_whose_leader_never_decided_runs_again_at_once_without_it(groups):
    """Four ZeroMQ peers; the drawn leader of ``mix1/0`` is there (connected) but never runs the exchange (frozen,
    dead behind an idle link). Its three followers fail with ``NoDecision`` after a grace window and a control send,
    then run ``mix1/0/again`` without it: agreed and mixed at once, not after another window spent waiting for it."""
    import time

    import torch

    from gossiploco.errors import NoDecision
    from tests.test_exchange import run_all

    g = groups(4, grace_s=GRACE_S)
    for ex in g.exchanges:
        ex.set_grouping(11, 16, (), {"mix1"})
    silent = leader_of(11, FIRST, range(4))
    followers = [r for r in range(4) if r != silent]

    def first(r):
        try:
            g.exchanges[r].group(FIRST, 0)
        except NoDecision as exc:
            return exc
        return None

    assert all(isinstance(e, NoDecision) for e in run_all([lambda r=r: first(r) for r in followers]))
    start = time.monotonic()
    got = run_all([lambda r=r: g.exchanges[r].group(AGAIN, 0) for r in followers])
    assert time.monotonic() - start < GRACE_S, "the second attempt waited for the silent leader"
    assert all(sorted(x) == followers for x in got) and len({tuple(x) for x in got}) == 1
    out = run_all([lambda r=r, m=m: g.exchanges[r].all_reduce_mean(AGAIN, torch.full((6,), float(r)), m)
                   for r, m in zip(followers, got)])
    assert all(torch.equal(o, torch.full((6,), sum(followers) / 3)) for o in out)
