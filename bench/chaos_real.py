"""Real-process chaos bench (issue 12, item 3): real ``gossiploco peer --join`` processes, one fault per trial.

    python bench/chaos.py real --trials 50                      # through the lead's front end
    python bench/chaos_real.py --trials 5 --out runs/chaos-real  # standalone, same options
    sudo .venv/bin/python bench/chaos_real.py --trials 50 --netem # also network faults (root)
    python bench/chaos.py real --netem --trial-start 32 --trials 1  # trial 32 of a run again (same draw)

What runs. One bootstrap DHT node (``gossiploco dht``) for the whole bench; per trial M peer processes
``python -m gossiploco peer --rank I --join BOOTSTRAP --swarm-key OUT/swarm.key --identity RUN/peer-I/identity.key
--workers M`` with ranks 1..M (identities made so that peer ids increase with the rank), each in its own
process group and output directory, a run id of their own (so no two trials ever mix; ``--new-run``, since
a peer killed in the previous trial stays in the swarm's list of runs for ``announce_ttl_s``) and the same
training seed in every trial. The default config is ``globalm1-localm2`` scaled down like the tests'
``TINY`` (tiny model, 32-token sequences, batch 4, a 2 MB corpus slice), R = 12 rounds of H = 150
*real* inner steps (7-25 ms each on this 2-core machine depending on its load, so a round takes 1-4 s
and the final validation loss means something); ``--synthetic-step-s`` makes an inner step a sleep
instead (``inner.synthetic_step_s``: steady round times under CPU contention, but the model then does
not train and the loss comparison is void). Timeouts are small so faults cost seconds:
``timeouts.exchange_s = 20``, ``timeouts.grace_s = 3`` (``--exchange-s``, ``--grace-s``),
``timeouts.startup_s = 30``, ``timeouts.discovery_s = 1`` (a faster start); the rest are the
config's defaults. Extra ``--set KEY=VALUE`` go to every peer.

Runs, in order: one fault-free baseline per (config, peers) used, the named scenario
``leader-kill-mid-mix2`` (always: 4 peers, ``globalm1-localm2``, rank 1, whose identity is chosen so that it
leads round 0's Mix2 (leaders are drawn per exchange: ``protocol.groups``), SIGKILLs itself just before sending chunk 0 of round 0's Mix2, through
``GOSSIPLOCO_FAULT=KILL:mix2/0:0``), then ``--trials`` random trials. Each random trial draws from
``--seed`` and its index one fault:

- ``kill``: SIGKILL of the peer process of a random rank (the leader of that round's Mix2 included); not restarted;
- ``stop``: SIGSTOP of a random peer's whole process group (a frozen machine: its DHT node too),
  SIGCONT 2-10 s later; it must catch up and finish;
- ``restart``: SIGKILL of a random rank, started again 0.5-2 s later with the same rank (new output
  directory ``peer-I-restart``); it must rejoin (download the state) and finish;
- with ``--netem`` (root, Linux namespaces): ``loss`` (5-25 % random packet loss), ``delay``
  (50-200 ms each way; needs sch_netem, else replaced by ``slow``: a 1-4 Mbit/s HTB link with a deep
  FIFO), each for 5-15 s on one peer's link or on every link, and ``partition``: one peer, or the
  upper half of the ranks, cut off from the others for 3-12 s, then healed.

The fault time is drawn within the run: when the target (for network faults: any peer) reaches round
k, k uniform in 1..R-2 (for ``restart`` k = 1, and the trial runs ``RESTART_ROUNDS_FACTOR`` times R rounds, so the
swarm still runs when it is back: a restarted peer needs about 10 s to import torch, start its DHT node and find the
swarm, and with R rounds alone 3 of 30 restarts came back after the end), plus a uniform delay within one round (the baseline's mean round time), so faults land anywhere
in a round, Mix1 and Mix2 included. ``--faults kill,stop`` restricts the kinds drawn.

Network (``--netem``): the test bed's star (``testbed.netns.Star``): namespace ``PREFIX-sw`` holds
bridges br0 and br1; the bootstrap node listens there on br0 (10.78.0.254); peer I lives in
``PREFIX-pI`` with eth0 = 10.78.0.I on br0 (prefix ``glc``, distinct from bench/netem.py's ``gln``).
Loss and delay are tc qdiscs on both ends of the peer's link (egress of eth0 = its upload, egress of
the switch port = its download; ``testbed.links``): netem when the kernel has it; else loss is an HTB
class fed by a classic-BPF classifier that sends a random fraction of packets (``ld rand``) to a leaf
queue of length 0. A partition moves the cut-off peers' switch ports to br1 (they still reach each
other, not the rest); healing moves them back. With ``--netem`` every trial, baselines included, runs
in the namespaces. Namespaces are removed on every exit path, and leftovers of a crashed earlier run
with the same prefix at start.

Measurements, per trial, per peer (each start of a peer is one "life"):

- progress events = the records of the peer's ``metrics.jsonl``, one at h = 0 of each round, every
  ``monitor.every`` inner steps and a final one (round R) after the last round. The bench tails every
  file while it runs (every ``POLL_S`` = 0.1 s) and stamps each new line with its arrival time
  (monotonic clock). A record waits for its consensus measurement, which runs in the background (a
  peer trains on meanwhile), so it may arrive well after its step: each event is therefore the
  record's ``run_s`` (the peer's seconds since its start when the step was reached) on the bench's
  clock, offset by the smallest arrival delay of the life's records (``progress_times``; arrival
  times where a record has no ``run_s``). The resolution is the poll interval;
- longest stall = the longest gap between two consecutive events, from the first record on; a life
  that does not finish also counts the open gap from its last record to its exit (or the trial's
  deadline). For a resumed (SIGSTOPped) peer the frozen time is subtracted;
- rounds completed = the highest round of its h = 0 records (the final record says R);
- ``final_val_loss`` of its summary.json, its failure and catch-up counts;
- for a killed peer: the processes of its tree (its descendants, snapshotted every 0.5 s while it
  lived, plus every process in its session) still alive 10 s after the kill ("orphans"; reported, not
  part of pass/fail; the bench kills them after looking).

Target (pass/fail per trial): every survivor (a peer not hit by a process fault; with a network fault
every peer) finishes every round (exit 0, final record at round R), a resumed or restarted peer
finishes too (a restarted one must have downloaded the state from the running swarm; if the swarm
finished within 15 s of its start, the trial is marked inconclusive instead), and no survivor's
longest stall exceeds ``bound = grace_s + exchange_s`` of the run's
config (one grace window plus the exchange deadline; the adaptive deadline is
``clamp(adaptive_factor x slowest recent exchange, min_exchange_s, exchange_s)``, at most
``exchange_s``, so this bound covers every adaptive value). Stalls above ``grace_s + min_exchange_s``
(the adaptive deadline's floor) are counted for information. A trial whose fault never fired (the run
died or hung first) fails. Exit code 1 when any trial (baseline, scenario or random) misses the
target, 0 otherwise, 2 when it cannot run (e.g. ``--netem`` without root), 130 when interrupted.

Output in ``--out`` (default runs/chaos-real): ``chaos-real.json`` (command, config, bound, baselines,
every trial with every peer's numbers and its last warnings), ``chaos-real.md`` (the command and a
table to paste into bench/results/chaos.md), and per trial a directory with each peer's log,
metrics.jsonl and summary.json. stdout: the command, one line per trial, a summary.

Every wait has a deadline (a trial's: ``--trial-timeout-s``, default 60 + R x (grace_s + exchange_s
+ 1)); every process started is stopped on every exit path (SIGINT then SIGKILL of its process group,
then any process left in its session or, with --netem, in its namespace); SIGTERM and SIGHUP are
turned into a clean stop, and a second Ctrl+C during the clean-up is ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from gossiploco.cli_options import parse_sets
from gossiploco.config import TINY_OVERRIDES
from testbed.links import clear_links, drop_without_netem, has_netem, shape_links
from testbed.netns import Star, Unavailable, namespace_pids, preflight, prefix_lock
from testbed.overrides import set_args
from testbed.peers import start_dht_node
from testbed.processes import (ProcessGroup, ProcInfo, cmdline, descendants, process_table, shielded, signal_group,
                               signal_pid)

SCENARIO = "leader-kill-mid-mix2"
FAULT_ENV = "GOSSIPLOCO_FAULT"
"""The runtime's fault-injection variable (``SIGNAL:KEY:CHUNK``); its name and format are stable."""
SCENARIO_FAULT = "KILL:mix2/0:0"
SCENARIO_CONFIG = "globalm1-localm2"
SCENARIO_PEERS = 4
PROCESS_FAULTS = ("kill", "stop", "restart")
NETWORK_FAULTS = ("loss", "delay", "partition")
POLL_S = 0.1
TREE_SNAPSHOT_S = 0.5
ORPHAN_CHECK_S = 10.0
REJOIN_WINDOW_S = 15.0
"""A restarted peer that could not rejoin because the swarm finished within this long of its start makes
the trial inconclusive (a start takes about 10 s here: torch import, DHT node, discovery)."""
RESTART_ROUNDS_FACTOR = 2
"""A ``restart`` trial runs this many times ``--rounds``; its lost time (``lost_s``) leaves out the extra rounds, at
the baseline's round time, and it gets no val-loss delta (the baseline ran ``--rounds``)."""
STOP_GRACE_S = 10.0
"""After SIGINT a peer gets this long to leave (withdraw its DHT record, stop its DHT node) before SIGKILL."""
BOOTSTRAP_START_S = 60.0
EXIT_UNAVAILABLE = 2
EXIT_INTERRUPTED = 130
SUBNET = "10.78.0"
BOOTSTRAP_HOST_NETNS = f"{SUBNET}.254"
SMALL = {**{k: v for k, v in TINY_OVERRIDES.items()
             if k not in ("inner_steps", "rounds", "seed", "monitor.every", "timeouts.exchange_s")},
         "timeouts.discovery_s": 1.0}
"""tests/conftest.py's TINY scale-down (rounds, steps, monitor and timeouts come from the options)."""



# ---------------------------------------------------------------------------------------------
# Options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``chaos.py real`` (and of this file run alone)."""
    parser.add_argument("--trials", type=int, default=5, help="random-fault trials (the named scenario always runs too)")
    parser.add_argument("--trial-start", type=int, default=0,
                        help="index of the first trial (with --trials 1: replay trial S of a longer run, same draw)")
    parser.add_argument("--peers", type=int, default=4, help="peers per random trial, ranks 1..M (the scenario always has 4)")
    parser.add_argument("--rounds", type=int, default=12, help="outer rounds R per run")
    parser.add_argument("--inner-steps", type=int, default=150, help="inner steps H per round")
    parser.add_argument("--monitor-every", type=int, default=50,
                        help="monitor.every: a metrics record (progress event) every this many inner steps, plus h = 0")
    parser.add_argument("--seed", type=int, default=0, help="training seed of every run, and seed of the fault draws")
    parser.add_argument("--config", default="globalm1-localm2", help="preset or TOML of the random trials")
    parser.add_argument("--exchange-s", type=float, default=20.0, help="timeouts.exchange_s of the peers")
    parser.add_argument("--grace-s", type=float, default=3.0, help="timeouts.grace_s of the peers")
    parser.add_argument("--startup-s", type=float, default=30.0, help="timeouts.startup_s of the peers")
    parser.add_argument("--synthetic-step-s", type=float, default=0.0,
                        help="> 0: an inner step sleeps this long instead of computing (the model does not train)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every peer (TOML value), repeatable")
    parser.add_argument("--faults", default="",
                        help="comma-separated kinds to draw from (default: kill,stop,restart and, with --netem, loss,delay,partition)")
    parser.add_argument("--only", default="",
                        help="comma-separated kinds: run only the trials whose draw is of these kinds (the draws stay "
                             "those of the whole run: replay a run's restarts, say), and the baseline, not the scenario")
    parser.add_argument("--orphan-check-s", type=float, default=ORPHAN_CHECK_S,
                        help="look for a killed peer's leftover processes this long after the kill (a faulted run "
                             "lasts at least until then)")
    parser.add_argument("--netem", action="store_true", help="run in network namespaces and add network faults (root)")
    parser.add_argument("--prefix", default="glc", help="name prefix of the namespaces (--netem)")
    parser.add_argument("--trial-timeout-s", type=float, default=0.0,
                        help="deadline of one trial (default 60 + R x (grace_s + exchange_s + 1))")
    parser.add_argument("--out", type=Path, default=Path("runs/chaos-real"), help="output directory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chaos_real.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run; returns the exit code."""
    return run(build_parser().parse_args(argv))


def overrides_for(args: argparse.Namespace, peers: int, rounds: int | None = None) -> dict[str, Any]:
    """The dotted config overrides every peer of a run gets (``workers`` included, for load_config); ``rounds``
    (a fault's own, ``draw_fault``) replaces ``--rounds``."""
    over = {**SMALL, "workers": peers, "rounds": rounds or args.rounds, "inner_steps": args.inner_steps, "seed": args.seed,
            "monitor.every": args.monitor_every, "inner.synthetic_step_s": args.synthetic_step_s,
            "timeouts.exchange_s": args.exchange_s, "timeouts.grace_s": args.grace_s,
            "timeouts.startup_s": args.startup_s}
    over.update(parse_sets(args.sets))
    return over


@dataclass
class RunSpec:
    """What one run (baseline, scenario or trial) is: its config and how it is faulted."""

    label: str
    config: str
    peers: int
    fault: dict
    seed_key: str = ""


# ---------------------------------------------------------------------------------------------
# The network (--netem)


class Net:
    """The faults of ``--netem``, on a star of peer namespaces PREFIX-pI (eth0 = SUBNET.I) on bridge br0 of
    PREFIX-sw; br1 holds the cut-off side of a partition."""

    def __init__(self, prefix: str, ranks: Sequence[int]):
        if not ranks or max(ranks) > 253 or min(ranks) < 1:
            raise Unavailable("--netem supports ranks 1..253")
        try:
            self.star = Star(prefix, ranks, lambda rank: f"{SUBNET}.{rank}", bridges=("br0", "br1"),
                             switch_address=f"{BOOTSTRAP_HOST_NETNS}/24")
        except ValueError as exc:
            raise Unavailable(f"--prefix: {exc}") from exc
        self.netem = False
        """Whether the kernel has sch_netem (probed in build)."""
        self._shaped: set[int] = set()
        self._cut: set[int] = set()

    def ns(self, rank: int) -> str:
        return self.star.ns(rank)

    def address(self, rank: int) -> str:
        return self.star.address(rank)

    def exec_prefix(self, rank: int | None) -> list[str]:
        """``ip netns exec`` of peer ``rank``'s namespace (None: the switch's, where the bootstrap node runs)."""
        return self.star.exec_prefix(rank)

    def destroy(self) -> list[str]:
        """Kill every process in, then delete, every namespace with this prefix (idempotent)."""
        self._shaped.clear()
        self._cut.clear()
        return self.star.destroy()

    def build(self) -> None:
        self.star.build()
        self.netem = has_netem(self.star.switch, "br1")

    def clear(self, ranks: Sequence[int] | None = None) -> None:
        ranks = list(self._shaped if ranks is None else ranks)
        clear_links(self.star.links(ranks))
        self._shaped.difference_update(ranks)

    def loss(self, ranks: Sequence[int], pct: float) -> str:
        self.clear(ranks)
        if self.netem:
            shape_links(self.star.links(ranks), loss_pct=pct)
        else:
            drop_without_netem(self.star.links(ranks), pct)
        self._shaped.update(ranks)
        return "netem" if self.netem else "htb+cbpf"

    def delay(self, ranks: Sequence[int], ms: float) -> None:
        self.clear(ranks)
        shape_links(self.star.links(ranks), delay_ms=ms, queue_packets=10000)
        self._shaped.update(ranks)

    def slow(self, ranks: Sequence[int], mbit: float) -> None:
        self.clear(ranks)
        shape_links(self.star.links(ranks), mbit, queue_packets=1000)
        self._shaped.update(ranks)

    def cut(self, ranks: Sequence[int]) -> None:
        """Move ``ranks``' switch ports to br1: they reach each other only, the rest (and the bootstrap node) not."""
        for r in ranks:
            self.star.move_port(r, "br1")
            self._cut.add(r)

    def heal(self) -> None:
        for r in sorted(self._cut):
            self.star.move_port(r, "br0", check=False)
        self._cut.clear()

    def reset(self) -> None:
        """No shaping, no partition (between trials and on every exit path)."""
        self.heal()
        self.clear()


# ---------------------------------------------------------------------------------------------
# One run's processes


@dataclass
class Life:
    """One start of one peer: its process, output, records with arrival times and process tree."""

    rank: int
    index: int
    out_dir: Path
    log_path: Path
    proc: subprocess.Popen
    started: float
    records: list[tuple[float, dict]] = field(default_factory=list)
    exit_code: int | None = None
    exited_at: float | None = None
    killed_at: float | None = None
    tree: dict[int, int] = field(default_factory=dict)
    """pid -> start time of every descendant seen while it lived."""
    start_ticks: int | None = None
    frozen: list[list[float]] = field(default_factory=list)
    """[stop, cont] intervals (cont = inf while frozen)."""
    _offset: int = 0
    _partial: bytes = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def name(self) -> str:
        return f"peer-{self.rank}" + ("" if self.index == 0 else f"-restart{'' if self.index == 1 else self.index}")

    def tail(self, now: float) -> None:
        path = self.out_dir / "metrics.jsonl"
        try:
            with path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        if not data:
            return
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if line.strip():
                try:
                    self.records.append((now, json.loads(line)))
                except json.JSONDecodeError:
                    self.records.append((now, {"unparsable": line[:200].decode(errors="replace")}))


def ordered_rank_identities(run_dir: Path, ranks: Iterable[int], seed: int) -> dict[int, Path]:
    """An identity file ``run_dir/peer-I/identity.key`` per rank I, such that the lowest rank leads round 0's Mix2
    (a peer's id comes from its identity, and the leader of each exchange is drawn from the run's ``seed``, the
    exchange's key and the ids: ``protocol.groups.leader_of``; rank 1 is the scenario's leader, as the scenario and
    the reports assume). Existing files are kept."""
    from gossiploco.protocol.groups import lead_order
    from gossiploco.security.identity import Identity

    ranks = sorted(ranks)
    paths = {rank: run_dir / f"peer-{rank}" / "identity.key" for rank in ranks}
    if not all(path.exists() for path in paths.values()):
        made = {identity.peer_id: identity for identity in (Identity.generate() for _ in ranks)}
        for rank, peer_id in zip(ranks, lead_order(seed, "mix2/0", made)):
            made[peer_id].save(paths[rank])
    return paths


def leads(identities: dict[int, Path], rank: int, live: Iterable[int], key: str, seed: int) -> bool:
    """Whether ``rank`` leads exchange ``key`` among the ``live`` ranks (one bucket: the chaos runs have 4 peers)."""
    from gossiploco.protocol.groups import leader_of
    from gossiploco.security.identity import Identity

    ids = {r: Identity.load_or_create(identities[r]).peer_id for r in live}
    return leader_of(seed, key, ids.values()) == ids[rank]


class Swarm:
    """The peer processes of one run: start, restart, watch, fault, always stop."""

    def __init__(self, ctx: Context, run_dir: Path, spec: RunSpec, run_id: str):
        self.ctx = ctx
        self.dir = run_dir
        self.spec = spec
        self.run_id = run_id
        self.lives: list[Life] = []
        self.overrides = overrides_for(ctx.args, spec.peers, spec.fault.get("rounds"))
        self._last_tree = 0.0
        self.identities = ordered_rank_identities(run_dir, range(1, spec.peers + 1), ctx.args.seed)
        self.group = ProcessGroup(ctrl_c=True, grace_s=STOP_GRACE_S)

    def identity(self, rank: int) -> Path:
        """Rank ``rank``'s identity file: the same for every life of the rank (a restart keeps its peer id)."""
        return self.identities[rank]

    def command(self, rank: int, out_dir: Path) -> list[str]:
        net = self.ctx.net
        host = net.address(rank) if net else "127.0.0.1"
        cmd = [sys.executable, "-m", "gossiploco", "peer", "--rank", str(rank), "--join", self.ctx.bootstrap_addr,
               "--swarm-key", str(self.ctx.swarm_key), "--identity", str(self.identity(rank)),
               "--host", host, "--workers", str(self.spec.peers), "--out", str(out_dir), "--config", self.spec.config,
               "--run-id", self.run_id, "--new-run", *set_args(self.overrides, without=("workers",))]
        return [*net.exec_prefix(rank), *cmd] if net else cmd

    def start(self, rank: int, env: dict[str, str] | None = None) -> Life:
        index = sum(1 for life in self.lives if life.rank == rank)
        name = f"peer-{rank}" + ("" if index == 0 else f"-restart{'' if index == 1 else index}")
        out_dir, log_path = self.dir / name, self.dir / f"{name}.log"
        self.dir.mkdir(parents=True, exist_ok=True)
        peer_env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
        peer_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})})
        proc = self.group.start(self.command(rank, out_dir), log_path, env=peer_env, header=True)
        life = Life(rank, index, out_dir, log_path, proc, time.monotonic())
        self.lives.append(life)
        return life

    def current(self, rank: int) -> Life:
        return [life for life in self.lives if life.rank == rank][-1]

    def live(self) -> list[Life]:
        return [life for life in self.lives if life.exit_code is None]

    def poll(self, now: float) -> None:
        for life in self.lives:
            if life.exit_code is None:
                code = life.proc.poll()
                life.tail(now)
                if code is not None:
                    life.exit_code, life.exited_at = code, now
            else:
                life.tail(now)
        if now - self._last_tree >= TREE_SNAPSHOT_S:
            self._last_tree = now
            self.snapshot_trees()

    def snapshot_trees(self, table: dict[int, ProcInfo] | None = None) -> None:
        table = table or process_table()
        for life in self.live():
            me = table.get(life.pid)
            if me is not None and life.start_ticks is None:
                life.start_ticks = me.start
            for info in descendants(table, life.pid):
                life.tree.setdefault(info.pid, info.start)

    def kill(self, life: Life, now: float) -> None:
        """SIGKILL of the peer process only (a crash: what it started is left to its own devices)."""
        self.snapshot_trees()
        signal_pid(life.pid, signal.SIGKILL)
        life.killed_at = now

    def freeze(self, life: Life, now: float) -> None:
        signal_group(life.pid, signal.SIGSTOP)
        life.frozen.append([now, math.inf])

    def thaw(self, life: Life, now: float) -> None:
        signal_group(life.pid, signal.SIGCONT)
        if life.frozen and life.frozen[-1][1] == math.inf:
            life.frozen[-1][1] = now

    def leftovers(self, life: Life, table: dict[int, ProcInfo] | None = None) -> list[ProcInfo]:
        """Processes of ``life``'s tree (descendants seen, or its session) that still exist and are not zombies."""
        table = table or process_table()
        out = []
        for pid, info in table.items():
            if info.state in ("Z", "X") or pid == os.getpid():
                continue
            mine = life.tree.get(pid) == info.start or (info.session == life.pid and pid != life.pid)
            if pid == life.pid and life.exit_code is None:
                mine = False  # still running: not a leftover
            if mine:
                out.append(info)
        return out

    def stop(self) -> None:
        """Resume, SIGINT, wait up to STOP_GRACE_S, SIGKILL the process groups (``ProcessGroup.stop``); then any
        process left in a life's tree or session, and (--netem) in the peers' namespaces. Idempotent, never raises."""
        self.group.stop()
        now = time.monotonic()
        for life in self.lives:
            if life.exit_code is None and life.proc.poll() is not None:
                life.exit_code, life.exited_at = life.proc.returncode, now
        table = process_table()
        for life in self.lives:
            for info in self.leftovers(life, table):
                signal_pid(info.pid, signal.SIGKILL)
        if self.ctx.net is not None:
            for rank in range(1, self.spec.peers + 1):
                for pid in namespace_pids(self.ctx.net.ns(rank)):
                    signal_pid(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# The bench


class Context:
    """What lives across runs: options, the network, the bootstrap node, the baselines."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.net: Net | None = None
        self.bootstrap: subprocess.Popen | None = None
        self.bootstrap_group = ProcessGroup(ctrl_c=True, grace_s=10.0)
        self.bootstrap_addr = ""
        self.bootstrap_log: Path = args.out / "bootstrap.log"
        self.bootstrap_starts = 0
        self.baselines: dict[tuple[str, int], dict] = {}
        self.token = f"{os.getpid()}-{int(time.time()) % 100000}"
        self.swarm_key: Path = args.out / "swarm.key"
        """The bench's swarm key, made fresh per bench run; the bootstrap node and every peer use it."""
        self._key_made = False

    def ensure_bootstrap(self) -> None:
        if self.bootstrap is not None and self.bootstrap.poll() is None:
            return
        if self.bootstrap is not None:
            print(f"  bootstrap node exited ({self.bootstrap.returncode}); starting another", flush=True)
            self.stop_bootstrap()
        host = BOOTSTRAP_HOST_NETNS if self.net else "127.0.0.1"
        if not self._key_made:
            from gossiploco.security.swarm_key import SwarmKey

            SwarmKey.generate().save(self.swarm_key)  # replaces an earlier bench's key in the same --out
            self._key_made = True
        self.args.out.mkdir(parents=True, exist_ok=True)
        self.bootstrap_group = ProcessGroup(ctrl_c=True, grace_s=10.0)
        self.bootstrap_starts += 1
        # The log is appended to: an earlier bench in the same --out may have written there; only this start counts.
        self.bootstrap, self.bootstrap_addr = start_dht_node(
            self.bootstrap_group, self.bootstrap_log, host=host, port=0, swarm_key=self.swarm_key,
            where=self.net.exec_prefix(None) if self.net else (), timeout_s=BOOTSTRAP_START_S,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})

    def stop_bootstrap(self) -> None:
        proc = self.bootstrap
        if proc is None:
            return
        table = process_table()
        tree = [info.pid for info in descendants(table, proc.pid)]
        self.bootstrap_group.stop()  # SIGINT, 10 s, SIGKILL of its process group
        for pid in tree:  # and whatever it started elsewhere
            signal_pid(pid, signal.SIGKILL)
        self.bootstrap = None


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


def timeouts_of(args: argparse.Namespace, config: str, peers: int, rounds: int | None = None) -> dict[str, float]:
    """The run's [timeouts] (from the real config loader) and the stall bound computed from them."""
    from gossiploco.config import load_config

    cfg = load_config(config, overrides_for(args, peers, rounds))
    t = cfg.timeouts
    return {"exchange_s": t.exchange_s, "grace_s": t.grace_s, "min_exchange_s": t.min_exchange_s,
            "adaptive_factor": t.adaptive_factor, "heartbeat_s": t.heartbeat_s, "startup_s": t.startup_s,
            "bound_s": t.grace_s + t.exchange_s, "adaptive_floor_s": t.grace_s + t.min_exchange_s,
            "rounds": cfg.rounds, "inner_steps": cfg.inner_steps, "monitor_every": cfg.monitor.every}


def draw_fault(args: argparse.Namespace, kinds: Sequence[str], trial: int, peers: int, netem: bool | None) -> dict:
    """The fault of random trial ``trial``: from ``--seed`` and the index only."""
    rng = random.Random(f"chaos-real:{args.seed}:{trial}")
    kind = rng.choice(list(kinds))
    ranks = list(range(1, peers + 1))
    last = max(1, args.rounds - 2)
    fault: dict[str, Any] = {"kind": kind, "round": rng.randint(1, last), "offset_frac": rng.random()}
    if kind in PROCESS_FAULTS:
        fault["target"] = rng.choice(ranks)
    if kind == "stop":
        fault["stop_s"] = round(rng.uniform(2.0, 10.0), 1)
    elif kind == "restart":
        fault["round"] = 1  # early: the restarted peer needs ~10 s to be back, and the swarm must still be running
        fault["rounds"] = RESTART_ROUNDS_FACTOR * args.rounds
        fault["restart_after_s"] = round(rng.uniform(0.5, 2.0), 1)
    elif kind in ("loss", "delay"):
        fault["ranks"] = [rng.choice(ranks)] if rng.random() < 0.5 else ranks
        fault["duration_s"] = round(rng.uniform(5.0, 15.0), 1)
        if kind == "loss":
            fault["loss_pct"] = round(rng.uniform(5.0, 25.0), 1)
        else:
            fault["delay_ms"] = round(rng.uniform(50.0, 200.0))
            fault["slow_mbit"] = round(rng.uniform(1.0, 4.0), 1)  # used when the kernel has no sch_netem
            if netem is False:
                fault["kind"] = "slow"
    elif kind == "partition":
        fault["ranks"] = [rng.choice(ranks)] if rng.random() < 0.5 or peers < 4 else ranks[peers // 2:]
        fault["duration_s"] = round(rng.uniform(3.0, 12.0), 1)
    return fault


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


def run_one(ctx: Context, spec: RunSpec) -> dict:
    """One run: start the peers, inject ``spec.fault`` at its time, watch, stop, measure."""
    args = ctx.args
    run_dir = args.out / spec.label
    if run_dir.exists():
        shutil.rmtree(run_dir)
    ctx.ensure_bootstrap()
    if ctx.net is not None:
        ctx.net.reset()
    limits = timeouts_of(args, spec.config, spec.peers, spec.fault.get("rounds"))
    rounds = limits["rounds"]
    timeout_s = args.trial_timeout_s or 60.0 + rounds * (limits["grace_s"] + limits["exchange_s"] + 1.0)
    fault = dict(spec.fault)
    kind = fault["kind"]
    base = ctx.baselines.get((spec.config, spec.peers))
    round_s = base["round_s"] if base and base.get("round_s") else 1.0
    swarm = Swarm(ctx, run_dir, spec, f"chaos-real-{ctx.token}-{spec.label}")
    ranks = list(range(1, spec.peers + 1))
    events: list[dict] = []
    pending: list[tuple[float, str, Callable[[float], None]]] = []
    state: dict[str, Any] = {"injected_at": None, "trigger": None, "timed_out": False}
    orphan_checks: dict[int, dict] = {}
    t0 = time.monotonic()

    def note(now: float, what: str) -> None:
        events.append({"t": round(now - t0, 2), "event": what})

    def schedule(at: float, name: str, fn: Callable[[float], None]) -> None:
        pending.append((at, name, fn))

    def orphan_check(life: Life, killed_at: float) -> None:
        def check(now: float) -> None:
            found = swarm.leftovers(life)
            orphan_checks[life.index * 1000 + life.rank] = {
                "peer": life.name, "after_s": round(now - killed_at, 1),
                "processes": [{"pid": p.pid, "comm": p.comm, "cmd": cmdline(p.pid, 120)} for p in found]}
            note(now, f"{life.name}: {len(found)} process(es) of its tree left {now - killed_at:.1f}s after the kill")
            for p in found:  # measured; now clean up
                signal_pid(p.pid, signal.SIGKILL)
        schedule(killed_at + ctx.args.orphan_check_s, f"orphan check {life.name}", check)

    def inject(now: float) -> None:
        state["injected_at"] = now
        net = ctx.net
        if kind in PROCESS_FAULTS:
            life = swarm.current(fault["target"])
            fault["leader"] = leads(swarm.identities, fault["target"], [l.rank for l in swarm.live()],
                                    f"mix2/{fault.get('round', 0)}", ctx.args.seed)  # of the round it is hit in
            if kind in ("kill", "restart"):
                swarm.kill(life, now)
                note(now, f"SIGKILL {life.name} (pid {life.pid})")
                orphan_check(life, now)
                if kind == "restart":
                    def restart(at: float, rank: int = fault["target"]) -> None:
                        new = swarm.start(rank)
                        note(at, f"restarted rank {rank} as {new.name} (pid {new.pid})")
                    schedule(now + fault["restart_after_s"], "restart", restart)
            else:
                swarm.freeze(life, now)
                note(now, f"SIGSTOP group of {life.name}")

                def cont(at: float, life: Life = life) -> None:
                    swarm.thaw(life, at)
                    note(at, f"SIGCONT group of {life.name}")
                schedule(now + fault["stop_s"], "SIGCONT", cont)
        else:
            assert net is not None
            if kind == "loss":
                fault["loss_method"] = net.loss(fault["ranks"], fault["loss_pct"])
            elif kind == "delay":
                net.delay(fault["ranks"], fault["delay_ms"])
            elif kind == "slow":
                net.slow(fault["ranks"], fault["slow_mbit"])
            elif kind == "partition":
                net.cut(fault["ranks"])
            note(now, f"{kind} on ranks {fault['ranks']}")

            def heal(at: float) -> None:
                net.reset()
                note(at, "network healed")
            schedule(now + fault["duration_s"], "heal", heal)

    try:
        env = {1: {FAULT_ENV: SCENARIO_FAULT}} if kind == SCENARIO else {}
        for rank in ranks:
            swarm.start(rank, env.get(rank))
        note(t0, f"started ranks {ranks} (run id {swarm.run_id})")
        deadline = t0 + timeout_s
        offset_s = fault.get("offset_frac", 0.0) * round_s
        while True:
            now = time.monotonic()
            swarm.poll(now)
            if kind == SCENARIO and state["injected_at"] is None:
                victim = swarm.current(1)
                if victim.exit_code is not None:
                    state["injected_at"] = victim.exited_at
                    fault["target"], fault["leader"] = 1, True
                    note(now, f"rank 1 exited with {victim.exit_code} ({FAULT_ENV}={SCENARIO_FAULT})")
                    if victim.exit_code == -signal.SIGKILL:
                        victim.killed_at = victim.exited_at
                        orphan_check(victim, victim.exited_at)
            elif kind not in ("none", SCENARIO) and state["injected_at"] is None:
                watch = [swarm.current(fault["target"])] if kind in PROCESS_FAULTS else swarm.lives
                if state["trigger"] is None:
                    for life in watch:
                        if life.exit_code is None and any(r.get("round", -1) >= fault["round"] for _, r in life.records):
                            state["trigger"] = now
                            break
                if state["trigger"] is not None and now >= state["trigger"] + offset_s:
                    if all(life.exit_code is None for life in watch[:1]) or kind not in PROCESS_FAULTS:
                        inject(now)
                    else:
                        state["trigger"] = None  # the target ended before its time: no fault
            for item in sorted(pending, key=lambda p: p[0]):
                if now >= item[0]:
                    pending.remove(item)
                    item[2](now)
            if not swarm.live() and not pending:
                break
            if now > deadline:
                state["timed_out"] = True
                note(now, f"trial deadline ({timeout_s:.0f}s): stopping every peer")
                for item in sorted(pending, key=lambda p: p[0]):  # resume, heal and look for orphans now
                    if item[1] != "restart":
                        item[2](now)
                pending.clear()
                break
            time.sleep(POLL_S)
    finally:
        with shielded():  # a second Ctrl+C must not cut the clean-up short
            if ctx.net is not None:
                with contextlib.suppress(Exception):
                    ctx.net.reset()
            swarm.stop()
        end = time.monotonic()
        for life in swarm.lives:
            life.tail(end)
    wall = end - t0
    return analyze(ctx, spec, fault, swarm, limits, state, events, orphan_checks, t0, end, wall)


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


def command_line() -> str:
    exe, cwd = sys.executable, os.getcwd().rstrip("/") + "/"
    return shlex.join([exe.removeprefix(cwd), *sys.argv])


def run(args: argparse.Namespace) -> int:
    """Run the bench (the module docstring); returns the exit code."""
    command = command_line()
    print(f"command: {command}", flush=True)
    if args.trials < 0 or args.trial_start < 0 or args.peers < 2 or args.rounds < 3 or args.inner_steps < 1:
        print("error: needs --trials >= 0, --trial-start >= 0, --peers >= 2, --rounds >= 3, --inner-steps >= 1", file=sys.stderr)
        return EXIT_UNAVAILABLE
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()] or [*PROCESS_FAULTS, *(NETWORK_FAULTS if args.netem else ())]
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    bad = [k for k in kinds + only if k not in (*PROCESS_FAULTS, *NETWORK_FAULTS)]
    if bad or (not args.netem and any(k in NETWORK_FAULTS for k in kinds)):
        print(f"error: --faults {args.faults!r} / --only {args.only!r}: kinds are {', '.join(PROCESS_FAULTS + NETWORK_FAULTS)} "
              f"(network kinds need --netem)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        limits = timeouts_of(args, args.config, args.peers)
        timeouts_of(args, SCENARIO_CONFIG, SCENARIO_PEERS)
    except Exception as exc:  # a config error names the field
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.netem:
        why = preflight()
        if why:
            print(f"cannot run: {why}", file=sys.stderr)
            return EXIT_UNAVAILABLE
    print(f"bound: no survivor stall > grace_s + exchange_s = {limits['grace_s']:g} + {limits['exchange_s']:g} = "
          f"{limits['bound_s']:g}s (adaptive deadline floor: grace_s + min_exchange_s = {limits['adaptive_floor_s']:g}s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args)
    report: dict[str, Any] = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()), "config": args.config,
                              "scenario_config": SCENARIO_CONFIG, "peers": args.peers, "netem": args.netem,
                              "sch_netem": None, "synthetic_step_s": args.synthetic_step_s, "limits": limits,
                              "fault_kinds": kinds, "runs": [], "interrupted": False}
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in previous:
        signal.signal(sig, raise_interrupt)
    code = 0
    lock = prefix_lock(args.prefix) if args.netem else contextlib.nullcontext()
    try:
        with lock:
            if args.netem:
                ctx.net = Net(args.prefix, list(range(1, max(args.peers, SCENARIO_PEERS) + 1)))
                stale = ctx.net.destroy()
                if stale:
                    print(f"removed namespaces of an earlier run: {', '.join(stale)}", flush=True)
                ctx.net.build()
                report["sch_netem"] = ctx.net.netem
                if not ctx.net.netem:
                    print("note: this kernel has no sch_netem: 'delay' becomes 'slow' (an HTB-limited link), "
                          "'loss' uses a BPF classifier", flush=True)
            plan: list[RunSpec] = []
            for config, peers in dict.fromkeys([(SCENARIO_CONFIG, SCENARIO_PEERS), (args.config, args.peers)]):
                plan.append(RunSpec(f"baseline-{Path(config).stem}-{peers}p", config, peers, {"kind": "none"}))
            if not only:
                plan.append(RunSpec(f"scenario-{SCENARIO}", SCENARIO_CONFIG, SCENARIO_PEERS, {"kind": SCENARIO}))
            netem_flag = ctx.net.netem if ctx.net else None
            for i in range(args.trial_start, args.trial_start + args.trials):
                fault = draw_fault(args, kinds, i, args.peers, netem_flag)
                if only and fault["kind"] not in only and not (fault["kind"] == "slow" and "delay" in only):
                    continue
                plan.append(RunSpec(f"trial-{i:03d}-{fault['kind']}", args.config, args.peers, fault))
            total = len(plan)
            for n, spec in enumerate(plan, 1):
                result = run_one(ctx, spec)
                if spec.fault["kind"] == "none":
                    ctx.baselines[(spec.config, spec.peers)] = {"val_loss": result["val_loss"], "round_s": result.get("round_s"),
                                                                "wall_s": result["survivor_wall_s"], "label": spec.label}
                report["runs"].append(result)
                print(line(result, f"{n:>2}/{total} {spec.label}"), flush=True)
                if not result["pass"]:
                    code = 1
                write_report(args, command, report)
    except KeyboardInterrupt:
        report["interrupted"] = True
        code = EXIT_INTERRUPTED
        print("interrupted; stopping every process", flush=True)
    except Unavailable as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        code = EXIT_UNAVAILABLE
    finally:
        try:
            with shielded():
                ctx.stop_bootstrap()
                if ctx.net is not None:
                    ctx.net.destroy()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if report["runs"]:
        write_report(args, command, report)
        print(f"summary: {report['summary']['text']}", flush=True)
        print(f"wrote {args.out / 'chaos-real.json'} and {args.out / 'chaos-real.md'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
