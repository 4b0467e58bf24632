"""Measurement and reporting of chaos_real trials (``bench/chaos_real.py``): progress and stalls per life, the
verdict of one run (``analyze``), one line per run, the markdown table and the summary."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from pathlib import Path

if __package__:  # imported as bench.chaos_real_report (the repository root on sys.path, as under pytest)
    from bench.chaos_real_swarm import (FAULT_ENV, PROCESS_FAULTS, SCENARIO, SCENARIO_FAULT, Context, Life, RunSpec,
                                         Swarm)
else:  # run from bench/chaos_real.py as a script: bench/ is on sys.path
    from chaos_real_swarm import (FAULT_ENV, PROCESS_FAULTS, SCENARIO, SCENARIO_FAULT, Context, Life, RunSpec,
                                  Swarm)

REJOIN_WINDOW_S = 15.0
"""A restarted peer that could not rejoin because the swarm finished within this long of its start makes
the trial inconclusive (a start takes about 10 s here: torch import, DHT node, discovery)."""


def warnings_of(path: Path, limit: int = 8) -> list[str]:
    """The last ``limit`` WARNING / ERROR / Traceback lines of a log (trimmed)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    keep = [line.strip()[:300] for line in text if re.search(r"WARNING|ERROR|Traceback|Error:", line)]
    return keep[-limit:]


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def describe(fault: dict) -> str:
    kind = fault["kind"]
    if kind == "none":
        return "none (baseline)"
    if kind == SCENARIO:
        return f"{SCENARIO}: rank 1 {FAULT_ENV}={SCENARIO_FAULT}"
    if kind in PROCESS_FAULTS:
        extra = {"stop": f", SIGCONT after {fault.get('stop_s')}s", "restart": f", restart after {fault.get('restart_after_s')}s"
                 + (f", {fault['rounds']} rounds" if fault.get("rounds") else "")}
        return f"{kind} rank {fault['target']}{extra.get(kind, '')}"
    scope = "all" if len(fault["ranks"]) > 1 and kind != "partition" else ",".join(map(str, fault["ranks"]))
    what = {"loss": f"{fault.get('loss_pct')}%", "delay": f"{fault.get('delay_ms')}ms", "slow": f"{fault.get('slow_mbit')}Mbit/s",
            "partition": "cut"}[kind]
    return f"{kind} {what} ranks {scope} for {fault['duration_s']}s"


def progress_times(records: list[tuple[float, dict]]) -> list[float]:
    """When each record's step was reached, on the bench's clock: its ``run_s`` plus the life's offset between the
    two clocks, the smallest (arrival - ``run_s``) of its records (a record arrives at or after its step); the
    arrival times where a record lacks ``run_s``."""
    arrivals = [t for t, _ in records]
    runs = [r.get("run_s") for _, r in records]
    if not records or not all(isinstance(x, (int, float)) for x in runs):
        return arrivals
    offset = min(t - x for t, x in zip(arrivals, runs))
    return [offset + x for x in runs]


def life_stats(life: Life, rounds: int, t_end: float) -> dict:
    """A life's progress: rounds completed, longest stall (frozen time subtracted), where it was."""
    times = progress_times(life.records)
    recs = [r for _, r in life.records]
    done_rounds = max((r.get("round", -1) for r in recs if r.get("h") == 0), default=-1)
    summary = read_json(life.out_dir / "summary.json")
    finished = life.exit_code == 0 and done_rounds >= rounds and summary is not None
    events = list(times)
    if not finished and events:
        events.append(life.exited_at if life.exited_at is not None else t_end)  # an open gap counts
    longest, where = 0.0, None
    for i in range(1, len(events)):
        a, b = events[i - 1], events[i]
        frozen = sum(max(0.0, min(b, c) - max(a, s)) for s, c in life.frozen)
        gap = b - a - frozen
        if gap > longest:
            before = recs[i - 1]
            after = recs[i] if i < len(recs) else None
            longest = gap
            where = {"from": f"r{before.get('round')} h{before.get('h')}",
                     "to": f"r{after.get('round')} h{after.get('h')}" if after else "exit" if life.exited_at else "deadline",
                     "start_s": a}
    out = {
        "peer": life.name, "rank": life.rank, "life": life.index, "exit_code": life.exit_code,
        "records": len(recs), "rounds_completed": max(done_rounds, 0), "finished": finished,
        "longest_stall_s": round(longest, 2), "stall_where": where,
        "first_record_s": round(times[0] - life.started, 2) if times else None,
        "final_val_loss": summary.get("final_val_loss") if summary else None,
        "wall_s": summary.get("wall_s") if summary else None,
    }
    if summary:
        for key in ("mix1_failures", "mix2_failures", "monitor_failures", "catchups"):
            if key in summary:
                out[key] = summary[key]
    h0 = [(t, r["round"]) for t, r in zip(times, recs) if r.get("h") == 0 and isinstance(r.get("round"), int)]
    if len(h0) >= 2 and h0[-1][1] > h0[0][1]:
        out["round_s"] = round((h0[-1][0] - h0[0][0]) / (h0[-1][1] - h0[0][1]), 3)
    joined = [r for r in recs if "catchup_from" in r]
    if joined:
        out["caught_up_from"] = joined[0]["catchup_from"]
        out["first_round"] = recs[0].get("round")
    out["warnings"] = warnings_of(life.log_path)
    return out


def analyze(ctx: Context, spec: RunSpec, fault: dict, swarm: Swarm, limits: dict, state: dict, events: list,
            orphan_checks: dict, t0: float, end: float, wall: float) -> dict:
    rounds = int(limits["rounds"])
    kind = fault["kind"]
    injected = state["injected_at"]
    target = fault.get("target") if kind in (*PROCESS_FAULTS, SCENARIO) else None
    peers = []
    for life in swarm.lives:
        stats = life_stats(life, rounds, end)
        if stats["stall_where"]:
            stats["stall_where"]["start_s"] = round(stats["stall_where"]["start_s"] - t0, 2)
        stats["role"] = ("survivor" if life.rank != target else
                         {"kill": "killed", SCENARIO: "killed", "stop": "resumed",
                          "restart": "killed" if life.index == 0 else "restarted"}[kind])
        peers.append(stats)
    survivors = [p for p in peers if p["role"] == "survivor"]
    bound = limits["bound_s"]
    problems = []
    if kind != "none" and injected is None:
        problems.append("the fault never fired (the run ended or hung before its time)")
    inconclusive = None
    if kind == "restart" and injected is not None:
        back = [(p, life) for p, life in zip(peers, swarm.lives) if p["role"] == "restarted"]
        if not back:
            problems.append("the killed peer was never restarted")
        for p, life in back:
            p["rejoined"] = bool(p.get("catchups") or "caught_up_from" in p)
            others_done = max((l.exited_at or end) for l in swarm.lives if l.rank != life.rank)
            p["swarm_ran_after_restart_s"] = round(others_done - life.started, 1)
            if not p["rejoined"]:
                if others_done - life.started < REJOIN_WINDOW_S:
                    inconclusive = (f"the swarm finished {others_done - life.started:.1f}s after {p['peer']} was started "
                                    f"(< {REJOIN_WINDOW_S:g}s), so the rejoin was not exercised (it ended with exit "
                                    f"{p['exit_code']} after {p['rounds_completed']}/{rounds} rounds)")
                    p["role"] = "restarted-too-late"  # not held to finishing: there was nothing left to join
                else:
                    problems.append(f"{p['peer']} did not download the state (no catch-up) while the swarm was running")
    for p in (p for p in peers if p["role"] in ("survivor", "resumed", "restarted")):
        if not p["finished"]:
            problems.append(f"{p['peer']} ({p['role']}) did not finish: exit {p['exit_code']}, "
                            f"{p['rounds_completed']}/{rounds} rounds")
    for p in survivors:
        if p["longest_stall_s"] > bound:
            w = p["stall_where"] or {}
            problems.append(f"{p['peer']} stalled {p['longest_stall_s']:.1f}s > {bound:.1f}s "
                            f"({w.get('from')} -> {w.get('to')} at t={w.get('start_s')}s)")
    if state["timed_out"]:
        problems.append("trial deadline reached")
    stalls = [p["longest_stall_s"] for p in survivors]
    losses = [p["final_val_loss"] for p in survivors if p["final_val_loss"] is not None]
    base = ctx.baselines.get((spec.config, spec.peers))
    val = statistics.fmean(losses) if losses else None
    round_times = [p["round_s"] for p in survivors if p.get("round_s")]
    walls = [p["wall_s"] for p in survivors if p["wall_s"] is not None]
    failures = {k: sum(p.get(f"{k}_failures") or 0 for p in survivors) for k in ("mix1", "mix2", "monitor")}
    orphans = sorted(orphan_checks.values(), key=lambda o: o["peer"])
    result = {
        "label": spec.label, "config": spec.config, "peer_count": spec.peers, "fault": fault, "fault_text": describe(fault),
        "injected_at_s": round(injected - t0, 2) if injected is not None else None,
        "injected_in_round": _round_at(swarm, injected, target), "pass": not problems, "problems": problems,
        "inconclusive": inconclusive,
        "bound_s": bound, "max_survivor_stall_s": max(stalls) if stalls else None,
        "stalls_over_adaptive_floor": sum(1 for s in stalls if s > limits["adaptive_floor_s"]),
        "survivors_finished": f"{sum(p['finished'] for p in survivors)}/{len(survivors)}",
        "val_loss": val, "baseline_val_loss": base.get("val_loss") if base else None,
        "val_loss_delta": (val - base["val_loss"]) if val is not None and base and base.get("val_loss") is not None
        and rounds == ctx.args.rounds else None,  # a run of more rounds (a restart's) is not the baseline's peer
        "orphans_after_10s": sum(len(o["processes"]) for o in orphans), "orphan_checks": orphans,
        "round_s": statistics.fmean(round_times) if round_times else None,
        "survivor_wall_s": max(walls) if walls else None,
        "lost_s": round(max(walls) - base["wall_s"] - (rounds - ctx.args.rounds) * (base.get("round_s") or 0.0), 1)
        if walls and base and base.get("wall_s") else None,
        "survivor_failures": failures,
        "wall_s": round(wall, 1), "timed_out": state["timed_out"], "events": events, "peers": peers,
    }
    return result


def _round_at(swarm: Swarm, t: float | None, rank: int | None = None) -> str | None:
    """Where peer ``rank`` (None: the swarm, its most advanced peer) was at time ``t``: its last (round, h) recorded."""
    if t is None:
        return None
    best = None
    for life in swarm.lives if rank is None else [life for life in swarm.lives if life.rank == rank][:1]:
        for at, rec in life.records:
            if at <= t and "round" in rec:
                key = (rec["round"], rec.get("h", 0))
                best = key if best is None or key > best else best
    return f"r{best[0]} h{best[1]}+" if best else "start-up"


# ---------------------------------------------------------------------------------------------
# Reporting


def line(result: dict, index: str) -> str:
    stall = result["max_survivor_stall_s"]
    delta = result["val_loss_delta"]
    val = (f"val {result['val_loss']:.3f}" + (f" ({delta:+.3f})" if delta is not None else "")) if result["val_loss"] is not None else "val -"
    where = f"@{result['injected_at_s']}s {result['injected_in_round']}" if result["injected_at_s"] is not None else (
        "" if result["fault"]["kind"] == "none" else "NOT INJECTED")
    leader = " (leader)" if result["fault"].get("leader") else ""
    lost = f" | lost {result['lost_s']:+.1f}s" if result.get("lost_s") is not None and result["fault"]["kind"] != "none" else ""
    return (f"[{index}] {result['fault_text']}{leader} {where} | survivors finished {result['survivors_finished']} | "
            f"max stall {stall if stall is not None else '-'}s (bound {result['bound_s']:.0f}s) | "
            f"failures {_failures(result)}{lost} | {val} | "
            f"orphans@10s {result['orphans_after_10s'] if result['orphan_checks'] else '-'} | {result['wall_s']}s | "
            f"{'PASS' if result['pass'] else 'FAIL'}"
            + ("" if result["pass"] else f": {'; '.join(result['problems'])}")
            + (f" (inconclusive: {result['inconclusive']})" if result.get("inconclusive") else ""))


def _failures(result: dict) -> str:
    f = result.get("survivor_failures") or {}
    return "/".join(str(f.get(k, 0)) for k in ("mix1", "mix2", "monitor"))


def markdown(command: str, report: dict) -> str:
    lim = report["limits"]
    out = [f"Command: `{command}`", "",
           f"Machine: {os.cpu_count()} CPU cores (load average {report['load_average']} at the start), {'network namespaces' if report['netem'] else 'loopback'}"
           + (f" (sch_netem: {'yes' if report['sch_netem'] else 'no, delay replaced by a slow HTB link, loss by a BPF classifier'})"
              if report["netem"] else "") + f"; {report['date']}.", "",
           f"Config: `{report['config']}` ({report['scenario_config']} for the scenario), tiny model, "
           f"R = {lim['rounds']}, H = {lim['inner_steps']}, monitor.every = {lim['monitor_every']}, "
           + ("real inner steps" if not report["synthetic_step_s"] else f"synthetic inner steps of {report['synthetic_step_s']}s")
           + f"; timeouts.exchange_s = {lim['exchange_s']:g}, grace_s = {lim['grace_s']:g}, min_exchange_s = {lim['min_exchange_s']:g}, "
           f"adaptive_factor = {lim['adaptive_factor']:g}, heartbeat_s = {lim['heartbeat_s']:g}.", "",
           f"Stall bound = grace_s + exchange_s = {lim['bound_s']:g} s (one grace window plus the exchange deadline; the adaptive "
           f"deadline is at most exchange_s). Stall = longest gap between two consecutive metrics records of a survivor, "
           f"timed when each record's step was reached (its run_s, on the bench's clock: a record written late, once its "
           f"background measurement ended, counts from its step; 0.1 s polling). Failures: the survivors' failed Mix1 / Mix2 / "
           f"monitor exchanges, summed. Lost: the slowest survivor's wall time minus the fault-free run's (noisy: it also "
           f"moves with the machine's load, which others share).", "",
           "| run | fault | injected | survivors finished | max survivor stall s | failures | lost s | val loss (Δ vs fault-free) "
           "| orphans at the check (--orphan-check-s after the kill) | wall s | result |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        delta = f" ({r['val_loss_delta']:+.4f})" if r["val_loss_delta"] is not None else ""
        val = f"{r['val_loss']:.4f}{delta}" if r["val_loss"] is not None else "-"
        inj = f"{r['injected_at_s']} s, {r['injected_in_round']}" if r["injected_at_s"] is not None else (
            "-" if r["fault"]["kind"] == "none" else "**not injected**")
        leader = " (leader)" if r["fault"].get("leader") else ""
        res = "pass" if r["pass"] else "**FAIL**: " + "; ".join(r["problems"]).replace("|", "/")
        if r.get("inconclusive"):
            res += f" (inconclusive: {r['inconclusive']})"
        stall = r["max_survivor_stall_s"]
        lost = f"{r['lost_s']:+.1f}" if r.get("lost_s") is not None and r["fault"]["kind"] != "none" else "-"
        out.append(f"| {r['label']} | {r['fault_text']}{leader} | {inj} | {r['survivors_finished']} | "
                   f"{stall if stall is not None else '-'} | {_failures(r)} | {lost} | {val} | {r['orphans_after_10s'] if r['orphan_checks'] else '-'} | "
                   f"{r['wall_s']} | {res} |")
    s = report["summary"]
    out += ["", f"Summary: {s['text']}", ""]
    return "\n".join(out)


def summarize(report: dict) -> dict:
    runs = report["runs"]
    trials = [r for r in runs if r["fault"]["kind"] != "none"]
    failed = [r["label"] for r in runs if not r["pass"]]
    stalls = [r["max_survivor_stall_s"] for r in trials if r["max_survivor_stall_s"] is not None]
    walls = [r["wall_s"] for r in trials]
    with_orphans = [r["label"] for r in trials if r["orphans_after_10s"]]
    checked = [r for r in trials if r["orphan_checks"]]
    inconclusive = [r["label"] for r in runs if r.get("inconclusive")]
    bound = report["limits"]["bound_s"]
    text = (f"{len(trials)} faulted runs ({len(runs) - len(trials)} baseline): {len(trials) - sum(1 for r in trials if not r['pass'])} pass, "
            f"{sum(1 for r in trials if not r['pass'])} fail; "
            f"stalls over {bound:g}s: {sum(1 for s in stalls if s > bound)}; max survivor stall {max(stalls, default=0):.1f}s; "
            f"orphans 10 s after a kill in {len(with_orphans)} of {len(checked)} kills; "
            f"wall per trial mean {statistics.fmean(walls) if walls else 0:.1f}s max {max(walls, default=0):.1f}s"
            + (f"; inconclusive: {', '.join(inconclusive)}" if inconclusive else "")
            + (f"; FAILED: {', '.join(failed)}" if failed else "; target met"))
    return {"failed": failed, "max_stall_s": max(stalls, default=None), "stalls_over_bound": sum(1 for s in stalls if s > bound),
            "trials_with_orphans": with_orphans, "inconclusive": inconclusive, "mean_wall_s": statistics.fmean(walls) if walls else None, "text": text,
            "pass": not failed}


def write_report(args: argparse.Namespace, command: str, report: dict) -> None:
    report["summary"] = summarize(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos-real.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / "chaos-real.md").write_text(markdown(command, report))
