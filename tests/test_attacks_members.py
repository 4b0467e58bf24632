"""bench/attacks_members.py: its verdicts, LocalPeers' open runs, and (slow) its smallest case end to end."""

from __future__ import annotations

import json
import math

import pytest

from bench import attacks_members as members  # the repository root is on sys.path (pyproject's pytest `pythonpath`)
from gossiploco.runtime.launch import LocalPeers


def row(suite="virtual", variant="plain", case="none", losses=(2.0,), uploaded=(), error=""):
    return members.Row(suite, "globalm1-localm2", variant, case, list(losses), list(uploaded), error=error)


def judged(*rows: members.Row) -> dict[str, str]:
    table = {r.key: r for r in rows}
    members.judge(table)
    return {f"{r.variant} {r.case}": r.verdict for r in rows}


def test_a_case_holds_up_to_the_harm_limit_and_an_improvement_costs_nothing():
    verdicts = judged(row(), row(case="sign:1", losses=(2.0 * 1.049,)), row(case="alie:4", losses=(2.0 * 1.051,)),
                      row(case="noise:10", losses=(1.5,)), row(case="scale:1000", losses=(float("nan"),)),
                      row(case="replay:1", error="RuntimeError: boom"))
    assert verdicts == {"plain none": "baseline", "plain sign:1": "held", "plain alie:4": "FAILED",
                        "plain noise:10": "held", "plain scale:1000": "FAILED", "plain replay:1": "FAILED"}


def test_the_worst_honest_peer_decides_and_a_missing_loss_fails():
    base = row("real", losses=(2.0, 2.0, 2.0))
    assert judged(base, row("real", case="weight:1000", losses=(2.0, 2.0, 2.2)))["plain weight:1000"] == "FAILED"
    assert judged(base, row("real", case="sign:1", losses=(2.0, None, 2.0)))["plain sign:1"] == "FAILED"


def test_robust_attack_free_costs_at_most_one_percent_against_plain():
    assert judged(row(), row(variant="robust", losses=(2.0 * 1.009,)))["robust none"] == "cost +0.90%: held"
    assert judged(row(), row(variant="robust", losses=(2.0 * 1.011,)))["robust none"] == "cost +1.10%: FAILED"
    # each variant's attacks are judged against its own attack-free run
    assert judged(row(), row(variant="robust", losses=(2.2,)),
                  row(variant="robust", case="sign:1", losses=(2.2,)))["robust sign:1"] == "held"


def test_a_state_flood_fails_on_uploads_and_is_reported_when_not_run():
    base = row("real", losses=(2.0,) * 3, uploaded=(100,) * 3)
    allowed = row("real", case="state_flood:5", losses=(2.0,) * 3, uploaded=(100 + 11,) * 3)
    allowed.flood_allowance = 30  # the limit lets the flooder take 30 bytes: 3 x 11 extra is within 1.1 x 30
    assert judged(base, allowed)["plain state_flood:5"] == "held"
    over = row("real", case="state_flood:5", losses=(2.0,) * 3, uploaded=(100 + 12,) * 3)
    over.flood_allowance = 30
    assert judged(base, over)["plain state_flood:5"] == "FAILED"
    assert judged(base, row("real", case="state_flood:5", error="not run: no module"))["plain state_flood:5"] == "not run"


def test_the_plain_variant_sets_robust_off_where_robust_mixing_exists():
    if members.robust_available():
        assert members.variant_overrides("plain") == {"robust.mode": "off"}
        assert members.variant_overrides("robust") == {"robust.mode": "on"}
    else:
        assert members.variant_overrides("plain") == {}
        with pytest.raises(SystemExit, match="no robust section"):
            members.variant_overrides("robust")


def test_local_peers_of_an_open_run_pass_open_and_no_swarm_key(tmp_path):
    peers = LocalPeers(2, tmp_path, join="/ip4/127.0.0.1/tcp/1/p2p/x", open_run=True)
    cmd = peers.command(1)
    assert "--open" in cmd and "--swarm-key" not in cmd and not (tmp_path / "swarm.key").exists()
    private = LocalPeers(2, tmp_path / "private", join="/ip4/127.0.0.1/tcp/1/p2p/x").command(1)
    assert "--open" not in private and "--swarm-key" in private
    with pytest.raises(ValueError, match="open_run"):
        LocalPeers(2, tmp_path, open_run=True)  # a static list has no open runs


@pytest.mark.slow
def test_the_smallest_case_end_to_end_finds_a_scaled_update(tmp_path):
    """Attack-free and x1000 in both suites, two rounds: the real suite's attacker is the one dishonest peer."""
    results = tmp_path / "members.md"
    argv = ["--variant", "plain", "--only", "scale", "--presets", "globalm1-localm2", "--virtual-rounds", "2",
            "--real-rounds", "2", "--out", str(tmp_path / "runs"), "--results", str(results)]
    assert members.main(argv) == 1  # plain averaging does not hold against x1000
    rows = {(r["suite"], r["case"]): r for r in json.loads(results.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {("virtual", "none"), ("virtual", "scale:1000"), ("real", "none"), ("real", "scale:1000")}
    for suite in ("virtual", "real"):
        base, attacked = rows[suite, "none"], rows[suite, "scale:1000"]
        assert base["verdict"] == "baseline" and not base["error"], base
        assert attacked["verdict"] == "FAILED" and not attacked["error"], attacked
        assert all(math.isfinite(x) for x in base["losses"]) and min(attacked["losses"]) > 2 * max(base["losses"])
    assert len(rows["real", "none"]["losses"]) == 3 and all(rows["real", "none"]["uploaded"])
    logs = tmp_path / "runs" / "real" / "plain" / "scale"
    assert "DISHONEST PEER" in (logs / "peer-3.log").read_text()
    assert not any("DISHONEST" in (logs / f"peer-{r}.log").read_text() for r in range(3))
    text = results.read_text()
    assert "`python bench/attacks_members.py " + " ".join(argv) + "`" in text
    assert "| globalm1-localm2 | plain | scale:1000 |" in text
