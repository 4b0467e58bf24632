"""Pairing as peers become ready: the agreement of a gossip exchange, where nobody waits for the slowest of its group.

A gossip exchange (Mix2's ``GossipMix``: every peer averages with one partner) needs a partner, not a group. Agreed
the way a group mean is (``agreement``: the bucket's leader waits until every member is ready, up to ``grace_s``,
then draws a matching over those ready), every peer of a bucket waits for the bucket's slowest member each round:
with unequal machines the swarm moves at its slowest peer's pace. Here, for the exchanges whose label is in
``PeerNode.paired`` (``ZmqExchange.set_grouping``), the bucket's leader is a matchmaker instead:

* A member ready for the exchange sends the leader ``Ready`` as before (the leader itself counts as ready when it
  reaches the exchange). The first one waits; the next one is paired with it at once: both are told the pair
  (``Decision`` naming the two), which then swaps and averages as a group of two.
* The matchmaking runs in the leader's protocol core, on its receiving thread: a leader still computing pairs its
  followers all the same, so a slow leader delays nobody (a frozen or dead one costs its followers one grace
  window, as before).
* A member left waiting is told it is alone (a ``Decision`` naming it alone: identity for that exchange) as soon as
  no other member of its bucket can still come (every other one is paired, disconnected or gave up), and otherwise
  gives up after its own grace window (``agreement.Follow``'s deadline; it then tells the bucket, ``Abort``, and the
  matchmaker stops counting on it). So a late or dead member costs at most the one member left waiting one grace
  window, and the others nothing.
* A member that asks again (its ``Ready`` is repeated every half grace window) gets its pair again.

**The mixing this gives.** A pair forms from consecutive arrivals. When the order in which the members become
ready is exchangeable (their compute times i.i.d., as with time-budget rounds, ``round.budget_s``), pairing
positions (1, 2), (3, 4), ... of a uniformly random order is a uniformly random perfect matching of those present:
``groups.gossip_rho`` holds, with ``p`` the share of members paired (all but one of an odd count). When speeds
differ persistently, fast members pair with fast ones more often than a uniform matching would: the matching is
then biased toward similar speeds (Mix1's group mean still mixes every member of a bucket each round). Each pair
is a group of its own for the rest of the protocol: its members hold the same list, chunks from anyone else are
refused, and pairs of one exchange are disjoint (the simulator checks both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gossiploco.protocol.agreement import Lead
from gossiploco.protocol.call import Step
from gossiploco.protocol.messages import Decision, Send

if TYPE_CHECKING:
    from gossiploco.protocol.node import PeerNode


PAIRINGS_KEPT = 64
"""Exchange keys a matchmaker remembers (the newest; older rounds' pairings are over)."""


@dataclass
class Pairing:
    """A matchmaker's state for one exchange key."""

    key: str
    candidates: frozenset[int]
    """The bucket's members by the matchmaker's view when the first one came."""
    waiting: int | None = None
    """A member ready with no partner yet."""
    waiting_since: float = 0.0
    paired: dict[int, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    """member -> (its pair, or itself alone, told at what time)."""


def _state(node: PeerNode, key: str, candidates: list[int]) -> Pairing:
    state = node.pairings.get(key)
    if state is None:
        state = Pairing(key, frozenset(candidates))
        node.pairings.put(key, state)
    return state


def _gone(node: PeerNode, key: str, peer: int) -> bool:
    """Whether ``peer`` can no longer take part in ``key`` (disconnected, gave up, or this peer itself closed)."""
    if peer == node.rank:
        return node.closed
    return peer in node.peers.failed or peer in node.aborted.get(key, set())


def _tell(node: PeerNode, key: str, group: tuple[int, ...]) -> list[Send]:
    decision = Decision(key, node.current_round, group)
    return [Send(p, decision) for p in group if p != node.rank]


def ready(node: PeerNode, key: str, member: int, candidates: list[int], now: float) -> list[Send]:
    """``member`` (a follower's ``Ready``, or this leader itself) is ready for ``key``: pair it, keep it waiting, or tell
    it again what it was told."""
    state = _state(node, key, candidates)
    told = state.paired.get(member)
    if told is not None:
        if member == node.rank:
            return []
        group, when = told
        if node.peers.lost_at.get(member, -1.0) >= when:
            group = tuple(p for p in group if p != member)  # a new process of it: that pair was its predecessor's
        return [Send(member, Decision(key, node.current_round, group))]
    if member not in state.candidates or member not in candidates:
        # Its Ready came by a view other than the one this pairing started with (peers came or went meanwhile): paired
        # here, it could meet a member of another bucket by either view. Alone for this exchange, told at once.
        state.paired[member] = ((member,), now)
        return _tell(node, key, (member,))
    other = state.waiting
    if other is not None and other != member and other in candidates and not _gone(node, key, other) \
            and now - state.waiting_since < node.grace_s:
        pair = tuple(sorted((other, member)))
        state.paired[other] = state.paired[member] = (pair, now)
        state.waiting = None
        return _tell(node, key, pair)
    if other != member:
        state.waiting, state.waiting_since = member, now
    return release_if_alone(node, state, now)


def release_if_alone(node: PeerNode, state: Pairing, now: float) -> list[Send]:
    """Tell the waiting member it is alone when no other member of the bucket can still come (every other one is
    paired, disconnected or gave up; this leader counts as coming until it took part or closed)."""
    waiting = state.waiting
    if waiting is None:
        return []
    if _gone(node, state.key, waiting):
        state.waiting = None
        return []
    if any(p != waiting and p not in state.paired and not _gone(node, state.key, p) for p in state.candidates):
        return []
    state.paired[waiting] = ((waiting,), now)
    state.waiting = None
    return _tell(node, state.key, (waiting,))


def on_abort(node: PeerNode, key: str, sender: int, now: float) -> list[Send]:
    """``sender`` abandoned ``key``: stop counting on it (and the member left waiting may be alone now)."""
    state = node.pairings.get(key)
    if state is None:
        return []
    if state.waiting == sender:
        state.waiting = None
    return release_if_alone(node, state, now)


def on_disconnected(node: PeerNode, peer: int, now: float) -> list[Send]:
    """``peer``'s connection dropped: a pairing under way may have a member left waiting alone now."""
    sends: list[Send] = []
    for state in list(node.pairings.values()):
        if peer in state.candidates or state.waiting == peer:
            if state.waiting == peer:
                state.waiting = None
            sends += release_if_alone(node, state, now)
    return sends


class PairLead(Lead):
    """This peer matches ``key``'s bucket (``view``) and takes part itself: ready when it starts, paired with the
    member waiting or the next to come, alone when nobody else can come or after ``grace_s``."""

    def start(self, node: PeerNode) -> list[Send]:
        sends: list[Send] = []
        for early in sorted(node.ready.pop(self.key, None) or ()):  # kept while this peer was starting up
            sends += ready(node, self.key, early, self.view, self.began)
        return sends + ready(node, self.key, node.rank, self.view, self.began)

    def close(self, node: PeerNode) -> None:
        state = node.pairings.get(self.key)
        if state is not None and state.waiting == node.rank:  # gave up (or failed): nobody is to be paired with it
            state.waiting = None
        super(Lead, self).close(node)

    def poll(self, node: PeerNode, now: float) -> Step:
        error = node.open_error(self.what)
        if error is not None:
            return Step(error=error)
        state = _state(node, self.key, self.view)
        sends = release_if_alone(node, state, now)
        told = state.paired.get(node.rank)
        if told is None and now < self.deadline:
            return Step(sends=sends, wait_until=self.deadline)
        if told is None:  # nobody came within the grace window
            state.paired[node.rank] = ((node.rank,), now)
            if state.waiting == node.rank:
                state.waiting = None
        group = list(state.paired[node.rank][0])
        node.grouped.put(self.key, frozenset(group))
        self.finished, self.group = True, group
        return Step(done=True, sends=sends)
