"""Gossip Mix2 paired as members become ready against bucket pairing, with and without rounds on a shared clock, in
the seeded simulator (the real protocol, ``protocol.pairing`` and ``protocol.agreement``).

    python -m bench.pairing_sim --peers 16 64 256 --seeds 2 --out bench/results/pairing-sim.md

Each cell: ``simulate_scale`` (consumer links, 1% churn, 20 s of compute a round, a 2 s grace window) with every
peer's compute equal but overshooting by ``U(0, --jitter)`` s each round, drawn afresh (what time-budget rounds do:
a round ends at its deadline plus less than one step), ``[groups] pairing`` bucket or ready, and rounds either
starting when the last one ended (each peer's own clock: ``round.clock = "start"``) or keeping to the shared round
clock (``round.clock = "shared"``, the runtime's ``round_clock.RoundClock``: round r's compute ends at the anchor +
(r + 1) ``--period``; a restarted peer takes up the anchor from the answers to its questions). Medians over seeds of the per-peer medians: blocking time per
round (Mix2 and the wait for Mix1 after it) and its 90th percentile, the share of rounds whose Mix1 mixed, control
messages sent per peer per round; violations of the simulator's properties (must be 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from multiprocessing import Pool
from pathlib import Path

from gossiploco.simulation.runs import simulate_scale

COLUMNS = ("blocking_s", "blocking_p90_s", "mix1_completion", "control_per_round")
VARIANTS = (("bucket", False), ("ready", False), ("bucket", True), ("ready", True))


def run_one(args: tuple) -> tuple[tuple, dict]:
    peers, seed, pairing, shared_clock, jitter, period, rounds = args
    began = time.perf_counter()
    result = simulate_scale(seed, peers, rounds=rounds, inner_spread=0.0, round_jitter=jitter,
                            round_period=period if shared_clock else 0.0, pairing=pairing)
    stats = result.stats["per_peer"]
    return (peers, pairing, shared_clock), {**{c: stats[c] for c in COLUMNS}, "violations": len(result.violations),
                                            "finished": sum(1 for k in result.finished.values() if k >= rounds),
                                            "wall_s": time.perf_counter() - began}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--jitter", type=float, default=2.0)
    parser.add_argument("--period", type=float, default=24.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cases = [(m, seed, pairing, clock, args.jitter, args.period, args.rounds)
             for m in args.peers for pairing, clock in VARIANTS for seed in range(1, args.seeds + 1)]
    began = time.perf_counter()
    with Pool(args.jobs) as pool:
        results = pool.map(run_one, cases)
    cells: dict[tuple, list[dict]] = {}
    for key, row in results:
        cells.setdefault(key, []).append(row)
    lines = ["| M | pairing | rounds | blocking s (p90) | Mix1 done | control / peer / round | finished | violations |",
             "|---:|---|---|---|---:|---:|---|---:|"]
    summary = []
    for (m, pairing, clock), rows in cells.items():
        med = {c: statistics.median(r[c] for r in rows) for c in COLUMNS}
        finished = min(r["finished"] for r in rows)
        violations = sum(r["violations"] for r in rows)
        summary.append({"peers": m, "pairing": pairing, "shared_clock": clock, **med, "finished": finished,
                        "violations": violations})
        lines.append(f"| {m} | {pairing} | {'shared clock' if clock else 'own clock'} | {med['blocking_s']:.2f} "
                     f"({med['blocking_p90_s']:.2f}) | {med['mix1_completion']:.3f} | "
                     f"{med['control_per_round']:.1f} | {finished}/{m} | {violations} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        command = " ".join(["python -m bench.pairing_sim", *sys.argv[1:]])
        Path(args.out).with_suffix(".md").write_text(
            f"# Gossip pairing as members come, against bucket pairing (simulator)\n\nProduced by "
            f"`bench/pairing_sim.py` (see its docstring).\n\n```\n{command}\n```\n\nSeeds 1 to {args.seeds}, "
            f"{args.rounds} rounds, jitter up to {args.jitter:g} s, shared-clock period {args.period:g} s; "
            f"wall time {time.perf_counter() - began:.0f} s.\n\n{table}\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
