"""Links on demand: a carrier that opens a link when something is sent and closes it when idle, instead of a
connection to every member (``PeerTable``'s ``links_on_demand``, ``SimNetwork.idle_s``). The membership rules in
memory, the simulated carrier's links, and whole simulated swarms of 64 and 256 peers under churn."""

from __future__ import annotations

import random
import statistics

import pytest

from gossiploco.protocol.messages import LEAVING, PROBE, Hello
from gossiploco.protocol.node import PeerNode
from gossiploco.protocol.peer_table import NEWS_SAMPLE
from gossiploco.simulation.faults import Fault
from gossiploco.simulation.network import SimNetwork
from gossiploco.simulation.runs import SCALE_TIMES, simulate_scale
from gossiploco.simulation.swarm import Settings, SimSwarm


def _node(peers: int = 8, rank: int = 0, on_demand: bool = True, join_round: int | None = 0) -> PeerNode:
    return PeerNode(rank, range(peers), grace_s=1.0, chunk_elems=8, mailbox_bytes=1 << 20, join_round=join_round,
                    links_on_demand=on_demand)


# -- the membership rules, in memory ------------------------------------------------------------------

def test_every_known_peer_starts_a_member_with_no_link_and_an_idle_close_keeps_it_one():
    node = _node()
    assert node.members(0) == list(range(8)) and node.peers.connected == set()
    assert node.peers.unreachable() == [] and node.peers.reachable() == set(range(1, 8))
    assert node.connected(3, 1.0, incarnation="a") == []  # a link to an idle member asks nothing
    assert node.idled(3, 2.0) == []
    assert 3 in node.members(0) and 3 in node.peers.idle and 3 not in node.peers.failed
    assert node.connected(3, 3.0, incarnation="a") == []  # the same process again: still nothing to ask


def test_a_link_to_an_idle_member_that_cannot_be_opened_takes_it_out_of_the_view():
    node = _node()
    node.disconnected(5, 1.0)  # the carrier's dial failed
    assert 5 not in node.members(0) and 5 in node.peers.failed and 5 not in node.peers.reachable()
    assert 5 in node.peers.unreachable()
    actions = node.connected(5, 2.0, incarnation="a")  # it answers again later: asked where it stands, as before
    assert [type(a.message) for a in actions] == [Hello] and actions[0].message.ask


def test_a_new_process_on_an_idle_members_link_is_pending_until_its_own_news():
    node = _node()
    node.connected(4, 1.0, incarnation="first")
    node.idled(4, 2.0)
    assert node.connected(4, 3.0, incarnation="second") == []  # restarted unseen: its news is on its way
    assert 4 not in node.members(0) and node.peers.pending() == [4]
    node.receive(4, Hello(2, 2), 3.1)
    assert 4 in node.members(2) and 4 not in node.members(1)


def test_a_question_says_its_senders_join_round_so_nobody_asks_back():
    """A question (a hello that asks) says its sender's join round once it has one: the peer asked learns it from
    the question and answers without asking back. An undecided sender (``PROBE``) is not asked back either: its
    answer could only say it is undecided, and its news comes later (its announcement, or its record). Asking back
    had made every poll of a joiner three messages instead of two."""
    node = _node()
    node.disconnected(6, 0.5)  # out of the view, as a member found later is
    (question,) = node.connected(6, 0.9, incarnation="b")  # its link up again: asked, saying this node's join round
    assert question.message.join_round == 0 and question.message.ask == node.probe_id
    (reply,) = node.receive(6, Hello(PROBE, 1, ask=3), 1.0)
    assert reply.message.echo == 3 and reply.message.ask == 0 and 6 not in node.members(1)
    (reply,) = node.receive(6, Hello(2, 1, ask=4), 1.1)  # decided since: its question says so
    assert reply.message.echo == 4 and reply.message.ask == 0 and reply.message.join_round == 0
    assert 6 in node.members(2) and 6 not in node.members(1)
    (plain,) = node.receive(2, Hello(PROBE, 1, ask=5), 1.2)
    assert plain.message.ask == 0  # a member in the view is not asked back
    undecided = _node(join_round=None)
    (question,) = undecided.restarted(3, 1.0)
    assert question.message.join_round == PROBE and question.message.ask == undecided.probe_id
    assert [a.message.join_round for a in undecided.announce(PROBE, to=[1, 2])] == [PROBE, PROBE]
    decided = _node(join_round=3)
    assert [a.message.join_round for a in decided.announce(PROBE, to=[1, 2])] == [3, 3]
    assert [a.message.join_round for a in decided.ask_again([1])] == [3]


def test_a_restart_the_carrier_reports_makes_the_member_pending_and_asked():
    node = _node()
    (probe,) = node.restarted(3, 1.0)
    assert 3 not in node.members(0) and node.peers.pending() == [3]
    assert probe.peer == 3 and probe.message.join_round == 0 and probe.message.ask == node.probe_id  # it says its own
    node.receive(3, Hello(4, 4), 1.1)  # its news
    assert 3 in node.members(4) and 3 not in node.members(3)
    assert node.restarted(0, 1.2) == [] and node.restarted(99, 1.2) == []  # itself, or a peer it does not know


@pytest.mark.parametrize("seen_by", ["link", "report"])
def test_a_ready_from_a_process_restarted_unseen_gets_the_group_decided_without_it(seen_by):
    """Links on demand: nobody saw the process go (its link was idle), so no drop marked it lost, and the group its
    previous process completed was handed to the new one's ``Ready`` for that exchange: it then waited out the
    exchange's deadline for chunks from peers long done with it (chaos seed 1414711, 2 deadlines of 6 s). A new
    process, seen on a link or reported by the carrier, counts as lost where it is seen, as a drop would."""
    from gossiploco.protocol.agreement import Lead
    from gossiploco.protocol.messages import Decision, Ready

    node = _node(peers=2)
    node.connected(1, 0.0, incarnation="first")
    lead = node.group_call("mix1/0", 0, 0.0)
    assert isinstance(lead, Lead)  # the lower lead score of two: this peer
    lead.start(node)
    node.receive(1, Ready("mix1/0", 0), 0.1)
    assert lead.poll(node, 0.1).done and lead.outcome() == [0, 1]
    assert node.receive(1, Ready("mix1/0", 0), 0.2)[0].message.group == (0, 1)  # a duplicate: the same answer
    node.idled(1, 5.0)
    node.current_round = 3
    if seen_by == "link":
        node.connected(1, 8.0, incarnation="second")
    else:
        node.restarted(1, 8.0)
    (answer,) = node.receive(1, Ready("mix1/0", 0), 8.1)
    assert answer.message == Decision("mix1/0", 3, (0,))
    assert node.peers.lost_at[1] == 8.0


def test_news_of_a_join_goes_to_linked_peers_those_outside_the_view_and_a_bounded_sample():
    node = _node(peers=200, join_round=None)
    node.connected(7, 0.5)
    node.disconnected(9, 0.6)  # outside the view: asked, its answer re-admits it
    sends = node.announce(3)
    to = {s.peer for s in sends}
    assert {7, 9} <= to and len(to) == 2 + NEWS_SAMPLE
    assert all(s.message.join_round == 3 for s in sends)
    assert next(s for s in sends if s.peer == 9).message.ask and not next(s for s in sends if s.peer == 7).message.ask
    full_mesh = _node(peers=200, join_round=None, on_demand=False)
    assert len(full_mesh.announce(3)) == 199  # a full mesh tells everyone, as before
    assert len(node.announce(PROBE, to=[1, 2])) == 2  # a question to named peers goes to them alone


def test_a_records_join_round_admits_a_peer_found_later_as_its_news_would_and_spares_the_joiners_news():
    """With links on demand a peer found through the directory is admitted from its record's join round
    (``PeerRecord.joined``), at its first read or a later one; a joiner that found the members this way tells only its
    linked peers and a sample, not every member it found (asking every peer found made a joiner open a link to each)."""
    from gossiploco.protocol.messages import STEPPING_OUT

    joiner = PeerNode(500, [], grace_s=1.0, chunk_elems=8, mailbox_bytes=1 << 20, join_round=None, links_on_demand=True)
    for peer in range(200):
        assert joiner.add_peer(peer, joined=peer % 3)  # founders from round 0, others joined later
    assert joiner.members(1) == [500]  # it takes no part yet
    joiner.announce(5)
    assert {p: k for p, k in joiner.peers.joined.items() if p != 500} == {p: p % 3 for p in range(200)}
    assert joiner.members(5) == list(range(200)) + [500] and joiner.peers.pending() == []
    news = joiner.announce(6)
    assert len(news) == NEWS_SAMPLE and all(not s.message.ask for s in news)  # nobody outside its view to ask
    without = PeerNode(500, [], grace_s=1.0, chunk_elems=8, mailbox_bytes=1 << 20, join_round=None, links_on_demand=True)
    for peer in range(200):
        without.add_peer(peer)  # found with no record's word (before): pending, so every one of them was asked
    assert len(without.announce(5)) == 200

    member = _node(peers=8)
    assert member.add_peer(9, joined=-1) and member.members(9) == list(range(8))  # not decided yet: pending
    assert not member.add_peer(9, joined=STEPPING_OUT) and 9 not in member.members(20)
    assert not member.add_peer(9, joined=4)  # a later read: it decided, so it is a member from round 4
    assert member.members(3) == list(range(8)) and member.members(4) == list(range(8)) + [9]
    assert 9 not in member.peers.said  # inferred, not said: its own hello still counts as news
    member.add_peer(9, joined=6)  # a record never moves a member already in the view
    assert member.peers.joined[9] == 4

    member.disconnected(3, 1.0)  # its link failed: only its own news re-admits it, never a record read maybe older
    member.add_peer(3, joined=0)
    assert 3 not in member.members(10)
    member.receive(2, Hello(LEAVING, 5), 2.0)  # it left: likewise
    member.add_peer(2, joined=0)
    assert 2 not in member.members(10)
    member.restarted(5, 3.0)  # a new process of it spoke: likewise
    member.add_peer(5, joined=0)
    assert 5 not in member.members(10)
    assert member.forget_peer(2) and member.add_peer(2, joined=7) and 2 in member.members(7)  # gone and back: new

    full_mesh = _node(peers=8, on_demand=False)
    assert full_mesh.add_peer(9, joined=0) and 9 not in full_mesh.members(0)  # a full mesh keeps to hellos


def test_a_full_mesh_carrier_keeps_the_former_rules():
    node = _node(on_demand=False)
    assert node.peers.idle == set() and node.peers.unreachable() == list(range(1, 8))
    actions = node.connected(3, 1.0)
    assert node.peers.pending() == [] and actions == []  # a static member known from the start: in the view
    assert node.links_ahead("mix2/0", 0) == []


def test_links_ahead_are_this_peers_bucket_of_the_coming_exchange():
    from gossiploco.protocol import groups

    node = _node(peers=100)
    node.group_seed, node.group_size = 5, 16
    ahead = node.links_ahead("mix2/3", 3)
    assert ahead == [p for p in groups.group_of(5, "mix2/3", list(range(100)), 0, 16) if p != 0]
    assert 0 < len(ahead) <= groups.cap(16)
    assert _node(peers=100, join_round=None).links_ahead("mix2/3", 3) == []  # takes no part yet: nothing ahead


# -- the simulated carrier ---------------------------------------------------------------------------

def _network(**options) -> tuple[SimNetwork, list[tuple]]:
    net = SimNetwork(random.Random(0), latency_s=0.01, heartbeat_s=1.0, **options)
    net.idle_s = 5.0
    events: list[tuple] = []
    net.on_connect = lambda a, b: events.append(("up", a, b, round(net.now, 3)))
    net.on_disconnect = lambda a, b: events.append(("down", a, b, round(net.now, 3)))
    net.on_idle = lambda a, b: events.append(("idle", a, b, round(net.now, 3)))
    return net, events


def test_a_message_opens_a_link_arrives_once_it_is_up_and_the_link_closes_when_idle():
    net, events = _network()
    got = []
    net.send(0, 1, 100, lambda: got.append(net.now))
    net.send(0, 1, 100, lambda: got.append(net.now))
    assert events == [] and got == []  # nothing is up before the handshake
    net.run_until(0.5)
    assert ("up", 0, 1, 0.02) in events and ("up", 1, 0, 0.02) in events  # a handshake: two latencies
    assert len(got) == 2 and all(abs(t - 0.03) < 1e-3 for t in got)  # then one more latency each, in order
    net.run_until(20.0)
    assert ("idle", 0, 1, 5.03) in events and ("idle", 1, 0, 5.03) in events  # 5 s after the last arrival
    assert not net.is_up(0, 1) and net.peak_links[0] == 1 and not any(e[0] == "down" for e in events)


def test_a_link_to_a_peer_that_does_not_answer_fails_after_the_handshake_deadline_then_redials():
    net, events = _network()
    alive = {0: True, 1: False}
    net.answers = lambda p: alive[p]
    got = []
    net.send(0, 1, 100, lambda: got.append(net.now))
    net.run_until(0.55)
    alive[1] = True  # within the deadline: the handshake's retries get through
    net.run_until(2.0)
    assert got and [e[0] for e in events][:2] == ["up", "up"]
    net2, events2 = _network()
    net2.answers = lambda p: p == 0
    net2.send(0, 1, 100, lambda: got.append(-1.0))
    net2.run_until(3.0)
    assert events2 == [("down", 0, 1, 1.0)]  # only the sender hears, once, and nothing arrives
    assert -1.0 not in got
    net2.answers = lambda p: True
    net2.run_until(4.0)
    assert net2.is_up(0, 1)  # it redials, as a dropped connection does


def test_past_its_cap_a_peer_closes_its_least_recently_used_idle_link_and_never_a_busy_one():
    from gossiploco.simulation.network import MIN_IDLE_S

    net, events = _network()
    net.idle_s, net.links_cap = 100.0, 2

    def send_at(t: float, *others: int) -> None:
        net.at(t, lambda: [net.send(0, other, 10, lambda: None) for other in others])
    send_at(0.0, 1, 2)
    send_at(0.1, 2)  # 2 used again: 1 is the least recently used
    send_at(0.1 + MIN_IDLE_S, 3)
    net.run_until(0.2 + MIN_IDLE_S)
    assert [e[:3] for e in events if e[0] == "idle"] == [("idle", 0, 1), ("idle", 1, 0)]
    assert net.is_up(0, 2) and net.is_up(0, 3) and net.peak_links[0] == 2
    send_at(0.3 + MIN_IDLE_S, 2, 3, 4)  # both others busy within MIN_IDLE_S: over the cap, none closed
    net.run_until(0.4 + MIN_IDLE_S)
    assert net.is_up(0, 2) and net.is_up(0, 3) and net.is_up(0, 4) and net.peak_links[0] == 3


# -- whole swarms --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sixty_four_peers_with_links_on_demand_under_churn_hold_every_property_and_far_fewer_links():
    """64 peers on consumer links in buckets of 16, 1% of them crashing each round and coming back: every property
    holds, every peer finishes, Mix1 completes about as often as over a full mesh, and a peer holds at most the links
    of its buckets (measured: a median peak of 24-39 links a peer, against 63 over a full mesh)."""
    mesh = simulate_scale(2, 64, rounds=4, churn=0.01)
    links = simulate_scale(2, 64, rounds=4, churn=0.01, links_idle_s=30.0)
    for result in (mesh, links):
        assert result.violations == [] and all(k >= 4 for k in result.finished.values()), result.violations[:3]
    a, b = mesh.stats["per_peer"], links.stats["per_peer"]
    assert a["connections_peak"] == 63
    assert b["connections_peak"] <= 3 * 16, b
    assert b["mix1_completion"] >= a["mix1_completion"] - 0.03, (a, b)
    assert b["control_per_round"] <= 2 * a["control_per_round"], (a, b)


@pytest.mark.slow
def test_with_links_on_demand_links_and_control_messages_stay_flat_from_16_to_256_peers():
    """Scale as a property, churn included: with links on demand a peer's peak links, messages and control messages
    per round at 256 peers stay within a bound of 16 peers' that does not grow with the swarm (links: within 4x,
    where a full mesh holds 16x as many; messages: within 2x)."""
    small, large = (simulate_scale(4, m, rounds=4, churn=0.01, links_idle_s=30.0) for m in (16, 256))
    for result in (small, large):
        assert result.violations == [] and all(k >= 4 for k in result.finished.values())
    a, b = small.stats["per_peer"], large.stats["per_peer"]
    assert b["connections_peak"] <= 4 * a["connections_peak"] < 255, (a, b)
    for column in ("messages_per_round", "control_per_round", "control_received_per_round"):
        assert b[column] <= 2 * a[column], (column, a[column], b[column])


@pytest.mark.slow
def test_a_restarted_peer_finds_the_others_in_the_directory_by_their_records_join_rounds():
    """Over links on demand a restarted peer knows nobody and finds the others in the run's directory, as the
    runtime's peer does (``SimSwarm.records``): peer 5 restarted in round 1 and took part again from a later round;
    peer 3, restarted after it, admits peer 5 from the round its record says (not from round 0, as a static list
    would), and the founders from 0."""
    settings = Settings(peers=16, rounds=5, group_size=16, links="consumer", mix2="gossip", links_idle_s=10.0,
                        **SCALE_TIMES)
    swarm = SimSwarm(3, settings)
    period = SCALE_TIMES["inner_s"]
    back = 3.2 * period + 5.0
    at_start = {}  # peer 3's view the moment its new process starts, before any message reached it
    swarm.net.at(back + 1e-9, lambda: at_start.update(swarm.peers[3].node.peers.joined))
    result = swarm.run([Fault("restart", 1.2 * period, 1.2 * period + 5.0, peer=5),
                        Fault("restart", 3.2 * period, back, peer=3)])
    assert result.violations == [], result.violations[:3]
    assert all(k == 5 for k in swarm.finished.values()) and len(swarm.finished) == 16
    five, three = swarm.peers[5].node, swarm.peers[3].node
    assert swarm.peers[3].reads_records and swarm.peers[5].reads_records
    rejoined = five.peers.joined[5]
    assert 1 <= rejoined < three.peers.joined[3] and three.peers.joined[5] == rejoined
    assert at_start == {**dict.fromkeys(set(range(16)) - {3, 5}, 0), 5: rejoined}  # read, not heard
    assert {p: three.peers.joined[p] for p in range(16) if p not in (3, 5)} == dict.fromkeys(set(range(16)) - {3, 5}, 0)


def test_a_member_dead_behind_an_idle_link_costs_the_others_at_most_one_grace_window():
    """64 peers, links on demand: peer 9 crashes for good at the start of round 1, when nobody holds a link to it
    (its links closed idle). Nobody saw it go; each peer finds out when it next needs a link to it. No other peer
    blocks more than one grace window and a control send longer than in the same run without the crash."""
    from gossiploco.protocol.agreement import CONTROL_SEND_S

    linked_at_crash = []

    def run(faults):
        settings = Settings(peers=64, rounds=3, group_size=16, links="consumer", mix2="gossip", links_idle_s=10.0,
                            **SCALE_TIMES)
        swarm = SimSwarm(6, settings)
        swarm.net.at(start - 1e-6, lambda: linked_at_crash.append([p for p in range(64) if swarm.net.is_up(9, p)]))
        result = swarm.run(faults)
        assert result.violations == [], result.violations[:3]
        return swarm

    start = SCALE_TIMES["inner_s"] + 13.0  # round 1's first links closed idle, its Mix2 links not yet opened again
    calm = run([])
    dead = run([Fault("crash", start, start + 1000.0, peer=9)])
    assert linked_at_crash[-1] == []  # nobody saw it go
    grace = SCALE_TIMES["grace_s"]
    before = {(p, r): b for p, r, _, b, _ in calm.timings}
    extra = [b - before[(p, r)] for p, r, _, b, _ in dead.timings if p != 9 and (p, r) in before]
    assert max(extra) <= grace + CONTROL_SEND_S + 0.05 * grace, sorted(extra)[-5:]
    assert statistics.median(extra) <= 0.05 * grace
    assert all(k >= 3 for p, k in dead.finished.items() if p != 9)
    found = sum(1 for p in range(64) if p != 9 and 9 in dead.peers[p].node.peers.failed)
    assert found > 0  # some did need a link to it, and found it dead
