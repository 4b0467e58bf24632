"""Membership views: which peers this one knows, is connected to, and mixes with in a round.

``members(r)`` is this peer's view of the peers taking part in round r's exchanges: the peers
whose join round is at most r and whose connection is up. A peer known from the start (a static
list) takes part from round 0; one found later is *pending* until it says hello ("I take part
from round J on"). A peer whose connection drops leaves the view at once and is pending again
when it comes back, until its hello. Pure state: times are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

FAILED_GRACE_S = 0.5
"""A call waiting on a peer whose connection dropped waits this much longer for data already on its way."""


class PeerTable:
    """One peer's view of the others; see the module docstring. Not thread-safe (the node's owner locks)."""

    def __init__(self, rank: int, known: Iterable[int], join_round: int | None):
        self.rank = rank
        self.known: set[int] = set(known) | {rank}
        """Every peer with an address (this one included)."""
        self.joined: dict[int, int] = dict.fromkeys(self.known, 0)
        """peer -> first round it takes part in; absent: pending."""
        if join_round is None:  # this peer decides later (``announce``) when it takes part
            del self.joined[rank]
        else:
            self.joined[rank] = join_round
        self.connected: set[int] = set()
        self.failed: dict[int, float] = {}
        """peer -> when its connection dropped (cleared on reconnection)."""
        self.lost_at: dict[int, float] = {}
        """peer -> when its connection last dropped (kept)."""
        self.reported: dict[int, int] = {}
        """peer -> the round it reported in its last hello."""
        self.round_clocks: dict[int, tuple[int, float]] = {}
        """peer -> (its round, when that round ends on this peer's clock), from its last hello that said so
        (``round_clock``: a joiner takes up the swarm's shared round clock from these)."""
        self.leader_rounds: dict[int, int] = {}
        """peer -> its round when it last answered this peer's ``Ready`` as a leader."""
        self.left: set[int] = set()
        """Peers that said they leave (and have not come back)."""

    def members(self, round_index: int | None = None) -> list[int]:
        last = math.inf if round_index is None else round_index
        if self.joined.get(self.rank, math.inf) > last:
            return [self.rank]  # not taking part in that round: mixes with nobody
        return [p for p, first in sorted(self.joined.items()) if first <= last and p not in self.failed]

    def takes_part(self, round_index: int) -> bool:
        return self.joined.get(self.rank, math.inf) <= round_index

    def add(self, peer: int) -> bool:
        """A peer found by discovery: known, pending until its hello. True if it is new."""
        if peer in self.known:
            return False
        self.known.add(peer)
        return True

    def forget(self, peer: int) -> bool:
        """A peer that is gone for good (its record left the directory) and not connected: drop everything kept of
        it, so that this table does not grow with every peer that ever came and went. ``add`` makes it pending again
        should it come back. True if it was known. Never this peer itself, nor a connected peer."""
        if peer == self.rank or peer not in self.known or peer in self.connected:
            return False
        self.known.discard(peer)
        self.left.discard(peer)
        for table in (self.joined, self.failed, self.lost_at, self.reported, self.round_clocks, self.leader_rounds):
            table.pop(peer, None)
        return True

    def on_connected(self, peer: int) -> bool:
        """Its connection is up. True when it is pending (the caller probes it for its join round)."""
        self.connected.add(peer)
        self.failed.pop(peer, None)
        self.left.discard(peer)
        return peer not in self.joined

    def on_disconnected(self, peer: int, now: float) -> bool:
        """Its connection dropped; True if it had been up (it leaves the view, pending until a hello)."""
        if peer not in self.connected:
            return False
        self.connected.discard(peer)
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
        return sorted(p for p in self.known if p != self.rank and p not in self.connected and p not in self.left)

    def on_join(self, peer: int, join_round: int) -> None:
        self.joined[peer] = join_round

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
        """Connected peers outside the view: they came back and have not said hello yet."""
        return sorted(p for p in self.connected if p not in self.joined)

    def drop_unconnected(self) -> list[int]:
        """Move peers that never connected to pending (they join with a hello when they come)."""
        gone = [p for p in self.known if p != self.rank and p not in self.connected and p in self.joined]
        for p in gone:
            del self.joined[p]
        return sorted(gone)
