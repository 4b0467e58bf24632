"""Peers that come and go over real ZeroMQ sockets: a peer that moved is no longer dialed where it was, and one
that is gone for good is forgotten with its sockets (``ZmqExchange.forget_peer``), so what a peer holds stays bounded
by the run's members now, not by every peer that ever came and went."""

from __future__ import annotations

import threading

import pytest

from conftest import wait_until
from gossiploco.transport.zmq_exchange import ZmqExchange
from tests.test_exchange import free_ports


def _count_connections(port: int, stop: threading.Event) -> tuple[list[int], threading.Thread]:
    """A plain TCP listener on ``port`` counting the connections made to it (in its one-element list) until ``stop``
    (then its thread ends and the port is free again)."""
    import socket

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    server.settimeout(0.05)
    counts = [0]

    def serve() -> None:
        with server:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                counts[0] += 1
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return counts, thread


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def test_a_peer_that_moved_or_was_forgotten_is_no_longer_dialed_where_it_was():
    """libzmq 4.3.5 goes on redialing an endpoint after ``disconnect``: a peer that moved (or left for good) was
    redialed at its old address for as long as this peer ran. Its sockets are now made afresh (moved) or closed
    (forgotten). A peer gone but not forgotten is still redialed: the control showing the window was long enough."""
    run_id = "test-forget"
    ports = free_ports(5)
    ep = {name: f"tcp://127.0.0.1:{port}" for name, port in zip(("a", "b_old", "b_new", "c", "d"), ports)}
    a = ZmqExchange(3, {3: ep["a"]}, run_id, 10.0, grace_s=2.0)
    others = [ZmqExchange(rank, {rank: ep[name]}, run_id, 10.0, grace_s=2.0)
              for rank, name in ((11, "b_old"), (12, "c"), (13, "d"))]
    b_new = None
    stop = threading.Event()
    try:
        for rank, name in ((11, "b_old"), (12, "c"), (13, "d")):
            assert a.add_peer(rank, ep[name])
        for other in others:
            assert other.add_peer(3, ep["a"])
        assert wait_until(lambda: a.members(0) == [3, 11, 12, 13], 10.0), a.members(0)
        for other in others:
            other.leave(linger_s=0.2)
        b_new = ZmqExchange(11, {11: ep["b_new"]}, run_id, 10.0, grace_s=2.0)  # b restarts elsewhere
        assert b_new.add_peer(3, ep["a"]) and a.add_peer(11, ep["b_new"])  # what discovery does on its new record
        assert wait_until(lambda: 11 in a.connected() and 12 not in a.connected() and 13 not in a.connected(), 10.0)
        assert not a.forget_peer(11)  # connected: kept
        assert a.forget_peer(13) and not a.forget_peer(13) and 13 not in a.known()
        listeners = {name: _count_connections(int(ep[name].rsplit(":", 1)[1]), stop) for name in ("b_old", "c", "d")}
        counts = {name: count for name, (count, _) in listeners.items()}
        assert wait_until(lambda: counts["c"][0] >= 3, 10.0), counts  # gone, not forgotten: redialed again and again
        assert counts["b_old"] == [0] and counts["d"] == [0], counts
        stop.set()
        for _, thread in listeners.values():
            thread.join(5.0)
        # d comes back: discovery finds its record again and connects it anew
        others[2] = ZmqExchange(13, {13: ep["d"]}, run_id, 10.0, grace_s=2.0)
        assert others[2].add_peer(3, ep["a"]) and a.add_peer(13, ep["d"])
        assert wait_until(lambda: 13 in a.connected(), 10.0)
    finally:
        stop.set()
        for ex in (a, *others, b_new):
            if ex is not None:
                ex.close()


def test_peers_that_come_and_go_leave_no_sockets_behind_once_forgotten():
    """What a peer holds stays bounded by the peers of the run now: 40 peers added and forgotten in turn leave
    its open file descriptors where they were (each added peer takes a dozen: DEALERs, monitors, their pipes)."""
    a = ZmqExchange(3, {3: f"tcp://127.0.0.1:{free_ports(1)[0]}"}, "test-churn", 10.0, grace_s=2.0)
    try:
        dead = [f"tcp://127.0.0.1:{port}" for port in free_ports(40)]  # nobody listens there
        assert a.add_peer(99, dead[0]) and a.forget_peer(99)  # the first add and forget open lazily made files
        assert wait_until(lambda: a.sockets.retired_monitors.empty(), 5.0)
        baseline = _open_fds()
        for i, endpoint in enumerate(dead):
            assert a.add_peer(100 + i, endpoint)
        grown = _open_fds() - baseline
        assert grown >= 2 * len(dead), grown  # what forgetting has to give back
        for i in range(len(dead)):
            assert a.forget_peer(100 + i)
        assert wait_until(lambda: _open_fds() <= baseline, 10.0), (baseline, _open_fds(), grown)
        assert a.known() == [3] and a.sockets.dealers == {} and a.sockets.monitors == {}
    finally:
        a.close()



@pytest.mark.slow  # a second or two of real sockets: kept out of the fast subset
def test_a_reverse_endpoint_is_redialed_while_wanted_and_never_once_its_peer_moved_on():
    """A reachable peer's DEALERs listen for a peer behind NAT, whose ROUTER dials them (a reverse connection).
    libzmq's redialing is off on the ROUTER (it restarted at 100 ms after every TCP connection, handshake or not:
    an endpoint that accepts and closes was dialed 10 times a second) and its receiving thread redials what it still
    wants (``retry.Redials``): here every attempt is taken and closed, so the endpoint still wanted is dialed again
    and again with backoff (the positive control of the window), while the one dropped (its peer moved) and the one
    of a forgotten peer are not dialed once more."""
    ports = free_ports(4)
    a = ZmqExchange(3, {3: f"tcp://127.0.0.1:{ports[0]}"}, "test-reverse", 10.0, grace_s=2.0)
    stop = threading.Event()
    try:
        kept, dropped, forgotten = (f"tcp://127.0.0.1:{port}" for port in ports[1:])
        listeners = [_count_connections(int(e.rsplit(":", 1)[1]), stop) for e in (kept, dropped, forgotten)]
        counts = [count for count, _ in listeners]  # each attempt is taken and closed: no handshake, a loss
        assert a.add_peer(8, forgotten)
        assert a.dial_reverse(6, [kept]) and a.dial_reverse(7, [dropped]) and a.dial_reverse(8, [forgotten])
        redials = a._receiver_work.redials
        assert wait_until(lambda: all(c[0] >= 3 for c in counts), 10.0), counts  # redialed after every loss
        assert a.dial_reverse(7, []) and a.forget_peer(8)  # 7 moved to another path; 8 left for good
        assert wait_until(lambda: not redials.wanted(dropped) and not redials.wanted(forgotten), 5.0)
        before = [c[0] for c in counts]
        # the kept endpoint is dialed twice more (its backoff is at most REDIAL_MAX_S): a window that long
        assert wait_until(lambda: counts[0][0] >= before[0] + 2, 10.0), counts
        # at most one attempt libzmq had begun before the drop was applied lands after it; a redial would be several
        assert all(c[0] - b <= 1 for c, b in zip(counts[1:], before[1:])), (before, counts)
        assert redials.losses(kept) >= 4 and a._receiver_work.redialed >= 4
    finally:
        stop.set()
        a.close()


def test_a_reverse_connection_that_dropped_is_made_again():
    """With libzmq's redialing off, a reverse connection that dropped (the listening peer restarted its sockets) is
    made again by the receiving thread, within its first redial delay and a poll, and carries messages again."""
    import zmq

    ports = free_ports(2)
    a = ZmqExchange(3, {3: f"tcp://127.0.0.1:{ports[0]}"}, "test-reverse", 10.0, grace_s=2.0)
    listen = f"tcp://127.0.0.1:{ports[1]}"
    ctx = zmq.Context()

    def listener():
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)

        def bound() -> bool:
            try:
                sock.bind(listen)
            except zmq.ZMQError:  # the closed one's port is freed by libzmq's I/O thread, a moment later
                return False
            return True

        if not wait_until(bound, 5.0):
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise AssertionError(f"cannot bind {listen} again")
        return sock, monitor

    def handshake(monitor) -> bool:
        return bool(monitor.poll(5000))

    sock, monitor = listener()
    try:
        assert a.dial_reverse(9, [listen])
        assert handshake(monitor)
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)  # the connection drops; nobody listens for a moment
        sock, monitor = listener()  # back at the same port
        assert handshake(monitor), "the reverse connection was not made again"
        assert a._receiver_work.redialed >= 1
    finally:
        if not sock.closed:
            sock.disable_monitor()  # first: the monitor's last event would wait for a reader closed before it
            sock.close(linger=0)
        monitor.close(linger=0)
        a.close()
        ctx.term()


@pytest.mark.slow  # a second or two of real sockets: kept out of the fast subset
def test_a_forgotten_peer_is_refused_at_the_handshake_until_it_is_known_again():
    """Forgetting a peer also takes its key off the ZAP handler's list: a forgotten peer that comes back and dials
    this one before discovery found its record again is refused at the handshake, as a stranger is (it retries with
    backoff), then admitted once it is known again."""
    from gossiploco.security.swarm_key import SwarmKey
    from gossiploco.security.trust import Trust

    key, run_id = SwarmKey.generate(), "test-revoke"
    ports = free_ports(3)
    ep = [f"tcp://127.0.0.1:{port}" for port in ports]
    a = ZmqExchange(0, {0: ep[0]}, run_id, 10.0, grace_s=2.0, trust=Trust.static(key, 0, 2))
    b = ZmqExchange(1, {1: ep[1]}, run_id, 10.0, grace_s=2.0, trust=Trust.static(key, 1, 2))
    back = None
    try:
        assert a.add_peer(1, ep[1]) and b.add_peer(0, ep[0])
        assert wait_until(lambda: a.members(0) == [0, 1] and b.members(0) == [0, 1], 10.0)
        b.leave(linger_s=0.2)
        assert wait_until(lambda: 1 not in a.connected(), 10.0)
        assert a.sockets.auth.admitted(1) and a.forget_peer(1) and not a.sockets.auth.admitted(1)
        assert a.sockets.auth.admitted(0)  # its own key stays
        refused = a.sockets.refused_connections().get("key of no member", 0)
        back = ZmqExchange(1, {1: ep[2]}, run_id, 10.0, grace_s=2.0, trust=Trust.static(key, 1, 2))
        assert back.add_peer(0, ep[0])  # it dials first; this peer has not found it again
        assert wait_until(lambda: a.sockets.refused_connections().get("key of no member", 0) > refused, 10.0)
        assert 1 not in a.connected()
        assert a.add_peer(1, ep[2])  # discovery finds its record again
        # as the runtime's join program does once its connections are up (``lifecycle.join``): what it said while
        # refused was lost with that connection
        assert wait_until(lambda: 0 in back.connected(), 15.0)
        back.announce(0)
        assert wait_until(lambda: a.members(0) == [0, 1] and back.members(0) == [0, 1], 15.0), (a.members(0),
                                                                                           back.members(0))
    finally:
        for ex in (a, b, back):
            if ex is not None:
                ex.close()
