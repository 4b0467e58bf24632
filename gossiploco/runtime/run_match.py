"""Does a starting peer's run match the runs already going in its swarm? (pure; no I/O)

Peers agree on a run by its id, a digest of their shared settings (``peer.run_id_for``), so a peer
started with another preset, ``--workers`` or ``--set`` value lands in a run of its own and would
wait there alone. The swarm's list of runs (``membership.runs``) shows the runs going and their
settings; ``RunWatch`` decides from it:

* at start (``check_start``): when another run is going and this peer's run is not, the peer stops
  with ``RunMismatch`` naming every field that differs, both values, and the flags that fix it,
  unless it was started with ``--new-run`` (a separate run in the same swarm, on purpose).
* entries that announce this peer's run id with other settings ("twins": an explicit ``--run-id``
  with other flags, or a stranger's forged copy; in an open run anyone may write an entry) follow
  the *backing rule*. An entry is backed when its signer has a live member record of the run
  (``members``: the run's peer records, which the starting peer reads first). This peer stops
  with ``RunMismatch`` naming the differences only when its settings match no backed entry of its
  run id and some backed entry announces other settings: the running swarm really has other
  settings, and joining would mix models that do not fit together. Otherwise it joins, and each
  twin is a warning naming who signed it and whether it is backed, counted in
  ``conflicting_entries``: one stranger's copy with one field changed cannot lock newcomers out of
  an open run (issue 25), and a newcomer with the run's exact settings joins when one backed
  entry matches, even beside a backed twin (two groups of members disagree: warned, not fatal).
  Limit: a stranger that also writes member records of the run (an open run admits anyone) backs
  its own twin; it can then refuse only the run's first peer (no backed entry of the real settings
  exists yet), never a newcomer to a running swarm. With ``members`` unknown (None), every entry
  counts as backed.
* later (``warnings``): two peers that started at the same moment with different settings both
  saw no other run; each finds the other afterwards, and it cannot be stopped safely mid-run, so
  it is told once per run, with the differences.

Every entry's config comes from the network: it was validated (``RunEntry.from_wire``) but its
values are only ever compared and shown, truncated (``show_value``).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from gossiploco.checkpoint import shared_config
from gossiploco.config import RunConfig
from gossiploco.errors import RunMismatch
from gossiploco.membership.runs import RunEntry, announced_config

MISSING = object()
"""A field one of the two configs does not have."""
MAX_SHOWN_ITEMS = 4
MAX_SHOWN_CHARS = 48
MAX_SHOWN_FIELDS = 12
MAX_SHOWN_RUNS = 3
MAX_SHOWN_PEERS = 6
MAX_REPORTED_TWINS = 1024
"""Twins remembered as already warned about (then the memory starts again: at worst a repeated warning)."""
_PLAIN = re.compile(r"[A-Za-z_][\w.\-/]*")
"""A text ``--set`` takes as it is (not TOML, so taken as a string) and a shell leaves alone."""


@dataclass(frozen=True)
class Difference:
    field: str
    """Dotted name: ``timeouts.startup_s``."""
    mine: Any
    theirs: Any


def config_differences(mine: Mapping, theirs: Mapping, prefix: str = "") -> list[Difference]:
    """Every leaf field where two nested configs differ (``MISSING`` where one lacks it), sorted by name."""
    out = []
    for key in sorted(set(mine) | set(theirs), key=str):
        a, b = mine.get(key, MISSING), theirs.get(key, MISSING)
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_differences(a, b, f"{name}.")
        elif a is MISSING or b is MISSING or type(a) is not type(b) or a != b:
            out.append(Difference(name, a, b))
    return sorted(out, key=lambda d: d.field)


def show_value(value: Any) -> str:
    """A value in a line of text: texts quoted and cut at ``MAX_SHOWN_CHARS``, lists after ``MAX_SHOWN_ITEMS``."""
    if value is MISSING:
        return "(absent)"
    if isinstance(value, (list, tuple)):
        shown = [show_value(v) for v in value[:MAX_SHOWN_ITEMS]]
        more = len(value) - MAX_SHOWN_ITEMS
        return "[" + ", ".join(shown + ([f"+{more} more"] if more > 0 else [])) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {show_value(v)}" for k, v in list(value.items())[:MAX_SHOWN_ITEMS]) \
            + (", ..." if len(value) > MAX_SHOWN_ITEMS else "") + "}"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS - 3] + "..."


def describe_differences(differences: list[Difference], theirs: str = "the running run") -> str:
    """``workers: this peer 4, the running run 2; ...`` (at most ``MAX_SHOWN_FIELDS``, then how many more)."""
    shown = [f"{d.field}: this peer {show_value(d.mine)}, {theirs} {show_value(d.theirs)}"
             for d in differences[:MAX_SHOWN_FIELDS]]
    more = len(differences) - MAX_SHOWN_FIELDS
    return "; ".join(shown + ([f"and {more} more fields"] if more > 0 else []))


def fixing_flags(differences: list[Difference]) -> str:
    """The command-line flags that give this peer the other run's values where a flag can: ``--config``,
    ``--workers``, then ``--set FIELD=VALUE`` (TOML values, quoted for a shell where needed)."""
    first, sets = [], []
    for d in differences:
        value = d.theirs
        if d.field == "name" and isinstance(value, str):
            first.insert(0, f"--config {shlex.quote(value)}")
        elif d.field == "workers" and isinstance(value, int):
            first.append(f"--workers {value}")
        elif isinstance(value, str) and value.startswith(("<", "sha256:")):
            continue  # a digest (a long list, the tokenizer's file): no flag gives it
        elif isinstance(value, (bool, int, float, str)) or (isinstance(value, list) and
                                                          all(isinstance(v, (str, int, float)) for v in value)):
            plain = isinstance(value, str) and _PLAIN.fullmatch(value) and value not in ("true", "false", "inf", "nan")
            toml = value if plain else json.dumps(value)
            sets.append(f"--set {shlex.quote(f'{d.field}={toml}')}")
    flags = first + sets
    if len(flags) > MAX_SHOWN_FIELDS:
        flags = flags[:MAX_SHOWN_FIELDS] + ["..."]
    return " ".join(flags)


@dataclass(frozen=True)
class ActiveRun:
    """A run going in the swarm, as its peers' entries show it."""

    run_id: str
    config: dict
    peers: tuple[int, ...]
    separate: bool = False
    """Started beside the others on purpose (``--new-run``): nobody is warned about it."""

    def label(self) -> str:
        peers = ", ".join(str(p) for p in self.peers[:MAX_SHOWN_PEERS])
        more = f" and {len(self.peers) - MAX_SHOWN_PEERS} more" if len(self.peers) > MAX_SHOWN_PEERS else ""
        return f"run {self.run_id} (peer{'s' if len(self.peers) > 1 else ''} {peers}{more})"


def active_runs(entries: Mapping[int, RunEntry], own_peer: int) -> list[ActiveRun]:
    """The runs in ``entries`` but this peer's own entry (maybe left by its previous process), most peers first.
    Entries of one run id that announce different configs count as different runs."""
    groups: dict[tuple[str, str], list[RunEntry]] = {}
    for peer, entry in entries.items():
        if peer != own_peer:
            groups.setdefault((entry.run_id, json.dumps(entry.config, sort_keys=True)), []).append(entry)
    runs = [ActiveRun(group[0].run_id, group[0].config, tuple(sorted(e.peer for e in group)), any(e.separate for e in group))
            for group in groups.values()]
    return sorted(runs, key=lambda run: (-len(run.peers), run.run_id, run.peers))


def _backers(run: ActiveRun, members: Collection[int] | None, own_peer: int) -> tuple[int, ...]:
    """The signers of ``run``'s entries that have a live member record (all of them when ``members`` is None)."""
    if members is None:
        return run.peers
    return tuple(p for p in run.peers if p in members and p != own_peer)


class RunWatch:
    """What one peer knows about the other runs of its swarm (module docstring). Not thread-safe: one
    caller at a time (the peer's start, then its discovery thread)."""

    def __init__(self, run_id: str, config: dict, peer: int, *, new_run: bool = False, ttl_s: float = 20.0):
        self.entry = RunEntry(peer, run_id, config, separate=new_run)
        """This peer's own entry (``config``: ``runs.announced_config`` of its shared config)."""
        self.new_run = new_run
        self.ttl_s = ttl_s
        self._warned: set[str] = set()
        self._twins_reported: set[tuple[str, tuple[int, ...], bool]] = set()
        self.conflicting_entries = 0
        """Entries of this peer's run id with other settings seen and warned about (each signer group once)."""
        self.twin_warnings: list[str] = []
        """The warnings about twins of the latest ``check_start`` (the caller logs them)."""

    @classmethod
    def for_config(cls, cfg: RunConfig, run_id: str, peer: int, *, new_run: bool = False) -> RunWatch:
        """Peer ``peer``'s watch for run ``run_id`` configured by ``cfg`` (its entry holds the shared config)."""
        return cls(run_id, announced_config(shared_config(cfg.to_dict())), peer, new_run=new_run,
                   ttl_s=cfg.timeouts.announce_ttl_s)

    def check_start(self, entries: Mapping[int, RunEntry], members: Collection[int] | None = None) -> list[ActiveRun]:
        """Before this peer announces itself: raise ``RunMismatch`` when it must not start (module
        docstring); else the other runs going (their differences are not warned about again).
        ``members``: peers with a live member record of this peer's run (None: unknown, every entry
        counts as backed). Twins that do not stop it are in ``twin_warnings`` (for the caller to log)."""
        mine = self.entry
        runs = active_runs(entries, mine.peer)
        twins = [run for run in runs if run.run_id == mine.run_id and run.config != mine.config]
        backed = [run for run in twins if _backers(run, members, mine.peer)]
        matched = any(_backers(run, members, mine.peer) for run in runs
                      if run.run_id == mine.run_id and run.config == mine.config)
        if backed and not matched:
            raise RunMismatch(
                " ".join(f"{run.label()} announces other settings than this peer's under the same run id: they differ in "
                         f"{describe_differences(config_differences(mine.config, run.config), 'those peers')}."
                         for run in backed[:MAX_SHOWN_RUNS])
                + " Start every peer of a run with the same --config, --workers and --set values, or give this peer "
                  "another --run-id.")
        self.twin_warnings = self._twin_warnings(twins, members)
        others = [run for run in runs if run.run_id != mine.run_id]
        self._warned.update(run.run_id for run in others)
        if not others or self.new_run or len(others) < len(runs):
            return others
        first = others[0]
        differences = config_differences(mine.config, first.config)
        also = [f"{run.label()} differs in {describe_differences(config_differences(mine.config, run.config), 'that run')}"
                for run in others[1:MAX_SHOWN_RUNS]]
        flags = fixing_flags(differences)
        raise RunMismatch(
            f"this swarm already has a run going with other settings than this peer's: {first.label()}. So this "
            "peer would wait alone in a run of its own. It differs in "
            f"{describe_differences(differences) or '(only the run id)'}."
            + (f" Other runs going: {'; '.join(also)}." if also else "")
            + " Start this peer with the same --config, --workers and --set values as the peers already running"
            + (f" (here: {flags})" if flags else "")
            + f", or pass --new-run to start a separate run in this swarm on purpose. (Entries of peers that stopped "
              f"just now expire within {self.ttl_s:g} s.)")

    def _twin_warnings(self, twins: list[ActiveRun], members: Collection[int] | None) -> list[str]:
        """One warning for each twin (a group of signers announcing this run id with other settings) not
        warned about before; counted in ``conflicting_entries``."""
        out = []
        for run in twins:
            backers = _backers(run, members, self.entry.peer)
            seen = (json.dumps(run.config, sort_keys=True, default=str), run.peers, bool(backers))
            if seen in self._twins_reported:
                continue
            if len(self._twins_reported) >= MAX_REPORTED_TWINS:
                self._twins_reported.clear()
            self._twins_reported.add(seen)
            self.conflicting_entries += 1
            who = (f"backed by live member{'s' if len(backers) > 1 else ''} {', '.join(map(str, backers[:MAX_SHOWN_PEERS]))}"
                   if backers else "signed by peers with no live member record of this run (strangers, or peers gone)")
            out.append(f"ignoring a conflicting entry: {run.label()} announces other settings under this run's id, "
                       f"{who}; it differs in "
                       f"{describe_differences(config_differences(self.entry.config, run.config), 'that entry')}. "
                       "This peer keeps its own settings (they match the run's members, or no member backs the other ones).")
        return out

    def warnings(self, entries: Mapping[int, RunEntry], members: Collection[int] | None = None) -> list[str]:
        """For a running peer: one warning for each run with other settings it had not seen before (none
        with ``--new-run``, where other runs are expected, nor about runs started with it), and for each
        twin of its own run id (``_twin_warnings``; ``members`` as in ``check_start``)."""
        mine = self.entry
        runs = active_runs(entries, mine.peer)
        out = self._twin_warnings([run for run in runs if run.run_id == mine.run_id and run.config != mine.config],
                                  members)
        for run in runs:
            if run.run_id == mine.run_id or run.run_id in self._warned:
                continue
            self._warned.add(run.run_id)
            if self.new_run or run.separate:
                continue
            out.append(f"another run started beside this one in this swarm: {run.label()}, which differs in "
                       f"{describe_differences(config_differences(mine.config, run.config), 'that run')}. The peers "
                       "meant for one run are split in two (they started at the same moment with different settings?): "
                       "stop the peers of one run and start them again with the other run's settings.")
        return out
