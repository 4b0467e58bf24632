"""Buckets and leaders of exchanges in large swarms (``protocol.groups``), against the math of their mixing matrices.

The paper's contraction factor of a random mixing W (eqs. 55-56, in expectation) is rho = the second eigenvalue
of E[W^T W]. For a group mean W_ij = 1/|g| when i and j share a bucket, and W^T W = W; the buckets are
exchangeable, so E[W] = a I + b 11^T with every eigenvalue off the consensus direction equal to
a = E[W_ii] - (1 - E[W_ii]) / (M - 1). The tests estimate a from many exchanges' buckets and compare it with
``mean_rho`` and ``gossip_rho`` within five standard errors of the estimate (computed from the samples themselves).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from gossiploco.mixing.operators import pair_matching
from gossiploco.protocol import groups


def _buckets(seed: int, key: str, view: list[int], size: int) -> list[list[int]]:
    """Every bucket of ``key`` at once (what each member's ``group_of`` gives, checked in the first test)."""
    n = groups.bucket_count(len(view), size)
    found: dict[int, list[int]] = {}
    for m, b in zip(sorted(view), (groups.scores(seed, key, "bucket", sorted(view)) % np.uint64(n)).tolist()):
        found.setdefault(b, []).append(m)
    return list(found.values())


def test_a_small_view_is_one_group_and_a_large_one_splits_into_a_partition_of_buckets_near_the_size():
    assert groups.group_of(1, "mix2/0", range(16), 3, 16) == list(range(16))
    view = list(range(1000))
    parts = _buckets(7, "mix2/5", view, 16)
    assert sorted(m for g in parts for m in g) == view  # a partition: every member in exactly one bucket
    n = groups.bucket_count(1000, 16)
    assert n == 64 and len(parts) <= n and 1000 / n <= 16 < 2 * 1000 / n
    sizes = [len(g) for g in parts]
    assert max(sizes) <= groups.cap(16), sizes
    # every member computes its own bucket the same way: the bucket of any member seen from any other agrees
    for g in parts[:5]:
        assert all(groups.group_of(7, "mix2/5", view, m, 16) == g for m in g)
    small = _buckets(7, "mix2/5", list(range(40)), 8)
    assert all(groups.group_of(7, "mix2/5", list(range(40)), m, 8) == g for g in small for m in g)


def test_a_member_one_peer_does_not_know_moves_only_its_own_bucket():
    view = list(range(300))
    full = {m: groups.group_of(3, "mix1/9", view, m, 16) for m in view}
    missing = 123
    partial = [m for m in view if m != missing]
    assert groups.bucket_count(len(view), 16) == groups.bucket_count(len(partial), 16)
    for m in partial:
        expected = [p for p in full[m] if p != missing]
        assert groups.group_of(3, "mix1/9", partial, m, 16) == expected


def test_leaders_are_drawn_per_exchange_and_nobody_leads_more_than_its_share():
    view, size, keys = list(range(40)), 8, 3000
    led = dict.fromkeys(view, 0)
    inverse = []
    for k in range(keys):
        for g in _buckets(11, f"mix2/{k}", view, size):
            led[groups.leader_of(11, f"mix2/{k}", g)] += 1
            inverse += [1 / len(g)] * len(g)
    share = sum(groups.bucket_size_pmf(40, size)[j] / j for j in range(1, 41))  # P(lead) = E[1 / |g|]
    expected = keys * share
    sd = math.sqrt(keys * share * (1 - share))
    assert all(abs(c - expected) < 5 * sd for c in led.values()), (expected, sd, led)
    assert groups.leader_of(11, "mix2/0", [5]) == 5


def test_the_group_means_rho_is_the_papers_contraction_in_expectation():
    m, size, keys = 40, 8, 2000
    samples = []
    for k in range(keys):
        w = np.zeros((m, m))
        for g in _buckets(5, f"mix1/{k}", list(range(m)), size):
            w[np.ix_(g, g)] = 1 / len(g)
        assert np.allclose(w.T @ w, w)  # a projection: E[W^T W] = E[W]
        diag = float(np.mean(np.diag(w)))
        samples.append(diag - (1 - diag) / (m - 1))
    estimate, se = statistics.fmean(samples), statistics.stdev(samples) / math.sqrt(keys)
    assert abs(estimate - groups.mean_rho(m, size)) < 5 * se, (estimate, se, groups.mean_rho(m, size))
    assert groups.mean_rho(16, 16) == 0.0  # one group: the global mean
    assert 0.5 / 16 < groups.mean_rho(1000, 16) < 2.5 / 16


def test_gossip_inside_buckets_is_an_unbiased_matching_with_the_stated_rho():
    m, size, keys = 12, 4, 3000
    pairs = np.zeros((m, m))
    matched_fraction = []
    for k in range(keys):
        key = f"mix2/{k}"
        matched = 0
        for g in _buckets(2, key, list(range(m)), size):
            for a, b in pair_matching(2, k, "mix2", g).items():
                if b is not None:
                    pairs[a, b] += 1
                    matched += 1
        matched_fraction.append(matched / m)
    p, se = statistics.fmean(matched_fraction), statistics.stdev(matched_fraction) / math.sqrt(keys)
    assert abs(p - groups.matched_probability(m, size)) < 5 * se
    off = pairs[~np.eye(m, dtype=bool)] / keys  # every pair matched with the same probability p / (M - 1)
    q = groups.matched_probability(m, size) / (m - 1)
    assert np.all(np.abs(off - q) < 5 * math.sqrt(q * (1 - q) / keys)), (off.min(), off.max(), q)
    # rho from the same samples: a = E[W_ii] - b with E[W_ii] = 1 - p / 2 and b = p / (2 (M - 1))
    assert abs((1 - p / 2 - p / (2 * (m - 1))) - groups.gossip_rho(m, size)) < 5 * se
    assert groups.gossip_rho(8, 16) == pytest.approx((8 - 2) / (2 * 7))  # the uniform perfect matching's


def test_scores_are_the_same_on_every_machine():
    # splitmix64 in uint64 arithmetic: fixed values, whatever the CPU (the buckets of a run must agree)
    got = groups.scores(0, "mix1/0", "bucket", [0, 1, 2 ** 31 - 1]).tolist()
    salt = int(groups._salt(0, "mix1/0", "bucket"))

    def splitmix(x: int) -> int:
        mask = (1 << 64) - 1
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    assert got == [splitmix(v ^ salt) for v in (0, 1, 2 ** 31 - 1)]


def test_a_joiner_moving_the_count_past_a_power_of_two_changes_only_its_own_bucket_at_its_first_round():
    """Found with the simulator's brand-new peers: 1,000 peers plus 43 newcomers crossed 1,024 = 16 x 64, where the
    bucket count doubles; while some views held a newcomer and others not, every exchange between the two sides
    failed (Mix1 0.921, against 0.994 for 900 peers growing to 940). The count is now taken over the members of the
    round before (``PeerTable.counted``): two views that differ only by this round's joiner split alike, so they
    disagree about the joiner's bucket alone. (Its news has a whole round to reach every view before it counts.)"""
    from gossiploco.protocol.agreement import Lead
    from gossiploco.protocol.messages import Hello
    from gossiploco.protocol.node import PeerNode

    def node(rank: int, knows_joiner: bool) -> PeerNode:
        n = PeerNode(rank, list(range(8)), grace_s=1.0, chunk_elems=8, mailbox_bytes=1 << 20)
        n.group_seed, n.group_size = 7, 4  # 8 members: 2 buckets of 4; a ninth makes 4 buckets where counted
        if knows_joiner:
            n.add_peer(8)
            n.receive(8, Hello(3, -1), 0.0)  # it takes part from round 3
        return n

    assert node(0, True).peers.counted(3) == node(0, False).peers.counted(3) == 8  # round 2's members
    assert node(0, True).peers.counted(4) == 9 and node(0, True).peers.counted(0) == 8
    differ = 0
    for key in ("mix1/3", "mix2/3"):
        for rank in range(8):
            knowing, unknowing = node(rank, True).group_call(key, 3, 0.0), node(rank, False).group_call(key, 3, 0.0)
            assert sorted(set(knowing.view) - {8}) == sorted(unknowing.view), (key, rank)  # one bucket, but for it
            def leader_of(call):
                return rank if isinstance(call, Lead) else call.leader
            if 8 not in knowing.view:  # the joiner's bucket may get it as leader; every other bucket is untouched
                assert leader_of(knowing) == leader_of(unknowing), (key, rank)
            differ += knowing.view != unknowing.view
    assert 0 < differ < 2 * 8  # the joiner's bucket only

