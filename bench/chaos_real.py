"""Real-process chaos bench (issue 12, item 3): real ``gossiploco peer --join`` processes, one fault per trial.

    python bench/chaos.py real --trials 50                      # through the lead's front end
    python bench/chaos_real.py --trials 5 --out runs/chaos-real  # standalone, same options
    sudo .venv/bin/python bench/chaos_real.py --trials 50 --netem # also network faults (root)
    python bench/chaos.py real --netem --trial-start 32 --trials 1  # trial 32 of a run again (same draw)

What runs. One bootstrap DHT node (``gossiploco dht``) for the whole bench; per trial M peer processes
``python -m gossiploco peer --rank I --join BOOTSTRAP --swarm-key OUT/swarm.key --identity RUN/peer-I/identity.key
--workers M`` with ranks 1..M (identities made so that peer ids increase with the rank), each in its own
process group and output directory, a run id of their own (so no two trials ever mix; ``--new-run``, since
a peer killed in the previous trial stays in the swarm's list of runs for ``announce_ttl_s``) and the same
training seed in every trial. The default config is ``globalm1-localm2`` scaled down like the tests'
``TINY`` (tiny model, 32-token sequences, batch 4, a 2 MB corpus slice), R = 12 rounds of H = 150
*real* inner steps (7-25 ms each on this 2-core machine depending on its load, so a round takes 1-4 s
and the final validation loss means something); ``--synthetic-step-s`` makes an inner step a sleep
instead (``inner.synthetic_step_s``: steady round times under CPU contention, but the model then does
not train and the loss comparison is void). Timeouts are small so faults cost seconds:
``timeouts.exchange_s = 20``, ``timeouts.grace_s = 3`` (``--exchange-s``, ``--grace-s``),
``timeouts.startup_s = 30``, ``timeouts.discovery_s = 1`` (a faster start); the rest are the
config's defaults. Extra ``--set KEY=VALUE`` go to every peer.

Runs, in order: one fault-free baseline per (config, peers) used, the named scenario
``leader-kill-mid-mix2`` (always: 4 peers, ``globalm1-localm2``, rank 1, whose identity is chosen so that it
leads round 0's Mix2 (leaders are drawn per exchange: ``protocol.groups``), SIGKILLs itself just before sending chunk 0 of round 0's Mix2, through
``GOSSIPLOCO_FAULT=KILL:mix2/0:0``), then ``--trials`` random trials. Each random trial draws from
``--seed`` and its index one fault:

- ``kill``: SIGKILL of the peer process of a random rank (the leader of that round's Mix2 included); not restarted;
- ``stop``: SIGSTOP of a random peer's whole process group (a frozen machine: its DHT node too),
  SIGCONT 2-10 s later; it must catch up and finish;
- ``restart``: SIGKILL of a random rank, started again 0.5-2 s later with the same rank (new output
  directory ``peer-I-restart``); it must rejoin (download the state) and finish;
- with ``--netem`` (root, Linux namespaces): ``loss`` (5-25 % random packet loss), ``delay``
  (50-200 ms each way; needs sch_netem, else replaced by ``slow``: a 1-4 Mbit/s HTB link with a deep
  FIFO), each for 5-15 s on one peer's link or on every link, and ``partition``: one peer, or the
  upper half of the ranks, cut off from the others for 3-12 s, then healed.

The fault time is drawn within the run: when the target (for network faults: any peer) reaches round
k, k uniform in 1..R-2 (for ``restart`` k = 1, and the trial runs ``RESTART_ROUNDS_FACTOR`` times R rounds, so the
swarm still runs when it is back: a restarted peer needs about 10 s to import torch, start its DHT node and find the
swarm, and with R rounds alone 3 of 30 restarts came back after the end), plus a uniform delay within one round (the baseline's mean round time), so faults land anywhere
in a round, Mix1 and Mix2 included. ``--faults kill,stop`` restricts the kinds drawn.

Network (``--netem``): the test bed's star (``testbed.netns.Star``): namespace ``PREFIX-sw`` holds
bridges br0 and br1; the bootstrap node listens there on br0 (10.78.0.254); peer I lives in
``PREFIX-pI`` with eth0 = 10.78.0.I on br0 (prefix ``glc``, distinct from bench/netem.py's ``gln``).
Loss and delay are tc qdiscs on both ends of the peer's link (egress of eth0 = its upload, egress of
the switch port = its download; ``testbed.links``): netem when the kernel has it; else loss is an HTB
class fed by a classic-BPF classifier that sends a random fraction of packets (``ld rand``) to a leaf
queue of length 0. A partition moves the cut-off peers' switch ports to br1 (they still reach each
other, not the rest); healing moves them back. With ``--netem`` every trial, baselines included, runs
in the namespaces. Namespaces are removed on every exit path, and leftovers of a crashed earlier run
with the same prefix at start.

Measurements, per trial, per peer (each start of a peer is one "life"):

- progress events = the records of the peer's ``metrics.jsonl``, one at h = 0 of each round, every
  ``monitor.every`` inner steps and a final one (round R) after the last round. The bench tails every
  file while it runs (every ``POLL_S`` = 0.1 s) and stamps each new line with its arrival time
  (monotonic clock). A record waits for its consensus measurement, which runs in the background (a
  peer trains on meanwhile), so it may arrive well after its step: each event is therefore the
  record's ``run_s`` (the peer's seconds since its start when the step was reached) on the bench's
  clock, offset by the smallest arrival delay of the life's records (``progress_times``; arrival
  times where a record has no ``run_s``). The resolution is the poll interval;
- longest stall = the longest gap between two consecutive events, from the first record on; a life
  that does not finish also counts the open gap from its last record to its exit (or the trial's
  deadline). For a resumed (SIGSTOPped) peer the frozen time is subtracted;
- rounds completed = the highest round of its h = 0 records (the final record says R);
- ``final_val_loss`` of its summary.json, its failure and catch-up counts;
- for a killed peer: the processes of its tree (its descendants, snapshotted every 0.5 s while it
  lived, plus every process in its session) still alive 10 s after the kill ("orphans"; reported, not
  part of pass/fail; the bench kills them after looking).

Target (pass/fail per trial): every survivor (a peer not hit by a process fault; with a network fault
every peer) finishes every round (exit 0, final record at round R), a resumed or restarted peer
finishes too (a restarted one must have downloaded the state from the running swarm; if the swarm
finished within 15 s of its start, the trial is marked inconclusive instead), and no survivor's
longest stall exceeds ``bound = grace_s + exchange_s`` of the run's
config (one grace window plus the exchange deadline; the adaptive deadline is
``clamp(adaptive_factor x slowest recent exchange, min_exchange_s, exchange_s)``, at most
``exchange_s``, so this bound covers every adaptive value). Stalls above ``grace_s + min_exchange_s``
(the adaptive deadline's floor) are counted for information. A trial whose fault never fired (the run
died or hung first) fails. Exit code 1 when any trial (baseline, scenario or random) misses the
target, 0 otherwise, 2 when it cannot run (e.g. ``--netem`` without root), 130 when interrupted.

Output in ``--out`` (default runs/chaos-real): ``chaos-real.json`` (command, config, bound, baselines,
every trial with every peer's numbers and its last warnings), ``chaos-real.md`` (the command and a
table to paste into bench/results/chaos.md), and per trial a directory with each peer's log,
metrics.jsonl and summary.json. stdout: the command, one line per trial, a summary.

Every wait has a deadline (a trial's: ``--trial-timeout-s``, default 60 + R x (grace_s + exchange_s
+ 1)); every process started is stopped on every exit path (SIGINT then SIGKILL of its process group,
then any process left in its session or, with --netem, in its namespace); SIGTERM and SIGHUP are
turned into a clean stop, and a second Ctrl+C during the clean-up is ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from testbed.netns import Unavailable, preflight, prefix_lock
from testbed.processes import cmdline, shielded, signal_pid

if __package__:  # imported as bench.chaos_real (the repository root on sys.path, as under pytest)
    from bench.chaos_real_report import analyze, line, progress_times, write_report
    from bench.chaos_real_swarm import (FAULT_ENV, PROCESS_FAULTS, SCENARIO, SCENARIO_FAULT, Context, Life, Net, RunSpec,
                                        Swarm, leads, overrides_for)
else:  # run as a script (python bench/chaos_real.py): bench/ is on sys.path
    from chaos_real_report import analyze, line, progress_times, write_report
    from chaos_real_swarm import (FAULT_ENV, PROCESS_FAULTS, SCENARIO, SCENARIO_FAULT, Context, Life, Net, RunSpec, Swarm,
                                  leads, overrides_for)

__all__ = ["RESTART_ROUNDS_FACTOR", "add_arguments", "build_parser", "draw_fault", "main", "overrides_for",
           "progress_times", "run"]
"""What other files import from here (bench/chaos.py, tests/test_chaos_real.py)."""

SCENARIO_CONFIG = "globalm1-localm2"
SCENARIO_PEERS = 4
NETWORK_FAULTS = ("loss", "delay", "partition")
POLL_S = 0.1
ORPHAN_CHECK_S = 10.0
RESTART_ROUNDS_FACTOR = 2
"""A ``restart`` trial runs this many times ``--rounds``; its lost time (``lost_s``) leaves out the extra rounds, at
the baseline's round time, and it gets no val-loss delta (the baseline ran ``--rounds``)."""
EXIT_UNAVAILABLE = 2
EXIT_INTERRUPTED = 130



# ---------------------------------------------------------------------------------------------
# Options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``chaos.py real`` (and of this file run alone)."""
    parser.add_argument("--trials", type=int, default=5, help="random-fault trials (the named scenario always runs too)")
    parser.add_argument("--trial-start", type=int, default=0,
                        help="index of the first trial (with --trials 1: replay trial S of a longer run, same draw)")
    parser.add_argument("--peers", type=int, default=4, help="peers per random trial, ranks 1..M (the scenario always has 4)")
    parser.add_argument("--rounds", type=int, default=12, help="outer rounds R per run")
    parser.add_argument("--inner-steps", type=int, default=150, help="inner steps H per round")
    parser.add_argument("--monitor-every", type=int, default=50,
                        help="monitor.every: a metrics record (progress event) every this many inner steps, plus h = 0")
    parser.add_argument("--seed", type=int, default=0, help="training seed of every run, and seed of the fault draws")
    parser.add_argument("--config", default="globalm1-localm2", help="preset or TOML of the random trials")
    parser.add_argument("--exchange-s", type=float, default=20.0, help="timeouts.exchange_s of the peers")
    parser.add_argument("--grace-s", type=float, default=3.0, help="timeouts.grace_s of the peers")
    parser.add_argument("--startup-s", type=float, default=30.0, help="timeouts.startup_s of the peers")
    parser.add_argument("--synthetic-step-s", type=float, default=0.0,
                        help="> 0: an inner step sleeps this long instead of computing (the model does not train)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every peer (TOML value), repeatable")
    parser.add_argument("--faults", default="",
                        help="comma-separated kinds to draw from (default: kill,stop,restart and, with --netem, loss,delay,partition)")
    parser.add_argument("--only", default="",
                        help="comma-separated kinds: run only the trials whose draw is of these kinds (the draws stay "
                             "those of the whole run: replay a run's restarts, say), and the baseline, not the scenario")
    parser.add_argument("--orphan-check-s", type=float, default=ORPHAN_CHECK_S,
                        help="look for a killed peer's leftover processes this long after the kill (a faulted run "
                             "lasts at least until then)")
    parser.add_argument("--netem", action="store_true", help="run in network namespaces and add network faults (root)")
    parser.add_argument("--prefix", default="glc", help="name prefix of the namespaces (--netem)")
    parser.add_argument("--trial-timeout-s", type=float, default=0.0,
                        help="deadline of one trial (default 60 + R x (grace_s + exchange_s + 1))")
    parser.add_argument("--out", type=Path, default=Path("runs/chaos-real"), help="output directory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chaos_real.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run; returns the exit code."""
    return run(build_parser().parse_args(argv))


# ---------------------------------------------------------------------------------------------
# The bench


def timeouts_of(args: argparse.Namespace, config: str, peers: int, rounds: int | None = None) -> dict[str, float]:
    """The run's [timeouts] (from the real config loader) and the stall bound computed from them."""
    from gossiploco.config import load_config

    cfg = load_config(config, overrides_for(args, peers, rounds))
    t = cfg.timeouts
    return {"exchange_s": t.exchange_s, "grace_s": t.grace_s, "min_exchange_s": t.min_exchange_s,
            "adaptive_factor": t.adaptive_factor, "heartbeat_s": t.heartbeat_s, "startup_s": t.startup_s,
            "bound_s": t.grace_s + t.exchange_s, "adaptive_floor_s": t.grace_s + t.min_exchange_s,
            "rounds": cfg.rounds, "inner_steps": cfg.inner_steps, "monitor_every": cfg.monitor.every}


def draw_fault(args: argparse.Namespace, kinds: Sequence[str], trial: int, peers: int, netem: bool | None) -> dict:
    """The fault of random trial ``trial``: from ``--seed`` and the index only."""
    rng = random.Random(f"chaos-real:{args.seed}:{trial}")
    kind = rng.choice(list(kinds))
    ranks = list(range(1, peers + 1))
    last = max(1, args.rounds - 2)
    fault: dict[str, Any] = {"kind": kind, "round": rng.randint(1, last), "offset_frac": rng.random()}
    if kind in PROCESS_FAULTS:
        fault["target"] = rng.choice(ranks)
    if kind == "stop":
        fault["stop_s"] = round(rng.uniform(2.0, 10.0), 1)
    elif kind == "restart":
        fault["round"] = 1  # early: the restarted peer needs ~10 s to be back, and the swarm must still be running
        fault["rounds"] = RESTART_ROUNDS_FACTOR * args.rounds
        fault["restart_after_s"] = round(rng.uniform(0.5, 2.0), 1)
    elif kind in ("loss", "delay"):
        fault["ranks"] = [rng.choice(ranks)] if rng.random() < 0.5 else ranks
        fault["duration_s"] = round(rng.uniform(5.0, 15.0), 1)
        if kind == "loss":
            fault["loss_pct"] = round(rng.uniform(5.0, 25.0), 1)
        else:
            fault["delay_ms"] = round(rng.uniform(50.0, 200.0))
            fault["slow_mbit"] = round(rng.uniform(1.0, 4.0), 1)  # used when the kernel has no sch_netem
            if netem is False:
                fault["kind"] = "slow"
    elif kind == "partition":
        fault["ranks"] = [rng.choice(ranks)] if rng.random() < 0.5 or peers < 4 else ranks[peers // 2:]
        fault["duration_s"] = round(rng.uniform(3.0, 12.0), 1)
    return fault


def run_one(ctx: Context, spec: RunSpec) -> dict:
    """One run: start the peers, inject ``spec.fault`` at its time, watch, stop, measure."""
    args = ctx.args
    run_dir = args.out / spec.label
    if run_dir.exists():
        shutil.rmtree(run_dir)
    ctx.ensure_bootstrap()
    if ctx.net is not None:
        ctx.net.reset()
    limits = timeouts_of(args, spec.config, spec.peers, spec.fault.get("rounds"))
    rounds = limits["rounds"]
    timeout_s = args.trial_timeout_s or 60.0 + rounds * (limits["grace_s"] + limits["exchange_s"] + 1.0)
    fault = dict(spec.fault)
    kind = fault["kind"]
    base = ctx.baselines.get((spec.config, spec.peers))
    round_s = base["round_s"] if base and base.get("round_s") else 1.0
    swarm = Swarm(ctx, run_dir, spec, f"chaos-real-{ctx.token}-{spec.label}")
    ranks = list(range(1, spec.peers + 1))
    events: list[dict] = []
    pending: list[tuple[float, str, Callable[[float], None]]] = []
    state: dict[str, Any] = {"injected_at": None, "trigger": None, "timed_out": False}
    orphan_checks: dict[int, dict] = {}
    t0 = time.monotonic()

    def note(now: float, what: str) -> None:
        events.append({"t": round(now - t0, 2), "event": what})

    def schedule(at: float, name: str, fn: Callable[[float], None]) -> None:
        pending.append((at, name, fn))

    def orphan_check(life: Life, killed_at: float) -> None:
        def check(now: float) -> None:
            found = swarm.leftovers(life)
            orphan_checks[life.index * 1000 + life.rank] = {
                "peer": life.name, "after_s": round(now - killed_at, 1),
                "processes": [{"pid": p.pid, "comm": p.comm, "cmd": cmdline(p.pid, 120)} for p in found]}
            note(now, f"{life.name}: {len(found)} process(es) of its tree left {now - killed_at:.1f}s after the kill")
            for p in found:  # measured; now clean up
                signal_pid(p.pid, signal.SIGKILL)
        schedule(killed_at + ctx.args.orphan_check_s, f"orphan check {life.name}", check)

    def inject(now: float) -> None:
        state["injected_at"] = now
        net = ctx.net
        if kind in PROCESS_FAULTS:
            life = swarm.current(fault["target"])
            fault["leader"] = leads(swarm.identities, fault["target"], [l.rank for l in swarm.live()],
                                    f"mix2/{fault.get('round', 0)}", ctx.args.seed)  # of the round it is hit in
            if kind in ("kill", "restart"):
                swarm.kill(life, now)
                note(now, f"SIGKILL {life.name} (pid {life.pid})")
                orphan_check(life, now)
                if kind == "restart":
                    def restart(at: float, rank: int = fault["target"]) -> None:
                        new = swarm.start(rank)
                        note(at, f"restarted rank {rank} as {new.name} (pid {new.pid})")
                    schedule(now + fault["restart_after_s"], "restart", restart)
            else:
                swarm.freeze(life, now)
                note(now, f"SIGSTOP group of {life.name}")

                def cont(at: float, life: Life = life) -> None:
                    swarm.thaw(life, at)
                    note(at, f"SIGCONT group of {life.name}")
                schedule(now + fault["stop_s"], "SIGCONT", cont)
        else:
            assert net is not None
            if kind == "loss":
                fault["loss_method"] = net.loss(fault["ranks"], fault["loss_pct"])
            elif kind == "delay":
                net.delay(fault["ranks"], fault["delay_ms"])
            elif kind == "slow":
                net.slow(fault["ranks"], fault["slow_mbit"])
            elif kind == "partition":
                net.cut(fault["ranks"])
            note(now, f"{kind} on ranks {fault['ranks']}")

            def heal(at: float) -> None:
                net.reset()
                note(at, "network healed")
            schedule(now + fault["duration_s"], "heal", heal)

    try:
        env = {1: {FAULT_ENV: SCENARIO_FAULT}} if kind == SCENARIO else {}
        for rank in ranks:
            swarm.start(rank, env.get(rank))
        note(t0, f"started ranks {ranks} (run id {swarm.run_id})")
        deadline = t0 + timeout_s
        offset_s = fault.get("offset_frac", 0.0) * round_s
        while True:
            now = time.monotonic()
            swarm.poll(now)
            if kind == SCENARIO and state["injected_at"] is None:
                victim = swarm.current(1)
                if victim.exit_code is not None:
                    state["injected_at"] = victim.exited_at
                    fault["target"], fault["leader"] = 1, True
                    note(now, f"rank 1 exited with {victim.exit_code} ({FAULT_ENV}={SCENARIO_FAULT})")
                    if victim.exit_code == -signal.SIGKILL:
                        victim.killed_at = victim.exited_at
                        orphan_check(victim, victim.exited_at)
            elif kind not in ("none", SCENARIO) and state["injected_at"] is None:
                watch = [swarm.current(fault["target"])] if kind in PROCESS_FAULTS else swarm.lives
                if state["trigger"] is None:
                    for life in watch:
                        if life.exit_code is None and any(r.get("round", -1) >= fault["round"] for _, r in life.records):
                            state["trigger"] = now
                            break
                if state["trigger"] is not None and now >= state["trigger"] + offset_s:
                    if all(life.exit_code is None for life in watch[:1]) or kind not in PROCESS_FAULTS:
                        inject(now)
                    else:
                        state["trigger"] = None  # the target ended before its time: no fault
            for item in sorted(pending, key=lambda p: p[0]):
                if now >= item[0]:
                    pending.remove(item)
                    item[2](now)
            if not swarm.live() and not pending:
                break
            if now > deadline:
                state["timed_out"] = True
                note(now, f"trial deadline ({timeout_s:.0f}s): stopping every peer")
                for item in sorted(pending, key=lambda p: p[0]):  # resume, heal and look for orphans now
                    if item[1] != "restart":
                        item[2](now)
                pending.clear()
                break
            time.sleep(POLL_S)
    finally:
        with shielded():  # a second Ctrl+C must not cut the clean-up short
            if ctx.net is not None:
                with contextlib.suppress(Exception):
                    ctx.net.reset()
            swarm.stop()
        end = time.monotonic()
        for life in swarm.lives:
            life.tail(end)
    wall = end - t0
    return analyze(ctx, spec, fault, swarm, limits, state, events, orphan_checks, t0, end, wall)


def command_line() -> str:
    exe, cwd = sys.executable, os.getcwd().rstrip("/") + "/"
    return shlex.join([exe.removeprefix(cwd), *sys.argv])


def run(args: argparse.Namespace) -> int:
    """Run the bench (the module docstring); returns the exit code."""
    command = command_line()
    print(f"command: {command}", flush=True)
    if args.trials < 0 or args.trial_start < 0 or args.peers < 2 or args.rounds < 3 or args.inner_steps < 1:
        print("error: needs --trials >= 0, --trial-start >= 0, --peers >= 2, --rounds >= 3, --inner-steps >= 1", file=sys.stderr)
        return EXIT_UNAVAILABLE
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()] or [*PROCESS_FAULTS, *(NETWORK_FAULTS if args.netem else ())]
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    bad = [k for k in kinds + only if k not in (*PROCESS_FAULTS, *NETWORK_FAULTS)]
    if bad or (not args.netem and any(k in NETWORK_FAULTS for k in kinds)):
        print(f"error: --faults {args.faults!r} / --only {args.only!r}: kinds are {', '.join(PROCESS_FAULTS + NETWORK_FAULTS)} "
              f"(network kinds need --netem)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        limits = timeouts_of(args, args.config, args.peers)
        timeouts_of(args, SCENARIO_CONFIG, SCENARIO_PEERS)
    except Exception as exc:  # a config error names the field
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.netem:
        why = preflight()
        if why:
            print(f"cannot run: {why}", file=sys.stderr)
            return EXIT_UNAVAILABLE
    print(f"bound: no survivor stall > grace_s + exchange_s = {limits['grace_s']:g} + {limits['exchange_s']:g} = "
          f"{limits['bound_s']:g}s (adaptive deadline floor: grace_s + min_exchange_s = {limits['adaptive_floor_s']:g}s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args)
    report: dict[str, Any] = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()), "config": args.config,
                              "scenario_config": SCENARIO_CONFIG, "peers": args.peers, "netem": args.netem,
                              "sch_netem": None, "synthetic_step_s": args.synthetic_step_s, "limits": limits,
                              "fault_kinds": kinds, "runs": [], "interrupted": False}
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in previous:
        signal.signal(sig, raise_interrupt)
    code = 0
    lock = prefix_lock(args.prefix) if args.netem else contextlib.nullcontext()
    try:
        with lock:
            if args.netem:
                ctx.net = Net(args.prefix, list(range(1, max(args.peers, SCENARIO_PEERS) + 1)))
                stale = ctx.net.destroy()
                if stale:
                    print(f"removed namespaces of an earlier run: {', '.join(stale)}", flush=True)
                ctx.net.build()
                report["sch_netem"] = ctx.net.netem
                if not ctx.net.netem:
                    print("note: this kernel has no sch_netem: 'delay' becomes 'slow' (an HTB-limited link), "
                          "'loss' uses a BPF classifier", flush=True)
            plan: list[RunSpec] = []
            for config, peers in dict.fromkeys([(SCENARIO_CONFIG, SCENARIO_PEERS), (args.config, args.peers)]):
                plan.append(RunSpec(f"baseline-{Path(config).stem}-{peers}p", config, peers, {"kind": "none"}))
            if not only:
                plan.append(RunSpec(f"scenario-{SCENARIO}", SCENARIO_CONFIG, SCENARIO_PEERS, {"kind": SCENARIO}))
            netem_flag = ctx.net.netem if ctx.net else None
            for i in range(args.trial_start, args.trial_start + args.trials):
                fault = draw_fault(args, kinds, i, args.peers, netem_flag)
                if only and fault["kind"] not in only and not (fault["kind"] == "slow" and "delay" in only):
                    continue
                plan.append(RunSpec(f"trial-{i:03d}-{fault['kind']}", args.config, args.peers, fault))
            total = len(plan)
            for n, spec in enumerate(plan, 1):
                result = run_one(ctx, spec)
                if spec.fault["kind"] == "none":
                    ctx.baselines[(spec.config, spec.peers)] = {"val_loss": result["val_loss"], "round_s": result.get("round_s"),
                                                                "wall_s": result["survivor_wall_s"], "label": spec.label}
                report["runs"].append(result)
                print(line(result, f"{n:>2}/{total} {spec.label}"), flush=True)
                if not result["pass"]:
                    code = 1
                write_report(args, command, report)
    except KeyboardInterrupt:
        report["interrupted"] = True
        code = EXIT_INTERRUPTED
        print("interrupted; stopping every process", flush=True)
    except Unavailable as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        code = EXIT_UNAVAILABLE
    finally:
        try:
            with shielded():
                ctx.stop_bootstrap()
                if ctx.net is not None:
                    ctx.net.destroy()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if report["runs"]:
        write_report(args, command, report)
        print(f"summary: {report['summary']['text']}", flush=True)
        print(f"wrote {args.out / 'chaos-real.json'} and {args.out / 'chaos-real.md'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
