"""What group Mix1 costs in quality (issue 26, item 2): the virtual swarm of ``globalm1-localm2`` with a global Mix1
against Mix1 in groups, at M = 16 and 32 workers, same seeds, side by side.

    python bench/group_mix1.py [--workers 16 32] [--sizes 8 4] [--seeds 0 1 2] [--rounds 40] [--inner-steps 8]
                               [--last 10] [--results bench/results/group-mix1.md]

For each M and seed, one run per ``[groups] size``: ``size = M`` (one group: the global Mix1, the paper's
GlobalM1LocalM2) and each of ``--sizes`` below M (Mix1 the mean of the worker's bucket, ``protocol.groups``; gossip
Mix2 matched inside buckets too). Tiny model, ``--rounds`` rounds of ``--inner-steps`` inner steps, consensus and
validation loss measured at the start of every round (``monitor.every = 0``) and after the last.

Reported per configuration: the final validation loss (the average model's) and CD_L2 (eq. 34, at h = 0: the
workers' z_{m,r} against their average) as the mean over the last ``--last`` rounds' measurements and the final
one, each seed's and their medians, and the median over seeds of the per-seed ratios against the global Mix1 of
the same M and seed. Beside them the analytic contraction factors (the paper's rho, eq. 27 onward;
``protocol.groups``): rho1 = ``mean_rho(M, size)`` of the group mean, rho2 = ``gossip_rho(M, size)`` of gossip
inside groups, F = 1 + rho2 / (1 - rho1) (eq. 27's bound on the consensus error, averaged over a round), and the
bound's prediction for the h = 0 CD_L2 ratio, sqrt((rho2 / (1 - rho1)) / (rho2_g / (1 - rho1_g))) against the
global run's (eq. 78: E[V_{r,0}] <= 2 rho2 eta^2 sigma^2 H / (1 - rho1)). Results: ``--results`` (Markdown) and
the same rows as JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from gossiploco.config import TINY_OVERRIDES, load_config  # noqa: E402
from gossiploco.protocol import groups  # noqa: E402
from gossiploco.runtime.virtual import VirtualSwarm  # noqa: E402

PRESET = "globalm1-localm2"


@dataclass
class Rhos:
    """The analytic contraction factors of one configuration (module docstring)."""

    rho1: float
    rho2: float

    @property
    def f(self) -> float:
        return 1.0 + self.rho2 / (1.0 - self.rho1)

    @property
    def v0(self) -> float:
        """eq. 78's bound on the h = 0 consensus error, in units of 2 eta^2 sigma^2 H."""
        return self.rho2 / (1.0 - self.rho1)


def rhos(workers: int, size: int) -> Rhos:
    return Rhos(groups.mean_rho(workers, size), groups.gossip_rho(workers, size))


@dataclass
class Run:
    """One virtual swarm's outcome."""

    workers: int
    size: int
    seed: int
    final_val_loss: float
    cd_l2_last: float
    """Mean CD_L2 over the last ``--last`` measurements at h = 0 (the final one included)."""
    cd_l2_final: float
    mix1_failures: int
    mix2_failures: int
    mix1_bytes: float
    """Mix1 payload bytes a worker sent per round (mean over rounds)."""
    wall_s: float


def run_one(workers: int, size: int, seed: int, rounds: int, inner_steps: int, last: int) -> Run:
    cfg = load_config(PRESET, {**TINY_OVERRIDES, "workers": workers, "rounds": rounds, "inner_steps": inner_steps,
                               "seed": seed, "monitor.every": 0, "groups.size": size})
    began = time.perf_counter()
    with closing(VirtualSwarm(cfg)) as swarm:
        result = swarm.run()
    wall = time.perf_counter() - began
    at_round_start = [r for r in result.records if r.get("h") == 0 and "cd_l2" in r]
    tail = at_round_start[-last:]
    sent = [r["mix1_bytes"] for r in result.records if "mix1_bytes" in r]
    return Run(workers, size, seed, float(result.summary["final_val_loss"]),
               statistics.fmean(r["cd_l2"] for r in tail), float(at_round_start[-1]["cd_l2"]),
               sum(r.get("mix1_failures", 0) for r in result.records),
               sum(r.get("mix2_failures", 0) for r in result.records),
               statistics.fmean(sent) if sent else 0.0, wall)


def label(workers: int, size: int) -> str:
    return "global" if groups.bucket_count(workers, size) == 1 else f"groups of {size}"


def summarize(runs: list[Run], workers: int, sizes: list[int]) -> list[dict]:
    """Per configuration of ``workers``: medians over seeds and the median per-seed ratios against global."""
    base = {r.seed: r for r in runs if r.workers == workers and r.size == workers}
    rows = []
    for size in sizes:
        mine = sorted((r for r in runs if r.workers == workers and r.size == size), key=lambda r: r.seed)
        if not mine:
            continue
        paired = [(r, base[r.seed]) for r in mine if r.seed in base]
        ratio = {k: statistics.median(getattr(r, k) / getattr(b, k) for r, b in paired) if paired else math.nan
                 for k in ("final_val_loss", "cd_l2_last", "cd_l2_final")}
        rh, rg = rhos(workers, size), rhos(workers, workers)
        rows.append({"workers": workers, "size": size, "config": label(workers, size), "rho1": rh.rho1,
                     "rho2": rh.rho2, "F": rh.f, "cd_l2_bound_ratio": math.sqrt(rh.v0 / rg.v0),
                     "seeds": [r.seed for r in mine],
                     "final_val_loss": [r.final_val_loss for r in mine],
                     "median_final_val_loss": statistics.median(r.final_val_loss for r in mine),
                     "median_cd_l2_last": statistics.median(r.cd_l2_last for r in mine),
                     "median_cd_l2_final": statistics.median(r.cd_l2_final for r in mine),
                     "ratio_final_val_loss": ratio["final_val_loss"], "ratio_cd_l2_last": ratio["cd_l2_last"],
                     "ratio_cd_l2_final": ratio["cd_l2_final"],
                     "mix1_failures": sum(r.mix1_failures for r in mine),
                     "mix2_failures": sum(r.mix2_failures for r in mine),
                     "mix1_bytes": statistics.fmean(r.mix1_bytes for r in mine),
                     "wall_s": sum(r.wall_s for r in mine)})
    return rows


def markdown(args: argparse.Namespace, command: str, runs: list[Run], table: list[dict], wall_s: float) -> list[str]:
    lines = ["# Group Mix1's quality cost (issue 26, item 2)", "",
             "Produced by `bench/group_mix1.py` (see its docstring).", "", "```",
             command, "```", "",
             f"Machine: {platform.machine()}, 2 shared CPU cores, CPU only. Virtual swarm, preset `{PRESET}`, tiny "
             f"model, {args.rounds} rounds of {args.inner_steps} inner steps, seeds {args.seeds}. `global`: "
             "`[groups] size` = M (one group); `groups of g`: `[groups] size` = g, Mix1 the mean of the worker's "
             "bucket and gossip Mix2 matched inside buckets. CD_L2 measured at the start of each round (h = 0); "
             f"`CD_L2 last {args.last}`: the mean of the last {args.last} measurements (the final one included). Ratios: "
             "the median over seeds of (this config / global, same M and seed). Bound ratio: eq. 78's prediction "
             "for the h = 0 CD_L2 ratio, sqrt((rho2 / (1 - rho1)) / (rho2_global / 1)).", "",
             "## Medians over seeds", "",
             "| M | Mix1 | rho1 | rho2 | F | final val loss | ratio | CD_L2 last | ratio | CD_L2 final | ratio | "
             "bound ratio | Mix1 bytes/worker/round | Mix1 / Mix2 failures |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['workers']} | {t['config']} | {t['rho1']:.4f} | {t['rho2']:.4f} | {t['F']:.4f} | "
                     f"{t['median_final_val_loss']:.4f} | {t['ratio_final_val_loss']:.4f} | "
                     f"{t['median_cd_l2_last']:.4f} | {t['ratio_cd_l2_last']:.4f} | {t['median_cd_l2_final']:.4f} | "
                     f"{t['ratio_cd_l2_final']:.4f} | {t['cd_l2_bound_ratio']:.3f} | {t['mix1_bytes']:.0f} | "
                     f"{t['mix1_failures']} / {t['mix2_failures']} |")
    lines += ["", "## Every run", "",
              "| M | Mix1 | seed | final val loss | CD_L2 last | CD_L2 final | Mix1 bytes/worker/round | wall s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.workers} | {label(r.workers, r.size)} | {r.seed} | {r.final_val_loss:.4f} | "
                     f"{r.cd_l2_last:.4f} | {r.cd_l2_final:.4f} | {r.mix1_bytes:.0f} | {r.wall_s:.0f} |")
    lines += ["", f"Wall time {wall_s:.0f} s."]
    return lines


def configurations(workers: int, sizes: list[int]) -> list[int]:
    """The ``[groups] size`` values run at ``workers``: the global Mix1 (``workers``) first, then the group sizes below it."""
    return [workers, *sorted({s for s in sizes if s < workers}, reverse=True)]


def write_results(args: argparse.Namespace, command: str, runs: list[Run], planned: int, wall_s: float) -> None:
    """``--results`` (Markdown) and its JSON twin from the runs so far (of ``planned``)."""
    table = [row for workers in args.workers for row in summarize(runs, workers, configurations(workers, args.sizes))]
    lines = markdown(args, command, runs, table, wall_s)
    if len(runs) < planned:
        lines += ["", f"Incomplete: {len(runs)} of {planned} runs so far."]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text("\n".join(lines) + "\n")
    args.results.with_suffix(".json").write_text(json.dumps(
        {"command": command, "preset": PRESET, "rounds": args.rounds, "inner_steps": args.inner_steps,
         "last": args.last, "complete": len(runs) == planned, "summary": table, "runs": [asdict(r) for r in runs],
         "wall_s": wall_s}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 4],
                        help="group sizes to compare with the global Mix1 (sizes >= M are the global one)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--last", type=int, default=10, help="rounds whose h = 0 CD_L2 is averaged")
    parser.add_argument("--results", type=Path, default=ROOT / "bench/results/group-mix1.md")
    args = parser.parse_args(argv)
    command = " ".join(["python", "bench/group_mix1.py", *(sys.argv[1:] if argv is None else argv)])
    if min(args.sizes) < 2 or args.rounds < 1 or args.inner_steps < 1 or args.last < 1:
        parser.error("--sizes at least 2; --rounds, --inner-steps and --last at least 1")
    began = time.perf_counter()
    runs: list[Run] = []
    planned = len(args.seeds) * sum(len(configurations(w, args.sizes)) for w in args.workers)
    for workers in args.workers:
        for seed in args.seeds:
            for size in configurations(workers, args.sizes):  # one seed's configurations side by side
                runs.append(run_one(workers, size, seed, args.rounds, args.inner_steps, args.last))
                r = runs[-1]
                print(f"M={workers} {label(workers, size)} seed {seed}: final val loss {r.final_val_loss:.4f}, "
                      f"CD_L2 last {r.cd_l2_last:.4f}, final {r.cd_l2_final:.4f} ({r.wall_s:.0f} s)", flush=True)
                write_results(args, command, runs, planned, time.perf_counter() - began)  # a stopped run keeps its rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
