"""bench/late_peer_sim.py: the late, frozen and dead peer at 64 peers, each within its bound (slow: a few seconds)."""

from __future__ import annotations

import json

import pytest

from bench import late_peer_sim  # the repository root is on sys.path (pyproject's pytest `pythonpath`)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_late_frozen_or_dead_peer_costs_the_others_at_most_their_bound_at_64_peers(tmp_path):
    out = tmp_path / "late"
    assert late_peer_sim.main(["--peers", "64", "--rounds", "3", "--out", str(out)]) == 0
    rows = {row["variant"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"late", "frozen", "dead"} and not any(r["violations"] for r in rows.values())
    assert rows["late"]["max"] <= 1.05 and rows["dead"]["max"] <= 1.05  # in grace windows
    assert rows["frozen"]["led_by_it"] > 0 and 1.0 < rows["frozen"]["led_by_it_max"] <= 1.55  # its followers waited
    assert "Every bound held." in out.with_suffix(".md").read_text()
