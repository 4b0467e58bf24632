"""What the CLI prints about runs: plain progress lines at a bounded interval when the output is not a terminal,
and the swarm's final table (one row per peer, the shared validation loss once)."""

from __future__ import annotations

import io

from rich.console import Console

from gossiploco.cli_report import PLAIN_EVERY_S, PlainProgress, print_swarm_summary, progress_line
from gossiploco.runtime.swarm import PeerProgress


def test_plain_progress_prints_at_once_then_at_most_every_interval():
    now = [100.0]
    buffer = io.StringIO()
    plain = PlainProgress(Console(file=buffer, width=200), clock=lambda: now[0])
    printed = []
    for step in range(100):  # an update every 0.5 s for 50 s
        plain.update(f"step {step}")
        printed.append(buffer.getvalue().count("\n"))
        now[0] += 0.5
    lines = buffer.getvalue().splitlines()
    assert lines[0].endswith("step 0") and printed[0] == 1  # the first at once
    steps = [int(line.rsplit(" ", 1)[1]) for line in lines]
    assert all(b - a == PLAIN_EVERY_S / 0.5 for a, b in zip(steps, steps[1:]))  # then every PLAIN_EVERY_S, no more often
    assert len(lines) == 5


def test_progress_line_says_what_the_swarm_is_doing():
    progress = {r: PeerProgress(r) for r in range(3)}
    assert "3 peers starting" in progress_line(progress, 5)
    progress[0].record = {"round": 2, "loss": 3.0, "val_loss": 3.5}
    progress[1].record = {"round": 1, "loss": 4.0}
    progress[2].exit_code = 0
    assert progress_line(progress, 5) == "swarm: round 1/5, loss 3.500, val loss 3.500; 2 of 3 peers running"


def test_the_swarm_table_has_a_row_per_peer_and_the_shared_loss_once(capsys):
    def peer(rank, exit_code, **summary):
        base = {"rounds": 4, "workers": 3, "mix1_failures": 0, "mix2_failures": 0, "grad_failures": 0, "catchups": 0,
                "bytes_sent": 2e6, "compute_utilization": 0.9, "wall_s": 10.0}
        return {"rank": rank, "exit_code": exit_code, "summary": {**base, **summary} if summary is not None else None}

    summary = {"config": "diloco", "run_id": "diloco-abc", "finished": 2, "final_val_loss": 2.5, "final_val_loss_spread": 0.0,
               "per_peer": [peer(0, 0, mix2_failures=2, bytes_sent=5e6), peer(1, 0, catchups=1, compute_utilization=0.5),
                            {"rank": 2, "exit_code": 1, "summary": None}]}
    print_swarm_summary(summary)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 3 and len(set(rows)) == 3
    assert "5.0" in rows[0] and "2" in rows[0] and "50%" in rows[1] and "exit 1" in rows[2]
    assert out.count("final val loss 2.5000") == 1 and "one averaged model" in out


def test_plain_progress_also_prints_when_a_round_begins():
    now = [0.0]
    buffer = io.StringIO()
    plain = PlainProgress(Console(file=buffer, width=200), clock=lambda: now[0])
    for step in range(12):  # 0.1 s per step, 4 steps per round: far quicker than the interval
        plain.update(f"step {step}", milestone=step // 4)
        now[0] += 0.1
    assert [line.rsplit(" ", 1)[1] for line in buffer.getvalue().splitlines()] == ["0", "4", "8"]


def test_a_summary_counts_the_workers_that_took_part_not_the_configured_number():
    from gossiploco.config import load_config
    from gossiploco.runtime.common import make_summary

    cfg = load_config("diloco", {"workers": 4})
    records = [{"round": 0, "members": 2}, {"round": 1, "members": 3}, {"round": 2, "members": 3}]
    summary = make_summary(cfg, records, 2.0, 1.0)
    assert summary["workers"] == 3 and summary["configured_workers"] == 4
    assert make_summary(cfg, [{"round": 0}], 2.0, 1.0)["workers"] == 4  # the virtual swarm: all configured ones run
