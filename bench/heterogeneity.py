"""Unequal peers: a steps budget (everyone runs H inner steps, the swarm at the pace of its slowest) against a
time budget with token-weighted means (``round.budget = "time"``, ``round.weights = "tokens"``).

Real peer processes on loopback (a static peer list, ZeroMQ), real training of ``--model``; the slow peer is
``compute.slowdown = --slowdown``: each of its inner steps runs for real, then it sleeps (slowdown - 1) times
what the step took, so its steps take that many times as long (a slower GPU, without the second process
that a CPU quota would need to share this machine's two cores). Two parts, five runs one after another:

Utilization, with synthetic compute (``inner.synthetic_step_s = --step-time``: an inner step is a sleep, the
netem bench's mode, so the peers do not compete for this machine's cores as separate machines would not;
the mixes still send the model's real bytes):

* ``fast only``: the ``--peers - 1`` fast peers alone, steps budget, ``--rounds`` rounds: the utilization
  the fast peers reach without the slow one;
* ``steps``: all ``--peers``, one slow, steps budget, ``--rounds`` rounds;
* ``time``: the same peers, time budget (the round length: the fast peers' median compute seconds for H steps
  in ``fast only``), token weights.

Validation loss at equal wall time, with real training:

* ``steps``: all ``--peers``, one slow, steps budget, ``--rounds`` rounds;
* ``time, equal wall``: time budget (the round length: the fast peers' median compute seconds for H steps in
  the real ``steps`` run), as many rounds as fit in the wall time ``steps`` took (rounded down).

Reported per run: wall time, the fast peers' utilization (their compute seconds over the rounds' seconds; the
mean over the fast peers), the slow peer's, the steps per round of each kind, and the final validation loss of
the averaged model (every peer ends with the same one; their mean is reported).

    python bench/heterogeneity.py --preset diloco --model small --peers 4 --inner-steps 40 --rounds 8 \\
        --step-time 0.05 --out bench/results/heterogeneity.md
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
from testbed.overrides import set_args


def peer_args(args: argparse.Namespace, rounds: int, **sets) -> list[str]:
    settings = {"model.size": args.model, "inner_steps": args.inner_steps, "rounds": rounds, "seed": 0,
                "device": "cpu", "monitor.enabled": False, **sets}
    return ["--config", args.preset, "--quiet", *set_args(settings)]


def run(args: argparse.Namespace, name: str, out: Path, peers: int, rounds: int, slow: bool, **sets) -> dict:
    """One run of ``peers`` processes (the last one slow when ``slow``), summarized from the peers' summaries."""
    per_rank = {peers - 1: ["--set", f"compute.slowdown={args.slowdown}"]} if slow else {}
    start = time.perf_counter()
    with LocalPeers(peers, out / f"{len(list(out.iterdir()))}-{name.replace(' ', '-').replace(',', '')}", peer_args(args, rounds, **sets),
                    env={"OMP_NUM_THREADS": "1"}, per_rank=per_rank) as local:
        local.start()
        codes = local.wait(args.timeout)
        if any(code != 0 for code in codes.values()):
            bad = next(r for r, c in codes.items() if c != 0)
            sys.exit(f"{name}: peer {bad} exited with {codes[bad]}:\n{local.log(bad)[-3000:]}")
        summaries = [json.loads((local.peer_dir(r) / "summary.json").read_text()) for r in range(peers)]
    fast = range(peers - 1) if slow else range(peers)
    steps = [[t["steps"] for t in s["round_times"]] for s in summaries]
    return {
        "name": name, "peers": peers, "rounds": rounds, "budget": sets.get("round.budget", "steps"),
        "length_s": sets.get("round.length_s"),
        "launch_s": time.perf_counter() - start,
        "wall_s": statistics.median(sum(t["s"] for t in s["round_times"]) for s in summaries),
        "fast_util": statistics.mean(summaries[r]["round_utilization"] for r in fast),
        "slow_util": summaries[-1]["round_utilization"] if slow else None,
        "fast_steps": statistics.mean(x for r in fast for x in steps[r]),
        "slow_steps": statistics.mean(steps[-1]) if slow else None,
        "fast_step_s": statistics.median(t["compute_s"] for r in fast for t in summaries[r]["round_times"]),
        "val_loss": statistics.mean(s["final_val_loss"] for s in summaries),
        "val_spread": max(s["final_val_loss"] for s in summaries) - min(s["final_val_loss"] for s in summaries),
        "failures": sum(s["mix1_failures"] + s["mix2_failures"] for s in summaries),
    }


def equal_wall(go, args: argparse.Namespace, wall_s: float, sets: dict) -> dict:
    """The time-budget run with as many rounds as fit in ``wall_s``: a first guess from the round length, then
    (at most twice) the rounds scaled by the wall time the last run took; the longest run within ``wall_s``."""
    rounds = max(1, int(wall_s / (sets["round.length_s"] * 1.15)))
    best = None
    for _ in range(3):
        result = go("time, equal wall", args.peers, rounds, True, **sets)
        if result["wall_s"] <= wall_s and (best is None or result["wall_s"] > best["wall_s"]):
            best = result
        per_round = result["wall_s"] / rounds
        fit = int(wall_s / per_round)
        if fit == rounds or (best is not None and fit < rounds and best is result):
            break
        rounds = max(1, fit)
    return best if best is not None else result


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(runs: list[dict]) -> list[str]:
    lines = ["| run | peers | budget | rounds | wall s | fast peers' utilization | slow peer's utilization | "
             "steps/round fast | steps/round slow | final val loss | spread | mix failures |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['peers']} | {r['budget']} | {r['rounds']} | {r['wall_s']:.1f} | "
                     f"{r['fast_util']:.1%} | {fmt(r['slow_util'], '.1%')} | {r['fast_steps']:.1f} | "
                     f"{fmt(r['slow_steps'], '.1f')} | {r['val_loss']:.4f} | {r['val_spread']:.1e} | {r['failures']} |")
    return lines


def report(args: argparse.Namespace, synthetic: list[dict], real: list[dict], length_s: float, command: str) -> str:
    base, steps, timed = synthetic
    real_steps, equal = real
    gap = (base["fast_util"] - timed["fast_util"]) * 100
    gained = real_steps["val_loss"] - equal["val_loss"]
    lines = [
        "# Unequal peers: steps against time budgets", "",
        f"Regenerate: `{command}`", "",
        f"Machine: {os.cpu_count()} CPU cores, no GPU, one torch thread per peer; preset `{args.preset}`, model "
        f"`{args.model}`, H = {args.inner_steps}; real peer processes over ZeroMQ on loopback (a static peer list). "
        f"The slow peer runs with `compute.slowdown = {args.slowdown:g}` (each step, then a sleep of "
        f"{args.slowdown - 1:g}x its time). Time budget: `round.budget = \"time\"`, `round.weights = \"tokens\"`. "
        "Wall: the median peer's seconds in rounds (start-up excluded); utilization: compute seconds over round "
        "seconds (the slow peer's sleeps count as its compute); val loss: of the averaged final model (all peers "
        "hold the same one: spread shown). The monitors are off (`monitor.enabled = false`: no consensus or "
        "validation measurement inside the rounds, only the final one), so the rounds hold training and mixing "
        "only.", "",
        f"## Utilization (synthetic compute: a step is a {args.step_time:g} s sleep; round length "
        f"{synthetic[2]['length_s']:.3f} s, the fast peers' median compute time for H steps in `fast only`)", "",
        *table(synthetic), "",
        f"## Validation loss at equal wall time (real training; round length {length_s:.2f} s, the fast peers' "
        "median compute time for H steps in the real `steps` run)", "", *table(real), "",
        "## Against the targets", "",
        f"- Fast peers' utilization with the slow peer, time budget: {timed['fast_util']:.1%}, against "
        f"{base['fast_util']:.1%} without it: {-gap:+.1f} points (target: within 5): "
        f"**{'met' if abs(gap) <= 5 else 'missed'}**. With the steps budget: {steps['fast_util']:.1%}.",
        f"- Wall time to {args.rounds} rounds (synthetic): steps {steps['wall_s']:.1f} s, time {timed['wall_s']:.1f} s "
        f"({steps['wall_s'] / timed['wall_s']:.2f}x faster); the fast peers alone {base['wall_s']:.1f} s.",
        f"- Validation loss at equal wall time (steps {real_steps['wall_s']:.0f} s, time {equal['wall_s']:.0f} s): "
        f"steps {real_steps['val_loss']:.4f}, time {equal['val_loss']:.4f} ({gained:+.4f} better with time; target: "
        f"better): **{'met' if gained > 0 else 'missed'}**.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="diloco")
    parser.add_argument("--model", default="small")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--slowdown", type=float, default=2.0)
    parser.add_argument("--step-time", type=float, default=0.05, help="Seconds of a synthetic inner step (utilization part).")
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds a run may take before it counts as hung.")
    parser.add_argument("--out", type=Path, help="Markdown report to write (default: print it).")
    args = parser.parse_args()
    command = "python bench/heterogeneity.py " + shlex.join(sys.argv[1:])
    timed = {"round.budget": "time", "round.weights": "tokens"}
    with tempfile.TemporaryDirectory(prefix="heterogeneity-") as tmp:
        out = Path(tmp)

        def go(name: str, peers: int, rounds: int, slow: bool, **sets) -> dict:
            result = run(args, name, out, peers, rounds, slow, **sets)
            print(json.dumps(result), flush=True)
            return result

        synthetic_sets = {"inner.synthetic_step_s": args.step_time}
        base = go("fast only", args.peers - 1, args.rounds, False, **synthetic_sets)
        synthetic = [base, go("steps", args.peers, args.rounds, True, **synthetic_sets),
                     go("time", args.peers, args.rounds, True, **synthetic_sets, **timed,
                        **{"round.length_s": round(base["fast_step_s"], 3)})]
        real_steps = go("steps, real", args.peers, args.rounds, True)
        length_s = round(real_steps["fast_step_s"], 3)
        equal = equal_wall(go, args, real_steps["wall_s"], {**timed, "round.length_s": length_s})
    text = report(args, synthetic, [real_steps, equal], length_s, command)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
