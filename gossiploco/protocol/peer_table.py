"""Membership views: which peers this one knows, is connected to, and mixes with in a round.

``members(r)`` is this peer's view of the peers taking part in round r's exchanges: the peers
whose join round is at most r and whose connection is up. A peer known from the start (a static
list) takes part from round 0; one found later is *pending* until it says hello ("I take part
from round J on"). A peer whose connection drops leaves the view at once and is pending again
when it comes back, until its hello. Pure state: times are passed in.

**Links on demand** (``links_on_demand``: a carrier with a bounded pool of links, as the simulator's
``SimNetwork.idle_s``). A member needs no link to stay one: every known peer starts *idle* (presumed alive, no link
up), the carrier opens a link when something is sent and closes it when nothing went either way for a while
(``on_idle``: no failure, the peer stays in the view). A link that comes up to an idle member re-admits nobody and
asks nothing; one that cannot be opened, or drops, is a failure as before (``on_disconnected``). A link from another
process of the same peer (a new ``incarnation``: it restarted unseen while its link was idle) makes it pending until
its own news (``news_targets``: the peers it has links to, those outside its view and a sample), and a link made to a
pending peer asks it where it stands (a question says its sender's own join round, so it is never asked back). So
nothing here is kept per link for peers that never exchanged with this one, and a dead idle member is found when a
link to it is next needed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

from gossiploco.protocol.messages import STEPPING_OUT

NEWS_SAMPLE = 16
"""With links on demand, news of a join round goes to this many members drawn at random, besides the peers with a link
up and those outside the view (``news_targets``)."""
FAILED_GRACE_S = 0.5
"""A call waiting on a peer whose connection dropped waits this much longer for data already on its way."""


class PeerTable:
    """One peer's view of the others; see the module docstring. Not thread-safe (the node's owner locks)."""

    def __init__(self, rank: int, known: Iterable[int], join_round: int | None, links_on_demand: bool = False):
        self.rank = rank
        self.links_on_demand = links_on_demand
        self.known: set[int] = set(known) | {rank}
        """Every peer with an address (this one included)."""
        self.joined: dict[int, int] = dict.fromkeys(self.known, 0)
        """peer -> first round it takes part in; absent: pending."""
        self.said: dict[int, int] = {}
        """peer -> the first round it said itself (its hello) it takes part in, where ``joined`` may hold one inferred
        (a ``Ready`` before its hello: ``agreement.on_ready``) or a static list's 0."""
        if join_round is None:  # this peer decides later (``announce``) when it takes part
            del self.joined[rank]
        else:
            self.joined[rank] = join_round
        self.connected: set[int] = set()
        """Peers with a link up."""
        self.idle: set[int] = set(self.known - {rank}) if links_on_demand else set()
        """Peers with no link up and presumed alive (``links_on_demand``; module docstring): still members."""
        self.incarnations: dict[int, object] = {}
        """peer -> the process its last link came from, where the carrier says (``on_connected``)."""
        self.failed: dict[int, float] = {}
        """peer -> when its connection dropped (cleared on reconnection)."""
        self.lost_at: dict[int, float] = {}
        """peer -> when its connection last dropped (kept)."""
        self.reported: dict[int, int] = {}
        """peer -> the round it reported in its last hello."""
        self.round_clocks: dict[int, tuple[int, float]] = {}
        """peer -> (its round, when that round ends on this peer's clock), from its last hello that said so
        (``round_clock``: a joiner takes up the swarm's shared round clock from these)."""
        self.round_starts: dict[int, tuple[int, float]] = {}
        """peer -> (its round, when it began that round on this peer's clock), from its last hello that said so
        (``Hello.began_ms_ago``: a joiner tells from these whether the round it would join is too far along)."""
        self.leader_rounds: dict[int, int] = {}
        """peer -> its round when it last answered this peer's ``Ready`` as a leader."""
        self.left: set[int] = set()
        """Peers that said they leave (and have not come back)."""

    def members(self, round_index: int | None = None) -> list[int]:
        last = math.inf if round_index is None else round_index
        if self.joined.get(self.rank, math.inf) > last:
            return [self.rank]  # not taking part in that round: mixes with nobody
        return [p for p, first in sorted(self.joined.items()) if first <= last and p not in self.failed]

    def counted(self, round_index: int | None) -> int:
        """How many members the bucket count of round ``round_index`` counts (``PeerNode._buckets``): those of the
        round before, as every member counts them (a peer joining at this round not even by itself); at round 0, or
        with no round, this peer's view of it."""
        if round_index is None or round_index <= 0:
            return len(set(self.members(round_index)) | {self.rank})
        return sum(1 for p, first in self.joined.items() if first < round_index and p not in self.failed)

    def takes_part(self, round_index: int) -> bool:
        return self.joined.get(self.rank, math.inf) <= round_index

    def add(self, peer: int, joined: int | None = None) -> bool:
        """A peer found by discovery: known, pending until its hello. True if it is new.

        ``joined``: the first round it takes part in, as its directory record says (``PeerRecord.joined``; None or
        negative: not said). With links on demand this admits a peer that was never in the view and has no link lost
        since it was found, as its news would have: its news goes to a sample of the members only
        (``news_targets``), and asking every peer found made a joiner open a link to every member and every member one
        to it. A peer that left, whose link failed or that restarted is left to its own news (a record read may be
        older than that), and a full mesh keeps to hellos: its links tell it who is there."""
        new = peer not in self.known
        if new:
            self.known.add(peer)
            if self.links_on_demand:
                self.idle.add(peer)
        if (self.links_on_demand and joined is not None and 0 <= joined < STEPPING_OUT and peer != self.rank
                and peer not in self.joined and peer not in self.lost_at and peer not in self.left):
            self.joined[peer] = joined
            self.said.pop(peer, None)
        return new

    def forget(self, peer: int) -> bool:
        """A peer that is gone for good (its record left the directory) and not connected: drop everything kept of
        it, so that this table does not grow with every peer that ever came and went. ``add`` makes it pending again
        should it come back. True if it was known. Never this peer itself, nor a connected peer."""
        if peer == self.rank or peer not in self.known or peer in self.connected:
            return False
        self.known.discard(peer)
        self.left.discard(peer)
        self.idle.discard(peer)
        for table in (self.joined, self.said, self.incarnations, self.failed, self.lost_at, self.reported,
                      self.round_clocks, self.round_starts, self.leader_rounds):
            table.pop(peer, None)
        return True

    def on_connected(self, peer: int, now: float, incarnation: object = None) -> bool:
        """Its connection is up (from process ``incarnation``, where the carrier says). True when it is pending and
        the caller should probe it for its join round. An idle member's link re-admits nobody and asks nothing;
        another process than its last link's (it restarted) makes it pending, left to its own news
        (``links_on_demand``), and counts as lost at ``now``, as a drop would have: the groups decided before name
        its previous process, and a call still waiting on that process fails; a link to a peer already pending
        asks it, as a full mesh's handshake does (its answer to an earlier question may have been lost with a link
        that was made afresh)."""
        was_idle = peer in self.idle
        self.idle.discard(peer)
        self.connected.add(peer)
        self.failed.pop(peer, None)
        self.left.discard(peer)
        before = self.incarnations.get(peer)
        if incarnation is not None:
            self.incarnations[peer] = incarnation
        if was_idle and before is not None and incarnation is not None and incarnation != before:
            self.joined.pop(peer, None)  # a restarted process: its news says when it takes part
            self.lost_at[peer] = now
            return False
        return peer not in self.joined  # a pending one is asked (an idle member's link asks nothing)

    def news_targets(self, draw: random.Random) -> list[int]:
        """Whom news of this peer's join round goes to: every known peer; with links on demand, the peers with a link
        up (they may have seen this peer go), those outside the view (their answers re-admit them) and ``NEWS_SAMPLE``
        other members drawn with ``draw``. The other members keep this peer in their views as they had it (a member
        that saw its link drop redials it and asks it once it answers): telling every member made each join open a
        link to every peer of the swarm."""
        others = self.known - {self.rank}
        if not self.links_on_demand:
            return sorted(others)
        told = self.connected | {p for p in others if p not in self.joined}
        rest = sorted(others - told)
        return sorted(told | set(draw.sample(rest, min(NEWS_SAMPLE, len(rest)))))

    def on_restart(self, peer: int, now: float) -> None:
        """A new process of ``peer`` spoke while no link to it was up (links on demand: none saw the old one go): it
        is pending until it says when it takes part, and counts as lost at ``now`` (``on_connected``)."""
        self.joined.pop(peer, None)
        self.reported.pop(peer, None)
        self.lost_at[peer] = now

    def on_idle(self, peer: int) -> bool:
        """The carrier closed its link for idleness: no failure, it stays a member. True if a link was up."""
        if peer not in self.connected:
            return False
        self.connected.discard(peer)
        self.idle.add(peer)
        return True

    def reachable(self) -> set[int]:
        """Peers this one can send to: a link is up, or an idle member's link opens on demand."""
        return self.connected | self.idle

    def on_disconnected(self, peer: int, now: float) -> bool:
        """Its connection dropped, or one to an idle member could not be opened; True if it had been up or idle
        (it leaves the view, pending until a hello)."""
        if peer not in self.connected and peer not in self.idle:
            return False
        self.connected.discard(peer)
        self.idle.discard(peer)
        self.failed[peer] = self.lost_at[peer] = now
        self.joined.pop(peer, None)
        return True

    def on_leave(self, peer: int, now: float) -> None:
        """It left gracefully: gone now, as if its connection dropped."""
        self.joined.pop(peer, None)
        self.failed[peer] = self.lost_at[peer] = now
        self.left.add(peer)

    def unreachable(self) -> list[int]:
        """Peers this one knows (discovery found them, or a static list names them) that did not say they leave,
        with no connection up: with none of them in a group, this peer mixes alone because it cannot reach them."""
        return sorted(p for p in self.known
                      if p != self.rank and p not in self.connected and p not in self.idle and p not in self.left)

    def on_join(self, peer: int, join_round: int, said: bool = True) -> None:
        """``peer`` takes part from ``join_round``: it ``said`` so, or this peer inferred it."""
        self.joined[peer] = join_round
        if said:
            self.said[peer] = join_round
        else:
            self.said.pop(peer, None)

    def said_joins(self) -> dict[int, int]:
        """The reachable other peers whose join round in ``joined`` is the one they said themselves."""
        reachable = self.reachable()
        return {p: k for p, k in self.joined.items() if p != self.rank and p in reachable and self.said.get(p) == k}

    def lost_since(self, peer: int, began: float) -> float | None:
        """When ``peer`` counts as lost for a call that began at ``began``: a drop during the call counts
        from when it happened; one before the call only while the peer is still gone (from ``began``)."""
        lost = self.lost_at.get(peer)
        if lost is not None and lost < began:
            return began if peer in self.failed else None
        return lost

    def recently_lost(self, within_s: float, now: float) -> list[int]:
        return sorted(p for p, t in self.lost_at.items() if now - t <= within_s)

    def pending(self) -> list[int]:
        """Reachable peers outside the view: they came back and have not said hello yet."""
        return sorted(p for p in self.reachable() if p not in self.joined)

    def drop_unconnected(self) -> list[int]:
        """Move peers that never connected to pending (they join with a hello when they come)."""
        gone = [p for p in self.known if p != self.rank and p not in self.reachable() and p in self.joined]
        for p in gone:
            del self.joined[p]
        return sorted(gone)
