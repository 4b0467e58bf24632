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
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from gossiploco.runtime.launch import free_ports

from testbed.spawned import GroupFailed, run_group

if __package__:  # imported as bench.allreduce (the repository root on sys.path, as under pytest)
    from bench.allreduce_backends import BACKENDS, CURVE_SUFFIX, CURVEZMQ_SUFFIX, peer_main, zmq_kwargs
    from bench.allreduce_report import ROOT, background_load, cpu_snapshot, machine, write_report
else:  # run as a script (python bench/allreduce.py): bench/ is on sys.path
    from allreduce_backends import BACKENDS, CURVE_SUFFIX, CURVEZMQ_SUFFIX, peer_main, zmq_kwargs
    from allreduce_report import ROOT, background_load, cpu_snapshot, machine, write_report

DEFAULT_ZMQ_IMPL = "gossiploco.transport.zmq_exchange:ZmqExchange"


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
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per peer (the peers share the cores; 0: torch's default, one per core, what a "
                        "peer process runs)")
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
