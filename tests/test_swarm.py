"""Membership over the real hivemind DHT with real peer processes on loopback: a late joiner,
crash and freeze together, a restarted bootstrap node, two runs on one DHT, graceful leave, and
the ``gossiploco swarm`` main job end to end."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from conftest import tiny_peer_args, wait_until
from gossiploco.cli_report import PLAIN_EVERY_S
from gossiploco.runtime.launch import LocalPeers
from gossiploco.transport.fault_injection import FAULT_ENV
from test_peer import ENV, assert_exit, model, reached_round, records, relative_error, summary, wait_stopped

pytestmark = pytest.mark.slow  # real peer processes and DHT nodes, tens of seconds each


@pytest.mark.timeout(240)
def test_a_peer_that_joins_at_round_k_catches_up_and_ends_in_consensus(tmp_path, bootstrap):
    # Rounds long enough (72 real inner steps, about 1.3 s here) that the swarm is still training when the
    # newcomer is up (about 13 s after it starts), and that downloading the state at a round boundary takes
    # a small part of a round: with 0.43 s rounds the newcomer once began its first round most of a round
    # late, was left out of the next round's exchanges as a straggler and (by design) caught up again.
    # Mix1 compressed against its reference (the last mean): the newcomer, which holds none, must cost the others
    # no failed Mix1 (its groups differ from the ones their references were made by, so everyone sends fp32 once).
    # Directory reads paced as a swarm of 3,000 would pace them (one a minute: ``read_pacing``), so the founders read
    # the newcomer's record in time only because its refused connections knock.
    args = tiny_peer_args("globalm1-localm2", rounds=30, inner_steps=72,
                          **{"monitor.every": 0, "timeouts.startup_s": 3.0, "mix1.compression": "4bit",
                             "timeouts.discovery_records_per_s": 0.05})
    with LocalPeers(4, tmp_path, args, env=ENV, join=bootstrap.address, swarm_key=bootstrap.swarm_key) as peers:
        peers.start([0, 1, 2])  # they wait 3 s for a fourth, then start without it
        assert wait_until(lambda: reached_round(peers, 0, 2), 120), peers.log(0)[-2000:]
        peers.start([3])
        codes = peers.wait(200)
    assert_exit(peers, codes, range(4))
    log = peers.log(3)
    assert "joined a running swarm; caught up from peer" in log, log[-3000:]
    first = records(peers, 3)[0]
    assert first["round"] >= 3 and first["catchup_from"] in [peers.peer_id(r) for r in (0, 1, 2)]
    assert summary(peers, 3)["catchups"] == 1, [line for line in log.splitlines() if "peer:" in line][-10:]
    finals = [model(peers, r) for r in range(4)]
    assert all(relative_error(f, finals[0]) == 0.0 for f in finals)  # one averaged model, newcomer included
    for rank in range(4):
        assert records(peers, rank)[-1]["members"] == 4
    for rank in range(3):  # the newcomer never blocked the others, nor failed their compressed Mix1
        assert summary(peers, rank)["mix1_failures"] + summary(peers, rank)["mix2_failures"] <= 2
        assert summary(peers, rank)["directory_reads"]["early"] >= 1, summary(peers, rank)["directory_reads"]
        assert "(another reference)" not in peers.log(rank), peers.log(rank)[-3000:]


@pytest.mark.timeout(240)
def test_a_killed_peer_and_a_frozen_peer_while_the_rest_finish(tmp_path, bootstrap):
    args = tiny_peer_args("globalm1-localm2", rounds=5, **{"transport.chunk_mb": 0.004, "timeouts.exchange_s": 60.0})
    with LocalPeers(4, tmp_path, args, env=ENV, join=bootstrap.address, swarm_key=bootstrap.swarm_key) as peers:
        # Mix1 is global (every member sends its chunk 0); Mix2 pairs 3 live members, so one sits a round out
        peers.start(env={1: {FAULT_ENV: "KILL:mix1/1:2"}, 2: {FAULT_ENV: "STOP:mix1/2:0"}})
        codes = peers.wait(180, ranks=[0, 1, 3])
        assert wait_stopped(peers.procs[2].pid, 1), ("the frozen peer must still exist, stopped", codes,
                                                     *(peers.log(r)[-2500:] for r in (0, 2, 3)))
    assert codes[1] == -signal.SIGKILL
    assert_exit(peers, codes, [0, 3])
    for rank in (0, 3):
        s = summary(peers, rank)
        assert s["rounds"] == 5 and s["wall_s"] < 90, "faults are detected, not waited out (exchange_s = 60)"
        assert records(peers, rank)[-1]["members"] == 2, [peers.log(r)[-2500:] for r in (0, 3)]
    assert relative_error(model(peers, 0), model(peers, 3)) == 0.0


@pytest.mark.timeout(240)
def test_a_restarted_bootstrap_node_does_not_stop_a_running_swarm(tmp_path):
    from gossiploco.membership.bootstrap import start_bootstrap
    from gossiploco.runtime.launch import free_ports

    from gossiploco.security.swarm_key import SwarmKey

    identity, key = tmp_path / "bootstrap.key", SwarmKey.generate()
    key_file = key.save(tmp_path / "swarm.key")
    port = free_ports(1)[0]
    dht, addresses = start_bootstrap("127.0.0.1", port, identity_file=identity, swarm=key)
    args = tiny_peer_args("globalm1-localm2", rounds=60, inner_steps=24, **{"monitor.every": 0, "timeouts.startup_s": 3.0})
    try:
        with LocalPeers(4, tmp_path, args, env=ENV, join=addresses[0], swarm_key=key_file) as peers:
            peers.start([0, 1, 2])
            assert wait_until(lambda: reached_round(peers, 0, 1), 120), peers.log(0)[-2000:]
            dht.shutdown()  # the bootstrap node goes away mid-run ...
            assert wait_until(lambda: reached_round(peers, 0, 2), 120), "the swarm stopped without its bootstrap node"
            dht, again = start_bootstrap("127.0.0.1", port, identity_file=identity, swarm=key)  # ... and comes back
            assert again == addresses, "same identity file and port: the same address"
            peers.start([3])  # a newcomer finds the running swarm through the restarted node
            codes = peers.wait(200)
    finally:
        dht.shutdown()
    assert_exit(peers, codes, range(4))
    assert "caught up from peer" in peers.log(3)
    assert records(peers, 0)[-1]["members"] == 4


@pytest.mark.timeout(240)
def test_two_runs_on_one_dht_never_mix(tmp_path, bootstrap):
    args = tiny_peer_args("globalm1-localm2", rounds=3)
    args += ["--new-run"]  # two runs in one swarm on purpose (else whichever starts second is refused, its settings differing)
    with LocalPeers(2, tmp_path / "a", [*args, "--run-id", "run-a"], env=ENV, join=bootstrap.address, swarm_key=bootstrap.swarm_key) as a, \
            LocalPeers(2, tmp_path / "b", [*args, "--run-id", "run-b", "--set", "seed=1"], env=ENV, join=bootstrap.address, swarm_key=bootstrap.swarm_key) as b:
        a.start()
        b.start([10, 11])
        codes_a, codes_b = a.wait(180), b.wait(180)
    assert_exit(a, codes_a, [0, 1])
    assert_exit(b, codes_b, [10, 11])
    for peers, ranks, run in ((a, (0, 1), "run-a"), (b, (10, 11), "run-b")):
        for rank in ranks:
            s = summary(peers, rank)
            assert s["run_id"] == run and s["malformed_messages"] == 0
            assert all(r["members"] == 2 for r in records(peers, rank))
    assert relative_error(model(a, 0), model(a, 1)) == 0.0 and relative_error(model(b, 10), model(b, 11)) == 0.0
    assert relative_error(model(a, 0), model(b, 10)) > 1e-3


@pytest.mark.timeout(120)
def test_ctrl_c_makes_a_peer_leave_and_the_others_drop_it_at_once(tmp_path, bootstrap):
    args = tiny_peer_args("globalm1-localm2", rounds=40, **{"monitor.every": 0, "timeouts.exchange_s": 60.0})
    args.remove("--quiet")  # a goodbye is routine news, logged at info level, which --quiet leaves out
    with LocalPeers(3, tmp_path, args, env=ENV, join=bootstrap.address, swarm_key=bootstrap.swarm_key) as peers:
        peers.start()
        assert wait_until(lambda: reached_round(peers, 0, 2), 90), peers.log(0)[-2000:]
        peers.signal(2, signal.SIGINT)
        assert peers.wait(20, ranks=[2])[2] == 130
        left = f"peer {peers.peer_id(2)} left"
        assert wait_until(lambda: left in peers.log(0) and left in peers.log(1), 10)
        codes = peers.wait(150, ranks=[0, 1])
    assert_exit(peers, codes, [0, 1])
    assert records(peers, 0)[-1]["members"] == 2
    assert summary(peers, 0)["wall_s"] < 100


@pytest.mark.timeout(240)
def test_swarm_command_runs_the_main_job_and_writes_summaries(tmp_path):
    import os
    import time

    out = tmp_path / "swarm"
    # Output to a pipe, as with `| tee` or a log file: progress must still show, at least every PLAIN_EVERY_S
    proc = subprocess.Popen([sys.executable, "-m", "gossiploco", "swarm", "--peers", "3", "--rounds", "2", "--inner-steps", "3",
                             "--model", "tiny", "--set", "data.max_corpus_mb=2.0", "--set", "data.seq_len=32",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV})
    try:
        stderr_lines = [(time.monotonic(), line) for line in proc.stderr]  # ends when the swarm closes stderr
        stdout = proc.stdout.read()
        assert proc.wait(timeout=220) == 0, "".join(line for _, line in stderr_lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = "".join(line for _, line in stderr_lines)
    progress = [t for t, line in stderr_lines if "swarm:" in line]
    assert progress and "swarm: round" in stderr, stderr
    times = [t for t, _ in stderr_lines]
    assert max(b - a for a, b in zip(times, times[1:])) < PLAIN_EVERY_S + 5, stderr  # never silent for long
    # A healthy run warns about nothing: not in the swarm's output, not in any peer's log
    for text in [stderr, stdout] + [(out / f"peer-{rank}.log").read_text() for rank in range(3)]:
        assert "WARN" not in text, text[-3000:]
    # The final table: one row per peer, then the shared validation loss once
    assert stdout.count("final val loss") == 1 and "one averaged model" in stdout, stdout
    assert "catch-ups" in stdout and all(re.search(rf"│\s+{rank} │\s+done", stdout) for rank in range(3)), stdout
    swarm = json.loads((out / "summary.json").read_text())
    assert swarm["peers"] == 3 and swarm["finished"] == 3 and not swarm["interrupted"]
    assert swarm["workers"] == 3 == swarm["configured_workers"]
    assert swarm["final_val_loss_spread"] == 0.0  # one averaged model
    for rank in range(3):
        assert (out / f"peer-{rank}" / "summary.json").exists() and (out / f"peer-{rank}" / "model.safetensors").exists()


@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_whole_swarm_cleanly(tmp_path):
    import os

    out = tmp_path / "swarm"
    proc = subprocess.Popen([sys.executable, "-m", "gossiploco", "swarm", "--peers", "2", "--rounds", "500", "--model", "tiny",
                             "--set", "data.max_corpus_mb=2.0", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    try:
        assert wait_until(lambda: (out / "peer-0" / "metrics.jsonl").exists(), 120), "the swarm did not start training"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    swarm = json.loads((out / "summary.json").read_text())
    assert swarm["interrupted"] and swarm["finished"] == 0
    logs = {p.name: p.read_text(errors="replace")[-4000:] for p in sorted(out.glob("peer-*.log"))}  # stacks of a stuck one
    assert all(p["exit_code"] == 130 for p in swarm["per_peer"]), (swarm["per_peer"], logs)  # each left on its SIGINT
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert leftover == [], "no peer process outlives the swarm"
