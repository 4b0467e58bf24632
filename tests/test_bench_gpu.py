"""bench/gpu.py on the CPU (CI has no GPU): its throughput rows, its peers' accounting, its report."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import gpu  # the repository root is on sys.path (pyproject's pytest `pythonpath`)
from gossiploco.config import load_config
from gossiploco.utilization import comm_plan, report, resolve_scenario, simulate


def test_shapes_and_peaks_are_read_as_documented():
    assert gpu.parse_shape("16x2048:ckpt")[:2] == (16, 2048) and gpu.parse_shape("16x2048:ckpt")[2].checkpoint_activations
    assert gpu.parse_shape("64x1024:mb16")[2].micro_batch_size == 16
    with pytest.raises(SystemExit, match="unknown option"):
        gpu.parse_shape("8x8:fast")
    assert gpu.detect_peak_tflops(torch.device("cpu")) is None
    # "H100 PCIe" must not be read as an SXM H100: the more specific name comes first.
    names = list(gpu.PEAK_BF16_TFLOPS)
    assert names.index("H100 PCIe") < names.index("H100") and names.index("A10G") < names.index("A10")


def test_throughput_rows_time_eager_and_tuned_side_by_side_and_compute_mfu(capsys):
    args = argparse.Namespace(sizes=["tiny"], shapes="4x32,4x32:mb2:ckpt", precision="fp32",
                                                      steps=2, repeats=2, warmup=1)
    rows = gpu.throughput_rows(args, torch.device("cpu"), peak_tflops=1.0)
    assert [(r["shape"], r["variant"]) for r in rows] == [("4x32", "eager"), ("4x32", "tuned"),
                                                          ("4x32:mb2:ckpt", "eager"), ("4x32:mb2:ckpt", "tuned")]
    for r in rows:
        assert r["ms"] > 0 and r["tokens_per_s"] == pytest.approx(4 * 32 / (r["ms"] / 1000))
        assert r["mfu"] == pytest.approx(6 * r["params"] * r["tokens_per_s"] / 1e12)  # 6N FLOPs per token
        assert r["mfu_attn"] > r["mfu"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cpu_run_measures_peers_against_the_simulator_and_writes_the_report(tmp_path):
    out = tmp_path / "gpu.md"
    gpu.main(["--device", "cpu", "--sizes", "tiny", "--shapes", "4x32", "--steps", "2", "--repeats", "1", "--warmup", "1",
              "--presets", "diloco,globalm1-localm2", "--rounds", "3", "--inner-steps", "4", "--peer-shape", "2x32",
              "--out", str(out)])
    text = out.read_text()
    assert "## Inner-step throughput" in text
    assert "| tiny | 0M | 4x32 | eager |" in text and "| tiny | 0M | 4x32 | tuned |" in text
    table = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith(("| diloco |", "| globalm1-localm2 |"))]
    assert sorted((row[0].strip(), int(row[1])) for row in table) == [(p, r) for p in ("diloco", "globalm1-localm2")
                                                                      for r in range(4)]
    for row in table:
        utilization, predicted = (float(row[i].strip().rstrip("%")) for i in (4, 5))
        assert 0 < utilization <= 100 and 0 < predicted <= 100
        assert float(row[8]) >= 0 and 0 <= float(row[9].strip().rstrip("%")) < 100  # other s, other %
    assert "from diloco's median Mix2" in text
    ends = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith(("| landed |", "| host |"))]
    assert [e[0].strip() for e in ends] == ["landed", "host"] and all(float(e[2]) > 0 for e in ends)


def test_the_prediction_is_the_simulators_for_the_measured_step_and_link():
    cfg = load_config("globalm1-localm2", {"model.size": "tiny", "inner_steps": 10})
    run = {"cfg": cfg, "step_s": 0.05, "peers": [{}] * 4}
    plan = comm_plan(cfg, gpu.VOCAB)
    sc = resolve_scenario(cfg, bandwidth_mbps=100.0, vocab_size=gpu.VOCAB, step_time_s=0.05, workers=4)
    assert gpu.predict(run, 100.0) == report(plan, sc, simulate(plan, sc))["compute_utilization"]
