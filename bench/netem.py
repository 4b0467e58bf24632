"""Real peers on shaped links: measured compute utilization against the simulator's prediction.

For each bandwidth B this benchmark builds a small private network out of Linux network
namespaces, runs M real ``gossiploco peer`` processes on it (one per namespace), and compares each
peer's measured compute utilization with ``gossiploco utilization``'s prediction for the same step
time, payload and bandwidth.

Topology (every name starts with ``--prefix``, default ``gln``; nothing is added to the root
namespace)::

    namespace PREFIX-sw:  bridge br0 with ports p0 .. p{M-1}          (the "switch")
    namespace PREFIX-pI:  eth0 = 10.77.0.{I+1}/24, veth peer of PREFIX-sw's pI   (peer I)

Each peer's access link is shaped to B in both directions with ``tc``: an HTB class of rate B on
the egress of the peer-side veth (upload) and on the egress of the switch-side veth (download),
so a peer has B up and B down (full duplex, the simulator's link). Under each class a FIFO of
``--queue-packets`` (1000, Linux's default queue length); ``--delay-ms`` / ``--loss-pct`` put a
netem qdisc there instead (both directions, so the round trip is twice the delay; needs sch_netem
in the kernel, else exit 2). tc counts whole Ethernet frames: at MTU 1500 a TCP flow carries at
most 1448 / 1514 = 95.6% of B as payload, which the simulator does not model (it sends payload at
exactly B); the table also shows the simulator fed with the measured TCP goodput, for comparison.

TCP congestion control in the peer namespaces (``--congestion-control``): ``auto`` takes cubic
(Linux's default) when the host allows it, else reno. BBR, the host's default on the machine the
results were taken on, gets only about 72% of B for the project's ring all-reduce on these links
(each ring step is a short burst that BBR paces below the link rate; reno gets 95%), so it is not
the default here; ``--congestion-control inherit`` measures with it.

ZeroMQ heartbeats (``--heartbeat-timeout-s``): the runtime drops a connection when no whole
message arrives within ``timeouts.heartbeat_s`` (5 s) of a heartbeat (libzmq counts complete
messages, not bytes). On these slow shared links a 4 MiB chunk, or a TCP flow stalled by drops, can
take longer, so healthy connections are dropped and exchanges fail (results/utilization.md has the
evidence). The option sets ``timeouts.heartbeat_s`` for the peers (and the swap probe), as a user on
such a link would; 0 (default) keeps the runtime's default. ``--swap-mb`` shows the drop in isolation.

Discovery (``--discovery``): ``dht`` (default) runs a bootstrap node (``gossiploco dht``) in peer 0's
namespace and starts every peer with ``--join`` it, as users do; ``static`` gives them the list.
Peers are always encrypted (CurveZMQ): each run gets a fresh swarm key (``RUN/swarm.key``, passed
with ``--swarm-key`` to the peers and to the bootstrap node) and, with ``dht``, identity files
``RUN/peer-I/identity.key`` whose peer ids increase with I (``--identity``).

Per bandwidth it runs, in order:

1. a raw TCP stream p0 -> p1 (probe ``tcp-server`` / ``tcp-client``): the goodput one flow gets;
2. the ring all-reduce of the model's payload among the M peers (probe ``ring``, the project's
   ``ZmqExchange.all_reduce_mean``): effective rate ``2 (M-1)/M * bytes * 8 / seconds`` against B.
   ``--ring-security plain,curve`` times it over both transports, alternating repeat by repeat in the
   same processes: ``plain`` is ``ZmqExchange(trust=None)`` (plaintext, kept for benchmarks), ``curve``
   is ``trust=Trust.static(swarm key, rank, M)`` (CurveZMQ, what ``gossiploco peer`` always runs);
   the table then compares the two (what encryption costs on the link);
3. with ``--swap-mb MB``, the heartbeat check (probe ``swap``): p0 and p1 swap MB with
   ``ZmqExchange.swap`` in ``--chunk-mb`` chunks, with the peers' heartbeat timeout
   (``--heartbeat-timeout-s``, else the runtime's). It shows whether a healthy connection survives
   one chunk's time on the wire: ``--bandwidths 5 --swap-mb 8`` fails with the runtime's 5 s and
   passes with ``--heartbeat-timeout-s 60`` or ``--chunk-mb 1`` (see "ZeroMQ heartbeats" above);
4. every preset (``--presets``, default all of ``peers/``): M peers, each started as
   ``ip netns exec PREFIX-pI python -m gossiploco peer --rank I --join BOOTSTRAP --swarm-key RUN/swarm.key
   --identity RUN/peer-I/identity.key --host 10.77.0.I+1``.
   By default an inner step is a sleep of ``--step-time`` seconds (``inner.synthetic_step_s``: the
   machine's CPU may be shared, a sleep is not slowed down by it; the communication is real).
   ``--real-compute`` runs the model's real inner steps instead, and the prediction then uses the
   measured seconds per step. Training-time monitors are off (``monitor.enabled = false``) except
   for ``globalm1-adaptive``, which needs them (``monitor.every = 0``: one measurement, i.e. one
   blocking all-reduce of the parameters, per round; the simulator does not model it).

Measured utilization of a peer = ``round_utilization`` of its summary.json: seconds computing
inner steps / seconds of the training rounds (start-up and the final measurement excluded). The
table gives the median over the peers and their min-max; a row passes when the median is within
``--tolerance`` points (default 5) of the prediction. The prediction is
``gossiploco.utilization.simulate`` with N = the model's real parameter count, the preset's real
Mix1/Mix2 block fractions, M, H, T and B; outer-step time 0 (the simulator's default).

Safety: needs root (namespaces and tc need CAP_NET_ADMIN), ``ip`` and ``tc``; when it cannot run it
says why and exits 2. Only addresses in 10.77.0.0/24 inside its own namespaces are used. Namespaces
are removed on every exit path (try/finally; SIGINT, SIGTERM and SIGHUP are turned into a clean
stop; a second Ctrl+C during the clean-up is ignored), and leftovers of a crashed earlier run with the
same prefix are removed at start (their processes killed by pid first). A lock file keeps two runs
with the same prefix apart. Every wait has a deadline; peer processes get SIGINT, then SIGKILL.

    sudo .venv/bin/python bench/netem.py --heartbeat-timeout-s 60   # every preset at 16 and 60 Mbit/s
    sudo .venv/bin/python bench/netem.py --presets diloco,globalm1 --bandwidths 20 --rounds 3
    sudo .venv/bin/python bench/netem.py --real-compute --presets globalm1-localm2 --bandwidths 60
    sudo .venv/bin/python bench/netem.py --presets none --bandwidths 50,200,1000 --ring-security plain,curve \
        --ring-repeats 7                                       # what encryption costs on the link (ring probe)
    sudo .venv/bin/python bench/netem.py --workers 2 --bandwidths 5 --presets none --tcp-seconds 0 \
        --ring-repeats 0 --swap-mb 8                           # the heartbeat drop alone (then: --heartbeat-timeout-s 60)
    .venv/bin/python bench/netem.py --predict-only             # the predictions only (no root needed)
    sudo .venv/bin/python bench/netem.py --cleanup             # remove leftovers of a crashed run

Exit codes: 0 ran (misses are reported, not failures; ``--strict`` makes a miss exit 1), 1 a run
broke (a peer failed or timed out), 2 cannot run here, 130 interrupted. Output: ``--out``
(default runs/netem): results.json (everything, per peer), table.md, and per run the peers' logs,
metrics.jsonl and summary.json; ``--sample-links 0.1`` adds every switch port's byte counters
over time (links.jsonl).

The network is the test bed's (``testbed.netns.Star``, links shaped by ``testbed.links``). The
probes run as ``python -m testbed.probes KIND ...`` inside the namespaces, one process per namespace
(``python -m testbed.probes KIND --help``): ``ring``, ``swap``, ``tcp-server`` / ``tcp-client`` (one
raw TCP stream, no ZeroMQ: what a single flow gets out of the shaped link) and ``sample`` (in the
switch namespace: every port's byte counters at an interval, JSON lines).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from testbed import netns
from testbed.links import qdisc_text, shape_links
from testbed.machine import cpu_model
from testbed.netns import PREFIX_RE, Star, Unavailable, preflight, prefix_lock, remove_namespaces, sh
from testbed.overrides import set_args
from testbed.peers import measured_overrides, predict, read_peer, run_swarm_key, start_dht_node
from testbed.probes import RING_PORT, TCP_PORT
from testbed.processes import ProcessGroup, child_env, tail

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_PREFIX = "gln"
SUBNET = "10.77.0"
"""Peer I gets 10.77.0.{I+1}/24 (a private range; only inside this benchmark's namespaces)."""
PEER_PORT = 7100
SWAP_PORT = 6950
STOP_GRACE_S = 10.0
"""After SIGINT a process gets this long to leave before SIGKILL."""
EXIT_UNAVAILABLE = 2
PROBES = [sys.executable, "-m", "testbed.probes"]
"""The link probes' command (run from the repository root, in a namespace)."""


# ---------------------------------------------------------------------------------------
# The network


class Network(Star):
    """``peers`` namespaces joined by a bridge in a switch namespace, each access link shaped (module docstring)."""

    def __init__(self, prefix: str, peers: int, mtu: int = 1500):
        if not 1 <= peers <= 200:
            raise ValueError(f"peers must be in 1..200, got {peers}")
        super().__init__(prefix, range(peers), lambda rank: f"{SUBNET}.{rank + 1}", mtu=mtu)
        self.peers = peers
        self.shaping: dict = {}

    def shape(self, rate_mbit: float, delay_ms: float = 0.0, loss_pct: float = 0.0, queue_packets: int = 1000) -> None:
        """Rate ``rate_mbit`` (10^6 bit/s of Ethernet frames) on every link in both directions, a FIFO of
        ``queue_packets`` (Linux's default txqueuelen is 1000), plus netem delay/loss. Replaces any
        earlier shaping."""
        shape_links(self.links(), rate_mbit, delay_ms, loss_pct, queue_packets, self.mtu)
        self.shaping = {"rate_mbit": rate_mbit, "delay_ms": delay_ms, "loss_pct": loss_pct, "queue_packets": int(queue_packets)}

    def set_congestion_control(self, name: str) -> str:
        """TCP congestion control of every peer namespace (``testbed.netns.set_congestion_control``)."""
        return netns.set_congestion_control([self.ns(r) for r in self.ranks], name)

    def flush_tcp_metrics(self) -> None:
        """Forget what TCP learnt about each destination (before each run, so runs do not depend on their order)."""
        for rank in self.ranks:
            sh(["ip", "-n", self.ns(rank), "tcp_metrics", "flush", "all"], check=False)

    def qdisc_text(self, rank: int = 0) -> str:
        """``tc qdisc show`` and ``tc class show`` of peer ``rank``'s two directions, for the record."""
        return qdisc_text([("upload", self.ns(rank), "eth0"), ("download", self.switch, f"p{rank}")])


def process_group(out_dir: Path) -> ProcessGroup:
    """The processes of one probe or run: each in its own session, started from the repository root (so
    ``-m testbed.probes`` is found), interrupted like Ctrl+C and killed ``STOP_GRACE_S`` later."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return ProcessGroup(env=child_env(), cwd=ROOT, ctrl_c=True, grace_s=STOP_GRACE_S)

# ---------------------------------------------------------------------------------------
# Probes of the link


def probe_tcp(net: Network, out_dir: Path, seconds: float) -> dict:
    """One raw TCP stream from peer 0 to peer 1: its goodput."""
    group = process_group(out_dir)
    result_path = out_dir / "tcp.json"
    result_path.unlink(missing_ok=True)
    try:
        group.start([*net.exec_prefix(1), *PROBES, "tcp-server", "--host", net.address(1), "--port", str(TCP_PORT),
                     "--out", str(result_path), "--timeout-s", "60"], out_dir / "tcp-server.log")
        group.start([*net.exec_prefix(0), *PROBES, "tcp-client", "--host", net.address(1), "--port", str(TCP_PORT),
                     "--seconds", str(seconds), "--timeout-s", "60"], out_dir / "tcp-client.log")
        codes = group.wait(seconds + 90)
    finally:
        group.stop()
    if codes != [0, 0] or not result_path.exists():
        raise RuntimeError(f"TCP probe failed (exit codes {codes}):\n{tail(out_dir / 'tcp-server.log')}\n{tail(out_dir / 'tcp-client.log')}")
    return json.loads(result_path.read_text())


SECURITIES = ("plain", "curve")
"""Transports the ring probe can time: ``plain`` (``ZmqExchange(trust=None)``, plaintext, kept for
benchmarks) and ``curve`` (``trust=Trust.static(swarm key, rank, M)``: CurveZMQ, what ``gossiploco
peer`` always runs)."""


def probe_ring(net: Network, out_dir: Path, numel: int, repeats: int, timeout_s: float, chunk_mb: float = 4.0,
               security: Sequence[str] = ("plain",)) -> dict:
    """The project's ring all-reduce of ``numel`` fp32 among all peers, ``repeats`` times per transport in
    ``security`` (``SECURITIES``). With several, every probe process holds one exchange per transport
    (ports RING_PORT, RING_PORT + 1) and times them alternately, repeat by repeat (the order swaps each
    repeat), so load and link state affect both alike. ``durations_s``: the first transport's."""
    security = list(security)
    group = process_group(out_dir)
    paths = [out_dir / f"ring-{r}.json" for r in range(net.peers)]
    key = ["--swarm-key", str(run_swarm_key(out_dir))] if "curve" in security else []
    try:
        for r, path in enumerate(paths):
            path.unlink(missing_ok=True)
            group.start([*net.exec_prefix(r), *PROBES, "ring", "--rank", str(r),
                         "--hosts", ",".join(net.address(q) for q in range(net.peers)), "--port", str(RING_PORT),
                         "--numel", str(numel), "--repeats", str(repeats), "--timeout-s", str(timeout_s),
                         "--chunk-mb", str(chunk_mb), "--security", ",".join(security), *key, "--out", str(path)],
                        out_dir / f"ring-{r}.log")
        codes = group.wait(timeout_s * (len(security) * repeats + 2) + 60)
    finally:
        group.stop()
    if any(c != 0 for c in codes) or not all(p.exists() for p in paths):
        logs = "\n".join(tail(out_dir / f"ring-{r}.log", 5) for r in range(net.peers))
        raise RuntimeError(f"ring probe failed (exit codes {codes}):\n{logs}")
    sides = [json.loads(p.read_text()) for p in paths]
    by: dict[str, dict] = {}
    for mode in security:
        per_rank = [side["seconds_by_security"][mode] for side in sides]
        # One collective's duration: the slowest rank of that repeat (all ranks started after a barrier).
        by[mode] = {"seconds_per_rank": per_rank, "durations_s": [max(rank[k] for rank in per_rank) for k in range(repeats)],
                    # CPU seconds of one all-reduce, median over ranks and repeats (the probe process, all threads).
                    "cpu_s": statistics.median(c for side in sides for c in side.get("cpu_s_by_security", {}).get(mode, []))
                    if all(side.get("cpu_s_by_security") for side in sides) else None}
    first = by[security[0]]
    return {"numel": numel, "payload_bytes": 4 * numel, "seconds_per_rank": first["seconds_per_rank"],
            "durations_s": first["durations_s"], "security": security, "by_security": by}


def probe_swap(net: Network, out_dir: Path, mb: float, chunk_mb: float, heartbeat_s: float = 0.0,
               timeout_s: float = 120.0) -> dict:
    """The heartbeat check: peers 0 and 1 swap ``mb`` MB with ``ZmqExchange.swap`` in ``chunk_mb`` MiB
    chunks, with heartbeat timeout ``heartbeat_s`` (0: the runtime's). A failed swap is a result, not
    an error: ``{"ok": False, "error": ...}``; an error is a probe that did not report at all."""
    group = process_group(out_dir)
    peers = f"tcp://{net.address(0)}:{SWAP_PORT},tcp://{net.address(1)}:{SWAP_PORT}"
    paths = [out_dir / f"swap-{r}.json" for r in range(2)]
    try:
        for r, path in enumerate(paths):
            path.unlink(missing_ok=True)
            group.start([*net.exec_prefix(r), *PROBES, "swap", "--rank", str(r), "--peers", peers,
                         "--mb", str(mb), "--chunk-mb", str(chunk_mb), "--heartbeat-s", str(heartbeat_s),
                         "--timeout-s", str(timeout_s), "--out", str(path)], out_dir / f"swap-{r}.log")
        codes = group.wait(2 * timeout_s + 60)
    finally:
        group.stop()
    if any(c != 0 for c in codes) or not all(p.exists() for p in paths):
        logs = "\n".join(tail(out_dir / f"swap-{r}.log", 5) for r in range(2))
        raise RuntimeError(f"swap probe failed (exit codes {codes}):\n{logs}")
    sides = [json.loads(p.read_text()) for p in paths]
    return {"mb": mb, "chunk_mb": chunk_mb, "heartbeat_s": sides[0]["heartbeat_s"], "ok": all(s["ok"] for s in sides),
            "seconds": max(s.get("seconds") or 0.0 for s in sides), "sides": sides}


def ring_rate_mbps(payload_bytes: float, workers: int, seconds: float) -> float:
    """Effective per-link rate of a ring all-reduce: ``2 (M-1)/M * payload * 8 / seconds`` in Mbit/s."""
    return 2 * (workers - 1) / workers * payload_bytes * 8 / seconds / 1e6


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


# ---------------------------------------------------------------------------------------
# Reports


def last_round_pct(r: dict) -> float | None:
    """Median over peers of the last round's utilization: compute per round / (compute per round + the
    last round's Mix1 wait, Mix2 and outer step). Leaves out round 0, whose start the peers reach at
    different moments (whoever connects last starts last, and round 0's first exchange waits for it)."""
    if r["prediction"]["mode"] != "factored":
        return None
    rounds, values = r["overrides"]["rounds"], []
    for p in r["peers"]:
        last, compute = p["last_round"], p["compute_s"] / rounds
        blocked = sum(last.get(k) or 0.0 for k in ("mix1_wait_s", "mix2_s", "outer_s"))
        values.append(100 * compute / (compute + blocked))
    return statistics.median(values)


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['preset']} | {r['bandwidth_mbps']:g} | | | | | error | | | | {r['error'].splitlines()[0]} |"
    pred = r["prediction"]
    mix1_ratio = pred["mix1_attempt_s"] / pred["compute_s"] if pred["mix1_attempt_s"] else 0.0
    notes = []
    mon = statistics.median(p["monitor_s"] for p in r["peers"])
    if mon > 0.01:
        notes.append(f"monitor all-reduce {100 * mon / statistics.median(p['rounds_s'] for p in r['peers']):.0f}% of "
                     f"round time; without it {r['measured_without_monitor_pct']:.1f}%")
    goodput, last = r.get("predicted_at_goodput_pct"), last_round_pct(r)
    return (f"| {r['preset']} | {r['bandwidth_mbps']:g} | {mix1_ratio:.2f} | {r['predicted_pct']:.1f} | "
            f"{r['measured_median_pct']:.1f} ({r['measured_min_pct']:.1f}-{r['measured_max_pct']:.1f}) | "
            f"{r['diff_pts']:+.1f} | {'pass' if r['pass'] else 'MISS'} | {r['failures']} | "
            f"{f'{goodput:.1f}' if goodput is not None else '-'} | {f'{last:.1f}' if last is not None else '-'} | "
            f"{'; '.join(notes)} |")


def breakdown_row(r: dict) -> str:
    """Per-round seconds, median over peers: measured against predicted."""
    if "error" in r:
        return ""
    pred, rounds = r["prediction"], r["overrides"]["rounds"]

    def med(key: str) -> float:
        return statistics.median(p[key] for p in r["peers"]) / rounds

    sync = pred["mode"] == "sync-dp"
    blocking = med("grad_s") if sync else med("mix1_wait_s") + med("mix2_s")
    return (f"| {r['preset']} | {r['bandwidth_mbps']:g} | {pred['compute_s']:.2f} / {med('compute_s'):.2f} | "
            f"{pred['blocking_comm_s']:.2f} / {blocking:.2f} | {med('monitor_s'):.2f} | {med('other_s'):.2f} | "
            f"{pred['wall_s']:.2f} / {med('rounds_s'):.2f} |")


def markdown(results: dict) -> str:
    lines: list[str] = []
    if results["runs"]:  # none with --presets none (link probes only)
        lines += ["| preset | B (Mbit/s) | Mix1 / compute | predicted % | measured % median (min-max) | diff (pts) | "
                  "within 5 | failed exchanges | simulator at TCP goodput % | measured, last round % | notes |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
        lines += [fmt_row(r) for r in results["runs"]]
        lines += ["", "Per round, median over peers, predicted / measured seconds (blocking = Mix1 wait + Mix2, or the "
                  "gradient all-reduces of sync-dp; other = outer step, packing, thread hand-offs):", "",
                  "| preset | B | compute | blocking comm | monitor | other | round |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [breakdown_row(r) for r in results["runs"] if "error" not in r]
        lines.append("")
    lines += ["| B (Mbit/s) | raw TCP goodput | ring all-reduce of the model (median of repeats) | % of B | "
              "globalm1 Mix1 (last round, median peer) | diloco Mix2 (last round, median peer) |",
              "|---:|---:|---:|---:|---:|---:|"]
    for link in results["links"]:
        b = link["bandwidth_mbps"]
        tcp = link.get("tcp", {}).get("mbps")
        ring = link.get("ring_mbps")
        cells = [f"{b:g}", f"{tcp:.2f} ({100 * tcp / b:.1f}%)" if tcp else "-",
                 f"{ring:.2f} Mbit/s ({statistics.median(link['ring']['durations_s']):.2f} s)" if ring else "-",
                 f"{100 * ring / b:.1f}%" if ring else "-"]
        for preset, key in (("globalm1", "mix1"), ("diloco", "mix2")):
            rate = mix_rate(results, preset, b, key)
            cells.append(f"{rate:.2f} Mbit/s ({100 * rate / b:.1f}%)" if rate else "-")
        lines.append("| " + " | ".join(cells) + " |")
    secured = [link for link in results["links"] if len(link.get("ring", {}).get("by_security", {})) > 1]
    if secured:
        lines += ["", "Ring all-reduce per transport (`--ring-security`), alternating repeat by repeat in the same "
                  "probe processes; medians of the repeats, rates as above:", "",
                  "| B (Mbit/s) | raw TCP goodput | plain: median s | plain: Mbit/s (% of B) | curve: median s | "
                  "curve: Mbit/s (% of B) | curve / plain time (median) | curve / plain per repeat | "
                  "CPU s per peer per all-reduce, plain / curve |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for link in secured:
            b, by = link["bandwidth_mbps"], link["ring"]["by_security"]
            tcp = link.get("tcp", {}).get("mbps")
            plain, curve = by.get("plain"), by.get("curve")
            if not (plain and curve):
                continue
            ratios = [c / p for p, c in zip(plain["durations_s"], curve["durations_s"])]
            lines.append(f"| {b:g} | {f'{tcp:.2f} ({100 * tcp / b:.1f}%)' if tcp else '-'} | {plain['median_s']:.3f} | "
                         f"{plain['mbps']:.2f} ({100 * plain['mbps'] / b:.1f}%) | {curve['median_s']:.3f} | "
                         f"{curve['mbps']:.2f} ({100 * curve['mbps'] / b:.1f}%) | "
                         f"{curve['median_s'] / plain['median_s']:.3f} | {', '.join(f'{r:.2f}' for r in ratios)} | "
                         + (f"{plain['cpu_s']:.3f} / {curve['cpu_s']:.3f} |" if plain.get("cpu_s") is not None
                            and curve.get("cpu_s") is not None else "- |"))
    swaps = [link for link in results["links"] if "swap" in link]
    if swaps:
        lines += ["", "Heartbeat check (`--swap-mb`): peers 0 and 1 swap a payload with `ZmqExchange.swap`:", ""]
        lines += [f"- {link['bandwidth_mbps']:g} Mbit/s: {swap_line(link['swap'], link['bandwidth_mbps'])}" for link in swaps]
    return "\n".join(lines)


def swap_line(swap: dict, bandwidth_mbps: float) -> str:
    """One line on a heartbeat check: what was swapped, with which timeout, and how it went."""
    chunk_s = swap["chunk_mb"] * (1 << 20) * 8 / (bandwidth_mbps * 1e6)
    what = (f"swap of {swap['mb']:g} MB in {swap['chunk_mb']:g} MiB chunks ({chunk_s:.1f} s per chunk at the link rate), "
            f"heartbeat timeout {swap['heartbeat_s']:g} s: ")
    if swap["ok"]:
        return what + f"ok in {swap['seconds']:.1f} s"
    errors = sorted({f"rank {side['rank']}: {side['error']}" for side in swap["sides"] if "error" in side})
    return what + f"FAILED after {swap['seconds']:.1f} s ({'; '.join(errors)})"


def mix_rate(results: dict, preset: str, bandwidth: float, mix: str) -> float | None:
    """Effective ring rate of the last round's all-reduce ``mix`` of ``preset`` (median over peers)."""
    for r in results["runs"]:
        if r["preset"] == preset and r["bandwidth_mbps"] == bandwidth and "error" not in r:
            rates = []
            for p in r["peers"]:
                seconds, nbytes = p["last_round"].get(f"{mix}_s"), p["last_round"].get(f"{mix}_bytes")
                if seconds and nbytes:
                    rates.append(ring_rate_mbps(nbytes, len(r["peers"]), seconds))
            return statistics.median(rates) if rates else None
    return None


# ---------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Real gossiploco peers on tc-shaped links in network namespaces: "
                                     "measured compute utilization against the simulator.",
                                     epilog="`python -m testbed.probes KIND --help`: the link probes it runs inside the "
                                     "namespaces (ring, swap, tcp-server, tcp-client, sample).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--presets", default="all", help="Comma-separated preset names, 'all' (every file in peers/) or "
                        "'none' (only the link probes).")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="A config override for every preset's peers and its prediction (e.g. mix1.compression=4bit).")
    parser.add_argument("--bandwidths", default="16,60", help="Link rates in Mbit/s (each direction, per peer), comma-separated.")
    parser.add_argument("--workers", type=int, default=4, help="Peers M (one namespace each).")
    parser.add_argument("--model", default="small", help="Model size (payload: its real parameter count, fp32).")
    parser.add_argument("--step-time", type=float, default=0.3, help="Seconds of one synthetic inner step T.")
    parser.add_argument("--inner-steps", type=int, default=10, help="Inner steps H per round.")
    parser.add_argument("--rounds", type=int, default=4, help="Rounds R per run.")
    parser.add_argument("--sync-dp-inner-steps", type=int, default=5, help="sync-dp: steps per 'round' (its utilization does not depend on H).")
    parser.add_argument("--sync-dp-rounds", type=int, default=2, help="sync-dp: rounds.")
    parser.add_argument("--real-compute", action="store_true", help="Real inner steps of the model instead of sleeps; T is then measured.")
    parser.add_argument("--seq-len", type=int, default=64, help="Tokens per sequence (real compute).")
    parser.add_argument("--batch-size", type=int, default=4, help="Sequences per inner step (real compute).")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="netem delay on each direction of each link.")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="netem loss on each direction of each link.")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--queue-packets", type=int, default=1000,
                        help="FIFO length of each shaped direction, in packets (1000: Linux's default txqueuelen). "
                             "Short queues drop more and make TCP (Reno) flows stall and share unevenly.")
    parser.add_argument("--congestion-control", default="auto",
                        help="TCP congestion control in the peer namespaces: auto (cubic if the host allows it, else reno), "
                             "inherit (the host's default), or a name (reno, cubic, bbr).")
    parser.add_argument("--sample-links", type=float, default=0.0, metavar="SECONDS",
                        help="Record every switch port's byte counters at this interval during each run (links.jsonl; 0: off).")
    parser.add_argument("--tolerance", type=float, default=5.0, help="Points of utilization a median may differ from the prediction.")
    parser.add_argument("--ring-repeats", type=int, default=3, help="Ring all-reduce probes per bandwidth (0: skip).")
    parser.add_argument("--ring-security", type=lambda t: [m.strip() for m in t.split(",") if m.strip()],
                        default=["plain"], metavar="plain[,curve]",
                        help="Transports the ring probe times: plain (ZmqExchange with trust=None) and/or curve "
                             "(CurveZMQ with Trust.static, what `gossiploco peer` runs); with both they alternate repeat "
                             "by repeat in the same processes and the table compares them. The main table's ring "
                             "column is the first one's.")
    parser.add_argument("--tcp-seconds", type=float, default=3.0, help="Raw TCP probe length per bandwidth (0: skip).")
    parser.add_argument("--swap-mb", type=float, default=0.0,
                        help="Heartbeat check per bandwidth: peers 0 and 1 swap this many MB in --chunk-mb chunks with "
                             "the peers' heartbeat timeout (--heartbeat-timeout-s, else the runtime's); 0: skip.")
    parser.add_argument("--chunk-mb", type=float, default=4.0,
                        help="transport.chunk_mb of the peers and the ring probe (the runtime's default). With the "
                             "runtime's 5 s heartbeat, a chunk that takes longer than 5 s on the wire drops the connection "
                             "(4 MiB: below 6.7 Mbit/s per flow).")
    parser.add_argument("--discovery", choices=("dht", "static"), default="dht",
                        help="How the peers find each other: a bootstrap DHT node in peer 0's namespace (--join), "
                             "or a static --peers list.")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=0.0,
                        help="Run the peers with timeouts.heartbeat_s set to this instead of the runtime's 5 s "
                             "(0: unchanged). libzmq counts only whole messages, so on a slow, congested link the "
                             "5 s timeout can drop healthy connections.")
    parser.add_argument("--exchange-timeout-s", type=float, default=120.0, help="timeouts.exchange_s of the peers.")
    parser.add_argument("--startup-allowance-s", type=float, default=240.0, help="Added to 3x the predicted run time for a run's deadline.")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Name prefix of the namespaces this run makes (and cleans).")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "netem", help="Output directory (results.json, table.md, per-run logs).")
    parser.add_argument("--predict-only", action="store_true", help="Print the plans and predictions; run nothing (no root needed).")
    parser.add_argument("--cleanup", action="store_true", help="Only remove leftovers of an earlier run with --prefix.")
    parser.add_argument("--report", type=Path, metavar="RESULTS_JSON", help="Only rewrite the tables of an earlier run's results.json (no root needed).")
    parser.add_argument("--strict", action="store_true", help="Exit 1 when a row misses the tolerance or the ring rate is under 90%% of B.")
    return parser.parse_args(argv)


def presets_of(text: str) -> list[str]:
    from gossiploco.config import preset_names

    names = preset_names()
    if text == "all":
        return names
    if text == "none":
        return []
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in names]
    if unknown:
        raise SystemExit(f"error: unknown presets {unknown}; choose from {names}")
    return chosen


def machine_info() -> dict:
    import platform

    info = {"kernel": platform.release(), "python": platform.python_version(), "cpus": os.cpu_count()}
    info["cpu"] = cpu_model()
    with contextlib.suppress(OSError):
        info["loadavg_start"] = Path("/proc/loadavg").read_text().split()[:3]
    info["ip"] = sh(["ip", "-V"], check=False).stdout.strip() if shutil.which("ip") else None
    return info


class _Stop(KeyboardInterrupt):
    """A signal asked us to stop (SIGINT, SIGTERM, SIGHUP)."""


def _on_signal(signum: int, frame: Any) -> None:
    raise _Stop(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["probe"]:  # the link probes' old entry point
        from testbed.probes import main as probe_main

        return probe_main(argv[1:])
    args = parse_args(argv)
    if not PREFIX_RE.match(args.prefix):
        print(f"error: --prefix must match {PREFIX_RE.pattern}, got {args.prefix!r}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    bandwidths = [float(b) for b in args.bandwidths.split(",") if b.strip()]
    presets = presets_of(args.presets)
    if not args.ring_security or any(m not in SECURITIES for m in args.ring_security):
        print(f"error: --ring-security takes a comma-separated list of {', '.join(SECURITIES)}", file=sys.stderr)
        return 1

    if args.report:
        table = markdown(json.loads(args.report.read_text()))
        (args.report.parent / "table.md").write_text(table + "\n")
        print(table)
        return 0

    if args.predict_only:
        for b in bandwidths:
            for preset in presets:
                plan = make_plan(preset, b, args)
                p = plan.prediction
                print(f"{preset:24s} {b:6g} Mbit/s  predicted {100 * p['compute_utilization']:5.1f}%  "
                      f"round {p['wall_s']:.2f} s (compute {p['compute_s']:.2f}, mix1 {p['mix1_attempt_s']:.2f}, "
                      f"mix2 {p['mix2_attempt_s']:.2f}, x{plan.cfg.rounds} rounds)")
        return 0

    if args.workers < 2 and not args.cleanup and (args.swap_mb > 0 or args.tcp_seconds > 0):
        print("error: the TCP probe and --swap-mb need --workers 2 or more (they run between peers 0 and 1)", file=sys.stderr)
        return 1
    problem = preflight()
    if problem:
        print(f"bench/netem.py cannot run here: {problem}", file=sys.stderr)
        return EXIT_UNAVAILABLE

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s in previous:
        signal.signal(s, _on_signal)
    net: Network | None = None
    try:
        with prefix_lock(args.prefix):
            leftovers = remove_namespaces(args.prefix)
            if leftovers:
                print(f"removed leftovers of an earlier run: {', '.join(leftovers)}")
            if args.cleanup:
                return 0
            net = Network(args.prefix, args.workers, args.mtu)
            try:
                return run_all(net, args, presets, bandwidths)
            finally:
                # No second Ctrl+C may interrupt the clean-up.
                for s in previous:
                    signal.signal(s, signal.SIG_IGN)
                removed = net.destroy()
                print(f"removed namespaces: {', '.join(removed) if removed else 'none left'}")
    except Unavailable as exc:
        print(f"bench/netem.py cannot run here: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except RuntimeError as exc:  # a command of the set-up failed: already cleaned up
        print(f"bench/netem.py: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'SIGINT'}); peers stopped, namespaces removed", file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_all(net: Network, args: argparse.Namespace, presets: list[str], bandwidths: list[float]) -> int:
    from gossiploco.utilization import block_sizes, default_vocab_size

    args.out.mkdir(parents=True, exist_ok=True)
    net.build()
    results: dict[str, Any] = {"machine": machine_info(), "argv": sys.argv, "args": {k: str(v) for k, v in vars(args).items()},
                               "links": [], "runs": []}
    results["machine"]["tcp_congestion_control"] = net.set_congestion_control(args.congestion_control)
    print(f"{net.peers} peer namespaces {net.ns(0)}..{net.ns(net.peers - 1)} on bridge {net.switch}/br0, "
          f"TCP congestion control {results['machine']['tcp_congestion_control']}", flush=True)
    path = args.out / "results.json"
    broken = False
    port = PEER_PORT
    for b in bandwidths:
        net.shape(b, args.delay_ms, args.loss_pct, args.queue_packets)
        link: dict[str, Any] = {"bandwidth_mbps": b, "tc": net.qdisc_text(0)}
        results["links"].append(link)
        link_dir = args.out / f"link-{b:g}mbit"
        if args.tcp_seconds > 0:
            link["tcp"] = probe_tcp(net, link_dir, args.tcp_seconds)
            print(f"[{b:g} Mbit/s] raw TCP p0->p1: {link['tcp']['mbps']:.2f} Mbit/s ({100 * link['tcp']['mbps'] / b:.1f}% of B)", flush=True)
        if args.ring_repeats > 0:
            from gossiploco.config import load_config

            cfg = load_config("globalm1", {"model.size": args.model})
            numel = sum(block_sizes(cfg.model.size, default_vocab_size(cfg)).values())
            link["ring"] = probe_ring(net, link_dir, numel, args.ring_repeats, args.exchange_timeout_s, chunk_mb=args.chunk_mb,
                                      security=args.ring_security)
            for mode, by in link["ring"]["by_security"].items():
                by["median_s"] = statistics.median(by["durations_s"])
                by["mbps"] = ring_rate_mbps(4 * numel, net.peers, by["median_s"])
                print(f"[{b:g} Mbit/s] ring all-reduce ({mode}) of {4 * numel / 1e6:.2f} MB among {net.peers}: "
                      f"{by['median_s']:.3f} s = {by['mbps']:.2f} Mbit/s ({100 * by['mbps'] / b:.1f}% of B)", flush=True)
            link["ring_mbps"] = link["ring"]["by_security"][args.ring_security[0]]["mbps"]
        if args.swap_mb > 0:
            link["swap"] = probe_swap(net, link_dir, args.swap_mb, args.chunk_mb, args.heartbeat_timeout_s,
                                      args.exchange_timeout_s)
            print(f"[{b:g} Mbit/s] {swap_line(link['swap'], b)}", flush=True)
        for preset in presets:
            plan = make_plan(preset, b, args)
            port += 1
            run = run_plan(net, plan, args, args.out / f"{preset}-{b:g}mbit", port, link.get("tcp", {}).get("mbps"))
            results["runs"].append(run)
            if "error" in run:
                broken = True
                print(f"[{b:g} Mbit/s] {preset}: ERROR {run['error']}", flush=True)
            else:
                print(f"[{b:g} Mbit/s] {preset:24s} predicted {run['predicted_pct']:5.1f}%  measured {run['measured_median_pct']:5.1f}% "
                      f"({run['measured_min_pct']:.1f}-{run['measured_max_pct']:.1f})  diff {run['diff_pts']:+.1f}  "
                      f"{'pass' if run['pass'] else 'MISS'}  ({run['wall_s']:.0f} s)", flush=True)
            path.write_text(json.dumps(results, indent=1, default=str))
    results["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    path.write_text(json.dumps(results, indent=1, default=str))
    table = markdown(results)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    print(f"results: {path}  table: {args.out / 'table.md'}")
    if broken:
        return 1
    missed = [r for r in results["runs"] if not r.get("pass")]
    slow = [link for link in results["links"] if link.get("ring_mbps") and link["ring_mbps"] < 0.9 * link["bandwidth_mbps"]]
    return 1 if args.strict and (missed or slow) else 0


if __name__ == "__main__":
    sys.exit(main())
