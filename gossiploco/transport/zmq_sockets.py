"""One peer's ZeroMQ sockets: what they are, how they connect, and how a message goes out.

Peer ``i`` binds one ROUTER (everything addressed to it arrives there) and connects, per other
peer, a data DEALER (routing id ``"i.<incarnation>"``) with a monitor socket (ZMTP handshakes and
disconnects: a dead process at once, a frozen one or a silent machine after the heartbeat
timeout) and a control DEALER (routing id ``"i.<incarnation>/control"``) for ``Ready``,
``Decision`` and ``Abort``, so those never queue behind megabytes of data on a slow link. The
incarnation is random per process, so the receiver can tell a restarted peer from another
connection of the same process (see ``ROUTER_HANDOVER`` below).

Thread rules (zmq sockets are not thread-safe): the ROUTER and the monitors belong to the one
thread that receives; each DEALER has a lock, and any thread may send on it while holding it.
Sends never block for long: ``NOBLOCK`` with a poll/retry loop bounded by the caller's deadline,
so a dead peer whose queue is full cannot hold a sender forever.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from gossiploco.errors import ExchangeClosed, ExchangeError, ExchangeTimeout, PeerFailed
from gossiploco.transport import codec

SEND_RETRY_S = 0.05
"""Longest wait between two tries of a send whose queue is full."""
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
"""Default liveness timeout (``heartbeat_s`` overrides it). A heartbeat waits behind data already
queued on the connection, so it must exceed the time one chunk takes on the slowest link: a
4 MiB chunk needs 0.7 s at 50 Mbit/s but over 5 s below about 7 Mbit/s."""
KEEPALIVE_IDLE_S, KEEPALIVE_INTVL_S, KEEPALIVE_COUNT = 10, 2, 3
"""TCP keepalive of inbound connections: a dead machine's connection is dropped after about 16 s."""


def routing_id(rank: int, incarnation: str, control: bool) -> bytes:
    """``b"<rank>.<incarnation>"`` for a data connection, plus ``b"/control"`` for a control one."""
    return f"{rank}.{incarnation}{'/control' if control else ''}".encode()


def parse_routing_id(identity: bytes) -> tuple[int, bytes, bool] | None:
    """(rank, incarnation, is control) of a routing id made by ``routing_id``; None for anything else."""
    head, dot, rest = identity.partition(b".")
    if not dot or not head.isdigit() or len(identity) > 64:
        return None
    control = rest.endswith(b"/control")
    return int(head), rest.removesuffix(b"/control"), control


class ZmqSockets:
    """The ROUTER, DEALERs and monitors of peer ``rank``; see the module docstring.

    ``bind`` is the address to bind, ``advertised`` the one peers are told (a port of 0 in it is
    replaced by the port the OS picked: ``endpoint``). Raises ``ExchangeError`` if the bind fails.
    """

    def __init__(self, rank: int, bind: str, advertised: str, *, heartbeat_s: float | None, max_message_bytes: int,
                 chunk_bytes: int):
        self.rank = rank
        self.incarnation = uuid.uuid4().hex[:12]
        """Random per process (see the module docstring)."""
        self.heartbeat_ms = HEARTBEAT_TIMEOUT_MS if heartbeat_s is None else max(1, int(1000 * heartbeat_s))
        self.ctx = zmq.Context(io_threads=1)
        self.sndhwm = max(8, min(1000, (256 << 20) // chunk_bytes))
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVHWM, 1000)
        # ROUTER_HANDOVER: a new connection with a routing id the ROUTER still holds (a peer that
        # reconnects before its old, dead connection is torn down: after a freeze, a partition, or
        # in a race with a restart) takes the id over. Without it libzmq parks the new connection
        # unread for good (seen: a resumed peer never heard the others again). Another process
        # claiming a peer is refused by ``ZmqExchange`` (each peer is pinned to its incarnation);
        # authenticating routing ids is the trust issue's work.
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # No ZMTP heartbeats on the ROUTER: libzmq 4.3.4/4.3.5 (and master) abort the whole process
        # (``Assertion failed: !_io_error (stream_engine_base.cpp:310)``) when a connection whose
        # input is stopped (its queue full, or its pipe taken over by ROUTER_HANDOVER) hangs up and
        # the heartbeat timer then writes to it (zeromq/libzmq#4364). A sender 1,000 messages ahead
        # of a busy receiver that then dies was enough. TCP keepalive drops a dead machine's stale
        # inbound connection instead; the DEALERs' heartbeats (which never stop input: they receive
        # nothing) still detect dead and frozen peers. ``tests/test_zmq_exchange.py`` replays the crash.
        self.router.setsockopt(zmq.TCP_KEEPALIVE, 1)
        self.router.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        self.router.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
        self.router.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_COUNT)
        # Frames far beyond any valid message make zmq drop the connection before buffering them.
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + codec.MAX_HEADER_BYTES)
        try:
            self.router.bind(bind)
        except zmq.ZMQError as exc:
            self.router.close(linger=0)
            self.ctx.term()
            raise ExchangeError(f"rank {rank}: cannot bind {bind}: {exc}") from exc
        host, _, port = advertised.rpartition(":")
        if port in ("0", "*"):  # the port the OS picked is the one peers must be told
            port = self.router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        self.endpoint = f"{host}:{port}"
        self.dealers: dict[int, tuple[zmq.Socket, threading.Lock]] = {}
        self.controls: dict[int, tuple[zmq.Socket, threading.Lock]] = {}
        self.monitors: dict[zmq.Socket, int] = {}
        self.new_monitors: queue.SimpleQueue = queue.SimpleQueue()
        """Monitors of peers added since the receiving thread last looked (it polls them)."""

    def connect(self, peer: int, endpoint: str) -> None:
        """A data DEALER to ``peer`` with its monitor, and a control DEALER."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, self.sndhwm)
        dealer.setsockopt(zmq.ROUTING_ID, routing_id(self.rank, self.incarnation, control=False))
        dealer.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_ms)
        # "Connected" means the ZMTP handshake succeeded: a frozen process's kernel still accepts
        # TCP connections, but only a live peer completes the handshake.
        monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        monitor.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        self.dealers[peer] = (dealer, threading.Lock())
        self.monitors[monitor] = peer
        self.new_monitors.put(monitor)
        control = self.ctx.socket(zmq.DEALER)
        control.setsockopt(zmq.LINGER, 0)
        control.setsockopt(zmq.ROUTING_ID, routing_id(self.rank, self.incarnation, control=True))
        control.connect(endpoint)
        self.controls[peer] = (control, threading.Lock())

    def reconnect(self, peer: int, old: str, new: str) -> None:
        """``peer`` moved from ``old`` to ``new`` (it restarted elsewhere)."""
        for sockets in (self.dealers, self.controls):
            sock, lock = sockets[peer]
            with lock:
                try:
                    sock.disconnect(old)
                except zmq.ZMQError:
                    pass
                sock.connect(new)

    def send(self, peer: int, frames: list, *, control: bool, deadline: float, what: str, zero_copy: bool,
             closed: Callable[[], bool]) -> zmq.MessageTracker | None:
        """Queue ``frames`` for ``peer``, retrying a full queue until ``deadline``. By default zmq copies
        the payload; with ``zero_copy`` it reads it in place until the returned tracker is done."""
        sockets = self.controls if control else self.dealers
        if peer not in sockets:
            raise PeerFailed(f"{what}: {peer} is not a known peer")
        dealer, lock = sockets[peer]
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ExchangeTimeout(f"{what}: the connection to {peer} stayed busy past the deadline")
        try:
            while True:
                if closed():
                    raise ExchangeClosed(f"rank {self.rank}: exchange closed during {what}")
                try:
                    return dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=not zero_copy, track=zero_copy)
                except zmq.Again:
                    pass
                except zmq.ZMQError as exc:
                    raise PeerFailed(f"{what}: sending to {peer} failed: {exc}") from exc
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ExchangeTimeout(f"{what}: peer {peer} did not take data by the deadline")
                dealer.poll(max(1, int(1000 * min(remaining, SEND_RETRY_S))), zmq.POLLOUT)
        finally:
            lock.release()

    @staticmethod
    def wait_sent(trackers: list[zmq.MessageTracker], deadline: float, what: str) -> None:
        """Block until zmq has released the buffers of zero-copy sends ``trackers`` (then forget them)."""
        for tracker in trackers:
            if tracker is None or tracker.done:
                continue
            try:
                tracker.wait(max(0.001, deadline - time.monotonic()))
            except zmq.NotDone:
                raise ExchangeTimeout(f"{what}: sent data still queued at the deadline") from None
        trackers.clear()

    def check_reachable(self, timeout_s: float) -> bool:
        """True if a ZeroMQ handshake with ``endpoint`` (this peer's advertised address) succeeds within ``timeout_s``."""
        probe = self.ctx.socket(zmq.DEALER)
        monitor = probe.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            probe.setsockopt(zmq.LINGER, 0)
            probe.setsockopt(zmq.ROUTING_ID, f"probe-{uuid.uuid4().hex[:8]}".encode())
            probe.connect(self.endpoint)
            return bool(monitor.poll(int(1000 * timeout_s)))
        finally:
            probe.disable_monitor()
            monitor.close(linger=0)
            probe.close(linger=0)

    def close(self, linger_s: float) -> None:
        """Close every DEALER (messages already queued get ``linger_s``) and the context. The ROUTER
        must be closed first, by its thread (``router.close``)."""
        monitors = {peer: monitor for monitor, peer in self.monitors.items()}
        for peer, (dealer, lock) in self.dealers.items():
            with lock:  # senders notice the close within SEND_RETRY_S and release it
                # Stop the monitor while its reader is still open: libzmq's "monitor stopped"
                # event is a blocking send that would hang on a closed reader.
                try:
                    dealer.disable_monitor()
                except zmq.ZMQError:
                    pass
                monitors[peer].close(linger=0)
                dealer.close(linger=int(1000 * linger_s))
        for control, lock in self.controls.values():
            with lock:
                control.close(linger=int(1000 * linger_s))
        self.ctx.term()
