"""The shared round clock (``round.clock = "shared"``): round r's training ends at the swarm's anchor + (r + 1) period;
founders anchor at their start of round 0, joiners take the anchor up from the answers to their questions."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from conftest import tiny_peer_args, wait_until
from gossiploco.config import RunConfig
from gossiploco.errors import ConfigError, MalformedMessage
from gossiploco.protocol import codec
from gossiploco.protocol.messages import MAX_ENDS_IN_MS, NO_CLOCK, PROBE, Hello, Send, from_wire, to_wire
from gossiploco.protocol.node import PeerNode
from gossiploco.round_budget import RoundBudget
from gossiploco.round_clock import TOLERANCE, RoundClock


def test_founders_anchor_at_their_first_round_and_every_round_ends_a_period_later():
    clock = RoundClock(10.0)
    assert clock.ends_at(0) is None
    assert clock.begin(0, 100.0) == 110.0 and clock.anchor == 100.0
    assert clock.begin(1, 110.3) == 120.0  # a round that starts late (its exchanges took 0.3 s) still ends on time
    assert clock.begin(2, 131.0) == 131.0  # already past its end: now (the budget runs one step), back in step at r=3
    assert clock.begin(3, 131.2) == 140.0
    assert clock.begin(9, 131.3) == 141.3  # far ahead of its clock: never more than a period
    resumed = RoundClock(10.0)
    assert resumed.begin(7, 50.0) == 60.0 and resumed.anchor == -20.0  # a whole swarm resumed at round 7 anchors there


def test_a_joiner_takes_the_median_of_the_answers_and_a_lying_minority_moves_it_within_the_honest_range():
    period, now = 10.0, 1000.0
    honest_anchor = 900.0  # the swarm's round 10 ends at 1010 on the joiner's clock
    reports = [(10, honest_anchor + 11 * period + d) for d in (0.01, 0.03, 0.05)]
    clock = RoundClock(period)
    assert clock.adopt(reports, now) is None and clock.anchor == pytest.approx(honest_anchor + 0.03)
    # Two liars of five, as far off as they like: the median stays within the honest answers.
    lying = reports + [(10, 1e9), (10, -1e9)]
    clock = RoundClock(period)
    assert clock.adopt(lying, now) is None
    assert honest_anchor + 0.01 <= clock.anchor <= honest_anchor + 0.05
    # Answers across a round boundary (one peer still in round 10's exchanges, two in round 11) give one anchor.
    clock = RoundClock(period)
    assert clock.adopt([(10, 1010.0), (11, 1020.0), (11, 1020.0)], 1010.2) is None and clock.anchor == 900.0
    assert RoundClock(period).adopt([], now) is None


def test_an_anchor_that_ends_the_round_more_than_the_tolerance_ahead_is_refused_one_in_the_past_taken():
    period, now = 10.0, 1000.0
    ahead = now + (1 + TOLERANCE) * period + 0.1  # no honest peer's round ends more than a period ahead
    clock = RoundClock(period)
    why = clock.adopt([(4, ahead)] * 3, now)
    assert why is not None and "keeping this peer's own" in why and clock.anchor is None
    assert clock.begin(5, now) == now + period  # its own clock then: a full round from its start
    assert RoundClock(period).adopt([(4, ahead - 0.2)], now) is None
    # Honest peers still in the exchanges of a round whose training ended long ago (faults made them wait): taken.
    # The swarm is behind its clock, this peer with it: rounds of one step each until they are back in step.
    clock = RoundClock(period)
    assert clock.adopt([(4, now - 42.0)] * 3, now) is None and clock.ends_at(5) == now - 32.0
    assert clock.begin(5, now) == now


def test_the_budget_on_the_shared_clock_ignores_measurements_and_tells_the_clock_not_its_late_deadline():
    cfg = RunConfig()
    cfg.round.budget, cfg.round.clock, cfg.round.length_s = "time", "shared", 10.0
    budget = RoundBudget(cfg, 0, real_clock=True)
    budget.begin(100.0, 0)
    budget.pause(3.0)  # a measurement: the start clock would move the deadline, the shared one must not
    assert budget.deadline == 110.0 and budget.round_ends_at == 110.0
    budget.begin(112.0, 1)  # came out of round 0 late
    assert budget.deadline == 120.0
    budget.begin(131.0, 2)  # past round 2's end: the budget runs its first step only
    assert budget.deadline == 131.0 and budget.round_ends_at == 130.0  # others learn the clock, not this lateness
    assert budget.another(0, 131.0) and not budget.another(1, 131.1)
    start = RunConfig()
    start.round.budget, start.round.length_s = "time", 10.0
    own = RoundBudget(start, 0, real_clock=True)
    own.begin(100.0, 0)
    own.pause(3.0)
    assert own.deadline == 113.0 and own.round_ends_at is None and own.adopt([(0, 5.0)], 0.0) is None


def test_the_setting_needs_a_time_budget_and_refuses_other_values():
    cfg = RunConfig()
    cfg.round.clock = "shared"
    with pytest.raises(ConfigError, match="budget"):
        cfg.round.check("round")
    cfg.round.clock = "wall"
    with pytest.raises(ConfigError, match="start, shared"):
        cfg.round.check("round")
    with pytest.raises(ValueError, match="period"):
        RoundClock(0.0)


def wire(message: Hello) -> Hello:
    header, tensors = to_wire(message, sender=3, run_id="run")
    frames = [bytes(f) for f in codec.encode(header, tensors)]
    decoded = codec.decode(frames, expect_run="run", max_bytes=1 << 20)
    return from_wire(decoded[0], decoded[1])


def test_a_hello_carries_the_time_left_in_the_round_and_an_earlier_versions_four_entries_still_parse():
    for left in (None, 0, 1500, -800, MAX_ENDS_IN_MS, -MAX_ENDS_IN_MS):
        assert wire(Hello(PROBE, 4, echo=2, ends_in_ms=left)) == Hello(PROBE, 4, echo=2, ends_in_ms=left)
    header, _ = to_wire(Hello(PROBE, 4), sender=3, run_id="run")
    assert from_wire(header, [torch.tensor([PROBE, 4, 0, 2]), torch.empty(0)]).ends_in_ms is None
    for left, began in ((None, 0), (1500, 2250), (None, MAX_ENDS_IN_MS), (-800, 0)):  # and how long ago it began
        assert wire(Hello(PROBE, 4, ends_in_ms=left, began_ms_ago=began)) == Hello(PROBE, 4, ends_in_ms=left,
                                                                                  began_ms_ago=began)
    assert from_wire(header, [torch.tensor([PROBE, 4, 0, 2, NO_CLOCK, 7]), torch.empty(0)]) == Hello(
        PROBE, 4, 0, 2, None, 7)
    for meta in ([PROBE, 4, 0, 2, MAX_ENDS_IN_MS + 1], [PROBE, 4, 0, 2, -MAX_ENDS_IN_MS - 1], [PROBE, 4, 0, 2, 0, 0, 0],
                 [PROBE, 4, 0, 2, NO_CLOCK], [PROBE, 4, 0, 2, 0, -1], [PROBE, 4, 0, 2, 0, MAX_ENDS_IN_MS + 1],
                 [PROBE, 4, 0, 2, NO_CLOCK + 1, 0]):
        with pytest.raises(MalformedMessage):
            from_wire(header, [torch.tensor(meta), torch.empty(0)])


def test_a_node_answers_with_its_rounds_end_and_the_asker_keeps_it_on_its_own_clock():
    member, joiner = (PeerNode(rank, [1, 2], grace_s=1.0, chunk_elems=64, mailbox_bytes=1 << 20) for rank in (1, 2))
    for node, other in ((member, 2), (joiner, 1)):
        node.connected(other, 0.0)
    member.current_round, member.round_ends = 6, (6, 50.0)
    [question] = joiner.announce(PROBE, to=[1])
    # The member's clock reads 47.5 when the question comes: 2.5 s left; the joiner's reads 1000.1 when the answer comes.
    [answer] = member.receive(2, question.message, 47.5)
    assert isinstance(answer, Send) and answer.message.ends_in_ms == 2500 and answer.message.current_round == 6
    joiner.receive(1, answer.message, 1000.1)
    assert joiner.peers.round_clocks == {1: (6, pytest.approx(1002.6))}
    [late] = member.receive(2, question.message, 51.25)  # in its exchanges, 1.25 s after its training ended
    assert late.message.ends_in_ms == -1250
    member.current_round = 7  # in a round whose end it was not told (done, say): says nothing
    [other] = member.receive(2, question.message, 51.5)
    assert other.message.ends_in_ms is None and other.message.current_round == 7
    member.round_ends = None  # on its own clock: says nothing, and nothing is kept
    [plain] = member.receive(2, question.message, 52.0)
    assert plain.message.ends_in_ms is None
    joiner.peers.round_clocks.clear()
    joiner.receive(1, plain.message, 1003.0)
    assert joiner.peers.round_clocks == {}


def test_in_the_simulator_restarted_peers_take_up_the_swarms_clock_within_an_answers_delivery_time():
    """1% churn and more: every restarted peer adopts the anchor from its answers (the checker flags any adopted
    anchor more than ``ROUND_CLOCK_SLACK_S`` from the running peers' median, and any refusal)."""
    from gossiploco.simulation import invariants, runs, swarm

    adopted: list[float] = []
    original = swarm.SimSwarm.position

    def position(self, peer, position, z, clock=None):
        out = original(self, peer, position, z, clock)
        if clock is not None and position.clocks:
            others = [c.anchor for p, c in self.round_clocks.items()
                      if p != peer.pid and c.anchor is not None and self.peers[p].running]
            adopted.append(abs(clock.anchor - statistics.median(others)))
        return out

    swarm.SimSwarm.position = position
    try:
        result = runs.simulate_scale(3, 32, rounds=5, churn=0.04, inner_spread=0.0, round_jitter=2.0,
                                      round_period=24.0, pairing="ready")
    finally:
        swarm.SimSwarm.position = original
    assert not result.violations, result.violations[:3]
    assert len(adopted) >= 3 and max(adopted) <= invariants.ROUND_CLOCK_SLACK_S, adopted
    assert min(result.finished.values()) == 5


def round_ends(peers, rank: int) -> dict[int, float]:
    path = peers.peer_dir(rank) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["round"]: r["round_ends_monotonic"] for r in rows if "round_ends_monotonic" in r}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_real_peers_end_their_rounds_together_and_a_late_joiner_takes_up_their_clock(tmp_path):
    """Three real peers, time-budget rounds of 1 s on the shared clock, gossip Mix2 paired as members come: the
    founders' rounds end a period apart for good; a peer started while they are in round 3 or later catches up
    and ends its rounds with theirs (``time.monotonic`` is the machine's: the peers' records compare directly)."""
    from gossiploco.runtime.launch import LocalPeers

    length = 1.0
    args = tiny_peer_args("globalm1-localm2", rounds=24, **{
        "round.budget": "time", "round.clock": "shared", "round.length_s": length, "groups.pairing": "ready",
        "monitor.every": 0, "timeouts.startup_s": 4.0, "timeouts.exchange_s": 30.0})
    with LocalPeers(3, tmp_path, args, env={"OMP_NUM_THREADS": "1"}) as peers:
        peers.start([0, 1])
        assert wait_until(lambda: max(round_ends(peers, 0), default=-1) >= 3, 90, 0.2), peers.log(0)[-3000:]
        peers.start([2])
        codes = peers.wait(150)
    assert all(code == 0 for code in codes.values()), (codes, peers.log(2)[-3000:])
    assert "joined a running swarm" in peers.log(2), peers.log(2)[-3000:]
    founders = [round_ends(peers, rank) for rank in (0, 1)]
    for ends in founders:  # a founder's rounds end a period apart: nothing drifts, whatever its exchanges took
        rounds = sorted(ends)
        assert all(ends[b] - ends[a] == pytest.approx((b - a) * length, abs=1e-6) for a, b in zip(rounds, rounds[1:]))
    joiner = round_ends(peers, 2)
    assert joiner and min(joiner) >= 3
    # Where the founders' clocks differ (their start barrier's spread), the joiner's lies between them, up to an
    # answer's delivery time on loopback (0.25 s: generous for a loaded 2-core machine, a quarter of a round).
    for r, ends in joiner.items():
        low, high = min(f[r] for f in founders), max(f[r] for f in founders)
        assert low - 0.25 <= ends <= high + 0.25, (r, ends, low, high)


def test_the_default_clock_keeps_a_runs_identity_and_the_shared_one_makes_another_run():
    from gossiploco.checkpoint import shared_config

    cfg = RunConfig()
    cfg.round.budget, cfg.round.length_s = "time", 30.0
    now = cfg.to_dict()
    before = {**now, "round": {k: v for k, v in now["round"].items() if k != "clock"}}  # a peer of an earlier version
    assert shared_config(now) == shared_config(before) == shared_config(shared_config(now))
    cfg.round.clock = "shared"
    assert shared_config(cfg.to_dict()) != shared_config(before)
    assert "round" not in shared_config(RunConfig().to_dict())
