"""Links on demand over the real ZeroMQ transport (``ZmqExchange(links_idle_s=...)``, ``transport.zmq_links``):
CurveZMQ and sealed data on loopback, real sockets and threads. No socket to a member until something is sent to it,
exchanges that open what they need, idle links closed without a failure and opened again, and a member that died
behind an idle link found by the first send to it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import once_free, wait_until
from gossiploco.config import ConfigError, RunConfig
from gossiploco.errors import ExchangeError, PeerFailed
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust
from gossiploco.transport.zmq_exchange import ZmqExchange
from gossiploco.transport.zmq_links import IDLE, LOST, ROOM_IDLE_S, UNOPENED, LinksOnDemand
from tests.test_exchange import free_ports, run_all

IDLE_S = 1.5


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def swarm():
    made: list[ZmqExchange] = []

    def make(world: int, idle_s: float = IDLE_S, heartbeat_s: float = 2.0, cap: int | None = None) -> list[ZmqExchange]:
        key = SwarmKey.generate()
        for attempt in range(5):
            endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(world)]
            try:
                for r in range(world):
                    made.append(ZmqExchange(r, endpoints, "links-test", 10.0, trust=Trust.static(key, r, world),
                                            heartbeat_s=heartbeat_s, links_idle_s=idle_s, grace_s=1.0,
                                            links_cap=cap))
                return made[-world:]
            except ExchangeError:
                for ex in made:
                    ex.close()
                made.clear()
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    try:
        yield make
    finally:
        for ex in made:
            ex.close()


def _links(ex: ZmqExchange) -> dict[str, int]:
    return ex.sockets.links.counts()


def test_members_need_no_socket_and_an_exchange_opens_only_what_it_uses(swarm):
    peers = swarm(4)
    assert all(ex.sockets.dealers == {} for ex in peers)  # nothing dialed at start
    assert all(ex.members(0) == [0, 1, 2, 3] for ex in peers)  # yet every peer is a member
    values = [torch.full((1000,), float(r)) for r in range(4)]
    out = run_all([lambda r=r: peers[r].all_reduce_mean("mix1/0", values[r], [0, 1, 2, 3]) for r in range(4)])
    assert all(torch.equal(o, torch.full((1000,), 1.5)) for o in out)
    swapped = run_all([lambda: peers[0].swap("mix2/0", 1, values[0]), lambda: peers[1].swap("mix2/0", 0, values[1])])
    assert torch.equal(swapped[0], values[1]) and torch.equal(swapped[1], values[0])
    # a ring sends to its next member only: peer 2 never sent anything to peer 0
    assert 0 not in peers[2].sockets.dealers and 3 in peers[2].sockets.dealers


def test_idle_links_close_without_a_failure_and_open_again(swarm):
    peers = swarm(3)
    values = [torch.full((500,), float(r)) for r in range(3)]
    run_all([lambda r=r: peers[r].all_reduce_mean("mix1/0", values[r], [0, 1, 2]) for r in range(3)])
    assert wait_until(lambda: all(ex.connected() for ex in peers), 5.0)
    assert wait_until(lambda: all(ex.sockets.dealers == {} for ex in peers), IDLE_S + 4.0)  # closed when idle
    assert all(ex.members(1) == [0, 1, 2] for ex in peers)  # no failure: still members
    assert all(ex.connected() == [] and _links(ex)["closed_idle"] >= 1 for ex in peers)
    assert all(not ex.inspect(lambda node: node.peers.failed) for ex in peers)
    out = run_all([lambda r=r: peers[r].all_reduce_mean("mix1/1", values[r], [0, 1, 2]) for r in range(3)])
    assert all(torch.equal(o, torch.full((500,), 1.0)) for o in out)  # opened again on demand
    assert all(_links(ex)["opened"] >= 2 for ex in peers)


def test_past_its_cap_a_peer_closes_the_link_it_used_least_lately_without_a_failure_and_opens_it_again(swarm):
    """``links_cap`` = 1 and an idle time of a minute: peer 0 swaps with peer 1, then 2, then 3. Each new link puts
    it past its cap, and the link it used least lately is closed, once unused for ``ROOM_IDLE_S``, as an idle one is
    (no failure: a member still), long before its idle time; a link closed so opens again on demand."""
    peers = swarm(4, idle_s=60.0, cap=1)
    values = [torch.full((200,), float(r)) for r in range(4)]
    for r, other in enumerate((1, 2, 3)):
        out = run_all([lambda: peers[0].swap(f"mix2/{r}", other, values[0]),
                       lambda: peers[other].swap(f"mix2/{r}", 0, values[other])])
        assert torch.equal(out[0], values[other]) and torch.equal(out[1], values[0])
        assert wait_until(lambda: set(peers[0].sockets.dealers) == {other}, ROOM_IDLE_S + 5.0), \
            (other, set(peers[0].sockets.dealers))
    counts = _links(peers[0])
    assert counts["closed_for_room"] == 2 and counts["closed_idle"] == 2 and counts["linked"] == 1
    assert peers[0].members(3) == [0, 1, 2, 3] and not peers[0].inspect(lambda node: node.peers.failed)
    assert all(0 in peers[other].members(3) for other in (1, 2, 3))
    out = run_all([lambda: peers[0].swap("mix2/3", 1, values[0]), lambda: peers[1].swap("mix2/3", 0, values[1])])
    assert torch.equal(out[0], values[1]) and _links(peers[0])["opened"] == 4


def test_past_the_cap_the_least_recently_used_links_up_and_unused_for_a_second_are_closed_and_no_others():
    links = LinksOnDemand(idle_s=30.0, handshake_s=2.0, cap=2)
    for peer in (1, 2, 3, 4):
        links.park(peer, f"tcp://a:{peer}")
    for peer, t in ((1, 0.0), (2, 0.5), (3, 0.9)):
        links.open(peer, now=t)
        links.link_up(peer)
    assert links.due(now=0.95) == ([], [])  # over the cap, but every link was used within ROOM_IDLE_S
    assert links.due(now=1.25) == ([1], [])  # the least recently used, unused for a second
    links.park(1, "tcp://a:1", idle=True)  # as the transport closes it
    links.open(4, now=1.3)  # over again; its handshake is not done: never closed for room
    links.used(2, now=1.35)
    assert links.due(now=1.6) == ([], [])  # 2 and 3 used within a second, 4 not up
    assert links.due(now=2.0) == ([3], [])  # 3 is now the least recently used unused for a second
    assert links.counts()["closed_for_room"] == 2 and links.counts()["linked"] == 3
    uncapped = LinksOnDemand(idle_s=30.0, handshake_s=2.0)
    for peer in range(1, 40):
        uncapped.park(peer, f"tcp://a:{peer}")
        uncapped.open(peer, now=0.0)
        uncapped.link_up(peer)
    assert uncapped.due(now=20.0) == ([], [])  # no cap: only the idle time closes links
    with pytest.raises(ValueError, match="cap"):
        LinksOnDemand(idle_s=30.0, handshake_s=2.0, cap=0)


def test_a_peer_leaving_tells_those_whose_links_to_it_are_up_though_its_own_to_them_are_closed(swarm, caplog):
    """Each end closes its own idle links: after a ring 0 -> 1 -> 2 -> 0 peer 0 holds a link to 1 only, while peer 2
    holds one to 0. Peer 0 leaving tells peer 2 too (it heard from 2 lately), so 2 sees a goodbye, not a lost link."""
    peers = swarm(3)
    values = [torch.full((300,), float(r)) for r in range(3)]
    run_all([lambda r=r: peers[r].all_reduce_mean("mix1/0", values[r], [0, 1, 2]) for r in range(3)])
    assert wait_until(lambda: 0 in peers[2].connected(), 5.0)
    assert 2 not in peers[0].sockets.dealers  # peer 0 never sent to peer 2
    assert 2 in peers[0].sockets.links.lately()
    peers[0].leave(linger_s=1.0)
    assert wait_until(lambda: all(0 not in peers[r].members(1) for r in (1, 2)), 5.0)
    assert all(peers[r].inspect(lambda node: 0 in node.peers.left) for r in (1, 2))  # a goodbye heard
    peers[2].close()  # its notes are logged
    assert "lost the connection to peer 0" not in caplog.text


@pytest.mark.slow  # waits out a frozen member's handshake deadline (8-9 s)
def test_a_peer_leaving_waits_for_a_slow_handshake_to_say_goodbye_and_names_whom_it_could_not_tell(swarm, caplog):
    """Peer 0 leaves while peer 2 answers handshakes slowly (its ZAP handler held 2.2 s a handshake, one at a time, so
    the control link that carries the goodbye is up after about 4.4 s), as on a machine where many peers leave at
    once (given 1 s, 28 of 32 peers of a ``gossiploco swarm`` left some peers untold, which took them for lost): it
    waits for the links it opened to say it, up to their handshake deadline, so 2 hears a goodbye. A peer that never
    answers (frozen) is waited for no longer than that, and named."""
    peers = swarm(4, heartbeat_s=4.0)
    values = [torch.full((300,), float(r)) for r in range(4)]
    run_all([lambda: peers[0].swap("mix2/0", 3, values[0]), lambda: peers[3].swap("mix2/0", 0, values[3])])
    run_all([lambda r=r: peers[r].all_reduce_mean("mix1/0", values[r], [0, 1, 2]) for r in range(3)])
    assert wait_until(lambda: 0 in peers[2].connected(), 5.0)
    assert 2 not in peers[0].sockets.dealers  # peer 0 never sent to peer 2: its goodbye needs a link made now
    slow = peers[2].sockets.auth
    callback = slow.callback
    slow.callback = lambda domain, key: time.sleep(2.2) or callback(domain, key)  # per handshake, one at a time
    assert wait_until(lambda: 3 not in peers[0].sockets.dealers, IDLE_S + 4.0)
    assert 3 in peers[0].sockets.links.lately()  # it heard from 3 lately: 3's link to it may be up
    frozen = _listening_in_place_of(peers[3])  # takes connections, answers no handshake: reported only after PATIENCE
    try:
        began = time.monotonic()
        peers[0].leave(linger_s=1.0)
        took = time.monotonic() - began
    finally:
        frozen.close()
    assert wait_until(lambda: 0 not in peers[2].members(1), 5.0)
    assert peers[2].inspect(lambda node: 0 in node.peers.left)  # a goodbye heard, after its slow handshake
    wait_s = peers[0].sockets.links.handshake_s + 1.0  # the handshake deadline and a control send
    assert wait_s - 0.2 <= took < wait_s + 2.0, took
    assert "leaving without telling 1 of 3 peer(s) (3)" in caplog.text
    peers[2].close()  # its notes are logged
    assert "lost the connection to peer 0" not in caplog.text


def _idle_after_a_ring(swarm, heartbeat_s: float) -> tuple[list[ZmqExchange], list[torch.Tensor]]:
    """Three peers on links on demand after one ring all-reduce, once every link they opened closed as idle."""
    peers = swarm(3, heartbeat_s=heartbeat_s)
    values = [torch.full((200,), float(r)) for r in range(3)]
    run_all([lambda r=r: peers[r].all_reduce_mean("mix1/0", values[r], [0, 1, 2]) for r in range(3)])
    assert wait_until(lambda: all(ex.sockets.dealers == {} for ex in peers), IDLE_S + 4.0)
    return peers, values


def _listening_in_place_of(peer: ZmqExchange):
    """Close ``peer`` and listen on its port (a plain socket): its kernel takes connections, and with nobody accepting
    them nothing answers a handshake (a frozen process)."""
    host, port = peer.bound.removeprefix("tcp://").rsplit(":", 1)
    peer.close()

    def bind() -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, int(port)))
        except OSError:
            listener.close()
            raise
        return listener

    frozen = once_free(bind)  # its port, freed a moment ago
    frozen.listen(64)
    return frozen


def test_a_link_dropped_after_its_idle_time_is_closed_as_idle_when_the_check_came_late(swarm, caplog):
    """Peer 2's link to peer 0 stays up past its idle time (its receiving thread's check comes late, as on a starved
    machine: held back here). Peer 0 leaves after its last message with peer 2 fell out of its ``lately_s``, so it
    does not tell peer 2: the drop is an idle close there, no lost peer (the swarm test of CI met this)."""
    peers = swarm(3, idle_s=0.3)
    late = peers[2].sockets.links
    due = late.due
    late.due = lambda now=None: ([], due(now)[1])  # its idle links are never closed by the check
    values = [torch.full((300,), float(r)) for r in range(3)]
    run_all([lambda r=r: peers[r].all_reduce_mean("mix1/0", values[r], [0, 1, 2]) for r in range(3)])
    assert wait_until(lambda: 0 in peers[2].connected(), 5.0)
    assert wait_until(lambda: 2 not in peers[0].sockets.links.lately(), 3 * peers[0].sockets.links.lately_s)
    peers[0].leave(linger_s=1.0)
    assert wait_until(lambda: 0 not in peers[2].connected(), 5.0)
    assert _links(peers[2])["closed_idle"] >= 1 and 0 in peers[2].members(1)  # parked, as an idle link is
    assert not peers[2].inspect(lambda node: node.peers.failed)
    peers[2].close()  # its notes are logged
    assert "lost the connection to peer 0" not in caplog.text


def test_a_member_dead_behind_an_idle_link_is_found_by_the_next_send_to_it(swarm):
    peers = swarm(3, heartbeat_s=1.0)
    values = [torch.full((200,), float(r)) for r in range(3)]
    run_all([lambda r=r: peers[r].all_reduce_mean("mix1/0", values[r], [0, 1, 2]) for r in range(3)])
    assert wait_until(lambda: all(ex.sockets.dealers == {} for ex in peers), IDLE_S + 4.0)
    peers[2].close()  # nobody holds a link to it: nobody sees it go
    time.sleep(0.2)
    assert peers[0].members(1) == [0, 1, 2]
    began = time.monotonic()
    with pytest.raises(PeerFailed):
        peers[0].swap("mix2/1", 2, values[0])  # its link cannot be opened within the handshake deadline
    assert time.monotonic() - began < 10.0
    assert wait_until(lambda: 2 not in peers[0].members(1), 3.0)
    assert peers[1].members(1) == [0, 1, 2]  # peer 1 never needed it, and still counts it


def test_a_member_frozen_behind_an_idle_link_is_found_by_the_next_send_to_it_before_any_exchange_deadline(swarm):
    """A frozen process: its kernel takes TCP connections (a listening socket nobody reads, here, on its port) and
    nothing in it answers a handshake. The send to it fails with ``PeerFailed`` (not the exchange's deadline) and the
    member leaves the view, as a full mesh's heartbeat would have it."""
    from gossiploco.transport.zmq_links import PATIENCE

    heartbeat_s = 1.0
    peers, values = _idle_after_a_ring(swarm, heartbeat_s)
    frozen = _listening_in_place_of(peers[2])
    try:
        began = time.monotonic()
        with pytest.raises(PeerFailed):
            peers[0].swap("mix2/1", 2, values[0])  # the exchange's own deadline is 10 s, and would raise a timeout
        taken = time.monotonic() - began
        assert taken < 10.0 and taken >= PATIENCE * heartbeat_s * 0.9, taken
        assert wait_until(lambda: 2 not in peers[0].members(1), 3.0)
        assert _links(peers[0])["frozen"] == 1
    finally:
        frozen.close()


@pytest.mark.slow  # a link's idle time, then up to PATIENCE handshake deadlines (5 s each)
@pytest.mark.parametrize("after", ["dies", "drops every connection"])
def test_a_member_dying_mid_handshake_on_a_link_opened_on_demand_is_reported_before_any_exchange_deadline(swarm, after):
    """Its process takes the connections the link opens and dies before the handshakes end: the connections drop with
    no refusal (libzmq dials again, and is refused from then on). That is no answer from a live process: the dial
    again is watched as a link just opened, and the member is reported within a handshake deadline or two, not kept
    until its record expires (as a real chaos trial under a cap of 2 showed: 50 s of exchanges waiting for it).
    ``drops every connection``: what this peer's tunnel port does for a member behind NAT whose relay is gone (it
    takes each connection and closes it when the relayed stream cannot be opened): reported after ``PATIENCE``
    handshake deadlines from the first taking."""
    import threading

    from gossiploco.transport.zmq_links import PATIENCE

    heartbeat_s = 1.0
    peers, values = _idle_after_a_ring(swarm, heartbeat_s)
    dying = _listening_in_place_of(peers[2])
    taken: list[bytes] = []

    def die_mid_handshake() -> None:
        dying.settimeout(5.0 if after == "dies" else 12.0)
        try:
            while True:
                conn, _ = dying.accept()  # a connection the link opens: its greeting read, then dropped
                conn.settimeout(2.0)
                taken.append(conn.recv(64))
                conn.close()
                if after == "dies":
                    break
        except OSError:
            pass
        dying.close()  # what waits in its backlog is reset, and every dial from now on is refused

    dier = threading.Thread(target=die_mid_handshake, daemon=True)
    dier.start()
    began = time.monotonic()
    with pytest.raises(PeerFailed):
        peers[0].swap("mix2/1", 2, values[0])  # the exchange's own deadline is 10 s, and would raise a timeout
    reported = time.monotonic() - began
    assert reported < 10.0
    if after != "dies":
        assert reported >= PATIENCE * heartbeat_s * 0.9 and len(taken) > 1, (reported, len(taken))
        with contextlib.suppress(OSError):
            dying.shutdown(socket.SHUT_RDWR)  # (wakes the accept)
    dier.join(15.0)
    assert taken and taken[0], "the link's first connection was never taken"
    assert wait_until(lambda: 2 not in peers[0].members(1), 3.0)


def test_a_member_restarted_behind_an_idle_link_is_admitted_as_its_new_process(swarm):
    """Nobody held a link to peer 1 when it restarted, so nobody saw its old process go: its new process must be
    taken for a restart (pending until it says where it stands), not refused as another process claiming it while
    its link is up (which is what a full mesh may assume)."""
    peers = swarm(2)
    values = [torch.full((100,), float(r)) for r in range(2)]
    run_all([lambda r=r: peers[r].swap("mix2/0", 1 - r, values[r]) for r in range(2)])
    assert wait_until(lambda: all(ex.sockets.dealers == {} for ex in peers), IDLE_S + 4.0)
    endpoint, trust = peers[1].bound, peers[1].trust
    peers[1].close()
    for attempt in range(20):  # its port, freed a moment ago
        try:
            peers[1] = ZmqExchange(1, {0: peers[0].bound, 1: endpoint}, "links-test", 10.0, trust=trust, join_round=None,
                                   heartbeat_s=2.0, links_idle_s=IDLE_S, grace_s=1.0)
            break
        except ExchangeError:
            time.sleep(0.1)
    peers[1].announce(3)  # the new process takes part from round 3, and says so
    assert wait_until(lambda: peers[0].members(3) == [0, 1] and peers[0].members(2) == [0], 10.0), peers[0].members(3)
    got = run_all([lambda r=r: peers[r].swap("mix2/3", 1 - r, values[r]) for r in range(2)])
    assert torch.equal(got[0], values[1]) and torch.equal(got[1], values[0])
    assert peers[0].security_counts()["rejected_messages"] == {}


def _strangers() -> tuple[list[ZmqExchange], Trust]:
    """Two peers of one swarm on links on demand, each knowing only itself (discovery finds the other later), and
    the swarm's trust (for the keys ``add_peer`` is given)."""
    key = SwarmKey.generate()
    for attempt in range(5):
        endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
        made: list[ZmqExchange] = []
        try:
            for r in range(2):
                made.append(ZmqExchange(r, {r: endpoints[r]}, "links-test", 10.0, trust=Trust.static(key, r, 2),
                                        links_idle_s=IDLE_S, heartbeat_s=2.0))
            return made, Trust.static(key, 0, 2)
        except ExchangeError:  # a port taken meanwhile: again on others
            for ex in made:
                ex.close()
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


def test_members_found_later_are_asked_where_they_stand_without_a_handshake_to_ask_them():
    """Discovery (``add_peer``) parks a member found later; a probe (which says its sender's join round) and its
    answer tell each the other's join round, so both views hold both though neither made a socket for the other up
    front."""
    peers, trust = _strangers()
    try:
        assert peers[0].add_peer(1, peers[1].bound, trust.key_of(1))
        assert peers[0].members(0) == [0]  # pending until it says where it stands
        time.sleep(0.3)  # peer 1 does not know peer 0 yet: the probe is dropped there
        assert peers[1].add_peer(0, peers[0].bound, trust.key_of(0))
        assert wait_until(lambda: peers[0].members(0) == [0, 1] and peers[1].members(0) == [0, 1], 10.0)
    finally:
        for ex in peers:
            ex.close()


def test_members_found_with_their_records_join_round_are_admitted_without_a_link_and_exchange():
    """A record's join round (``add_peer(joined=...)``, from ``PeerRecord.joined``) admits a member found later with
    no socket made and nothing asked; an undecided one (-1) stays pending, unasked, until a later read says it decided.
    Then the two exchange as members, opening their link for it."""
    peers, trust = _strangers()
    try:
        assert peers[0].add_peer(1, peers[1].bound, trust.key_of(1), joined=-1)
        assert peers[1].add_peer(0, peers[0].bound, trust.key_of(0), joined=0)
        assert peers[1].members(0) == [0, 1] and peers[0].members(0) == [0]
        assert not peers[0].add_peer(1, peers[1].bound, trust.key_of(1), joined=0)  # a later read: it decided
        assert peers[0].members(0) == [0, 1] and peers[0].joined_round == 0
        time.sleep(0.3)  # a probe would have gone out by now
        assert all(ex.sockets.dealers == {} and _links(ex)["opened"] == 0 for ex in peers)
        values = [torch.full((100,), float(r)) for r in range(2)]
        got = run_all([lambda r=r: peers[r].swap("mix2/0", 1 - r, values[r]) for r in range(2)])
        assert torch.equal(got[0], values[1]) and torch.equal(got[1], values[0])
        assert all(_links(ex)["opened"] == 1 for ex in peers)
    finally:
        for ex in peers:
            ex.close()


def test_the_bookkeeping_reports_idle_links_and_unanswered_handshakes_once():
    links = LinksOnDemand(idle_s=5.0, handshake_s=2.0)
    links.park(1, "tcp://a:1")
    links.park(2, "tcp://a:2")
    assert links.open(1, now=0.0) == "tcp://a:1" and links.open(1, now=0.5) is None
    assert links.open(2, now=0.0) == "tcp://a:2"
    links.link_up(1)
    assert links.due(now=1.0) == ([], [])
    assert links.due(now=2.0) == ([], [2]) and links.due(now=2.5) == ([], [])  # peer 2: reported once
    links.used(1, now=3.0)
    assert links.due(now=7.7) == ([], []) and links.due(now=8.0) == ([1], [])
    assert links.due(now=8.1) == ([], [])  # looked at most every CHECK_S
    links.park(1, "tcp://a:1")
    assert links.counts()["parked"] == 1 and links.tracks(1) and links.open(1, now=9.0) == "tcp://a:1"
    links.park(1, "tcp://a:1")
    assert links.forget(1) and not links.tracks(1) and not links.forget(1)


def test_a_link_made_again_after_a_refused_handshake_is_reported_if_its_new_connection_is_never_taken():
    """A refused handshake is a live process's answer (not reported); the link made again to try once more is watched
    anew, so a member that died meanwhile is reported when that connection is never taken."""
    links = LinksOnDemand(idle_s=30.0, handshake_s=2.0)
    links.park(1, "tcp://a:1")
    links.open(1, now=0.0)
    links.answered(1, now=0.1)  # TCP taken
    links.answered(1, refused=True, now=0.2)  # and the handshake refused: alive, no timer left
    assert links.due(now=10.0) == ([], [])
    links.redialed(1, now=11.0)  # ``retry_refused`` made its sockets again; its process has died since
    assert links.due(now=12.5) == ([], []) and links.due(now=13.0) == ([], [1])
    links.redialed(1, now=20.0)
    links.answered(1, now=20.1)
    links.answered(1, refused=True, now=20.2)  # refused again: alive
    assert links.due(now=40.0) == ([], [])
    links.redialed(2, now=41.0)  # not a link made on demand: nothing to watch
    assert links.due(now=50.0) == ([], [])


def test_a_member_parked_on_a_relayed_path_is_opened_through_it_until_parked_on_another():
    links = LinksOnDemand(idle_s=5.0, handshake_s=2.0)
    links.park(1, "tcp://127.0.0.1:4100", relayed=True)  # this peer's tunnel port for member 1
    links.park(2, "tcp://a:2")
    assert links.through_relay(1) and not links.through_relay(2) and links.counts()["relayed"] == 1
    assert links.open(1, now=0.0) == "tcp://127.0.0.1:4100" and links.through_relay(1)  # its sockets dial the tunnel
    links.park(1, "tcp://b:1", idle=True)  # closed when idle, now on a direct path
    assert not links.through_relay(1) and links.counts()["relayed"] == 0
    links.park(2, "tcp://127.0.0.1:4102", relayed=True)
    assert links.forget(2) and not links.through_relay(2)


def test_a_dropped_link_is_unopened_idle_or_lost_by_whether_it_came_up_and_when_it_was_last_used():
    links = LinksOnDemand(idle_s=1.0, handshake_s=2.0)
    links.park(1, "tcp://a:1")
    links.open(1, now=0.0)
    assert links.link_down(1, now=0.1) == UNOPENED  # its handshake never ended: dialed again, no failure
    links.link_up(1)
    links.used(1, now=1.0)
    assert links.link_down(1, now=1.9) == LOST  # used within its idle time: a lost peer
    links.link_up(1)
    assert links.link_down(1, now=2.0) == IDLE  # idle for idle_s: the check would have closed it


def test_the_peers_contacted_lately_are_kept_as_long_as_their_own_links_may_stay_up_and_no_longer():
    links = LinksOnDemand(idle_s=1.0, handshake_s=2.0)
    links.park(1, "tcp://a:1")
    assert links.open(1, now=0.0) == "tcp://a:1"  # sent to
    links.used(2, now=0.5)  # heard from a peer whose own link here is up, though this peer's to it is parked
    assert links.lately(now=1.0) == [1, 2]
    assert links.lately(now=0.5 + links.lately_s) == [2] and links.lately(now=1.0 + links.lately_s) == []
    assert links.counts()["lately"] == 2
    links.due(now=10.0)
    assert links.counts()["lately"] == 0  # pruned: as many as the peer's recent contacts, never the swarm


def test_a_connection_taken_whose_handshake_never_ends_is_reported_once_and_a_refusal_never():
    """A frozen process's kernel takes the connection and nothing answers: reported after ``PATIENCE`` handshake
    deadlines from the taking, once a link opened; a refused handshake is a live process's answer."""
    from gossiploco.transport.zmq_links import PATIENCE

    links = LinksOnDemand(idle_s=100.0, handshake_s=2.0)
    for peer in (1, 2, 3):
        links.park(peer, f"tcp://a:{peer}")
        links.open(peer, now=0.0)
        links.answered(peer, now=1.0)  # TCP taken: not "unanswered" at 2 s
    links.answered(2, refused=True, now=1.5)  # peer 2's process refused the handshake: alive
    links.link_up(3)
    assert links.due(now=2.0) == ([], [])
    assert links.due(now=1.0 + PATIENCE * 2.0 - 0.3) == ([], [])  # (due looks every CHECK_S)
    assert links.due(now=1.0 + PATIENCE * 2.0) == ([], [1])
    links.answered(1, now=8.0)  # libzmq dialed again and the kernel took it again: no second report
    assert links.due(now=30.0) == ([], []) and links.counts()["frozen"] == 1
    links.park(1, "tcp://a:1")
    links.open(1, now=40.0)  # a link opened anew is watched anew
    links.answered(1, now=40.0)
    assert links.due(now=40.0 + PATIENCE * 2.0) == ([], [1]) and links.counts()["frozen"] == 2


def test_a_handshake_dropped_without_a_refusal_leaves_the_dial_again_watched_and_a_refusal_does_not():
    """A connection dropped mid-handshake with no refusal (its process died, or its handshake interval ran out) is no
    live answer: the dial again must be taken within a handshake deadline, and the handshake waited for keeps the time
    of the first taking, so a peer that takes and drops connections for good is reported after ``PATIENCE`` deadlines;
    a refusal is a live answer and leaves no timer; a peer is reported once, whichever timer ran out."""
    from gossiploco.transport.zmq_links import PATIENCE

    links = LinksOnDemand(idle_s=100.0, handshake_s=2.0)
    for peer in (1, 2, 3):
        links.park(peer, f"tcp://a:{peer}")
        links.open(peer, now=0.0)
        links.answered(peer, now=0.5)  # TCP taken
    links.handshake_dropped(1, now=1.0)  # peer 1 died mid-handshake: its dials again are refused from now on
    links.answered(2, refused=True, now=1.0)  # peer 2 refused: alive, its retries are ``HandshakeBackoff``'s
    links.handshake_dropped(3, now=1.0)  # peer 3 takes every dial again and drops it before the handshake ends
    assert links.due(now=2.9) == ([], [])
    links.answered(3, now=1.1)
    assert links.due(now=3.2) == ([], [1])  # peer 1's dial again never taken: one deadline after the drop
    for t in (2.0, 3.0, 4.0, 5.0):
        links.handshake_dropped(3, now=t)
        links.answered(3, now=t + 0.1)
    assert links.due(now=0.5 + PATIENCE * 2.0 - 0.3) == ([], [])  # (due looks every CHECK_S)
    assert links.due(now=0.5 + PATIENCE * 2.0) == ([], [3])  # PATIENCE deadlines from its first taking
    assert links.due(now=60.0) == ([], []) and links.counts()["frozen"] == 1  # each reported once, peer 2 never
    links.link_up(2)
    links.handshake_dropped(2, now=61.0)  # a link up is not watched (its drop is ``link_down``'s)
    links.handshake_dropped(9, now=61.0)  # nor a peer not linked on demand
    assert links.due(now=70.0) == ([], [])


def test_a_link_made_again_has_routing_ids_of_its_own_that_name_the_same_process():
    from gossiploco.security.trust import parse_routing_id, routing_id

    first, again = routing_id(7, "abc123", False, link=1), routing_id(7, "abc123", False, link=2)
    assert first != again and first == b"7.abc123~1" and routing_id(7, "abc123", True, link=2) == b"7.abc123~2/control"
    assert parse_routing_id(first) == parse_routing_id(again) == parse_routing_id(b"7.abc123") == (7, b"abc123", False)
    assert parse_routing_id(routing_id(7, "abc123", False, stripe=3, link=4)) == (7, b"abc123", False)
    for bad in (b"7.abc123~", b"7.abc123~0", b"7.abc123~x", b"7.abc~1~2"):
        assert parse_routing_id(bad) is None, bad


def test_the_setting_is_zero_for_a_full_mesh_or_a_positive_idle_time():
    cfg = RunConfig()
    assert cfg.transport.links_idle_s == 0.0
    cfg.transport.links_idle_s = -1.0
    with pytest.raises(ConfigError, match="links_idle_s"):
        cfg.transport.check("transport")


def test_the_cap_is_twice_a_buckets_other_members_unless_set():
    cfg = RunConfig()
    assert cfg.transport.links_cap == 0 and cfg.transport.links_kept(16) == 30 and cfg.transport.links_kept(4) == 6
    cfg.transport.links_cap = 12
    assert cfg.transport.links_kept(16) == 12
    cfg.transport.links_cap = -1
    with pytest.raises(ConfigError, match="links_cap"):
        cfg.transport.check("transport")


@pytest.mark.slow  # a real swarm: DHT, peer processes, training (25-60 s)
@pytest.mark.timeout(240)
def test_a_swarm_on_links_on_demand_trains_to_the_end_opening_and_closing_links(tmp_path):
    """``gossiploco swarm`` with ``transport.links_idle_s`` = 0.5 s (rounds take longer): 4 real peers find each other
    through the DHT, are parked, open links as their exchanges need them and close them when idle, many times
    each, and every peer finishes every round with no failed mix and no warning."""
    from test_peer import ENV

    out = tmp_path / "swarm"
    proc = subprocess.run([sys.executable, "-m", "gossiploco", "swarm", "--peers", "4", "--rounds", "4", "--inner-steps",
                           "60", "--model", "tiny", "--set", "data.max_corpus_mb=2.0", "--set",
                           "transport.links_idle_s=0.5", "--out", str(out)], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    swarm = json.loads((out / "summary.json").read_text())
    assert swarm["finished"] == 4 and not swarm["interrupted"]
    for rank in range(4):
        assert "WARN" not in (out / f"peer-{rank}.log").read_text()
        peer = json.loads((out / f"peer-{rank}" / "summary.json").read_text())
        links = peer["security"]["links_on_demand"]
        assert links["opened"] >= 3 and links["closed_idle"] >= 1, links
