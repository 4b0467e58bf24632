"""A goodbye that arrives after the leaver's connection is seen to drop (``zmq_receiver.GOODBYE_GRACE_S``).

A leaving peer sends its goodbye on its data connection (sealed, to the other's sealed port) and then closes: the
other peer can see its own connection to the leaver drop before that goodbye is read. Real ZeroMQ peers on loopback;
peer 1 reaches peer 0 through a TCP forwarder the test cuts, so the drop comes first, every time."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from conftest import free_ports, wait_until
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust
from gossiploco.transport import zmq_receiver
from gossiploco.transport.zmq_exchange import ZmqExchange


class _Forwarder:
    """Forwards each TCP connection made to ``endpoint`` to ``target_port`` on loopback until ``cut``, which closes
    every connection and stops listening (a dial again is refused)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:  # cut
                return
            with self._lock:
                if self._cut:  # accepted as it was cut (a dial again): refused
                    near.close()
                    return
            try:
                far = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:  # the target closed: so does this connection
                near.close()
                continue
            far.settimeout(None)
            with self._lock:
                self.sockets += [near, far]
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            try:
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (a close alone does not)
            except OSError:
                pass
            self.listener.close()
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


@pytest.fixture
def pair():
    """Peer 0 and peer 1, sealed data both ways; peer 1 dials peer 0's main port through a ``_Forwarder``."""
    key = SwarmKey.generate()
    ports = free_ports(2)
    forwarder = _Forwarder(ports[0])
    direct = [f"tcp://127.0.0.1:{p}" for p in ports]
    peers = [ZmqExchange(0, direct, "goodbye", 10.0, trust=Trust.static(key, 0, 2), grace_s=1.0),
             ZmqExchange(1, [forwarder.endpoint, direct[1]], "goodbye", 10.0, trust=Trust.static(key, 1, 2),
                         grace_s=1.0)]
    try:
        assert all(p.wait_connected(10.0) for p in peers)
        assert wait_until(lambda: peers[0].sockets.sealed.is_up(1) and peers[1].sockets.sealed.is_up(0), 10.0)
        yield peers, forwarder
    finally:
        forwarder.cut()
        for p in peers:
            p.close()


def _drop_seen(peer: ZmqExchange, other: int) -> bool:
    """``peer`` saw its connection to ``other`` drop: reported to its node, or waiting for a goodbye."""
    return other not in peer.connected() or other in peer.receiver.dropping()


@pytest.mark.slow  # real sockets for seconds: out of the fast subset
def test_a_goodbye_read_after_the_leaver_s_connection_dropped_is_a_peer_that_left_not_one_lost(pair, caplog,
                                                                                                monkeypatch):
    monkeypatch.setattr(zmq_receiver, "GOODBYE_GRACE_S", 5.0)  # the mechanism, not this machine's speed
    peers, forwarder = pair
    forwarder.cut()  # peer 1's connection to peer 0 drops; peer 0's own to peer 1 (and its sealed path) stay up
    assert wait_until(lambda: _drop_seen(peers[1], 0), 5.0)
    peers[0].leave(linger_s=1.0)
    assert wait_until(lambda: peers[1].inspect(lambda node: 0 in node.peers.left), 5.0)  # its goodbye heard
    assert wait_until(lambda: 0 not in peers[1].connected(), 10.0)
    peers[1].close()  # its notes are logged
    assert "lost the connection to peer 0" not in caplog.text


@pytest.mark.slow  # real sockets for seconds: out of the fast subset
def test_a_drop_with_no_goodbye_is_reported_as_lost_once_the_grace_is_over(pair, caplog):
    peers, forwarder = pair
    forwarder.cut()
    began = time.monotonic()
    assert wait_until(lambda: 0 not in peers[1].connected(), 5.0)
    assert time.monotonic() - began >= zmq_receiver.GOODBYE_GRACE_S - 0.05  # 0.05: the clocks' and poll's slack
    peers[1].close()
    assert "lost the connection to peer 0" in caplog.text
