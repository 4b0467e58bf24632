"""The member attack suite: dishonest members of an open run (issue 25), against plain and robust mixing.

    python bench/attacks_members.py [--variant plain|robust|both] [--only CASE ...] [--virtual-only|--real-only]

Two suites, each case run once per variant (``plain``: ``robust.mode=off``, today's averaging; ``robust``:
``robust.mode=on``; a checkout whose config has no ``robust`` section runs plain with no override and
refuses ``robust``):

* ``virtual``: ``VirtualSwarm`` of ``VIRTUAL_WORKERS`` workers in this process, the workers of
  ``VIRTUAL_ATTACKERS`` dishonest (``gossiploco.adversary``, the omniscient ALIE of the paper's threat
  model), for each preset of ``--presets``; the final val loss is that of the honest workers' average.
* ``real``: an open run (``start_bootstrap(open_run=True)``, ``gossiploco peer --open``) of ``REAL_PEERS``
  real peer processes, the highest rank dishonest (``GOSSIPLOCO_ATTACK`` in its environment only), preset
  ``REAL_PRESET``; the final val loss is each honest peer's ``summary.json`` (it averages what the members
  hold, the attacker's model included, as any member would). ``state_flood`` is real only and also reports
  the honest peers' uploaded bytes (``wire_bytes_sent``: mixing, control and state uploads).

Cases: ``none`` (attack-free) and the kinds of ``gossiploco.adversary`` at the strengths of
``DEFAULT_STRENGTH`` unless ``--strength KIND=S`` says otherwise. Every run uses ``round.weights =
"tokens"`` (the ``weight`` lie needs it; with a steps budget the merges then equal unweighted ones bit
for bit, so the attack-free run is today's).

Settings (measured on 2 shared cores, plain): 60 rounds of 8 inner steps in both suites, ALIE at
``mu - 4 sigma``. Shorter or weaker, the small-bias attacks do not hurt plain averaging measurably: at
30 rounds replay and ALIE (1 sigma) even lowered the honest loss (-1.6%, -7.3%); ALIE stayed under 5% at
1 sigma (60 rounds -1.4%, 100 rounds +4.2%) and 2 sigma (60 rounds +3.2%); at 60 rounds replay costs
+19% and ALIE at 4 sigma +11% (virtual, globalm1-localm2). A plain run takes about 11 minutes.

Verdicts (one-sided: an attack that lowers the loss costs nothing): a case *held* when its honest final
val loss is at most ``HARM_LIMIT`` above the attack-free run of the same suite, preset and variant (and,
for ``state_flood``, the honest peers' uploads at most the attack-free run's plus ``FLOOD_SLACK`` times what
the state-request limit allows the flooder, ``flood_allowance``); a missing or non-finite loss, a peer that did not finish, or a run that could not be started
fails. The robust variant's attack-free run must cost at most ``ROBUST_COST_LIMIT`` against the plain
one's. Rows are kept in ``--data`` (JSON) across invocations, so ``--variant robust`` after a plain run
completes the table; ``--results`` (Markdown) is rewritten from all rows, with each run's command.
Exit status 1 if any case run now did not hold (expected for plain: the "before").
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from gossiploco.adversary import ATTACK_ENV, DEFAULT_STRENGTH, KINDS, Adversary  # noqa: E402
from gossiploco.config import TINY_OVERRIDES, RunConfig, load_config  # noqa: E402
from testbed.machine import cpu_model  # noqa: E402

CASES = ("none", *KINDS)
REAL_ONLY = ("state_flood",)
VARIANTS = ("plain", "robust")
VIRTUAL_WORKERS, VIRTUAL_ATTACKERS = 8, (3, 6)
REAL_PEERS, REAL_ATTACKER, REAL_PRESET = 4, 3, "globalm1-localm2"
PRESETS = ("globalm1-localm2", "diloco")
"""The issue's preset, and the one preset whose Mix2 is a global all-reduce (where robust owners aggregate)."""
VIRTUAL_ROUNDS, REAL_ROUNDS, INNER_STEPS = 60, 60, 8
HARM_LIMIT = 0.05
"""An attack holds when the honest final val loss is at most this much (relative) above the attack-free run's."""
ROBUST_COST_LIMIT = 0.01
"""Robust mixing without attackers may cost at most this much (relative) final val loss against plain."""
FLOOD_SLACK = 1.1
"""A state flood holds when the honest peers upload no more than the attack-free run's bytes plus what the
protocol's state-request limit allows a member (``protocol.state_limit``: ``BURST`` states, then one per
``REFILL_ROUNDS`` rounds, from each honest peer) times this slack (chunk headers and framing)."""
REAL_TIMEOUT_S = 300.0
STATE_FLOOD_MODULE = "gossiploco.runtime.state_flood"
PLAIN_SECURITY_KEYS = ("encrypted", "private", "refused_connections", "rejected_messages")
"""A summary's ``security`` counters before robust mixing; any other is shown in the row's notes."""


@dataclass
class Row:
    """One case's outcome: ``suite`` virtual|real, its ``preset`` and ``variant``, ``case`` (``none`` or an attack spec)."""

    suite: str
    preset: str
    variant: str
    case: str
    losses: list[float | None] = field(default_factory=list)
    """The honest workers' (virtual: one, their average) or honest peers' final val losses."""
    uploaded: list[int] = field(default_factory=list)
    """Real suite: each honest peer's ``wire_bytes_sent``."""
    flood_allowance: int = 0
    """``state_flood``: the state bytes the protocol's limit lets the flooder take from the honest peers in all."""
    notes: list[str] = field(default_factory=list)
    error: str = ""
    """Why the case has no valid outcome (could not run, did not finish, not run)."""
    wall_s: float = 0.0
    settings: str = ""
    command: str = ""
    verdict: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.suite, self.preset, self.variant, self.case

    @property
    def worst(self) -> float:
        """The worst honest final val loss (inf when any is missing or non-finite)."""
        if not self.losses or any(x is None or not math.isfinite(x) for x in self.losses):
            return math.inf
        return max(self.losses)


# -- variants and settings -------------------------------------------------------------------------------


def robust_available() -> bool:
    """Whether this checkout's config has the ``robust`` section (robust mixing is merged)."""
    return "robust" in {f.name for f in dataclasses.fields(RunConfig)}


def variant_overrides(variant: str) -> dict[str, str]:
    """The config overrides of ``variant``: ``robust.mode`` off or on; plain without robust mixing: none."""
    if variant == "robust" and not robust_available():
        raise SystemExit("--variant robust: this checkout's config has no robust section (robust.mode); "
                         "merge robust mixing first, or run --variant plain")
    if not robust_available():
        return {}
    return {"robust.mode": "off" if variant == "plain" else "on"}


def attack_spec(case: str, strengths: dict[str, float]) -> str:
    """``KIND:STRENGTH`` of ``case`` (``none``: empty)."""
    if case == "none":
        return ""
    return f"{case}:{strengths.get(case, DEFAULT_STRENGTH[case]):g}"


def overrides(args, variant: str, rounds: int) -> dict:
    return {**TINY_OVERRIDES, **variant_overrides(variant), "rounds": rounds, "inner_steps": args.inner_steps,
            "round.weights": "tokens", "monitor.every": args.inner_steps}


# -- the virtual suite ------------------------------------------------------------------------------------


def run_virtual(args, preset: str, variant: str, case: str) -> Row:
    """One ``VirtualSwarm`` run: ``case``'s attackers at ``VIRTUAL_ATTACKERS``; the honest average's final val loss."""
    import torch

    from gossiploco.runtime.virtual import VirtualSwarm

    spec = attack_spec(case, args.strengths)
    row = Row("virtual", preset, variant, spec or "none",
              settings=f"{VIRTUAL_WORKERS} workers, attackers {list(VIRTUAL_ATTACKERS)}, {args.virtual_rounds} rounds "
                       f"x {args.inner_steps} steps, tiny model")
    torch.set_num_threads(1)  # 8 worker threads on 2 shared cores: intra-op threads only contend
    start = time.perf_counter()
    try:
        cfg = load_config(preset, {**overrides(args, variant, args.virtual_rounds), "workers": VIRTUAL_WORKERS})
        adversaries = {m: Adversary.parse(spec, seed=m) for m in VIRTUAL_ATTACKERS} if spec else {}
        result = VirtualSwarm(cfg, adversaries=adversaries).run()
        row.losses = [result.summary["final_val_loss"]]
        row.notes.append(f"mix failures {result.summary['mix1_failures'] + result.summary['mix2_failures']}")
    except Exception as exc:  # noqa: BLE001 - a case that cannot run is reported, and fails
        row.error = f"{type(exc).__name__}: {exc}"
    row.wall_s = time.perf_counter() - start
    return row


# -- the real suite ---------------------------------------------------------------------------------------


def state_flood_available() -> bool:
    """Whether peers act on ``state_flood`` (its runtime module is merged); else the case is not run."""
    return importlib.util.find_spec(STATE_FLOOD_MODULE) is not None


def flood_allowance(honest: int, rounds: int) -> int:
    """The state bytes ``protocol.state_limit`` lets one member take from ``honest`` peers over ``rounds`` rounds:
    ``BURST + ceil(rounds / REFILL_ROUNDS)`` states from each, a state being z, the outer momentum and AdamW's two
    moments (``runtime.peer_join.provide_state``) in fp32."""
    from gossiploco.data import load_corpus
    from gossiploco.model import count_parameters
    from gossiploco.protocol.state_limit import BURST, REFILL_ROUNDS

    vocab = load_corpus(load_config(REAL_PRESET, TINY_OVERRIDES).data).vocab_size
    return honest * (BURST + math.ceil(rounds / REFILL_ROUNDS)) * 4 * 4 * count_parameters("tiny", vocab)


def run_real(args, variant: str, case: str) -> Row:
    """One open run of ``REAL_PEERS`` peer processes, rank ``REAL_ATTACKER`` mounting ``case``."""
    from gossiploco.membership.bootstrap import start_bootstrap
    from gossiploco.runtime.launch import LocalPeers
    from testbed.outsider import ENV
    from testbed.overrides import peer_args

    spec = attack_spec(case, args.strengths)
    row = Row("real", REAL_PRESET, variant, spec or "none",
              settings=f"open run, {REAL_PEERS} peer processes, attacker rank {REAL_ATTACKER}, {args.real_rounds} "
                       f"rounds x {args.inner_steps} steps, tiny model")
    if case == "state_flood" and not state_flood_available():
        row.error = f"not run: {STATE_FLOOD_MODULE} is not in this checkout (peers would ignore the attack)"
        return row
    out = args.out / "real" / variant / (case if case != "none" else "attack-free")
    shutil.rmtree(out, ignore_errors=True)  # logs are appended to: start clean
    out.mkdir(parents=True)
    start = time.perf_counter()
    dht = None
    try:
        dht, addresses = start_bootstrap("127.0.0.1", 0, open_run=True)
        cli = peer_args(REAL_PRESET, overrides(args, variant, args.real_rounds))
        with LocalPeers(REAL_PEERS, out, cli, env=ENV, join=addresses[0], open_run=True) as peers:
            peers.start(env={REAL_ATTACKER: {ATTACK_ENV: spec}} if spec else None)
            codes = peers.wait(args.real_timeout)
        honest = [r for r in range(REAL_PEERS) if r != REAL_ATTACKER]
        summaries = {r: read_json(peers.peer_dir(r) / "summary.json") for r in range(REAL_PEERS)}
        row.losses = [summaries[r].get("final_val_loss") for r in honest]
        row.uploaded = [int(summaries[r].get("wire_bytes_sent") or 0) for r in honest]
        if case == "state_flood":
            row.flood_allowance = flood_allowance(len(honest), args.real_rounds)
        failures = sum(summaries[r].get(k, 0) or 0 for r in honest for k in ("mix1_failures", "mix2_failures"))
        row.notes.append(f"exit codes {codes}; honest mix failures {failures}")
        attacker = summaries[REAL_ATTACKER]
        if attacker.get("final_val_loss") is not None:
            row.notes.append(f"attacker's own final val loss {attacker['final_val_loss']:.4f}")
        screens = [{k: v for k, v in summaries[r].get("security", {}).items() if k not in PLAIN_SECURITY_KEYS}
                   for r in honest]
        if any(screens):  # counters beyond today's (robust mixing's screen and exclusions)
            row.notes.append(f"honest peers' security counters {screens}")
        bad = {r: codes.get(r) for r in honest if codes.get(r) != 0 or summaries[r].get("rounds") != args.real_rounds}
        if bad:
            row.error = f"honest peers did not finish: exit codes {bad}; " + "; ".join(
                f"peer {r}: {peers.log(r)[-300:]!r}" for r in bad)
    except Exception as exc:  # noqa: BLE001 - a case that cannot run is reported, and fails
        row.error = f"{type(exc).__name__}: {exc}"
    finally:
        if dht is not None:
            dht.shutdown()
    row.wall_s = time.perf_counter() - start
    return row


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# -- verdicts and the table -------------------------------------------------------------------------------


def relative(value: float, base: float) -> float:
    return (value - base) / base if math.isfinite(value) and math.isfinite(base) and base > 0 else math.inf


def judge(rows: dict[tuple, Row]) -> None:
    """Set every row's verdict against the attack-free row of its suite, preset and variant (module docstring)."""
    for row in rows.values():
        if row.error:
            row.verdict = "not run" if row.error.startswith("not run") else "FAILED"
            continue
        base = rows.get((row.suite, row.preset, row.variant, "none"))
        if row.case == "none":
            plain = rows.get((row.suite, row.preset, "plain", "none"))
            if row.variant == "robust":
                cost = relative(row.worst, plain.worst) if plain and not plain.error else None
                row.verdict = ("no plain attack-free run" if cost is None else
                               f"cost {cost:+.2%}: " + ("held" if cost <= ROBUST_COST_LIMIT else "FAILED"))
            else:
                row.verdict = "baseline" if math.isfinite(row.worst) else "FAILED"
            continue
        if base is None or base.error or not math.isfinite(base.worst):
            row.verdict = "no attack-free run"
            continue
        harm = relative(row.worst, base.worst)
        held = harm <= HARM_LIMIT
        if row.case.startswith("state_flood") and base.uploaded and row.uploaded:
            extra = sum(row.uploaded) - sum(base.uploaded)
            held = held and row.flood_allowance > 0 and extra <= FLOOD_SLACK * row.flood_allowance
        row.verdict = "held" if held else "FAILED"


def fmt_loss(row: Row) -> str:
    if not row.losses:
        return "-"
    return ", ".join("missing" if x is None else f"{x:.4f}" for x in row.losses)


def fmt_vs(row: Row, rows: dict[tuple, Row]) -> str:
    base = rows.get((row.suite, row.preset, row.variant, "none"))
    if row.error or base is None or base.error:
        return "-"
    text = f"{relative(row.worst, base.worst):+.1%}"
    if row.case.startswith("state_flood") and base.uploaded:
        text += (f"; uploads {sum(row.uploaded) / 2**20:.1f} MiB vs {sum(base.uploaded) / 2**20:.1f} MiB "
                 f"(x{sum(row.uploaded) / max(1, sum(base.uploaded)):.2f}; the request limit allows "
                 f"+{row.flood_allowance / 2**20:.1f} MiB)")
    return text


def machine() -> str:
    return f"{os.cpu_count()} CPU cores ({cpu_model()}), shared with other jobs; {platform.system()} {platform.release()}; torch CPU"


def write_results(path: Path, rows: dict[tuple, Row], runs: list[dict]) -> None:
    lines = ["# Member attack suite: dishonest members of an open run", "",
             "Produced by `bench/attacks_members.py` (issue 25, part 4; see its docstring for the settings and verdicts). "
             f"A case *held* when the honest final val loss is at most {HARM_LIMIT:.0%} above the attack-free run of "
             f"the same suite, preset and variant (`state_flood`: and the honest uploads at most the attack-free run's "
             f"plus {FLOOD_SLACK}x what the state-request limit allows the flooder); "
             f"robust mixing without attackers may cost at most {ROBUST_COST_LIMIT:.0%} against plain. "
             "Plain rows are the \"before\" that motivates robust mixing: their failures are expected. A negative "
             "change means the attack lowered the honest loss (with this tiny config's outer step a damped mean, as a "
             "sign flip or noise in place of an update leaves it, trains faster): such a row says nothing about "
             "robustness. Real runs: each honest peer's final model averages the members' models, the attacker's "
             "included (robustly in the robust variant: the monitors' averages are robust means there). One run's "
             "final loss moves by 1 to 2% with the last bits of its sums, so a single attack-free pair does not "
             "measure robust mixing's 1% cost: `bench/robust_cost.py` does, over seeds "
             "(`bench/results/robust-cost.md`, `bench/results/robust-cost-4.md`).", "",
             "Runs recorded here:", ""]
    for run in runs:
        lines.append(f"- `{run['command']}`: {run['machine']}; wall time {run['wall_s']:.0f} s; {run['date']}")
    for suite in ("virtual", "real"):
        chosen = [r for r in rows.values() if r.suite == suite]
        if not chosen:
            continue
        lines += ["", f"## {suite.capitalize()} suite", "", f"Settings: {chosen[0].settings}; strengths are the "
                  "adversary's `KIND:STRENGTH`.", "",
                  "| Preset | Variant | Case | Honest final val loss | vs attack-free | Verdict | Notes | Wall |",
                  "|---|---|---|---|---|---|---|---|"]
        order = {c: i for i, c in enumerate(CASES)}
        for row in sorted(chosen, key=lambda r: (r.preset, r.variant, order.get(r.case.split(":")[0], 99))):
            notes = "; ".join([*row.notes, row.error] if row.error else row.notes).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {row.preset} | {row.variant} | {row.case} | {fmt_loss(row)} | {fmt_vs(row, rows)} | "
                         f"{row.verdict} | {notes} | {row.wall_s:.0f} s |")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def load_rows(path: Path) -> tuple[dict[tuple, Row], list[dict]]:
    data = read_json(path)
    rows = {}
    for raw in data.get("rows", []):
        row = Row(**{k: v for k, v in raw.items() if k in {f.name for f in dataclasses.fields(Row)}})
        rows[row.key] = row
    return rows, data.get("runs", [])


def save_rows(path: Path, rows: dict[tuple, Row], runs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"runs": runs, "rows": [dataclasses.asdict(r) for r in rows.values()]}, indent=1) + "\n")
    tmp.replace(path)


# -- the command ------------------------------------------------------------------------------------------


def parse_strength(text: str) -> tuple[str, float]:
    kind, _, value = text.partition("=")
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"{kind!r}: one of {', '.join(KINDS)}")
    try:
        return kind, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: KIND=NUMBER") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=(*VARIANTS, "both"), default="both")
    ap.add_argument("--only", nargs="+", choices=CASES, default=None,
                    help="these cases (the attack-free run of each suite is always run)")
    suites = ap.add_mutually_exclusive_group()
    suites.add_argument("--virtual-only", action="store_true")
    suites.add_argument("--real-only", action="store_true")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), help="virtual suite's presets")
    ap.add_argument("--virtual-rounds", type=int, default=VIRTUAL_ROUNDS)
    ap.add_argument("--real-rounds", type=int, default=REAL_ROUNDS)
    ap.add_argument("--inner-steps", type=int, default=INNER_STEPS)
    ap.add_argument("--strength", nargs="+", type=parse_strength, default=[], metavar="KIND=S",
                    help="attack strengths other than the adversary's defaults")
    ap.add_argument("--real-timeout", type=float, default=REAL_TIMEOUT_S, help="seconds for one real run")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "attacks-members")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "attacks-members.md")
    ap.add_argument("--data", type=Path, default=None, help="the rows kept across runs (default: --results as .json)")
    args = ap.parse_args(argv)
    args.strengths = dict(STRENGTHS_DEFAULT, **dict(args.strength))
    args.data = args.data or args.results.with_suffix(".json")
    return args


STRENGTHS_DEFAULT: dict[str, float] = {"alie": 4.0}
"""The bench's strengths where they differ from ``gossiploco.adversary.DEFAULT_STRENGTH``."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants = VARIANTS if args.variant == "both" else (args.variant,)
    for variant in variants:
        variant_overrides(variant)  # refuse an unavailable variant before anything runs
    cases = ["none", *[c for c in CASES if c != "none" and (args.only is None or c in args.only)]]
    rows, runs = load_rows(args.data)
    done: list[Row] = []
    started = time.monotonic()
    plan = []
    if not args.real_only:
        plan += [("virtual", p, v, c) for v in variants for p in args.presets for c in cases if c not in REAL_ONLY]
    if not args.virtual_only:
        plan += [("real", REAL_PRESET, v, c) for v in variants for c in cases]
    for i, (suite, preset, variant, case) in enumerate(plan, 1):
        row = run_virtual(args, preset, variant, case) if suite == "virtual" else run_real(args, variant, case)
        row.command = "python bench/attacks_members.py " + " ".join(sys.argv[1:] if argv is None else argv)
        for old in [k for k in rows if k[:3] == row.key[:3] and k[3].split(":")[0] == case]:
            del rows[old]  # the same case at another strength: replaced
        rows[row.key] = row
        done.append(row)
        judge(rows)
        print(f"[{i}/{len(plan)}] {suite} {preset} {variant} {row.case}: {fmt_loss(row)} ({fmt_vs(row, rows)}) "
              f"{row.verdict} {row.error} [{row.wall_s:.0f} s]", flush=True)
    command = "python bench/attacks_members.py " + " ".join(sys.argv[1:] if argv is None else argv)
    runs.append({"command": command.strip(), "machine": machine(), "wall_s": time.monotonic() - started,
                 "date": time.strftime("%Y-%m-%d %H:%M %Z")})
    save_rows(args.data, rows, runs)
    write_results(args.results, rows, runs)
    return 0 if all(r.verdict in ("held", "baseline") or r.verdict.endswith("held") for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
