"""The sealed data path on real sockets (``gossiploco.transport.zmq_sealed``): data chunks sealed with AES-256-GCM on
a second port, keys offered over CurveZMQ, CurveZMQ whenever the sealed port is not reachable, and what an attacker
on the wire can do to it (replay, tamper, garbage): refused and counted, the exchange unharmed."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zmq

from conftest import (assert_pair_mean_with_a_partner_ahead, assert_three_peers_exchange_exactly, free_ports,
                      once_free, wait_until)
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust
from gossiploco.transport.sealed import ENVELOPE
from gossiploco.transport.zmq_exchange import ZmqExchange

CHUNK = 1 << 14


def run_all(fns):
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn) for fn in fns]]


def _swarm(n: int, sealed_ports=None, key=None, chunk_bytes: int = CHUNK):
    key = key or SwarmKey.generate()
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(n)]
    ports = sealed_ports or [0] * n
    exchanges = [ZmqExchange(r, endpoints, "sealed", 10.0, chunk_bytes=chunk_bytes, trust=Trust.static(key, r, n),
                             sealed_port=ports[r]) for r in range(n)]
    assert all(ex.wait_connected(10.0) for ex in exchanges)
    return exchanges


def _sealed_up(exchanges, pairs) -> bool:
    return wait_until(lambda: all(exchanges[s].sockets.sealed.is_up(r) for s, r in pairs), 10.0)


def _all_reduce(exchanges, key: str, seed: int = 0):
    n = len(exchanges)
    values = [torch.randn(100_003, generator=torch.Generator().manual_seed(seed * 100 + r)) for r in range(n)]
    out = run_all([lambda r=r: exchanges[r].all_reduce_mean(key, values[r], list(range(n))) for r in range(n)])
    expected = (sum(v.double() for v in values) / n).float()
    assert all(torch.allclose(o, expected, atol=1e-6) and torch.equal(o, out[0]) for o in out)


def _curve_data(ex) -> int:
    """Data messages this peer sent over CurveZMQ (every stripe)."""
    return sum(ex.sockets.further_stripes.sends)


def _close(exchanges):
    for ex in exchanges:
        ex.close()


@pytest.mark.slow  # a second or more of real sockets: out of the fast subset
def test_encrypted_peers_send_every_data_chunk_sealed_and_get_the_same_results():
    exchanges = _swarm(3)
    try:
        assert _sealed_up(exchanges, [(s, r) for s in range(3) for r in range(3) if s != r])
        assert_three_peers_exchange_exactly(exchanges, run_all)
        for ex in exchanges:
            assert ex.sockets.sealed.sent > 0 and _curve_data(ex) == 0, (ex.sockets.sealed.sent, ex.sockets.further_stripes.sends)
            assert ex.admission.total_rejected == 0
    finally:
        _close(exchanges)


@pytest.mark.slow  # a second or more of real sockets: out of the fast subset
def test_a_peer_without_a_sealed_port_gets_its_data_over_curvezmq_and_seals_what_it_sends():
    exchanges = _swarm(3, sealed_ports=[0, 0, None])
    try:
        assert _sealed_up(exchanges, [(s, r) for s in range(3) for r in (0, 1) if s != r])
        _all_reduce(exchanges, "mix1/0")
        assert exchanges[2].sockets.sealed.port is None and not exchanges[0].sockets.sealed.is_up(2)
        assert exchanges[2].sockets.sealed.sent > 0 and _curve_data(exchanges[2]) == 0
        # in the ring 0 -> 1 -> 2 -> 0, peer 1 sends to peer 2: over CurveZMQ
        assert _curve_data(exchanges[1]) > 0
    finally:
        _close(exchanges)


def test_an_unreachable_sealed_port_costs_nothing_data_goes_over_curvezmq():
    """A firewall that forwards only the main port: the sealed handshake never succeeds, so nothing waits on it."""
    exchanges = _swarm(2)
    try:
        assert _sealed_up(exchanges, [(0, 1), (1, 0)])
        closed_port = free_ports(1)[0]
        exchanges[0].sockets.sealed.dial(1, f"tcp://127.0.0.1:{closed_port}")  # nothing listens there
        assert not exchanges[0].sockets.sealed.is_up(1)
        before = exchanges[0].sockets.sealed.sent
        _all_reduce(exchanges, "mix1/0")
        assert exchanges[0].sockets.sealed.sent == before and _curve_data(exchanges[0]) > 0
        assert exchanges[1].sockets.sealed.sent > 0
    finally:
        _close(exchanges)


@pytest.mark.slow  # seconds: the fast subset keeps its margin under 2 minutes
def test_a_restarted_peer_offers_a_new_key_on_a_new_port_and_is_sent_sealed_again():
    key = SwarmKey.generate()
    exchanges = _swarm(2, key=key)
    try:
        assert _sealed_up(exchanges, [(0, 1), (1, 0)])
        old_port = exchanges[1].sockets.sealed.port
        endpoint = exchanges[1].endpoints[1]
        exchanges[1].close()
        exchanges[1] = ZmqExchange(1, [exchanges[0].endpoints[0], endpoint], "sealed", 10.0, chunk_bytes=CHUNK,
                                   trust=Trust.static(key, 1, 2))
        assert exchanges[1].wait_connected(10.0)
        new_port = exchanges[1].sockets.sealed.port
        assert wait_until(lambda: exchanges[0].sockets.sealed.sealer.port_of(1) == new_port
                          and exchanges[0].sockets.sealed.is_up(1), 10.0), (old_port, new_port)
        before = exchanges[0].sockets.sealed.sent
        _all_reduce(exchanges, "mix1/1")
        assert exchanges[0].sockets.sealed.sent > before
        assert exchanges[1].admission.total_rejected == 0
    finally:
        _close(exchanges)


class _Tap:
    """A man in the middle on the sealed path from one peer to another: it forwards each message and keeps a copy."""

    def __init__(self, target: str):
        self.ctx = zmq.Context.instance()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(target)
        self.seen: list[list[bytes]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.front.poll(50):
                frames = self.front.recv_multipart()[1:]  # without the routing id the ROUTER added
                self.seen.append(frames)
                self.back.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.front.close()
        self.back.close()


@pytest.mark.slow  # a second or more of real sockets: out of the fast subset
def test_replayed_tampered_and_forged_messages_on_the_sealed_port_are_refused_and_counted():
    exchanges = _swarm(2)
    target = f"tcp://127.0.0.1:{exchanges[0].sockets.sealed.port}"
    tap = _Tap(target)
    attacker = zmq.Context.instance().socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    try:
        assert _sealed_up(exchanges, [(0, 1), (1, 0)])
        exchanges[1].sockets.sealed.dial(0, tap.endpoint)  # peer 1's data to peer 0 now passes the tap
        assert _sealed_up(exchanges, [(1, 0)])
        _all_reduce(exchanges, "mix1/0")
        assert tap.seen and exchanges[1].sockets.sealed.sent > 0
        assert exchanges[0].admission.total_rejected == 0
        attacker.connect(target)  # anyone may connect to the sealed port: it has no handshake to refuse them
        replayed = tap.seen[: min(5, len(tap.seen))]
        for frames in replayed:
            attacker.send_multipart(frames)
        tampered = list(tap.seen[-1])
        tampered[-1] = tampered[-1][:-1] + bytes([tampered[-1][-1] ^ 1])
        attacker.send_multipart(tampered)
        attacker.send_multipart([b"garbage", b"more garbage"])
        attacker.send_multipart([ENVELOPE.pack(b"K" * 8, 0, 1), b"x" * 100])  # a well-formed envelope under no key
        rejected = lambda: exchanges[0].security_counts()["rejected_messages"]  # noqa: E731
        assert wait_until(lambda: sum(rejected().values()) == len(replayed) + 3, 10.0), rejected()
        reasons = rejected()
        assert reasons.get("sealed message replayed") == len(replayed), reasons
        assert reasons.get("sealed frame failed authentication") == 1, reasons
        assert reasons.get("sealed message under an unknown key") == 1, reasons
        _all_reduce(exchanges, "mix1/1", seed=1)  # none of it touched the exchange
    finally:
        attacker.close()
        tap.close()
        _close(exchanges)


@pytest.mark.parametrize("size", [0, 1, 3 * CHUNK // 4 + 1])
def test_payloads_of_every_size_cross_the_sealed_path_exactly(size):
    exchanges = _swarm(2)
    try:
        assert _sealed_up(exchanges, [(0, 1), (1, 0)])
        values = [torch.randn(size, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        swapped = run_all([lambda r=r: exchanges[r].swap("mix2/0", 1 - r, values[r]) for r in (0, 1)])
        assert torch.equal(swapped[0], values[1]) and torch.equal(swapped[1], values[0])
        flats = [v.clone() for v in values]  # the pair mean, averaged in the callers' vectors as chunks arrive
        means = run_all([lambda r=r: exchanges[r].swap_mean("mix2/1", 1 - r, flats[r], inplace=True) for r in (0, 1)])
        assert all(torch.equal(m, (values[0] + values[1]) / 2) for m in means)
    finally:
        _close(exchanges)


def test_the_pair_mean_over_curvezmq_alone_overwrites_no_chunk_before_it_is_sent():
    """Without the sealed port libzmq's I/O threads encrypt the chunks (CurveZMQ) after they are queued: the pair
    mean's averaging into the caller's vector never reaches what the partner receives."""
    exchanges = _swarm(2, sealed_ports=[None, None], chunk_bytes=8 << 20)
    try:
        assert_pair_mean_with_a_partner_ahead(exchanges, 4, 2 << 20)
        assert _curve_data(exchanges[0]) >= 4
    finally:
        _close(exchanges)


def test_the_buffer_pool_reuses_a_buffer_once_zmq_released_it_and_bounds_what_one_peer_queues():
    import time

    from gossiploco.errors import ExchangeTimeout
    from gossiploco.transport.zmq_sealed import MAX_SENDING, POOLED_MIN_BYTES, BufferPool

    ctx = zmq.Context()
    pool = BufferPool()
    try:
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        sent_ok = ctx.socket(zmq.PUSH)
        sent_ok.connect(f"tcp://127.0.0.1:{port}")
        stuck = ctx.socket(zmq.PUSH)
        stuck.connect(f"tcp://127.0.0.1:{free_ports(1)[0]}")  # nobody listens: its messages stay queued
        assert pool.take(POOLED_MIN_BYTES - 1, []) is None  # small frames are not pooled
        taken: list = []
        view = pool.take(POOLED_MIN_BYTES, taken)
        view[:] = b"x" * POOLED_MIN_BYTES
        tracker = sent_ok.send(view, copy=False, track=True)
        pool.retire(1, tracker, taken)
        assert pull.recv() == b"x" * POOLED_MIN_BYTES
        assert wait_until(lambda: tracker.done, 5.0)
        again: list = []
        pool.take(POOLED_MIN_BYTES, again)
        assert again[0] is taken[0], "a released buffer large enough is reused, not a new one made"
        pool.retire(1, None, again)
        for _ in range(MAX_SENDING):  # fill what peer 7 may have queued
            held: list = []
            pool.take(POOLED_MIN_BYTES, held)
            pool.retire(7, stuck.send(memoryview(held[0]), copy=False, track=True), held)
        began = time.monotonic()
        with pytest.raises(ExchangeTimeout, match="still queued"):
            pool.wait_room(7, began + 0.3, "test")
        assert time.monotonic() - began >= 0.3
        pool.wait_room(8, time.monotonic() + 0.3, "test")  # another peer is not held back by peer 7's queue
    finally:
        ctx.destroy(linger=0)


def test_the_sealed_port_admits_connections_only_from_members_addresses_and_a_refused_sender_dials_again():
    """A stranger cannot even hold a connection open on the sealed port unless it shares a member's address; a
    member whose sealed connection came before its CurveZMQ one was admitted is refused once, then dials again."""
    import queue
    import time

    from zmq.utils.monitor import recv_monitor_message

    from gossiploco.transport.zmq_auth import SEALED_REFUSAL, SwarmAuthenticator, secure_client, secure_server
    from gossiploco.transport.zmq_sealed import SealedLinks

    key = SwarmKey.generate()
    receiver, sender = Trust.static(key, 0, 2), Trust.static(key, 1, 2)
    ctx, other = zmq.Context(), zmq.Context()
    auth = SwarmAuthenticator(ctx, receiver, "rank 0")
    auth.start()
    auth.allow(sender.identity.curve_public, 1)
    links = [SealedLinks(ctx, 0, b"0.r", "tcp://127.0.0.1:0", max_frame_bytes=1 << 20, heartbeat_ms=5000, sndhwm=10,
                         monitors_out=queue.SimpleQueue()),
             SealedLinks(other, 1, b"1.s", None, max_frame_bytes=1 << 20, heartbeat_ms=5000, sndhwm=10,
                         monitors_out=queue.SimpleQueue())]
    target = f"tcp://127.0.0.1:{links[0].port}"
    try:
        stranger = other.socket(zmq.DEALER)  # from 127.0.0.2: no member's CurveZMQ connection came from there
        stranger_events = stranger.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        stranger.connect(f"tcp://127.0.0.2:0;127.0.0.1:{links[0].port}")
        assert stranger_events.poll(5000), "the stranger's handshake was not refused"
        assert auth.refusals().get(SEALED_REFUSAL) == 1

        def drive() -> None:  # what the receiving thread does: apply dials, read the sealed DEALER's monitor
            links[1].dial_pending()
            for monitor in links[1].monitors:
                while monitor.poll(0):
                    event = recv_monitor_message(monitor)
                    links[1].event(monitor, event["event"], event["endpoint"].decode())

        links[1].dial(0, target)  # before any CurveZMQ connection from this address: refused
        assert wait_until(lambda: drive() or links[1].refusals.refusals(0) >= 1, 5.0)
        assert not links[1].is_up(0) and auth.refusals()[SEALED_REFUSAL] >= 2
        router = ctx.socket(zmq.ROUTER)  # a CurveZMQ connection of member 1 from 127.0.0.1 is admitted ...
        secure_server(router, receiver)
        curve_port = router.bind_to_random_port("tcp://127.0.0.1")
        client = other.socket(zmq.DEALER)
        secure_client(client, sender, receiver.identity.curve_public)
        client.connect(f"tcp://127.0.0.1:{curve_port}")
        client.send(b"hello")
        assert router.poll(5000) and router.recv_multipart()[1] == b"hello"
        began = time.monotonic()  # ... and the sealed DEALER, dialing again after its backoff, gets in
        assert wait_until(lambda: drive() or links[1].is_up(0), 10.0)
        assert time.monotonic() - began < 5.0
        for sock in (stranger_events, stranger, router, client):
            sock.close(linger=0)
    finally:
        for link in links:
            link.close(0.0)
            link.close_router()
        auth.stop()
        ctx.destroy(linger=0)
        other.destroy(linger=0)


@pytest.mark.slow  # a second or two of real sockets: kept out of the fast subset
def test_a_peer_whose_path_changed_is_no_longer_dialed_at_its_old_sealed_port(monkeypatch):
    """A sealed DEALER whose path changes is made afresh, not disconnected: libzmq 4.3.5 goes on redialing an endpoint
    after ``disconnect``, so a peer that moved (here: to a reverse path, which is not sealed) was dialed at its old
    sealed port for good. Peer 2's link, gone but unchanged, is still redialed in the same window: the control."""
    from gossiploco.transport import zmq_sealed
    from tests.test_peer_churn import _count_connections

    monkeypatch.setattr(zmq_sealed, "RECONNECT_MAX_MS", 200)  # libzmq's redials of a lost sealed link: quick here
    exchanges = _swarm(3)
    a = exchanges[0]
    stop = threading.Event()
    try:
        assert _sealed_up(exchanges, [(0, 1), (0, 2)])
        ports = {r: a.sockets.sealed.sealer.port_of(r) for r in (1, 2)}
        endpoint_1 = a.endpoints[1]
        for r in (1, 2):
            exchanges[r].close()
        counts = {r: _count_connections(ports[r], stop)[0] for r in (1, 2)}
        assert a.add_peer(1, endpoint_1, listen=True)  # its path changed: no longer dialed directly
        assert wait_until(lambda: 1 not in a.sockets.sealed.dealers, 5.0)
        before = {r: c[0] for r, c in counts.items()}
        assert wait_until(lambda: counts[2][0] >= before[2] + 3, 10.0), counts  # still dialed, again and again
        # at most one attempt begun before the DEALER was closed lands after it; the old socket redialed every 0.2 s
        assert counts[1][0] - before[1] <= 1, (before, counts)
    finally:
        stop.set()
        a.close()


@pytest.mark.slow  # seconds
def test_a_peer_restarted_on_its_port_after_its_dial_back_check_is_dialed_afresh():
    """A peer restarted on the same port first runs its dial-back check's listener there, which sends its nonce to
    whoever connects: the others' DEALERs redialing that port take it for a broken ZMTP greeting, and libzmq drops such
    a connection for good, saying only that it disconnected. When the new process speaks, the DEALERs made before its
    predecessor was lost are made afresh, so the others reach it again (before, they never did: every send to it
    queued until its deadline, and a peer restarted with a fixed ``--port`` trained alone)."""
    from gossiploco.reach.reachability import NonceListener

    key = SwarmKey.generate()
    exchanges = _swarm(3, key=key)
    try:
        _all_reduce(exchanges, "mix1/0")  # every peer heard from its process
        endpoint = exchanges[2].endpoints[2]
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        exchanges[2].close()  # killed: no goodbye
        assert wait_until(lambda: 2 not in exchanges[0].connected() and 2 not in exchanges[1].connected(), 10.0)
        check = once_free(lambda: NonceListener(host, int(port), b"nonce"))  # its port, freed a moment ago
        assert wait_until(lambda: check.accepted >= 2, 10.0)  # both redialing DEALERs met the check's listener
        check.close()
        exchanges[2] = ZmqExchange(2, [ex.endpoints[ex.rank] for ex in exchanges[:2]] + [endpoint], "sealed", 10.0,
                                   chunk_bytes=CHUNK, trust=Trust.static(key, 2, 3))
        exchanges[2].announce(-1)  # it speaks (a joining peer announces itself): a probe, asking for replies
        assert wait_until(lambda: all(2 in ex.connected() for ex in exchanges[:2]), 10.0), \
            [ex.connected() for ex in exchanges]
        _all_reduce(exchanges, "mix1/1")
    finally:
        _close(exchanges)
