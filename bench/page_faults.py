"""What freed-page reuse saves: in-place all-reduces back to back, with the exchange's malloc thresholds and without.

``--peers`` processes (``spawn``) on 127.0.0.1, one ``ZmqExchange`` each (plaintext, or ``--sealed``: CurveZMQ with
data sealed with AES-GCM, as ``gossiploco peer`` runs), all-reduce one ``--values`` float32 tensor in place
``--reps`` times back to back after one warm-up (the input is not regenerated between repetitions: the steady state
of a peer that mixes every round). Each repetition's time is the slowest peer's; CPU seconds and minor page faults
are per peer (medians). The peers run under ``testbed.spawned.run_group`` (killed, their process groups
included, on any error or timeout). Two sets of peers alternate ``--rounds`` times: ``reuse`` (the exchange sets glibc's
``M_MMAP_THRESHOLD``/``M_TRIM_THRESHOLD``, ``transport.process_limits.reuse_freed_memory``) and ``defaults``
(``GLIBC_TUNABLES=glibc.malloc.perturb=0`` in the peers' environment: a no-op setting, which makes the exchange leave
malloc as glibc sets it). Every wait has a deadline.

    python -m bench.page_faults --rounds 3 --out bench/results/page-faults.md
    python -m bench.page_faults --sealed --rounds 3 --out bench/results/page-faults-sealed.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from gossiploco.runtime.launch import free_ports

from testbed.spawned import become_session_leader, close_within, cpu_seconds, finish, run_group

DEFAULTS_ENV = {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}
WAIT_S = 120.0


def _peer(rank: int, world: int, cfg: dict, barrier, results, info_q, extra) -> None:
    """One peer (``testbed.spawned.run_group``'s target): its repetitions' (seconds, CPU seconds, minor faults)."""
    become_session_leader()
    try:
        import resource

        import torch

        torch.set_num_threads(1)
        from gossiploco.transport.process_limits import reuse_freed_memory
        from gossiploco.transport.zmq_exchange import ZmqExchange

        options = {}
        if cfg["sealed"]:
            from gossiploco.security.swarm_key import SwarmKey
            from gossiploco.security.trust import Trust

            options["trust"] = Trust.static(SwarmKey.parse(cfg["key"]), rank, world)
        exchange = ZmqExchange(rank, cfg["endpoints"], "page-faults", WAIT_S, **options)
        if not exchange.wait_connected(WAIT_S):
            raise RuntimeError(f"rank {rank}: peers did not connect")
        x = torch.randn(cfg["values"])
        rows = []
        for rep in range(cfg["reps"] + 1):
            barrier.wait(WAIT_S)
            faults, cpu, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, cpu_seconds(), time.monotonic()
            exchange.all_reduce_mean(f"mix1/{rep}", x, list(range(world)), inplace=True)
            rows.append((time.monotonic() - start, cpu_seconds() - cpu,
                         resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
        barrier.wait(WAIT_S)
    except BaseException:  # noqa: BLE001 - every failure goes to the driver, which kills the group
        results.put(("error", rank, traceback.format_exc()))
        finish(results, 1)
    results.put(("done", rank, (reuse_freed_memory(), rows[1:])))
    closed = close_within(exchange.close, 15.0)
    results.put(("closed", rank, closed))
    finish(results, 0)


def run_set(label: str, env: dict[str, str], args, key: str) -> dict:
    """One set of peers with ``env`` added to their environment: per-repetition times, CPU and faults."""
    cfg = {"endpoints": [f"tcp://127.0.0.1:{p}" for p in free_ports(args.peers)], "sealed": args.sealed, "key": key,
           "values": args.values, "reps": args.reps}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawn passes this process's environment on
    try:
        messages = run_group(_peer, args.peers, cfg, WAIT_S * (args.reps + 2), f"page-faults-{label}")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    got = {m[1]: m[2] for m in messages if m[0] == "done"}
    walls = [max(got[r][1][i][0] for r in got) for i in range(args.reps)]
    return {"label": label, "reused": sorted({got[r][0] for r in got}), "walls": walls,
            "median_s": statistics.median(walls),
            "cpu_s": statistics.median(row[1] for r in got for row in got[r][1]),
            "faults": statistics.median(row[2] for r in got for row in got[r][1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--values", type=int, default=100_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two sets")
    p.add_argument("--sealed", action="store_true", help="CurveZMQ with AES-GCM sealed data (default: plaintext)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from gossiploco.security.swarm_key import SwarmKey

    key = SwarmKey.generate().text  # the sealed runs' (each set of peers a run of its own: ports differ)
    rows = []
    for i in range(args.rounds):
        for label, env in (("reuse", {}), ("defaults", DEFAULTS_ENV)):
            row = run_set(label, env, args, key)
            rows.append(row)
            print(f"{label}: median {row['median_s']:.3f} s, CPU {row['cpu_s']:.3f} s, faults {row['faults']:.0f} "
                  f"(reused: {row['reused']}; {', '.join(f'{w:.3f}' for w in row['walls'])})", flush=True)
    command = " ".join(["python -m bench.page_faults", *(sys.argv[1:] if argv is None else argv)])
    reuse = [r["median_s"] for r in rows if r["label"] == "reuse"]
    defaults = [r["median_s"] for r in rows if r["label"] == "defaults"]
    ratios = [d / r for r, d in zip(reuse, defaults)]
    lines = [f"# Freed-page reuse, {'sealed' if args.sealed else 'plaintext'} in-place all-reduce", "",
             f"Regenerate: `{command}`", "",
             f"{args.peers} peers, {args.values:,} float32 values each, {args.reps} repetitions after a warm-up, "
             f"{args.rounds} alternations (see the module docstring).", "",
             "| set | median s | CPU s per peer | minor faults per peer | repetitions s |", "|---|---:|---:|---:|---|"]
    lines += [f"| {r['label']} | {r['median_s']:.3f} | {r['cpu_s']:.3f} | {r['faults']:.0f} | "
              f"{', '.join(f'{w:.3f}' for w in r['walls'])} |" for r in rows]
    lines += ["", f"defaults / reuse, per alternation: {', '.join(f'{x:.2f}' for x in ratios)} "
              f"(median {statistics.median(ratios):.2f})"]
    print(lines[-1])
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
