"""bench/netem.py's runs: one preset at one bandwidth (``Plan``), its peers' command lines, and a run of
M real peers on the shaped network measured against the simulator's prediction (``run_plan``)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.overrides import set_args
from testbed.peers import measured_overrides, predict, read_peer, run_swarm_key, start_dht_node
from testbed.processes import ProcessGroup, tail

if __package__:  # imported as bench.netem_runs (the repository root on sys.path, as under pytest)
    from bench.netem_network import PROBES, Network, process_group
else:  # bench/netem.py run as a script: bench/ is on sys.path
    from netem_network import PROBES, Network, process_group


# ---------------------------------------------------------------------------------------
# Presets


@dataclass
class Plan:
    """One preset at one bandwidth: its config overrides and the simulator's prediction."""

    preset: str
    bandwidth_mbps: float
    overrides: dict
    cfg: Any
    prediction: dict


def preset_overrides(preset: str, args: argparse.Namespace) -> dict:
    """The ``--set`` overrides of one preset's peers (also what the prediction loads)."""
    from gossiploco.cli_options import parse_sets

    return measured_overrides(
        preset, model=args.model, workers=args.workers, inner_steps=args.inner_steps, rounds=args.rounds,
        sync_dp_inner_steps=args.sync_dp_inner_steps, sync_dp_rounds=args.sync_dp_rounds, seq_len=args.seq_len,
        batch_size=args.batch_size, exchange_timeout_s=args.exchange_timeout_s, chunk_mb=args.chunk_mb,
        step_time_s=None if args.real_compute else args.step_time, sets=parse_sets(args.sets))


def make_plan(preset: str, bandwidth_mbps: float, args: argparse.Namespace) -> Plan:
    from gossiploco.config import load_config

    overrides = preset_overrides(preset, args)
    cfg = load_config(preset, overrides)
    return Plan(preset, bandwidth_mbps, overrides, cfg, predict(cfg, bandwidth_mbps, args.step_time))


def peer_command(net: Network, plan: Plan, rank: int, port: int, out_dir: Path, heartbeat_s: float = 0.0,
                 join: str | None = None) -> list[str]:
    """``ip netns exec PREFIX-pI python -m gossiploco peer ...``: found through the DHT at ``join``, else
    through the static list of every peer's address. Every peer uses the run's swarm key
    (``out_dir/swarm.key``, from ``run_swarm_key``); a DHT peer keeps its identity in
    ``out_dir/peer-I/identity.key`` (made by ``ordered_identities``: peer ids increase with the rank)."""
    key = ["--swarm-key", str(out_dir / "swarm.key")]
    if join:
        where = ["--join", join, "--host", net.address(rank), "--port", str(port), "--workers", str(net.peers),
                 "--identity", str(out_dir / f"peer-{rank}" / "identity.key"), *key]
    else:
        where = ["--peers", ",".join(f"tcp://{net.address(r)}:{port}" for r in range(net.peers)), *key]
    sets = set_args(plan.overrides, without=("workers",))  # the world size: --peers, or --workers with --join
    if heartbeat_s:
        sets += ["--set", f"timeouts.heartbeat_s={heartbeat_s}"]
    return [*net.exec_prefix(rank), sys.executable, "-m", "gossiploco", "peer", "--config", plan.preset,
            "--rank", str(rank), *where, "--out", str(out_dir / f"peer-{rank}"), "--quiet", *sets]


def start_bootstrap(net: Network, group: ProcessGroup, out_dir: Path, port: int, timeout_s: float = 60.0) -> str:
    """``gossiploco dht`` in peer 0's namespace with the run's swarm key (``out_dir/swarm.key``), logging to
    ``out_dir/bootstrap.log``; returns the multiaddr it prints for ``--join``."""
    return start_dht_node(group, out_dir / "bootstrap.log", host=net.address(0), port=port,
                          swarm_key=out_dir / "swarm.key", where=net.exec_prefix(0), timeout_s=timeout_s)[1]


def link_busy(path: Path, rate_mbit: float) -> dict | None:
    """From ``links.jsonl`` (switch port counters): how busy the links were while the run moved data.

    The window runs from the first to the last sample interval in which any port carried more than
    10% of the rate (start-up and the idle tail are left out). ``busy_pct``: bytes that crossed all
    2M directions / (2M x rate x window); ``per_direction``: the same per port and direction."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return None
    devs = sorted(k for k in rows[0] if k != "t") if rows else []
    if len(rows) < 3 or not devs:
        return None
    bytes_per_s = rate_mbit * 1e6 / 8
    active = [i for i in range(1, len(rows))
              if any(rows[i][d][k] - rows[i - 1][d][k] > 0.1 * bytes_per_s * (rows[i]["t"] - rows[i - 1]["t"])
                     for d in devs for k in (0, 1))]
    if not active:
        return None
    first, last = rows[active[0] - 1], rows[active[-1]]
    window = last["t"] - first["t"]
    per = {f"{d}.{'up' if k == 0 else 'down'}": 100 * (last[d][k] - first[d][k]) / (bytes_per_s * window)
           for d in devs for k in (0, 1)}
    return {"window_s": window, "busy_pct": statistics.mean(per.values()), "per_direction": per}


def run_plan(net: Network, plan: Plan, args: argparse.Namespace, out_dir: Path, port: int,
             goodput_mbps: float | None = None) -> dict:
    """M peers of ``plan`` on the shaped network; their measurements and the comparison."""
    net.flush_tcp_metrics()
    group = process_group(out_dir)
    timeout_s = args.startup_allowance_s + 3.0 * plan.prediction["wall_s"] * plan.cfg.rounds
    start = time.monotonic()
    sampler = process_group(out_dir)
    try:
        if args.sample_links:
            sampler.start([*net.exec_prefix(None), *PROBES, "sample", "--interval-s", str(args.sample_links),
                           "--seconds", str(timeout_s + 30), "--out", str(out_dir / "links.jsonl")],
                          out_dir / "sampler.log")
        run_swarm_key(out_dir)
        if args.discovery == "dht":
            from gossiploco.security.options import ordered_identities

            ordered_identities(net.peers, out_dir)  # out_dir/peer-I/identity.key, peer ids in rank order
        join = start_bootstrap(net, group, out_dir, port + 1) if args.discovery == "dht" else None  # stopped with the group
        peers = [group.start(peer_command(net, plan, rank, port, out_dir, args.heartbeat_timeout_s, join),
                             out_dir / f"peer-{rank}.log") for rank in range(net.peers)]
        codes = group.wait(timeout_s, peers)
    finally:
        group.stop()
        sampler.stop(grace_s=2)
    wall = time.monotonic() - start
    result: dict[str, Any] = {"preset": plan.preset, "bandwidth_mbps": plan.bandwidth_mbps, "exit_codes": codes,
                              "wall_s": wall, "overrides": plan.overrides, "out": str(out_dir)}
    if any(c != 0 for c in codes):
        bad = [r for r, c in enumerate(codes) if c != 0]
        result["error"] = (f"peers {bad} " + ("timed out" if None in codes else "failed") + f" (exit codes {codes}); "
                           f"log of peer {bad[0]}:\n{tail(out_dir / f'peer-{bad[0]}.log')}")
        return result
    peers = [read_peer(out_dir, r) for r in range(net.peers)]
    steps = plan.cfg.inner_steps * plan.cfg.rounds
    step_time = statistics.median(p["compute_s"] / steps for p in peers) if args.real_compute else args.step_time
    prediction = predict(plan.cfg, plan.bandwidth_mbps, step_time) if args.real_compute else plan.prediction
    utils = [100 * p["round_utilization"] for p in peers]
    predicted = 100 * prediction["compute_utilization"]
    measured = statistics.median(utils)
    result.update({
        "step_time_s": step_time,
        "predicted_pct": predicted,
        "measured_median_pct": measured,
        "measured_min_pct": min(utils),
        "measured_max_pct": max(utils),
        "diff_pts": measured - predicted,
        "pass": abs(measured - predicted) <= args.tolerance,
        "prediction": prediction,
        # Not the prediction: the simulator fed with what one TCP flow measurably gets out of the link
        # (payload rate, Ethernet/IP/TCP headers excluded), to separate framing from everything else.
        "predicted_at_goodput_pct": (100 * predict(plan.cfg, goodput_mbps, step_time)["compute_utilization"]
                                     if goodput_mbps else None),
        # Measured, with the seconds the peers spent in consensus monitors taken out of the rounds.
        "measured_without_monitor_pct": statistics.median(
            100 * p["compute_s"] / (p["rounds_s"] - p["monitor_s"]) for p in peers),
        "peers": peers,
        "failures": sum(sum(p["failures"].values()) for p in peers),
        "links": link_busy(out_dir / "links.jsonl", plan.bandwidth_mbps) if args.sample_links else None,
    })
    return result
