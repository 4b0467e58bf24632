"""bench/gossip_swap.py: an odd number of peers refused (fast) and a small run whose every result it checked (slow)."""

from __future__ import annotations

import pytest

from bench import gossip_swap  # the repository root is on sys.path (pyproject's pytest `pythonpath`)


def test_an_odd_number_of_peers_is_refused():
    with pytest.raises(SystemExit) as exc:
        gossip_swap.main(["--peers", "3"])
    assert exc.value.code == 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_small_run_checks_every_result_and_reports_each_collective(tmp_path):
    out = tmp_path / "swap.md"
    gossip_swap.main(["--peers", "2", "--values", "300_001", "--reps", "2", "--out", str(out)])
    rows = {line.split("|")[1].strip(): line for line in out.read_text().splitlines() if line.startswith("| ")}
    assert set(gossip_swap.KINDS) <= set(rows)
    assert rows["ring"].split("|")[4].strip() == "1.00"  # the ring against itself
    assert "a swap takes 1.00 of the ring here" in out.read_text()  # 2 peers: the same bytes
