"""A refused CurveZMQ handshake over real sockets (``transport.retry.HandshakeBackoff``): libzmq never dials again
after a refusal, so the driver does, for the control connection as for the data one, and at once when the refusing
peer shows it has admitted this one since."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from conftest import wait_until
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust
from gossiploco.transport.retry import RETRY_FIRST_S, refused_delay_s
from gossiploco.transport.zmq_exchange import ZmqExchange
from tests.test_exchange import free_ports

pytestmark = pytest.mark.slow  # a second or several of real sockets each: kept out of the fast subset


def _zap_refusing(ctx: zmq.Context, refused: int, stop: threading.Event) -> tuple[list[bytes], threading.Thread]:
    """A ZAP handler on ``ctx`` that refuses the ``refused``-th connection (1: the first) and admits every other; the
    list holds the client key of every connection it was asked about, in order."""
    zap = ctx.socket(zmq.REP)
    zap.bind("inproc://zeromq.zap.01")
    asked: list[bytes] = []

    def serve() -> None:
        with zap:
            while not stop.is_set():
                if not zap.poll(50):
                    continue
                version, request, _domain, _address, _identity, _mechanism, *credentials = zap.recv_multipart()
                asked.append(credentials[0] if credentials else b"")
                refuse = len(asked) == refused
                zap.send_multipart([version, request, b"400" if refuse else b"200", b"no" if refuse else b"OK",
                                    b"" if refuse else b"peer", b""])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return asked, thread


@pytest.mark.parametrize("refused", [1, 2])
def test_a_refused_connection_is_dialed_again_though_its_sibling_was_accepted(refused):
    """The data and control DEALERs to a peer handshake apart, so a peer that admits this one between them (it just
    read this peer's record) refuses one and accepts the other. Whichever is refused (the first connection here, or
    the second: one of the two is the control one), it is dialed again. Before, only the data DEALER's refusal was
    watched: a refused control DEALER stayed down while the data came through (a peer never heard a leader's
    decisions). ZAP cannot tell the two connections apart (it sees the key), hence both orders."""
    key = SwarmKey.generate()
    ports = free_ports(2)
    ctx, stop = zmq.Context(), threading.Event()
    asked, zap = _zap_refusing(ctx, refused, stop)
    server = ctx.socket(zmq.ROUTER)  # peer 1's ROUTER, with a ZAP handler that refuses one connection
    server.setsockopt(zmq.CURVE_SERVER, 1)
    server.setsockopt(zmq.CURVE_SECRETKEY, key.static_identity(1).curve_secret)
    server.setsockopt(zmq.ZAP_DOMAIN, b"test")
    server.bind(f"tcp://127.0.0.1:{ports[1]}")
    a = ZmqExchange(0, {0: f"tcp://127.0.0.1:{ports[0]}"}, "test-refused-one", 10.0, grace_s=2.0,
                    trust=Trust.static(key, 0, 2))
    try:
        assert a.add_peer(1, f"tcp://127.0.0.1:{ports[1]}")
        # dialed again (both DEALERs made afresh) after RETRY_FIRST_S
        assert wait_until(lambda: len(asked) >= 4, RETRY_FIRST_S + 5.0), len(asked)
        assert set(asked) == {key.static_identity(0).curve_public}
        handshakes = a.sockets.handshakes  # read across threads: the receiving thread's, done with peer 1 soon
        assert wait_until(lambda: handshakes.refusals(1) == 0 and not handshakes.pending, 5.0)
    finally:
        a.close()
        stop.set()
        zap.join(2.0)
        server.close(linger=0)
        ctx.term()


def test_a_refusing_peer_that_admitted_this_one_since_is_dialed_again_at_once_not_after_its_backoff():
    """Peer 0 dials peer 1 before peer 1 has read its record: refused four times, its next try waits
    ``refused_delay_s(4)`` (4 s). Peer 1 then finds peer 0 and connects to it (admitting its key first): its first
    message brings peer 0's try forward. Without that, no connection comes sooner than 4 s after the fourth refusal;
    with it, one comes as soon as a handshake and a message can go each way, which three quarters of that leaves time
    for on a loaded machine (at three refusals, half of a 2 s wait did not, with the whole suite and a simulation
    sharing 2 cores)."""
    key, run_id = SwarmKey.generate(), "test-hurry"
    ep = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    a = ZmqExchange(0, {0: ep[0]}, run_id, 10.0, grace_s=2.0, trust=Trust.static(key, 0, 2))
    b = ZmqExchange(1, {1: ep[1]}, run_id, 10.0, grace_s=2.0, trust=Trust.static(key, 1, 2))
    try:
        assert a.add_peer(1, ep[1])
        refusals = 4
        assert wait_until(lambda: a.sockets.handshakes.refusals(1) >= refusals, 2 * sum(
            refused_delay_s(n) for n in range(1, refusals + 1)) + 5.0)
        admitted = time.monotonic()
        assert b.add_peer(0, ep[0])
        bound = 0.75 * refused_delay_s(refusals)
        assert wait_until(lambda: 1 in a.connected(), bound), a.sockets.handshakes.refusals(1)
        assert time.monotonic() - admitted < bound
    finally:
        a.close()
        b.close()


def test_a_connection_dropped_during_its_handshake_is_dialed_again_by_libzmq_and_its_sockets_are_kept():
    """A relay's stream reset drops a connection mid-handshake: libzmq reports it (no detail) and dials again itself.
    Before, that counted as a refusal and both of the peer's DEALERs were made afresh, so a working sibling connection
    was torn down and a send racing the change found no socket (``not a known peer``: CI's libp2p exchange test)."""
    key = SwarmKey.generate()
    listener = socket.create_server(("127.0.0.1", 0))  # takes each connection and drops it before any handshake
    accepted: list[float] = []
    stop = threading.Event()

    def drop() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            accepted.append(time.monotonic())
            conn.close()

    thread = threading.Thread(target=drop, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    a = ZmqExchange(0, {0: f"tcp://127.0.0.1:{free_ports(1)[0]}"}, "test-dropped", 10.0, grace_s=2.0,
                    trust=Trust.static(key, 0, 2))
    try:
        assert a.add_peer(1, f"tcp://127.0.0.1:{port}")
        dealer = a.sockets.dealers[1]
        assert wait_until(lambda: len(accepted) >= 6, 5.0), len(accepted)  # dialed again, by libzmq
        assert a.sockets.dealers[1] is dealer  # never made afresh
        assert a.sockets.handshakes.refusals(1) == 0 and not a.sockets.handshakes.pending
    finally:
        a.close()
        stop.set()
        thread.join(2.0)
        listener.close()
