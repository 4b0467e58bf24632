"""Mix1 and Mix2 in a swarm split into groups (issue 26, item 2): the operators over a ``MemoryHub`` whose
exchanges run in the buckets of ``protocol.groups``, against references computed here from ``groups.group_of``.

References, for exchange key k (``"mix1/r"``, ``"mix2/r"``) and worker m with vector x_m:

    group G(m) = group_of(seed, k, all workers, m, size); the G(m) over m partition the workers
    GlobalMix:  every m gets  mean_{j in G(m)} x_j                   (the bucket's mean, not the swarm's)
    GossipMix:  m is matched with pair_matching(seed, r, "mix2", G(m))[m], a member of G(m) (or nobody), and
                the pair (a, b) both get (x_a + x_b) / 2, so the pair's sum is kept
    referenced compressed Mix1 (int8, no error feedback): a worker whose reference was made by exactly the
                members of G(m) (or is x_0) sends Q(x - ref); otherwise every member of G(m) sends fp32, and
                nothing fails for that reason. Members holding different references (tags) fail the exchange.

Tolerances (fp32, unit roundoff u = eps / 2 = 2^-24): a mean of g values summed in fp32 and divided by g is off
the exact mean by at most (g - 1) u max|x| (the sum) + u max|x| (the division) = g u max|x| (to first order),
so ``g * eps * max|x|`` bounds it with a factor 2 to spare. A pair mean fl(a + b) / 2 (the halving is exact) keeps
the pair's sum to within u |a + b|.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gossiploco.mixing import GlobalMix, GossipMix, MemoryHub, pair_matching
from gossiploco.mixing.compression import build_codec
from gossiploco.protocol import groups
from gossiploco.protocol.ring import segment_bounds

WORKERS, SIZE, SEED = 12, 4, 7
EPS = torch.finfo(torch.float32).eps


def vectors(n: int, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * scale for _ in range(WORKERS)]


def run_round(mixers, values, round_index: int, hub: MemoryHub):
    """Every worker's ``mix`` at once (each waits for its group in the hub); the MixResults in rank order."""
    with ThreadPoolExecutor(max_workers=len(mixers)) as pool:
        futures = [pool.submit(m.mix, [{"w": v}], round_index, hub.exchange(r))
                   for r, (m, v) in enumerate(zip(mixers, values))]
        return [f.result(timeout=60) for f in futures]


def buckets(key: str) -> dict[int, list[int]]:
    """Each worker's group for ``key``, from the reference definition."""
    return {m: groups.group_of(SEED, key, list(range(WORKERS)), m, SIZE) for m in range(WORKERS)}


def test_the_buckets_partition_the_workers_and_every_member_sees_the_same_group():
    for key in ("mix1/0", "mix1/1", "mix2/0", "mix2/5"):
        of = buckets(key)
        hub = MemoryHub(WORKERS, 5.0, seed=SEED, group_size=SIZE)
        assert all(hub.exchange(m).group(key, 0) == of[m] for m in range(WORKERS))
        distinct = {tuple(g) for g in of.values()}
        assert sorted(m for g in distinct for m in g) == list(range(WORKERS))  # disjoint, and they cover everyone
        assert all(m in of[m] and all(of[j] == of[m] for j in of[m]) for m in range(WORKERS))
        assert len(distinct) > 1  # 12 workers over buckets of 4: the swarm is split


def test_global_mix_in_groups_gives_each_worker_its_buckets_mean():
    hub = MemoryHub(WORKERS, 10.0, seed=SEED, group_size=SIZE)
    mixers = [GlobalMix("mix1", ["w"], SEED) for _ in range(WORKERS)]
    for r in range(3):
        xs = vectors(257, 100 + r)
        out = run_round(mixers, xs, r, hub)
        of = buckets(f"mix1/{r}")
        for m, o in enumerate(out):
            g = of[m]
            exact = sum(xs[j].double() for j in g) / len(g)
            bound = len(g) * EPS * max(float(xs[j].abs().max()) for j in g)
            assert o.ok, o.cause
            assert float((o.values[0]["w"].double() - exact).abs().max()) <= bound
            assert torch.equal(o.values[0]["w"], out[g[0]].values[0]["w"])  # the group agrees bit for bit
            assert o.bytes == (2 * (len(g) - 1) * 257 * 4 // len(g) if len(g) > 1 else 0)
        global_mean = sum(x.double() for x in xs) / WORKERS
        assert max(float((o.values[0]["w"].double() - global_mean).abs().max()) for o in out) > 1e-2  # not the swarm's


def test_gossip_in_groups_pairs_only_inside_buckets_and_keeps_each_pairs_sum():
    hub = MemoryHub(WORKERS, 10.0, seed=SEED, group_size=SIZE)
    mixers = [GossipMix("mix2", ["w"], SEED) for _ in range(WORKERS)]
    unmatched = 0
    for r in range(4):
        xs = vectors(129, 200 + r)
        out = run_round(mixers, xs, r, hub)
        of = buckets(f"mix2/{r}")
        for m, o in enumerate(out):
            partner = pair_matching(SEED, r, "mix2", of[m]).get(m)
            assert o.ok and o.partner == partner
            if partner is None:
                unmatched += 1
                assert torch.equal(o.values[0]["w"], xs[m])
                continue
            assert partner in of[m]
            assert torch.equal(o.values[0]["w"], out[partner].values[0]["w"])
            pair_sum = xs[m].double() + xs[partner].double()
            kept = 2 * o.values[0]["w"].double()  # the two members' values, summed (exactly, in fp64)
            assert bool(((kept - pair_sum).abs() <= EPS / 2 * pair_sum.abs()).all())
        assert unmatched == sum(len(g) % 2 for g in {tuple(g) for g in of.values()})  # one per odd bucket
        unmatched = 0


def compressed_reference(zs: dict[int, torch.Tensor], ref: torch.Tensor, group: list[int], codec) -> torch.Tensor:
    """``compressed.group_mean`` of d_m = z_m - ref written out: owner k of segment S_k sums its own exact d_k and
    the others' D(Q(d_m)) in member order, divides by g; everyone gets ref + D(Q(that))."""
    out = torch.empty_like(ref)
    bounds = segment_bounds(ref.numel(), len(group))
    for k, owner in enumerate(group):
        s = slice(bounds[k], bounds[k + 1])
        total = (zs[owner][s] - ref[s]).clone()
        for m in group:
            if m != owner:
                total += codec.roundtrip(zs[m][s] - ref[s])[1]
        out[s] = ref[s] + codec.roundtrip(total / len(group))[1]
    return out


def rounds_with_a_repeated_group() -> tuple[int, int, list[int]]:
    """Two Mix1 rounds (r1 < r2) in which some bucket of at least 3 workers is the same, others are not, and a
    worker alone in r1 (it keeps x_0 unless it drops it) is in a group of several in r2."""
    for r2 in range(1, 200):
        for r1 in range(r2):
            first, second = buckets(f"mix1/{r1}"), buckets(f"mix1/{r2}")
            same = [g for m, g in second.items() if g == first[m] and len(g) >= 3]
            if (same and any(first[m] != g for m, g in second.items() if len(g) > 1)
                    and any(len(first[m]) == 1 and len(second[m]) > 1 for m in first)):
                return r1, r2, same[0]
    raise AssertionError("no repeated group in 200 rounds")


def test_a_referenced_compressed_mix1_uses_its_reference_only_in_the_group_that_made_it():
    codec = build_codec("int8", block=64)
    n = 300
    hub = MemoryHub(WORKERS, 10.0, seed=SEED, group_size=SIZE)
    mixers = [GlobalMix("mix1", ["w"], SEED, codec) for _ in range(WORKERS)]
    assert all(m.referenced for m in mixers)
    x0 = vectors(n, 1)[0]
    for m in mixers:
        m.start_reference([{"w": x0}])
    r1, r2, repeated = rounds_with_a_repeated_group()
    fp32_bytes = {g: 2 * (g - 1) * n * 4 // g for g in range(2, WORKERS + 1)}

    # r1: x_0 is every group's reference, so every group of two or more compresses against it
    zs = {m: x0 + v for m, v in enumerate(vectors(n, 2, 0.01))}
    out = run_round(mixers, [zs[m] for m in range(WORKERS)], r1, hub)
    of = buckets(f"mix1/{r1}")
    for m, o in enumerate(out):
        assert o.ok, o.cause
        if len(of[m]) > 1:
            assert torch.equal(o.values[0]["w"], compressed_reference(zs, x0, of[m], codec))
            assert o.bytes < fp32_bytes[len(of[m])] / 3

    # r2: the repeated group compresses against its r1 mean; every other group sends fp32, and none fails
    previous = {m: o.values[0]["w"] for m, o in enumerate(out)}
    zs = {m: previous[m] + v for m, v in enumerate(vectors(n, 3, 0.01))}
    out = run_round(mixers, [zs[m] for m in range(WORKERS)], r2, hub)
    of = buckets(f"mix1/{r2}")
    for m, o in enumerate(out):
        g = of[m]
        assert o.ok, o.cause
        if len(g) == 1:
            assert o.bytes == 0 and torch.equal(o.values[0]["w"], zs[m])
        elif g == repeated:
            assert torch.equal(o.values[0]["w"], compressed_reference(zs, previous[m], g, codec))
            assert o.bytes < fp32_bytes[len(g)] / 3
        else:
            exact = sum(zs[j].double() for j in g) / len(g)
            bound = len(g) * EPS * max(float(zs[j].abs().max()) for j in g)
            assert float((o.values[0]["w"].double() - exact).abs().max()) <= bound
            assert o.bytes == fp32_bytes[len(g)]  # fp32 through the two-phase exchange: a ring's share


def test_members_holding_different_references_fail_the_exchange_instead_of_mixing_them():
    """The repeated group's members all compress (their references were made by exactly this group), but one of
    them holds x_0 instead (tag 1, as a worker that restarted from x_0 would): the tags differ, so the group's
    exchange fails at once for all of them, and the next mix of each sends fp32 and succeeds."""
    codec = build_codec("int8", block=64)
    n = 300
    hub = MemoryHub(WORKERS, 10.0, seed=SEED, group_size=SIZE)
    mixers = [GlobalMix("mix1", ["w"], SEED, codec) for _ in range(WORKERS)]
    x0 = vectors(n, 1)[0]
    for m in mixers:
        m.start_reference([{"w": x0}])
    r1, r2, repeated = rounds_with_a_repeated_group()
    out = run_round(mixers, [x0 + v for v in vectors(n, 2, 0.01)], r1, hub)
    stranger = repeated[-1]
    mixers[stranger].start_reference([{"w": x0}])  # a different reference, the same codec
    zs = [o.values[0]["w"] + v for o, v in zip(out, vectors(n, 3, 0.01))]
    out = run_round(mixers, zs, r2, hub)
    for m, o in enumerate(out):
        if m in repeated:
            assert not o.ok and "tag" in o.cause, o.cause
            assert o.values[0]["w"] is zs[m]  # identity
        else:
            assert o.ok, o.cause
    later = r2 + 1
    out = run_round(mixers, zs, later, hub)
    of = buckets(f"mix1/{later}")
    assert all(o.ok for o in out), [o.cause for o in out]
    for m in repeated:  # its reference was dropped: fp32 now, whatever its new group
        g = of[m]
        exact = sum(zs[j].double() for j in g) / len(g)
        assert float((out[m].values[0]["w"].double() - exact).abs().max()) <= len(g) * EPS * max(
            float(zs[j].abs().max()) for j in g)


@pytest.mark.parametrize("world,size", [(16, 8), (32, 8), (32, 4)])
def test_the_analytic_rhos_of_the_bench_configurations(world, size):
    """The bench's rho1 and rho2 (``bench/group_mix1.py``): a swarm within the size is one group (rho1 = 0, the
    uniform matching's rho2); beyond it, rho1 near 1/size and rho2 above the uniform matching's."""
    uniform = (world - 2) / (2 * (world - 1))
    assert groups.mean_rho(world, world) == 0.0 and groups.gossip_rho(world, world) == pytest.approx(uniform)
    assert 0.5 / size < groups.mean_rho(world, size) < 2.0 / size
    assert groups.gossip_rho(world, size) > uniform


@pytest.mark.slow
def test_the_virtual_swarms_round_start_consensus_is_against_every_workers_average_when_mix1_is_in_groups(
        make_config):
    """eq. 34 at h = 0, written out: CD_L2 = (1/M) sum_m ||z_m - z_bar||, z_bar = (1/M) sum_m z_m over all M
    workers. A Mix1 in groups gives each worker its bucket's mean, so the monitor must not take it for z_bar (a
    global Mix1's result is z_bar, and the monitor reuses it). z_bar is rounded to fp32 (u |z_bar| per value), which
    moves each norm by at most u ||z_bar||: the tolerance. (With 4 workers in pairs, gossip makes partners' z equal
    and a bucket's mean can be z_bar exactly; 8 workers in buckets of 4 do not.)"""
    from gossiploco.runtime.virtual import VirtualSwarm

    workers, size = 8, 4
    cfg = make_config("globalm1-localm2", workers=workers, rounds=2, inner_steps=2,
                      **{"groups.size": size, "monitor.every": 0})
    swarm = VirtualSwarm(cfg)
    checked, apart = [], []

    def check(_, record):
        if record is None or not 0 < record["round"] < cfg.rounds:
            return
        zs = [t.params_cpu() for t in swarm.trainers]
        names = list(zs[0])
        flat = torch.stack([torch.cat([z[n].double().reshape(-1) for n in names]) for z in zs])
        mean = flat.mean(0)
        tolerance = EPS * float(mean.norm())
        want = float((flat - mean).norm(dim=1).mean())
        assert record["cd_l2"] == pytest.approx(want, rel=0, abs=tolerance), record["round"]
        bucket = groups.group_of(cfg.seed, f"mix1/{record['round']}", range(workers), 0, size)
        wrong = float((flat - flat[bucket].mean(0)).norm(dim=1).mean())  # against worker 0's bucket mean
        apart.append(abs(wrong - want) > 100 * tolerance)
        checked.append(record["round"])

    swarm.run(on_step=check)
    assert checked == list(range(1, cfg.rounds))
    assert any(apart)  # the bucket's mean would have measured something else: the test can fail
