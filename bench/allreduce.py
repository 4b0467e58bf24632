"""All-reduce benchmark: ZmqExchange against torch.distributed (gloo) and hivemind, on loopback.

``--peers`` peer processes (multiprocessing ``spawn``) on 127.0.0.1. zmq and gloo run side by
side in the same peer processes, alternating per repetition (even repetitions zmq first, odd
ones gloo first), so both see the same machine load and the same inputs; hivemind runs in its
own set of processes afterwards (its averager forks helper processes and runs ~10x longer).

Per repetition and backend each peer fills a fresh random fp32 tensor (chunk c of rank r's input
is ``randn`` seeded by (rank, rep, c), so any peer can regenerate any other's), all peers meet
at a barrier, and each times its own all-reduce mean; the repetition's time is the maximum over
peers. After the clock stops the result is checked against the exact mean (float64 sum of all
ranks' regenerated inputs / peers): every element by one peer (the peers split that work), and
every peer's whole result against it through per-chunk float64 checksums. One untimed warm-up
repetition precedes the timed ones. Peak RSS (VmHWM, reset through /proc/self/clear_refs after
gc just before the barrier) is reported in payload-sized buffers beyond the input and what the process
already held: the steady state of a peer that mixes every round, whose allocator reuses the pages of the
previous exchange's buffers. ``--trim`` also calls malloc_trim there (as the bench did until 2026-11-27):
every repetition then starts with those pages given back, so RSS counts all the memory one all-reduce
touches, but the timing includes faulting fresh pages in (0.1-0.13 s of a 0.72-0.75 s plaintext all-reduce
of 4 x 400 MB here).

hivemind: rank 0 starts a DHT on 127.0.0.1, the others join it; one DecentralizedAverager per
peer with target_group_size = min_group_size = peers, so all peers form one group. Matchmaking
runs before the barrier (``step(require_trigger=True)`` until AWAITING_TRIGGER); the clock
covers only the all-reduce (``allow_allreduce()`` to the result), so hivemind is not charged
for matchmaking.

``--curve`` adds, next to each zmq backend listed, the same exchange encrypted
(``zmq-inplace-curve``, ``zmq-curve``: ``ZmqExchange(..., trust=Trust.static(key, rank, peers))``
with a swarm key made for the run, what ``gossiploco peer`` always runs: CurveZMQ connections, data chunks
sealed with AES-256-GCM on the sealed port, ``transport.zmq_sealed``) and the same with CurveZMQ alone
(``zmq-inplace-curvezmq``, ``zmq-curvezmq``: ``sealed_port=None``, as before the sealed port existed),
alternating with the plaintext one in the same peer processes, and reports encrypted / plain (target: at
most ``TARGET_CURVE`` = 1.3x on loopback).

``--overlap`` times inner steps of a LocalTrainer with no communication and while Mix1
all-reduces of its parameters are in flight, in five placements of training and communication
(``bench/allreduce_overlap.py``), and the peak RSS a Mix1 in flight adds to a training process.

    python bench/allreduce.py                                  # the recorded configuration
    python bench/allreduce.py --values 10_000_000 --reps 3 --backends zmq,gloo --overlap none
    python bench/allreduce.py --backends zmq-inplace --curve --reps 9 --overlap none   # what encryption costs

Every wait has a deadline; on any error, timeout or Ctrl+C the driver kills every peer's process
group (each peer leads its own session, so hivemind's helper processes go too). Debugging aids:
``BENCH_THREADS=1`` prints per-thread CPU time of rank 0 around each all-reduce,
``BENCH_DEBUG=<s>`` dumps every peer's stacks every <s> seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

from gossiploco.runtime.launch import free_ports

from testbed.machine import cpu_model
from testbed.spawned import (
    GroupFailed, become_session_leader, close_within, cpu_seconds, finish, load_impl, proc_status, reset_peak_rss,
    run_group, thread_cpu, thread_cpu_delta,
)

ROOT = Path(__file__).resolve().parent.parent

GEN_CHUNK = 1 << 22  # elements per independently seeded randn chunk
DEFAULT_ZMQ_IMPL = "gossiploco.transport.zmq_exchange:ZmqExchange"
TARGET_VS_GLOO = 1.5  # zmq time at most 1.5x gloo's
TARGET_VS_HIVEMIND = 10.0  # zmq at least 10x faster than hivemind
TARGET_OVERLAP_PCT = 3.0
TARGET_CURVE = 1.30  # encrypted at most 1.3x plaintext's time on loopback (issue 28)
CURVE_SUFFIX = "-curve"
CURVEZMQ_SUFFIX = "-curvezmq"
TARGET_EXTRA_BUFFERS = 3.0
MAX_ERR_OK = 1e-5  # float32 sums of 4 standard normals: the exact mean differs by a few 1e-7
COMPRESSED_MAX_ERR_OK = {"zmq-int8": 0.1, "zmq-4bit": 1.5}
"""The compressed group means (gossiploco.mixing.compressed) quantize each value twice onto a grid of
step absmax / 127 (int8) or absmax / 7 (4bit) per block of 4096 standard normals (absmax about 4): the
worst error is about 3/4 of a step from the senders' rounding plus half a step from the owner's."""
SUMS_DEV_OK = 1e-3


# -- inputs and checks ---------------------------------------------------------------------------

def chunk_seed(rank: int, rep: int, chunk: int) -> int:
    return ((rank + 1) * 1_000_003 + rep) * 1_000_003 + chunk


def random_chunk(rank: int, rep: int, chunk: int, n: int, out=None):
    import torch

    g = torch.Generator().manual_seed(chunk_seed(rank, rep, chunk))
    return torch.randn(n, generator=g) if out is None else torch.randn(n, generator=g, out=out)


def fill_random(x, rank: int, rep: int) -> None:
    """Rank ``rank``'s input of repetition ``rep``, written into the 1-d tensor ``x``."""
    total = x.numel()
    for c, start in enumerate(range(0, total, GEN_CHUNK)):
        random_chunk(rank, rep, c, min(GEN_CHUNK, total - start), out=x[start:start + GEN_CHUNK])


def check_result(result, world: int, rank: int, rep: int, total: int) -> dict:
    """This peer's share of the result check: the max abs error against the exact mean (float64
    sum of all ranks' regenerated inputs / world) over the chunks c with c % world == rank (the
    peers' shares cover every element once), and a float64 checksum of every chunk of its whole
    result, which the driver compares across peers (each chunk against the peer that checked it)."""
    import torch

    flat = result.reshape(-1)
    if flat.numel() != total or flat.dtype != torch.float32:
        raise AssertionError(f"result has {flat.numel()} {flat.dtype} elements, expected {total} float32")
    worst, sums = 0.0, []
    for c, start in enumerate(range(0, total, GEN_CHUNK)):
        n = min(GEN_CHUNK, total - start)
        mine = flat[start:start + n]
        sums.append(float(mine.sum(dtype=torch.float64)))
        if c % world != rank:
            continue
        acc = torch.zeros(n, dtype=torch.float64)
        for r in range(world):
            acc += random_chunk(r, rep, c, n)
        acc /= world
        err = float((mine.double() - acc).abs().max())
        worst = max(worst, err if err == err else float("inf"))  # NaN counts as a failure
    return {"max_err": worst, "sums": sums}


# -- backends (inside the peer processes) ----------------------------------------------------------

class ZmqPeer:
    inplace = False
    curve = False
    sealed = True
    """With ``curve``: data chunks sealed with AES-GCM on the sealed port (False: CurveZMQ alone)."""

    def __init__(self, rank: int, world: int, cfg: dict, info_q):
        cls = load_impl(cfg["zmq_impl"])
        self.world = world
        suffix = "" if not self.curve else CURVE_SUFFIX if self.sealed else CURVEZMQ_SUFFIX
        kind = getattr(self, "backend", "") or ("zmq-inplace" if self.inplace else "zmq") + suffix
        kwargs = dict(cfg["zmq_kwargs"])
        if self.curve:  # CurveZMQ with a static list's identities, derived from the run's swarm key
            from gossiploco.security.swarm_key import SwarmKey
            from gossiploco.security.trust import Trust

            kwargs["trust"] = Trust.static(SwarmKey.parse(cfg["swarm_key"]), rank, world)
            if not self.sealed:
                kwargs["sealed_port"] = None
        self.ex = cls(rank, cfg["endpoints"][kind], f"{cfg['run_id']}-{kind}", cfg["timeout_s"], **kwargs)
        if not self.ex.wait_connected(cfg["timeout_s"]):
            self.ex.close()
            raise RuntimeError(f"rank {rank}: zmq peers did not connect within {cfg['timeout_s']}s")

    def prepare(self, x, rep: int) -> None:
        self.x = x

    def run(self, rep: int):
        kwargs = {"inplace": True} if self.inplace else {}
        return self.ex.all_reduce_mean(f"mix1/{rep}", self.x, list(range(self.world)), **kwargs)

    def close(self) -> None:
        self.ex.close()


class ZmqInplacePeer(ZmqPeer):
    """``all_reduce_mean(..., inplace=True)``: the exchange reduces in the caller's tensor."""

    inplace = True


class ZmqCurvePeer(ZmqPeer):
    """The copying API over CurveZMQ (``trust=Trust.static``)."""

    curve = True


class ZmqInplaceCurvePeer(ZmqInplacePeer):
    """``inplace=True`` encrypted (``trust=Trust.static``): the data plane as ``gossiploco peer`` runs it."""

    curve = True


class ZmqCurveZmqPeer(ZmqCurvePeer):
    """The copying API over CurveZMQ alone (no sealed port)."""

    sealed = False


class ZmqInplaceCurveZmqPeer(ZmqInplaceCurvePeer):
    """``inplace=True`` over CurveZMQ alone (no sealed port): every byte through libzmq's XSalsa20-Poly1305."""

    sealed = False


class ZmqCompressedPeer(ZmqPeer):
    """The compressed group mean of ``mix2.compression`` (``group_mean``: quantized reduce-scatter by direct
    sends, then a quantized all-gather) over the same exchange, fp32 sums."""

    inplace = True
    compression = ""

    def __init__(self, rank: int, world: int, cfg: dict, info_q):
        from gossiploco.mixing.compression import build_codec

        super().__init__(rank, world, cfg, info_q)
        self.codec = build_codec(self.compression)

    def run(self, rep: int):
        from gossiploco.mixing.compressed import group_mean

        return group_mean(f"mix2/{rep}", self.x, list(range(self.world)), self.ex, self.codec, inplace=True)[0]


class ZmqInt8Peer(ZmqCompressedPeer):
    compression, backend = "int8", "zmq-int8"


class Zmq4bitPeer(ZmqCompressedPeer):
    compression, backend = "4bit", "zmq-4bit"


class GlooPeer:
    def __init__(self, rank: int, world: int, cfg: dict, info_q):
        from datetime import timedelta

        import torch.distributed as dist

        self.dist, self.world = dist, world
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=cfg["timeout_s"]))

    def prepare(self, x, rep: int) -> None:
        self.x = x

    def run(self, rep: int):
        self.dist.all_reduce(self.x)  # sum, in place
        self.x.div_(self.world)
        return self.x

    def close(self) -> None:
        self.dist.destroy_process_group()


class HivemindPeer:
    def __init__(self, rank: int, world: int, cfg: dict, info_q):
        import multiprocessing

        # A spawn child inherits the spawn start method; hivemind's helper processes expect fork.
        multiprocessing.set_start_method("fork", force=True)
        import hivemind
        import torch

        self.timeout_s = cfg["timeout_s"]
        self.matchmaking_s = cfg["hivemind_matchmaking_s"]
        host = ["/ip4/127.0.0.1/tcp/0"]
        if rank == 0:
            self.dht = hivemind.DHT(start=True, host_maddrs=host)
            maddrs = [str(a) for a in self.dht.get_visible_maddrs()]
            for _ in range(world - 1):
                info_q.put(maddrs)
        else:
            maddrs = info_q.get(timeout=self.timeout_s)
            self.dht = hivemind.DHT(start=True, host_maddrs=host, initial_peers=maddrs)
        self.averager = hivemind.averaging.DecentralizedAverager(
            [torch.zeros(cfg["values"])], self.dht, start=True, prefix="bench_allreduce",
            target_group_size=world, min_group_size=world, min_matchmaking_time=self.matchmaking_s,
            request_timeout=min(3.0, self.matchmaking_s / 2), allreduce_timeout=self.timeout_s, next_chunk_timeout=30.0,
            shutdown_timeout=5)
        self.control = None

    def prepare(self, x, rep: int) -> None:
        from hivemind.averaging.control import AveragingStage

        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(x)
        self.control = self.averager.step(wait=False, require_trigger=True, timeout=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while self.control.stage != AveragingStage.AWAITING_TRIGGER:
            if self.control.done():
                self.control.result(timeout=0)  # raises the step's failure
                raise RuntimeError("hivemind step finished before the trigger")
            if time.monotonic() > deadline:
                raise TimeoutError(f"hivemind matchmaking did not finish within {self.timeout_s}s")
            time.sleep(0.005)

    def run(self, rep: int):
        self.control.allow_allreduce()
        self.control.result(timeout=self.timeout_s)
        with self.averager.get_tensors() as tensors:
            return tensors[0]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.averager.shutdown()
        with contextlib.suppress(Exception):
            self.dht.shutdown()


BACKENDS = {"zmq": ZmqPeer, "zmq-inplace": ZmqInplacePeer, "zmq-curve": ZmqCurvePeer,
            "zmq-inplace-curve": ZmqInplaceCurvePeer, "zmq-curvezmq": ZmqCurveZmqPeer,
            "zmq-inplace-curvezmq": ZmqInplaceCurveZmqPeer, "zmq-int8": ZmqInt8Peer, "zmq-4bit": Zmq4bitPeer,
            "gloo": GlooPeer, "hivemind": HivemindPeer}


def peer_main(rank: int, world: int, cfg: dict, barrier, results, info_q, extra) -> None:
    """One peer: set up every backend of ``cfg["kinds"]``, then warm-up + timed repetitions."""
    become_session_leader()
    peers: dict = {}
    try:
        import torch

        torch.set_num_threads(cfg["threads"])
        for kind in cfg["kinds"]:
            start = time.monotonic()
            peers[kind] = BACKENDS[kind](rank, world, cfg, info_q)
            results.put(("ready", rank, {"backend": kind, "setup_s": time.monotonic() - start}))
        x = torch.empty(cfg["values"], dtype=torch.float32)
        t_wait = cfg["timeout_s"]
        for rep in range(cfg["warmup"] + cfg["reps"]):
            order = cfg["kinds"] if rep % 2 == 0 else cfg["kinds"][::-1]
            for kind in order:
                peer = peers[kind]
                fill_random(x, rank, rep)
                barrier.wait(t_wait)
                peer.prepare(x, rep)
                base = reset_peak_rss(trim=cfg["trim"])
                barrier.wait(t_wait)
                threads0 = thread_cpu() if os.environ.get("BENCH_THREADS") else None
                cpu0, t0 = cpu_seconds(), time.monotonic()
                out = peer.run(rep)
                t1, cpu1 = time.monotonic(), cpu_seconds()
                peak = proc_status("VmHWM")
                if threads0 is not None and rank == 0:
                    print(f"{kind} rank 0 rep {rep} threads: {thread_cpu_delta(threads0, thread_cpu())}", flush=True)
                check = check_result(out, world, rank, rep, cfg["values"]) if cfg["verify"] else \
                    {"max_err": 0.0, "sums": []}
                del out
                results.put(("rep", rank, {"backend": kind, "rep": rep, "t0": t0, "t1": t1, "rss_base": base,
                                           "rss_peak": peak, "cpu_s": cpu1 - cpu0, **check}))
        barrier.wait(t_wait)  # nobody closes while another still exchanges
    except BaseException:  # noqa: BLE001 - every failure goes to the driver, which kills the group
        results.put(("error", rank, traceback.format_exc()))
        finish(results, 1)
    # "done" goes out before close(): a close() that hangs must not cost the measurements.
    results.put(("done", rank, None))
    closed = [kind for kind, peer in peers.items() if close_within(peer.close, cfg["close_timeout_s"])]
    results.put(("closed", rank, closed))
    finish(results, 0)


# -- driver ---------------------------------------------------------------------------------------

def bench_group(kinds: list[str], args, attempts: int = 3) -> dict[str, dict]:
    """Run ``kinds`` side by side in one set of peer processes; per-backend summaries."""
    cfg = {
        "kinds": kinds, "values": args.values, "reps": args.reps, "warmup": args.warmup, "threads": args.threads,
        "timeout_s": args.timeout, "zmq_impl": args.zmq_impl, "zmq_kwargs": zmq_kwargs(args),
        "hivemind_matchmaking_s": args.hivemind_matchmaking,
        "close_timeout_s": 15.0, "verify": not args.no_verify, "trim": args.trim,
    }
    if any(k.endswith((CURVE_SUFFIX, CURVEZMQ_SUFFIX)) for k in kinds):
        from gossiploco.security.swarm_key import SwarmKey

        cfg["swarm_key"] = SwarmKey.generate().text  # this run's, shared by its peers (spawn pickles cfg)
    label = "+".join(kinds)

    def show(msg):
        if msg[0] == "rep" and msg[1] == 0:
            r = msg[2]
            print(f"  {r['backend']} rep {r['rep']}: rank 0 {r['t1'] - r['t0']:.3f}s, its share of the check: max err "
                  f"{r['max_err']:.1e}", flush=True)

    for attempt in range(attempts):
        zmq_kinds = [k for k in kinds if k.startswith("zmq")]
        ports = free_ports(args.peers * len(zmq_kinds) + 1)
        cfg.update(endpoints={k: [f"tcp://127.0.0.1:{p}" for p in ports[i * args.peers:(i + 1) * args.peers]]
                              for i, k in enumerate(zmq_kinds)},
                   port=ports[-1], run_id=f"bench-{os.getpid()}-{attempt}")
        start = time.monotonic()
        try:
            msgs = run_group(peer_main, args.peers, cfg, args.timeout + 60, label, show, cfg["close_timeout_s"])
            break
        except GroupFailed as exc:
            # A port taken between free_ports and bind shows up at setup; anything else is final.
            if attempt + 1 < attempts and ("Address already in use" in str(exc) or "cannot bind" in str(exc)):
                print(f"  {label}: port clash, retrying", flush=True)
                continue
            raise
    wall = time.monotonic() - start
    closed_by = [m[2] for m in msgs if m[0] == "closed"]
    out = {}
    for kind in kinds:
        reps: dict[int, list[dict]] = {}
        for m in msgs:
            if m[0] == "rep" and m[2]["backend"] == kind:
                reps.setdefault(m[2]["rep"], []).append({**m[2], "rank": m[1]})
        timed = []
        for rep in sorted(reps):
            rows = reps[rep]
            if len(rows) != args.peers:
                raise GroupFailed(f"{kind}: repetition {rep} has {len(rows)} of {args.peers} peers")
            by_rank = {r["rank"]: r for r in rows}
            sums_dev = 0.0
            for c in range(len(rows[0]["sums"])):
                ref = by_rank[c % args.peers]["sums"][c]
                sums_dev = max(sums_dev, max(abs(r["sums"][c] - ref) for r in rows))
            timed.append({
                "rep": rep,
                "sums_dev": sums_dev,
                "warmup": rep < args.warmup,
                "seconds": max(r["t1"] - r["t0"] for r in rows),
                "start_skew": max(r["t0"] for r in rows) - min(r["t0"] for r in rows),
                "max_err": max(r["max_err"] for r in rows),
                "extra_rss": max(r["rss_peak"] - r["rss_base"] for r in rows) / (4 * args.values),
                "cpu_s": statistics.mean(r["cpu_s"] for r in rows),
            })
        measured = [t for t in timed if not t["warmup"]]
        out[kind] = {
            "backend": kind,
            "median_s": statistics.median(t["seconds"] for t in measured),
            "reps": timed,
            "max_err": max(t["max_err"] for t in timed),
            "sums_dev": max(t["sums_dev"] for t in timed),
            "checked": cfg["verify"],
            "extra_rss_median": statistics.median(t["extra_rss"] for t in measured),
            "extra_rss_max": max(t["extra_rss"] for t in measured),
            "cpu_s_median": statistics.median(t["cpu_s"] for t in measured),
            "setup_s": max(m[2]["setup_s"] for m in msgs if m[0] == "ready" and m[2]["backend"] == kind),
            "close_failed": args.peers - sum(kind in c for c in closed_by),
            "group_wall_s": wall,
        }
    return out


def impl_file(spec: str) -> str:
    """Where the exchange class under test lives, relative to the repository when inside it."""
    import inspect

    with contextlib.suppress(Exception):
        path = Path(inspect.getfile(load_impl(spec))).resolve()
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return "?"


def zmq_kwargs(args) -> dict:
    kw = {}
    if args.chunk_bytes:
        kw["chunk_bytes"] = args.chunk_bytes
    if args.max_message_bytes:
        kw["max_message_bytes"] = args.max_message_bytes
    if args.io_threads:
        kw["io_threads"] = args.io_threads
    if args.stripes:
        kw["stripes"] = args.stripes
    return kw


def paired_ratios(results: dict, a: str, b: str) -> list[float]:
    """Per timed repetition, a's time / b's time (same peers, same inputs, back to back)."""
    ra = {t["rep"]: t["seconds"] for t in results[a]["reps"] if not t["warmup"]}
    rb = {t["rep"]: t["seconds"] for t in results[b]["reps"] if not t["warmup"]}
    return [ra[k] / rb[k] for k in sorted(ra) if k in rb]


# -- report ----------------------------------------------------------------------------------------

def machine() -> dict:
    import torch

    mem = 0
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    cpu = cpu_model()
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("zmq", "hivemind"):
        with contextlib.suppress(Exception):
            versions[mod] = importlib.import_module(mod).__version__
    with contextlib.suppress(Exception):
        import zmq

        versions["libzmq"] = zmq.zmq_version()
    return {"nproc": os.cpu_count(), "mem_gib": mem / 2**30, "cpu": cpu, "kernel": platform.release(), **versions}


def cpu_snapshot() -> dict:
    """System-wide busy and steal CPU seconds (/proc/stat) and this process tree's CPU seconds."""
    import resource

    snap = {"t": time.monotonic(), "busy": 0.0, "steal": 0.0, "ours": 0.0}
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
        snap["busy"] = (user + nice + system + irq + softirq) / tick
        snap["steal"] = steal / tick
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        snap["ours"] += ru.ru_utime + ru.ru_stime
    return snap


def background_load(before: dict, after: dict) -> dict:
    """Average share of all cores used by other processes, and stolen by the hypervisor, between
    two snapshots (approximate: helpers our peers started and that were killed are not counted
    as ours)."""
    cores = (os.cpu_count() or 1) * max(after["t"] - before["t"], 1e-9)
    other = (after["busy"] - before["busy"]) - (after["ours"] - before["ours"])
    return {"other_pct": max(0.0, 100 * other / cores), "steal_pct": 100 * (after["steal"] - before["steal"]) / cores,
            "loadavg_start": before.get("loadavg")}


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def write_report(path: Path, args, command: str, mach: dict, results: dict, overlap: list[dict],
                 total_s: float) -> None:
    mb = 4 * args.values / 1e6
    side = [k for k in results if k != "hivemind"]
    together = ", ".join(side[:-1]) + " and " + side[-1] if len(side) > 1 else "".join(side)
    lines = [
        "# All-reduce benchmark (loopback)",
        "",
        f"Regenerate: `{command}`",
        "",
        f"Machine: {mach['nproc']} CPU cores ({mach['cpu']}), {mach['mem_gib']:.1f} GiB RAM, Linux {mach['kernel']}; "
        f"Python {mach['python']}, torch {mach['torch']}, pyzmq {mach.get('zmq', '?')} "
        f"(libzmq {mach.get('libzmq', '?')}), "
        f"hivemind {mach.get('hivemind', '?')}. The machine is shared and noisy: medians are quoted, every number is "
        f"listed below. Whole run: {total_s:.0f} s; during it, other processes on this VM used about "
        f"{mach['load']['other_pct']:.0f}% of the cores and the hypervisor stole {mach['load']['steal_pct']:.0f}% "
        f"(1-minute load average at the start: {mach['load']['loadavg_start']:.2f}).",
        "",
        f"Payload: {args.values:,} float32 values ({mb:.0f} MB) per peer, {args.peers} peer processes on 127.0.0.1, "
        f"{args.threads} torch thread(s) per peer, {args.warmup} untimed warm-up + {args.reps} timed repetitions. "
        f"{together} run side by side in the same peer processes, alternating per repetition (same inputs, same "
        "load); hivemind runs in its own processes afterwards. Each repetition: fresh random input, barrier, "
        "every peer times its own all-reduce mean; the repetition's time is the maximum over peers. Then the result "
        "is checked against the exact mean (float64 sum of all ranks' regenerated inputs / peers), every element "
        "by one peer (the peers split the check), and every peer's whole result is compared with that through "
        "per-chunk float64 checksums. `max err`: worst absolute error (inputs are standard normal); `spread`: "
        f"largest checksum difference between peers (chunks of {GEN_CHUNK:,} values); the check passes when "
        f"max err < {MAX_ERR_OK:g} and spread < {SUMS_DEV_OK:g}.",
        "",
        f"- zmq: `{args.zmq_impl}` ({impl_file(args.zmq_impl)}) with {zmq_kwargs(args) or 'its default options'} "
        "(chunked ring reduce-scatter + "
        "all-gather; returns a new tensor). zmq-inplace (when listed): the same with `inplace=True`, reducing in "
        "the caller's tensor.",
        "- gloo: `torch.distributed.all_reduce` (sum, in place) then `div_`.",
        f"- hivemind: `DecentralizedAverager` with its defaults, target_group_size = min_group_size = {args.peers}; "
        "the clock starts at `allow_allreduce()` after matchmaking, so matchmaking is not charged.",
        "",
        "| backend | median s | min s | max s | payload GB/s at median | CPU s per peer (median) | result check | "
        "extra peak RSS per peer, x payload (median / max) |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for kind, res in results.items():
        secs = [t["seconds"] for t in res["reps"] if not t["warmup"]]
        rss = "n/a (the averager is a separate process)" if kind == "hivemind" else \
            f"{res['extra_rss_median']:.2f} / {res['extra_rss_max']:.2f}"
        cpu = "n/a" if kind == "hivemind" else f"{res['cpu_s_median']:.2f}"
        if not res["checked"]:
            check = "not checked (--no-verify)"
        else:
            ok = res["max_err"] < COMPRESSED_MAX_ERR_OK.get(kind, MAX_ERR_OK) and res["sums_dev"] < SUMS_DEV_OK
            check = f"{'ok' if ok else '**FAILED**'}: max err {res['max_err']:.1e}, spread {res['sums_dev']:.1e}"
        lines.append(f"| {kind} | {res['median_s']:.3f} | {min(secs):.3f} | {max(secs):.3f} | "
                     f"{mb / 1e3 / res['median_s']:.2f} | {cpu} | {check} | {rss} |")
    lines += ["", "Per repetition, seconds (max over peers; `w` = untimed warm-up; in brackets the spread of the "
              "peers' start times after the barrier):", ""]
    for kind, res in results.items():
        reps = ", ".join(f"{'w ' if t['warmup'] else ''}{t['seconds']:.3f} [{1e3 * t['start_skew']:.0f} ms]"
                         for t in res["reps"])
        lines.append(f"- {kind}: {reps}")
    closes = [f"{k}: {r['close_failed']} of {args.peers} peers" for k, r in results.items() if r["close_failed"]]
    if closes:
        lines += ["", f"close() did not return within 15 s (the peers were killed): {', '.join(closes)}."]
    lines += ["", "## Ratios and targets", ""]
    zmq, gloo, hm = results.get("zmq"), results.get("gloo"), results.get("hivemind")
    rows = ["| target | measured | verdict |", "|---|---|---|"]
    zin = results.get("zmq-inplace")
    # The runtime's all-reduces (GlobalMix: Mix1, global Mix2, sync-DP gradients; the monitor average)
    # pass inplace=True, so zmq-inplace is the data plane as it trains; zmq is the copying API.
    for kind, label in (("zmq-inplace", "zmq as the runtime calls it (inplace)"), ("zmq", "zmq, copying API")):
        res = results.get(kind)
        if res and gloo:
            ratio = res["median_s"] / gloo["median_s"]
            paired = paired_ratios(results, kind, "gloo")
            rows.append(f"| {label}: time <= {TARGET_VS_GLOO}x gloo's | median {kind} / median gloo = **{ratio:.2f}** "
                        f"(per repetition, back to back: {', '.join(f'{r:.2f}' for r in paired)}; median "
                        f"{statistics.median(paired):.2f}) | {verdict(ratio <= TARGET_VS_GLOO)} |")
        if res and hm:
            ratio = hm["median_s"] / res["median_s"]
            rows.append(f"| {label}: >= {TARGET_VS_HIVEMIND:.0f}x faster than hivemind | median hivemind / median "
                        f"{kind} = **{ratio:.1f}** | {verdict(ratio >= TARGET_VS_HIVEMIND)} |")
    for plain, suffix, what in [(p, s, w) for p in ("zmq-inplace", "zmq") for s, w in (
            (CURVE_SUFFIX, "Encryption (CurveZMQ + AES-GCM sealed data)"), (CURVEZMQ_SUFFIX, "CurveZMQ alone"))]:
        curve = plain + suffix
        if results.get(plain) and results.get(curve):
            ratio = results[curve]["median_s"] / results[plain]["median_s"]
            paired = paired_ratios(results, curve, plain)
            rows.append(f"| {what} ({plain}): time <= {TARGET_CURVE:.2f}x "
                        f"plaintext's | median {curve} {results[curve]['median_s']:.3f} s / median {plain} "
                        f"{results[plain]['median_s']:.3f} s = **{ratio:.3f}** (per repetition, back to back: "
                        f"{', '.join(f'{r:.3f}' for r in paired)}; median {statistics.median(paired):.3f}) | "
                        f"{verdict(ratio <= TARGET_CURVE)} |")
    for o in overlap:
        rows.append(f"| inner step with Mix1 in flight within {TARGET_OVERLAP_PCT:.0f}% of a quiet step "
                    f"({o['model']}, {o['mode']}) | **{o['overhead_pct']:+.1f}%** (without waiting for a core: "
                    f"{no_runq_overhead(o):+.1f}%) | {verdict(o['overhead_pct'] <= TARGET_OVERLAP_PCT)} |")
    if zmq:
        # Whole peer, beyond model and inner optimizer: z and the outer momentum (FactoredDiLoCo holds
        # both all the time) plus what a Mix1 in flight adds: measured in the overlap runs when there
        # is one with the exchange inside the training process, else estimated from the all-reduce
        # alone plus the packed vector it is given.
        inproc = [o for o in overlap if o["mode"] in ("pinned", "shared")]
        if inproc:
            big = max(inproc, key=lambda o: (o["params"], o["mode"] == "pinned"))
            mix_extra, how = big["mix_extra_rss"], f"Mix1 in flight adds {big['mix_extra_rss']:.2f} (measured: " \
                f"{big['model']}, {big['mode']})"
        else:
            mix_extra = (zin or zmq)["extra_rss_max"] + 1
            how = f"Mix1 in flight adds about {mix_extra:.2f} (estimated: packed vector + in-place all-reduce)"
        whole = mix_extra + 2
        rows.append(f"| peak RSS per peer: at most {TARGET_EXTRA_BUFFERS:.0f} parameter-sized fp32 buffers beyond "
                    f"model and inner optimizer | {how}; + z and outer momentum = **{whole:.1f}**. The zmq all-reduce "
                    f"alone: {zmq['extra_rss_max']:.2f} beyond its input"
                    f"{' (zmq-inplace: %.2f)' % zin['extra_rss_max'] if zin else ''}"
                    f"{' (gloo: %.2f)' % gloo['extra_rss_max'] if gloo else ''}"
                    f" | {verdict(whole <= TARGET_EXTRA_BUFFERS)} |")
    lines += rows
    trimmed = " and malloc_trim" if args.trim else (
        "; no malloc_trim: memory that earlier repetitions freed and malloc kept is reused, not counted")
    lines += [
        "",
        "Peak RSS of the all-reduce alone is VmHWM during it minus VmRSS just before it, per peer, with the input "
        f"tensor already resident (VmHWM reset through /proc/self/clear_refs after gc{trimmed}), in units of "
        "the payload (4 x values bytes). It counts the result: zmq returns a new tensor (at least 1.0), gloo "
        "reduces in place. For the whole peer, the overlap runs below measure what a Mix1 in flight adds to a "
        "training process's peak (packed vector, the exchange's buffers, the result), to which z and the outer "
        "momentum (held by FactoredDiLoCo throughout) are added. Not counted: end_round's own buffers (y, the "
        "pseudo-gradient and Mix2's all-reduce, which can overlap a late Mix1).",
    ]
    if overlap:
        lines += ["", "## Inner step with Mix1 in flight", ""]
        lines += overlap_section(overlap, args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def no_runq_overhead(o: dict) -> float:
    """In-flight step over quiet step, both without their run-queue wait, minus 1, in percent."""
    q, f = o["quiet_split"], o["inflight_split"]
    return 100 * ((f["cpu"] + f["blocked"]) / (q["cpu"] + q["blocked"]) - 1)


def overlap_section(overlap: list[dict], args) -> list[str]:
    lines = [
        "Two exchange peers (`ZmqExchange`) on loopback. A training process runs a LocalTrainer (fp32 AdamW, "
        "synthetic random byte tokens, 1 torch thread) and times each inner step in alternating phases (cycles x "
        "steps per phase: " + ", ".join(sorted({f"{o['model']} {o['cycles']} x {o['steps']}" for o in overlap}))
        + "): *quiet* (no communication anywhere) and *Mix1* (Mix1 runs back to back: `GlobalMix.mix([z], r, "
        f"exchange)`, the operator FactoredDiLoCo's Mix1 calls, with `mix1.compression = {args.overlap_compression}`: "
        "pack, (encode,) all-reduce over both peers, check, unpack; "
        "a step counts as in flight if an all-reduce was still running when it ended, and the phase ends after "
        "as many counted steps as a quiet phase has). Overhead = median in-flight step / median quiet step - 1. "
        "The training thread's CPU time per step is shown too: when it stays flat while the wall time grows, the "
        "step was waiting (for the GIL or for a core), not computing more.",
        "",
        "This VM has 2 cores, so training and communication contend however they are placed; the placements "
        "bound the effect:",
        "",
        "- `pinned`: peer 0 trains and runs its exchange on a background thread (as `FactoredDiLoCo` does); its "
        "training thread is pinned to CPU 0, its exchange threads (zmq I/O, receiver, service, Mix1) and all of "
        "peer 1 (communication only, no model) to CPU 1. Training has a core to itself but shares the GIL with "
        "the exchange threads, which share the other core with peer 1.",
        "- `process`: the same placement, but the exchange of peer 0 runs in a separate process from training "
        "(3 processes: 2 communication-only peers on CPU 1, training alone on CPU 0, no exchange in it). "
        "Pinned vs process isolates what sharing the GIL costs; what remains is memory-bandwidth and cache "
        "interference.",
        "- `shared`: both peers train and exchange, nothing pinned: 2 training threads plus all communication "
        "threads on 2 cores, the exchange's CPU time (copies, reduction, codec, kernel TCP) taken from training.",
        "- `companion` and `companion-shared`: `pinned` and `shared` with each training peer's exchange in its "
        "companion process (`compute.companion = on`, `gossiploco.companion.CompanionExchange`, what a peer runs): "
        "the Mix1 operator (pack, codec, unpack) stays on the training process's background thread, the exchange "
        "(sockets, protocol, reductions) runs in the companion, tensors cross in shared memory. Pinned, the "
        "companion inherits CPU 1.",
        f"- `companion-nice` and `companion-shared-nice`: the same with the companion (every thread of it) at niceness "
        f"+{args.companion_niceness} (`compute.companion_niceness`): where a core is wanted by both, training gets it "
        "first and Mix1 takes longer (its all-reduce time during training below).",
        "",
        "| model | params | mode | batch x seq | quiet step, median s | in-flight step, median s | overhead | "
        "training-thread CPU s per step, quiet / in flight | steps quiet / in flight | Mix1 all-reduce s, alone / "
        "during training (median) | in-flight steps per all-reduce |",
        "|---|---:|---|---|---:|---:|---:|---|---|---|---:|",
    ]
    for o in overlap:
        lines.append(
            f"| {o['model']} | {o['params'] / 1e6:.1f}M | {o['mode']} | {o['batch']} x {o['seq']} | "
            f"{o['quiet_s']:.4f} | {o['inflight_s']:.4f} | **{o['overhead_pct']:+.1f}%** | "
            f"{o['quiet_cpu_s']:.4f} / {o['inflight_cpu_s']:.4f} | {o['n_quiet']} / {o['n_inflight']} | "
            f"{o['mix_alone_s']:.3f} / {o['mix_s']:.3f} | {o['steps_per_mix']:.1f} |")
    lines += ["", "Where an in-flight step's extra time goes (means per step, seconds, quiet -> in flight; from the "
              "training thread's CPU time and its run-queue wait in /proc/thread-self/schedstat): *cpu* = computing, "
              "*run queue* = runnable but no core free (our communication threads, or other processes on this VM), "
              "*blocked* = the rest: waiting for the GIL, a lock or a page fault.", "",
              "| model | mode | wall | cpu | run queue | blocked | overhead without run-queue wait |",
              "|---|---|---|---|---|---|---:|"]
    for o in overlap:
        q, f = o["quiet_split"], o["inflight_split"]
        lines.append(f"| {o['model']} | {o['mode']} | " + " | ".join(
            f"{q[k]:.4f} -> {f[k]:.4f}" for k in ("wall", "cpu", "runq", "blocked")) +
            f" | {no_runq_overhead(o):+.1f}% |")
    lines += ["", "The last column, (cpu + blocked) in flight over (cpu + blocked) quiet, estimates the overhead on a "
              "machine where a core is free for communication and nothing else runs: it keeps what the exchange "
              "costs the training thread itself (GIL, memory bandwidth, caches) and drops the waiting for a core, "
              "which on this 2-core VM comes from our own communication threads (shared) or from other processes "
              "pushed onto the training core while the exchange occupies the other one (pinned, process)."]
    lines += ["", "Peak RSS of a training process during the Mix1 phases over its peak during the quiet phases, in "
              "parameter-sized fp32 buffers (what a Mix1 in flight adds on top of training; in `process` mode the "
              "exchange lives in other processes): " + ", ".join(
                  f"{o['model']} {o['mode']}: {o['mix_extra_rss']:+.2f}" for o in overlap) + ". FactoredDiLoCo also "
              "holds z and the outer momentum (2 more buffers) all the time."]
    lines += ["", "Per computing peer (quiet median / in-flight median, seconds):", ""]
    for o in overlap:
        per = ", ".join(f"rank {p['rank']}: {p['quiet_s']:.4f} / {p['inflight_s']:.4f} ({p['overhead_pct']:+.1f}%)"
                        for p in o["per_peer"])
        lines.append(f"- {o['model']} {o['mode']}: {per}")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", type=lambda s: int(s.replace("_", "")), default=100_000_000)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backends", default="zmq,zmq-inplace,gloo,hivemind",
                   help="any of zmq, zmq-inplace, zmq-curve, zmq-inplace-curve, gloo, hivemind")
    p.add_argument("--curve", action="store_true",
                   help="also run each zmq backend listed with CurveZMQ (zmq-curve, zmq-inplace-curve), alternating "
                        "with the plaintext one, and report curve / plain")
    p.add_argument("--threads", type=int, default=1, help="torch threads per peer (the peers share the cores)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of one exchange, barrier or setup step (s)")
    p.add_argument("--zmq-impl", default=DEFAULT_ZMQ_IMPL, help="module:Class or /path/file.py:Class")
    p.add_argument("--chunk-bytes", type=int, default=0, help="ZmqExchange chunk_bytes (0: its default)")
    p.add_argument("--max-message-bytes", type=int, default=0)
    p.add_argument("--io-threads", type=int, default=0, help="ZmqExchange io_threads (0: its default, half the cores, 1 to 8)")
    p.add_argument("--stripes", type=int, default=0, help="ZmqExchange stripes: data connections per peer (0: its default, the I/O threads)")
    p.add_argument("--hivemind-matchmaking", type=float, default=2.0, help="hivemind min_matchmaking_time (s)")
    p.add_argument("--overlap", default="pinned,process,shared,companion,companion-shared",
                   help="comma-separated modes (pinned, process, shared, companion, companion-shared, companion-nice, "
                        "companion-shared-nice) or none")
    p.add_argument("--companion-niceness", type=int, default=19,
                   help="the companion's niceness in the companion-nice and companion-shared-nice modes")
    p.add_argument("--overlap-models", default="125m,small")
    p.add_argument("--overlap-steps", type=int, default=0, help="steps per phase (0: per-model default)")
    p.add_argument("--overlap-cycles", type=int, default=0, help="quiet/Mix1 phase pairs (0: per-model default)")
    p.add_argument("--overlap-batch", type=int, default=1)
    p.add_argument("--overlap-compression", default="none", help="mix1.compression of the overlapped Mix1 (none: fp32)")
    p.add_argument("--overlap-seq", type=int, default=64)
    p.add_argument("--no-verify", action="store_true", help="skip the result check (profiling only)")
    p.add_argument("--trim", action="store_true",
                   help="malloc_trim before each repetition (RSS from a trimmed heap; timings then fault in fresh pages)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "allreduce.md")
    p.add_argument("--json", type=Path, default=None, help="also dump the raw numbers here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reps < 1 or args.peers < 2 or args.values < args.peers:
        raise SystemExit("need --reps >= 1, --peers >= 2 and --values >= --peers")
    command = " ".join(["python bench/allreduce.py", *(sys.argv[1:] if argv is None else argv)])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks that kill the peers
    start = time.monotonic()
    mach = machine()
    snap0 = cpu_snapshot()
    snap0["loadavg"] = os.getloadavg()[0]
    kinds = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.curve:  # each zmq backend's encrypted twin right after it (the order alternates per repetition)
        kinds = list(dict.fromkeys(k for kind in kinds for k in
                                   ([kind, kind + CURVE_SUFFIX, kind + CURVEZMQ_SUFFIX] if kind in ("zmq", "zmq-inplace")
                                    else [kind])))
    unknown = sorted(set(kinds) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {sorted(BACKENDS)}")
    groups = [g for g in ([k for k in kinds if k != "hivemind"], [k for k in kinds if k == "hivemind"]) if g]
    results: dict[str, dict] = {}
    for group in groups:
        print(f"[{'+'.join(group)}] {args.peers} peers, {args.values:,} values, {args.warmup}+{args.reps} reps",
              flush=True)
        results.update(bench_group(group, args))
        for kind in group:
            r = results[kind]
            print(f"[{kind}] median {r['median_s']:.3f}s, max err {r['max_err']:.1e}, extra RSS "
                  f"{r['extra_rss_max']:.2f}x, CPU s per peer {r['cpu_s_median']:.2f}", flush=True)
    results = {k: results[k] for k in kinds}
    overlap: list[dict] = []
    modes = [] if args.overlap == "none" else [m for m in args.overlap.split(",") if m]
    if modes:
        from allreduce_overlap import run_overlap

        for model in [m for m in args.overlap_models.split(",") if m]:
            for mode in modes:
                print(f"[overlap] {model} {mode}", flush=True)
                o = run_overlap(model, mode, args)
                overlap.append(o)
                print(f"[overlap] {model} {mode}: quiet {o['quiet_s']:.4f}s, in flight {o['inflight_s']:.4f}s, "
                      f"{o['overhead_pct']:+.1f}%, all-reduce {o['mix_s']:.3f}s ({o['wall_s']:.0f}s)", flush=True)
    total = time.monotonic() - start
    mach["load"] = background_load(snap0, cpu_snapshot())
    write_report(args.out, args, command, mach, results, overlap, total)
    if args.json:
        args.json.write_text(json.dumps({"machine": mach, "results": results, "overlap": overlap}, indent=1))
    print(f"wrote {args.out} ({total:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
