"""What one late or dead peer costs the others, in the simulator, from 64 to 1,000 peers.

    python bench/late_peer_sim.py [--peers 64 256 1000] [--seeds 1] [--rounds 4] [--out bench/results/late-peer-sim]

Each cell runs one swarm four times with the same seed: calm; with one peer computing ten grace windows longer than
the others in every round ("late": it arrives at every exchange after its group decided); with that peer stopped
(SIGSTOP) for three windows from the moment round 1's Mix2 begins, whose bucket of peer 0 it leads ("frozen": its
followers wait for a leader that says nothing, and the heartbeat finds it stopped only after ``heartbeat_s``, 5 s); and with it crashing for good in the middle of round 1 ("dead"). The real protocol (``PeerNode``, agreement
in buckets of 16, ring Mix1 on a background task, gossip Mix2) on consumer links, a real run's clock ratios (20 s
rounds, 2 s grace window), no other fault (``gossiploco.simulation.swarm.SimSwarm``).

For every other peer and round: its blocking time (Mix2 plus waiting for Mix1 after compute) minus the calm run's,
in grace windows. The issue's bound: at most one grace window; for the peers whose Mix2 that round the late peer
leads (they wait for its decision, and give up one window and a control send after their ``Ready``: it never says
``Leading``), one window and a control send. Reported: the largest excess of each kind, and the 99th percentile of
all. Writes ``OUT.json`` and ``OUT.md`` with this command line; exits 1 when a bound is broken
or a run breaks a simulator property.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from gossiploco.protocol import groups
from gossiploco.protocol.agreement import CONTROL_SEND_S
from gossiploco.simulation.faults import Fault
from gossiploco.simulation.runs import SCALE_TIMES
from gossiploco.simulation.swarm import Settings, SimSwarm



def late_peer(seed: int, peers: int, group_size: int = 16) -> int:
    """The late or dead peer: the leader of peer 0's Mix2 bucket in round 1, so that it leads some followers."""
    view = list(range(peers))
    return groups.leader_of(seed, "mix2/1", groups.group_of(seed, "mix2/1", view, 0, group_size))

LATENESS_WINDOWS = 10
FROZEN_WINDOWS = 3
SLACK_WINDOWS = 0.05
"""Rings of other buckets end a few ms apart from run to run: what the calm and the changed run differ by anyway."""


def blocking(peers: int, seed: int, rounds: int, variant: str) -> tuple[dict[tuple[int, int], float], Settings, list]:
    """Each (peer, round)'s blocking time in one run of ``variant`` (calm, late or dead), the settings and the
    violations of the simulator's properties."""
    settings = Settings(peers=peers, rounds=rounds, group_size=16, links="consumer", mix2="gossip", **SCALE_TIMES)
    swarm = SimSwarm(seed, settings)
    faults = []
    late = late_peer(seed, peers)
    if variant == "late":
        swarm.inner_s[late] += LATENESS_WINDOWS * settings.grace_s
    elif variant == "dead":
        start = 1.5 * (settings.inner_s + settings.grace_s)
        faults = [Fault("crash", start, start, peer=late)]
    elif variant == "frozen":  # stopped (SIGSTOP) for 3 windows from round 1's Mix2 on, whose bucket of peer 0 it leads
        start = 2 * settings.inner_s
        faults = [Fault("pause", start, start + FROZEN_WINDOWS * settings.grace_s, peer=late)]
    result = swarm.run(faults)
    return {(p, r): b for p, r, _, b, _ in swarm.timings}, settings, [str(v) for v in result.violations]


def excess(calm: dict, changed: dict, settings: Settings, seed: int) -> dict:
    """The changed run's extra blocking over the calm run, in grace windows, for every peer but the late one."""
    grace = settings.grace_s
    late = late_peer(seed, settings.peers, settings.group_size)
    others, led = [], []
    for (p, r), b in changed.items():
        if p == late or (p, r) not in calm:
            continue
        extra = (b - calm[(p, r)]) / grace
        bucket = groups.group_of(seed, f"mix2/{r}", list(range(settings.peers)), p, settings.group_size)
        (led if late in bucket and groups.leader_of(seed, f"mix2/{r}", bucket) == late else others).append(extra)
    every = sorted(others + led)
    return {"max": round(max(others), 3), "p99": round(every[int(0.99 * (len(every) - 1))], 3),
            "led_by_it_max": round(max(led), 3) if led else None, "led_by_it": len(led), "samples": len(every)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[64, 256, 1000])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="bench/results/late-peer-sim")
    args = parser.parse_args(argv)
    rows = []
    for m in args.peers:
        for seed in range(1, args.seeds + 1):
            began = time.perf_counter()
            calm, settings, violations = blocking(m, seed, args.rounds, "calm")
            for variant in ("late", "frozen", "dead"):
                changed, _, more = blocking(m, seed, args.rounds, variant)
                row = {"peers": m, "seed": seed, "variant": variant, **excess(calm, changed, settings, seed),
                       "violations": violations + more}
                row["wall_s"] = round(time.perf_counter() - began, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    bound = 1.0 + SLACK_WINDOWS
    follower_bound = 1.0 + (CONTROL_SEND_S / SCALE_TIMES["grace_s"]) + SLACK_WINDOWS
    # A frozen peer is also a member of others' background Mix1 rings, which wait for it until the heartbeat finds it
    # stopped (``heartbeat_s``): that bound is the heartbeat's, not a grace window, so only its followers are checked
    broken = [r for r in rows if r["violations"] or (r["max"] > bound and r["variant"] != "frozen")
              or (r["led_by_it_max"] or 0) > follower_bound]
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "machine": platform.platform(),
                                                    "rows": rows}, indent=1))
    lines = [f"Command: `{command}` ({args.rounds} rounds, buckets of 16, consumer links, grace window "
             f"{SCALE_TIMES['grace_s']:g} s, one control send {CONTROL_SEND_S:g} s)", "",
             "Extra blocking of the other peers over the calm run of the same seed, in grace windows "
             "(bound: 1; followers of the late peer's own decisions: 1 plus one control send, "
             f"{follower_bound - SLACK_WINDOWS:.2f}; a frozen peer's other bucket-mates are not bound by a window: "
             "its Mix1 rings wait for it until the heartbeat finds it stopped):", "",
             "| M | seed | peer | max (others) | p99 (all) | max where it leads the peer's Mix2 (cases) | samples | "
             "violations | wall s (since the calm run began) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        led = f"{r['led_by_it_max']} ({r['led_by_it']})" if r["led_by_it"] else "- (0)"
        lines.append(f"| {r['peers']} | {r['seed']} | {r['variant']} | {r['max']} | {r['p99']} | {led} | "
                     f"{r['samples']} | {len(r['violations'])} | {r['wall_s']} |")
    lines += ["", "Every bound held." if not broken else f"**{len(broken)} row(s) broke a bound.**", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
