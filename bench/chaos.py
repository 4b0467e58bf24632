"""Chaos for the peer protocol: a deterministic simulator over many seeds, or real peer processes.

    python bench/chaos.py sim --seeds N [--peers M | --max-peers M] [--rounds R] [--seed-start S] [--jobs J] [--log]
    python bench/chaos.py real --trials N [...]            (bench/chaos_real.py: real processes, DHT, faults)

``sim`` runs ``gossiploco.simulation.simulate(seed)`` for seeds S .. S+N-1 (the peer count, 2 to 8 or with
``--max-peers M`` in an eighth of the seeds 9 to M, the group size (2, 3, 4 or 16) and 1 to 3 faults are drawn from
each seed unless ``--peers`` is given; ``--peers 1000`` runs a thousand peers; about a third of the seeds
also put peers behind NAT, with relays that fail and reset connections). It prints one line per
violation with the seed that reproduces it, the connections opened by path and the relays' resets
and drops, then ``N seeds, V violations``; it exits 1 if V > 0.
``--seed-start S --seeds 1 --log`` replays one seed exactly and prints its event log.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections import Counter

from gossiploco.simulation import simulate
from gossiploco.simulation.paths import PATHS


def _one(job: tuple[int, int | None, int, bool, int]) -> tuple[int, list[str], dict, list[str], list[str]]:
    seed, peers, rounds, log, max_peers = job
    result = simulate(seed, peers=peers, rounds=rounds, log=log, max_peers=max_peers)
    faults = [str(f) for f in result.faults]
    stats = {"peers": result.settings.peers, "nat": bool(result.settings.behind_nat), **result.stats}
    return seed, [str(v) for v in result.violations], stats, faults, result.log


def run_sim(args: argparse.Namespace) -> int:
    jobs = [(s, args.peers, args.rounds, args.log, args.max_peers)
            for s in range(args.seed_start, args.seed_start + args.seeds)]
    start = time.perf_counter()
    violations, kinds, sizes, links = 0, Counter(), Counter(), Counter()
    if args.jobs > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            results = pool.imap_unordered(_one, jobs, chunksize=16)
            violations = _report(results, args, kinds, sizes, links)
    else:
        violations = _report(map(_one, jobs), args, kinds, sizes, links)
    took = time.perf_counter() - start
    print(f"peers per seed: {dict(sorted(sizes.items()))}; by property: {dict(kinds) or 'none'}; {took:.1f}s")
    print(f"paths: {', '.join(f'{path} {links[path]}' for path in PATHS)}; seeds with NAT {links['nat_seeds']}; "
          f"relay resets {links['relay_resets']}, relay drops {links['relay_drops']}")
    print(f"{args.seeds} seeds, {violations} violations")
    return 1 if violations else 0


def _report(results, args, kinds: Counter, sizes: Counter, links: Counter) -> int:
    """Print each violation (and each log if asked); count seeds by size and connections by path into the counters."""
    count = 0
    for seed, found, stats, faults, log in results:
        sizes[stats["peers"]] += 1
        links.update(stats["paths"])
        links.update(relay_resets=stats["relay_resets"], relay_drops=stats["relay_drops"], nat_seeds=stats["nat"])
        for text in found:
            count += 1
            kinds[text.split(" ", 1)[0]] += 1
            print(f"seed {seed}: {text}  [faults: {'; '.join(faults)}]  replay: python bench/chaos.py sim "
                  f"--seed-start {seed} --seeds 1 --log", flush=True)
        if args.log:
            print(f"seed {seed}: {stats}; faults: {'; '.join(faults)}")
            print("\n".join(log))
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    sim = sub.add_parser("sim", help="the deterministic protocol simulator over many seeds")
    sim.add_argument("--seeds", type=int, default=1000)
    sim.add_argument("--seed-start", type=int, default=0)
    sim.add_argument("--peers", type=int, default=None, help="peers per run (default: 2 to 8, drawn per seed)")
    sim.add_argument("--max-peers", type=int, default=8,
                     help="above 8: an eighth of the seeds draw 9 to this many peers (CI: 64)")
    sim.add_argument("--rounds", type=int, default=5)
    sim.add_argument("--jobs", type=int, default=1, help="worker processes")
    sim.add_argument("--log", action="store_true", help="print each seed's event log (for replaying one seed)")
    real = sub.add_parser("real", help="real peer processes through the DHT under injected faults")
    import chaos_real  # bench/ is on sys.path when this file runs as a script

    chaos_real.add_arguments(real)
    args = parser.parse_args(argv)
    return run_sim(args) if args.mode == "sim" else chaos_real.run(args)


if __name__ == "__main__":
    sys.exit(main())
