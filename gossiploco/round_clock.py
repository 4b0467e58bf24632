"""A round clock the peers share (``round.clock = "shared"``): round r's training ends at ``anchor + (r + 1) * period``.

Why. With a time budget on each peer's own clock (``round.clock = "start"``), a round's deadline counts from the
moment the previous round's Mix2 released the peer. Bucket pairing releases a whole bucket at once, so the peers
stay within a latency of each other; ready pairing (``[groups] pairing = "ready"``) releases each pair as it
meets, so the round starts drift apart, a little more each round, and the next Mix1 leaves the late ones out
(measured in the simulator: README, "Large swarms"). On a shared clock every peer's round r ends at the same
instant, whatever its own exchanges took: a peer that came out of round r - 1 late trains less in round r (its
first step always runs) and is back in step at r's end. The drift cannot accumulate.

The anchor. Nothing is agreed by messages for a swarm that starts together: the founders start round 0 together
(the start barrier), and each takes its own start of round 0 as its anchor, so their clocks differ by the
barrier's spread (milliseconds on a LAN, a latency or two over the internet) and that does not grow. A peer that
joins a running swarm (or catches up after falling behind) cannot know the founders' anchor from its own start:
it asks. Every hello a peer answers carries the milliseconds left until its current round's end
(``protocol.messages.Hello.ends_in_ms``); the asker turns each answer into an anchor on its own clock and takes
their median (``adopt``), so fewer than half of the answers lying cannot move it outside the honest ones' range.
An anchor that would end the newest reported round more than 1.5 periods from now is refused whoever says it: no
honest peer's round ends more than a period ahead. One in the past is taken: honest peers may still be in the
exchanges of a round whose training ended periods ago (measured in the simulator with faults: up to 4.2 periods),
and a peer whose deadline has passed still runs one step a round, so an anchor too early (only a majority of lying
answers gives one) costs this peer most of its training, never the swarm a wait.

Times are ``time.monotonic()`` on the peer's machine: never sent, so the peers' clocks need not agree on the time
of day; only their rates must agree (machines that keep time by NTP slew their monotonic clocks to within a few
parts per million: a second in days). Sans-I/O: the caller passes the times.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

TOLERANCE = 0.5
"""An adopted anchor is refused when it would end the newest reported round more than ``1 + TOLERANCE`` periods from
now: an honest peer's round ends at most a period ahead (plus an answer's delivery time)."""


class RoundClock:
    """See the module docstring. ``period_s``: a round's length, training and exchanges together."""

    def __init__(self, period_s: float):
        if not period_s > 0:
            raise ValueError(f"a shared round clock needs a period > 0 s, got {period_s}")
        self.period_s = period_s
        self.anchor: float | None = None
        """Where round 0 began on this peer's clock; None until the first round (or an adopted anchor) sets it."""

    def ends_at(self, round_index: int) -> float | None:
        """When round ``round_index``'s training ends on this peer's clock (None before the anchor is known)."""
        return None if self.anchor is None else self.anchor + (round_index + 1) * self.period_s

    def begin(self, round_index: int, now: float) -> float:
        """Round ``round_index`` starts at ``now``: the deadline of its training. The first round sets the anchor
        (``now`` is round ``round_index``'s start); a deadline already past is ``now`` (the caller's budget still
        runs one step); one more than a period away (this peer is ahead of its clock) is ``now + period``."""
        if self.anchor is None:
            self.anchor = now - round_index * self.period_s
        ends = self.ends_at(round_index)
        assert ends is not None
        return min(max(ends, now), now + self.period_s)

    def adopt(self, reports: Iterable[tuple[int, float]], now: float) -> str | None:
        """Take the swarm's anchor from other peers' answers: ``(their round, when it ends on this peer's clock)``.
        Returns why they were refused (None: adopted, or nothing to adopt)."""
        reports = [(k, ends) for k, ends in reports if k >= 0]
        if not reports:
            return None
        anchors = [ends - (k + 1) * self.period_s for k, ends in reports]
        anchor = statistics.median(anchors)
        # Where the newest reported round ends: the round this peer goes on with ends there or a period later.
        newest = max(k for k, _ in reports)
        ends = anchor + (newest + 1) * self.period_s
        if ends > now + (1 + TOLERANCE) * self.period_s:
            return (f"the others' round clock (round {newest} ending {ends - now:+.1f} s from now, median of "
                    f"{len(anchors)} answers) is further ahead than a round: keeping this peer's own")
        self.anchor = anchor
        return None
