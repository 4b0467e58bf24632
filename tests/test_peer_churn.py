"""Peers that come and go over real ZeroMQ sockets: a peer that moved is no longer dialed where it was, and one
that is gone for good is forgotten with its sockets (``ZmqExchange.forget_peer``), so what a peer holds stays bounded
by the run's members now, not by every peer that ever came and went."""

from __future__ import annotations

import math
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



@pytest.mark.slow
def test_a_reverse_connection_to_a_peer_that_is_gone_is_redialed_with_backoff():
    """A peer behind NAT dials the reverse ports a reachable peer offers it with its ROUTER, which cannot be made
    afresh (every inbound connection is on it), and libzmq goes on redialing after ``disconnect``: a departed
    peer's ports are dialed for as long as the run lasts. The ROUTER's reconnect interval backs off to
    ``zmq_sockets.REVERSE_RECONNECT_MAX_MS`` instead of staying at libzmq's 100 ms (10 attempts a second a port):
    shown by libzmq's own retry events on a ROUTER with the exchange's settings, dialing a closed port."""
    import zmq
    import zmq.utils.monitor

    from gossiploco.transport.zmq_sockets import REVERSE_RECONNECT_MAX_MS

    a = ZmqExchange(3, {3: f"tcp://127.0.0.1:{free_ports(1)[0]}"}, "test-reverse", 10.0, grace_s=2.0)
    try:
        ivl, ivl_max = (a.sockets.router.getsockopt(opt) for opt in (zmq.RECONNECT_IVL, zmq.RECONNECT_IVL_MAX))
    finally:
        a.close()
    assert ivl_max == REVERSE_RECONNECT_MAX_MS and 0 < ivl < ivl_max
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RECONNECT_IVL, ivl)
    router.setsockopt(zmq.RECONNECT_IVL_MAX, ivl_max)
    monitor = router.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED)
    try:
        router.connect(f"tcp://127.0.0.1:{free_ports(1)[0]}")  # nobody listens: every attempt is refused
        intervals, wanted = [], 1 + math.ceil(math.log2(ivl_max / ivl))  # doubling from ivl, then capped
        while len(intervals) < wanted and monitor.poll(3 * ivl_max):
            intervals.append(int(zmq.utils.monitor.recv_monitor_message(monitor)["value"]))
        assert len(intervals) == wanted, intervals
        assert intervals[-1] == ivl_max and all(b >= a for a, b in zip(intervals, intervals[1:])), intervals
    finally:
        router.disable_monitor()
        monitor.close(linger=0)
        router.close(linger=0)
        ctx.term()
