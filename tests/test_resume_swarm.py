"""Resuming real peer processes: a whole swarm stopped with Ctrl+C and started again with --resume continues at
the same round with the same parameters; a peer killed outright and resumed rejoins, downloading the newer
state when the swarm went on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import tiny_peer_args, wait_until
from gossiploco.checkpoint import latest_checkpoint, run_checkpoints
from gossiploco.config import load_config
from gossiploco.data import load_corpus, validation_batches
from gossiploco.model import build_model
from gossiploco.runtime.launch import LocalPeers
from testbed.overrides import set_args
from test_peer import ENV, reached_round, records, summary

pytestmark = pytest.mark.slow  # real peer processes and DHT nodes

SETS = {"data.max_corpus_mb": 2.0, "data.seq_len": 32, "monitor.every": 0, "timeouts.startup_s": 30.0}


def swarm_command(out, *extra):
    sets = set_args(SETS)
    return [sys.executable, "-m", "gossiploco", "swarm", "-c", "globalm1-localm2", "--peers", "3", "--rounds", "30",
            "--inner-steps", "20", "--model", "tiny", *sets, "--out", str(out), *extra]


def peer_records(out, rank):
    return [json.loads(line) for line in (out / f"peer-{rank}" / "metrics.jsonl").read_text().splitlines()]


def val_loss_of_average(out, ranks, cfg) -> float:
    """The validation loss of the mean of the peers' checkpointed z (what the resumed swarm's first Mix1 averages)."""
    zs = [latest_checkpoint(run_checkpoints(out / f"peer-{r}")) for r in ranks]
    names = [k.removeprefix("w0/z/") for k in zs[0].tensors if k.startswith("w0/z/")]
    corpus = load_corpus(cfg.data)
    model = build_model(cfg.model.size, corpus.vocab_size, cfg.data.seq_len, cfg.seed)
    avg = {n: torch.stack([z.tensors[f"w0/z/{n}"] for z in zs]).mean(0) for n in names}
    model.load_state_dict(avg, strict=True)
    model.eval()
    with torch.no_grad():
        batches = validation_batches(corpus, cfg.data, cfg.seed)
        return sum(float(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in batches) / len(batches)


def run_until_round_3_and_ctrl_c(out, env) -> str:
    """Run the 3-peer swarm until each peer checkpointed round 3, then Ctrl+C it; its stderr."""
    proc = subprocess.Popen(swarm_command(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert wait_until(lambda: all((out / f"peer-{r}" / "checkpoints").is_dir() and
                                      latest_checkpoint(run_checkpoints(out / f"peer-{r}")) is not None
                                      and latest_checkpoint(run_checkpoints(out / f"peer-{r}")).round >= 3
                                      for r in range(3)), 240), "the swarm did not reach round 3"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 130
        return proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(420)
def test_a_whole_swarm_stopped_with_ctrl_c_restarts_with_resume_at_the_same_round(tmp_path):
    out = tmp_path / "swarm"
    env = {**os.environ, **ENV}
    err = run_until_round_3_and_ctrl_c(out, env)
    stopped = {r: latest_checkpoint(run_checkpoints(out / f"peer-{r}")).round for r in range(3)}
    assert max(stopped.values()) - min(stopped.values()) <= 1, stopped  # stopped together: one round apart at most
    for r in range(3):
        peer_summary = json.loads((out / f"peer-{r}" / "summary.json").read_text())
        assert peer_summary["interrupted"] and peer_summary["round_reached"] >= stopped[r], peer_summary
    stopped_swarm = json.loads((out / "summary.json").read_text())
    assert stopped_swarm["interrupted"] and stopped_swarm["val_loss_at_stop"] is not None  # no longer None
    cfg = load_config("globalm1-localm2", {"workers": 3, "rounds": 30, "inner_steps": 20, "model.size": "tiny", **SETS})
    expected = val_loss_of_average(out, range(3), cfg) if len(set(stopped.values())) == 1 else None

    again = subprocess.run(swarm_command(out, "--resume"), capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, (err[-2000:], again.stderr[-3000:])
    start = max(stopped.values())
    for r in range(3):
        recs = peer_records(out, r)
        rounds = [rec["round"] for rec in recs if rec["h"] == 0]
        assert rounds == sorted(set(rounds)) and rounds[-1] == 30, rounds  # no round twice, all the way to the end
        resumed = json.loads((out / f"peer-{r}" / "summary.json").read_text())
        assert resumed["resumed_from"] == stopped[r] and not resumed.get("interrupted"), resumed
        first = next(rec for rec in recs if rec["round"] == start and rec["h"] == 0)
        if expected is not None:  # the swarm's first average after the restart is that of the checkpoints
            assert first["val_loss"] == pytest.approx(expected, rel=1e-5), (first, expected)
        assert resumed["catchups"] == (1 if stopped[r] < start else 0), resumed
    swarm = json.loads((out / "summary.json").read_text())
    assert swarm["finished"] == 3 and swarm["final_val_loss_spread"] == 0.0


@pytest.mark.timeout(300)
def test_a_swarm_stopped_across_a_round_boundary_resumes_without_waiting_and_each_peer_behind_catches_up_once(tmp_path):
    """Ctrl+C can fall across a round boundary (the test above allows one round between the peers, and a loaded
    machine gives it: seen in a full suite). Made certain here: after the stop, peers 0 and 1 lose their newest
    checkpoint, so they resume a round before peer 2. Peer 2 takes them as members of its round and goes on; they
    had waited out the whole start-up timeout (30 s) for it at their round, started without it, and caught up twice
    each in the disorder that followed. Now its news that it takes part from the next round makes them take its
    state at once: one catch-up each, none for peer 2, no wait for a quorum."""
    out = tmp_path / "swarm"
    env = {**os.environ, **ENV}
    run_until_round_3_and_ctrl_c(out, env)
    top = max(latest_checkpoint(run_checkpoints(out / f"peer-{r}")).round for r in range(3))
    for r in (0, 1):
        for path in (out / f"peer-{r}" / "checkpoints").glob(f"round-{top:06d}.*"):
            path.unlink()
    stopped = {r: latest_checkpoint(run_checkpoints(out / f"peer-{r}")).round for r in range(3)}
    assert stopped == {0: top - 1, 1: top - 1, 2: top}, stopped

    again = subprocess.run(swarm_command(out, "--resume"), capture_output=True, text=True, timeout=240, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    for r in range(3):
        resumed = json.loads((out / f"peer-{r}" / "summary.json").read_text())
        assert resumed["resumed_from"] == stopped[r], resumed
        assert resumed["catchups"] == (1 if r < 2 else 0), resumed
        log = (out / f"peer-{r}.log").read_text()
        assert "after waiting" not in log, [line for line in log.splitlines() if "after waiting" in line]
    swarm = json.loads((out / "summary.json").read_text())
    assert swarm["finished"] == 3


@pytest.mark.timeout(300)
def test_a_killed_peer_resumed_from_its_checkpoint_downloads_the_state_of_a_swarm_that_went_on(tmp_path, bootstrap):
    """The swarm has more rounds than the test waits for, and is stopped with Ctrl+C once the resumed peer has caught
    up and trained on: with a fixed number of rounds the survivors could finish before the resumed peer is up (it ran
    alone then, with nothing to download: seen once in CI)."""
    args = tiny_peer_args("globalm1-localm2", rounds=100_000, inner_steps=40,
                          **{"monitor.every": 0, "timeouts.startup_s": 30.0})
    with LocalPeers(3, tmp_path, args, env=ENV, join=bootstrap.address, swarm_key=bootstrap.swarm_key) as peers:
        peers.start()
        assert wait_until(lambda: reached_round(peers, 2, 4), 150), peers.log(2)[-2000:]
        peers.signal(2, signal.SIGKILL)  # no goodbye, no checkpoint on the way out: the last periodic one stays
        assert peers.wait(30, [2])[2] == -signal.SIGKILL
        saved = latest_checkpoint(run_checkpoints(peers.peer_dir(2))).round
        assert wait_until(lambda: reached_round(peers, 0, saved + 2), 120)  # the swarm goes on without it
        peers.per_rank[2] = ["--resume"]
        peers.start([2])
        went_on = max(rec["round"] for rec in records(peers, 0))
        assert wait_until(lambda: "caught up from peer" in peers.log(2) and reached_round(peers, 2, went_on + 2), 180), \
            peers.log(2)[-3000:]
        for rank in range(3):
            peers.signal(rank, signal.SIGINT)
        codes = peers.wait(60)
    assert codes == {0: 130, 1: 130, 2: 130}, (codes, peers.log(2)[-3000:])
    resumed = summary(peers, 2)
    assert resumed["resumed_from"] == saved and resumed["catchups"] >= 1 and resumed["bytes_received"] > 0, resumed
    rounds = [rec["round"] for rec in records(peers, 2) if rec["h"] == 0]
    assert rounds == sorted(set(rounds)) and rounds[-1] >= went_on + 2, rounds
