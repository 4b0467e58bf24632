"""What robust mixing costs without attackers: plain and robust attack-free runs of the virtual swarm side by
side, over several seeds (one run's final loss moves by about 1% with the last bits of its sums, so a cost of
1% is only seen across seeds).

    python bench/robust_cost.py [--seeds 0 1 2] [--presets globalm1-localm2 diloco] [--rounds 60] [--workers 8]
                                [--results bench/results/robust-cost.md]

Each seed runs the same config (``bench/attacks_members.py``'s virtual suite: tiny model, 8 workers, 8 inner
steps, token weights) with ``robust.mode=off`` and ``=on``; reported per preset: each seed's final val loss,
the means, the median of the per-seed ratios robust / plain, and the wall times. The target (issue 25): robust
mixing without attackers costs at most 1% of final validation loss. Results: ``bench/results/robust-cost.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from gossiploco.config import TINY_OVERRIDES, load_config  # noqa: E402
from gossiploco.runtime.virtual import VirtualSwarm  # noqa: E402

WORKERS = 8
COST_LIMIT = 0.01


def final_loss(preset: str, mode: str, seed: int, rounds: int, workers: int) -> tuple[float, float]:
    cfg = load_config(preset, {**TINY_OVERRIDES, "workers": workers, "rounds": rounds, "inner_steps": 8, "seed": seed,
                               "round.weights": "tokens", "robust.mode": mode, "monitor.every": 0})
    began = time.perf_counter()
    with closing(VirtualSwarm(cfg)) as swarm:
        result = swarm.run()
    return float(result.summary["final_val_loss"]), time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--presets", nargs="+", default=["globalm1-localm2", "diloco"])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--results", type=Path, default=ROOT / "bench/results/robust-cost.md")
    args = parser.parse_args()
    began = time.perf_counter()
    lines = ["# What robust mixing costs without attackers", "",
             "Produced by `bench/robust_cost.py` (see its docstring).", "", "```",
             "python " + " ".join(["bench/robust_cost.py", *sys.argv[1:]]), "```", "",
             f"Machine: {platform.machine()}, 2 shared CPU cores, CPU only. Virtual swarm of {args.workers} workers, tiny "
             f"model, {args.rounds} rounds of 8 inner steps, token weights, no attacker.", "",
             "| Preset | Seed | plain final val loss | robust final val loss | robust / plain | plain s | robust s |",
             "|---|---|---|---|---|---|---|"]
    verdicts = []
    for preset in args.presets:
        ratios, plains, robusts = [], [], []
        for seed in args.seeds:
            plain, plain_s = final_loss(preset, "off", seed, args.rounds, args.workers)
            robust, robust_s = final_loss(preset, "on", seed, args.rounds, args.workers)
            plains.append(plain)
            robusts.append(robust)
            ratios.append(robust / plain)
            lines.append(f"| {preset} | {seed} | {plain:.4f} | {robust:.4f} | {robust / plain:.4f} | {plain_s:.0f} | "
                         f"{robust_s:.0f} |")
            print(lines[-1], flush=True)
        mean_cost = statistics.mean(robusts) / statistics.mean(plains) - 1
        median_ratio = statistics.median(ratios)
        held = mean_cost <= COST_LIMIT
        verdicts.append(held)
        lines.append(f"| **{preset}** | mean | {statistics.mean(plains):.4f} | {statistics.mean(robusts):.4f} | "
                     f"median {median_ratio:.4f}; mean cost {mean_cost:+.2%}: {'held' if held else 'MISSED'} "
                     f"(target <= {COST_LIMIT:.0%}) | | |")
        print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.perf_counter() - began:.0f} s."]
    args.results.write_text("\n".join(lines) + "\n")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
