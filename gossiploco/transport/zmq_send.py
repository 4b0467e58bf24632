"""A DEALER shared by several threads: one bounded send (the lock, ``NOBLOCK``, the poll/retry loop), closing it
with its monitor, and the monitor events of a failed handshake.

A send never blocks for long: it takes the socket's lock and retries a full queue (``NOBLOCK``, then a poll for
room, ``retry.send_wait_s``) until the caller's deadline, so a dead peer whose queue is full cannot hold a sender
forever. Used by ``zmq_sockets`` (the CurveZMQ DEALERs) and ``zmq_sealed`` (the sealed ones). Also the options of
a peer's ROUTER, each with its reason (``router_options``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from gossiploco.errors import ExchangeClosed, ExchangeTimeout, PeerFailed
from gossiploco.transport.retry import send_wait_s

HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
"""Monitor events of a handshake that failed."""
HANDSHAKE_REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
"""Those after which libzmq gives up on the connection (the other end refused it: the owner dials again). A handshake
that failed with no detail (the connection dropped or timed out during it, as a relay's stream reset makes it) is
dialed again by libzmq itself (measured: 14 tries in 2 s at a 100 ms reconnect interval); dialing it again here too
would only tear down a sibling connection that works."""
HEARTBEAT_MIN_IVL_MS = 1000
"""ZMTP heartbeats never ping more often than this (``heartbeat``)."""


def heartbeat(sock: zmq.Socket, timeout_ms: int) -> None:
    """ZMTP heartbeats on ``sock``'s connections: a PING every third of ``timeout_ms`` (at least a second), and the
    connection dropped when nothing came for ``timeout_ms`` after one. A dead or frozen peer is found within
    ``timeout_ms`` plus an interval (6.7 s by default, where a PING a second took 6 s); each PING and its PONG cost
    both ends an encrypted message and a wake-up of libzmq's I/O thread, on every connection, so a peer's idle CPU
    is proportional to its connections times this rate (three fifths of what a PING a second cost by default, a
    tenth with ``heartbeat_s = 30``)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(HEARTBEAT_MIN_IVL_MS, timeout_ms // 3))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)


class GaveUp(Exception):
    """``give_up()`` said to stop retrying a full queue (the caller sends elsewhere); nothing was sent."""


def send_until(sock: zmq.Socket, lock: threading.Lock, frames: list, *, deadline: float, what: str, peer: int,
               rank: int, closed: Callable[[], bool], copy: bool = True, track: bool = False,
               give_up: Callable[[], bool] | None = None) -> zmq.MessageTracker | None:
    """Queue ``frames`` on ``sock`` (holding ``lock``) for ``peer``, retrying a full queue until ``deadline``.
    Returns zmq's tracker (with ``track``). Raises ``ExchangeTimeout`` at the deadline, ``ExchangeClosed`` once
    ``closed()``, ``PeerFailed`` on a socket error, and ``GaveUp`` when the queue is full and ``give_up()`` holds."""
    if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise ExchangeTimeout(f"{what}: the connection to {peer} stayed busy past the deadline")
    try:
        while True:
            if closed():
                raise ExchangeClosed(f"rank {rank}: exchange closed during {what}")
            try:
                return sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy, track=track)
            except zmq.Again:
                if give_up is not None and give_up():
                    raise GaveUp from None
            except zmq.ZMQError as exc:
                raise PeerFailed(f"{what}: sending to {peer} failed: {exc}") from exc
            wait_s = send_wait_s(deadline, time.monotonic())
            if wait_s is None:
                raise ExchangeTimeout(f"{what}: peer {peer} did not take data by the deadline")
            sock.poll(max(1, int(1000 * wait_s)), zmq.POLLOUT)
    finally:
        lock.release()


def close_leaving_monitor(sock: zmq.Socket, linger_s: float = 0.0) -> None:
    """Close ``sock`` (the caller holds its lock; messages still queued get ``linger_s``, 0: dropped at once) after
    stopping its monitor, whose reader stays open: the thread that polls that reader closes it (see
    ``close_monitored`` for why the order matters)."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    sock.close(linger=int(1000 * linger_s))


def close_monitored(sock: zmq.Socket, lock: threading.Lock, monitor: zmq.Socket, linger_s: float) -> None:
    """Close ``sock`` (messages already queued get ``linger_s``) and its ``monitor``, holding ``lock``: senders notice
    the close within ``retry.SEND_RETRY_S`` and release it. The monitor is stopped while its reader is still open:
    libzmq's "monitor stopped" event is a blocking send that would hang on a closed reader."""
    with lock:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(linger=0)
        sock.close(linger=int(1000 * linger_s))


KEEPALIVE_IDLE_S, KEEPALIVE_INTVL_S, KEEPALIVE_COUNT = 10, 2, 3
"""TCP keepalive of a ROUTER's inbound connections: a dead machine's connection is dropped after about 16 s."""


def router_options(router: zmq.Socket, max_frame_bytes: int, handshake_ms: int) -> None:
    """A peer's ROUTER's options, set before it binds: why each is there, below."""
    router.setsockopt(zmq.RCVHWM, 1000)
    # ROUTER_HANDOVER: a new connection with a routing id the ROUTER still holds (a peer that
    # reconnects before its old, dead connection is torn down: after a freeze, a partition, or
    # in a race with a restart) takes the id over. Without it libzmq parks the new connection
    # unread for good (seen: a resumed peer never heard the others again). Only members get
    # this far (CurveZMQ + ZAP); a message whose routing id names another peer than the one its
    # key authenticated is refused (``transport.admission``), and each peer is pinned to one process
    # (incarnation). Known limit: a misbehaving member could still take over another member's
    # routing id (ZAP does not see routing ids), costing that peer its connection until it reconnects.
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # No ZMTP heartbeats on the ROUTER: libzmq 4.3.4/4.3.5 (and master) abort the whole process
    # (``Assertion failed: !_io_error (stream_engine_base.cpp:310)``) when a connection whose
    # input is stopped (its queue full, or its pipe taken over by ROUTER_HANDOVER) hangs up and
    # the heartbeat timer then writes to it (zeromq/libzmq#4364). A sender 1,000 messages ahead
    # of a busy receiver that then dies was enough. TCP keepalive drops a dead machine's stale
    # inbound connection instead; the DEALERs' heartbeats (which never stop input: they receive
    # nothing) still detect dead and frozen peers. ``tests/test_attacks.py`` replays the crash.
    router.setsockopt(zmq.TCP_KEEPALIVE, 1)
    router.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    router.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    router.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_COUNT)
    # Frames far beyond any valid message make zmq drop the connection before buffering them.
    router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    # A client that connects and never completes the handshake is dropped after ``handshake_ms``.
    router.setsockopt(zmq.HANDSHAKE_IVL, handshake_ms)
    # The ROUTER dials only reverse connections (``Receiver.dial``). libzmq's own redialing starts again at 100 ms
    # after every TCP connection, handshake or not, so an endpoint that takes TCP but refuses or never completes
    # the handshake was dialed 10 times a second for as long as it was wanted. So libzmq never redials here; the
    # receiving thread redials the endpoints it still wants (``retry.Redials``: backoff counted from the last
    # handshake), from its monitor's events.
    router.setsockopt(zmq.RECONNECT_IVL, -1)
