"""``bench/page_faults.py`` runs both sets of peers, reports each, and writes its table."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc's thresholds are glibc's")
def test_a_short_run_compares_the_thresholds_with_glibcs_defaults(tmp_path):
    out = tmp_path / "faults.md"
    run = subprocess.run([sys.executable, "-m", "bench.page_faults", "--peers", "2", "--values", "2000000", "--reps", "2",
                          "--rounds", "1", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("reuse: ") and "(reused: [True];" in line for line in lines), run.stdout
    assert any(line.startswith("defaults: ") and "(reused: [False];" in line for line in lines), run.stdout
    table = out.read_text()
    assert "| reuse |" in table and "| defaults |" in table and "defaults / reuse, per alternation:" in table
