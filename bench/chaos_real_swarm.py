"""The processes and network of one chaos_real trial (``bench/chaos_real.py``): the ``--netem`` star (``Net``), one
start of one peer (``Life``), the peer processes of a run (``Swarm``) and what lives across runs (``Context``: the
bootstrap node, the network, the baselines)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from gossiploco.cli_options import parse_sets
from gossiploco.config import TINY_OVERRIDES
from testbed.links import clear_links, drop_without_netem, has_netem, shape_links
from testbed.netns import Star, Unavailable, namespace_pids
from testbed.overrides import set_args
from testbed.peers import start_dht_node
from testbed.processes import ProcessGroup, ProcInfo, descendants, process_table, signal_group, signal_pid

FAULT_ENV = "GOSSIPLOCO_FAULT"
"""The runtime's fault-injection variable (``SIGNAL:KEY:CHUNK``); its name and format are stable."""
SCENARIO = "leader-kill-mid-mix2"
SCENARIO_FAULT = "KILL:mix2/0:0"
PROCESS_FAULTS = ("kill", "stop", "restart")
TREE_SNAPSHOT_S = 0.5
STOP_GRACE_S = 10.0
"""After SIGINT a peer gets this long to leave (withdraw its DHT record, stop its DHT node) before SIGKILL."""
BOOTSTRAP_START_S = 60.0
SUBNET = "10.78.0"
BOOTSTRAP_HOST_NETNS = f"{SUBNET}.254"
SMALL = {**{k: v for k, v in TINY_OVERRIDES.items()
             if k not in ("inner_steps", "rounds", "seed", "monitor.every", "timeouts.exchange_s")},
         "timeouts.discovery_s": 1.0}
"""tests/conftest.py's TINY scale-down (rounds, steps, monitor and timeouts come from the options)."""


# ---------------------------------------------------------------------------------------------
# A run's options and spec


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
# Across runs


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
