"""Group agreement: before an exchange, the peers taking part agree on its member list.

A peer's candidates for exchange ``key`` of round r are its bucket of its view (``members(r)``), and their
leader is the bucket's lowest lead score (``protocol.groups``: buckets of at most ``group_size`` members on
average, a leader no one can choose; a view of at most ``group_size`` members is one bucket).

* Followers send it ``Ready(key, r)`` and wait for its ``Decision``.
* The leader (``Lead``) waits until every candidate is ready or has failed, at most ``grace_s`` from its start or
  from the first follower's ``Ready`` if that came earlier, then sends the group (itself plus the ready followers,
  at most ``groups.cap``) to each of them. Nobody waits for a peer outside its bucket: a late or dead member costs
  its own group one grace window at most, and so does a late leader (below).
* Everyone in the group then runs the exchange over exactly that list. Every peer of a group
  holds the same list, so gossip pairings computed from it are mutual.
* A straggler whose ``Ready`` comes after the decision is told at once and does identity.
* A follower repeats its ``Ready`` every half grace window (a message lost with a dropped
  connection costs half a window, not the whole wait). A leader that is leading the key answers a repeated
  ``Ready`` with ``Leading``: it is there and decides within its window.
* A follower (``Follow``) waits for the decision one grace window plus one control send, or, once its leader said
  ``Leading``, two windows plus one control send (the leader's window may have begun up to one window later, at
  its own start). So a leader that is late (still computing, frozen, or gone without a word) costs its
  followers one window and a control send, then they do identity; a leader that is there and waits for slow
  members is waited for. A follower also fails at once when its leader disconnects or abandons the key. It then
  tells every candidate of its bucket that it abandons the key (``Abort``), so a peer that counted on it fails at
  once instead of waiting out a deadline (this is what keeps a dead leader from costing more than one grace window).
  A leader stops waiting for a member that sent ``Abort`` for the key (it followed another leader by an older
  view): no ``Ready`` will come from it. Nor for the members of another leader's decision without it: a peer caught
  up into a round the others are in may lead one of its exchanges by a view that counts it in, so a leader that hears
  its join news sends it the decisions it made without it that it would lead (``went_on_without``). One of
  a round later than the peer's own tells it that it trails the swarm: it is a straggler (``PeerNode.straggling``)
  and re-aligns at its next round's start.
* A decision naming a member this peer does not know yet (discovery has not found it: no address, no
  key) fails the follower's call, counted (``unknown_members``): a group it cannot run is a failed
  exchange, never a crash.
* A peer asked to lead a key while its own view names another leader, or puts the asker in another bucket, or of a
  round it has left without deciding it (``left_behind``), answers "not leading" (an empty decision); a peer still
  starting up keeps the ``Ready`` (it is about to lead).
* A key run again (``keys.again_key``: Mix1's ring retried among a group's survivors) is declined by the members
  that completed its first attempt (``protocol.declines``): the lead order skips them, a leader does not wait for
  them, and a follower whose leader declines follows the next leader of the order, or leads where it is next.

Peers whose views name different leaders form disjoint groups (each consistent) or do identity:
never a mixed-up exchange. Chunks of a key from a peer outside the group this peer agreed on are
refused at once (``PeerNode``), as a second line of defence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gossiploco.errors import ExchangeError, ExchangeTimeout, NoDecision, PeerFailed
from gossiploco.protocol import declines, groups
from gossiploco.protocol.call import Call, Step
from gossiploco.protocol.messages import Action, Decision, Leading, Ready, Send, op_and_round

if TYPE_CHECKING:
    from gossiploco.protocol.node import PeerNode

READY_REPEAT = 0.5
"""A follower repeats its ``Ready`` every this many grace windows until the decision comes (it is idempotent)."""
CONTROL_SEND_S = 1.0
"""Deadline for sending one control message (hello, ready, abort, state request)."""


def ring_order(members: set[int] | list[int], behind_nat: set[int]) -> list[int]:
    """The group's order, which is its ring's: peers behind NAT (``behind_nat``) between reachable
    ones, so that ring neighbours talk over direct or reverse connections rather than relays
    (``gossiploco.reach.paths``); two NAT'd neighbours only when they outnumber the reachable.
    Otherwise by id. The leader decides it; everyone takes it from the decision, so all agree."""
    reachable = sorted(m for m in members if m not in behind_nat)
    natted = sorted(m for m in members if m in behind_nat)
    order: list[int] = []
    while reachable or natted:
        if reachable:
            order.append(reachable.pop(0))
        if natted:
            order.append(natted.pop(0))
    return order


class _GroupCall(Call):
    """An agreement call; its outcome is the agreed group."""

    group: list[int]

    def outcome(self) -> list[int]:
        return self.group


class Lead(_GroupCall):
    """This peer leads ``key``: wait for its bucket's followers (``view``; at most ``grace_s``), then decide."""

    def __init__(self, key: str, view: list[int], began: float, grace_s: float, buckets: int = 1):
        super().__init__(key, began, began + grace_s)
        self.view = view
        self.buckets = buckets
        """How many buckets the view split into (``groups.bucket_count``): every member it waits for or decides on
        shares this peer's bucket of that many (the simulator checks it)."""
        self.what = f"group {key!r} (leading {view})"

    def start(self, node: PeerNode) -> list[Send]:
        node.leading_now.put(self.key, True)  # repeated Readys are answered with ``Leading`` (``on_ready``)
        return []

    def close(self, node: PeerNode) -> None:
        node.leading_now.pop(self.key)
        super().close(node)

    def poll(self, node: PeerNode, now: float) -> Step:
        error = node.open_error(self.what)
        if error is not None:
            return Step(error=error)
        ready = node.ready.get(self.key, set())
        # A member that abandoned the key (``Abort``: its own leader, by its view, disconnected or never decided)
        # sends no Ready: waiting for it would cost the rest of the window, then its next exchange with this peer
        gave_up = node.aborted.get(self.key, set())
        told = node.told.get(self.key)  # another leader's decision without this peer (``went_on_without``)
        if told is not None and node.rank not in told[1]:
            gave_up = gave_up | set(told[1])  # they went on: none of them sends a Ready
        waiting = [p for p in self.view
                   if p != node.rank and p not in node.peers.failed and p not in ready and p not in gave_up]
        first = node.first_ready.get(self.key)
        if first is not None and first < self.began:  # followers were waiting already: one window from the first
            self.deadline = min(self.deadline, max(self.began, first + node.grace_s))
        if waiting and now < self.deadline:
            return Step(wait_until=self.deadline)
        ready = node.ready.pop(self.key, set())  # an early follower whose wait ran out (in gave_up) does identity
        chosen = {node.rank} | {p for p in ready if p not in node.peers.failed and p not in gave_up}
        # A Ready accepted while this peer's view had another size (a member came or went meanwhile) may come from
        # outside the bucket this call leads: told "not leading", as any peer asking the wrong leader is.
        strangers = sorted(p for p in chosen if not groups.in_bucket(node.group_seed, self.key, self.buckets,
                                                                     node.rank, p))
        chosen -= set(strangers)
        limit, over = groups.cap(node.group_size), []
        if len(chosen) > limit:  # a bucket far above its mean (Binomial): the lowest lead scores go on
            order = groups.lead_order(node.group_seed, self.key, chosen)
            chosen, over = set(order[:limit]), order[limit:]
        group = ring_order(chosen, node.behind_nat if node.order_rings else set())
        node.decided.put(self.key, (group, now))
        node.grouped.put(self.key, frozenset(group))
        left_out = sorted(set(self.view) - set(group))
        if left_out:
            why = ("they went on without this peer" if told is not None and set(left_out) <= set(told[1])
                   else f"not ready within {self.deadline - self.began:.1f}s")
            node.note(f"{self.key} goes on without {left_out} ({why})")
        decision = Decision(self.key, node.current_round, tuple(group))
        node.leading_now.pop(self.key)
        self.finished, self.group = True, group
        refusal = Decision(self.key, node.current_round, ())
        return Step(done=True, sends=[Send(p, decision) for p in group + over if p != node.rank]
                    + [Send(p, refusal) for p in strangers])


class Follow(_GroupCall):
    """This peer follows ``leader`` for ``key`` of round ``round_index``: send ``Ready``, wait for the decision."""

    def __init__(self, key: str, leader: int, round_index: int, view: list[int], began: float, grace_s: float):
        super().__init__(key, began, began + grace_s + CONTROL_SEND_S)
        self.leader, self.round, self.view = leader, round_index, view
        self.grace_s = grace_s
        self.leader_there = False
        """Whether the leader said ``Leading``: then the wait is two windows, not one."""
        self.lead: Lead | None = None
        """The call leading the bucket, once this peer took the lead of a key run again (``_next_leader``)."""
        self.what = f"group {key!r} led by {leader}"

    def start(self, node: PeerNode) -> list[Send]:
        # No node.begin here: that would refuse data chunks of ``key`` that fast members send
        # before this peer starts the exchange itself.
        self.sent_at = self.began
        return [Send(self.leader, Ready(self.key, self.round))]

    def poll(self, node: PeerNode, now: float) -> Step:
        if self.lead is not None:  # leading now: its steps are this call's
            step = self.lead.poll(node, now)
            self.deadline = self.lead.deadline
            if step.done:
                self.finished, self.group = True, self.lead.group
            return step
        error = node.open_error(self.what)
        if error is not None:
            return Step(error=error)
        if not self.leader_there and node.leading.get(self.key) == self.leader:
            self.leader_there = True  # it is there, deciding within its window, which may have begun after ours
            self.deadline = self.began + 2 * self.grace_s + CONTROL_SEND_S
        told = node.told.get(self.key)
        if told is not None and told[0] == self.leader:
            node.told.pop(self.key)
            group = told[1]
            if not group:
                error = PeerFailed(f"{self.what}: peer {self.leader} does not lead it (our member views differ)")
            elif node.rank not in group:
                node.left_out.put(self.key, self.round)
                error = ExchangeTimeout(f"{self.what}: this peer was not ready within the grace window; "
                                        f"{list(group)} went on without it")
            elif unknown := sorted(set(group) - node.peers.known):
                # A member discovery has not found yet (no address, no key): this peer cannot run the group.
                node.unknown_members += 1
                error = PeerFailed(f"{self.what}: the decision names peers this peer does not know yet: {unknown}")
            else:
                node.grouped.put(self.key, frozenset(group))
                self.finished, self.group = True, list(group)
                return Step(done=True)
        elif self.leader in node.peers.failed:
            error = PeerFailed(f"{self.what}: the leader disconnected")
        elif self.leader in node.aborted.get(self.key, ()):
            if declines.is_again(self.key):  # it declined the key run again: the next of the lead order leads
                return self._next_leader(node, now)
            error = PeerFailed(f"{self.what}: the leader abandoned the exchange")
        elif now >= self.deadline:
            error = NoDecision(f"{self.what}: no decision within {self.deadline - self.began:.1f}s"
                               + ("" if self.leader_there else " (the leader never said it was there)"))
            node.declines.leader_silent(node, self.key, self.leader)
        if error is None:
            resend_at = self.sent_at + READY_REPEAT * node.grace_s
            if now >= resend_at:  # ask again: a Ready lost with a dropped connection must not cost the whole wait
                self.sent_at = now
                return Step(sends=[Send(self.leader, Ready(self.key, self.round))], wait_until=min(self.deadline, now + READY_REPEAT * node.grace_s))
            return Step(wait_until=min(self.deadline, resend_at))
        return Step(error=error, sends=self.fail(node, error))

    def _next_leader(self, node: PeerNode, now: float) -> Step:
        """The leader declined (or abandoned) a key run again: follow the next leader of the lead order without it
        (``declines.leader_of``: every follower of the bucket heard the same, so all move to the same one), or lead
        the bucket where this peer is next (alone, where every other member declined: identity). Each move costs a
        message's round trip, not a grace window."""
        leader = declines.leader_of(node, self.key, self.view)  # this peer at the latest: it never declines to itself
        self.began, self.leader_there = now, False
        if leader == node.rank:
            self.lead = node.lead_call(self.key, self.round, self.view, now)
            self.what = self.lead.what
            return Step(sends=self.lead.start(node), wait_until=now)
        self.leader, self.sent_at = leader, now
        self.deadline = now + self.grace_s + CONTROL_SEND_S
        self.what = f"group {self.key!r} led by {leader}"
        return Step(sends=[Send(leader, Ready(self.key, self.round))], wait_until=now)

    def close(self, node: PeerNode) -> None:
        if self.lead is not None:
            self.lead.close(node)
        super().close(node)

    def fail(self, node: PeerNode, error: ExchangeError) -> list[Send]:
        self.close(node)
        # Everyone of the view, not just the leader: a peer the leader put in a group with this one
        # must not wait out its deadline for chunks that will not come.
        return node.aborts(self.key, [p for p in self.view if p != node.rank])


def on_ready(node: PeerNode, sender: int, message: Ready, now: float) -> list[Send]:
    """A follower's ``Ready``: count it (this peer leads), answer a straggler with the decision, or
    say this peer does not lead the key. A ``Ready`` from a peer whose connection dropped after the
    decision comes from a new incarnation (it restarted): the group it may be named in is its
    predecessor's, so it is told the group without it."""
    key = message.key
    peers = node.peers
    if sender not in peers.joined and sender in peers.connected:
        # It believes it takes part but its hello never reached us (it froze, came back and kept
        # its view): adopt it from the next round rather than leave it out forever.
        peers.on_join(sender, message.round + 1, said=False)
        node.note(f"peer {sender} is back (ready for {key!r}); it takes part from round {message.round + 1}", routine=True)
    declined = node.declines.on_ready(sender, key)
    if declined is not None:  # it completed the first attempt of a key run again (``protocol.declines``)
        return declined
    decided = node.decided.get(key)
    if decided is not None:  # a straggler (or a duplicate): the group went on
        group, when = decided
        if peers.lost_at.get(sender, -1.0) >= when:
            group = [p for p in group if p != sender]
        return [Send(sender, Decision(key, node.current_round, tuple(group)))]
    own = peers.joined.get(node.rank)  # None: this peer has not decided yet (starting up)
    if own is not None and (own > message.round or not node.leads(key, message.round, sender)
                            or left_behind(node, key)):
        return [Send(sender, Decision(key, node.current_round, ()))]
    if own is not None and node.pairs_as_ready(key):  # matched as it comes (``protocol.pairing``)
        return node.pair_ready(key, sender, message.round, now)
    if key not in node.ready:
        node.first_ready.put(key, now)
    known = node.ready.get(key, set())
    node.ready.put(key, known | {sender})
    if sender in known and node.leading_now.get(key):  # asked again: say this peer is there and deciding
        return [Send(sender, Leading(key, node.current_round))]
    return []


def left_behind(node: PeerNode, key: str) -> bool:
    """Whether this peer will never lead ``key``, which it did not decide: an exchange of a round it has left (Mix1 and
    Mix2 run within their round; a measurement may trail it, ``runtime.peer_monitor``; a paired exchange's matchmaker
    keeps its word past it, ``protocol.pairing``) that it is not leading now. A straggler's ``Ready`` for it is then
    answered "not leading" at once, not kept until the straggler's wait runs out (chaos seed 840767: a thawed peer
    waited 1.5 s on a leader two rounds ahead that counted it in by a later view, and caught up a round late)."""
    op, round_index = op_and_round(key)
    return (op != "monitor" and round_index < node.current_round and not node.leading_now.get(key)
            and not node.pairs_as_ready(key))


def on_decision(node: PeerNode, sender: int, message: Decision) -> None:
    """A leader's answer to this peer's ``Ready`` (or a "not leading")."""
    node.peers.leader_rounds[sender] = message.leader_round  # how far the leader is: a peer left behind learns it here
    node.told.put(message.key, (sender, message.group))
    round_index = op_and_round(message.key)[1]
    if message.group and node.rank not in message.group and round_index > node.current_round:
        # A later round's exchange already went on without this peer (``went_on_without`` tells a peer that
        # joined a round the others had left): it trails the swarm by a round, and re-aligns at its next round's
        # start (``straggling``) instead of missing every exchange until a leader is a whole round ahead of it
        node.left_out.put(message.key, round_index)


def went_on_without(node: PeerNode, peer: int, join_round: int) -> list[Action]:
    """A peer that caught up into a round this one is in (or past) counts itself in that round's exchanges, so by its
    own view it may lead one this peer led without it, and wait a whole grace window for Readys that never come:
    it is sent those decisions (only those it would lead: a follower's Ready is answered at once anyway). Only
    this round's and the last (an honest joiner lags a round at most): news that claims an old round (a peer's
    own to send, as often as it likes) costs a handful of bucket computations, not one for every decision kept."""
    if join_round > node.current_round:
        return []
    first = max(join_round, node.current_round - 1)
    sends: list[Action] = []
    for key, (group, _) in node.decided.items():
        round_index = op_and_round(key)[1]
        if round_index < first or peer in group:
            continue
        bucket = groups.group_of(node.group_seed, key, sorted(set(node.members(round_index)) | {peer}), peer,
                                 node.group_size, node.buckets(round_index))
        if groups.leader_of(node.group_seed, key, bucket) == peer:
            sends.append(Send(peer, Decision(key, node.current_round, tuple(group))))
    return sends
