"""Real peer processes at growing M (issue 26, item 6): round time, blocking time, Mix1, bytes, control messages,
connections and memory per peer, against M.

    nice -n 5 python -m bench.scale_real --peers 4,16,32,64 --rounds 8 --out runs/scale-real \\
        --json bench/results/scale-real.json --markdown bench/results/scale.md
    python -m bench.scale_real --peers 64 --group-size 64 ...   # one group: everyone waits for everyone
    python -m bench.scale_real --peers 64 --heartbeat-s 30 ...  # a timeout changed (also --grace-s)
    python -m bench.scale_real --json ... --markdown ... --markdown-only  # rewrite the table from the JSON

``--json`` keeps one summary per (M, group size, timeouts changed, ``--label``): a new run replaces its own and keeps
the others; ``--markdown`` rewrites the generated part of the file's "Real processes" section (between its markers)
and keeps the rest. Run outputs (logs with timestamps, per-peer records) go to ``--out``/m{M}-g{size}[-hb..][-label].

What runs. For each M, M OS processes (``python -m bench.scale_real peer``, started by the test bed's process
manager ``gossiploco.runtime.launch.ProcessGroup``, each in its own session, all killed on every exit path), each
one communication-only peer: the real transport (``ZmqExchange`` with the static endpoint list of ``gossiploco peer
--peers``: loopback ports from ``free_ports``, CurveZMQ with every rank's key derived from one swarm key,
``Trust.static``; no DHT), the run's grouping (``set_grouping(seed, groups.size)``, default 16, so 32 and 64 peers
exchange in buckets), the real mixing operators (``GlobalMix`` for Mix1, ``GossipMix`` for Mix2) on a small
payload (``--payload`` floats, default 65,536 = 256 KiB), and the config's default timeouts (``TimeoutConfig``:
grace 10 s, exchange deadline 120 s adaptive from 10 s, heartbeat 5 s). Compute is synthetic: peer ``rank``
sleeps ``inner_s`` per round, drawn once per peer uniformly in ``--inner`` (default 1.0-2.0 s) from the seed, so
unequal speeds show as waiting wherever a peer waits for a slower one.

Each round follows Algorithm 1's schedule (as ``gossiploco.factored`` runs it and ``simulation.swarm`` does in
virtual time): Mix1 of z launched at the round's start on a background thread (non-blocking), the inner compute,
a blocking Mix2 of the pseudo-gradient, then the wait for Mix1 and the outer step (z = Mix1(z) - lr Mix2(delta)).
All peers start round 0 together (``testbed.file_barrier``: after every peer connected to every other, so start-up
is not measured); after the last round each peer waits (bounded) for the others before closing.

Per peer per round (``peer-RANK.json``): ``round_s`` (start of the round to the end of its outer step),
``blocking_s`` = ``mix2_s`` (in Mix2: agreement, wait for the partner, swap) + ``mix1_wait_s`` (after Mix2, for
the background Mix1 to end); Mix1's and Mix2's outcome (ok or the cause) and agreed group size; bytes: payload
sent (``bytes_sent``), everything sent (``wire_sent``: codec frames of every message, control included), payload
received; control messages sent (``Traffic.control_sent``: messages other than data chunks, by kind; ZMTP
heartbeats are libzmq's own and not counted); connections: other peers connected now (``connected``), this
peer's DEALER sockets (``dealers``: a data and a control one per known peer), open file descriptors and sockets
(``testbed.processes.resources``: TCP connections both ways plus ZeroMQ's internal signalling pairs), RSS, PSS and
threads. The summary per M is the median over all peers and rounds (round 0 included), plus the 90th percentile
of round and blocking time, the Mix1 completion rate (rounds where Mix1 gave a mean, of all peer-rounds), and the
memory the machine lost while the swarm ran (``MemAvailable`` before, lowest during).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.scale_real_report import write_markdown

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class SwarmSettings:
    """One run of ``peers`` processes; every peer reads the same settings (``swarm.json``)."""

    peers: int
    endpoints: list[str]
    run_id: str
    swarm_key: str
    """Path of the run's swarm key file (CurveZMQ; every rank's key is derived from it)."""
    out: str
    rounds: int = 8
    payload: int = 65536
    """Floats in each of z and the pseudo-gradient."""
    inner_low_s: float = 1.0
    inner_high_s: float = 2.0
    group_size: int = 16
    seed: int = 0
    outer_lr: float = 0.7
    connect_s: float = 300.0
    """How long a peer waits to connect to every other, and then for every peer at the start line."""
    finish_s: float = 120.0
    """How long a peer that finished waits for the others before closing."""
    heartbeat_s: float | None = None
    """``timeouts.heartbeat_s`` (None: the config's default, 5 s)."""
    grace_s: float | None = None
    """``timeouts.grace_s`` (None: the config's default, 10 s)."""
    pairing: str = "bucket"
    """``[groups] pairing`` of Mix2 (``ready``: each member paired with the next one of its bucket ready)."""
    period_s: float = 0.0
    """> 0: time-budget rounds on the shared round clock (``round.clock = "shared"``, ``round_clock.RoundClock``):
    a peer's compute ends at its clock's deadline plus an overshoot drawn per peer and round from U(0, overshoot_s)
    (the step in flight), instead of ``inner_s`` from its round's start. Founders anchor at their start line."""
    overshoot_s: float = 0.0
    links_idle_s: float = 0.0
    """> 0: links on demand (``[transport] links_idle_s``, ``transport.zmq_links``): a peer makes a member's sockets
    when it sends to it (its Mix2 bucket's at each round's start, ``link_ahead``) and closes them this long idle, or
    to keep at most twice a bucket's other members (``[transport] links_cap``'s default)."""


def inner_seconds(seed: int, rank: int, low: float, high: float) -> float:
    """Peer ``rank``'s synthetic compute per round: uniform in [low, high], drawn once from (seed, rank)."""
    return random.Random(f"{seed}:{rank}:inner").uniform(low, high)


class GroupRecorder:
    """An ``Exchange`` that passes everything to ``exchange`` and notes the size of each agreed group, by key
    (what the operators do not return). Thread-safe as the exchange is: each key is written by one thread."""

    def __init__(self, exchange):
        self._exchange = exchange
        self.sizes: dict[str, int] = {}

    def group(self, key: str, round_index: int) -> list[int]:
        members = self._exchange.group(key, round_index)
        self.sizes[key] = len(members)
        return members

    def __getattr__(self, name: str):
        return getattr(self._exchange, name)


# -- the peer program -----------------------------------------------------------------------------------


def run_peer(settings: SwarmSettings, rank: int) -> dict:
    """Peer ``rank``'s whole run (module docstring); returns its record (also written to ``peer-RANK.json``)."""
    import torch

    from gossiploco.config_sections import TimeoutConfig, TransportConfig
    from gossiploco.security.swarm_key import SwarmKey
    from gossiploco.security.trust import Trust
    from gossiploco.transport.deadlines import AdaptiveDeadlines
    from gossiploco.transport.zmq_exchange import ZmqExchange
    from testbed.file_barrier import FileBarrier
    from testbed.processes import resources

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    out = Path(settings.out)
    record: dict = {"rank": rank, "inner_s": inner_seconds(settings.seed, rank, settings.inner_low_s,
                                                           settings.inner_high_s), "rounds": [], "error": None}
    t = TimeoutConfig(**{k: v for k, v in (("heartbeat_s", settings.heartbeat_s), ("grace_s", settings.grace_s))
                         if v is not None})
    record["timeouts"] = {"grace_s": t.grace_s, "heartbeat_s": t.heartbeat_s, "exchange_s": t.exchange_s,
                          "min_exchange_s": t.min_exchange_s}
    trust = Trust.static(SwarmKey.load(settings.swarm_key), rank, settings.peers)
    began = time.monotonic()
    exchange = ZmqExchange(rank, settings.endpoints, settings.run_id, t.exchange_s, grace_s=t.grace_s,
                           deadlines=AdaptiveDeadlines(t.exchange_s, min_s=t.min_exchange_s, factor=t.adaptive_factor),
                           heartbeat_s=t.heartbeat_s, trust=trust, links_idle_s=settings.links_idle_s,
                           links_cap=TransportConfig().links_kept(settings.group_size))  # as a peer's default
    try:
        exchange.set_grouping(settings.seed, settings.group_size, {"mix2"} if settings.pairing == "ready" else ())
        record["connected_all"] = exchange.wait_connected(settings.connect_s)
        record["connect_s"] = time.monotonic() - began
        start = FileBarrier(out / "start", settings.peers)
        start.arrive(rank, {"connected": len(exchange.connected())})
        if not start.wait(settings.connect_s):
            raise RuntimeError(f"only {start.arrived()} of {settings.peers} peers reached the start line")
        record["start_resources"] = resources()
        run_rounds(settings, rank, exchange, record)
        finish = FileBarrier(out / "finish", settings.peers)
        finish.arrive(rank)
        record["all_finished"] = finish.wait(settings.finish_s)
    except Exception as exc:  # noqa: BLE001 - recorded, and the process exits 1
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        record["malformed"] = exchange.malformed_messages
        record["dropped"] = exchange.dropped_messages
        exchange.close()
        write_json(out / f"peer-{rank}.json", record)
    return record


def run_rounds(settings: SwarmSettings, rank: int, exchange, record: dict) -> None:
    """The rounds of Algorithm 1's schedule with synthetic compute; one entry per round into ``record["rounds"]``."""
    import torch

    from gossiploco.mixing.operators import GlobalMix, GossipMix
    from gossiploco.round_clock import RoundClock
    from testbed.processes import resources

    recorder = GroupRecorder(exchange)
    mix1 = GlobalMix("mix1", ["z"], settings.seed)
    mix2 = GossipMix("mix2", ["delta"], settings.seed)
    gen = torch.Generator().manual_seed(settings.seed * 1000 + rank)
    z = torch.randn(settings.payload, generator=gen)
    inner_s = record["inner_s"]
    traffic = exchange.traffic
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mix1-{rank}")
    clock = RoundClock(settings.period_s) if settings.period_s else None
    overshoot = random.Random(f"{settings.seed}:{rank}:overshoot")

    def timed_mix1(state: dict, r: int):
        t0 = time.perf_counter()
        result = mix1.mix([state], r, recorder)
        return result, time.perf_counter() - t0

    try:
        for r in range(settings.rounds):
            before = (traffic.payload_sent, traffic.wire_sent, exchange.bytes_received, traffic.control_sent,
                      traffic.control_counts(), cpu_seconds())
            t_round = time.perf_counter()
            exchange.current_round = r
            pending = pool.submit(timed_mix1, {"z": z.clone()}, r)  # Mix1 launched at the round's start, non-blocking
            exchange.link_ahead(mix2.key(r), r)  # links on demand: Mix2's links made during compute (as the runtime)
            compute_s = inner_s
            if clock is not None:  # time-budget rounds on the shared clock: train until the clock's deadline
                deadline = clock.begin(r, time.monotonic())
                exchange.round_ends = (r, clock.ends_at(r))
                compute_s = max(0.0, deadline - time.monotonic()) + overshoot.uniform(0, settings.overshoot_s)
            time.sleep(compute_s)  # the inner steps (synthetic compute)
            delta = torch.randn(settings.payload, generator=gen).mul_(0.01)
            t_mix2 = time.perf_counter()
            res2 = mix2.mix([{"delta": delta}], r, recorder)  # blocking Mix2 of the pseudo-gradient
            mix2_s = time.perf_counter() - t_mix2
            t_wait = time.perf_counter()
            res1, mix1_s = pending.result()  # join Mix1
            mix1_wait_s = time.perf_counter() - t_wait
            z = res1.values[0]["z"] - settings.outer_lr * res2.values[0]["delta"]  # the outer step
            round_s = time.perf_counter() - t_round
            kinds = traffic.control_counts()
            record["rounds"].append({
                "round": r, "round_s": round_s, "compute_s": compute_s, "mix2_s": mix2_s, "mix1_wait_s": mix1_wait_s,
                "blocking_s": mix2_s + mix1_wait_s, "mix1_s": mix1_s,
                "mix1_ok": res1.ok, "mix1_cause": res1.cause, "mix1_group": recorder.sizes.get(f"mix1/{r}"),
                "mix2_ok": res2.ok, "mix2_cause": res2.cause, "mix2_group": recorder.sizes.get(f"mix2/{r}"),
                "partner": res2.partner,
                "bytes_sent": traffic.payload_sent - before[0], "wire_sent": traffic.wire_sent - before[1],
                "bytes_received": exchange.bytes_received - before[2],
                "control_sent": traffic.control_sent - before[3],
                "control_kinds": {k: n - before[4].get(k, 0) for k, n in kinds.items() if n - before[4].get(k, 0)},
                "cpu_s": cpu_seconds() - before[5], "connected": len(exchange.connected()),
                "dealers": len(exchange.sockets.dealers) + len(exchange.sockets.controls),
                **resources(), "finite": bool(torch.isfinite(z).all()),
            })
    finally:
        pool.shutdown(wait=True)


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    """User + system CPU seconds of this process (every thread), or of its waited-for children."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# -- the driver -----------------------------------------------------------------------------------------


def mem_available() -> int:
    """``MemAvailable`` of /proc/meminfo, bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_swarm(peers: int, out: Path, *, rounds: int = 8, payload: int = 65536, inner: tuple[float, float] = (1.0, 2.0),
              group_size: int = 16, seed: int = 0, timeout_s: float | None = None, heartbeat_s: float | None = None,
              grace_s: float | None = None, label: str = "", pairing: str = "bucket", period_s: float = 0.0,
              overshoot_s: float = 0.0, links_idle_s: float = 0.0) -> dict:
    """Start ``peers`` peer processes, wait for them (at most ``timeout_s``), stop them; returns the run's
    summary (``summarize``) with every peer's record under ``records``."""
    from gossiploco.runtime.launch import free_ports
    from gossiploco.security.swarm_key import SwarmKey
    from testbed.processes import ProcessGroup, child_env, tail

    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("peer-*.json"), *out.glob("start/*.json"), *out.glob("finish/*.json")]:
        stale.unlink()
    key = out / "swarm.key"
    if not key.exists():
        SwarmKey.generate().save(key)
    settings = SwarmSettings(peers, [f"tcp://127.0.0.1:{p}" for p in free_ports(peers)], f"scale-{os.urandom(4).hex()}",
                             str(key), str(out), rounds=rounds, payload=payload, inner_low_s=inner[0],
                             inner_high_s=inner[1], group_size=group_size, seed=seed, heartbeat_s=heartbeat_s,
                             grace_s=grace_s, pairing=pairing, period_s=period_s, overshoot_s=overshoot_s,
                             links_idle_s=links_idle_s)
    write_json(out / "swarm.json", asdict(settings))
    timeout_s = timeout_s or settings.connect_s * 2 + rounds * (inner[1] + 30) + settings.finish_s
    env = child_env(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    low_memory = before = mem_available()
    high_load = 0.0
    stop_sampling = threading.Event()

    def sample() -> None:
        nonlocal low_memory, high_load
        while not stop_sampling.wait(0.5):
            low_memory = min(low_memory, mem_available())
            high_load = max(high_load, os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began, cpu_before = time.monotonic(), cpu_seconds(resource.RUSAGE_CHILDREN)
    group = ProcessGroup(env=env, cwd=ROOT, grace_s=10)
    try:
        procs = [group.start([sys.executable, "-m", "bench.scale_real", "peer", "--settings", str(out / "swarm.json"),
                              "--rank", str(rank)], out / f"peer-{rank}.log") for rank in range(peers)]
        codes = group.wait(timeout_s, procs)
    finally:
        group.stop()
        stop_sampling.set()
        sampler.join()
    wall_s, peers_cpu_s = time.monotonic() - began, cpu_seconds(resource.RUSAGE_CHILDREN) - cpu_before
    records, problems = [], []
    for rank, code in enumerate(codes):
        path = out / f"peer-{rank}.json"
        rec = json.loads(path.read_text()) if path.exists() else {"rank": rank, "rounds": [], "error": "no record"}
        rec["exit_code"] = code
        if code != 0 or rec.get("error"):
            problems.append(f"rank {rank}: exit {code}, {rec.get('error')}; log tail:\n{tail(out / f'peer-{rank}.log', 5)}")
        records.append(rec)
    summary = summarize(records, settings)
    summary.update(label=label, wall_s=wall_s, peers_cpu_s=peers_cpu_s, load_max=high_load, mem_available_before=before, mem_lost_max=before - low_memory, problems=problems,
                   records=records)
    return summary


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def p90(values) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else None


def summarize(records: list[dict], settings: SwarmSettings) -> dict:
    """Medians over every peer and round (module docstring) and whether every peer finished every round."""
    rows = [row for rec in records for row in rec["rounds"]]
    done = sum(1 for rec in records if len(rec["rounds"]) == settings.rounds and not rec.get("error")
               and rec.get("exit_code") == 0)
    causes: dict[str, int] = {}
    for row in rows:
        for which in ("mix1", "mix2"):
            if not row[f"{which}_ok"]:
                cause = f"{which}: {(row[f'{which}_cause'] or '?').split(':')[0]}"
                causes[cause] = causes.get(cause, 0) + 1
    kinds = {kind: [row["control_kinds"].get(kind, 0) for row in rows]
             for kind in sorted({k for row in rows for k in row["control_kinds"]})}
    return {
        "peers": settings.peers, "group_size": settings.group_size, "heartbeat_s": settings.heartbeat_s,
        "grace_s": settings.grace_s, "rounds": settings.rounds, "pairing": settings.pairing,
        "period_s": settings.period_s, "overshoot_s": settings.overshoot_s,
        "payload_floats": settings.payload, "inner_s": [settings.inner_low_s, settings.inner_high_s],
        "peers_done": done, "peer_rounds": len(rows),
        "round_s": median(r["round_s"] for r in rows), "round_s_p90": p90(r["round_s"] for r in rows),
        "blocking_s": median(r["blocking_s"] for r in rows), "blocking_s_p90": p90(r["blocking_s"] for r in rows),
        "mix2_s": median(r["mix2_s"] for r in rows), "mix1_wait_s": median(r["mix1_wait_s"] for r in rows),
        "mix1_s": median(r["mix1_s"] for r in rows), "cpu_s": median(r.get("cpu_s") for r in rows),
        "connected_min": min((r["connected"] for r in rows), default=None),
        "mix1_completion": sum(r["mix1_ok"] for r in rows) / len(rows) if rows else None,
        "mix2_completion": sum(r["mix2_ok"] for r in rows) / len(rows) if rows else None,
        "failures": causes,
        "mix1_group": median(r["mix1_group"] for r in rows), "mix2_group": median(r["mix2_group"] for r in rows),
        "bytes_sent": median(r["bytes_sent"] for r in rows), "wire_sent": median(r["wire_sent"] for r in rows),
        "bytes_received": median(r["bytes_received"] for r in rows),
        "control_sent": median(r["control_sent"] for r in rows),
        "control_sent_mean": statistics.fmean(r["control_sent"] for r in rows) if rows else None,
        "control_sent_max": max((r["control_sent"] for r in rows), default=None),
        "control_kinds": {k: statistics.fmean(v) for k, v in kinds.items()},
        "connected": median(r["connected"] for r in rows), "dealers": median(r["dealers"] for r in rows),
        "fds": median(r.get("fds") for r in rows), "sockets": median(r.get("sockets") for r in rows),
        "rss": median(r.get("rss") for r in rows), "pss": median(r.get("pss") for r in rows),
        "threads": median(r.get("threads") for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command")
    peer = sub.add_parser("peer", help="one peer process (started by the driver)")
    peer.add_argument("--settings", required=True)
    peer.add_argument("--rank", type=int, required=True)
    ap.add_argument("--peers", default="4,16,32,64", help="comma-separated M values, run in order")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--payload", type=int, default=65536, help="floats per mixed vector")
    ap.add_argument("--inner", default="1.0,2.0", help="LOW,HIGH seconds of synthetic compute per round")
    ap.add_argument("--group-size", type=int, default=16, help="[groups] size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heartbeat-s", type=float, default=None, help="timeouts.heartbeat_s (default: the config's)")
    ap.add_argument("--grace-s", type=float, default=None, help="timeouts.grace_s (default: the config's)")
    ap.add_argument("--pairing", choices=("bucket", "ready"), default="bucket", help="[groups] pairing of Mix2")
    ap.add_argument("--period", type=float, default=0.0,
                    help="> 0: time-budget rounds of this period on the shared round clock (--inner unused)")
    ap.add_argument("--overshoot", type=float, default=0.0, help="with --period: compute overshoots by U(0, this) s")
    ap.add_argument("--min-free-gb", type=float, default=4.0,
                    help="skip an M when MemAvailable is below this plus 0.15 GB per peer")
    ap.add_argument("--label", default="", help="names this run in the results (a repetition, a variant)")
    ap.add_argument("--links-idle-s", type=float, default=0.0,
                    help="links on demand, closed after this many idle seconds (0: a full mesh; name it with --label)")
    ap.add_argument("--out", default="runs/scale-real")
    ap.add_argument("--json", default=None, help="write the summaries here (appends to a list keyed by M and size)")
    ap.add_argument("--markdown", default=None, help="write the 'Real processes' section of this file")
    ap.add_argument("--markdown-only", action="store_true", help="only rewrite --markdown from --json; run nothing")
    ap.add_argument("--record-command", default=None, help="the command line to record (default: this one)")
    args = ap.parse_args(argv)
    if args.command == "peer":
        settings = SwarmSettings(**json.loads(Path(args.settings).read_text()))
        return 0 if run_peer(settings, args.rank)["error"] is None else 1
    if args.markdown_only:
        write_markdown(Path(args.markdown), json.loads(Path(args.json).read_text())["runs"])
        return 0
    low, high = (float(v) for v in args.inner.split(","))
    results = []
    for m in (int(v) for v in args.peers.split(",")):
        need = (args.min_free_gb + 0.15 * m) * 2**30
        if mem_available() < need:
            print(f"M={m}: skipped, MemAvailable {mem_available() / 2**30:.1f} GB < {need / 2**30:.1f} GB", flush=True)
            continue
        name = "-".join(filter(None, [f"m{m}-g{args.group_size}", args.heartbeat_s and f"hb{args.heartbeat_s:g}",
                                      args.grace_s and f"grace{args.grace_s:g}", args.period and f"clock{args.period:g}",
                                      args.pairing != "bucket" and args.pairing, args.label]))
        summary = run_swarm(m, Path(args.out) / name, rounds=args.rounds, payload=args.payload,
                            inner=(low, high), group_size=args.group_size, seed=args.seed,
                            heartbeat_s=args.heartbeat_s, grace_s=args.grace_s, label=args.label,
                            pairing=args.pairing, period_s=args.period, overshoot_s=args.overshoot,
                            links_idle_s=args.links_idle_s)
        print(json.dumps({k: v for k, v in summary.items() if k != "records"}, indent=1), flush=True)
        results.append(summary)
    command = args.record_command or "python -m bench.scale_real " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json:
        path = Path(args.json)
        kept = json.loads(path.read_text())["runs"] if path.exists() else []
        variant = lambda s: (s["peers"], s["group_size"], s.get("heartbeat_s"), s.get("grace_s"), s.get("label", ""),  # noqa: E731
                             s.get("pairing", "bucket"), s.get("period_s", 0.0), s.get("overshoot_s", 0.0))
        new = {variant(s) for s in results}
        kept = [s for s in kept if variant(s) not in new]
        runs = sorted(kept + [{**{k: v for k, v in s.items() if k != "records"}, "command": command} for s in results],
                      key=lambda s: (s["group_size"] != 16, s["group_size"], s.get("heartbeat_s") or 0, s.get("grace_s") or 0,
                                     s.get("period_s") or 0, s.get("pairing", "bucket"), s.get("label", ""), s["peers"]))
        write_json(path, {"runs": runs})
        if args.markdown:
            write_markdown(Path(args.markdown), runs)
    return 0 if all(s["peers_done"] == s["peers"] for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
