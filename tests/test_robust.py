"""Robust mixing against the math: CenteredClip (Karimireddy, He and Jaggi 2021, the aggregator of BTARD-SGD),
the screen, bounded weights, the two-owner group mean, ClippedGossip (He, Karimireddy and Jaggi 2022), and the
ledger that excludes a repeat offender. In memory (``MemoryHub``); the attack bench runs real peers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gossiploco.config import RobustConfig
from gossiploco.mixing import GlobalMix, GossipMix, MemoryHub
from gossiploco.mixing.compression import Float32Codec, build_codec
from gossiploco.mixing.robust import RobustSettings, bounded_weights, centered_clip, coordinate_median, screen
from gossiploco.mixing.robust_mean import Robust, robust_group_mean
from gossiploco.mixing.screen import Ledger
from gossiploco.protocol.ring import segment_bounds

SETTINGS = RobustSettings()
EPS = torch.finfo(torch.float32).eps


def honest_rows(m: int, n: int, seed: int = 0, spread: float = 0.1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g)
    return base + spread * torch.randn(m, n, generator=g)


def reference_centered_clip(rows: torch.Tensor, w: torch.Tensor, tau: float, v: torch.Tensor, iterations: int):
    """v_{l+1} = v_l + sum_m w_m clip(x_m - v_l, tau) / sum_m w_m, clip(d, tau) = d min(1, tau / ||d||), in float64."""
    rows, w, v = rows.double(), w.double(), v.double()
    for _ in range(iterations):
        step = torch.zeros_like(v)
        for x, wm in zip(rows, w):
            d = x - v
            step += wm * d * min(1.0, tau / float(d.norm()))
        v = v + step / w.sum()
    return v


def test_coordinate_median_is_the_middle_value_or_the_mean_of_the_two_middle_ones():
    rows = torch.tensor([[1.0, 9.0], [5.0, -1.0], [3.0, 4.0]])
    assert torch.equal(coordinate_median(rows), torch.tensor([3.0, 4.0]))
    assert torch.equal(coordinate_median(rows[:2]), torch.tensor([3.0, 4.0]))


def test_without_outliers_centered_clip_is_the_weighted_mean():
    rows, w = honest_rows(6, 1000), torch.tensor([1.0, 2.0, 1.0, 0.5, 1.0, 1.5])
    out = centered_clip(rows, w, SETTINGS)
    exact = (w.double().unsqueeze(1) * rows.double()).sum(0) / w.double().sum()
    # fp32: a few roundings of values of size |x| per step
    assert float((out.double() - exact).abs().max()) <= 16 * EPS * float(rows.abs().max()) * SETTINGS.iterations


def test_centered_clip_follows_its_equation_and_bounds_a_scaled_liar():
    rows = honest_rows(5, 500, seed=1)
    rows[4] = rows[4] * 1000
    w = torch.ones(5)
    out = centered_clip(rows, w, SETTINGS)
    v0 = coordinate_median(rows)
    tau = SETTINGS.radius_factor * float((rows - v0).norm(dim=1).median())
    expected = reference_centered_clip(rows, w, tau, v0, SETTINGS.iterations)
    assert float((out.double() - expected).norm()) <= 1e-4 * float(expected.norm())
    honest_mean = rows[:4].mean(0)
    # each step moves the result at most w_liar tau / W toward the liar; the honest rows pull it back
    assert float((out - honest_mean).norm()) <= SETTINGS.iterations * tau / 5 + tau
    assert float((rows.mean(0) - honest_mean).norm()) > 100 * tau  # what a mean would have done


def test_the_screen_names_outliers_rows_pointing_backwards_and_non_finite_rows():
    anchor = torch.zeros(300)
    rows = honest_rows(6, 300, seed=2, spread=1.0)  # honest moves agree (cosine about 1/2) but spread widely
    rows[1] = rows[1] * 50
    rows[2] = -rows[2]  # as far from the median as honest rows may be, but backwards
    rows[3, 7] = float("nan")
    verdict = screen(rows, SETTINGS, anchor)
    assert set(verdict.failed) == {1, 2, 3} and verdict.dropped == {3}
    assert "typical distance" in verdict.failed[1] and "against" in verdict.failed[2]
    assert screen(honest_rows(6, 300, seed=3), SETTINGS, anchor).failed == {}


def test_weights_are_bounded_by_the_median_claim():
    bounded, over = bounded_weights([1.0, 1.0, 64.0, 0.5, 1.0], cap=2.0)
    assert bounded == [1.0, 1.0, 2.0, 0.5, 1.0] and over == [2]


def run_group(values, *, liars=None, weights=None, codec=None, ledgers=None, round_index=0):
    """robust_group_mean on every member at once over a MemoryHub; ``liars[r]`` wraps member r's exchange."""
    n = len(values)
    hub = MemoryHub(n, 10.0)
    ledgers = ledgers or [Ledger() for _ in range(n)]
    codec = codec or Float32Codec()

    def one(r):
        ex = hub.exchange(r)
        if liars and r in liars:
            ex = liars[r](ex)
        return robust_group_mean("mix2/0", values[r], list(range(n)), ex, codec, SETTINGS, ledgers[r], round_index,
                                 weight=None if weights is None else weights[r])

    with ThreadPoolExecutor(max_workers=n) as pool:
        return [f.result(timeout=30) for f in [pool.submit(one, r) for r in range(n)]], ledgers


def test_an_honest_group_gets_the_mean_everywhere_bit_for_bit_alike():
    values = list(honest_rows(5, 103, seed=4))
    results, ledgers = run_group(values)
    mean = torch.stack(values).double().mean(0)
    bounds = segment_bounds(103, 5)
    size = [4 * (bounds[k + 1] - bounds[k]) for k in range(5)]
    for me, (out, _, sent) in enumerate(results):
        assert torch.equal(out, results[0][0])
        assert float((out.double() - mean).abs().max()) <= 16 * EPS * float(mean.abs().max()) * SETTINGS.iterations
        scatter = sum(size[j] + size[j - 1] for j in range(5) if j != me)  # both owners of every segment
        assert sent == scatter + 4 * (size[me] + size[me - 1])  # and both its results to the 4 others
    assert all(ledger.summary()["screen_failures"] == {} for ledger in ledgers)


def test_a_scaled_member_is_clipped_struck_and_at_length_excluded():
    ledgers = [Ledger(strikes=3, window=5) for _ in range(5)]
    for r in range(3):
        values = list(honest_rows(5, 200, seed=10 + r))
        honest_mean = torch.stack(values[:4]).mean(0)
        values[4] = values[4] * 1000
        results, _ = run_group(values, ledgers=ledgers, round_index=r)
        spread = float((torch.stack(values[:4]) - honest_mean).norm(dim=1).max())
        for out, _, _ in results[:4]:
            assert float((out - honest_mean).norm()) <= 2 * spread
    for ledger in ledgers[:4]:
        assert ledger.excluded() == {4}
        assert "failed the screen in 3 of the last 5 rounds" in ledger.summary()["excluded"]["4"]
    values = list(honest_rows(5, 200, seed=20))
    values[4] = values[4] * 1000
    results, _ = run_group(values, ledgers=ledgers, round_index=3)
    # excluded: whatever it sends (as a member or as an owner) changes nothing, also after it left and came back
    # under the same identity (a new exchange for the same rank: members are keyed by the id their key fixes)
    values[4] = values[4] * -7
    again, _ = run_group(values, ledgers=ledgers, round_index=4)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(results[:4], again[:4]))


class LyingOwner:
    """A member whose results as an owner are off by ``bias`` (its inputs are honest)."""

    def __init__(self, exchange, bias: float):
        self.exchange, self.bias, self.rank = exchange, bias, exchange.rank

    def __getattr__(self, name):
        return getattr(self.exchange, name)

    def all_to_all(self, key, parts, members, sizes, tag=0):
        if key.endswith("/gather"):
            any_part = next(iter(parts.values()))
            lie = (any_part.view(torch.float32) + self.bias).view(torch.uint8)
            parts = {m: lie for m in parts}
        return self.exchange.all_to_all(key, parts, members, sizes, tag)


def test_a_lying_owner_moves_no_segment_past_each_members_own_value_and_is_counted():
    values = list(honest_rows(4, 400, seed=5))
    honest = torch.stack(values).mean(0)
    results, ledgers = run_group(values, liars={2: lambda ex: LyingOwner(ex, 5.0)})
    for r in (0, 1, 3):
        out = results[r][0]
        low, high = torch.minimum(values[r], honest) - 1e-5, torch.maximum(values[r], honest) + 1e-5
        assert bool(((out >= low) & (out <= high)).all())  # between its own value and the honest mean
        summary = ledgers[r].summary()
        assert summary["owner_disagreements"] == 2 and summary["screen_failures"] == {}


def test_robust_weighted_mean_bounds_a_weight_lie():
    values = list(honest_rows(5, 50, seed=6))
    results, ledgers = run_group(values, weights=[1.0, 1.0, 1.0, 1.0, 64.0])
    w = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0])  # the lie counts as twice the median claim
    expected = (w.unsqueeze(1) * torch.stack(values)).sum(0) / w.sum()
    assert float((results[0][0] - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    assert results[0][1] == pytest.approx(6 / 5)
    assert "4" in ledgers[0].summary()["screen_failures"]


def test_robust_group_mean_works_through_a_dense_codec():
    values = list(honest_rows(4, 8192, seed=7))
    results, _ = run_group(values, codec=build_codec("int8", block=4096))
    mean = torch.stack(values).mean(0)
    for out, _, _ in results:  # two int8 quantizations: 2 absmax / 127 per value at most
        assert float((out - mean).abs().max()) <= 2 * float(torch.stack(values).abs().max()) / 127 + 1e-6


def mixers_over_hub(factory, values, round_index=0, hub=None):
    hub = hub or MemoryHub(len(values), 10.0)
    mixers = [factory(r) for r in range(len(values))]
    with ThreadPoolExecutor(max_workers=len(values)) as pool:
        futures = [pool.submit(m.mix, [v], round_index, hub.exchange(r)) for r, (m, v) in enumerate(zip(mixers, values))]
        return [f.result(timeout=30) for f in futures], mixers


def test_robust_global_mix_is_the_mean_without_attackers():
    values = [{"w": row.reshape(10, 10)} for row in honest_rows(4, 100, seed=8)]

    def factory(r):
        mixer = GlobalMix("mix1", ["w"], 0)
        mixer.make_robust(Robust(SETTINGS, Ledger()))
        return mixer

    results, _ = mixers_over_hub(factory, values)
    mean = torch.stack([v["w"] for v in values]).mean(0)
    assert all(res.ok and torch.allclose(res.values[0]["w"], mean, atol=1e-5) for res in results)


def test_clipped_gossip_refuses_a_reversed_partner_and_clips_a_scaled_one():
    g = torch.Generator().manual_seed(9)
    update = torch.randn(100, generator=g)
    mine, reversed_, scaled = update + 0.1 * torch.randn(100, generator=g), -update, update * 1000
    for theirs, struck in ((reversed_, "against"), (scaled, None)):
        ledger = Ledger()
        mixer = GossipMix("mix2", ["w"], 0)
        mixer.make_robust(Robust(SETTINGS, ledger))
        partner = GossipMix("mix2", ["w"], 0)
        partner.make_robust(Robust(SETTINGS, Ledger()))
        results, _ = mixers_over_hub(lambda r: mixer if r == 0 else partner, [{"w": mine}, {"w": theirs}])
        out = results[0].values[0]["w"]
        if struck:
            assert torch.equal(out, mine) and struck in ledger.summary()["last_screen_failure"]["1"]
        else:  # clipped to radius_factor times its own move: half of that is taken
            assert float((out - mine).norm()) <= SETTINGS.radius_factor * float(mine.norm()) / 2 * (1 + 1e-5)


def test_robust_mode_auto_follows_whether_the_run_is_open():
    assert RobustConfig().active(open_run=True) and not RobustConfig().active(open_run=False)
    assert RobustConfig(mode="on").active(False) and not RobustConfig(mode="off").active(True)


def test_over_zeromq_a_scaled_member_moves_the_honest_members_no_further_than_the_honest_spread():
    from test_exchange import ZmqGroup

    group = ZmqGroup(4, 10.0)
    try:
        values = list(honest_rows(4, 2000, seed=11))
        honest_mean = torch.stack(values[:3]).mean(0)
        values[3] = values[3] * 1000
        ledgers = [Ledger() for _ in range(4)]

        def one(r):
            mixer = GlobalMix("mix1", ["w"], 0)
            mixer.make_robust(Robust(SETTINGS, ledgers[r]))
            return mixer.mix([{"w": values[r]}], 0, group.exchanges[r])

        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(one, range(4)))
        spread = float((torch.stack(values[:3]) - honest_mean).norm(dim=1).max())
        for r in range(3):
            assert results[r].ok and float((results[r].values[0]["w"] - honest_mean).norm()) <= 2 * spread
            assert "3" in ledgers[r].summary()["screen_failures"]
    finally:
        group.close()


def test_three_rows_convict_nobody_by_distance_or_direction_but_non_finite_rows_are_dropped():
    rows = honest_rows(3, 300, seed=12)
    rows[1] = rows[1] * 50
    assert screen(rows, SETTINGS, torch.zeros(300)).failed == {}
    rows[2, 0] = float("inf")
    verdict = screen(rows, SETTINGS)
    assert verdict.dropped == {2} and set(verdict.failed) == {2}
