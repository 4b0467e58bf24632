"""ZeroMQ exchange: striped data connections (several per peer, so that CURVE's crypto uses several I/O threads),
which paths get them, and their bounded pool.

Every call has a deadline of a few seconds, ports are random, sockets linger 0.
"""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from conftest import assert_three_peers_exchange_exactly, wait_until
from gossiploco.transport.zmq_exchange import ZmqExchange
from tests.test_exchange import free_ports, run_all


@pytest.mark.parametrize("encrypted", [False, True])
def test_striped_data_connections_carry_the_same_exchanges(encrypted):
    """With several data connections per peer (CURVE's crypto on several I/O threads), chunks take them in turn and
    arrive in any order: an all-reduce, a swap and a compressed all-to-all give what one connection gives, and every
    stripe carried data."""
    from gossiploco.security.swarm_key import SwarmKey
    from gossiploco.security.trust import Trust

    key = SwarmKey.generate() if encrypted else None
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(3)]
    exchanges = [ZmqExchange(r, endpoints, "stripes", 10.0, chunk_bytes=1 << 14, io_threads=2, stripes=3,
                             trust=Trust.static(key, r, 3) if encrypted else None, sealed_port=None)
                 for r in range(3)]  # no sealed port: data stays on CurveZMQ's stripes
    try:
        assert all(ex.wait_connected(10.0) for ex in exchanges)
        assert_three_peers_exchange_exactly(exchanges, run_all)
        for ex in exchanges:
            sends = ex.sockets.further_stripes.sends
            assert len(sends) == 3 and min(sends) > 0, sends
            assert ex.admission.total_rejected == 0
    finally:
        for ex in exchanges:
            ex.close()


def test_stripes_only_on_direct_paths_once_the_first_handshake_succeeded_and_chunks_went():
    """A relayed peer gets one data connection (a relay's slots and link are shared), and so does a reverse one. A
    direct one gets its further stripes at the first data chunk to it after the first data connection's handshake
    succeeded: the peer admits this one's key by then (dialed together, one stripe could be refused by a peer that
    admitted this one between their handshakes, and libzmq never dials again after a refusal), and a member no chunk
    went to holds none (``zmq_stripes``). Hellos never make them."""
    ports = free_ports(3)
    ex = ZmqExchange(0, {0: f"tcp://127.0.0.1:{ports[0]}"}, "stripes", 5.0, io_threads=2, stripes=4, join_round=None,
                     chunk_bytes=1 << 12)
    nine = ZmqExchange(9, {9: f"tcp://127.0.0.1:{ports[1]}"}, "stripes", 5.0, io_threads=1, stripes=1, join_round=None,
                       chunk_bytes=1 << 12)
    try:
        ex.add_peer(7, "tcp://127.0.0.1:1", relayed=True)
        ex.add_peer(8, "tcp://127.0.0.1:2", listen=True)
        ex.add_peer(6, f"tcp://127.0.0.1:{ports[2]}")  # nobody there: no handshake, no stripes
        ex.add_peer(9, f"tcp://127.0.0.1:{ports[1]}")
        nine.add_peer(0, f"tcp://127.0.0.1:{ports[0]}")
        assert wait_until(lambda: 9 in ex.connected() and 0 in nine.connected(), 10.0)
        assert ex.sockets.data_connections(9) == 1 and ex.sockets.further_stripes.sends == [0, 0, 0, 0]  # hellos only so far
        ex.announce(0)
        nine.announce(0)
        mine, theirs = torch.arange(10_000.0), -torch.arange(10_000.0)
        got = run_all([lambda: ex.swap("mix2/0", 9, mine), lambda: nine.swap("mix2/0", 0, theirs)])
        assert torch.equal(got[0], theirs) and torch.equal(got[1], mine)
        assert ex.sockets.data_connections(9) == 4 and min(ex.sockets.further_stripes.sends) > 0
        assert [ex.sockets.data_connections(p) for p in (6, 7, 8)] == [1, 1, 1]
    finally:
        ex.close()
        nine.close()


def test_further_stripes_are_a_bounded_pool_of_the_peers_chunks_went_to_last(monkeypatch):
    """At most ``MAX_STRIPED`` peers hold further stripes: making a new peer's closes those of the peers chunks went
    to least recently, once idle for ``IDLE_S``, and goes over the bound while all are in use; a retired peer's are
    closed and it is allowed none until admitted again; a peer whose stripes cannot be made keeps its first DEALER,
    counted, and is not tried again. Real DEALERs, dialing a port nobody listens on."""
    from gossiploco.transport import zmq_stripes

    monkeypatch.setattr(zmq_stripes, "MAX_STRIPED", 2)
    ctx = zmq.Context()
    made: dict[int, list[zmq.Socket]] = {}

    def make(peer, stripe, endpoint):
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        made.setdefault(peer, []).append(sock)
        return sock

    pool = zmq_stripes.Stripes(3, make)
    first = (ctx.socket(zmq.DEALER), threading.Lock())
    nowhere = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    try:
        assert pool.pick(1, first, 0.0) is first and not made  # not admitted yet: the first DEALER only
        for peer in (1, 2, 3, 4):
            pool.due(peer, nowhere)
            pool.admitted(peer)
        turns = [pool.pick(1, first, 0.0)[0] for _ in range(3)]  # made now, then taken in turn
        assert turns[0] is first[0] and turns[1:] == made[1] and pool.connections(1) == 3
        pool.pick(2, first, 10.0)
        pool.pick(3, first, 20.0)  # peer 1's went out 20 s ago, under IDLE_S: over the bound, nothing closed
        assert pool.striped() == [1, 2, 3] and pool.evicted == 0
        pool.pick(4, first, 45.0)  # 1 and 2 idle for 30 s or more: both closed to make room
        assert pool.striped() == [3, 4] and pool.evicted == 2
        assert all(sock.closed for sock in made[1] + made[2]) and not any(sock.closed for sock in made[3])
        assert pool.pick(1, first, 46.0) is first and pool.striped() == [1, 3, 4]  # made again; 3 is in use
        pool.drop(3)
        assert all(sock.closed for sock in made[3]) and pool.pick(3, first, 47.0) is first and pool.striped() == [1, 4]
        assert pool.opened == 5
        calls = []

        def failing(peer, stripe, endpoint):  # out of file descriptors at the second stripe, say
            calls.append(stripe)
            if stripe == 2:
                raise zmq.ZMQError(24)
            return make(peer, stripe, endpoint)

        broken = zmq_stripes.Stripes(3, failing)
        broken.due(5, nowhere)
        broken.admitted(5)
        assert broken.pick(5, first, 48.0) is first and broken.failed == 1 and made[5][0].closed  # the one made: closed
        assert broken.pick(5, first, 49.0) is first and calls == [1, 2]  # not tried again for that connection
        pool.close(0.0)
        assert pool.striped() == [] and all(sock.closed for socks in made.values() for sock in socks)
    finally:
        first[0].close(linger=0)
        ctx.term()
