"""A failed Mix1 run again among its group's survivors (``mixing.again``, ``protocol.keys``): the key's buckets and a
leader of its own, the policy's time window, the mixer's second attempt (an exact fp32 mean of the survivors), and the
simulator's swarm, where it lifts Mix1's completion under churn without adding blocking time. A real peer killed
mid-ring: ``tests/test_peer.py::test_sigkill_mid_all_reduce_runs_mix1_again_among_the_survivors``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gossiploco.mixing import GlobalMix, MemoryHub
from gossiploco.mixing.again import RunAgain
from gossiploco.mixing.compression import build_codec
from gossiploco.protocol import groups, keys
from gossiploco.simulation.runs import simulate_scale


def test_a_key_run_again_keeps_the_first_keys_buckets_and_draws_its_own_leader():
    view = list(range(1000))
    changed = 0
    for k in range(200):
        key = f"mix1/{k}"
        again = keys.again_key(key)
        assert keys.first_key(again) == key and keys.first_key(key) == key
        me = view[k * 7 % 1000]
        group = groups.group_of(5, key, view, me, 16)
        assert groups.group_of(5, again, view, me, 16) == group  # the same survivors meet again
        changed += groups.leader_of(5, again, group) != groups.leader_of(5, key, group)
    # A leader drawn anew: it differs with probability 1 - E[1/|g|] (about 15/16 for buckets of about 16)
    assert 150 < changed < 200, changed


def test_a_key_run_again_is_not_a_phase_of_the_key_it_repeats():
    assert keys.phases("monitor/0/2/terms") == ["monitor/0/2/terms", "monitor/0", "monitor/0/2"]
    assert keys.phases("mix1/3") == ["mix1/3"]
    # A peer that abandoned mix1/3 (the failed ring) still runs mix1/3/again; its phases are phases of it
    assert keys.phases("mix1/3/again") == ["mix1/3/again"]
    assert keys.phases("mix1/3/f2/again") == ["mix1/3/f2/again"]
    assert keys.phases("mix1/3/again/scatter") == ["mix1/3/again/scatter", "mix1/3/again"]


def test_a_second_attempt_is_allowed_while_the_round_has_time_for_it():
    policy = RunAgain(True, grace_s=2.0)
    assert policy.round_began(100.0) is None  # no whole round yet: no length to go by
    policy.ended(True, 3.0, again=False)
    by = policy.round_began(160.0)  # a 60 s round, a Mix1 of 3 s, a grace window of 2 s
    assert by == pytest.approx(160.0 + 60.0 - 2 * 2.0 - 3.0)
    assert policy.wanted(by, 200.0) and policy.wanted(by, by) and not policy.wanted(by, by + 0.001)
    policy.ended(False, 1.0, again=False)  # a failure leaves the last success's time
    policy.ended(True, 5.0, again=True)
    assert (policy.tried, policy.succeeded) == (1, 1)
    assert policy.round_began(220.0) == pytest.approx(220.0 + 60.0 - 4.0 - 5.0)
    off = RunAgain(False, grace_s=2.0)
    off.round_began(0.0)
    assert off.round_began(60.0) is None and not off.wanted(None, 60.0)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_the_survivors_of_a_failed_ring_get_their_exact_mean_the_second_time(codec):
    """Rank 3 never takes part: the first attempt (a group of 4) fails after the group was agreed; once it is known
    dead, the second attempt under ``mix1/0/again`` is the survivors' exact mean, also for a compressed Mix1 (its
    reference was dropped with the failure: fp32)."""
    hub = MemoryHub(4, timeout_s=0.3)
    values = [{"w": torch.arange(6, dtype=torch.float32) * (r + 1)} for r in range(4)]
    mixers = [GlobalMix("mix1", ["w"], 0, build_codec(codec)) for _ in range(3)]
    for mixer in mixers:
        mixer.start_reference([values[0]])  # x_0: the compressed mean's first reference
    with ThreadPoolExecutor(max_workers=3) as pool:
        first = list(pool.map(lambda r: mixers[r].mix([values[r]], 0, hub.exchange(r)), range(3)))
        assert all(not f.ok and f.grouped and not f.again for f in first), first
        assert all(f.values[0]["w"] is values[r]["w"] for r, f in enumerate(first))  # identity
        hub.fail(3)
        again = list(pool.map(lambda r: mixers[r].mix([values[r]], 0, hub.exchange(r), again=True), range(3)))
    mean = torch.stack([values[r]["w"] for r in range(3)]).double().mean(0).float()
    # Three fp32 values below 16 summed (two roundings of at most half an ulp of a sum below 32: 16 eps each) and
    # divided by 3 (half an ulp of a mean below 16: 8 eps): within 40 eps of the exact mean
    bound = 40 * torch.finfo(torch.float32).eps
    for result in again:
        assert result.ok and result.again, result
        assert (result.values[0]["w"] - mean).abs().max().item() <= bound
    assert mixers[0].key(0) == "mix1/0"  # the next call's key: a second attempt names only itself


def test_a_failure_the_caller_may_run_again_is_not_announced_as_identity(caplog):
    hub = MemoryHub(2, timeout_s=0.2)  # rank 1 never comes
    mixer = GlobalMix("mix1", ["w"], 0)
    with caplog.at_level("WARNING", logger="gossiploco.mixing.operators"):
        assert not mixer.mix([{"w": torch.ones(2)}], 0, hub.exchange(0), last_try=False).ok
        assert not mixer.mix([{"w": torch.ones(2)}], 1, hub.exchange(0)).ok
    first, last = [r.getMessage() for r in caplog.records]
    assert "exchange failed" in first and "identity" not in first  # the caller says what comes next
    assert last.endswith("; identity this round")


def test_a_group_that_was_never_agreed_is_not_a_failure_to_run_again():
    hub = MemoryHub(2, timeout_s=5.0)
    result = GlobalMix("mix1", ["w"], 0).mix([{"w": torch.ones(2)}], 0, _Refusing(hub.exchange(0)))
    assert not result.ok and not result.grouped


def test_a_group_whose_leader_never_decided_is_run_again_and_one_that_completed_declines_it():
    """A leader dead behind an idle link never decides: its bucket's followers all fail alike (``NoDecision``), and
    would meet again under the key's second leader, so the failure is one to run again. A Mix1 that completed over
    an agreed group tells its exchange (``protocol.declines``), once, and only for the first attempt."""
    from gossiploco.errors import NoDecision

    hub = MemoryHub(2, timeout_s=5.0)
    silent = _Refusing(hub.exchange(0), NoDecision("mix1/0: no decision within 3.0s (the leader never said it was there)"))
    result = GlobalMix("mix1", ["w"], 0).mix([{"w": torch.ones(2)}], 0, silent)
    assert not result.ok and not result.grouped and result.leaderless
    assert silent.completed_keys == []

    class _Told:
        def __init__(self, inner):
            self.inner, self.rank, self.completed_keys = inner, inner.rank, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def completed(self, key):
            self.completed_keys.append(key)

    exchanges = [_Told(hub.exchange(r)) for r in range(2)]
    mixers = [GlobalMix("mix1", ["w"], 0) for _ in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = list(pool.map(lambda r: mixers[r].mix([{"w": torch.ones(2) * r}], 3, exchanges[r]), range(2)))
        again = list(pool.map(lambda r: mixers[r].mix([{"w": torch.ones(2) * r}], 3, exchanges[r], again=True),
                              range(2)))
    assert all(f.ok and f.grouped for f in first + again)
    assert [e.completed_keys for e in exchanges] == [["mix1/3"], ["mix1/3"]]


class _Refusing:
    """An exchange whose agreement fails (this peer was left out, or ``error``)."""

    def __init__(self, inner, error=None):
        from gossiploco.errors import ExchangeTimeout
        self.inner, self.rank, self.completed_keys = inner, inner.rank, []
        self.error = error or ExchangeTimeout("this peer was not ready within the grace window")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def group(self, key, round_index):
        raise self.error

    def completed(self, key):
        self.completed_keys.append(key)


@pytest.mark.slow
def test_the_simulated_swarm_completes_more_mix1_under_churn_and_blocks_no_longer():
    """256 simulated peers on consumer links, 1% of them crashing a round, the same seed with and without."""
    without = simulate_scale(1, 256, rounds=5, churn=0.01, mix1_again=False)
    with_again = simulate_scale(1, 256, rounds=5, churn=0.01)
    assert not without.violations and not with_again.violations
    a, b = without.stats["per_peer"], with_again.stats["per_peer"]
    assert b["mix1_again"].get("ok", 0) > 0 and not a["mix1_again"]
    assert b["mix1_completion"] > a["mix1_completion"] + 0.02, (a["mix1_completion"], b["mix1_completion"])
    assert b["blocking_s"] <= a["blocking_s"] and b["round_s"] <= a["round_s"]
