"""bench/netem.py's report: the markdown tables of a run's results.json (utilization against the
prediction, the per-round breakdown, the link probes, encryption's cost on the ring, the heartbeat check)."""

from __future__ import annotations

import statistics

if __package__:  # imported as bench.netem_report (the repository root on sys.path, as under pytest)
    from bench.netem_network import ring_rate_mbps
else:  # bench/netem.py run as a script: bench/ is on sys.path
    from netem_network import ring_rate_mbps


# ---------------------------------------------------------------------------------------
# Reports


def last_round_pct(r: dict) -> float | None:
    """Median over peers of the last round's utilization: compute per round / (compute per round + the
    last round's Mix1 wait, Mix2 and outer step). Leaves out round 0, whose start the peers reach at
    different moments (whoever connects last starts last, and round 0's first exchange waits for it)."""
    if r["prediction"]["mode"] != "factored":
        return None
    rounds, values = r["overrides"]["rounds"], []
    for p in r["peers"]:
        last, compute = p["last_round"], p["compute_s"] / rounds
        blocked = sum(last.get(k) or 0.0 for k in ("mix1_wait_s", "mix2_s", "outer_s"))
        values.append(100 * compute / (compute + blocked))
    return statistics.median(values)


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['preset']} | {r['bandwidth_mbps']:g} | | | | | error | | | | {r['error'].splitlines()[0]} |"
    pred = r["prediction"]
    mix1_ratio = pred["mix1_attempt_s"] / pred["compute_s"] if pred["mix1_attempt_s"] else 0.0
    notes = []
    mon = statistics.median(p["monitor_s"] for p in r["peers"])
    if mon > 0.01:
        notes.append(f"monitor all-reduce {100 * mon / statistics.median(p['rounds_s'] for p in r['peers']):.0f}% of "
                     f"round time; without it {r['measured_without_monitor_pct']:.1f}%")
    goodput, last = r.get("predicted_at_goodput_pct"), last_round_pct(r)
    return (f"| {r['preset']} | {r['bandwidth_mbps']:g} | {mix1_ratio:.2f} | {r['predicted_pct']:.1f} | "
            f"{r['measured_median_pct']:.1f} ({r['measured_min_pct']:.1f}-{r['measured_max_pct']:.1f}) | "
            f"{r['diff_pts']:+.1f} | {'pass' if r['pass'] else 'MISS'} | {r['failures']} | "
            f"{f'{goodput:.1f}' if goodput is not None else '-'} | {f'{last:.1f}' if last is not None else '-'} | "
            f"{'; '.join(notes)} |")


def breakdown_row(r: dict) -> str:
    """Per-round seconds, median over peers: measured against predicted."""
    if "error" in r:
        return ""
    pred, rounds = r["prediction"], r["overrides"]["rounds"]

    def med(key: str) -> float:
        return statistics.median(p[key] for p in r["peers"]) / rounds

    sync = pred["mode"] == "sync-dp"
    blocking = med("grad_s") if sync else med("mix1_wait_s") + med("mix2_s")
    return (f"| {r['preset']} | {r['bandwidth_mbps']:g} | {pred['compute_s']:.2f} / {med('compute_s'):.2f} | "
            f"{pred['blocking_comm_s']:.2f} / {blocking:.2f} | {med('monitor_s'):.2f} | {med('other_s'):.2f} | "
            f"{pred['wall_s']:.2f} / {med('rounds_s'):.2f} |")


def markdown(results: dict) -> str:
    lines: list[str] = []
    if results["runs"]:  # none with --presets none (link probes only)
        lines += ["| preset | B (Mbit/s) | Mix1 / compute | predicted % | measured % median (min-max) | diff (pts) | "
                  "within 5 | failed exchanges | simulator at TCP goodput % | measured, last round % | notes |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
        lines += [fmt_row(r) for r in results["runs"]]
        lines += ["", "Per round, median over peers, predicted / measured seconds (blocking = Mix1 wait + Mix2, or the "
                  "gradient all-reduces of sync-dp; other = outer step, packing, thread hand-offs):", "",
                  "| preset | B | compute | blocking comm | monitor | other | round |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [breakdown_row(r) for r in results["runs"] if "error" not in r]
        lines.append("")
    lines += ["| B (Mbit/s) | raw TCP goodput | ring all-reduce of the model (median of repeats) | % of B | "
              "globalm1 Mix1 (last round, median peer) | diloco Mix2 (last round, median peer) |",
              "|---:|---:|---:|---:|---:|---:|"]
    for link in results["links"]:
        b = link["bandwidth_mbps"]
        tcp = link.get("tcp", {}).get("mbps")
        ring = link.get("ring_mbps")
        cells = [f"{b:g}", f"{tcp:.2f} ({100 * tcp / b:.1f}%)" if tcp else "-",
                 f"{ring:.2f} Mbit/s ({statistics.median(link['ring']['durations_s']):.2f} s)" if ring else "-",
                 f"{100 * ring / b:.1f}%" if ring else "-"]
        for preset, key in (("globalm1", "mix1"), ("diloco", "mix2")):
            rate = mix_rate(results, preset, b, key)
            cells.append(f"{rate:.2f} Mbit/s ({100 * rate / b:.1f}%)" if rate else "-")
        lines.append("| " + " | ".join(cells) + " |")
    secured = [link for link in results["links"] if len(link.get("ring", {}).get("by_security", {})) > 1]
    if secured:
        lines += ["", "Ring all-reduce per transport (`--ring-security`), alternating repeat by repeat in the same "
                  "probe processes; medians of the repeats, rates as above:", "",
                  "| B (Mbit/s) | raw TCP goodput | plain: median s | plain: Mbit/s (% of B) | curve: median s | "
                  "curve: Mbit/s (% of B) | curve / plain time (median) | curve / plain per repeat | "
                  "CPU s per peer per all-reduce, plain / curve |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for link in secured:
            b, by = link["bandwidth_mbps"], link["ring"]["by_security"]
            tcp = link.get("tcp", {}).get("mbps")
            plain, curve = by.get("plain"), by.get("curve")
            if not (plain and curve):
                continue
            ratios = [c / p for p, c in zip(plain["durations_s"], curve["durations_s"])]
            lines.append(f"| {b:g} | {f'{tcp:.2f} ({100 * tcp / b:.1f}%)' if tcp else '-'} | {plain['median_s']:.3f} | "
                         f"{plain['mbps']:.2f} ({100 * plain['mbps'] / b:.1f}%) | {curve['median_s']:.3f} | "
                         f"{curve['mbps']:.2f} ({100 * curve['mbps'] / b:.1f}%) | "
                         f"{curve['median_s'] / plain['median_s']:.3f} | {', '.join(f'{r:.2f}' for r in ratios)} | "
                         + (f"{plain['cpu_s']:.3f} / {curve['cpu_s']:.3f} |" if plain.get("cpu_s") is not None
                            and curve.get("cpu_s") is not None else "- |"))
    swaps = [link for link in results["links"] if "swap" in link]
    if swaps:
        lines += ["", "Heartbeat check (`--swap-mb`): peers 0 and 1 swap a payload with `ZmqExchange.swap`:", ""]
        lines += [f"- {link['bandwidth_mbps']:g} Mbit/s: {swap_line(link['swap'], link['bandwidth_mbps'])}" for link in swaps]
    return "\n".join(lines)


def swap_line(swap: dict, bandwidth_mbps: float) -> str:
    """One line on a heartbeat check: what was swapped, with which timeout, and how it went."""
    chunk_s = swap["chunk_mb"] * (1 << 20) * 8 / (bandwidth_mbps * 1e6)
    what = (f"swap of {swap['mb']:g} MB in {swap['chunk_mb']:g} MiB chunks ({chunk_s:.1f} s per chunk at the link rate), "
            f"heartbeat timeout {swap['heartbeat_s']:g} s: ")
    if swap["ok"]:
        return what + f"ok in {swap['seconds']:.1f} s"
    errors = sorted({f"rank {side['rank']}: {side['error']}" for side in swap["sides"] if "error" in side})
    return what + f"FAILED after {swap['seconds']:.1f} s ({'; '.join(errors)})"


def mix_rate(results: dict, preset: str, bandwidth: float, mix: str) -> float | None:
    """Effective ring rate of the last round's all-reduce ``mix`` of ``preset`` (median over peers)."""
    for r in results["runs"]:
        if r["preset"] == preset and r["bandwidth_mbps"] == bandwidth and "error" not in r:
            rates = []
            for p in r["peers"]:
                seconds, nbytes = p["last_round"].get(f"{mix}_s"), p["last_round"].get(f"{mix}_bytes")
                if seconds and nbytes:
                    rates.append(ring_rate_mbps(nbytes, len(r["peers"]), seconds))
            return statistics.median(rates) if rates else None
    return None
