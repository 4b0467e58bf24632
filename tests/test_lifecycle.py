"""The peer's lifecycle programs (``protocol.lifecycle``) in memory: each rule driven step by step with a
scripted clock and scripted peers; the simulator (tests/test_simulation.py) runs the same programs under
faults, and the network peer drives them over ZeroMQ (tests/test_peer.py, test_swarm.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from gossiploco.errors import ExchangeClosed, ExchangeError, ExchangeTimeout, PeerFailed
from gossiploco.protocol import lifecycle
from gossiploco.protocol.agreement import Follow
from gossiploco.protocol.collectives import FetchState
from gossiploco.protocol.messages import PROBE, STEPPING_OUT, Decision, Hello, Ready, Send
from gossiploco.protocol.node import PeerNode

ROOT = Path(__file__).resolve().parents[1]


def node_of(rank: int, known, connected=(), join_round=None, static=True) -> PeerNode:
    """A static list's peer (the others take part from round 0), or a discovered one's (the others pending until their hello)."""
    node = PeerNode(rank, known if static else [rank], grace_s=0.5, chunk_elems=8, mailbox_bytes=1 << 20,
                    join_round=join_round)
    for p in known if not static else ():
        node.add_peer(p)
    for p in connected:
        node.connected(p, 0.0)
    return node


def settings(**overrides) -> lifecycle.Settings:
    counter = iter(range(1_000_000))
    values = dict(rounds=10, hello_s=1.0, connect_s=2.0, boundary_s=3.0, state_s=4.0, state_size=6,
                  nonce=lambda: f"n{next(counter)}")
    return lifecycle.Settings(**{**values, **overrides})


class Script:
    """A driver for one program: a virtual clock; ``answers[p]`` is the round peer p reports to each
    question (None: it never answers), with the join round ``joins[p]`` (default ``PROBE``: it says nothing
    of taking part); ``states[p]`` what a state download from p gives (a round and tensor, or an error);
    ``at_wait`` runs before each wait (to change the node as events would; True when it did: a ``Wait`` then
    ends at once)."""

    def __init__(self, node: PeerNode, answers=None, states=None, at_wait=None, joins=None, began=None, ends=None):
        self.node, self.now = node, 0.0
        self.answers, self.states, self.at_wait = dict(answers or {}), dict(states or {}), at_wait
        self.joins = dict(joins or {})
        self.began, self.ends = dict(began or {}), dict(ends or {})  # when p began its round; when it ends (clock)
        self.sent: list[Send] = []
        self.fetched: list[int] = []
        self.sleeps = 0

    def run(self, program):
        value, error = None, None
        while True:
            done, effect = lifecycle.advance(program, value, error)
            if done:
                return effect
            error = None
            if isinstance(effect, lifecycle.Act):
                self.sent.extend(effect.actions)
                for send in effect.actions:
                    self._answer(send)
            elif isinstance(effect, (lifecycle.Wait, lifecycle.Sleep)):
                assert effect.until >= self.now, "a wait into the past"
                woke = self.at_wait(self) if self.at_wait is not None else False  # an event: a Wait ends at once
                self.sleeps += isinstance(effect, lifecycle.Sleep)
                self.now = self.now + 0.001 if woke and isinstance(effect, lifecycle.Wait) else effect.until
            elif isinstance(effect, lifecycle.Run):
                assert isinstance(effect.call, FetchState)
                self.fetched.append(effect.call.peer)
                got = self.states.get(effect.call.peer, ExchangeTimeout("no answer"))
                if isinstance(got, Exception):
                    error = got
                else:
                    value = got
                    continue
            value = self.now

    def _answer(self, send: Send) -> None:
        message = send.message
        if isinstance(message, Hello) and message.ask_reply:
            round_ = self.answers.get(send.peer)
            if round_ is not None:
                began, ends = self.began.get(send.peer), self.ends.get(send.peer)
                self.node.receive(send.peer, Hello(
                    self.joins.get(send.peer, PROBE), round_, echo=message.ask,
                    ends_in_ms=None if ends is None else round((ends - self.now) * 1000),
                    began_ms_ago=None if began is None else round((self.now - began) * 1000)), self.now)


def test_corroborated_drops_a_lone_far_claim_and_keeps_a_boundary():
    assert lifecycle.corroborated({1: 5, 2: 5, 3: 11}) == {1: 5, 2: 5}
    assert lifecycle.corroborated({1: 5, 2: 6}) == {1: 5, 2: 6}
    assert lifecycle.corroborated({1: 9}) == {1: 9}


def test_ask_rounds_collects_the_connected_peers_answers_and_refuses_an_uncorroborated_claim():
    node = node_of(0, [0, 1, 2, 3], connected=[1, 2, 3])
    script = Script(node, answers={1: 4, 2: 4, 3: 40})
    assert script.run(lifecycle.ask_rounds(node, settings())) == {1: 4, 2: 4}
    assert any("no other member backs" in text for _, text in node.notes)
    assert script.now == 0.0, "every answer came at once: no wait"


def test_ask_rounds_asks_again_whoever_has_not_answered_and_gives_up_at_hello_s():
    node = node_of(0, [0, 1, 2], connected=[1, 2])
    script = Script(node, answers={1: 3})  # peer 2 never answers
    rounds = script.run(lifecycle.ask_rounds(node, settings(hello_s=3.5)))
    assert rounds == {1: 3}
    asks_to_2 = [s for s in script.sent if s.peer == 2 and isinstance(s.message, Hello) and s.message.ask_reply]
    assert len(asks_to_2) == 1 + 3, "the probe, then again every PROBE_REPEAT_S within hello_s"
    assert all(s.message.ask == node.probe_id for s in asks_to_2), "the repeats ask the same question"
    assert script.now == pytest.approx(3.5)


def test_ask_rounds_does_not_wait_for_a_peer_that_dropped_meanwhile():
    node = node_of(0, [0, 1, 2], connected=[1, 2])

    def drop(script):
        node.disconnected(2, script.now)
        return True

    script = Script(node, answers={1: 3}, at_wait=drop)
    assert script.run(lifecycle.ask_rounds(node, settings(hello_s=5.0))) == {1: 3}
    assert script.now < 1.0, "the dropped peer is not waited for"


def test_ask_rounds_asks_a_sample_of_a_large_swarm_drawn_afresh_for_each_question():
    """Asking every peer made each peer answer every joiner: control messages per peer grew with the swarm."""
    others = range(1, 41)
    node = node_of(0, [0, *others], connected=others, join_round=0)
    samples = []
    for _ in range(2):
        script = Script(node, answers=dict.fromkeys(others, 3))
        rounds = script.run(lifecycle.ask_rounds(node, settings()))
        asked = {s.peer for s in script.sent}
        assert len(asked) == lifecycle.ROUND_SAMPLE and set(rounds) == asked and set(rounds.values()) == {3}
        samples.append(asked)
    assert samples[0] != samples[1], "each question draws its own sample"

    small = node_of(0, [0, 1, 2, 3], connected=[1, 2, 3], join_round=0)
    script = Script(small, answers={1: 2, 2: 2, 3: 2})
    assert script.run(lifecycle.ask_rounds(small, settings())) == {1: 2, 2: 2, 3: 2}, "a small swarm: everyone"


def test_news_of_a_join_round_asks_only_the_peers_outside_the_view():
    node = node_of(0, [0, 1, 2, 3], connected=[1, 2, 3], join_round=0)
    node.disconnected(3, 1.0)
    node.connected(3, 1.1)  # it dropped and came back: pending until it says where it stands
    sends = node.announce(5)
    assert sorted(s.peer for s in sends) == [1, 2, 3] and all(s.message.join_round == 5 for s in sends)
    assert [s.peer for s in sends if s.message.ask_reply] == [3], "the members in the view owe no answer"
    assert all(s.message.ask_reply for s in node.announce(PROBE, to=[1, 2])), "a probe asks everyone it goes to"
    assert not any(s.message.ask_reply for s in node.announce(6, ask_reply=False))


def test_a_peer_waiting_for_a_boundary_asks_the_next_two_peers_of_the_newest_round_each_poll():
    """Asking the same 8 peers every poll made those 8 answer 80 polls a round each."""
    node = node_of(0, range(7), connected=range(1, 7), join_round=0)
    ahead = dict.fromkeys(range(1, 7), 4)
    script = Script(node, answers=ahead)

    def boundary(script):
        if script.now >= 0.6:
            script.answers = dict.fromkeys(range(1, 7), 5)

    script.at_wait = boundary
    newest = script.run(lifecycle.next_round_begins(node, settings(boundary_poll_s=0.25), ahead))
    assert set(newest.values()) == {5}
    size = lifecycle.BOUNDARY_SAMPLE
    polls = [script.sent[i:i + size] for i in range(0, len(script.sent), size)]
    assert len(polls) >= 4 and all(len({s.peer for s in poll}) == 2 for poll in polls), polls
    assert {s.peer for poll in polls[:3] for s in poll} == set(range(1, 7)), "three polls cover all six"


def test_join_starts_a_new_swarm_at_round_0_and_leaves_out_peers_that_never_connected():
    node = node_of(0, [0, 1, 2], connected=[1])
    script = Script(node, answers={1: 0})
    position = script.run(lifecycle.join(node, settings(), start_round=0))
    assert position.round == 0 and position.state is None
    assert 2 not in node.peers.joined, "never connected: pending until its hello"
    assert node.peers.joined[0] == 0, "this peer takes part from round 0"
    assert any("not connected after" in text for _, text in node.notes)


def test_join_waits_for_a_quorum_until_its_deadline_and_reports_the_members():
    node = node_of(0, [0, 1, 2], connected=[1, 2], static=False)
    script = Script(node, answers={1: -1, 2: -1})
    position = script.run(lifecycle.join(node, settings(), start_round=0, quorum=3, quorum_until=7.0))
    assert script.now == pytest.approx(7.0), "waited for the quorum until the deadline"
    assert position.members == [0], "the others never said they take part"

    def hello(script):  # peer 1 says it takes part from round 0
        node.receive(1, Hello(0, -1), script.now)
        return True

    node = node_of(0, [0, 1], connected=[1], static=False)
    script = Script(node, answers={1: -1}, at_wait=hello)
    position = script.run(lifecycle.join(node, settings(), start_round=0, quorum=2, quorum_until=7.0))
    assert position.members == [0, 1] and script.now < 1.0


@pytest.mark.parametrize("news", ["hello", "hello further on", "ready", "hello at the start"])
def test_a_resumed_peer_waiting_for_its_quorum_takes_the_state_of_a_peer_resumed_a_round_later(news):
    """A swarm stopped across a round boundary resumes: the peer that stopped a round later answered the question
    with round -1 (it had not started a round), then says it takes part from the next round. This peer takes its
    state at once (no wait for a boundary: that peer waits for nobody), where it waited out its whole quorum
    deadline for a member that would never come to its round. Only the peer's own word counts, for the next round
    only, and only on a resume: a claim further on (it must be backed by another member: ``ask_rounds``), a join
    round inferred from a ``Ready`` before its hello (``agreement.on_ready``), and a fresh start move nobody."""
    good = torch.arange(6, dtype=torch.float32)
    start = 0 if news == "hello at the start" else 3
    node = node_of(0, [0, 1, 2], connected=[1, 2], static=False)

    def say(script):  # peer 1 says it takes part from this peer's start round, and peer 2 from a later one
        if 2 in node.peers.joined:
            return False
        node.receive(1, Hello(start, -1), script.now)
        if news == "ready":
            node.receive(2, Ready(f"mix1/{start}", start), script.now)
        else:
            later = start + (2 if news == "hello further on" else 1)
            node.receive(2, Hello(later, later), script.now)
        return True

    script = Script(node, answers={1: -1, 2: -1}, states={2: (start + 1, good)}, at_wait=say)
    position = script.run(lifecycle.join(node, settings(), start_round=start, quorum=3, quorum_until=7.0))
    assert node.peers.joined[2] > start
    if news == "hello":
        assert position.round == 4 and torch.equal(position.state, good) and position.donor == 2
        assert script.now < 1.0 and script.sleeps == 0, "taken at once"
    else:
        assert position.round == start and position.state is None and script.fetched == []
        assert script.now == pytest.approx(7.0), "nobody moved"


def test_a_peer_that_joins_a_running_swarm_waits_for_the_boundary_and_downloads_that_round():
    node = node_of(3, [1, 2, 3], connected=[1, 2], static=False)
    good = torch.arange(6, dtype=torch.float32)
    script = Script(node, answers={1: 4, 2: 4}, states={1: (5, good), 2: (5, good)})

    def boundary(script):  # the swarm begins round 5 once this peer has waited a little
        if script.now >= 0.5:
            script.answers = {1: 5, 2: 5}

    script.at_wait = boundary
    position = script.run(lifecycle.join(node, settings(), start_round=0))
    assert position.round == 5 and torch.equal(position.state, good) and position.fresh_join
    assert script.fetched == [2], "donors rotated by this peer's id (3 % 2 = 1: [2, 1])"
    assert node.peers.joined[3] == 5 and node.caught_up_into == 5
    assert not any(isinstance(s.message, Hello) and s.message.join_round == STEPPING_OUT for s in script.sent), \
        "a fresh peer takes part in nothing yet: nothing to step out of"


@pytest.mark.parametrize("case", ["late", "early", "one liar", "shared clock", "no limit", "cannot rejoin"])
def test_a_peer_that_would_join_a_round_far_along_waits_for_its_end_and_downloads_the_next(case):
    """Found by the simulator's brand-new peers (``simulation.newcomers``): a newcomer that arrived mid-round 0 took part
    in round 0, so its Mix2 came half a round after the others'; its bucket waited a grace window for it and those whose
    leader it was by the draw got no decision. Now it takes part in the others' round only if they began it at most
    ``late_join_s`` ago (the median of their answers); later, it waits for the boundary and downloads the next round's
    state, as a peer arriving in a later round does. On a shared round clock it ends the round with them: it joins."""
    node = node_of(3, [1, 2, 3], connected=[1, 2], static=False)
    good = torch.arange(6, dtype=torch.float32)
    began = {"late": {1: -3.0, 2: -2.5}, "early": {1: -0.2, 2: -0.3}, "one liar": {1: -0.2, 2: -100.0}}.get(
        case, {1: -3.0, 2: -2.5})
    ends = {1: 5.0, 2: 5.0} if case == "shared clock" else {}
    limit = None if case == "no limit" else 1.0
    life = settings(late_join_s=limit, rejoin_error="it cannot" if case == "cannot rejoin" else None)
    script = Script(node, answers={1: 0, 2: 0}, states={1: (1, good), 2: (1, good)}, began=began, ends=ends)

    def boundary(script):  # the others begin round 1 once this peer has waited a little
        if script.now >= 0.5:
            script.answers, script.began = {1: 1, 2: 1}, {1: 0.5, 2: 0.5}

    script.at_wait = boundary
    if case == "cannot rejoin":  # the sync-dp baseline has no state to download: it joins as before
        position = script.run(lifecycle.join(node, life, start_round=0))
        assert position.round == 0 and script.fetched == []
        return
    position = script.run(lifecycle.join(node, life, start_round=0))
    if case == "late":
        assert position.round == 1 and torch.equal(position.state, good) and position.fresh_join
        assert node.peers.joined[3] == 1
        assert any("began round 0 2.5s ago" in text for _, text in node.notes)  # the lower median of 3.0 and 2.5
    else:
        assert position.round == 0 and position.state is None and script.fetched == []
        assert node.peers.joined[3] == 0


def test_a_node_says_how_long_ago_it_began_its_round_and_the_asker_keeps_it_on_its_own_clock():
    member, joiner = node_of(1, [1, 2], connected=[2]), node_of(2, [1, 2], connected=[1])
    [question] = joiner.announce(PROBE, to=[1])
    [silent] = member.receive(2, question.message, 5.0)
    assert silent.message.began_ms_ago is None  # before its first round: nothing to say
    member.begin_round(4, 40.0)
    [answer] = member.receive(2, question.message, 42.25)
    assert answer.message.began_ms_ago == 2250 and answer.message.current_round == 4
    joiner.receive(1, answer.message, 1000.0)
    assert joiner.peers.round_starts == {1: (4, pytest.approx(997.75))}
    assert member.round_began == 40.0 and member.current_round == 4


@pytest.mark.parametrize("poll_s", [lifecycle.BOUNDARY_POLL_S, 0.0125])
def test_a_peer_waiting_for_a_boundary_learns_of_it_within_its_poll(poll_s):
    """Seen in the simulator (seed 106212, 43 peers): the boundary poll was a real run's 0.25 s on a clock whose
    grace window is 0.5 s, so a caught-up peer began its round up to half a window after the others and missed
    its next exchange's window. The poll is ``boundary_poll_s``: the boundary is seen within it (two here: ``Script``
    answers a question with the rounds as they were at its last wait)."""
    node = node_of(3, [1, 2, 3], connected=[1, 2], static=False)
    good = torch.arange(6, dtype=torch.float32)
    script = Script(node, answers={1: 4, 2: 4}, states={1: (5, good), 2: (5, good)})
    began = 0.3

    def boundary(script):
        if script.now >= began:
            script.answers = {1: 5, 2: 5}

    script.at_wait = boundary
    position = script.run(lifecycle.join(node, settings(boundary_poll_s=poll_s), start_round=0))
    assert position.round == 5 and position.fresh_join
    assert began <= script.now <= began + 2 * poll_s + 1e-9, (script.now, poll_s)


def test_a_resumed_peer_one_round_behind_downloads_at_once():
    node = node_of(1, [1, 2], connected=[2])
    state = torch.zeros(6)
    script = Script(node, answers={2: 8}, states={2: (8, state)})
    position = script.run(lifecycle.join(node, settings(), start_round=7))
    assert position.round == 8 and script.sleeps == 0, "no wait for a boundary: the others wait at round 8's start"


@pytest.mark.parametrize("bad", ["size", "nan", "error"])
def test_an_unusable_state_is_refused_and_the_next_donor_tried(bad):
    node = node_of(0, [0, 1, 2], connected=[1, 2], join_round=0)
    good = torch.ones(6)
    broken = {"size": (5, torch.ones(7)), "nan": (5, torch.tensor([1.0, float("nan"), 0, 0, 0, 0])),
              "error": PeerFailed("bad chunk")}[bad]
    script = Script(node, answers={1: 5, 2: 5}, states={1: broken, 2: (5, good)})
    position = script.run(lifecycle.catch_up(node, settings(), {1: 5, 2: 5}, current=3))
    assert position.round == 5 and position.donor == 2 and torch.equal(position.state, good)
    assert script.fetched == [1, 2]
    assert any(isinstance(s.message, Hello) and s.message.join_round == STEPPING_OUT for s in script.sent), \
        "a member steps out while it catches up"


def test_without_a_usable_state_a_member_goes_on_with_its_own_and_a_fresh_process_gives_up():
    node = node_of(0, [0, 1], connected=[1], join_round=0)
    script = Script(node, answers={1: 6}, states={1: ExchangeTimeout("gone")})
    position = script.run(lifecycle.catch_up(node, settings(), {1: 6}, current=4))
    assert position.round == 4 and position.state is None and node.peers.joined[0] == 4

    node = node_of(0, [0, 1], connected=[1])
    script = Script(node, answers={1: 6}, states={1: ExchangeTimeout("gone")})
    with pytest.raises(ExchangeError, match="no peer gave its state"):
        script.run(lifecycle.catch_up(node, settings(), {1: 6}, current=0, fresh=True))
    assert script.fetched == [1, 1], "a fresh process tries again at the next boundary before giving up"


def test_a_member_whose_donor_dropped_mid_download_and_came_back_asks_again_at_the_next_boundary():
    """Seen in the chaos simulator (seed 1409390): a relay reset the only path in the middle of a state download and
    the donor was back 0.1 s later, but the download had failed, and the member went on with its own state, a round
    behind; its next catch-up met another reset and downloaded mid-round, and it mixed again 3 rounds after coming
    back. Now it tries once more at the next boundary, in step with the swarm. A donor that failed without a drop
    is not asked again (``test_without_a_usable_state_...``)."""
    node = node_of(0, [0, 1], connected=[1], join_round=0)
    script = Script(node, answers={1: 6}, states={1: PeerFailed("peer 1 disconnected")})

    def reset_then_boundary(script):
        if not script.fetched and 1 not in node.peers.lost_at:  # a reset cuts the path during the catch-up
            node.disconnected(1, script.now)
            node.connected(1, script.now + 0.1)
            return True
        if script.fetched == [1] and script.answers[1] == 6:  # the download failed; then the next round begins
            script.answers, script.states = {1: 7}, {1: (7, torch.ones(6))}
            return True
        return False

    script.at_wait = reset_then_boundary
    position = script.run(lifecycle.catch_up(node, settings(), {1: 6}, current=4))
    assert position.round == 7 and torch.equal(position.state, torch.ones(6)) and script.fetched == [1, 1]
    assert any("trying again at the next round boundary" in text for _, text in node.notes)


def test_a_fresh_process_whose_donor_restarted_too_starts_with_it_instead_of_giving_up():
    """Seen in the chaos simulator (seed 1102405): both peers of a swarm restarted within a second; the fresh one's
    donor answered "no state yet" (it was starting again itself), and the fresh one stopped with "no peer gave its
    state" while the other went on alone from round 0. Nobody past its round any more, but someone answered: it
    starts with them, as ``join`` does. Nobody answering at all still gives up (the swarm is gone)."""
    node = node_of(0, [0, 1], connected=[1])
    script = Script(node, answers={1: 6}, states={1: PeerFailed("peer 1 has no state to give yet")})

    def restarted(script):  # its donor restarted: it now answers round -1 (it has not started a round)
        if script.fetched:
            script.answers = {1: -1}

    script.at_wait = restarted
    position = script.run(lifecycle.catch_up(node, settings(), {1: 6}, current=0, fresh=True))
    assert position.round == 0 and position.state is None and node.peers.joined[0] == 0
    assert any("taking part from round 0 with them" in text for _, text in node.notes)

    node = node_of(0, [0, 1], connected=[1])
    script = Script(node, answers={}, states={1: PeerFailed("gone")})  # it said round 6 once, and nothing since
    with pytest.raises(ExchangeError, match="no peer answered where it stands"):
        script.run(lifecycle.catch_up(node, settings(), {1: 6}, current=0, fresh=True))


def test_a_peer_waiting_for_a_boundary_stops_once_every_peer_ahead_is_gone():
    """Seen in a real swarm: the one other survivor ran ahead alone and finished its run while this peer waited a
    whole ``boundary_s`` (60 s there) for it to begin a round. Once every peer of the newest round lost its connection
    or left, nobody can begin one: the peer goes on with its own state at once."""
    node = node_of(0, [0, 1, 2], connected=[1, 2], join_round=0)

    def finish(script):  # both peers ahead finish their runs once this peer has waited a little
        if script.now >= 0.5:
            node.disconnected(1, script.now)
            node.disconnected(2, script.now)

    script = Script(node, answers={1: 6, 2: 6}, states={1: PeerFailed("disconnected"), 2: PeerFailed("gone")},
                    at_wait=finish)
    position = script.run(lifecycle.catch_up(node, settings(boundary_s=60.0), {1: 6, 2: 6}, current=4))
    assert position.round == 4 and position.state is None
    assert script.now < 1.0, "waited for peers that were gone"
    assert any("is gone" in text for _, text in node.notes)


def test_maybe_catch_up_decides_from_the_node_alone():
    life = settings()
    node = node_of(0, [0, 1], connected=[1], join_round=0)
    node.peers.on_join(1, 0)
    assert Script(node).run(lifecycle.maybe_catch_up(node, life, 3)) == lifecycle.Position(3)

    node.peers.leader_rounds[1] = 5  # a leader answered from round 5: the swarm went on
    script = Script(node, answers={1: 5}, states={1: (6, torch.zeros(6))})
    script.at_wait = lambda s: s.answers.update({1: 6})
    assert script.run(lifecycle.maybe_catch_up(node, life, 3)).round == 6

    assert Script(node).run(lifecycle.maybe_catch_up(node, settings(solo=True), 3)) == lifecycle.Position(3)


def test_a_baseline_that_cannot_rejoin_says_why():
    node = node_of(0, [0, 1], connected=[1])
    with pytest.raises(ExchangeError, match="sync-dp cannot rejoin"):
        Script(node, answers={1: 3}).run(lifecycle.join(node, settings(rejoin_error="sync-dp cannot rejoin"), 0))


def test_a_closed_node_ends_a_waiting_program_with_exchange_closed():
    node = node_of(0, [0, 1, 2], connected=[1])

    def close(script):
        node.closed = True

    with pytest.raises(ExchangeClosed):
        Script(node, at_wait=close).run(lifecycle.join(node, settings(), 0))


def test_a_decision_naming_a_peer_this_one_does_not_know_fails_the_group_instead_of_crashing():
    node = node_of(2, [1, 2], connected=[1], join_round=0)
    node.peers.on_join(1, 0)
    call = Follow("mix1/0", 1, 0, [1, 2], 0.0, 0.5)
    call.start(node)
    node.receive(1, Decision("mix1/0", 0, (1, 2, 77)), 0.1)
    step = call.poll(node, 0.1)
    assert isinstance(step.error, PeerFailed) and "77" in str(step.error)
    assert node.unknown_members == 1
    assert {s.peer for s in step.sends} == {1}, "the others hear at once that this peer abandons the key"


def test_the_simulator_holds_no_lifecycle_rule_of_its_own():
    """It imports the runtime's programs and defines none of join, asking rounds or catching up itself."""
    tree = ast.parse((ROOT / "gossiploco" / "simulation" / "swarm.py").read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert not defined & {"join", "ask_rounds", "maybe_catch_up", "catch_up", "next_round_begins", "download"}
    source = (ROOT / "gossiploco" / "simulation" / "swarm.py").read_text()
    assert "lifecycle.join(" in source and "lifecycle.maybe_catch_up(" in source
    runtime = (ROOT / "gossiploco" / "runtime" / "peer_join.py").read_text()
    # the runtime runs the same programs, on its exchange (by name: the exchange may be in a companion process)
    assert ".join_swarm(" in runtime and ".catch_up_if_behind(" in runtime
    driver = (ROOT / "gossiploco" / "transport" / "zmq_exchange.py").read_text()
    assert "lifecycle.join(" in driver and "lifecycle.maybe_catch_up(" in driver
    assert "PROBE" not in runtime and "announce(" not in runtime, "the runtime asks and announces only through the lifecycle"
    assert PROBE == -1
