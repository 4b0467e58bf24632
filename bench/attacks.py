"""The attack suite: what an outsider who knows only the bootstrap address (plus, as a port scanner
would find them, the peers' data-plane and DHT ports) can do to a private run of real peer processes.

    python bench/attacks.py [--peers 3] [--rounds 60] [--only NAME ...] [--out DIR]
    python bench/attacks.py --all      # this suite, then every companion suite below

The companion suites, each its own script with its own results file (``--all`` runs them in turn, each in its
own process, and fails when any of them does):

* ``bench/attacks_relay.py``: strangers against the relay (free proxy, slot flood, 1 TiB length prefixes),
  private and open bootstrap (``bench/results/attacks-relay.md``);
* ``bench/attacks_surface.py``: dial-back jamming and oversized prefixes, the dashboard's Host check
  (``bench/results/attacks-surface.md``);
* ``bench/attacks_open.py``: strangers and members against an open run (DHT storage flood, a conflicting
  run entry, a state-request flood) (``bench/results/attacks-open.md``);
* ``bench/attacks_members.py --variant robust``: dishonest members of an open run, 1 of 4 real peers and
  2 of 8 virtual workers (``bench/results/attacks-members.md``).

Runs (each with a new swarm key and bootstrap node started here, ``start_bootstrap(swarm=key)``, and
``--peers`` real ``gossiploco peer --join`` processes of the tests' tiny config, ``globalm1-localm2``):

1. ``baseline``: no attack; gives each peer's final validation loss and a quiet peer's peak RSS;
2. ``intrusion``: every attack below but the floods, mounted concurrently (one thread each) once the
   peers have announced themselves, while they train;
3. ``flood``: connection floods against two peers while the last peer joins, and for the whole run.

Each attack returns a ``Result`` whose verdict is taken after the run: what a private swarm should do,
what happened (the attacker's own observations, the victims' ``summary.json`` "security" counters,
exit codes, RSS), and the honest peers' mean final validation loss against the baseline's. The swarm
must finish every round. Exit status 1 if any attack succeeded (or could not be mounted while the
swarm ran). Results go to ``--out`` (default ``runs/attacks``) and ``bench/results/attacks.md``.

Modules: this driver (runs, verdicts, report); ``attacks_swarm`` (the swarm, ``Result``); ``attacks_private``
(the attacks).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__:  # imported as bench.attacks (the repository root on sys.path, as under pytest)
    from bench.attacks_private import ATTACKS, FLOOD, INTRUSION
    from bench.attacks_swarm import LOSS_REL_TOL, ROOT, Result, Swarm, security
else:  # run as a script (python bench/attacks.py): bench/ is on sys.path
    from attacks_private import ATTACKS, FLOOD, INTRUSION
    from attacks_swarm import LOSS_REL_TOL, ROOT, Result, Swarm, security


def finish(sw: Swarm, results: list[Result], baseline: dict | None, timeout_s: float) -> None:
    sw.codes = sw.peers.wait(timeout_s)
    time.sleep(0.3)  # the sampler's last look
    for res in results:
        if res.check is not None:
            try:
                res.check(sw)
            except Exception as exc:  # noqa: BLE001 - a broken verdict is a failed attack check
                res.fail(f"verdict raised {type(exc).__name__}: {exc}")
    summaries = [sw.summary(r) for r in range(sw.count)]
    losses = [s.get("final_val_loss") for s in summaries]
    for rank, s in enumerate(summaries):
        if sw.codes.get(rank) != 0 or s.get("rounds") != sw.rounds:
            for res in results:
                res.fail(f"peer {rank} exit {sw.codes.get(rank)}, rounds {s.get('rounds')}: {sw.peers.log(rank)[-300:]!r}")
    failures = sum(s.get(k, 0) for s in summaries for k in ("mix1_failures", "mix2_failures"))
    catchups = sum(s.get("catchups", 0) for s in summaries)
    for res in results:
        mean = sum(x for x in losses if x is not None) / max(1, sum(x is not None for x in losses))
        res.loss = f"{mean:.4f}"
        if baseline:
            base = sum(baseline["losses"]) / len(baseline["losses"])
            res.loss += f" (baseline {base:.4f})"
            if abs(mean - base) > LOSS_REL_TOL * base:
                res.fail(f"final loss {mean:.4f} vs baseline {base:.4f}")
        res.happened.append(f"mix failures {failures}, catch-ups {catchups}")
        if failures > len(summaries) or catchups:
            res.fail("the swarm's mixing was disturbed")


def run_baseline(out: Path, args) -> dict:
    sw = Swarm("baseline", out / "baseline", args.peers, args.rounds)
    try:
        sw.peers.start()
        sw.codes = sw.peers.wait(args.timeout)
        summaries = [sw.summary(r) for r in range(sw.count)]
        if any(code != 0 for code in sw.codes.values()):
            raise RuntimeError(f"the attack-free run failed: {sw.codes}")
        return {"losses": [s["final_val_loss"] for s in summaries], "hwm": max(sw.hwm.values()),
                "security": [s["security"] for s in summaries], "wall_s": max(s["wall_s"] for s in summaries)}
    finally:
        sw.close()


def run_group(name: str, attacks: dict, out: Path, args, baseline: dict, late: bool) -> list[Result]:
    """Start the swarm (``late``: all but the last peer first), mount ``attacks`` concurrently once the
    first peers announced themselves, start the last peer, and take each verdict after the run."""
    sw = Swarm(name, out / name, args.peers, args.rounds)
    sw.baseline_hwm = baseline["hwm"] if baseline else 0
    results: dict[str, Result] = {}
    try:
        first = list(range(args.peers - 1)) if late else list(range(args.peers))
        sw.peers.start(first)
        sw.endpoints = sw.wait_announced(first)
        ids = {r: p for r, (p, _) in sw.endpoints.items()}
        learnt: dict[int, bytes] = {}
        if "discovery" in attacks:  # first: a stronger attacker then knows the servers' keys
            time.sleep(1.0)
            results["discovery"] = attacks["discovery"](sw, ids, learnt)

        def mount(attack_name: str) -> None:
            try:
                results[attack_name] = attacks[attack_name](sw, ids, learnt)
            except Exception as exc:  # noqa: BLE001 - an attack that cannot be mounted is reported
                results[attack_name] = Result(attack_name, "")
                results[attack_name].fail(f"could not be mounted: {type(exc).__name__}: {exc}")
            results[attack_name].happened.append(f"mounted by round {sw.round_of(0)} of {sw.rounds}")
            if sw.peers.procs[0].poll() is not None:
                results[attack_name].fail("the swarm had finished before the attack was over (use more --rounds)")
        threads = [threading.Thread(target=mount, args=(n,)) for n in attacks if n != "discovery"]
        for t in threads:
            t.start()
        if late:
            for t in threads:
                t.join(60)
            sw.peers.start([args.peers - 1])
            sw.endpoints.update(sw.wait_announced([args.peers - 1]))
        for t in threads:
            t.join(240)
        finish(sw, list(results.values()), baseline, args.timeout)
        for rank in range(sw.count):
            print(f"[{name}] peer {rank}: exit {sw.codes.get(rank)}, {security(sw.summary(rank))}", flush=True)
    finally:
        sw.close()
    return [results[n] for n in attacks if n in results]


def write_results(path: Path, command: str, baseline: dict | None, results: list[Result], wall: float) -> None:
    lines = ["# Attack suite: outsiders against a private swarm", "",
             "Produced by `bench/attacks.py` (the project's own attack suite; see its docstring).", "",
             "```", command, "```", "",
             f"Machine: 2 shared CPU cores, loopback. Bench wall time {wall:.0f} s. Runs: one attack-free baseline, "
             "then `intrusion` (every attack but the floods, mounted concurrently while the peers train) and "
             "`flood` (floods up before the last peer starts, kept up all run); each run has its own swarm key "
             "and bootstrap node, and the same config (so the same final loss when nothing interferes)."]
    if baseline:
        lines += ["", f"Baseline: final val loss per peer {[round(x, 4) for x in baseline['losses']]}, quiet peak RSS "
                      f"{baseline['hwm'] >> 10} MiB, wall {baseline['wall_s']:.0f} s, security counters "
                      f"{baseline['security']} (joins race the members' record reads: a few refusals are expected)."]
    lines += ["", "| Attack | A private swarm should | What happened (evidence) | Honest peers' final val loss | Verdict |",
              "|---|---|---|---|---|"]
    for res in results:
        happened = "; ".join(res.happened).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {res.attack} | {res.expected} | {happened} | {res.loss} | {'held' if res.ok else 'SUCCEEDED'} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--only", nargs="+", choices=ATTACKS, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "attacks")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "attacks.md")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--all", action="store_true", help="then run every companion suite (module docstring)")
    args = ap.parse_args()
    if args.peers < 2:
        ap.error("--peers must be at least 2")
    chosen = args.only or ATTACKS
    started = time.monotonic()
    baseline = run_baseline(args.out, args)
    print(f"baseline: losses {baseline['losses']}, peak RSS {baseline['hwm'] >> 10} MiB", flush=True)
    results = []
    intrusion = {n: a for n, a in INTRUSION.items() if n in chosen}
    if intrusion:
        results += run_group("intrusion", intrusion, args.out, args, baseline, late=False)
    flood = {n: a for n, a in FLOOD.items() if n in chosen}
    if flood:
        results += run_group("flood", flood, args.out, args, baseline, late=True)
    command = "python bench/attacks.py " + " ".join(sys.argv[1:])
    write_results(args.results, command.strip(), baseline, results, time.monotonic() - started)
    for res in results:
        print(f"{'held     ' if res.ok else 'SUCCEEDED'} {res.attack}: {'; '.join(res.happened)}", flush=True)
    failed = [] if all(res.ok for res in results) else ["bench/attacks.py"]
    if args.all:
        failed += run_companions()
    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


COMPANIONS = (["bench/attacks_relay.py"], ["bench/attacks_surface.py"], ["bench/attacks_open.py"],
              ["bench/attacks_members.py", "--variant", "robust"])


def run_companions() -> list[str]:
    """Each companion suite in its own process (they start their own bootstrap nodes and peers), one after
    another; the ones that failed (an attack that succeeded, or a suite that could not run), by command."""
    failed = []
    for argv in COMPANIONS:
        command = " ".join(["python", *argv])
        print(f"== {command}", flush=True)
        if subprocess.run([sys.executable, *argv], cwd=ROOT).returncode != 0:
            failed.append(command)
    return failed


if __name__ == "__main__":
    sys.exit(main())
