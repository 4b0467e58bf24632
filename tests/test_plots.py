"""``gossiploco plot``: windowed statistics against a direct computation, PNG output for one and
several runs with missing fields, and clear errors for unusable run directories."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from gossiploco import plots
from gossiploco.cli import app
from gossiploco.errors import ConfigError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_records(rounds=6, inner_steps=10, every=2, seed=0):
    """Records shaped like a simulate run's: no loss in the first, val_loss at round starts only,
    CD_JS missing in some records and null (non-finite) in one."""
    rng = np.random.default_rng(seed)
    records = []
    for r in range(rounds + 1):
        for h in range(0, inner_steps if r < rounds else 1, every):
            step = r * inner_steps + h
            rec = {"round": r, "h": h, "step": step, "cd_l2": float(rng.uniform(0.1, 1.0)), "cd_l2_sq": 0.5}
            if step:
                rec["loss"] = 5.0 * math.exp(-step / 30) + 0.1 * float(rng.random())
            if h == 0:
                rec["val_loss"] = 5.0 * math.exp(-step / 30)
            if step % 6 != 4:
                rec["cd_js"] = float(rng.uniform(0.0, 0.3))
            records.append(rec)
    records[3]["cd_js"] = None
    return records


def write_run(path, records, summary=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 20_000  # a drawn figure, not an empty canvas


def run_cli(args):
    return CliRunner().invoke(app, ["plot", *map(str, args)])


def flat(text):
    return "".join(text.split())  # rich wraps long paths; compare without whitespace


@pytest.mark.timeout(10)
@pytest.mark.parametrize("window", [1, 2, 3, 5, 50])
def test_windowed_stats_match_a_direct_computation(window):
    values = list(np.random.default_rng(window).normal(size=23))
    med, lo, hi = plots.windowed_stats(values, window)
    for i in range(len(values)):
        chunk = np.array(values[max(0, i - window + 1) : i + 1])
        assert med[i] == pytest.approx(float(np.median(chunk)), rel=0, abs=1e-15)
        assert lo[i] == chunk.min() and hi[i] == chunk.max()
    assert plots.windowed_stats([], window) == ([], [], [])


@pytest.mark.timeout(10)
def test_windowed_stats_small_example_and_bad_window():
    assert plots.windowed_stats([3.0, 1.0, 2.0, 5.0], 2) == ([3.0, 2.0, 1.5, 3.5], [3.0, 1.0, 1.0, 2.0], [3.0, 3.0, 2.0, 5.0])
    with pytest.raises(ConfigError, match="--window: must be >= 1"):
        plots.windowed_stats([1.0], 0)


@pytest.mark.timeout(60)
def test_one_run_writes_a_png(tmp_path):
    run = write_run(tmp_path / "run", synthetic_records())
    result = run_cli([run, "--window", "4"])
    assert result.exit_code == 0, result.output
    assert_png(run / "metrics.png")  # the default output


@pytest.mark.timeout(10)
def test_series_skip_missing_and_null_fields(tmp_path):
    records = synthetic_records()
    run = plots.load_run(write_run(tmp_path / "run", records))
    steps, values = run.series("cd_js")
    assert steps == [r["step"] for r in records if r.get("cd_js") is not None]
    assert values == [r["cd_js"] for r in records if r.get("cd_js") is not None]
    assert run.series("loss")[0][0] == records[1]["step"]
    assert run.series("val_loss")[0] == [r["step"] for r in records if r["h"] == 0]
    assert run.series("nothing") == ([], [])


@pytest.mark.timeout(60)
def test_several_runs_side_by_side(tmp_path):
    a = write_run(tmp_path / "a", synthetic_records(seed=1), {"config": "globalm1"})
    b = write_run(tmp_path / "b", synthetic_records(rounds=4, seed=2))
    c = write_run(tmp_path / "c", [{"round": 0, "h": 0, "step": 0}])  # a run with nothing measured yet
    out = tmp_path / "figs" / "compare.png"
    result = run_cli([a, b, c, "--out", out])
    assert result.exit_code == 0, result.output
    assert_png(out)
    assert [plots.load_run(p).label for p in (a, b)] == ["a (globalm1)", "b"]


@pytest.mark.timeout(60)
def test_same_named_runs_get_their_parent_in_the_legend(tmp_path):
    runs = [plots.load_run(write_run(tmp_path / swarm / "peer-0", synthetic_records(seed=i))) for i, swarm in enumerate(("x", "y"))]
    out = plots.plot_runs(runs, tmp_path / "peers.png", window=3)
    assert [r.label for r in runs] == ["x/peer-0", "y/peer-0"]
    assert_png(out)


@pytest.mark.timeout(30)
def test_errors_name_the_problem(tmp_path):
    missing = run_cli([tmp_path / "nope"])
    assert missing.exit_code == 2 and "nosuchrundirectory" in flat(missing.output)

    (tmp_path / "empty_dir").mkdir()
    no_metrics = run_cli([tmp_path / "empty_dir"])
    assert no_metrics.exit_code == 2 and "nometrics.jsonl" in flat(no_metrics.output)

    empty = write_run(tmp_path / "empty", [])
    result = run_cli([empty])
    assert result.exit_code == 2 and "norecords(emptyfile)" in flat(result.output)

    bad = write_run(tmp_path / "bad", [{"round": 0, "h": 0, "step": 0}])
    with (bad / "metrics.jsonl").open("a") as f:
        f.write('{"round": 0, "h": 2, "step": 2, "cd_js": 0.1\n')
    result = run_cli([bad])
    assert result.exit_code == 2
    assert "metrics.jsonl:2:malformedJSON" in flat(result.output)

    not_object = write_run(tmp_path / "list", [{"round": 0, "h": 0, "step": 0}])
    with (not_object / "metrics.jsonl").open("a") as f:
        f.write("\n[1, 2]\n")
    result = run_cli([not_object])
    assert result.exit_code == 2 and "metrics.jsonl:3:expectedaJSONobject,gotlist" in flat(result.output)

    no_step = write_run(tmp_path / "nostep", [{"round": 0, "h": 0}])
    result = run_cli([no_step])
    assert result.exit_code == 2 and "metrics.jsonl:1:recordhasnointeger'step'field" in flat(result.output)

    good = write_run(tmp_path / "good", synthetic_records())
    result = run_cli([good, "--window", "0"])
    assert result.exit_code == 2 and "--window: must be >= 1" in " ".join(result.output.split())
    assert not (good / "metrics.png").exists()


@pytest.mark.timeout(60)
def test_a_swarm_directory_plots_every_peer(tmp_path):
    swarm = tmp_path / "swarm"
    for rank in (1, 0, 10):  # peer order is numeric, not the directory listing's
        write_run(swarm / f"peer-{rank}", synthetic_records(seed=rank))
    (swarm / "peer-3").mkdir()  # a peer that wrote nothing yet is left out
    (swarm / "summary.json").write_text("{}")
    result = run_cli([swarm])
    assert result.exit_code == 0, result.output
    assert_png(swarm / "metrics.png")
    assert [r.path.name for r in plots.load_runs([swarm])] == ["peer-0", "peer-1", "peer-10"]
