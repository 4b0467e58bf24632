"""Sixteen real peers in network namespaces, half of them behind home NAT, training a tiny model to the end in buckets.

    sudo .venv/bin/python bench/scale_netns.py [--peers 16] [--rounds 4] [--group-size 8] [--set KEY=VALUE ...]
                                               [--out runs/scale-netns]

The NAT testbed (``testbed/nat.py``): a bootstrap ``gossiploco dht`` node (and relay) on ``pub0``, ``peers / 2``
peers on public hosts ``pub1..`` and ``peers / 2`` on home hosts behind their routers' NAT (``home0..``: their
paths are reverse connections and relays, decided by the dial-back check). Every peer is ``gossiploco peer --join``
with the tiny model and real inner steps of ``globalm1-localm2``, ``[groups] size`` = ``--group-size`` (8: two
buckets per exchange at 16 peers, so Mix1 is each bucket's mean and Mix2 pairs inside buckets), and
``timeouts.heartbeat_s`` 30 (48 processes on this 2-core machine: peers, their DHT processes and p2pd). It reports
whether every peer exited 0 having run every round, each peer's failures, catch-ups, paths and members per
exchange, and with links on demand (``--set transport.links_idle_s=S``) the links each opened, closed and holds on
a relayed path; ``--out``/results.md holds the table and the command. Needs root (exit 2 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from testbed import nat as nt
from testbed.overrides import peer_args
from testbed.peers import netns_peers, run_swarm_key
from gossiploco.cli_options import parse_sets
from gossiploco.config import TINY_OVERRIDES

PRESET = "globalm1-localm2"
ENV = {"OMP_NUM_THREADS": "1"}


def peer_row(out: Path, rank: int) -> dict:
    """What one peer's summary and metrics say."""
    summary_path = out / f"peer-{rank}" / "summary.json"
    if not summary_path.exists():
        return {"rank": rank, "done": False}
    s = json.loads(summary_path.read_text())
    records = [json.loads(line) for line in (out / f"peer-{rank}" / "metrics.jsonl").read_text().splitlines() if line]
    members = [r["members"] for r in records if isinstance(r.get("members"), int)]
    return {"rank": rank, "done": True, "last_round": max((r.get("round", -1) for r in records), default=-1),
            "reachable": s.get("reach", {}).get("reachable"),
            "paths": sorted(set(s.get("reach", {}).get("per_peer", {}).values())),
            "failures": {k: v for k, v in s.items() if ("fail" in k or "catch" in k) and v},
            "final_val_loss": s.get("final_val_loss"), "members_median": statistics.median(members) if members else None,
            "links": s.get("security", {}).get("links_on_demand")}


def links_cell(links: dict | None) -> str:
    """A peer's links on demand: opened / closed (idle or for room) / held at the end (of them relayed)."""
    if not links:
        return "-"
    return f"{links['opened']} / {links['closed_idle']} / {links['linked']} ({links.get('relayed', 0)} relayed)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every peer (e.g. transport.links_idle_s=5)")
    parser.add_argument("--out", default="runs/scale-netns")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    public, homes = args.peers - args.peers // 2, args.peers // 2
    overrides = {**TINY_OVERRIDES, "workers": args.peers, "rounds": args.rounds, "inner_steps": args.inner_steps,
                 "groups.size": args.group_size, "timeouts.heartbeat_s": 30.0, "timeouts.startup_s": 300.0,
                 **parse_sets(args.set)}
    began = time.monotonic()
    with nt.NatTestbed(public=public + 1, homes=homes, prefix="gnsc") as bed:
        key = run_swarm_key(out)
        boot, join = bed.start_dht_node(bed.host("pub0"), out, env=ENV)
        hosts = [bed.host(f"pub{i + 1}") for i in range(public)] + [bed.host(f"home{j}") for j in range(homes)]
        try:
            with netns_peers(hosts, out, [*peer_args(PRESET, overrides), "--workers", str(args.peers)], env=ENV,
                             join=join, swarm_key=key) as peers:
                peers.start()
                codes = peers.wait(args.timeout_s)
        finally:
            boot.terminate()
    took = time.monotonic() - began
    rows = [peer_row(out, rank) | {"exit": codes.get(rank)} for rank in range(args.peers)]
    done = sum(1 for r in rows if r["exit"] == 0 and r.get("done"))
    command = "sudo .venv/bin/python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    lines = [f"Command: `{command}`; {took:.0f} s; {done} of {args.peers} peers exited 0 with their summary.", "",
             "| rank | host | exit | last round recorded | reachable | paths | members (median) | failures and catch-ups "
             "| final val loss | links on demand: opened / closed / held |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r, host in zip(rows, hosts):
        lines.append(f"| {r['rank']} | {host.name} | {r['exit']} | {r.get('last_round')} | {r.get('reachable')} "
                     f"| {', '.join(r.get('paths', []))} "
                     f"| {r.get('members_median')} | {r.get('failures') or '-'} | {r.get('final_val_loss')} "
                     f"| {links_cell(r.get('links'))} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"command": command, "seconds": took, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0 if done == args.peers else 1


if __name__ == "__main__":
    raise SystemExit(main())
