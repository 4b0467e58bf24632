"""Gossip's pair mean against the ring all-reduce of the same vector, on loopback, encrypted as peers run.

``--peers`` processes (spawn) on 127.0.0.1, each a ``ZmqExchange`` with a static list's identities derived from a
swarm key made for the run (CurveZMQ, data chunks sealed with AES-256-GCM on the sealed port: what ``gossiploco
peer`` runs). Each repetition times, in an order that rotates per repetition so that each sees the same load:

* ``pair-mean``: ``swap_mean(inplace=True)`` with the partner ``rank ^ 1`` (``protocol.collectives.PairMean``:
  each chunk averaged into the caller's vector as it arrives), what ``GossipMix`` runs;
* ``swap+add``: ``swap`` and then ``(theirs + mine) / 2`` in the received tensor, the path before it;
* ``ring``: ``all_reduce_mean(inplace=True)`` over every peer, what ``GlobalMix`` runs.

Every peer's input is ``randn`` seeded by (rank, repetition), so each can regenerate its partner's: after the clock
stops each checks its pair mean bit for bit against ``(a + b) / 2`` written here, and the ring's mean against the
float64 mean within float32's rounding. A repetition's time is the slowest peer's; the report gives medians and the
ratio of each to the ring. The paper's simulator (``gossiploco utilization``) charges a ring 2 (M - 1) / M of the
payload per peer and a swap 1: at 4 peers the swap should take 2/3 of the ring, at 2 peers the same.

    python bench/gossip_swap.py                                     # 4 peers, 25M values: bench/results/gossip-swap.md
    python bench/gossip_swap.py --peers 2 --values 5_000_000 --reps 3 --out /tmp/swap.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

from gossiploco.runtime.launch import free_ports
from testbed.machine import cpu_model
from testbed.spawned import GroupFailed, become_session_leader, close_within, finish, run_group

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("pair-mean", "swap+add", "ring")


def peer_input(rank: int, rep: int, n: int):
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(rank * 100_003 + rep))


def peer(rank: int, world: int, cfg: dict, barrier, results, _info, _extra) -> None:
    become_session_leader()
    code = 0
    try:
        import torch

        from gossiploco.security.swarm_key import SwarmKey
        from gossiploco.security.trust import Trust
        from gossiploco.transport.zmq_exchange import ZmqExchange

        torch.set_num_threads(1)
        ex = ZmqExchange(rank, cfg["endpoints"], "gossip-swap", cfg["timeout_s"],
                         trust=Trust.static(SwarmKey.parse(cfg["swarm_key"]), rank, world))
        if not ex.wait_connected(cfg["timeout_s"]):
            raise RuntimeError(f"rank {rank}: peers did not connect within {cfg['timeout_s']}s")
        n, partner, members = cfg["values"], rank ^ 1, list(range(world))
        for rep in range(cfg["warmup"] + cfg["reps"]):
            mine, theirs = peer_input(rank, rep, n), peer_input(partner, rep, n)
            pair_reference = (mine + theirs) / 2  # x_i <- (x_i + x_j) / 2, in float32
            kinds = KINDS[rep % 3:] + KINDS[:rep % 3]
            for kind in kinds:
                flat = mine.clone()
                barrier.wait(cfg["timeout_s"])
                began = time.perf_counter()
                if kind == "pair-mean":
                    out = ex.swap_mean(f"pm/{rep}", partner, flat, inplace=True)
                elif kind == "swap+add":
                    out = ex.swap(f"sw/{rep}", partner, flat).add_(flat).div_(2)
                else:
                    out = ex.all_reduce_mean(f"ring/{rep}", flat, members, inplace=True)
                seconds = time.perf_counter() - began
                if kind == "ring":
                    exact = sum(peer_input(r, rep, n).double() for r in members) / world
                    error = float((out.double() - exact).abs().max())
                    ok = error <= cfg["ring_tolerance"]
                else:
                    ok, error = torch.equal(out, pair_reference), 0.0
                if not ok:
                    raise AssertionError(f"rank {rank} rep {rep}: {kind} is wrong (max error {error:g})")
                if rep >= cfg["warmup"]:
                    results.put(("time", rank, rep, kind, seconds))
        results.put(("done", rank))
        results.put(("closed", rank, close_within(ex.close, 10.0)))
    except BaseException:  # noqa: BLE001 - reported to the driver, which stops the group
        results.put(("error", rank, traceback.format_exc()))
        code = 1
    finish(results, code)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4, help="an even number: the pairs are (0, 1), (2, 3), ...")
    ap.add_argument("--values", type=lambda s: int(s.replace("_", "")), default=25_000_000)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gossip-swap.md")
    args = ap.parse_args(argv)
    if args.peers < 2 or args.peers % 2:
        ap.error("--peers must be an even number, at least 2")
    from gossiploco.security.swarm_key import SwarmKey

    # The ring's float32 mean of M standard normals (|x| < 8: beyond it, 1e-15 a value): its M - 1 additions each
    # round by at most half an ulp of a partial sum below 8M, at most 2^(log2(8M) + 1 - 24); divided by M, and with
    # the division's own half ulp, under M * 2^-20.
    cfg = {"endpoints": [f"tcp://127.0.0.1:{p}" for p in free_ports(args.peers)], "swarm_key": SwarmKey.generate().text,
           "values": args.values, "reps": args.reps, "warmup": args.warmup, "timeout_s": args.timeout,
           "ring_tolerance": args.peers * 2.0 ** -20}
    started = time.perf_counter()
    try:
        messages = run_group(peer, args.peers, cfg, idle_timeout_s=4 * args.timeout, label="gossip-swap")
    except GroupFailed as exc:
        sys.exit(f"error: {exc}")
    times: dict[str, dict[int, float]] = {k: {} for k in KINDS}
    for m in messages:
        if m[0] == "time":
            _, _rank, rep, kind, seconds = m
            times[kind][rep] = max(times[kind].get(rep, 0.0), seconds)  # the slowest peer's
    medians = {k: statistics.median(times[k].values()) for k in KINDS}
    ring_bytes, swap_bytes = 2 * (args.peers - 1) / args.peers, 1.0
    lines = [
        "# Gossip's pair mean against the ring all-reduce (bench/gossip_swap.py)", "",
        f"Command: `python bench/gossip_swap.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({time.perf_counter() - started:.0f} s)",
        f"Machine: {cpu_model()}; {args.peers} peers on loopback, {args.values:,} fp32 values each, encrypted "
        "(CurveZMQ, data sealed with AES-256-GCM), one torch thread each.", "",
        f"Median of {args.reps} repetitions (after {args.warmup} warm-up), each the slowest peer's time; results "
        "checked against (a + b) / 2 bit for bit (pairs) and the float64 mean (ring).", "",
        "| collective | median s | each repetition (s) | / ring | bytes each peer sends, in payloads |",
        "|---|---:|---|---:|---:|",
    ]
    for k in KINDS:
        reps = ", ".join(f"{times[k][r]:.3f}" for r in sorted(times[k]))
        share = ring_bytes if k == "ring" else swap_bytes
        lines.append(f"| {k} | {medians[k]:.3f} | {reps} | {medians[k] / medians['ring']:.2f} | {share:.2f} |")
    lines += ["", f"The simulator's ratio (bytes alone): a swap takes {swap_bytes / ring_bytes:.2f} of the ring here.", ""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
