"""bench/scale_real.py: the peer program on real processes (a short run), its summary and verdict, and the pieces it
stands on (the transport's control-message counter, the file barrier)."""

from __future__ import annotations

import pytest
import torch

from bench import scale_real  # the repository root is on sys.path (pyproject's pytest `pythonpath`)
from bench.scale_real_report import criterion, variant_name
from gossiploco.protocol.messages import Data, Decision, Hello, Ready
from gossiploco.transport.traffic import Traffic
from testbed.file_barrier import FileBarrier

ROUND_FIELDS = {"round_s", "blocking_s", "mix2_s", "mix1_wait_s", "mix1_s", "mix1_ok", "mix1_cause", "mix1_group",
                "mix2_ok", "mix2_group", "bytes_sent", "wire_sent", "bytes_received", "control_sent", "control_kinds",
                "connected", "dealers", "fds", "sockets", "rss", "pss", "threads"}


def test_traffic_counts_every_message_but_data_chunks_as_control():
    traffic = Traffic()
    frames = [b"header", b"x" * 16]
    traffic.sent(Ready("mix2/0", 0), frames)
    traffic.sent(Decision("mix2/0", 0, (1, 2)), frames)
    traffic.sent(Hello(0, 0), frames)
    traffic.sent(Data("mix2/0", 0, (4,), torch.zeros(4)), frames)
    assert traffic.control_sent == 3
    assert traffic.control_counts() == {"Ready": 1, "Decision": 1, "Hello": 1}
    assert traffic.payload_sent == 16 and traffic.wire_sent == 4 * 22


def test_file_barrier_opens_only_when_every_party_arrived(tmp_path):
    barrier = FileBarrier(tmp_path / "start", 2, poll_s=0.01)
    barrier.arrive(0, {"connected": 1})
    assert not barrier.wait(0.05)
    barrier.arrive(1)
    assert barrier.wait(0.05)
    assert barrier.notes() == {0: {"connected": 1}, 1: {}}


def test_inner_seconds_are_fixed_per_peer_and_within_the_spread():
    drawn = [scale_real.inner_seconds(3, rank, 1.0, 2.0) for rank in range(64)]
    assert drawn == [scale_real.inner_seconds(3, rank, 1.0, 2.0) for rank in range(64)]
    assert all(1.0 <= s <= 2.0 for s in drawn) and max(drawn) - min(drawn) > 0.5


def test_the_verdict_compares_the_medians_at_64_and_4_peers():
    runs = [{"peers": 4, "group_size": 16, "blocking_s": 0.4, "peers_done": 4},
            {"peers": 64, "group_size": 16, "blocking_s": 0.7, "peers_done": 64}]
    assert "MISSED" in criterion(runs) and "1.75x" in criterion(runs)
    runs[1]["blocking_s"] = 0.6
    assert ": met:" in criterion(runs)
    shared = {"peers": 64, "group_size": 16, "blocking_s": 0.1, "peers_done": 64, "pairing": "ready", "period_s": 3.0,
              "overshoot_s": 0.5}
    assert variant_name(shared) == "shared clock 3 s (+ up to 0.5 s), ready pairing"
    assert criterion(runs + [shared]).count(": met:") == 1  # no 4-peer run of its schedule: not judged
    verdict = criterion(runs + [shared, {**shared, "peers": 4, "peers_done": 4, "blocking_s": 0.05}])
    assert "ready pairing: MISSED: 0.10 s / 0.05 s = 2.00x" in verdict and ": met: 0.60 s / 0.40 s" in verdict


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_three_peer_processes_finish_every_round_and_record_each(tmp_path):
    payload = 3 * 1366  # three equal ring segments: every peer sends the same share
    summary = scale_real.run_swarm(3, tmp_path, rounds=2, payload=payload, inner=(0.1, 0.3))
    assert summary["problems"] == [] and summary["peers_done"] == 3, summary["problems"]
    assert summary["mix1_completion"] == 1.0 and summary["mix2_completion"] == 1.0
    ring = 2 * (3 - 1) * payload * 4 // 3  # a ring all-reduce of 3 sends 2 (M - 1) / M of the payload
    swap = payload * 4  # a matched gossip peer sends all of it; of 3, one is unmatched each round
    for rec in summary["records"]:
        assert rec["exit_code"] == 0 and rec["error"] is None and rec["all_finished"]
        assert [row["round"] for row in rec["rounds"]] == [0, 1]
        for row in rec["rounds"]:
            assert ROUND_FIELDS <= row.keys(), ROUND_FIELDS - row.keys()
            assert row["mix1_group"] == row["mix2_group"] == 3
            assert row["bytes_sent"] == ring + (swap if row["partner"] is not None else 0)
            assert row["connected"] == 2 and row["dealers"] == 4 and row["finite"]
            assert row["blocking_s"] == pytest.approx(row["mix2_s"] + row["mix1_wait_s"])
            assert row["round_s"] >= rec["inner_s"] + row["blocking_s"]
    assert sum(row["control_sent"] for rec in summary["records"] for row in rec["rounds"]) > 0
