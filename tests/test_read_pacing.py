"""``membership.read_pacing``: a running peer reads its run's records at most ``records_per_s`` a second on average
(every ``discovery_s`` in small runs, as before), and ``discovery_s`` after its last read when a newcomer's key
knocks; a stranger knocking all the time gets what every peer did before, a read every ``discovery_s``."""

from __future__ import annotations

import pytest

from gossiploco.config import ConfigError, RunConfig
from gossiploco.membership.read_pacing import ReadPacing


def reads_over(pacing: ReadPacing, members: int, seconds: float, knocks_at=lambda t: 0, tick_s: float = 2.0) -> list[float]:
    """The times the discovery loop (a tick every ``tick_s``) reads in ``seconds``, with ``members`` records."""
    times, t = [], 0.0
    while t <= seconds:
        knocks = knocks_at(t)
        if pacing.due(t, knocks):
            pacing.read(t, members, knocks)
            times.append(t)
        t += tick_s
    return times


@pytest.mark.parametrize("members", [4, 16, 64, 256, 1000, 10_000])
def test_records_read_a_second_stay_within_the_bound_and_small_runs_read_every_period(members):
    pacing = ReadPacing(every_s=2.0, records_per_s=32.0)
    hour = 3600.0  # an hour of ticks
    times = reads_over(pacing, members, hour)
    gaps = [b - a for a, b in zip(times, times[1:])]
    if members <= 64:
        assert len(times) == hour / 2.0 + 1  # every tick: what a small run always did
    else:  # members / gap records a second: at most 32, and no fewer than a tick's rounding makes it
        assert all(members / 32.0 <= gap < members / 32.0 + 2.0 for gap in gaps), gaps[:5]
    assert pacing.early_reads == 0


def test_a_knock_brings_the_next_read_to_one_period_after_the_last_and_no_sooner():
    pacing = ReadPacing(every_s=2.0, records_per_s=32.0)
    assert pacing.interval_s(1000) == 31.25
    assert pacing.due(0.0, 0)
    pacing.read(0.0, 1000, 0)
    assert not pacing.due(1.0, 1)  # knocked, but a period has not passed
    assert pacing.due(2.0, 1)  # a newcomer waits a period, as it did before
    pacing.read(2.0, 1000, 1)
    assert not pacing.due(4.0, 1) and not pacing.due(33.0, 1)  # the same knock does not count twice
    assert pacing.due(33.25, 1)
    assert pacing.reads == 2 and pacing.early_reads == 1


def test_a_stranger_knocking_all_the_time_gets_a_read_every_period_never_more():
    pacing = ReadPacing(every_s=2.0, records_per_s=32.0)
    times = reads_over(pacing, 1000, 600.0, knocks_at=lambda t: int(t * 10), tick_s=0.5)
    assert all(b - a >= 2.0 for a, b in zip(times, times[1:]))
    assert len(times) == 300 + 1


def test_the_setting_is_checked():
    cfg = RunConfig()
    assert cfg.timeouts.discovery_records_per_s == 32.0
    cfg.timeouts.discovery_records_per_s = 0.0
    with pytest.raises(ConfigError, match="discovery_records_per_s"):
        cfg.timeouts.check("timeouts")
    with pytest.raises(ValueError):
        ReadPacing(every_s=2.0, records_per_s=0.0)


def test_an_awaited_offer_makes_reads_due_every_period_while_it_is_awaited():
    pacing = ReadPacing(every_s=2.0, records_per_s=32.0)
    pacing.read(0.0, 1000, 0)
    assert not pacing.due(2.0, 0) and pacing.due(2.0, 0, urgent=True) and not pacing.due(1.9, 0, urgent=True)
    pacing.read(2.0, 1000, 0)
    assert pacing.counts() == {"reads": 2, "early": 1}
