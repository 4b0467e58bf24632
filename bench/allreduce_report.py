"""The report of ``bench/allreduce.py``: the machine and its background load, the results table, the ratios
against the targets, and the section on inner steps with Mix1 in flight (``bench/allreduce_overlap.py``'s
numbers), written as markdown (``bench/results/allreduce.md`` unless ``--out`` says otherwise).

Imports the peer side's constants (``bench/allreduce_backends.py``); the driver (``bench/allreduce.py``)
imports from here, never the reverse."""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import statistics
import time
from pathlib import Path

from testbed.machine import cpu_model
from testbed.spawned import load_impl

if __package__:  # imported as bench.allreduce_report (the repository root on sys.path, as under pytest)
    from bench.allreduce_backends import CURVE_SUFFIX, CURVEZMQ_SUFFIX, GEN_CHUNK, zmq_kwargs
else:  # run from bench/allreduce.py as a script: bench/ is on sys.path
    from allreduce_backends import CURVE_SUFFIX, CURVEZMQ_SUFFIX, GEN_CHUNK, zmq_kwargs

ROOT = Path(__file__).resolve().parent.parent

TARGET_VS_GLOO = 1.5  # zmq time at most 1.5x gloo's
TARGET_VS_HIVEMIND = 10.0  # zmq at least 10x faster than hivemind
TARGET_OVERLAP_PCT = 3.0
TARGET_CURVE = 1.30  # encrypted at most 1.3x plaintext's time on loopback (issue 28)
TARGET_EXTRA_BUFFERS = 3.0
MAX_ERR_OK = 1e-5  # float32 sums of 4 standard normals: the exact mean differs by a few 1e-7
COMPRESSED_MAX_ERR_OK = {"zmq-int8": 0.1, "zmq-4bit": 1.5}
"""The compressed group means (gossiploco.mixing.compressed) quantize each value twice onto a grid of
step absmax / 127 (int8) or absmax / 7 (4bit) per block of 4096 standard normals (absmax about 4): the
worst error is about 3/4 of a step from the senders' rounding plus half a step from the owner's."""
SUMS_DEV_OK = 1e-3


# -- report ----------------------------------------------------------------------------------------

def impl_file(spec: str) -> str:
    """Where the exchange class under test lives, relative to the repository when inside it."""
    import inspect

    with contextlib.suppress(Exception):
        path = Path(inspect.getfile(load_impl(spec))).resolve()
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return "?"


def paired_ratios(results: dict, a: str, b: str) -> list[float]:
    """Per timed repetition, a's time / b's time (same peers, same inputs, back to back)."""
    ra = {t["rep"]: t["seconds"] for t in results[a]["reps"] if not t["warmup"]}
    rb = {t["rep"]: t["seconds"] for t in results[b]["reps"] if not t["warmup"]}
    return [ra[k] / rb[k] for k in sorted(ra) if k in rb]


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
        f"{args.threads or 'the default number of'} torch thread(s) per peer, {args.warmup} untimed warm-up + "
        f"{args.reps} timed repetitions. "
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
