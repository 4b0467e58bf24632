"""A collective's chunk arithmetic (``protocol.chunk_math``): torch's results bit for bit, on the calling thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gossiploco.protocol import chunk_math

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("divisor", [2, 3, 4, 7, 10, 64, 1000])
def test_the_ring_s_sums_and_means_are_torch_s_bit_for_bit(divisor):
    # IEEE 754 addition and division are correctly rounded element by element, so numpy's float32 results must
    # equal torch's exactly (no tolerance): a sum of chunk + received, then its mean by the member count.
    g = torch.Generator().manual_seed(divisor)
    mine = torch.randn(1 << 16, generator=g) * 1e3
    theirs = torch.randn(1 << 16, generator=g)
    assert torch.equal(chunk_math.add_(mine.clone(), theirs), mine.clone().add_(theirs))
    assert torch.equal(chunk_math.div_(mine.clone(), divisor), mine.clone().div_(divisor))
    pair = chunk_math.div_(chunk_math.add_(mine.clone(), theirs), 2)
    assert torch.equal(pair, (mine + theirs) / 2)
    into = torch.empty_like(mine)
    assert chunk_math.copy_(into, theirs) is into and torch.equal(into, theirs)


def test_what_numpy_cannot_view_goes_through_torch():
    bf16 = torch.randn(1000).to(torch.bfloat16)
    assert torch.equal(chunk_math.add_(bf16.clone(), bf16), bf16 + bf16)
    assert torch.equal(chunk_math.div_(bf16.clone(), 3), bf16 / 3)
    mixed = torch.zeros(1000, dtype=torch.float64)
    assert torch.equal(chunk_math.add_(mixed, torch.ones(1000)), torch.ones(1000, dtype=torch.float64))
    shaped = torch.zeros(10, 100)
    assert torch.equal(chunk_math.copy_(shaped, torch.ones(10, 100)), torch.ones(10, 100))


def test_a_received_chunk_is_reduced_without_starting_a_team_of_threads():
    # torch runs an op over a 4 MiB chunk on a team of OpenMP threads made for the thread that asks, left spinning
    # between ops (a peer's all-reduce took 2.3x as long, bench/results/chunk-math.md). Counted in a fresh process:
    # the threads that appear while a new thread feeds a pair mean one received chunk (the ring's path: add, then
    # divide), then while another runs torch's own add on the same chunk.
    code = textwrap.dedent("""
        import os, threading, torch
        from gossiploco.protocol.collectives import PairMean
        from gossiploco.protocol.messages import Data
        torch.set_num_threads(2)
        n = 1 << 20
        mine, theirs = torch.randn(n), torch.randn(n)
        expected = (mine + theirs) / 2
        mean = PairMean("mix2", 0, 1, mine, n, 0.0, 1e9)
        made = {}
        def run(name, op):
            before = len(os.listdir("/proc/self/task"))
            op()
            made[name] = len(os.listdir("/proc/self/task")) - before
        for name, op in [("feed", lambda: mean.feed(Data("mix2", 0, (n, 0, 0), theirs))),
                         ("torch", lambda: theirs.add_(mine))]:
            t = threading.Thread(target=run, args=(name, op))
            t.start()
            t.join(60)
        assert torch.equal(mean.outcome(), expected)
        print(made["feed"], made["torch"])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    ours, torch_s = map(int, done.stdout.split())
    if torch_s == 0:
        pytest.skip("this torch build runs an elementwise op without a team of threads: nothing to compare with")
    assert ours == 0
