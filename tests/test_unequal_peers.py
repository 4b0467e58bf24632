"""Unequal machines as real peer processes: time-budget rounds and token-weighted merging over ZeroMQ.

The simulated clock (``round.step_time_factors``) gives network peers the step counts of the virtual swarm's
unequal workers, so their parameters must match it (weighted ring all-reduce and push-sum gossip alike).
The real clock (``round.length_s``) with one peer slowed down (``compute.slowdown``) must give that peer
fewer steps and less weight, and spare the fast peers the wait for it.
"""

from __future__ import annotations

import pytest

from conftest import tiny_peer_args
from gossiploco.runtime.launch import LocalPeers
from test_peer import ENV, assert_exit, assert_matches_virtual_swarm, records, summary

pytestmark = pytest.mark.slow  # real peer processes

TOKENS_PER_STEP = 4 * 32  # the tiny configs' batch: 4 sequences of 32 tokens


COMPRESSED = {"mix2.compression": "int8", "mix2.block_size": 64, "mix1.compression": "4bit", "mix1.fragments": 2}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("preset,compression", [("globalm1-localm2", {}), ("localm1m2", {}), ("diloco", {}),
                                                ("globalm1-localm2", COMPRESSED), ("diloco", {"mix2.compression": "4bit"})])
def test_peers_with_the_simulated_clock_train_the_virtual_swarms_unequal_workers(preset, compression, tmp_path):
    """Steps 4, 4, 2 and 1 a round (factors 1, 1, 2, 4 of 4 base steps), means weighted by tokens: the ZeroMQ
    collectives (ring all-reduce of [w x, w]; push-sum swaps; compressed: the weights gathered, then the
    compressed means of s x) give the in-memory hub's parameters."""
    overrides = {"round.budget": "time", "round.weights": "tokens", "round.step_time_factors": [1.0, 1.0, 2.0, 4.0],
                 **compression}
    with LocalPeers(4, tmp_path, tiny_peer_args(preset, **overrides), env=ENV) as peers:
        peers.start()
        codes = peers.wait(180)
    assert_matches_virtual_swarm(peers, codes, preset, **overrides)
    for rank, steps in enumerate([4, 4, 2, 1]):
        rounds = [r for r in records(peers, rank) if "steps" in r]
        assert len(rounds) == 3 and all(r["steps"] == steps and r["tokens"] == steps * TOKENS_PER_STEP for r in rounds)


@pytest.mark.timeout(240)
def test_a_slow_peer_under_a_real_clock_runs_fewer_steps_and_the_fast_ones_do_not_wait_for_it(tmp_path):
    """Three peers, the third three times slower; rounds of a fixed length: the slow peer's rounds hold about a
    third of the fast peers' steps, every peer's round lasts about the same, the mixes never fail, and every
    peer ends with the same averaged model (Mix2 is a global weighted mean here)."""
    length_s = 1.5
    overrides = {"round.budget": "time", "round.weights": "tokens", "round.length_s": length_s, "rounds": 4,
                 "inner_steps": 200, "mix2.kind": "global", "monitor.val_loss": False}
    with LocalPeers(3, tmp_path, tiny_peer_args("globalm1-localm2", **overrides), env=ENV,
                    per_rank={2: ["--set", "compute.slowdown=3.0"]}) as peers:
        peers.start()
        codes = peers.wait(180)
    assert_exit(peers, codes, range(3))
    steps = {rank: [r["steps"] for r in records(peers, rank) if "steps" in r] for rank in range(3)}
    assert all(len(s) == 4 for s in steps.values()), steps
    fast = sorted(s for rank in (0, 1) for s in steps[rank])
    slow = steps[2]
    assert fast[0] >= 4 and max(slow) < fast[0], steps  # the slow one ran fewer steps in every round
    ratio = sum(slow) / (sum(fast) / 2)
    # At most about a third; no lower bound: the slow peer sleeps twice its own step, and its step is longer when
    # the three peers share two cores (measured 0.147 once), so its share depends on the machine. What holds
    # everywhere: every peer computes for its whole round, whatever its number of steps.
    assert ratio < 0.6, (ratio, steps)
    for rank in range(3):
        computing = [r["compute_s"] for r in records(peers, rank) if "steps" in r]
        assert all(0.9 * length_s < c < length_s + 1.0 for c in computing), (rank, computing)
    for rank in range(3):
        s = summary(peers, rank)
        assert s["mix1_failures"] == s["mix2_failures"] == 0
        rounds = [t["s"] for t in s["round_times"]]
        # a round: its length plus under one step (the deadline) plus the mixes; never the slow peer's H steps
        assert all(length_s * 0.9 < t < length_s + 2.0 for t in rounds[1:]), (rank, rounds)
    finals = {summary(peers, rank)["final_val_loss"] for rank in range(3)}
    assert len(finals) == 1, finals
