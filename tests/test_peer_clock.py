"""A peer's time accounting: every second of a round is computing, measuring, blocked, or other."""

from __future__ import annotations

import pytest

from gossiploco.runtime.peer_clock import PeerClock


def test_a_rounds_seconds_split_into_ticked_blocked_and_other_and_add_up_everywhere():
    clock = PeerClock()
    clock.add("startup_s", 2.0)
    clock.begin_round()
    clock.tick("compute_s", 3.0)
    clock.tick("monitor_s", 0.5)
    assert clock.take_record() == {"compute_s": 3.0, "monitor_s": 0.5}  # a record mid-round
    clock.tick("compute_s", 1.0)
    clock.add("mix2_s", 1.2)
    assert clock.end_round(0, 6.0, {"mix1_wait_s": 0.0, "mix2_s": 1.2}) == pytest.approx(0.3)
    clock.begin_round()
    clock.tick("compute_s", 4.0)
    clock.add("grad_s", 0.5)
    assert clock.end_round(1, 4.6, {"grad_s": 0.5}) == pytest.approx(0.1)
    clock.add("rounds_s", 10.6)
    assert clock.take_record() == {"compute_s": 5.0, "monitor_s": 0.0}
    s = clock.summary(wall_s=16.0)
    assert [t["round"] for t in s["round_times"]] == [0, 1]
    assert s["round_times"][0] == pytest.approx({"round": 0, "s": 6.0, "compute_s": 4.0, "monitor_s": 0.5,
                                                 "mix1_wait_s": 0.0, "mix2_s": 1.2, "other_s": 0.3})
    assert s["total_compute_s"] == 8.0 and s["total_other_s"] == pytest.approx(0.4) and s["total_startup_s"] == 2.0
    assert s["round_utilization"] == pytest.approx(8.0 / 10.6) and s["compute_utilization"] == 0.5
    assert s["other_fraction"] == pytest.approx(0.4 / 10.6)
    # Every round's seconds are accounted for.
    for t in s["round_times"]:
        assert sum(v for k, v in t.items() if k not in ("round", "s")) == pytest.approx(t["s"])


def test_a_peer_that_never_trained_reports_zeros_not_a_division_error():
    s = PeerClock().summary(wall_s=0.0)
    assert s["compute_utilization"] == s["round_utilization"] == s["other_fraction"] == 0.0 and s["round_times"] == []
