"""The scaling curve in the simulator: what one peer's rounds cost as the swarm grows from 4 to 1,000 peers.

    python bench/scale_sim.py [--peers 4 16 64 256 1000] [--seeds 2] [--rounds 5] [--out bench/results/scale-sim]

Every run is ``gossiploco.simulation.simulate_scale``: the real protocol (``PeerNode``, its agreement in buckets
of ``[groups] size`` = 16, ring all-reduce Mix1 on a background task, gossip Mix2) on consumer links (50 Mbit/s to
1 Gbit/s, 20 to 100 ms between two peers), compute times within 5% of each other, 1% of the peers crashing in each
round and coming back 10 s later (join, catch-up), a real run's clock ratios (20 s rounds, 2 s grace window).
Side by side in the same run: the same swarms with no churn (what membership changes cost), and one group for
everyone (``--one-group-up-to``: the design before buckets, a global barrier and one ring through every member), and
links on demand (``--links-idle-s``: each peer opens a link when it sends and closes it after that long idle, instead
of a connection to every member; ``SimNetwork.idle_s``), with churn and without. ``--newcomers F``: in every variant,
brand-new peers arrive too, F x M a round on average (``simulation.newcomers``); the per-peer columns stay the
founding peers', and the newcomers' own are added (how many finished, the control messages each sent in all).
``--without-mix1-again``: each variant with churn also runs with a failed Mix1 not run again among its group's
survivors (``mix1.again = false``; ``mixing.again``), side by side.

Per peer per round (medians over peers and rounds): round time, blocking time (Mix2 plus waiting for Mix1 after
compute), Mix1 completion (the share of rounds whose Mix1 mixed with at least one other peer), bytes and messages
sent, control messages sent (everything but data chunks) and received, and connections (up at the end; the most a
peer had up at once, median and max over peers; opened over the run); and under each table, the exchanges that
failed in each cell, by cause, summed over its seeds, and the Mix1s run again (succeeded, failed).
Writes ``OUT.json`` and ``OUT.md`` (with this command line).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from gossiploco.simulation.runs import simulate_scale

COLUMNS = ["round_s", "blocking_s", "blocking_p90_s", "mix1_completion", "bytes_per_round", "messages_per_round",
           "control_per_round", "control_received_per_round", "connections_live", "connections_peak",
           "connections_peak_max", "connections_opened"]


def run_one(peers: int, seed: int, rounds: int, churn: float, group_size: int, links_idle_s: float = 0.0,
            links_cap: int = 0, newcomers: float = 0.0, mix1_again: bool = True) -> dict:
    began = time.perf_counter()
    result = simulate_scale(seed, peers, rounds=rounds, churn=churn, group_size=group_size, links_idle_s=links_idle_s,
                            links_cap=links_cap, newcomers=newcomers, mix1_again=mix1_again)
    return {"peers": peers, "seed": seed, "churn": churn, "group_size": group_size, "links_idle_s": links_idle_s,
            "links_cap": links_cap, "newcomers_share": newcomers, "mix1_again_on": mix1_again,
            "violations": [str(v) for v in result.violations], "wall_s": round(time.perf_counter() - began, 1),
            "finished": sum(1 for p, k in result.finished.items() if p < peers and k >= rounds),
            **result.stats["per_peer"]}


def summarize(rows: list[dict]) -> dict:
    """Medians over seeds of each column."""
    out = {c: round(statistics.median(r[c] for r in rows), 4) for c in COLUMNS}
    out["wall_s"] = round(statistics.median(r["wall_s"] for r in rows), 1)
    out["violations"] = sum(len(r["violations"]) for r in rows)
    out["finished"] = min(r["finished"] for r in rows)
    out["connections_peak_max"] = max(r["connections_peak_max"] for r in rows)
    out["newcomers"] = sum(r["newcomers"] for r in rows)
    out["newcomers_finished"] = sum(r["newcomers_finished"] for r in rows)
    out["newcomer_control_sent"] = round(statistics.median(r["newcomer_control_sent"] for r in rows), 1)
    out["failures"] = dict(sum((Counter(r["failures"]) for r in rows), Counter()).most_common())
    out["mix1_again"] = dict(sum((Counter(r["mix1_again"]) for r in rows), Counter()))
    return out


def table(title: str, entries: list[tuple[int, dict]]) -> list[str]:
    joins = any(s["newcomers"] for _, s in entries)
    lines = [f"### {title}", "", "| M | round s | blocking s (p90) | Mix1 done | bytes/round | msgs/round | control/round | "
             "control received/round | conns up | conns peak (max) | conns opened | finished | violations | sim wall s |"
             + (" newcomers finished | newcomer control sent |" if joins else ""),
             "|" + "---|" * (16 if joins else 14)]
    for m, s in entries:
        lines.append(f"| {m} | {s['round_s']:.2f} | {s['blocking_s']:.2f} ({s['blocking_p90_s']:.2f}) | "
                     f"{s['mix1_completion']:.3f} | {s['bytes_per_round']:.0f} | {s['messages_per_round']:.1f} | "
                     f"{s['control_per_round']:.1f} | {s['control_received_per_round']:.1f} | "
                     f"{s['connections_live']} | {s['connections_peak']} ({s['connections_peak_max']}) | "
                     f"{s['connections_opened']} | "
                     f"{s['finished']}/{m} | {s['violations']} | {s['wall_s']} |"
                     + (f" {s['newcomers_finished']}/{s['newcomers']} | {s['newcomer_control_sent']:.0f} |" if joins else ""))
    lines.append("")
    for m, s in entries:  # why exchanges failed, summed over the seeds (``simulation.costs.failure_cause``)
        causes = "; ".join(f"{cause} ({n})" for cause, n in s["failures"].items()) or "none"
        again = s["mix1_again"]
        lines.append(f"- M = {m}, exchanges failed: {causes}; Mix1 run again: {again.get('ok', 0)} succeeded, "
                     f"{again.get('failed', 0)} failed")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 16, 64, 256, 1000])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--churn", type=float, default=0.01)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--one-group-up-to", type=int, default=256,
                        help="also run one group for everyone at sizes up to this (0: never)")
    parser.add_argument("--links-idle-s", type=float, nargs="*", default=[30.0],
                        help="also run links on demand, closed after this many idle seconds (none: only a full mesh)")
    parser.add_argument("--links-cap", type=int, default=0,
                        help="links on demand: the most links a peer keeps (SimNetwork.links_cap; 0: no bound)")
    parser.add_argument("--only-links", action="store_true", help="run only the links-on-demand variants")
    parser.add_argument("--newcomers", type=float, default=0.0,
                        help="brand-new peers arriving each round, as a share of M (0.01: 10 a round at 1,000)")
    parser.add_argument("--without-mix1-again", action="store_true",
                        help="also run each churned variant with a failed Mix1 not run again (mix1.again = false)")
    parser.add_argument("--out", default="bench/results/scale-sim")
    args = parser.parse_args(argv)
    groups, churned = f"groups of {args.group_size}", f"{args.churn:.0%} churn"  # the titles say what ran
    variants = [] if args.only_links else [
        (f"{groups}, {churned}", args.churn, args.group_size, args.peers, 0.0),
        (f"{groups}, no churn", 0.0, args.group_size, args.peers, 0.0),
        (f"one group (the former global barrier), {churned}", args.churn, None,
         [m for m in args.peers if m <= args.one_group_up_to], 0.0)]
    variants = [v for v in variants if v[3]]
    cap = f", at most {args.links_cap} a peer" if args.links_cap else ""
    for idle in args.links_idle_s:
        variants += [(f"{groups}, {churned}, links on demand (closed after {idle:g} s idle{cap})", args.churn,
                      args.group_size, args.peers, idle),
                     (f"{groups}, no churn, links on demand (closed after {idle:g} s idle{cap})", 0.0,
                      args.group_size, args.peers, idle)]
    if args.newcomers:
        variants = [(f"{title}, newcomers {args.newcomers:g} x M a round", *rest) for title, *rest in variants]
    variants = [(*v, True) for v in variants]
    if args.without_mix1_again:  # each churned variant right after its twin with Mix1 run again
        variants = [w for v in variants
                    for w in ([v, (f"{v[0]}, Mix1 not run again", *v[1:5], False)] if v[1] else [v])]
    results: dict[str, dict[int, dict]] = {}
    rows = []
    for title, churn, size, sizes, idle, again in variants:
        results[title] = {}
        for m in sizes:
            runs = [run_one(m, seed, args.rounds, churn, size or max(m, 2), idle, args.links_cap if idle else 0,
                            args.newcomers, again) for seed in range(1, args.seeds + 1)]
            rows += runs
            results[title][m] = summarize(runs)
            print(f"{title}: M={m} {json.dumps(results[title][m])}", flush=True)
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "machine": platform.platform(),
                                                    "summary": {t: {str(m): s for m, s in v.items()}
                                                                for t, v in results.items()},
                                                    "runs": rows}, indent=1))
    lines = [f"Command: `{command}` ({args.seeds} seeds per cell, medians; {args.rounds} rounds)", ""]
    for title, entries in results.items():
        lines += table(title, sorted(entries.items()))
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 1 if any(s["violations"] for v in results.values() for s in v.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
