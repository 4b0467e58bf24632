"""Adaptive Mix2 benchmark (issue 6, item 5): globalm1, globalm1-localm2, the sensitivity-chosen
subset and globalm1-adaptive on the virtual swarm with the small model.

1. ``gossiploco sensitivity -c globalm1`` ranks the blocks by JS sensitivity, sweeps a few top-k
   Mix2 subsets and writes the proposed subset as a preset to ``<out>/subset.toml`` (not into
   peers/); its runs go under ``<out>/sensitivity``.
2. ``gossiploco simulate`` once per (configuration, seed): globalm1, globalm1-localm2, the subset
   preset file and globalm1-adaptive, all with the same M, H, R and overrides (those of
   bench/quality.py), ``--jobs`` at a time with ``--threads`` torch threads each. The sensitivity
   run takes one of the job slots while the configurations that do not need it run in the other.
3. Writes ``bench/results/adaptive.md``: final validation loss, max CD_JS and blocking Mix2 bytes
   per round (``mix2_bytes`` of the metrics records: payload per worker per round) per
   configuration, the adaptive controller's decisions for one seed, and whether the target
   (adaptive within 1% of globalm1-localm2's final validation loss with at most half its blocking
   bytes) is met, and a table of the other adaptive settings tried (``--variants``: globalm1-adaptive with
   some ``adaptive.*`` fields changed, every seed).

    python bench/adaptive.py                  # the recorded configuration
    python bench/adaptive.py --report-only    # rewrite the results from the runs in --out
    python bench/adaptive.py --skip-existing --variants grow_factor=1.3   # another setting; keeps the runs already there
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "globalm1-localm2"
ADAPTIVE = "globalm1-adaptive"
SUBSET = "subset"
"""Label of the sensitivity-chosen configuration (its preset file is ``<out>/subset.toml``)."""
CONFIGS = ["globalm1", BASELINE, SUBSET, ADAPTIVE]
DEFAULT_VARIANTS = ["grow_factor=1.5", "warmup_rounds=1,grow_factor=1.5", "shrink_after=5"]
"""The other adaptive settings the recorded benchmark compares (grow_factor = 1.5 was the default before it)."""
VARIANTS_NOTE = ("`AdaptiveConfig.grow_factor` was 1.5 before this benchmark and is 1.2 since, on the evidence of this table: "
                 "with 1.5 the controller never grew on seed 0 and the loss target was missed; with 1.2 both seeds grow "
                 "once and the target is met.")
LOSS_TOLERANCE = 0.01
BYTES_LIMIT = 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--model", default="small")
    p.add_argument("--set", dest="sets", nargs="*", default=["inner.lr=3e-3", "inner.warmup_steps=16", "monitor.every=4"],
                   help="overrides for every run (sensitivity included)")
    p.add_argument("--adaptive-set", dest="adaptive_sets", nargs="*", default=[],
                   help="extra overrides for the adaptive runs only (e.g. adaptive.grow_factor=1.2); recorded in the results")
    p.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                   help="other adaptive settings to compare, each a comma-separated list of adaptive.* fields: "
                        "warmup_rounds=1,grow_factor=1.2 (run with every seed, reported in their own table)")
    p.add_argument("--sweep-sizes", default="1,2,4", help="subset sizes the sensitivity sweep trains")
    p.add_argument("--tolerance", type=float, default=0.1, help="sensitivity proposal tolerance on peak CD_JS (relative to full Mix2)")
    p.add_argument("--sensitivity-seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-adaptive")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "adaptive.md")
    p.add_argument("--report-only", action="store_true", help="rewrite the results from the runs already in --out")
    p.add_argument("--skip-existing", action="store_true",
                   help="do not rerun a run whose summary.json (or the sensitivity report with its proposal) is already in --out")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Commands


def rel(path: Path) -> str:
    """``path`` relative to the repository root when it is inside it (for the recorded commands)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def common_options(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--workers", str(args.workers), "--inner-steps", str(args.inner_steps), "--rounds", str(args.rounds),
            "--model", args.model, "--seed", str(seed), "--device", "cpu"]


def sets(values: list[str]) -> list[str]:
    out: list[str] = []
    for s in values:
        out += ["--set", s]
    return out


def sensitivity_cmd(args: argparse.Namespace) -> list[str]:
    return (["gossiploco", "sensitivity", "--config", "globalm1", *common_options(args, args.sensitivity_seed),
             "--sweep-sizes", args.sweep_sizes, "--tolerance", f"{args.tolerance:g}",
             "--out", rel(args.out / "sensitivity.json"), "--preset-out", rel(args.out / "subset.toml"),
             "--runs-dir", rel(args.out / "sensitivity")] + sets(args.sets))


def variant_label(variant: str) -> str:
    return f"adaptive[{variant}]"


def variant_sets(variant: str) -> list[str]:
    return [f"adaptive.{kv.strip()}" for kv in variant.split(",") if kv.strip()]


def run_dir(args: argparse.Namespace, config: str, seed: int) -> Path:
    if config.startswith("adaptive["):
        slug = config[len("adaptive["):-1].replace(",", "_").replace("=", "")
        return args.out / f"adaptive-{slug}-seed{seed}"
    return args.out / f"{config}-seed{seed}"


def simulate_cmd(args: argparse.Namespace, config: str, seed: int) -> list[str]:
    preset = rel(args.out / "subset.toml") if config == SUBSET else config
    extra = args.adaptive_sets if config == ADAPTIVE else []
    if config.startswith("adaptive["):
        preset, extra = ADAPTIVE, args.adaptive_sets + variant_sets(config[len("adaptive["):-1])
    return (["gossiploco", "simulate", "--config", preset, *common_options(args, seed),
             "--out", rel(run_dir(args, config, seed)), "--quiet"] + sets(args.sets) + sets(extra))


def execute(args: argparse.Namespace, cmd: list[str], what: str, done: Path) -> None:
    if args.skip_existing and done.exists():
        print(f"  {what}: kept ({rel(done)} exists)", flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "gossiploco", *cmd[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    print(f"  {what}: done in {time.time() - start:.0f}s", flush=True)


def show(cmd: list[str]) -> str:
    return " ".join(f"'{c}'" if any(ch in c for ch in " []\"*") else c for c in cmd)


# ---------------------------------------------------------------------------------------------
# Measurements


def load_run(path: Path) -> dict:
    """summary.json plus the per-round figures of metrics.jsonl."""
    summary = json.loads((path / "summary.json").read_text())
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # Each round's communication stats (and the adaptive decision) go into the first record after it.
    summary["mix2_bytes"] = [r["mix2_bytes"] for r in records if "mix2_bytes" in r]
    summary["decisions"] = [r["mix2_decision"] for r in records if "mix2_decision" in r]
    return summary


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def stats(runs: list[dict]) -> dict:
    per_seed_bytes = [mean(r["mix2_bytes"]) for r in runs]
    return {
        "val": mean([r["final_val_loss"] for r in runs]),
        "js": mean([r["max_cd_js"] for r in runs]),
        "bytes": mean(per_seed_bytes),
        "bytes_max": max(max(r["mix2_bytes"]) for r in runs),
    }


# ---------------------------------------------------------------------------------------------
# The benchmark


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    variants = [variant_label(v) for v in args.variants]
    if not args.report_only:
        first = [(c, s) for c in CONFIGS + variants if c != SUBSET for s in args.seeds]
        run = lambda c, s: execute(args, simulate_cmd(args, c, s), f"{c} seed {s}", run_dir(args, c, s) / "summary.json")
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            sens = pool.submit(execute, args, sensitivity_cmd(args), "sensitivity (globalm1)", args.out / "subset.toml")
            futures = [pool.submit(run, c, s) for c, s in first]
            sens.result()  # the subset runs need its preset
            futures += [pool.submit(run, SUBSET, s) for s in args.seeds]
            for f in futures:
                f.result()
    runs = {c: [load_run(run_dir(args, c, s)) for s in args.seeds] for c in CONFIGS + variants}
    sensitivity = json.loads((args.out / "sensitivity.json").read_text())
    # Wall time: the sum of every training run's own wall time (the sensitivity runs' included) over the jobs
    # in parallel; each run's figure depends on what else the machine was running.
    sens_runs = [json.loads(p.read_text())["wall_s"] for p in sorted((args.out / "sensitivity").glob("*/summary.json"))]
    walls = [r["wall_s"] for rs in runs.values() for r in rs] + sens_runs
    wall = (sum(walls) / args.jobs, len(walls) * min(walls) / args.jobs)
    text = report(args, runs, sensitivity, wall, variants)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(text)
    print(text)
    print(f"wrote {args.results}")


def report(args: argparse.Namespace, runs: dict[str, list[dict]], sensitivity: dict, wall: tuple[float, float],
           variants: list[str]) -> str:
    proposal = sensitivity.get("proposal", {})
    subset_blocks = proposal.get("blocks", [])
    s = {c: stats(rs) for c, rs in runs.items()}
    base = s[BASELINE]
    bench_cmd = (f"python bench/adaptive.py --seeds {' '.join(map(str, args.seeds))} --workers {args.workers} "
                 f"--inner-steps {args.inner_steps} --rounds {args.rounds} --model {args.model} --sweep-sizes {args.sweep_sizes} "
                 f"--tolerance {args.tolerance:g} --sensitivity-seed {args.sensitivity_seed} --jobs {args.jobs} --threads {args.threads} "
                 f"--set {' '.join(args.sets)}" + (f" --adaptive-set {' '.join(args.adaptive_sets)}" if args.adaptive_sets else "")
                 + (f" --variants {' '.join(args.variants)}" if args.variants else ""))
    adaptive_cfg = runs[ADAPTIVE][0].get("run_config", {}).get("adaptive", {})
    lines = [
        "# Adaptive Mix2 benchmark (virtual swarm, built-in corpus)",
        "",
        f"Regenerate: `{bench_cmd}` (`--report-only` rewrites this file from the runs in `{rel(args.out)}`).",
        "",
        f"Model `{args.model}`, M = {args.workers}, H = {args.inner_steps}, R = {args.rounds} "
        f"({args.inner_steps * args.rounds} inner steps per worker), seeds {args.seeds}, overrides {' '.join(args.sets)} "
        "for every run" + (f"; adaptive runs also {' '.join(args.adaptive_sets)}" if args.adaptive_sets else "") + ". "
        + f"Whole benchmark: about {wall[0] / 60:.0f} min wall on this machine ({os.cpu_count()} cores, {args.jobs} runs in parallel, "
          f"{args.threads} torch thread each: the sum of the training runs' wall times over {args.jobs}, which grows with "
          f"whatever else the machine runs); about {wall[1] / 60:.0f} min at the pace of the fastest run.",
        "",
        "Commands, run from the repository root (`python -m gossiploco` does the same):",
        "",
        "```",
        show(sensitivity_cmd(args)),
    ]
    for c in CONFIGS + variants:
        for seed in args.seeds:
            lines.append(show(simulate_cmd(args, c, seed)))
    lines += ["```", ""]
    lines += [
        "Configurations: `globalm1` (no Mix2), `globalm1-localm2` (pairwise-gossip Mix2 on every block), "
        f"`subset` (the preset `gossiploco sensitivity` proposed: gossip Mix2 on {', '.join(subset_blocks) or 'nothing'}), "
        f"`globalm1-adaptive` (gossip Mix2 starting on embed and lm_head, grown and shrunk by the controller; "
        f"adaptive settings {json.dumps(adaptive_cfg)}).",
        "",
        "Final val loss is the averaged model's on the fixed validation batches; max CD_JS is eq. 46 over every "
        "measurement (round 0's value is shared by every configuration, since no mixing has acted yet). "
        "Mix2 bytes are the blocking Mix2 payload per worker per round (`mix2_bytes` of the metrics records, "
        "float32), averaged over the R rounds; for the adaptive run the value moves with its subset, so the "
        "largest round is also shown. Ratios are to globalm1-localm2's mean.",
        "",
        "| configuration | final val loss | vs globalm1-localm2 | max CD_JS | Mix2 bytes / round (mean) | max round | bytes vs globalm1-localm2 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in CONFIGS:
        v = s[c]
        lines.append(f"| {c} | {v['val']:.4f} | {100 * (v['val'] / base['val'] - 1):+.2f}% | {v['js']:.4f} | "
                     f"{v['bytes']:,.0f} | {v['bytes_max']:,.0f} | {100 * v['bytes'] / base['bytes']:.1f}% |")
    lines += ["", "Per seed:", "",
              "| configuration | seed | final val loss | max CD_JS | Mix2 bytes / round (mean) | max round | bytes vs globalm1-localm2 | wall s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in CONFIGS:
        for i, r in enumerate(runs[c]):
            b = mean(r["mix2_bytes"])
            b0 = mean(runs[BASELINE][i]["mix2_bytes"])
            lines.append(f"| {c} | {r['seed']} | {r['final_val_loss']:.4f} | {r['max_cd_js']:.4f} | {b:,.0f} | "
                         f"{max(r['mix2_bytes']):,.0f} | {100 * b / b0:.1f}% | {r['wall_s']:.0f} |")

    # Sensitivity
    lines += ["", "## Sensitivity (globalm1, seed %d)" % args.sensitivity_seed, "",
              f"Ranking by {sensitivity.get('rank_by', 'mean')} JS sensitivity over round starts, most sensitive first: "
              f"{', '.join(sensitivity.get('ranking', []))}.", ""]
    if "sweep" in sensitivity:
        lines += ["| subset | Mix2 params | peak CD_JS | final val loss | blocks |", "|---|---:|---:|---:|---|"]
        for r in sensitivity["sweep"]:
            val = f"{r['final_val_loss']:.4f}" if r.get("final_val_loss") is not None else "-"
            mark = " (proposed)" if r["label"] == proposal.get("label") else ""
            lines.append(f"| {r['label']}{mark} | {100 * r['mix2_fraction']:.1f}% | {r['peak_cd_js']:.4f} | {val} | "
                         f"{', '.join(r['blocks']) or '-'} |")
        lines += ["", f"Proposed (smallest subset with peak CD_JS within {100 * sensitivity.get('tolerance', args.tolerance):g}% "
                  f"of full Mix2's): {proposal.get('label')}, Mix2 on {', '.join(subset_blocks)}"
                  f"{'' if proposal.get('within_tolerance', True) else ' (no subset was within tolerance)'}."]

    # Adaptive decisions
    first = runs[ADAPTIVE][0]
    lines += ["", f"## Adaptive decisions (seed {first['seed']})", "",
              "Signal: the round's largest CD_JS; level: median of the previous rounds' signals (window). "
              "Blocks: how many blocks Mix2 covered in that round (after the decision), with the round's Mix2 bytes.", "",
              "| round | action | #blocks | Mix2 bytes | signal | level | reason |", "|---:|---|---:|---:|---:|---:|---|"]
    for d, b in zip(first["decisions"], first["mix2_bytes"]):
        fmt = lambda x: "-" if x is None else f"{x:.4f}"
        lines.append(f"| {d['round']} | {d['action']} | {len(d['blocks'])} | {b:,} | {fmt(d['signal'])} | {fmt(d['level'])} | {d['reason']} |")
    for r in runs[ADAPTIVE][1:]:
        acts = [f"r{d['round']} {d['action']} -> {len(d['blocks'])}" for d in r["decisions"] if d["action"] in ("grow", "shrink")]
        lines += ["", f"Seed {r['seed']}: {'; '.join(acts) or 'no grow or shrink'} "
                  f"(final subset {', '.join(r['decisions'][-1]['blocks']) if r['decisions'] else '-'})."]

    # Target
    a = s[ADAPTIVE]
    loss_ratio = a["val"] / base["val"] - 1
    bytes_ratio = a["bytes"] / base["bytes"]
    loss_ok = loss_ratio <= LOSS_TOLERANCE
    bytes_ok = bytes_ratio <= BYTES_LIMIT
    lines += ["", "## Target", "",
              "Adaptive within 1% of globalm1-localm2's final validation loss with at most half its blocking bytes "
              "(means over seeds; a lower loss counts as within).", "",
              f"- final val loss: {a['val']:.4f} vs {base['val']:.4f} ({100 * loss_ratio:+.2f}%): **{'met' if loss_ok else 'missed'}**",
              f"- blocking Mix2 bytes per round: {a['bytes']:,.0f} vs {base['bytes']:,.0f} ({100 * bytes_ratio:.1f}%, "
              f"max round {a['bytes_max']:,.0f}): **{'met' if bytes_ok else 'missed'}**"]
    for i, r in enumerate(runs[ADAPTIVE]):
        b0 = runs[BASELINE][i]
        lr = r["final_val_loss"] / b0["final_val_loss"] - 1
        br = mean(r["mix2_bytes"]) / mean(b0["mix2_bytes"])
        lines.append(f"- seed {r['seed']}: loss {100 * lr:+.2f}%, bytes {100 * br:.1f}%: "
                     f"{'met' if lr <= LOSS_TOLERANCE and br <= BYTES_LIMIT else 'missed'}")
    lines += ["", f"**Target {'met' if loss_ok and bytes_ok else 'missed'}.**", ""]
    vals = [r["final_val_loss"] for r in runs[BASELINE]]
    spread = max(vals) - min(vals)
    g1 = s["globalm1"]["val"]
    gap = lambda c: (g1 - s[c]["val"]) / (g1 - base["val"]) if g1 != base["val"] else float("nan")
    lines.append(f"For scale: globalm1-localm2's final val loss spans {spread:.4f} across its seeds "
                 f"({100 * spread / base['val']:.1f}% of its mean), and globalm1 (no Mix2) is "
                 f"{100 * (g1 / base['val'] - 1):+.2f}% from it; of that gap the adaptive runs close "
                 f"{100 * gap(ADAPTIVE):.0f}% and the subset {100 * gap(SUBSET):.0f}% (same seeds, so the runs of a seed share "
                 "initialisation and data).")
    lines += ["", "## What the controller did", ""] + explain(runs, ADAPTIVE, adaptive_cfg, loss_ok, bytes_ok)
    floor = runs[ADAPTIVE][0]["decisions"][0]["blocks"] if runs[ADAPTIVE][0]["decisions"] else []
    lines += ["", f"Against the sensitivity subset: that preset gossips {', '.join(subset_blocks)} in every round "
              f"({100 * s[SUBSET]['bytes'] / base['bytes']:.1f}% of the bytes, {100 * (s[SUBSET]['val'] / base['val'] - 1):+.2f}% loss); "
              f"the adaptive run starts from {', '.join(floor)} (the preset's floor) and covers only the blocks its spikes "
              f"added, for the rounds between their grow and shrink ({100 * s[ADAPTIVE]['bytes'] / base['bytes']:.1f}% of the bytes, "
              f"{100 * (s[ADAPTIVE]['val'] / base['val'] - 1):+.2f}% loss). Blocks in the sensitivity ranking's top "
              f"{len(subset_blocks)} that are not in the floor: "
              f"{', '.join(b for b in subset_blocks if b not in floor) or 'none'}."]

    if variants:
        lines += ["", "## Other adaptive settings tried", "",
                  "Each row is globalm1-adaptive with the named `adaptive.*` fields changed (everything else as above), "
                  "same seeds. Target: loss within 1% and bytes at most 50% of globalm1-localm2, means over seeds. "
                  + (VARIANTS_NOTE if "grow_factor=1.5" in args.variants else ""), "",
                  "| adaptive settings | final val loss | vs globalm1-localm2 | max CD_JS | Mix2 bytes / round (mean) | max round | "
                  "bytes vs globalm1-localm2 | target | grow / shrink by seed |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for c in [ADAPTIVE] + variants:
            v = s[c] = stats(runs[c])
            ok = v["val"] / base["val"] - 1 <= LOSS_TOLERANCE and v["bytes"] / base["bytes"] <= BYTES_LIMIT
            moves = "; ".join(f"seed {r['seed']}: " + (", ".join(f"r{d['round']} {d['action']} -> {len(d['blocks'])}"
                                                               for d in r["decisions"] if d["action"] in ("grow", "shrink")) or "none")
                              for r in runs[c])
            name = (f"as above (grow_factor={adaptive_cfg.get('grow_factor')}, calm_factor={adaptive_cfg.get('calm_factor')}, "
                    f"shrink_after={adaptive_cfg.get('shrink_after')}, window={adaptive_cfg.get('window')}, "
                    f"warmup_rounds={adaptive_cfg.get('warmup_rounds')})") if c == ADAPTIVE else c[len("adaptive["):-1]
            lines.append(f"| {name} | {v['val']:.4f} | {100 * (v['val'] / base['val'] - 1):+.2f}% | {v['js']:.4f} | {v['bytes']:,.0f} | "
                         f"{v['bytes_max']:,.0f} | {100 * v['bytes'] / base['bytes']:.1f}% | {'met' if ok else 'missed'} | {moves} |")
        lines += ["", "Per seed:", "", "| adaptive settings | seed | final val loss | vs globalm1-localm2 | Mix2 bytes / round (mean) | bytes vs globalm1-localm2 |",
                  "|---|---:|---:|---:|---:|---:|"]
        for c in variants:
            for i, r in enumerate(runs[c]):
                b0 = runs[BASELINE][i]
                lines.append(f"| {c[len('adaptive['):-1]} | {r['seed']} | {r['final_val_loss']:.4f} | "
                             f"{100 * (r['final_val_loss'] / b0['final_val_loss'] - 1):+.2f}% | {mean(r['mix2_bytes']):,.0f} | "
                             f"{100 * mean(r['mix2_bytes']) / mean(b0['mix2_bytes']):.1f}% |")
    return "\n".join(lines) + "\n"


def explain(runs: dict[str, list[dict]], config: str, adaptive_cfg: dict, loss_ok: bool, bytes_ok: bool) -> list[str]:
    """What the adaptive runs did, from their decisions (the likely cause of a missed target)."""
    out = []
    for r in runs[config]:
        decisions = r["decisions"]
        signals = ", ".join("-" if d["signal"] is None else f"{d['signal']:.3f}" for d in decisions)
        moves = [d for d in decisions if d["action"] in ("grow", "shrink")]
        sizes = [len(d["blocks"]) for d in decisions]
        text = (f"- seed {r['seed']}: round signals (max CD_JS) {signals}; "
                + (", ".join(f"round {d['round']} {d['action']} to {len(d['blocks'])} blocks" for d in moves) if moves
                   else f"no grow or shrink, Mix2 stayed on its {sizes[0] if sizes else 0} floor blocks")
                + f"; Mix2 covered {min(sizes, default=0)} to {max(sizes, default=0)} blocks.")
        out.append(text)
    never_grew = all(not any(d["action"] == "grow" for d in r["decisions"]) for r in runs[config])
    if not loss_ok and never_grew:
        out += ["", f"Loss missed because the controller never grew Mix2 beyond its floor ({', '.join(runs[config][0]['decisions'][0]['blocks'])}). "
                "The one jump in CD_JS is from round 0 (every worker starts from x_0, so the round's disagreement builds "
                "from zero) to round 1, the first round that starts after an outer step; with "
                f"warmup_rounds = {adaptive_cfg.get('warmup_rounds')} that jump falls in the warmup and is never compared "
                "with a level. After it the signal only decays round by round, so later rounds are in between or calm "
                f"(at most calm_factor = {adaptive_cfg.get('calm_factor')} x their median) and none exceeds "
                f"grow_factor = {adaptive_cfg.get('grow_factor')} x the median. The controller reacts to spikes relative "
                "to its own recent level, not to the absolute disagreement that Mix1 alone leaves."]
    elif not loss_ok:
        out += ["", "Loss missed although the controller grew: see the decisions above for when, and the sensitivity sweep "
                "for which blocks close the loss gap."]
    if not bytes_ok:
        out += ["", "Bytes missed: the controller grew Mix2 onto large blocks (an MLP block is about 18% of the small model's "
                "parameters) and kept them for enough rounds to exceed half of full Mix2's bytes on average."]
    return out


if __name__ == "__main__":
    main()
