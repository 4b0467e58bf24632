"""The service thread of the ZeroMQ driver: it sends what the receiver decided and serves state.

The receiver thread never sends (a full queue to a slow peer would stall every peer's messages),
and a failing call does not block on its aborts: the node's ``Send`` actions (hello replies,
decisions, aborts), ``ServeState`` requests and the transport's own ``TransportMessage``s are queued
here (``submit``, bounded: a full queue drops the action, counted in ``Traffic.dropped``) and carried out in order on this thread, each
send bounded by ``CONTROL_SEND_S``, each state upload by ``timeout_s``.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gossiploco.errors import ExchangeClosed, ExchangeError
from gossiploco.protocol.agreement import CONTROL_SEND_S
from gossiploco.protocol.collectives import state_chunks
from gossiploco.protocol.messages import Send, ServeState
from gossiploco.transport.traffic import Traffic

log = logging.getLogger(__name__)

QUEUE_SIZE = 1024
POLL_S = 0.1
"""How often the thread wakes to notice ``close()``."""

@dataclass(frozen=True)
class TransportMessage:
    """A message of the transport itself (not the protocol's), sent as ready-made ``frames`` to ``peer`` on
    its control connection: a sealed-data key offer (``zmq_sealed``)."""

    peer: int
    frames: list
    what: str


StateProvider = Callable[[], tuple[int, torch.Tensor] | None]
"""Returns (round, flat fp32 state) to hand a catching-up peer, or None when there is none yet."""
SendFn = Callable[[Send, float, str], object]
"""The driver's send: ``send(action, deadline, what)``; raises ``ExchangeError``."""
SendFramesFn = Callable[[int, list, float, str], object]
"""The driver's send of a ``TransportMessage``: ``send(peer, frames, deadline, what)``; raises ``ExchangeError``."""


class Service:
    """The service thread's work for peer ``rank`` (``run`` is the thread's body); see the module docstring.

    ``send``: the driver's send; ``send_frames``: its send of a ``TransportMessage``; ``chunk_elems``: values per
    state chunk; ``closed()``: the driver is closing.
    """

    def __init__(self, rank: int, send: SendFn, traffic: Traffic, *, chunk_elems: int, timeout_s: float,
                 closed: Callable[[], bool], send_frames: SendFramesFn):
        self.rank = rank
        self.send = send
        self.send_frames = send_frames
        self.traffic = traffic
        self.chunk_elems = chunk_elems
        self.timeout_s = timeout_s
        self.closed = closed
        self.provider: StateProvider | None = None
        """What ``ServeState`` uploads (``ZmqExchange.serve_state``); None: "no state yet"."""
        self._tasks: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)

    def submit(self, action: Send | ServeState | TransportMessage) -> None:
        """Queue ``action`` for this thread; never blocks (a full queue drops it, logged and counted). Any thread."""
        try:
            self._tasks.put_nowait(action)
        except queue.Full:
            self.traffic.drop()
            log.warning("rank %d: service queue full; dropped a %s for %d", self.rank, type(action).__name__, action.peer)

    def run(self) -> None:
        """The thread's loop, until ``closed()`` or the exchange is closed under a send."""
        while not self.closed():
            try:
                action = self._tasks.get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                if isinstance(action, ServeState):
                    self._serve_state(action)
                elif isinstance(action, TransportMessage):
                    self.send_frames(action.peer, action.frames, time.monotonic() + CONTROL_SEND_S, action.what)
                else:
                    self.send(action, time.monotonic() + CONTROL_SEND_S, type(action.message).__name__)
            except ExchangeClosed:
                return
            except ExchangeError as exc:
                log.log(logging.WARNING if isinstance(action, TransportMessage) else logging.INFO,
                        "rank %d: %s to %d not sent: %s", self.rank, getattr(action, "what", type(action).__name__),
                        action.peer, exc)

    def _serve_state(self, action: ServeState) -> None:
        deadline = time.monotonic() + self.timeout_s
        provider = self.provider
        try:
            state = provider() if provider is not None else None
        except Exception:  # noqa: BLE001 - a provider bug is logged; the requester gets "none yet"
            log.exception("rank %d: the state provider failed", self.rank)
            state = None
        for chunk in state_chunks(action.nonce, state, self.chunk_elems):
            self.send(Send(action.peer, chunk), deadline, f"state upload to {action.peer}")
        if state is not None:
            log.info("rank %d: gave round %d state (%d values) to peer %d", self.rank, state[0], state[1].numel(), action.peer)
