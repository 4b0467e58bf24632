"""One exchange call as a state machine, and the loop every driver runs it with.

A call (a swap, a ring all-reduce, a state download, leading or following a group agreement) is
created by a driver when its owner asks for an exchange. It never touches a socket, a thread or a
clock: the driver asks it, holding the node's lock, what it needs next (``poll``), and it answers
with a ``Step``:

* ``mail``: a chunk it was waiting for is here; the driver hands it to ``feed`` (outside the
  lock: this is where the mixing math runs) and sends whatever ``feed`` returns;
* ``wait_until``: nothing to do before that time unless an event arrives (a message, a
  connection change) -- the driver sends ``sends`` (if any), then sleeps until then or until the
  node changes;
* ``done``: the call succeeded; ``outcome()`` gives its result (called outside the lock, after
  the driver is done with the memory the call's sends read);
* ``error``: the call failed (``ExchangeTimeout``, ``PeerFailed``, ``ExchangeClosed``); its
  ``sends`` tell the other participants at once (``Abort``) so they do not wait out a deadline.

``run_call`` is that loop for a driver that may block (the ZeroMQ driver runs it on the caller's
thread); the deterministic simulator runs the same steps from its event queue.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gossiploco.errors import ExchangeError, ExchangeTimeout, PeerFailed
from gossiploco.protocol.messages import Data, Send

if TYPE_CHECKING:
    from gossiploco.protocol.node import PeerNode


@dataclass
class Step:
    """What a call wants next; see the module docstring."""

    sends: list[Send] = field(default_factory=list)
    mail: Data | None = None
    wait_until: float | None = None
    done: bool = False
    error: ExchangeError | None = None


class Call(ABC):
    """One exchange on one peer. ``start``/``poll``/``fail`` run under the node's lock, ``feed`` outside it.

    ``key`` names the exchange, ``began``/``deadline`` bound it (from the driver's clock), ``what``
    describes it in errors.
    """

    key: str
    what: str

    def __init__(self, key: str, began: float, deadline: float):
        self.key, self.began, self.deadline = key, began, deadline
        self.finished = False

    @abstractmethod
    def start(self, node: PeerNode) -> list[Send]:
        """Register with ``node`` and return the first messages to send."""

    @abstractmethod
    def poll(self, node: PeerNode, now: float) -> Step:
        """The next step (never blocks)."""

    @abstractmethod
    def outcome(self) -> Any:
        """The result, once ``poll`` said ``done``."""

    def feed(self, message: Data) -> list[Send]:
        """Use a chunk ``poll`` handed out; returns messages to send. Raises ``PeerFailed`` for bad data."""
        raise NotImplementedError

    def fail(self, node: PeerNode, error: ExchangeError) -> list[Send]:
        """The call failed with ``error``: forget it, and say so to whoever must know."""
        self.close(node)
        return []

    def close(self, node: PeerNode) -> None:
        """Forget the call's registrations with ``node`` (idempotent)."""
        self.finished = True


class DataCall(Call):
    """A call that waits for data chunks, one at a time, in the order ``need`` gives."""

    def __init__(self, key: str, began: float, deadline: float, watch: list[int]):
        super().__init__(key, began, deadline)
        self.watch = watch
        """Peers whose ``Abort`` of this key fails the call (they gave up: no chunk will come)."""
        self.digest: object = None
        """The digest of the member list the call runs over (on every chunk it sends), None for a call of two."""

    @abstractmethod
    def need(self) -> tuple[int, int] | None:
        """``(sender, chunk index)`` of the next chunk wanted; None once complete."""


    @abstractmethod
    def expected_senders(self) -> set[int]:
        """Peers this call takes chunks of its key from (chunks from others are refused at once)."""

    def start(self, node: PeerNode) -> list[Send]:
        return node.begin(self.key, self.expected_senders())

    def poll(self, node: PeerNode, now: float) -> Step:
        want = self.need()
        if want is None:
            self.close(node)
            return Step(done=True)
        sender, chunk = want
        message = node.mailbox.take(self.key, sender, chunk)
        if message is not None:
            node.bytes_received += message.data.numel() * message.data.element_size()
            return Step(mail=message)
        error, wake = node.fault(self.key, sender, self.watch, self.began, now, self.digest)
        if error is None and now >= self.deadline:
            error = ExchangeTimeout(f"{self.what}: no chunk {chunk} from {sender} within {self.deadline - self.began:.1f}s")
        if error is not None:
            return Step(sends=self.fail(node, error), error=error)
        return Step(wait_until=self.deadline if wake is None else min(wake, self.deadline))

    def fail(self, node: PeerNode, error: ExchangeError) -> list[Send]:
        self.close(node)
        return node.aborts(self.key, [p for p in self.watch if p != node.rank])

    def close(self, node: PeerNode) -> None:
        if not self.finished:
            self.finished = True
            node.end(self.key)


def run_call(call: Call, node: PeerNode, *, locked: Callable, wait: Callable[[float | None], None],
             clock: Callable[[], float], send: Callable[[list[Send]], None],
             before_feed: Callable[[Call, Data], None] | None = None,
             before_outcome: Callable[[], None] | None = None) -> Any:
    """Drive ``call`` to its end on a driver that may block; returns its result or raises its error.

    ``locked()`` is a context manager holding the node's lock; ``wait(until)`` (called with the
    lock held) sleeps until ``until`` or until the node changes; ``send(sends)`` (called without
    the lock) hands messages to the carrier, raising ``ExchangeError`` if it cannot within the
    call's deadline; ``before_feed`` (optional) runs before each ``feed`` and ``before_outcome``
    before ``outcome``, e.g. to wait until zero-copy sends released the memory about to be written.
    """
    with locked():
        sends = call.start(node)
    while True:
        try:
            send(sends)
        except ExchangeError as exc:
            with locked():
                sends = call.fail(node, exc)
            _send_quietly(send, sends)
            raise
        with locked():
            while True:
                step = call.poll(node, clock())
                if step.wait_until is None or step.sends:
                    break
                wait(step.wait_until)
        if step.wait_until is not None:  # a repeat to send before waiting on
            sends = step.sends
            continue
        if step.error is not None:
            _send_quietly(send, step.sends)
            raise step.error
        if step.done:
            send(step.sends)
            if before_outcome is not None:
                before_outcome()
            return call.outcome()
        try:
            if before_feed is not None:
                before_feed(call, step.mail)
            sends = call.feed(step.mail)
        except (PeerFailed, ExchangeTimeout) as exc:
            with locked():
                sends = call.fail(node, exc)
            _send_quietly(send, sends)
            raise


def _send_quietly(send: Callable[[list[Send]], None], sends: list[Send]) -> None:
    """Best-effort sends of a failing call (its aborts): a failure to send them is not news."""
    try:
        send(sends)
    except ExchangeError:
        pass
