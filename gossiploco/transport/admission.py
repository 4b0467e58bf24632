"""Admission: who sent a message on the ZeroMQ data plane, decided before the protocol sees it.

Pure code: no sockets, threads or clocks (``now`` is passed in), so every rule is unit-tested
directly (``tests/test_admission.py``). A message that reaches a peer's ROUTER carries up to three
claims of who sent it:

* the connection's routing id, ``"<peer>.<incarnation>"`` on a data connection and
  ``"<peer>.<incarnation>/control"`` on a control one (``security.trust.routing_id``; the
  incarnation is random per process);
* the header's ``sender``;
* with ``trust``, the peer id the connection's CurveZMQ key was authenticated as (the ZAP handler's
  ``User-Id``, ``zmq_auth``).

``identify`` admits the message only if all of them name the same peer and it came on the right
connection for its kind (``Ready``, ``Decision``, ``Abort`` on the control one, everything else on the
data one). ``pin`` then holds each peer to one process: another incarnation claiming the same peer
is refused while the pinned one's connection has not dropped since it was pinned (a restarted
peer's new process is accepted once its old connection is gone). Every refusal raises
``MalformedMessage``; the owner counts it with ``reject`` by its reason (``MalformedMessage.reason``:
numbers and quoted values masked, so alike refusals count together).

Not thread-safe: the owner (``ZmqExchange``) calls it under its lock.
"""

from __future__ import annotations

from collections import Counter

from gossiploco.errors import MalformedMessage
from gossiploco.protocol.messages import CONTROL, Message
from gossiploco.security.trust import parse_routing_id


class Admission:
    """Who may speak as whom; see the module docstring. ``authenticated``: the carrier authenticates
    every connection (``trust``), so the authenticated peer id must match too."""

    def __init__(self, authenticated: bool):
        self.authenticated = authenticated
        self.rejected: Counter[str] = Counter()
        """Messages refused, by reason (after decoding, and the protocol's own refusals)."""
        self._pinned: dict[int, tuple[bytes, float]] = {}  # peer -> (its process's incarnation, when pinned)

    def identify(self, routing_id: bytes, sender: int, message: Message, authenticated_as: str | None) -> bytes:
        """The incarnation of ``sender`` if the connection ``routing_id`` (authenticated as peer
        ``authenticated_as``; None without ``trust``) may carry ``message`` from it; else ``MalformedMessage``."""
        claimed = parse_routing_id(routing_id)
        if claimed is None or claimed[0] != sender or claimed[2] != isinstance(message, CONTROL):
            raise MalformedMessage(f"sender {sender} arrived on connection {routing_id[:32]!r}")
        if self.authenticated and authenticated_as != str(sender):
            raise MalformedMessage(f"sender {sender} arrived on a connection authenticated as {authenticated_as!r}")
        return claimed[1]

    def pin(self, sender: int, incarnation: bytes, lost_at: float, now: float) -> str | None:
        """Hold ``sender`` to the process ``incarnation`` (``lost_at``: when its connection last dropped,
        -inf if never). Raises ``MalformedMessage`` for another process while the pinned one is up;
        returns a note when a new process of a peer is accepted (a restart), else None."""
        pinned = self._pinned.get(sender)
        if pinned is not None and pinned[0] == incarnation:
            return None
        if pinned is not None and lost_at < pinned[1]:
            raise MalformedMessage(f"another process claims to be peer {sender} while its connection is up")
        self._pinned[sender] = (incarnation, now)
        return None if pinned is None else f"peer {sender} speaks from a new process now"

    def forget(self, peer: int) -> None:
        """``peer`` left the run and was forgotten (``ZmqExchange.forget_peer``): whichever process of it speaks
        next is pinned anew. Without this, the node having forgotten when its connection dropped, the process it
        comes back as would be refused for good as "another process ... while its connection is up"."""
        self._pinned.pop(peer, None)

    def is_pinned(self, peer: int) -> bool:
        """A process of ``peer`` was admitted (for tests and diagnostics)."""
        return peer in self._pinned

    def reject(self, reason: str) -> int:
        """Count one refused message with ``reason``; returns how many have had that reason so far."""
        self.rejected[reason] += 1
        return self.rejected[reason]

    @property
    def total_rejected(self) -> int:
        return sum(self.rejected.values())
