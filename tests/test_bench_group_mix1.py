"""bench/group_mix1.py: its summary against the definitions (fast) and a one-round run of it (slow)."""

from __future__ import annotations

import json
import math

import pytest

from bench import group_mix1  # the repository root is on sys.path (pyproject's pytest `pythonpath`)
from gossiploco.protocol import groups


def run(size: int, seed: int, loss: float, cd: float) -> group_mix1.Run:
    return group_mix1.Run(workers=16, size=size, seed=seed, final_val_loss=loss, cd_l2_last=cd, cd_l2_final=cd,
                          mix1_failures=0, mix2_failures=0, mix1_bytes=0.0, wall_s=1.0)


def test_the_summary_pairs_each_seed_with_the_global_run_and_states_the_papers_factors():
    runs = [run(16, 0, 2.0, 1.0), run(16, 1, 3.0, 2.0), run(16, 2, 2.5, 1.0),
            run(8, 0, 2.2, 1.5), run(8, 1, 3.0, 2.0), run(8, 2, 2.5, 1.2)]
    glob, grouped = group_mix1.summarize(runs, 16, [16, 8])
    assert glob["config"] == "global" and glob["rho1"] == 0.0 and glob["ratio_final_val_loss"] == 1.0
    assert glob["F"] == pytest.approx(1 + groups.gossip_rho(16, 16))  # eq. 27 with rho1 = 0
    assert grouped["config"] == "groups of 8"
    assert grouped["ratio_final_val_loss"] == pytest.approx(1.0)  # median of 1.1, 1.0, 1.0
    assert grouped["ratio_cd_l2_last"] == pytest.approx(1.2)  # median of 1.5, 1.0, 1.2
    assert grouped["median_final_val_loss"] == 2.5
    rho1, rho2 = groups.mean_rho(16, 8), groups.gossip_rho(16, 8)
    assert grouped["F"] == pytest.approx(1 + rho2 / (1 - rho1))
    assert grouped["cd_l2_bound_ratio"] == pytest.approx(math.sqrt(rho2 / (1 - rho1) / groups.gossip_rho(16, 16)))


def test_a_group_size_below_two_is_refused():
    with pytest.raises(SystemExit) as exc:
        group_mix1.main(["--sizes", "1"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_a_one_round_run_writes_both_configurations(tmp_path):
    out = tmp_path / "g.md"
    assert group_mix1.main(["--workers", "4", "--sizes", "2", "--seeds", "0", "--rounds", "1", "--inner-steps", "1",
                            "--last", "1", "--results", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [row["config"] for row in data["summary"]] == ["global", "groups of 2"]
    assert data["summary"][1]["rho1"] == pytest.approx(groups.mean_rho(4, 2))
    assert all(r["mix1_failures"] == 0 and math.isfinite(r["final_val_loss"]) for r in data["runs"])
    assert "--sizes 2" in out.read_text()
