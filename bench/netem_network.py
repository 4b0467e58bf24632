"""bench/netem.py's network and its link probes: the star of namespaces with shaped access links
(``Network``), the processes of one probe or run, and the probes of a link (raw TCP, the ring all-reduce,
the heartbeat swap). The driver is bench/netem.py; its docstring describes the topology and the probes."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Sequence

from testbed import netns
from testbed.links import qdisc_text, shape_links
from testbed.netns import Star, sh
from testbed.peers import run_swarm_key
from testbed.probes import RING_PORT, TCP_PORT
from testbed.processes import ProcessGroup, child_env, tail

ROOT = Path(__file__).resolve().parent.parent

SUBNET = "10.77.0"
"""Peer I gets 10.77.0.{I+1}/24 (a private range; only inside this benchmark's namespaces)."""
SWAP_PORT = 6950
STOP_GRACE_S = 10.0
"""After SIGINT a process gets this long to leave before SIGKILL."""
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
