"""Inner-step time with Mix1 in flight versus with no communication (part of ``bench/allreduce.py``).

Two exchange peers (``ZmqExchange``) on loopback. A training process builds a LocalTrainer (the
model, fp32 AdamW, a synthetic byte-token stream: random tokens, so no corpus is read) with 1
torch thread and times every inner step, in alternating phases:

* quiet: ``steps`` inner steps, no communication anywhere;
* Mix1: Mix1 runs back to back (``GlobalMix("mix1", ...).mix([z], r, exchange)``, the operator
  FactoredDiLoCo's Mix1 uses: pack the parameters into one flat fp32 vector, all-reduce it over
  both peers, check and unpack; then again with the next r) while training goes on. With
  ``--overlap-compression`` the operator compresses as ``mix1.compression`` does (encoding, decoding
  and the fp32 sums in the same process). A step
  counts as *in flight* if an all-reduce was still running when it ended. When a training
  process has ``steps`` such steps, the peers agree on a last all-reduce index (the highest
  index any peer has started, under a shared lock) so every peer runs the same number of
  all-reduces, and the phase ends.

Placements (``roles``): ``pinned`` (peer 0 trains with its exchange on a background thread,
training thread on CPU 0, everything else on CPU 1), ``process`` (the same placement but the
exchange in processes of its own: isolates the GIL), ``shared`` (both peers train, nothing
pinned), and ``companion`` and ``companion-shared``: ``pinned`` and ``shared`` with each training peer's exchange in
its companion process (``compute.companion``: the ``CompanionExchange`` a peer runs; the companion inherits the
communication CPU where pinned); ``companion-nice`` and ``companion-shared-nice``: the same with the companion at
``--companion-niceness`` (``compute.companion_niceness``). Per step the training thread's CPU time and run-queue wait are recorded, so the extra
wall time splits into computing, waiting for a core and being blocked (GIL, locks, faults).
The peak RSS of each training process is read per phase (VmHWM, reset between phases).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import traceback

from gossiploco.runtime.launch import free_ports

from testbed.spawned import (
    GroupFailed, become_session_leader, close_within, finish, load_impl, proc_status, reset_peak_rss, run_group,
)

DEFAULT_STEPS = {"tiny": 40, "small": 15, "125m": 4}  # inner steps per phase
DEFAULT_CYCLES = {"tiny": 3, "small": 3, "125m": 2}  # quiet + Mix1 phase pairs
LIMIT_NONE = 2**30


def _shared(ctx):
    """Lock; agreed limit on all-reduce indices; highest index each comm rank started; how many
    comm ranks are still in their Mix1 loop."""
    return (ctx.Lock(), ctx.Value("q", LIMIT_NONE, lock=False), ctx.Array("q", 8, lock=False),
            ctx.Value("q", 0, lock=False))


def runqueue_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (/proc/thread-self/schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def roles(mode: str) -> list[tuple[bool, bool]]:
    """(trains, communicates) per process of a mode."""
    return {"pinned": [(True, True), (False, True)],
            "shared": [(True, True), (True, True)],
            "process": [(False, True), (False, True), (True, False)],
            "companion": [(True, True), (False, True)],
            "companion-shared": [(True, True), (True, True)]}[mode.removesuffix("-nice")]  # niced: the same roles


def overlap_peer(rank: int, world: int, cfg: dict, barrier, results, info_q, extra) -> None:
    become_session_leader()
    holder: list = []  # the exchange, once made, so that it is closed however the run ends
    try:
        _overlap_peer(rank, world, cfg, barrier, results, info_q, extra, holder)
    except BaseException:  # noqa: BLE001 - every failure goes to the driver, which kills the group
        results.put(("error", rank, traceback.format_exc()))
        finish(results, 1)
    results.put(("done", rank, None))
    if not holder or close_within(holder[0].close, cfg["close_timeout_s"]):  # a trainer-only process has none
        results.put(("closed", rank, None))
    finish(results, 0)


def _overlap_peer(rank, world, cfg, barrier, results, info_q, extra, holder) -> None:
    import numpy as np
    import torch

    lock, limit, started, busy = extra
    torch.set_num_threads(1)
    mode = cfg["mode"]
    trains, communicates = roles(mode)[rank]
    comm_ranks = [r for r, (_, c) in enumerate(roles(mode)) if c]
    pin = mode.removesuffix("-nice") in ("pinned", "process", "companion")
    ncpu = os.cpu_count() or 1
    train_cpus, comm_cpus = {0}, set(range(1, ncpu)) or {0}
    if pin:
        # Threads started from here on (the exchange's) inherit this; the training thread moves later.
        os.sched_setaffinity(0, comm_cpus if communicates else train_cpus)
    t_wait = cfg["timeout_s"]
    ex = None
    if communicates:
        if trains and mode.startswith("companion"):  # the peer's exchange in its companion process, as a peer runs it
            from gossiploco.companion.exchange import CompanionExchange

            niceness = cfg["companion_niceness"] if mode.endswith("-nice") else 0
            ex = CompanionExchange(rank=comm_ranks.index(rank), endpoints=cfg["endpoints"], run_id=cfg["run_id"],
                                   timeout_s=t_wait, niceness=niceness)
        else:
            ex = load_impl(cfg["zmq_impl"])(comm_ranks.index(rank), cfg["endpoints"], cfg["run_id"], t_wait)
        holder.append(ex)
        if not ex.wait_connected(t_wait):
            raise RuntimeError(f"rank {rank}: peers did not connect within {t_wait}s")

    if trains:
        from gossiploco.config import InnerOptConfig
        from gossiploco.data import TokenStream
        from gossiploco.model import build_model
        from gossiploco.optim import InnerOptimizer
        from gossiploco.trainer import LocalTrainer

        model = build_model(cfg["model"], 256, cfg["seq"], 0, torch.device("cpu"))
        tokens = np.random.default_rng(1234).integers(0, 256, size=1 << 20, dtype=np.uint8)
        trainer = LocalTrainer(model, InnerOptimizer(model, InnerOptConfig(warmup_steps=10), 100_000),
                               TokenStream(tokens, cfg["seq"], cfg["batch"], 0, rank))
        z = trainer.params_cpu()
        numel = sum(v.numel() for v in z.values())
        trainers = [r for r, (t, _) in enumerate(roles(mode)) if t]
        if rank == trainers[0]:  # tells the processes without a model the parameter count
            for _ in range(world - len(trainers)):
                info_q.put(numel)
    else:
        numel = info_q.get(timeout=t_wait)
    if communicates:
        from gossiploco.mixing.operators import GlobalMix

        if not trains:  # a parameter-sized stand-in for z
            z = {"flat": torch.randn(numel)}
        from gossiploco.mixing.compression import build_codec

        # a compressed Mix1 (``--overlap-compression``) mixes against its reference from the second index on
        mixer = GlobalMix("mix1", list(z), cfg["seed"], build_codec(cfg["compression"]))

        def mix1(round_index: int) -> None:
            """One Mix1 of z, as FactoredDiLoCo runs it; a failure (identity fallback) is an error here."""
            result = mixer.mix([z], round_index, ex)
            if not result.ok:
                raise RuntimeError(f"Mix1 round {round_index} failed: {result.cause}")
    if pin and trains and communicates:
        os.sched_setaffinity(0, train_cpus)  # this (the training) thread only

    def claim(i: int) -> bool:
        with lock:
            if i >= limit.value:
                return False
            started[rank] = i
            return True

    def stop() -> None:
        with lock:
            limit.value = min(limit.value, max(started[r] for r in comm_ranks) + 1)

    mix_seconds: list[float] = []

    def mix_loop(base: int, errors: list) -> None:
        try:
            if pin and trains:
                os.sched_setaffinity(0, comm_cpus)
            i = 0
            while claim(i):
                start = time.perf_counter()
                mix1(base + i)
                mix_seconds.append(time.perf_counter() - start)
                i += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            with lock:
                busy.value -= 1

    def reset_phase() -> None:
        if rank == 0:
            limit.value = LIMIT_NONE
            busy.value = len(comm_ranks)
            for r in comm_ranks:
                started[r] = -1
        barrier.wait(t_wait)

    quiet, inflight, mixes = [], [], []
    quiet_cpu, inflight_cpu = [], []  # CPU time of the training thread per step
    quiet_runq, inflight_runq = [], []  # time it waited for a CPU per step
    peaks: dict[str, list[int]] = {"quiet": [], "mix": []}  # VmHWM per phase
    if trains:
        for _ in range(cfg["warmup_steps"]):
            trainer.inner_step()
    # Two all-reduces with no training anywhere: the first warms connections, buffers and the
    # allocator; the second gives the all-reduce's own duration for reference.
    alone_s = None
    for i in range(2):
        barrier.wait(t_wait)
        start = time.perf_counter()
        if communicates:
            mix1(i)
            alone_s = time.perf_counter() - start
    steps = cfg["steps"]
    for cycle in range(cfg["cycles"]):
        reset_peak_rss()
        barrier.wait(t_wait)  # quiet phase
        if trains:
            for _ in range(steps):
                t, c, w = time.perf_counter(), time.thread_time(), runqueue_wait_s()
                trainer.inner_step()
                quiet.append(time.perf_counter() - t)
                quiet_cpu.append(time.thread_time() - c)
                quiet_runq.append(runqueue_wait_s() - w)
        peaks["quiet"].append(proc_status("VmHWM"))
        reset_peak_rss()
        reset_phase()  # Mix1 phase: in flight while any comm rank is still in its loop
        base = (cycle + 1) * 100_000
        mix_seconds.clear()
        errors: list = []
        thread = None
        if communicates:
            thread = threading.Thread(target=mix_loop, args=(base, errors), name="mix1", daemon=True)
            thread.start()
        if trains:
            counted = 0
            deadline = time.monotonic() + t_wait * 4
            while busy.value > 0:
                t, c, w = time.perf_counter(), time.thread_time(), runqueue_wait_s()
                trainer.inner_step()
                if busy.value > 0:
                    inflight.append(time.perf_counter() - t)
                    inflight_cpu.append(time.thread_time() - c)
                    inflight_runq.append(runqueue_wait_s() - w)
                    counted += 1
                    if counted == steps:
                        stop()
                if time.monotonic() > deadline:
                    stop()
                    raise TimeoutError("Mix1 phase did not end")
        if thread is not None:
            thread.join(t_wait * 4)
            if thread.is_alive():
                raise TimeoutError("Mix1 thread did not end")
        if errors:
            raise errors[0]
        peaks["mix"].append(proc_status("VmHWM"))
        mixes += mix_seconds
    barrier.wait(t_wait)
    results.put(("overlap", rank, {"trains": trains, "quiet": quiet, "inflight": inflight, "mix_s": mixes,
                                   "quiet_cpu": quiet_cpu, "inflight_cpu": inflight_cpu,
                                   "quiet_runq": quiet_runq, "inflight_runq": inflight_runq,
                                   "numel": numel, "alone_s": alone_s, "peaks": peaks}))


def run_overlap(model: str, mode: str, args) -> dict:
    """One (model, mode) measurement; returns the summary the report prints."""
    world = len(roles(mode))
    ports = free_ports(sum(c for _, c in roles(mode)))
    cfg = {
        "model": model, "mode": mode, "batch": args.overlap_batch, "seq": args.overlap_seq,
        "steps": args.overlap_steps or DEFAULT_STEPS.get(model, 10),
        "cycles": args.overlap_cycles or DEFAULT_CYCLES.get(model, 2),
        "warmup_steps": 2, "seed": 0, "timeout_s": args.timeout, "compression": args.overlap_compression,
        "companion_niceness": args.companion_niceness, "zmq_impl": args.zmq_impl, "close_timeout_s": 15.0,
        "endpoints": [f"tcp://127.0.0.1:{p}" for p in ports], "run_id": f"overlap-{os.getpid()}-{model}-{mode}",
    }
    began = time.monotonic()
    msgs = run_group(overlap_peer, world, cfg, args.timeout * 4 + 60, f"overlap-{model}-{mode}",
                     close_timeout_s=cfg["close_timeout_s"], shared=_shared)
    rows = [m for m in msgs if m[0] == "overlap" and m[2]["trains"]]
    if not rows:
        raise GroupFailed("overlap: no computing peer reported")
    per_peer = []
    for m in rows:
        r = m[2]
        if not r["quiet"] or not r["inflight"]:
            raise GroupFailed(f"overlap {model} {mode}: rank {m[1]} has no quiet or no in-flight steps")
        q, f = statistics.median(r["quiet"]), statistics.median(r["inflight"])
        per_peer.append({"rank": m[1], "quiet_s": q, "inflight_s": f, "overhead_pct": 100 * (f / q - 1)})
    quiet = [s for m in rows for s in m[2]["quiet"]]
    inflight = [s for m in rows for s in m[2]["inflight"]]
    mix = [s for m in msgs if m[0] == "overlap" for s in m[2]["mix_s"]]
    q, f = statistics.median(quiet), statistics.median(inflight)
    qc = statistics.median(s for m in rows for s in m[2]["quiet_cpu"])
    fc = statistics.median(s for m in rows for s in m[2]["inflight_cpu"])

    def split(phase: str) -> dict:
        """Mean per step: CPU time, waiting for a CPU, and the rest (blocked: GIL, locks, faults)."""
        wall = [s for m in rows for s in m[2][phase]]
        cpu = [s for m in rows for s in m[2][phase + "_cpu"]]
        runq = [s for m in rows for s in m[2][phase + "_runq"]]
        n = len(wall)
        return {"wall": sum(wall) / n, "cpu": sum(cpu) / n, "runq": sum(runq) / n,
                "blocked": max(0.0, (sum(wall) - sum(cpu) - sum(runq)) / n)}
    return {
        "quiet_cpu_s": qc, "inflight_cpu_s": fc, "quiet_split": split("quiet"), "inflight_split": split("inflight"),
        "mix_alone_s": max(m[2]["alone_s"] or 0.0 for m in msgs if m[0] == "overlap"),
        "wall_s": time.monotonic() - began,
        "model": model, "mode": mode, "cycles": cfg["cycles"], "steps": cfg["steps"], "batch": cfg["batch"],
        "seq": cfg["seq"], "params": rows[0][2]["numel"],
        "quiet_s": q, "inflight_s": f, "overhead_pct": 100 * (f / q - 1),
        "n_quiet": len(quiet), "n_inflight": len(inflight), "mix_s": statistics.median(mix) if mix else 0.0,
        "steps_per_mix": (statistics.median(mix) / f) if mix else 0.0, "per_peer": per_peer,
        # Peak RSS of a training process in Mix1 phases over its peak in quiet phases, in
        # parameter-sized fp32 buffers (max over training processes).
        "mix_extra_rss": max((max(m[2]["peaks"]["mix"]) - max(m[2]["peaks"]["quiet"])) / (4 * m[2]["numel"])
                             for m in rows),
        "quiet_all": quiet, "inflight_all": inflight,
    }
