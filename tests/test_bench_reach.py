"""bench/reach.py: the relay-aware prediction, its options, and (root, namespaces) a short real run."""

from __future__ import annotations

import json

import pytest

from bench import reach  # the repository root is on sys.path (pyproject's pytest `pythonpath`)
from gossiploco.config import load_config
from gossiploco.mixing.operators import pair_matching
from test_nat_testbed import require_netns


def test_swarm_prediction_adds_a_mix2_in_the_rounds_that_pair_the_natted_peers():
    cfg = load_config(reach.PRESET, {"model.size": "small", "workers": 4, "inner_steps": 10, "rounds": 8,
                                     "inner.synthetic_step_s": 0.3, "monitor.enabled": False})
    ids = [11, 22, 33, 44]  # the last two are behind NAT
    got = reach.swarm_prediction(cfg, 50.0, 0.3, ids)
    want = [r for r in range(8) if pair_matching(cfg.seed, r, "mix2", ids)[33] == 44]
    assert got["relayed_rounds"] == want
    sim = got["simulator"]
    wall = 8 * sim["wall_s"] + len(want) * sim["mix2_attempt_s"]
    assert got["with_relay_pct"] == pytest.approx(100 * 8 * sim["compute_s"] / wall)
    assert got["plain_pct"] == pytest.approx(100 * sim["compute_utilization"])
    assert (got["with_relay_pct"] < got["plain_pct"]) == bool(want)


def test_one_payload_per_rate_is_required():
    with pytest.raises(SystemExit) as exc:
        reach.main(["--rates", "50,500", "--mb", "16"])
    assert exc.value.code == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_run_measures_each_path_and_leaves_nothing(tmp_path):
    require_netns()
    code = reach.main(["--rates", "50", "--mb", "1", "--repeats", "1", "--pings", "2", "--swarm-rate", "0",
                       "--prefix", "gntr", "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [p["path"] for p in results["pairs"]] == ["direct", "reverse", "relayed"]
    for p in results["pairs"]:
        assert "error" not in p, p.get("error")
        assert p["paths_seen"][0] == p["path"] and p["goodput_mbit"] > 0
        # CPU time comes in clock ticks (10 ms): one MiB over a direct path can cost less than one, so the
        # test checks that the count saw each peer's process, not that it is above zero
        assert p["cpu_s_per_gb"] >= 0, p
        for host in p["hosts"]:
            assert any(k.startswith(f"gntr-{host}/") for k in p["cpu_by_proc"]), (host, p["cpu_by_proc"])
    assert not reach.NatTestbed(prefix="gntr").namespaces()
