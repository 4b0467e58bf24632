"""Monitors off the critical path: the seconds each peer's main thread spends in the monitor (``monitor_s``) with
one slow peer, for two checkouts of the code side by side (before: measurements block on the group's all-reduce;
after: they run in the background, ``runtime.peer_monitor``).

Real peer processes on loopback (a static peer list, ZeroMQ); compute is synthetic (``inner.synthetic_step_s``: an
inner step is a sleep, so the peers do not compete for this machine's cores), the last peer ``--slowdown`` times
slower (``compute.slowdown``), steps budget (everyone runs H steps a round), measurements at h = 0 and every
``--every`` steps. Each checkout's peers run with ``PYTHONPATH`` set to it.

    python bench/monitor_offpath.py --before /work/main --after . --out bench/results/monitor-offpath.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gossiploco.runtime.launch import LocalPeers
from testbed.overrides import peer_args


def run(code: Path, args: argparse.Namespace) -> dict:
    overrides = {"model.size": "tiny", "inner_steps": args.inner_steps, "rounds": args.rounds, "seed": 0,
                 "device": "cpu", "data.seq_len": 32, "data.batch_size": 4, "data.max_corpus_mb": 2.0,
                 "inner.synthetic_step_s": args.step_time, "monitor.every": args.every}
    slow = args.peers - 1
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(code.resolve())}
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # ``python -m`` puts the working directory first on the path: only PYTHONPATH picks the code
        start = time.perf_counter()
        with LocalPeers(args.peers, tmp, peer_args(args.preset, overrides), env=env,
                        per_rank={slow: ["--set", f"compute.slowdown={args.slowdown}"]}) as peers:
            peers.start()
            codes = peers.wait(args.timeout)
            wall = time.perf_counter() - start
            if any(c != 0 for c in codes.values()):
                raise SystemExit(f"{code}: peers exited with {codes}; rank 0's log:\n{peers.log(0)[-3000:]}")
            summaries = [json.loads((peers.peer_dir(r) / "summary.json").read_text()) for r in range(args.peers)]
    out = {"wall_s": wall, "peers": []}
    for rank, s in enumerate(summaries):
        rounds = [t["s"] for t in s["round_times"]]
        monitor_rounds = [t.get("monitor_s", 0.0) for t in s["round_times"]]
        out["peers"].append({"rank": rank, "slow": rank == slow, "monitor_s": s["total_monitor_s"],
                             "monitor_s_rounds": sum(monitor_rounds),
                             "monitor_s_per_round": statistics.median(monitor_rounds),
                             "round_s": statistics.median(rounds), "mix2_s": s["total_mix2_s"],
                             "late": s.get("monitor_late"), "waits": s.get("monitor_waits"),
                             "failures": s.get("monitor_failures")})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="checkout whose peers measure blocking")
    p.add_argument("--after", type=Path, required=True, help="checkout whose peers measure in the background")
    p.add_argument("--preset", default="globalm1-localm2")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--slowdown", type=float, default=4.0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    home = Path.cwd()
    codes = {"before": args.before.resolve(), "after": args.after.resolve()}
    results = {name: run(code, args) for name, code in codes.items()}
    os.chdir(home)
    lines = ["# Monitors off the critical path", "", "```", "python " + " ".join(shlex.quote(a) for a in sys.argv), "```",
             "", f"{args.peers} peers, preset {args.preset}, tiny model, synthetic steps of {args.step_time}s, the last peer "
             f"{args.slowdown}x slower, H = {args.inner_steps}, measured at h = 0 and every {args.every} steps, "
             f"{args.rounds} rounds. Medians over rounds; monitor_s is the main thread's time in the monitor.", "",
             "monitor_s in rounds: its sum over the training rounds; total: with the final measurement (blocking by "
             "design: it waits for the measurements in flight, i.e. for the slowest peer, at the end of the run).", "",
             "| code | rank | slow | monitor_s in rounds | monitor_s total | monitor_s / round (median) | round s (median) "
             "| mix2_s total | late | waits | failures | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        for peer in res["peers"]:
            lines.append(f"| {name} | {peer['rank']} | {'yes' if peer['slow'] else ''} | {peer['monitor_s_rounds']:.2f} | "
                         f"{peer['monitor_s']:.2f} | "
                         f"{peer['monitor_s_per_round']:.3f} | {peer['round_s']:.2f} | {peer['mix2_s']:.2f} | "
                         f"{peer['late']} | {peer['waits']} | {peer['failures']} | {res['wall_s']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        (home / args.out).write_text(text)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
