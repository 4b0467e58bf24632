"""A network peer's monitor over the in-memory exchange: measurements run in the background, so a peer's call to
measure returns before a slower member has contributed; records are still written in (round, h) order, and a
measurement due while another runs is postponed, not skipped (runtime.peer_monitor)."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import tiny_config, wait_until
from gossiploco import consensus_sample as cs
from gossiploco.data import heldout_batch, validation_batches
from gossiploco.mixing.exchange import MemoryHub
from gossiploco.runtime.common import build_trainer
from gossiploco.runtime.peer_clock import PeerClock
from gossiploco.runtime.peer_monitor import PeerMonitor
from gossiploco.runtime.peer_progress import TrainingProgress

HUB_DEADLINE_S = 30.0
"""The in-memory exchange's deadline: a monitor that blocked on the slower member would return only after it."""


def make_monitor(cfg, corpus, hub: MemoryHub, rank: int, published: list[dict]) -> PeerMonitor:
    trainer = build_trainer(cfg, corpus, torch.device("cpu"), rank)
    with torch.no_grad():  # the members disagree by a known amount
        for p in trainer.model.parameters():
            p.add_(0.01 * (rank + 1))
    eval_trainer = build_trainer(cfg, corpus, torch.device("cpu"), -1)
    return PeerMonitor(cfg, rank, hub.exchange(rank), trainer, eval_trainer, heldout_batch(corpus, cfg.data, cfg.seed),
                       validation_batches(corpus, cfg.data, cfg.seed), clock=PeerClock(), progress=TrainingProgress(),
                       adaptive=None, publish=published.append)


def written(monitors: list[PeerMonitor], published: list[list[dict]], n: int) -> bool:
    """Poll like each peer's main thread does between inner steps, until each wrote ``n`` records."""
    for monitor in monitors:
        monitor.poll()
    return all(len(out) >= n for out in published)


@pytest.mark.slow  # four tiny models and two background measurements: about 2 s on a loaded 2-core machine
@pytest.mark.timeout(120)
def test_a_fast_peer_does_not_wait_for_a_slower_one_to_measure_and_writes_its_records_in_order(corpus):
    cfg = tiny_config("diloco", workers=2)
    hub = MemoryHub(2, HUB_DEADLINE_S)
    fast_out: list[dict] = []
    slow_out: list[dict] = []
    fast = make_monitor(cfg, corpus, hub, 0, fast_out)
    slow = make_monitor(cfg, corpus, hub, 1, slow_out)
    try:
        # The fast peer measures twice before the slow one contributes anything: both calls return (on this
        # thread, so the slow member cannot contribute before they do), nothing is written yet, and the second
        # measurement waits behind the first instead of being skipped.
        fast.record(0, 0, val_loss=True)
        fast.poll(0, 1)
        fast.record(0, 2, val_loss=False)
        assert fast_out == []
        # Now the slow member measures; the fast one's parameters moved on meanwhile (its next step).
        slow.record(0, 0, val_loss=True)
        fast.poll(0, 3)
        with torch.no_grad():
            for p in fast.trainer.model.parameters():
                p.sub_(0.01)  # twice as far from the slow member's as before
        slow.record(0, 2, val_loss=False)
        assert wait_until(lambda: written([fast, slow], [fast_out, slow_out], 2), HUB_DEADLINE_S)
    finally:
        for m in (fast, slow):
            m.exchange.close()  # as a peer closes: the exchange first, which ends a measurement in flight
            m.close()
    assert [(r["round"], r["h"]) for r in fast_out] == [(r["round"], r["h"]) for r in slow_out] == [(0, 0), (0, 2)]
    # (0, 0): both members' parameters as they were; two members: CD_L2 = ||x_0 - x_1|| / 2 (eq. 34), CD_L2^2 its
    # square (eq. 40), the whole swarm (no estimate).
    gap = 0.01 * sum(p.numel() for p in fast.trainer.model.parameters()) ** 0.5
    for out in (fast_out, slow_out):
        first = out[0]
        assert "monitor_cause" not in first and first["cd_scope"] == "swarm" and first["cd_group_size"] == 2
        assert first["cd_l2"] == pytest.approx(gap / 2, rel=1e-4)
        assert first["cd_l2_sq"] == pytest.approx(gap ** 2 / 4, rel=1e-4)
        assert first["val_loss"] > 0 and first["monitor_bg_s"] > 0
    assert fast_out[0]["cd_js"] == slow_out[0]["cd_js"] and fast_out[0]["val_loss"] == slow_out[0]["val_loss"]
    # (0, 2) was postponed on the fast peer: its snapshot is of step 3, after one more move of its parameters, and
    # the record says so; the slow member measured on time.
    assert fast_out[1]["cd_step"] == 3 and "cd_step" not in slow_out[1]
    assert fast_out[1]["cd_l2"] == pytest.approx(2 * gap / 2, rel=1e-4)
    assert fast.progress.counts["monitor_late"] == 1 and fast.progress.counts["monitor_failures"] == 0
    assert fast_out[0]["monitor_s"] < HUB_DEADLINE_S / 10  # returned long before the deadline it would have waited


@pytest.mark.timeout(60)
def test_the_final_measurement_blocks_and_keeps_the_averaged_model(corpus):
    cfg = tiny_config("diloco", workers=2)
    hub = MemoryHub(2, HUB_DEADLINE_S)
    outs: list[list[dict]] = [[], []]
    monitors = [make_monitor(cfg, corpus, hub, rank, outs[rank]) for rank in range(2)]

    other = threading.Thread(target=monitors[1].record, args=(cfg.rounds, 0), kwargs={"val_loss": True, "final": True})
    other.start()
    try:
        record = monitors[0].record(cfg.rounds, 0, val_loss=True, final=True)
    finally:
        other.join(HUB_DEADLINE_S)
        for m in monitors:
            m.exchange.close()
            m.close()
    assert outs[0] == [record] and "monitor_cause" not in record and record["val_loss"] > 0
    params = [m.trainer.params_cpu() for m in monitors]
    for name, value in monitors[0].final_params.items():
        assert torch.allclose(value, (params[0][name] + params[1][name]) / 2, atol=1e-6)


@pytest.mark.slow  # eight tiny models
@pytest.mark.timeout(120)
def test_above_the_group_size_each_peer_reports_its_groups_estimate_of_the_swarm(corpus):
    """4 peers in buckets of at most 2 on average (seed 0 puts 0, 1, 2 together and 3 alone for ``monitor/0/0``):
    the group of 3 writes ``consensus_sample.estimate`` of its members' parameters (g = 3 of M = 4), the peer alone
    writes no value and says why."""
    cfg = tiny_config("diloco", workers=4)
    hub = MemoryHub(4, HUB_DEADLINE_S, seed=0, group_size=2)
    outs: list[list[dict]] = [[] for _ in range(4)]
    monitors = [make_monitor(cfg, corpus, hub, rank, outs[rank]) for rank in range(4)]
    try:
        for monitor in monitors:
            monitor.record(0, 0, val_loss=False)
        assert wait_until(lambda: written(monitors, outs, 1), HUB_DEADLINE_S)
    finally:
        for m in monitors:
            m.exchange.close()
            m.close()
    points = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.trainer.model.parameters()]) for m in monitors])
    want = cs.group_estimate(points, [0, 1, 2])
    for rank in (0, 1, 2):
        got = outs[rank][0]
        assert (got["cd_scope"], got["cd_group_size"], got["cd_swarm_size"]) == ("group", 3, 4)
        assert got["cd_l2_sq"] == pytest.approx(want["cd_l2_sq"], rel=1e-4)
        assert got["cd_l2"] == pytest.approx(want["cd_l2"], rel=1e-4)
    alone = outs[3][0]
    assert alone["cd_scope"] == "none" and "cd_l2" not in alone and "alone in its group" in alone["monitor_cause"]
