"""The report of ``bench/scale_real.py``: the table of its runs' summaries, the blocking verdict of issue 26, and the
generated part of ``bench/results/scale.md``."""

from __future__ import annotations

from pathlib import Path


BEGIN, END = "<!-- scale-real: begin (bench/scale_real.py writes this part) -->", "<!-- scale-real: end -->"


def table(runs: list[dict]) -> str:
    """The summaries as a markdown table, one row per (group size, M)."""
    mib, kib = 2**20, 2**10

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    head = ("| M | group size | variant | peers done | round s (p50 / p90) | blocking s (p50 / p90) | Mix2 s | Mix1 wait s "
            "| Mix1 s | Mix1 ok | Mix1 / Mix2 group | payload sent KiB | all sent KiB | received KiB | control msgs (p50 / mean / max) "
            "| connected | DEALERs | fds (sockets) | RSS MiB | PSS MiB | threads | machine memory used GiB |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in runs:
        rows.append(
            f"| {s['peers']} | {s['group_size']} | {variant_name(s)} | {s['peers_done']}/{s['peers']} "
            f"| {f(s['round_s'])} / {f(s['round_s_p90'])} | {f(s['blocking_s'])} / {f(s['blocking_s_p90'])} "
            f"| {f(s['mix2_s'])} | {f(s['mix1_wait_s'])} | {f(s['mix1_s'])} | {f(s['mix1_completion'], '{:.0%}')} "
            f"| {f(s['mix1_group'], '{:.0f}')} / {f(s['mix2_group'], '{:.0f}')} | {f(s['bytes_sent'] / kib, '{:.0f}')} "
            f"| {f(s['wire_sent'] / kib, '{:.0f}')} | {f(s['bytes_received'] / kib, '{:.0f}')} "
            f"| {f(s['control_sent'], '{:.0f}')} / {f(s['control_sent_mean'], '{:.1f}')} / {f(s['control_sent_max'], '{:.0f}')} | {f(s['connected'], '{:.0f}')} | {f(s['dealers'], '{:.0f}')} "
            f"| {f(s['fds'], '{:.0f}')} ({f(s['sockets'], '{:.0f}')}) | {f(s['rss'] / mib, '{:.0f}')} "
            f"| {f(s['pss'] / mib, '{:.0f}')} | {f(s['threads'], '{:.0f}')} | {f(s['mem_lost_max'] / 2**30, '{:.1f}')} |")
    return "\n".join(rows)


def variant_name(s: dict) -> str:
    """What sets a run apart from the default settings: its label, and timeouts it changed."""
    parts = [s.get("label") or ""] + [f"{k.removesuffix('_s')} {s[k]:g} s" for k in ("heartbeat_s", "grace_s")
                                      if s.get(k) is not None]
    if s.get("period_s"):
        parts.append(f"shared clock {s['period_s']:g} s (+ up to {s['overshoot_s']:g} s)")
    if s.get("pairing", "bucket") != "bucket":
        parts.append(f"{s['pairing']} pairing")
    return ", ".join(p for p in parts if p) or "default"


def schedule(s: dict) -> tuple:
    """How a run's rounds are scheduled (pairing, shared clock): runs compare with the 4-peer run of the same."""
    return s.get("pairing", "bucket"), s.get("period_s") or 0.0, s.get("overshoot_s") or 0.0


def criterion(runs: list[dict]) -> str:
    """The done criterion of issue 26: the median blocking per round of each 64-peer run with the default grouping
    and timeouts within 1.5x of the 4-peer run's with the same schedule (``schedule``), with every peer done."""
    def timeouts_default(s: dict) -> bool:
        return s["group_size"] == 16 and s.get("heartbeat_s") is None and s.get("grace_s") is None

    bases = {}
    for s in runs:
        if s["peers"] == 4 and timeouts_default(s) and not s.get("label"):
            bases.setdefault(schedule(s), s)
    at_64 = [s for s in runs if s["peers"] == 64 and timeouts_default(s) and schedule(s) in bases]
    if not at_64:
        return "Blocking criterion: not measured (needs M = 4 and M = 64 with group size 16 and default timeouts)."
    lines = []
    for s in at_64:
        a = bases[schedule(s)]["blocking_s"]
        ratio = s["blocking_s"] / a if a else float("inf")
        verdict = "met" if ratio <= 1.5 and s["peers_done"] == 64 else "MISSED"
        lines.append(f"{variant_name(s)}: {verdict}: {s['blocking_s']:.2f} s / {a:.2f} s = {ratio:.2f}x, "
                     f"{s['peers_done']} of 64 peers done")
    default = bases.get(schedule({}))
    others = [f"M={s['peers']}, group size {s['group_size']}, {variant_name(s)}: {s['blocking_s'] / default['blocking_s']:.2f}x"
              for s in runs if default and default["blocking_s"] and s not in bases.values() and s not in at_64
              and schedule(s) == schedule({})]
    return ("Blocking criterion (median blocking per round at 64 peers within 1.5x of 4 peers' with the same schedule, "
            "group size 16, default timeouts): " + "; ".join(lines) + "."
            + (" Other runs against the default 4-peer median, for information: " + "; ".join(others) + "." if others else ""))


def write_markdown(path: Path, runs: list[dict]) -> None:
    """Replace the generated part of the "Real processes" section of ``path`` (between ``BEGIN`` and ``END``;
    appended with a heading when absent), keeping everything else of the file."""
    commands = sorted({s["command"] for s in runs})
    kinds = "; ".join(f"M={s['peers']}/g{s['group_size']} ({variant_name(s)}): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in s["control_kinds"].items()) for s in runs)
    failures = "; ".join(f"M={s['peers']}/g{s['group_size']} ({variant_name(s)}): {s['failures']}"
                         for s in runs if s["failures"]) or "none"
    body = "\n\n".join([BEGIN, table(runs), criterion(runs),
                         f"Control messages sent per peer per round, mean by kind: {kinds}.",
                         f"Failed exchanges (peer-rounds, by cause): {failures}.",
                         "Commands:\n\n" + "\n".join(f"    nice -n 5 {c}" for c in commands), END])
    text = path.read_text() if path.exists() else "# Scaling: round cost against M\n"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + body + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n## Real processes (bench/scale_real.py)\n\n" + body + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
