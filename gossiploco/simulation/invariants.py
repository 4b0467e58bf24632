"""The properties the simulator checks, each with a name that says which guarantee broke.

    liveness.call_overran      a call ran past its own deadline (plus the lost-peer grace): a wait that did not fire
    liveness.exchange_stalled  one exchange (agreement + data) of a live peer took longer than the bound:
                               2 grace windows + one control send + the call's adaptive deadline + the lost-peer grace
    liveness.late_leader       a follower whose leader never said it was there (``Leading``) waited for it longer
                               than one grace window and one control send: a late leader cost more than one window
    liveness.unfinished        a peer that was never crashed did not finish every round by the end of the run
    agreement.group_mismatch   two peers completed the same exchange with different member lists (a ring's
                               order included: the leader's order keeps peers behind NAT apart)
    agreement.not_mutual       a peer completed a swap with a partner that was not swapping with it
    agreement.outside_bucket   a leader waited for, or put in its group, a peer outside its own bucket of that exchange
                               (``protocol.groups``): an exchange waited on a peer of another group
    correctness.mean           a completed all-reduce did not give the mean of its group's inputs
    correctness.swap           a completed swap did not hand over the partner's input (the pair's sum is not kept)
    correctness.identity       a failed exchange changed the value it was given
    recovery.state             a downloaded state differs from the donor's state of that round
    recovery.not_mixing        a restarted or resumed peer was not in an agreed group of 2 or more again (or alone
                               in its bucket by the draw, or a matchmaker's odd one out) within 2 rounds of the swarm
                               (checked when no other fault overlaps its recovery: ``simulation.recovery``)
    bounded.growth             a node's mailbox or records went past their limits
    round_clock.refused        a restarted peer refused the answers' shared round clock (``round_clock``)
    round_clock.off            a restarted peer's adopted round clock is more than ``ROUND_CLOCK_SLACK_S`` from the
                               running peers' (those still in the run: a peer that finished tells no clock)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch

from gossiploco.protocol.agreement import CONTROL_SEND_S, Follow, Lead
from gossiploco.protocol import groups
from gossiploco.protocol.collectives import FetchState, PairMean, RingAllReduce, Swap
from gossiploco.protocol.records import MAX_KEYS
from gossiploco.protocol.peer_table import FAILED_GRACE_S

ROUND_CLOCK_SLACK_S = 1.0
"""How far a restarted peer's adopted round clock may be from the running peers' (``round_clock.off``): an answer's
delivery time (up to 0.1 s of latency between two peers in the simulator, plus queueing behind data on a slow link).
Measured: 36 to 78 ms at 64 peers (seeds 1 and 2)."""
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Violation:
    name: str
    time: float
    peer: int
    detail: str

    def __str__(self) -> str:
        return f"{self.name} at t={self.time:.3f}s on peer {self.peer}: {self.detail}"


class Checker:
    """Collects what peers did and reports every broken property once."""

    def __init__(self, grace_s: float, mailbox_bytes: int, incarnation=lambda peer: 0, group_seed: int = 0):
        self.grace_s, self.mailbox_bytes = grace_s, mailbox_bytes
        self.group_seed = group_seed
        self.incarnation = incarnation
        """peer -> its current incarnation (a restart makes a new one)."""
        self.violations: list[Violation] = []
        self.inputs: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        self.partners: dict[str, dict[int, int]] = defaultdict(dict)
        self.began_with: dict[tuple[str, int], tuple[tuple[int, int], ...]] = {}
        self.groups: dict[str, dict[tuple[int, ...], int]] = defaultdict(dict)  # key -> group -> a peer that completed with it
        self.completed = 0
        self.failed = 0
        self.one_sided = 0

    def flag(self, name: str, time: float, peer: int, detail: str) -> None:
        self.violations.append(Violation(name, time, peer, detail))

    def round_clock_adopted(self, peer: int, time: float, refused: str | None, anchor: float | None,
                            others: list[float]) -> None:
        """A peer took up the shared round clock (``round_clock.RoundClock.adopt``): honest answers are never refused,
        and the anchor lands within ``ROUND_CLOCK_SLACK_S`` of the running peers' median."""
        if refused:
            self.flag("round_clock.refused", time, peer, refused)
        elif others and anchor is not None and abs(anchor - statistics.median(others)) > ROUND_CLOCK_SLACK_S:
            self.flag("round_clock.off", time, peer, f"anchor {anchor:.3f} s, the others' median "
                                                     f"{statistics.median(others):.3f} s")

    def started(self, key: str, peer: int, value: torch.Tensor, partner: int | None = None,
                members: list[int] | None = None) -> None:
        self.inputs[key][peer] = value.clone()
        if partner is not None:
            self.partners[key][peer] = partner
        if members is not None:  # who the members were when this call began (one may restart before it ends), in ring order
            self.began_with[(key, peer)] = tuple((m, self.incarnation(m)) for m in members)

    def call_ended(self, sim_peer, call, began: float, now: float, ok: bool) -> None:
        if isinstance(call, (Lead, Follow)):
            limit = call.deadline
        else:
            limit = call.deadline + FAILED_GRACE_S
        if now > limit + 1e-6 and sim_peer.thawed_at < call.began:  # a frozen process's waits overrun: not a bug
            self.flag("liveness.call_overran", now, sim_peer.pid, f"{call.what} ended {now - limit:.3f}s after its deadline")
        if (isinstance(call, Follow) and not call.leader_there and sim_peer.thawed_at < call.began
                and now - call.began > self.grace_s + CONTROL_SEND_S + 1e-6):
            self.flag("liveness.late_leader", now, sim_peer.pid,
                      f"{call.what}: waited {now - call.began:.3f}s for a leader that never said it was there")
        self.completed += ok
        self.failed += not ok
        if isinstance(call, Lead):
            self._check_bucket(sim_peer.pid, call, now, ok)
        if ok and isinstance(call, RingAllReduce):
            self.check_mean(sim_peer.pid, call.key, call.members, call.acc, now)
        if ok and isinstance(call, Swap):
            self._check_swap(sim_peer.pid, call, now)
        if isinstance(call, FetchState):
            pass  # checked by the peer against the donor's snapshot
        self._check_bounded(sim_peer, now)

    def exchange_ended(self, sim_peer, key: str, began: float, now: float, deadline_s: float) -> None:
        """One exchange (agreement, then data) of a peer that was neither crashed nor frozen meanwhile."""
        if not sim_peer.running or sim_peer.thawed_at >= began:
            return
        bound = 2 * self.grace_s + CONTROL_SEND_S + deadline_s + FAILED_GRACE_S
        if now - began > bound + 1e-6:
            self.flag("liveness.exchange_stalled", now, sim_peer.pid, f"{key} took {now - began:.3f}s > {bound:.3f}s")

    def identity_kept(self, peer: int, key: str, before: torch.Tensor, after: torch.Tensor, now: float) -> None:
        if not torch.equal(before, after):
            self.flag("correctness.identity", now, peer, f"failed {key} changed the value")

    def check_mean(self, peer: int, key: str, members: list[int], result: torch.Tensor, now: float) -> None:
        """A group mean (the ring's, or a compressed mean's two phases) that completed on ``peer``."""
        # A restarted peer may run a key its previous incarnation ran: groups are of incarnations.
        group = self.began_with.get((key, peer)) or tuple((m, self.incarnation(m)) for m in members)
        groups = self.groups[key]
        for other, who in groups.items():  # disjoint groups (views with different leaders) are fine; overlapping ones must agree
            if other != group and set(other) & set(group):
                self.flag("agreement.group_mismatch", now, peer, f"{key}: {list(group)} here, {list(other)} on peer {who}")
        groups.setdefault(group, peer)
        inputs = self.inputs[key]
        missing = [m for m in members if m not in inputs]
        if missing:
            self.flag("agreement.group_mismatch", now, peer, f"{key}: completed although {missing} never started it")
            return
        mean = torch.stack([inputs[m].double() for m in members]).mean(0).float()
        if not torch.allclose(result, mean, atol=TOLERANCE):
            self.flag("correctness.mean", now, peer, f"{key} over {members}: max error "
                      f"{(result - mean).abs().max().item():.3g}")

    def _check_bucket(self, peer: int, call: Lead, now: float, ok: bool) -> None:
        """Everyone a leader waited for or decided on shares its bucket (with the bucket count of its view)."""
        members = sorted(set(call.view) | (set(call.group) if ok else set()))
        outside = [m for m in members if not groups.in_bucket(self.group_seed, call.key, call.buckets, peer, m)]
        if outside:
            self.flag("agreement.outside_bucket", now, peer, f"{call.key}: led {call.view} -> "
                      f"{call.group if ok else 'failed'}; {outside} are not in its bucket of {call.buckets}")

    def _check_swap(self, peer: int, call: Swap, now: float) -> None:
        partner = call.partner
        theirs = self.partners[call.key].get(partner)
        if theirs != peer:
            self.flag("agreement.not_mutual", now, peer, f"{call.key}: swapped with {partner}, whose partner is {theirs}")
            return
        theirs = self.inputs[call.key][partner].reshape(-1)
        if isinstance(call, PairMean):  # the same bits on both sides: (a + b) / 2 elementwise, as a reference
            expected = (self.inputs[call.key][peer].reshape(-1) + theirs) / 2
            if not torch.equal(call.out, expected):
                self.flag("correctness.swap", now, peer, f"{call.key}: the pair mean with {partner} is not (a + b) / 2")
        elif not torch.equal(call.out, theirs):
            self.flag("correctness.swap", now, peer, f"{call.key}: did not receive partner {partner}'s input")

    def _check_bounded(self, sim_peer, now: float) -> None:
        sizes = sim_peer.node.pending_state()
        over = {k: v for k, v in sizes.items()
                if (k == "mailbox_bytes" and v > self.mailbox_bytes) or (k not in ("mailbox_bytes", "mailbox_chunks") and v > MAX_KEYS)}
        if over:
            self.flag("bounded.growth", now, sim_peer.pid, f"over their limits: {over}")
