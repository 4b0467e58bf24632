"""What ``gossiploco utilization`` shows of a result: one JSON object, a few terminal lines, the bandwidth sweep plot."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

from gossiploco.utilization.model import CommPlan, MixLoad, RoundTime, Scenario, simulate


def report(plan: CommPlan, sc: Scenario, result: RoundTime) -> dict[str, Any]:
    """One JSON-ready object: every field of ``result``, then the inputs and payloads."""
    return {
        "config": plan.name,
        "mode": plan.mode,
        **asdict(result),
        "mix1": {**asdict(plan.mix1), "payload_bytes": plan.mix1.payload_values(sc.params) * sc.bytes_per_value * plan.mix1.scale},
        "mix2": {**asdict(plan.mix2), "payload_bytes": plan.mix2.payload_values(sc.params) * sc.bytes_per_value * plan.mix2.scale},
        "monitors_per_round": plan.monitors,
        "scenario": asdict(sc),
    }


def describe(plan: CommPlan, sc: Scenario, result: RoundTime) -> str:
    """A few lines for a terminal."""

    def row(label: str, seconds: float, note: str = "") -> str:
        return f"  {label:24s}{seconds:10.1f} s{note}"

    lines = [
        f"{plan.name}: N = {sc.params:.4g}, M = {sc.workers}, H = {sc.inner_steps}, T = {sc.step_time_s:.4g} s, "
        f"{sc.bandwidth_mbps:g} Mbps, {sc.bytes_per_value:g} B/value, failure rate {sc.failure_rate:g}",
        f"compute utilization {100 * result.compute_utilization:.1f}%  (per round:)",
        row("compute", result.compute_s),
    ]
    if plan.mode == "sync-dp":
        lines.append(row("gradient all-reduces", result.mix2_s, f"  blocking, {result.mix2_attempt_s:.1f} s per attempt"))
    else:
        lines += [
            row(f"mix1 {_mix_label(plan.mix1)}", result.mix1_s,
                f"  hidden {result.mix1_hidden_s:.1f} s, exposed {result.mix1_exposed_s:.1f} s"),
            row(f"mix2 {_mix_label(plan.mix2)}", result.mix2_s, "  blocking"),
            row("outer step", result.outer_step_s),
        ]
        if plan.monitors:
            lines.insert(-1, row(f"monitors x{plan.monitors}", result.monitor_s, "  blocking, sharing the link with Mix1"))
    lines.append(row("wall", result.wall_s))
    if plan.mode == "factored" and plan.mix1.kind != "identity":
        lines.append(f"Mix1 is fully hidden from H = {result.min_inner_steps_hiding_mix1:.1f} inner steps (without failures)")
    return "\n".join(lines)


def _mix_label(mix: MixLoad) -> str:
    label = mix.kind + ("+state" if mix.state else "") + (f" x{mix.scale:.3g} bytes" if mix.scale != 1.0 and mix.kind != "identity" else "")
    return label if mix.fraction == 1.0 or mix.kind == "identity" else f"{label} ({100 * mix.fraction:.0f}%)"


def plot_bandwidth_sweep(path: Path, plans: Sequence[CommPlan], sc: Scenario, bandwidths_mbps: Sequence[float] | None = None) -> None:
    """Utilization against bandwidth for each plan, like the paper's Figure 3, as a PNG.

    Solid lines: no failures. Dotted lines: ``sc.failure_rate``, when it is above 0.
    Headless (matplotlib's Agg backend).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if bandwidths_mbps is None:
        bandwidths_mbps = [10 * 10 ** (i / 40) for i in range(121)]  # 10 Mbps .. 10 Gbps, log-spaced
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, plan in enumerate(plans):
        color = f"C{i % 10}"
        for rate, style in ((0.0, "-"), (sc.failure_rate, ":")):
            if style == ":" and rate == 0.0:
                continue
            util = [100 * simulate(plan, replace(sc, bandwidth_mbps=b, failure_rate=rate)).compute_utilization for b in bandwidths_mbps]
            ax.plot(bandwidths_mbps, util, style, color=color, label=plan.name if style == "-" else None)
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth per link (Mbps)")
    ax.set_ylabel("compute utilization (%)")
    ax.set_ylim(0, 102)
    title = f"N = {sc.params:.3g}, M = {sc.workers}, H = {sc.inner_steps}, T = {sc.step_time_s:.3g} s, {sc.bytes_per_value:g} B/value"
    if sc.failure_rate > 0:
        title += f"; dotted: failure rate {sc.failure_rate:g}"
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
