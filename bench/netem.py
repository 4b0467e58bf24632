"""Real peers on shaped links: measured compute utilization against the simulator's prediction.

For each bandwidth B this benchmark builds a small private network out of Linux network
namespaces, runs M real ``gossiploco peer`` processes on it (one per namespace), and compares each
peer's measured compute utilization with ``gossiploco utilization``'s prediction for the same step
time, payload and bandwidth.

Topology (every name starts with ``--prefix``, default ``gln``; nothing is added to the root
namespace)::

    namespace PREFIX-sw:  bridge br0 with ports p0 .. p{M-1}          (the "switch")
    namespace PREFIX-pI:  eth0 = 10.77.0.{I+1}/24, veth peer of PREFIX-sw's pI   (peer I)

Each peer's access link is shaped to B in both directions with ``tc``: an HTB class of rate B on
the egress of the peer-side veth (upload) and on the egress of the switch-side veth (download),
so a peer has B up and B down (full duplex, the simulator's link). Under each class a FIFO of
``--queue-packets`` (1000, Linux's default queue length); ``--delay-ms`` / ``--loss-pct`` put a
netem qdisc there instead (both directions, so the round trip is twice the delay; needs sch_netem
in the kernel, else exit 2). tc counts whole Ethernet frames: at MTU 1500 a TCP flow carries at
most 1448 / 1514 = 95.6% of B as payload, which the simulator does not model (it sends payload at
exactly B); the table also shows the simulator fed with the measured TCP goodput, for comparison.

TCP congestion control in the peer namespaces (``--congestion-control``): ``auto`` takes cubic
(Linux's default) when the host allows it, else reno. BBR, the host's default on the machine the
results were taken on, gets only about 72% of B for the project's ring all-reduce on these links
(each ring step is a short burst that BBR paces below the link rate; reno gets 95%), so it is not
the default here; ``--congestion-control inherit`` measures with it.

ZeroMQ heartbeats (``--heartbeat-timeout-s``): the runtime drops a connection when no whole
message arrives within ``timeouts.heartbeat_s`` (5 s) of a heartbeat (libzmq counts complete
messages, not bytes). On these slow shared links a 4 MiB chunk, or a TCP flow stalled by drops, can
take longer, so healthy connections are dropped and exchanges fail (results/utilization.md has the
evidence). The option sets ``timeouts.heartbeat_s`` for the peers (and the swap probe), as a user on
such a link would; 0 (default) keeps the runtime's default. ``--swap-mb`` shows the drop in isolation.

Discovery (``--discovery``): ``dht`` (default) runs a bootstrap node (``gossiploco dht``) in peer 0's
namespace and starts every peer with ``--join`` it, as users do; ``static`` gives them the list.
Peers are always encrypted (CurveZMQ): each run gets a fresh swarm key (``RUN/swarm.key``, passed
with ``--swarm-key`` to the peers and to the bootstrap node) and, with ``dht``, identity files
``RUN/peer-I/identity.key`` whose peer ids increase with I (``--identity``).

Per bandwidth it runs, in order:

1. a raw TCP stream p0 -> p1 (probe ``tcp-server`` / ``tcp-client``): the goodput one flow gets;
2. the ring all-reduce of the model's payload among the M peers (probe ``ring``, the project's
   ``ZmqExchange.all_reduce_mean``): effective rate ``2 (M-1)/M * bytes * 8 / seconds`` against B.
   ``--ring-security plain,curve`` times it over both transports, alternating repeat by repeat in the
   same processes: ``plain`` is ``ZmqExchange(trust=None)`` (plaintext, kept for benchmarks), ``curve``
   is ``trust=Trust.static(swarm key, rank, M)`` (CurveZMQ, what ``gossiploco peer`` always runs);
   the table then compares the two (what encryption costs on the link);
3. with ``--swap-mb MB``, the heartbeat check (probe ``swap``): p0 and p1 swap MB with
   ``ZmqExchange.swap`` in ``--chunk-mb`` chunks, with the peers' heartbeat timeout
   (``--heartbeat-timeout-s``, else the runtime's). It shows whether a healthy connection survives
   one chunk's time on the wire: ``--bandwidths 5 --swap-mb 8`` fails with the runtime's 5 s and
   passes with ``--heartbeat-timeout-s 60`` or ``--chunk-mb 1`` (see "ZeroMQ heartbeats" above);
4. every preset (``--presets``, default all of ``peers/``): M peers, each started as
   ``ip netns exec PREFIX-pI python -m gossiploco peer --rank I --join BOOTSTRAP --swarm-key RUN/swarm.key
   --identity RUN/peer-I/identity.key --host 10.77.0.I+1``.
   By default an inner step is a sleep of ``--step-time`` seconds (``inner.synthetic_step_s``: the
   machine's CPU may be shared, a sleep is not slowed down by it; the communication is real).
   ``--real-compute`` runs the model's real inner steps instead, and the prediction then uses the
   measured seconds per step. Training-time monitors are off (``monitor.enabled = false``) except
   for ``globalm1-adaptive``, which needs them (``monitor.every = 0``: one measurement, i.e. one
   blocking all-reduce of the parameters, per round; the simulator does not model it).

Measured utilization of a peer = ``round_utilization`` of its summary.json: seconds computing
inner steps / seconds of the training rounds (start-up and the final measurement excluded). The
table gives the median over the peers and their min-max; a row passes when the median is within
``--tolerance`` points (default 5) of the prediction. The prediction is
``gossiploco.utilization.simulate`` with N = the model's real parameter count, the preset's real
Mix1/Mix2 block fractions, M, H, T and B; outer-step time 0 (the simulator's default).

Safety: needs root (namespaces and tc need CAP_NET_ADMIN), ``ip`` and ``tc``; when it cannot run it
says why and exits 2. Only addresses in 10.77.0.0/24 inside its own namespaces are used. Namespaces
are removed on every exit path (try/finally; SIGINT, SIGTERM and SIGHUP are turned into a clean
stop; a second Ctrl+C during the clean-up is ignored), and leftovers of a crashed earlier run with the
same prefix are removed at start (their processes killed by pid first). A lock file keeps two runs
with the same prefix apart. Every wait has a deadline; peer processes get SIGINT, then SIGKILL.

    sudo .venv/bin/python bench/netem.py --heartbeat-timeout-s 60   # every preset at 16 and 60 Mbit/s
    sudo .venv/bin/python bench/netem.py --presets diloco,globalm1 --bandwidths 20 --rounds 3
    sudo .venv/bin/python bench/netem.py --real-compute --presets globalm1-localm2 --bandwidths 60
    sudo .venv/bin/python bench/netem.py --presets none --bandwidths 50,200,1000 --ring-security plain,curve \
        --ring-repeats 7                                       # what encryption costs on the link (ring probe)
    sudo .venv/bin/python bench/netem.py --workers 2 --bandwidths 5 --presets none --tcp-seconds 0 \
        --ring-repeats 0 --swap-mb 8                           # the heartbeat drop alone (then: --heartbeat-timeout-s 60)
    .venv/bin/python bench/netem.py --predict-only             # the predictions only (no root needed)
    sudo .venv/bin/python bench/netem.py --cleanup             # remove leftovers of a crashed run

Exit codes: 0 ran (misses are reported, not failures; ``--strict`` makes a miss exit 1), 1 a run
broke (a peer failed or timed out), 2 cannot run here, 130 interrupted. Output: ``--out``
(default runs/netem): results.json (everything, per peer), table.md, and per run the peers' logs,
metrics.jsonl and summary.json; ``--sample-links 0.1`` adds every switch port's byte counters
over time (links.jsonl).

The probes run as ``bench/netem.py probe KIND ...`` inside the namespaces, one process per
namespace (``bench/netem.py probe KIND --help``): ``ring``, ``swap``, ``tcp-server`` /
``tcp-client`` (one raw TCP stream, no ZeroMQ: what a single flow gets out of the shaped link) and
``sample`` (in the switch namespace: every port's byte counters at an interval, JSON lines).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

SELF = Path(__file__).resolve()
ROOT = SELF.parent.parent

DEFAULT_PREFIX = "gln"
SUBNET = "10.77.0"
"""Peer I gets 10.77.0.{I+1}/24 (a private range; only inside this benchmark's namespaces)."""
PEER_PORT = 7100
RING_PORT = 6900
SWAP_PORT = 6950
TCP_PORT = 6800
CMD_TIMEOUT_S = 20.0
"""Deadline of one ip / tc command."""
STOP_GRACE_S = 10.0
"""After SIGINT a process gets this long to leave before SIGKILL."""
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")
EXIT_UNAVAILABLE = 2


class Unavailable(Exception):
    """This machine cannot run the benchmark (not root, no ip/tc, namespaces refused)."""


# ---------------------------------------------------------------------------------------
# Commands


def sh(cmd: Sequence[str], *, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one command with a deadline; raise with its stderr when ``check`` and it fails."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{' '.join(cmd)}: no answer after {timeout:.0f}s") from exc
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def preflight() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and tc need CAP_NET_ADMIN); run it with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2), not found on PATH"
    try:
        proc = sh(["ip", "netns", "list"], check=False)
    except RuntimeError as exc:
        return f"`ip netns list` does not answer: {exc}"
    if proc.returncode != 0:
        return f"`ip netns` is unavailable: {proc.stderr.strip()}"
    return None


# ---------------------------------------------------------------------------------------
# The network


def list_namespaces(prefix: str, suffix: str = r"sw|p\d+") -> list[str]:
    """Namespaces this benchmark made with ``prefix`` (``PREFIX-sw``, ``PREFIX-pI``); ``suffix``, a regular
    expression, names another tool's namespaces (bench/nat_testbed.py's)."""
    pattern = re.compile(rf"^{re.escape(prefix)}-({suffix})$")
    out = sh(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if pattern.match(n))


def kill_namespace_processes(ns: str) -> list[int]:
    """SIGKILL every process living in namespace ``ns`` (only ever one of ours), by pid."""
    proc = sh(["ip", "netns", "pids", ns], check=False)
    pids = [int(p) for p in proc.stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def remove_namespaces(prefix: str, suffix: str = r"sw|p\d+") -> list[str]:
    """Kill the processes in, then delete, every namespace with ``prefix`` (and ``suffix``, as in
    ``list_namespaces``). Returns what was removed."""
    names = list_namespaces(prefix, suffix)
    for ns in names:
        kill_namespace_processes(ns)
    if names:
        time.sleep(0.2)  # let the killed processes go (a namespace lives while a process is in it)
    for ns in names:
        sh(["ip", "netns", "del", ns], check=False)
    return names


@contextlib.contextmanager
def prefix_lock(prefix: str) -> Iterator[None]:
    """Hold ``/run/lock/gossiploco-netem-PREFIX.lock`` (or under /tmp): one run per prefix at a time."""
    lock_dir = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    path = lock_dir / f"gossiploco-netem-{prefix}.lock"
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise Unavailable(f"another bench/netem.py run with prefix {prefix!r} is active ({path}); "
                              "wait for it or use --prefix") from None
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # still holding it: a run starting now makes a fresh file
            fcntl.flock(handle, fcntl.LOCK_UN)


def shape_links(links: Sequence[tuple[str, str]], rate_mbit: float, delay_ms: float = 0.0, loss_pct: float = 0.0,
                queue_packets: int = 1000, mtu: int = 1500) -> None:
    """Shape each egress (namespace, device) of ``links`` as ``Network.shape`` describes (replaces earlier shaping)."""
    rate = f"{rate_mbit:g}mbit"
    limit = int(queue_packets)
    for ns, dev in links:
        sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)  # earlier shaping, if any
        sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
        sh(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
            "rate", rate, "ceil", rate, "quantum", str(mtu + 14)])
        # The leaf queue under the class: netem (delay / loss) or a plain FIFO.
        if delay_ms > 0 or loss_pct > 0:
            netem = ["netem", "limit", str(limit)]
            if delay_ms > 0:
                netem += ["delay", f"{delay_ms:g}ms"]
            if loss_pct > 0:
                netem += ["loss", f"{loss_pct:g}%"]
            try:
                sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", *netem])
            except RuntimeError as exc:
                raise Unavailable(f"cannot add a netem qdisc for --delay-ms / --loss-pct (this kernel may lack "
                                  f"sch_netem): {exc}") from exc
        else:
            sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "pfifo", "limit", str(limit)])


@dataclass
class Network:
    """``peers`` namespaces joined by a bridge in a switch namespace, each access link shaped (module docstring)."""

    prefix: str
    peers: int
    mtu: int = 1500
    built: bool = False
    shaping: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not PREFIX_RE.match(self.prefix):
            raise ValueError(f"--prefix must match {PREFIX_RE.pattern} (short: interface and namespace names), got {self.prefix!r}")
        if not 1 <= self.peers <= 200:
            raise ValueError(f"peers must be in 1..200, got {self.peers}")

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def ns(self, rank: int) -> str:
        return f"{self.prefix}-p{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(rank)]

    def exec_prefix_switch(self) -> list[str]:
        return ["ip", "netns", "exec", self.switch]

    def build(self) -> None:
        """Create the namespaces, bridge and veth pairs. Raises ``Unavailable`` if namespaces are refused."""
        sw = self.switch
        try:
            sh(["ip", "netns", "add", sw])
        except RuntimeError as exc:
            raise Unavailable(f"cannot create a network namespace: {exc}") from exc
        self.built = True
        try:
            sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        except RuntimeError as exc:
            raise Unavailable(f"cannot create a bridge: {exc}") from exc
        sh(["ip", "-n", sw, "link", "set", "br0", "mtu", str(self.mtu), "up"])
        for rank in range(self.peers):
            ns = self.ns(rank)
            sh(["ip", "netns", "add", ns])
            sh(["ip", "-n", sw, "link", "add", f"p{rank}", "mtu", str(self.mtu), "type", "veth",
                "peer", "name", "eth0", "mtu", str(self.mtu), "netns", ns])
            sh(["ip", "-n", sw, "link", "set", f"p{rank}", "master", "br0", "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", "eth0"])
            sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])

    def links(self) -> list[tuple[str, str]]:
        """(namespace, device) of every shaped egress: each peer's upload, then each peer's download."""
        return [(self.ns(r), "eth0") for r in range(self.peers)] + [(self.switch, f"p{r}") for r in range(self.peers)]

    def shape(self, rate_mbit: float, delay_ms: float = 0.0, loss_pct: float = 0.0, queue_packets: int = 1000) -> None:
        """Rate ``rate_mbit`` (10^6 bit/s of Ethernet frames) on every link in both directions, a FIFO of
        ``queue_packets`` (Linux's default txqueuelen is 1000), plus netem delay/loss. Replaces any
        earlier shaping."""
        shape_links(self.links(), rate_mbit, delay_ms, loss_pct, queue_packets, self.mtu)
        self.shaping = {"rate_mbit": rate_mbit, "delay_ms": delay_ms, "loss_pct": loss_pct, "queue_packets": int(queue_packets)}

    def set_congestion_control(self, name: str) -> str:
        """TCP congestion control of every peer namespace. ``auto``: cubic (Linux's default) when the
        host allows it, else reno; ``inherit``: leave what the namespace got. Returns the one in use."""
        allowed = sh(["ip", "netns", "exec", self.ns(0), "sysctl", "-n", "net.ipv4.tcp_allowed_congestion_control"],
                     check=False).stdout.split()
        if name == "auto":
            name = "cubic" if "cubic" in allowed else "reno"
        for rank in range(self.peers):
            # Every connection starts fresh: no ssthresh / RTT remembered from an earlier run's connections.
            sh(["ip", "netns", "exec", self.ns(rank), "sysctl", "-w", "net.ipv4.tcp_no_metrics_save=1"], check=False)
        if name != "inherit":
            for rank in range(self.peers):
                proc = sh(["ip", "netns", "exec", self.ns(rank), "sysctl", "-w", f"net.ipv4.tcp_congestion_control={name}"],
                          check=False)
                if proc.returncode != 0:
                    raise Unavailable(f"cannot use TCP congestion control {name!r} in the namespaces (allowed here: "
                                      f"{' '.join(allowed) or '?'}): {proc.stderr.strip()}")
        return sh(["ip", "netns", "exec", self.ns(0), "sysctl", "-n", "net.ipv4.tcp_congestion_control"]).stdout.strip()

    def flush_tcp_metrics(self) -> None:
        """Forget what TCP learnt about each destination (before each run, so runs do not depend on their order)."""
        for rank in range(self.peers):
            sh(["ip", "-n", self.ns(rank), "tcp_metrics", "flush", "all"], check=False)

    def qdisc_text(self, rank: int = 0) -> str:
        """``tc qdisc show`` and ``tc class show`` of peer ``rank``'s two directions, for the record."""
        parts = []
        for label, ns, dev in (("upload", self.ns(rank), "eth0"), ("download", self.switch, f"p{rank}")):
            qdisc = sh(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout.strip()
            cls = sh(["tc", "-n", ns, "class", "show", "dev", dev]).stdout.strip()
            parts.append(f"{label} ({ns} {dev}):\n{qdisc}\n{cls}")
        return "\n".join(parts)

    def destroy(self) -> list[str]:
        """Remove everything with this prefix (idempotent)."""
        self.built = False
        return remove_namespaces(self.prefix)


# ---------------------------------------------------------------------------------------
# Processes


class Group:
    """Child processes in their own sessions; ``stop()`` always leaves none running."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []

    def start(self, cmd: list[str], log_name: str, env: dict[str, str]) -> subprocess.Popen:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        log = (self.out_dir / log_name).open("w")
        self._logs.append(log)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait(self, timeout_s: float, procs: list[subprocess.Popen] | None = None) -> list[int | None]:
        """Exit codes once all of ``procs`` (default: every child) exit; None for any still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for proc in self.procs if procs is None else procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGINT every live child's process group, wait up to ``grace_s``, then SIGKILL. Idempotent."""
        live = [p for p in self.procs if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        for log in self._logs:
            log.close()
        self._logs = []


def child_env() -> dict[str, str]:
    """Children: unbuffered output, one math thread each (M peers share the machine's cores)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------
# Probes of the link


def probe_tcp(net: Network, out_dir: Path, seconds: float) -> dict:
    """One raw TCP stream from peer 0 to peer 1: its goodput."""
    group = Group(out_dir)
    result_path = out_dir / "tcp.json"
    result_path.unlink(missing_ok=True)
    probe = [sys.executable, str(SELF), "probe"]
    try:
        group.start([*net.exec_prefix(1), *probe, "tcp-server", "--host", net.address(1),
                     "--port", str(TCP_PORT), "--out", str(result_path), "--timeout-s", "60"], "tcp-server.log", child_env())
        group.start([*net.exec_prefix(0), *probe, "tcp-client", "--host", net.address(1),
                     "--port", str(TCP_PORT), "--seconds", str(seconds), "--timeout-s", "60"], "tcp-client.log", child_env())
        codes = group.wait(seconds + 90)
    finally:
        group.stop()
    if codes != [0, 0] or not result_path.exists():
        raise RuntimeError(f"TCP probe failed (exit codes {codes}):\n{tail(out_dir / 'tcp-server.log')}\n{tail(out_dir / 'tcp-client.log')}")
    return json.loads(result_path.read_text())


SECURITIES = ("plain", "curve")
"""Transports the ring probe can time: ``plain`` (``ZmqExchange(trust=None)``, plaintext, kept for
benchmarks) and ``curve`` (``trust=Trust.static(swarm key, rank, M)``: CurveZMQ, what ``gossiploco
peer`` always runs)."""


def probe_ring(net: Network, out_dir: Path, numel: int, repeats: int, timeout_s: float, chunk_mb: float = 4.0,
               security: Sequence[str] = ("plain",)) -> dict:
    """The project's ring all-reduce of ``numel`` fp32 among all peers, ``repeats`` times per transport in
    ``security`` (``SECURITIES``). With several, every probe process holds one exchange per transport
    (ports RING_PORT, RING_PORT + 1) and times them alternately, repeat by repeat (the order swaps each
    repeat), so load and link state affect both alike. ``durations_s``: the first transport's."""
    security = list(security)
    group = Group(out_dir)
    paths = [out_dir / f"ring-{r}.json" for r in range(net.peers)]
    key = ["--swarm-key", str(run_swarm_key(out_dir))] if "curve" in security else []
    try:
        for r, path in enumerate(paths):
            path.unlink(missing_ok=True)
            group.start([*net.exec_prefix(r), sys.executable, str(SELF), "probe", "ring", "--rank", str(r),
                         "--hosts", ",".join(net.address(q) for q in range(net.peers)), "--port", str(RING_PORT),
                         "--numel", str(numel), "--repeats", str(repeats), "--timeout-s", str(timeout_s),
                         "--chunk-mb", str(chunk_mb), "--security", ",".join(security), *key, "--out", str(path)],
                        f"ring-{r}.log", child_env())
        codes = group.wait(timeout_s * (len(security) * repeats + 2) + 60)
    finally:
        group.stop()
    if any(c != 0 for c in codes) or not all(p.exists() for p in paths):
        logs = "\n".join(tail(out_dir / f"ring-{r}.log", 5) for r in range(net.peers))
        raise RuntimeError(f"ring probe failed (exit codes {codes}):\n{logs}")
    sides = [json.loads(p.read_text()) for p in paths]
    by: dict[str, dict] = {}
    for mode in security:
        per_rank = [side["seconds_by_security"][mode] for side in sides]
        # One collective's duration: the slowest rank of that repeat (all ranks started after a barrier).
        by[mode] = {"seconds_per_rank": per_rank, "durations_s": [max(rank[k] for rank in per_rank) for k in range(repeats)],
                    # CPU seconds of one all-reduce, median over ranks and repeats (the probe process, all threads).
                    "cpu_s": statistics.median(c for side in sides for c in side.get("cpu_s_by_security", {}).get(mode, []))
                    if all(side.get("cpu_s_by_security") for side in sides) else None}
    first = by[security[0]]
    return {"numel": numel, "payload_bytes": 4 * numel, "seconds_per_rank": first["seconds_per_rank"],
            "durations_s": first["durations_s"], "security": security, "by_security": by}


def probe_swap(net: Network, out_dir: Path, mb: float, chunk_mb: float, heartbeat_s: float = 0.0,
               timeout_s: float = 120.0) -> dict:
    """The heartbeat check: peers 0 and 1 swap ``mb`` MB with ``ZmqExchange.swap`` in ``chunk_mb`` MiB
    chunks, with heartbeat timeout ``heartbeat_s`` (0: the runtime's). A failed swap is a result, not
    an error: ``{"ok": False, "error": ...}``; an error is a probe that did not report at all."""
    group = Group(out_dir)
    peers = f"tcp://{net.address(0)}:{SWAP_PORT},tcp://{net.address(1)}:{SWAP_PORT}"
    paths = [out_dir / f"swap-{r}.json" for r in range(2)]
    try:
        for r, path in enumerate(paths):
            path.unlink(missing_ok=True)
            group.start([*net.exec_prefix(r), sys.executable, str(SELF), "probe", "swap", "--rank", str(r), "--peers", peers,
                         "--mb", str(mb), "--chunk-mb", str(chunk_mb), "--heartbeat-s", str(heartbeat_s),
                         "--timeout-s", str(timeout_s), "--out", str(path)], f"swap-{r}.log", child_env())
        codes = group.wait(2 * timeout_s + 60)
    finally:
        group.stop()
    if any(c != 0 for c in codes) or not all(p.exists() for p in paths):
        logs = "\n".join(tail(out_dir / f"swap-{r}.log", 5) for r in range(2))
        raise RuntimeError(f"swap probe failed (exit codes {codes}):\n{logs}")
    sides = [json.loads(p.read_text()) for p in paths]
    return {"mb": mb, "chunk_mb": chunk_mb, "heartbeat_s": sides[0]["heartbeat_s"], "ok": all(s["ok"] for s in sides),
            "seconds": max(s.get("seconds") or 0.0 for s in sides), "sides": sides}


def ring_rate_mbps(payload_bytes: float, workers: int, seconds: float) -> float:
    """Effective per-link rate of a ring all-reduce: ``2 (M-1)/M * payload * 8 / seconds`` in Mbit/s."""
    return 2 * (workers - 1) / workers * payload_bytes * 8 / seconds / 1e6


# ---------------------------------------------------------------------------------------
# Presets


@dataclass
class Plan:
    """One preset at one bandwidth: its config overrides and the simulator's prediction."""

    preset: str
    bandwidth_mbps: float
    overrides: dict
    cfg: Any
    prediction: dict


def preset_overrides(preset: str, args: argparse.Namespace) -> dict:
    """The ``--set`` overrides of one preset's peers (also what the prediction loads)."""
    from gossiploco.config import load_config

    sync = load_config(preset).mode == "sync-dp"
    overrides: dict[str, Any] = {
        "model.size": args.model,
        "workers": args.workers,
        "inner_steps": args.sync_dp_inner_steps if sync else args.inner_steps,
        "rounds": args.sync_dp_rounds if sync else args.rounds,
        "seed": 0,
        "device": "cpu",
        "data.seq_len": args.seq_len,
        "data.batch_size": args.batch_size,
        "data.heldout_batch_size": 2,
        "data.val_batches": 1,
        "data.max_corpus_mb": 2.0,
        "inner.warmup_steps": 1,
        "monitor.enabled": False,
        "timeouts.exchange_s": args.exchange_timeout_s,
        "timeouts.startup_s": 120.0,
        "transport.chunk_mb": args.chunk_mb,
    }
    from gossiploco.cli_options import parse_sets

    overrides.update(parse_sets(args.sets))  # e.g. mix1.compression=4bit: the peers run it, the prediction loads it
    if not args.real_compute:
        overrides["inner.synthetic_step_s"] = args.step_time
    if load_config(preset).mix2.mode == "adaptive":
        # Adaptive Mix2 is driven by the monitors: one consensus measurement per round, at h = 0.
        overrides.update({"monitor.enabled": True, "monitor.every": 0, "monitor.val_loss": False})
    return overrides


def predict(cfg: Any, bandwidth_mbps: float, step_time_s: float) -> dict:
    """``gossiploco utilization`` for ``cfg``: real parameter count and block fractions of its model."""
    from gossiploco import utilization as util

    vocab = util.default_vocab_size(cfg)
    plan = util.comm_plan(cfg, vocab, with_monitors=True)  # what the peers run, monitors included
    sc = util.resolve_scenario(cfg, bandwidth_mbps=bandwidth_mbps, vocab_size=vocab, step_time_s=step_time_s)
    return util.report(plan, sc, util.simulate(plan, sc))


def make_plan(preset: str, bandwidth_mbps: float, args: argparse.Namespace) -> Plan:
    from gossiploco.config import load_config

    overrides = preset_overrides(preset, args)
    cfg = load_config(preset, overrides)
    return Plan(preset, bandwidth_mbps, overrides, cfg, predict(cfg, bandwidth_mbps, args.step_time))


def run_swarm_key(out_dir: Path) -> Path:
    """A fresh swarm key for one run, ``out_dir/swarm.key`` (peers are always encrypted; the bootstrap
    node reads the same file instead of writing ``swarm.key`` into the current directory)."""
    from gossiploco.security.swarm_key import SwarmKey

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "swarm.key"
    path.unlink(missing_ok=True)  # an earlier run's, in a reused --out
    return SwarmKey.generate().save(path)


def peer_command(net: Network, plan: Plan, rank: int, port: int, out_dir: Path, heartbeat_s: float = 0.0,
                 join: str | None = None) -> list[str]:
    """``ip netns exec PREFIX-pI python -m gossiploco peer ...``: found through the DHT at ``join``, else
    through the static list of every peer's address. Every peer uses the run's swarm key
    (``out_dir/swarm.key``, from ``run_swarm_key``); a DHT peer keeps its identity in
    ``out_dir/peer-I/identity.key`` (made by ``ordered_identities``: peer ids increase with the rank)."""
    key = ["--swarm-key", str(out_dir / "swarm.key")]
    if join:
        where = ["--join", join, "--host", net.address(rank), "--port", str(port), "--workers", str(net.peers),
                 "--identity", str(out_dir / f"peer-{rank}" / "identity.key"), *key]
    else:
        where = ["--peers", ",".join(f"tcp://{net.address(r)}:{port}" for r in range(net.peers)), *key]
    sets = []
    for key, value in plan.overrides.items():
        if key != "workers":  # the world size comes from --peers, or --workers with --join
            sets += ["--set", f"{key}={json.dumps(value)}"]
    if heartbeat_s:
        sets += ["--set", f"timeouts.heartbeat_s={heartbeat_s}"]
    return [*net.exec_prefix(rank), sys.executable, "-m", "gossiploco", "peer", "--config", plan.preset,
            "--rank", str(rank), *where, "--out", str(out_dir / f"peer-{rank}"), "--quiet", *sets]


def start_bootstrap(net: Network, group: Group, port: int, timeout_s: float = 60.0) -> str:
    """``gossiploco dht`` in peer 0's namespace with the run's swarm key (``group.out_dir/swarm.key``);
    returns the multiaddr it prints for ``--join``."""
    proc = group.start([*net.exec_prefix(0), sys.executable, "-m", "gossiploco", "dht", "--host", net.address(0),
                        "--port", str(port), "--swarm-key", str(group.out_dir / "swarm.key")], "bootstrap.log", child_env())
    log = group.out_dir / "bootstrap.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text(errors="replace").splitlines():
            if "--join " in line:
                return line.split("--join ", 1)[1].split()[0]
        time.sleep(0.2)
    raise RuntimeError(f"the bootstrap node did not print its address within {timeout_s:.0f}s:\n{tail(log)}")


def read_peer(out_dir: Path, rank: int) -> dict:
    """One peer's summary plus the per-round fields of its last record (the last round's Mix timings)."""
    peer_dir = out_dir / f"peer-{rank}"
    summary = json.loads((peer_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (peer_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = records[-1] if records else {}
    rounds = summary["rounds"]
    # The final record's monitor_s is the final measurement (after the rounds): not round time.
    monitor_rounds = summary.get("total_monitor_s", 0.0) - last.get("monitor_s", 0.0)
    blocking = {
        "mix1_wait_s": summary.get("total_mix1_wait_s", 0.0),
        "mix2_s": summary.get("total_mix2_s", 0.0),
        "grad_s": summary.get("total_grad_s", 0.0),
        "monitor_s": monitor_rounds,
    }
    other = summary["total_rounds_s"] - summary["total_compute_s"] - sum(blocking.values())
    return {
        "rank": rank,
        "round_utilization": summary["round_utilization"],
        "compute_s": summary["total_compute_s"],
        "rounds_s": summary["total_rounds_s"],
        **blocking,
        "other_s": other,
        "per_round_s": summary["total_rounds_s"] / rounds,
        "last_round": {k: last.get(k) for k in ("mix1_s", "mix1_wait_s", "mix2_s", "outer_s", "mix1_bytes", "mix2_bytes")},
        "failures": {k: summary.get(k, 0) for k in ("mix1_failures", "mix2_failures", "grad_failures", "monitor_failures")},
        "bytes_sent": summary.get("bytes_sent"),
    }


def link_busy(path: Path, rate_mbit: float) -> dict | None:
    """From ``links.jsonl`` (switch port counters): how busy the links were while the run moved data.

    The window runs from the first to the last sample interval in which any port carried more than
    10% of the rate (start-up and the idle tail are left out). ``busy_pct``: bytes that crossed all
    2M directions / (2M x rate x window); ``per_direction``: the same per port and direction."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return None
    devs = sorted(k for k in rows[0] if k != "t") if rows else []
    if len(rows) < 3 or not devs:
        return None
    bytes_per_s = rate_mbit * 1e6 / 8
    active = [i for i in range(1, len(rows))
              if any(rows[i][d][k] - rows[i - 1][d][k] > 0.1 * bytes_per_s * (rows[i]["t"] - rows[i - 1]["t"])
                     for d in devs for k in (0, 1))]
    if not active:
        return None
    first, last = rows[active[0] - 1], rows[active[-1]]
    window = last["t"] - first["t"]
    per = {f"{d}.{'up' if k == 0 else 'down'}": 100 * (last[d][k] - first[d][k]) / (bytes_per_s * window)
           for d in devs for k in (0, 1)}
    return {"window_s": window, "busy_pct": statistics.mean(per.values()), "per_direction": per}


def run_plan(net: Network, plan: Plan, args: argparse.Namespace, out_dir: Path, port: int,
             goodput_mbps: float | None = None) -> dict:
    """M peers of ``plan`` on the shaped network; their measurements and the comparison."""
    net.flush_tcp_metrics()
    group = Group(out_dir)
    timeout_s = args.startup_allowance_s + 3.0 * plan.prediction["wall_s"] * plan.cfg.rounds
    start = time.monotonic()
    sampler = Group(out_dir)
    try:
        if args.sample_links:
            sampler.start([*net.exec_prefix_switch(), sys.executable, str(SELF), "probe", "sample",
                           "--interval-s", str(args.sample_links), "--seconds", str(timeout_s + 30),
                           "--out", str(out_dir / "links.jsonl")], "sampler.log", child_env())
        run_swarm_key(out_dir)
        if args.discovery == "dht":
            from gossiploco.security.options import ordered_identities

            ordered_identities(net.peers, out_dir)  # out_dir/peer-I/identity.key, peer ids in rank order
        join = start_bootstrap(net, group, port + 1) if args.discovery == "dht" else None  # stopped with the group
        peers = [group.start(peer_command(net, plan, rank, port, out_dir, args.heartbeat_timeout_s, join),
                             f"peer-{rank}.log", child_env()) for rank in range(net.peers)]
        codes = group.wait(timeout_s, peers)
    finally:
        group.stop()
        sampler.stop(grace_s=2)
    wall = time.monotonic() - start
    result: dict[str, Any] = {"preset": plan.preset, "bandwidth_mbps": plan.bandwidth_mbps, "exit_codes": codes,
                              "wall_s": wall, "overrides": plan.overrides, "out": str(out_dir)}
    if any(c != 0 for c in codes):
        bad = [r for r, c in enumerate(codes) if c != 0]
        result["error"] = (f"peers {bad} " + ("timed out" if None in codes else "failed") + f" (exit codes {codes}); "
                           f"log of peer {bad[0]}:\n{tail(out_dir / f'peer-{bad[0]}.log')}")
        return result
    peers = [read_peer(out_dir, r) for r in range(net.peers)]
    steps = plan.cfg.inner_steps * plan.cfg.rounds
    step_time = statistics.median(p["compute_s"] / steps for p in peers) if args.real_compute else args.step_time
    prediction = predict(plan.cfg, plan.bandwidth_mbps, step_time) if args.real_compute else plan.prediction
    utils = [100 * p["round_utilization"] for p in peers]
    predicted = 100 * prediction["compute_utilization"]
    measured = statistics.median(utils)
    result.update({
        "step_time_s": step_time,
        "predicted_pct": predicted,
        "measured_median_pct": measured,
        "measured_min_pct": min(utils),
        "measured_max_pct": max(utils),
        "diff_pts": measured - predicted,
        "pass": abs(measured - predicted) <= args.tolerance,
        "prediction": prediction,
        # Not the prediction: the simulator fed with what one TCP flow measurably gets out of the link
        # (payload rate, Ethernet/IP/TCP headers excluded), to separate framing from everything else.
        "predicted_at_goodput_pct": (100 * predict(plan.cfg, goodput_mbps, step_time)["compute_utilization"]
                                     if goodput_mbps else None),
        # Measured, with the seconds the peers spent in consensus monitors taken out of the rounds.
        "measured_without_monitor_pct": statistics.median(
            100 * p["compute_s"] / (p["rounds_s"] - p["monitor_s"]) for p in peers),
        "peers": peers,
        "failures": sum(sum(p["failures"].values()) for p in peers),
        "links": link_busy(out_dir / "links.jsonl", plan.bandwidth_mbps) if args.sample_links else None,
    })
    return result


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


# ---------------------------------------------------------------------------------------
# Probes: ``bench/netem.py probe KIND``, one process inside each namespace


def _exchange(rank: int, peers: str, run_id: str, timeout_s: float, chunk_mb: float, heartbeat_s: float | None = None,
              swarm_key: str | None = None):
    """A ``ZmqExchange`` among ``peers`` (comma-separated endpoints) with the peers' transport settings;
    plaintext, or CurveZMQ with a static list's identities when ``swarm_key`` (a key file) is given."""
    from gossiploco.config import TransportConfig
    from gossiploco.transport.zmq_exchange import ZmqExchange

    trust = None
    if swarm_key:
        from gossiploco.security.swarm_key import SwarmKey
        from gossiploco.security.trust import Trust

        trust = Trust.static(SwarmKey.load(swarm_key), rank, len(peers.split(",")))
    transport = TransportConfig(chunk_mb=chunk_mb)  # messages up to the peers' default 64 MiB
    return ZmqExchange(rank, peers.split(","), run_id, timeout_s, max_message_bytes=int(transport.max_message_mb * (1 << 20)),
                       chunk_bytes=int(transport.chunk_mb * (1 << 20)) // 4 * 4, heartbeat_s=heartbeat_s, trust=trust)


def ring_side(args: argparse.Namespace) -> int:
    """Time ``--repeats`` ring all-reduces of ``--numel`` fp32 (``ZmqExchange.all_reduce_mean``, the code
    Mix1 and DiLoCo's Mix2 run) per transport of ``--security``, each after a tiny barrier all-reduce on
    the same exchange so every peer starts together; check the mean; write the seconds per repeat to
    ``--out``. Transport i listens on ``--port`` + i; with several they alternate, the order swapping
    every repeat."""
    import torch

    torch.set_num_threads(1)
    security = [m for m in args.security.split(",") if m]
    if "curve" in security and not args.swarm_key:
        print("--security curve needs --swarm-key", file=sys.stderr)
        return 2
    hosts = args.hosts.split(",")
    members = list(range(len(hosts)))
    exchanges = {}
    seconds: dict[str, list[float]] = {mode: [] for mode in security}
    cpu: dict[str, list[float]] = {mode: [] for mode in security}  # this process's CPU seconds (all threads)
    try:
        for i, mode in enumerate(security):
            peers = ",".join(f"tcp://{h}:{args.port + i}" for h in hosts)
            exchanges[mode] = _exchange(args.rank, peers, f"netem-ring-{mode}", args.timeout_s, args.chunk_mb,
                                        swarm_key=args.swarm_key if mode == "curve" else None)
        for mode, ex in exchanges.items():
            if not ex.wait_connected(args.timeout_s):
                print(f"rank {args.rank}: peers not connected ({mode}) after {args.timeout_s}s", file=sys.stderr)
                return 1
        flat = torch.full((args.numel,), float(args.rank + 1))
        expected = sum(r + 1 for r in members) / len(members)
        tiny = torch.zeros(1)
        for k in range(args.repeats):
            for mode in (security if k % 2 == 0 else security[::-1]):
                ex = exchanges[mode]
                ex.all_reduce_mean(f"barrier/{k}", tiny, members)
                start, cpu0 = time.perf_counter(), time.process_time()
                out = ex.all_reduce_mean(f"mix1/{k}", flat, members)
                seconds[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - cpu0)
                if abs(float(out[0]) - expected) > 1e-4 or abs(float(out[-1]) - expected) > 1e-4:
                    print(f"rank {args.rank}: wrong all-reduce result ({mode}) {float(out[0])} != {expected}", file=sys.stderr)
                    return 1
        for ex in exchanges.values():
            ex.all_reduce_mean("barrier/end", tiny, members)
    finally:
        for ex in exchanges.values():
            ex.close(linger_s=0.5)
    Path(args.out).write_text(json.dumps({"rank": args.rank, "numel": args.numel, "workers": len(members),
                                          "seconds": seconds[security[0]], "seconds_by_security": seconds,
                                          "cpu_s_by_security": cpu}))
    return 0


def swap_side(args: argparse.Namespace) -> int:
    """One side of the heartbeat check: swap ``--mb`` MB with the other rank; write whether it worked
    (and how long it took, or why it failed) to ``--out``. Exit 0 either way: a failed swap is the
    measurement; only a probe that cannot report exits non-zero."""
    import torch

    from gossiploco.config import TimeoutConfig
    from gossiploco.errors import ExchangeError

    torch.set_num_threads(1)
    heartbeat_s = args.heartbeat_s or TimeoutConfig().heartbeat_s  # 0: what a peer runs with by default
    ex = _exchange(args.rank, args.peers, "netem-swap", args.timeout_s, args.chunk_mb, heartbeat_s)
    out: dict[str, Any] = {"rank": args.rank, "heartbeat_s": heartbeat_s, "chunk_mb": args.chunk_mb, "mb": args.mb}
    try:
        if not ex.wait_connected(args.timeout_s):
            out.update(ok=False, error=f"peers not connected after {args.timeout_s}s")
        else:
            start = time.perf_counter()
            try:
                ex.swap("mix2/0", 1 - args.rank, torch.ones(int(args.mb * 1e6 / 4)))
                out.update(ok=True, seconds=round(time.perf_counter() - start, 2))
            except ExchangeError as exc:
                out.update(ok=False, seconds=round(time.perf_counter() - start, 2), error=f"{type(exc).__name__}: {exc}")
            # A swap returns once the partner's data is in: wait until the partner has ours too before
            # closing. After a failed swap this barrier may fail too (at once, or at --timeout-s): the
            # result is already known.
            with contextlib.suppress(ExchangeError):
                ex.all_reduce_mean("done", torch.zeros(1), [0, 1])
    finally:
        ex.close(linger_s=1.0)
    Path(args.out).write_text(json.dumps(out))
    return 0


def tcp_server(args: argparse.Namespace) -> int:
    """Accept one TCP stream, count what arrives until the sender closes; write the goodput to ``--out``."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((args.host, args.port))
    srv.listen(1)
    srv.settimeout(args.timeout_s)
    conn, _ = srv.accept()
    conn.settimeout(args.timeout_s)
    received, first, last = 0, None, None
    with conn, srv:
        while True:
            data = conn.recv(1 << 20)
            if not data:
                break
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                received += len(data)  # bytes after the first read, over the time after it
            last = now
    if first is None or last is None or last <= first:
        print("tcp-server: nothing received", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps({"bytes": received, "seconds": last - first,
                                          "mbps": received * 8 / (last - first) / 1e6}))
    return 0


def tcp_client(args: argparse.Namespace) -> int:
    """Send zeros to the server as fast as TCP takes them for ``--seconds``."""
    deadline = time.monotonic() + args.timeout_s
    while True:  # the server may not listen yet
        try:
            conn = socket.create_connection((args.host, args.port), timeout=2.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    buf = b"\0" * (1 << 16)
    conn.settimeout(args.timeout_s)
    start = time.monotonic()
    with conn:
        while time.monotonic() - start < args.seconds:
            conn.sendall(buf)
        conn.shutdown(socket.SHUT_WR)  # the server's byte count ends when the queued data has arrived
        conn.recv(1)
    return 0


def sample_links(args: argparse.Namespace) -> int:
    """Every ``--interval-s``, the byte counters of every interface of this namespace (the switch's
    veths: rx = what the peer sent, tx = what it received), one JSON line per sample, until killed."""
    net = Path("/sys/class/net")
    devs = sorted(d.name for d in net.iterdir() if d.name not in ("lo", "br0"))
    with open(args.out, "w") as out:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            row: dict[str, Any] = {"t": time.time()}
            for dev in devs:
                stats = net / dev / "statistics"
                row[dev] = [int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())]
            out.write(json.dumps(row) + "\n")
            out.flush()
            time.sleep(args.interval_s)
    return 0


def probe_main(argv: Sequence[str]) -> int:
    """``bench/netem.py probe KIND ...``: one probe process (the benchmark starts them in the namespaces)."""
    parser = argparse.ArgumentParser(prog="bench/netem.py probe", description="One link probe, run inside a "
                                     "namespace of bench/netem.py's network (the benchmark starts these itself).")
    sub = parser.add_subparsers(dest="kind", required=True)
    p = sub.add_parser("ring", help="time the project's ring all-reduce among all peers")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--hosts", required=True, help="Comma-separated addresses of every peer, in rank order.")
    p.add_argument("--port", type=int, default=RING_PORT, help="Port of the first transport of --security (the next: +1).")
    p.add_argument("--security", default="plain", help="Comma-separated transports to time, alternately: plain "
                   "(trust=None) and/or curve (CurveZMQ, Trust.static from --swarm-key).")
    p.add_argument("--swarm-key", help="Swarm key file (curve): the static identities derive from it.")
    p.add_argument("--numel", type=int, required=True, help="fp32 values to all-reduce.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-mb", type=float, default=4.0, help="transport.chunk_mb (every peer's must match).")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("swap", help="the heartbeat check: swap a payload between rank 0 and rank 1")
    p.add_argument("--rank", type=int, choices=(0, 1), required=True)
    p.add_argument("--peers", required=True, help="The two endpoints, tcp://HOST:PORT,tcp://HOST:PORT.")
    p.add_argument("--mb", type=float, default=8.0, help="Payload of the swap, MB.")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="transport.chunk_mb (both sides' must match).")
    p.add_argument("--heartbeat-s", type=float, default=0.0, help="Heartbeat timeout (0: the runtime's default).")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("tcp-server", help="receive one raw TCP stream, write its goodput")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=TCP_PORT)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("tcp-client", help="send one raw TCP stream")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=TCP_PORT)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p = sub.add_parser("sample", help="this namespace's byte counters at an interval (JSON lines)")
    p.add_argument("--interval-s", type=float, default=0.1)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    return {"ring": ring_side, "swap": swap_side, "tcp-server": tcp_server, "tcp-client": tcp_client,
            "sample": sample_links}[args.kind](args)


# ---------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Real gossiploco peers on tc-shaped links in network namespaces: "
                                     "measured compute utilization against the simulator.",
                                     epilog="`bench/netem.py probe KIND --help`: the link probes it runs inside the "
                                     "namespaces (ring, swap, tcp-server, tcp-client, sample).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--presets", default="all", help="Comma-separated preset names, 'all' (every file in peers/) or "
                        "'none' (only the link probes).")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="A config override for every preset's peers and its prediction (e.g. mix1.compression=4bit).")
    parser.add_argument("--bandwidths", default="16,60", help="Link rates in Mbit/s (each direction, per peer), comma-separated.")
    parser.add_argument("--workers", type=int, default=4, help="Peers M (one namespace each).")
    parser.add_argument("--model", default="small", help="Model size (payload: its real parameter count, fp32).")
    parser.add_argument("--step-time", type=float, default=0.3, help="Seconds of one synthetic inner step T.")
    parser.add_argument("--inner-steps", type=int, default=10, help="Inner steps H per round.")
    parser.add_argument("--rounds", type=int, default=4, help="Rounds R per run.")
    parser.add_argument("--sync-dp-inner-steps", type=int, default=5, help="sync-dp: steps per 'round' (its utilization does not depend on H).")
    parser.add_argument("--sync-dp-rounds", type=int, default=2, help="sync-dp: rounds.")
    parser.add_argument("--real-compute", action="store_true", help="Real inner steps of the model instead of sleeps; T is then measured.")
    parser.add_argument("--seq-len", type=int, default=64, help="Tokens per sequence (real compute).")
    parser.add_argument("--batch-size", type=int, default=4, help="Sequences per inner step (real compute).")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="netem delay on each direction of each link.")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="netem loss on each direction of each link.")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--queue-packets", type=int, default=1000,
                        help="FIFO length of each shaped direction, in packets (1000: Linux's default txqueuelen). "
                             "Short queues drop more and make TCP (Reno) flows stall and share unevenly.")
    parser.add_argument("--congestion-control", default="auto",
                        help="TCP congestion control in the peer namespaces: auto (cubic if the host allows it, else reno), "
                             "inherit (the host's default), or a name (reno, cubic, bbr).")
    parser.add_argument("--sample-links", type=float, default=0.0, metavar="SECONDS",
                        help="Record every switch port's byte counters at this interval during each run (links.jsonl; 0: off).")
    parser.add_argument("--tolerance", type=float, default=5.0, help="Points of utilization a median may differ from the prediction.")
    parser.add_argument("--ring-repeats", type=int, default=3, help="Ring all-reduce probes per bandwidth (0: skip).")
    parser.add_argument("--ring-security", type=lambda t: [m.strip() for m in t.split(",") if m.strip()],
                        default=["plain"], metavar="plain[,curve]",
                        help="Transports the ring probe times: plain (ZmqExchange with trust=None) and/or curve "
                             "(CurveZMQ with Trust.static, what `gossiploco peer` runs); with both they alternate repeat "
                             "by repeat in the same processes and the table compares them. The main table's ring "
                             "column is the first one's.")
    parser.add_argument("--tcp-seconds", type=float, default=3.0, help="Raw TCP probe length per bandwidth (0: skip).")
    parser.add_argument("--swap-mb", type=float, default=0.0,
                        help="Heartbeat check per bandwidth: peers 0 and 1 swap this many MB in --chunk-mb chunks with "
                             "the peers' heartbeat timeout (--heartbeat-timeout-s, else the runtime's); 0: skip.")
    parser.add_argument("--chunk-mb", type=float, default=4.0,
                        help="transport.chunk_mb of the peers and the ring probe (the runtime's default). With the "
                             "runtime's 5 s heartbeat, a chunk that takes longer than 5 s on the wire drops the connection "
                             "(4 MiB: below 6.7 Mbit/s per flow).")
    parser.add_argument("--discovery", choices=("dht", "static"), default="dht",
                        help="How the peers find each other: a bootstrap DHT node in peer 0's namespace (--join), "
                             "or a static --peers list.")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=0.0,
                        help="Run the peers with timeouts.heartbeat_s set to this instead of the runtime's 5 s "
                             "(0: unchanged). libzmq counts only whole messages, so on a slow, congested link the "
                             "5 s timeout can drop healthy connections.")
    parser.add_argument("--exchange-timeout-s", type=float, default=120.0, help="timeouts.exchange_s of the peers.")
    parser.add_argument("--startup-allowance-s", type=float, default=240.0, help="Added to 3x the predicted run time for a run's deadline.")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Name prefix of the namespaces this run makes (and cleans).")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "netem", help="Output directory (results.json, table.md, per-run logs).")
    parser.add_argument("--predict-only", action="store_true", help="Print the plans and predictions; run nothing (no root needed).")
    parser.add_argument("--cleanup", action="store_true", help="Only remove leftovers of an earlier run with --prefix.")
    parser.add_argument("--report", type=Path, metavar="RESULTS_JSON", help="Only rewrite the tables of an earlier run's results.json (no root needed).")
    parser.add_argument("--strict", action="store_true", help="Exit 1 when a row misses the tolerance or the ring rate is under 90%% of B.")
    return parser.parse_args(argv)


def presets_of(text: str) -> list[str]:
    from gossiploco.config import preset_names

    names = preset_names()
    if text == "all":
        return names
    if text == "none":
        return []
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in names]
    if unknown:
        raise SystemExit(f"error: unknown presets {unknown}; choose from {names}")
    return chosen


def machine_info() -> dict:
    import platform

    info = {"kernel": platform.release(), "python": platform.python_version(), "cpus": os.cpu_count()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        info["loadavg_start"] = Path("/proc/loadavg").read_text().split()[:3]
    info["ip"] = sh(["ip", "-V"], check=False).stdout.strip() if shutil.which("ip") else None
    return info


class _Stop(KeyboardInterrupt):
    """A signal asked us to stop (SIGINT, SIGTERM, SIGHUP)."""


def _on_signal(signum: int, frame: Any) -> None:
    raise _Stop(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["probe"]:
        return probe_main(argv[1:])
    args = parse_args(argv)
    if not PREFIX_RE.match(args.prefix):
        print(f"error: --prefix must match {PREFIX_RE.pattern}, got {args.prefix!r}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    bandwidths = [float(b) for b in args.bandwidths.split(",") if b.strip()]
    presets = presets_of(args.presets)
    if not args.ring_security or any(m not in SECURITIES for m in args.ring_security):
        print(f"error: --ring-security takes a comma-separated list of {', '.join(SECURITIES)}", file=sys.stderr)
        return 1

    if args.report:
        table = markdown(json.loads(args.report.read_text()))
        (args.report.parent / "table.md").write_text(table + "\n")
        print(table)
        return 0

    if args.predict_only:
        for b in bandwidths:
            for preset in presets:
                plan = make_plan(preset, b, args)
                p = plan.prediction
                print(f"{preset:24s} {b:6g} Mbit/s  predicted {100 * p['compute_utilization']:5.1f}%  "
                      f"round {p['wall_s']:.2f} s (compute {p['compute_s']:.2f}, mix1 {p['mix1_attempt_s']:.2f}, "
                      f"mix2 {p['mix2_attempt_s']:.2f}, x{plan.cfg.rounds} rounds)")
        return 0

    if args.workers < 2 and not args.cleanup and (args.swap_mb > 0 or args.tcp_seconds > 0):
        print("error: the TCP probe and --swap-mb need --workers 2 or more (they run between peers 0 and 1)", file=sys.stderr)
        return 1
    problem = preflight()
    if problem:
        print(f"bench/netem.py cannot run here: {problem}", file=sys.stderr)
        return EXIT_UNAVAILABLE

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s in previous:
        signal.signal(s, _on_signal)
    net: Network | None = None
    try:
        with prefix_lock(args.prefix):
            leftovers = remove_namespaces(args.prefix)
            if leftovers:
                print(f"removed leftovers of an earlier run: {', '.join(leftovers)}")
            if args.cleanup:
                return 0
            net = Network(args.prefix, args.workers, args.mtu)
            try:
                return run_all(net, args, presets, bandwidths)
            finally:
                # No second Ctrl+C may interrupt the clean-up.
                for s in previous:
                    signal.signal(s, signal.SIG_IGN)
                removed = net.destroy()
                print(f"removed namespaces: {', '.join(removed) if removed else 'none left'}")
    except Unavailable as exc:
        print(f"bench/netem.py cannot run here: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except RuntimeError as exc:  # a command of the set-up failed: already cleaned up
        print(f"bench/netem.py: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'SIGINT'}); peers stopped, namespaces removed", file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_all(net: Network, args: argparse.Namespace, presets: list[str], bandwidths: list[float]) -> int:
    from gossiploco.utilization import block_sizes, default_vocab_size

    args.out.mkdir(parents=True, exist_ok=True)
    net.build()
    results: dict[str, Any] = {"machine": machine_info(), "argv": sys.argv, "args": {k: str(v) for k, v in vars(args).items()},
                               "links": [], "runs": []}
    results["machine"]["tcp_congestion_control"] = net.set_congestion_control(args.congestion_control)
    print(f"{net.peers} peer namespaces {net.ns(0)}..{net.ns(net.peers - 1)} on bridge {net.switch}/br0, "
          f"TCP congestion control {results['machine']['tcp_congestion_control']}", flush=True)
    path = args.out / "results.json"
    broken = False
    port = PEER_PORT
    for b in bandwidths:
        net.shape(b, args.delay_ms, args.loss_pct, args.queue_packets)
        link: dict[str, Any] = {"bandwidth_mbps": b, "tc": net.qdisc_text(0)}
        results["links"].append(link)
        link_dir = args.out / f"link-{b:g}mbit"
        if args.tcp_seconds > 0:
            link["tcp"] = probe_tcp(net, link_dir, args.tcp_seconds)
            print(f"[{b:g} Mbit/s] raw TCP p0->p1: {link['tcp']['mbps']:.2f} Mbit/s ({100 * link['tcp']['mbps'] / b:.1f}% of B)", flush=True)
        if args.ring_repeats > 0:
            from gossiploco.config import load_config

            cfg = load_config("globalm1", {"model.size": args.model})
            numel = sum(block_sizes(cfg.model.size, default_vocab_size(cfg)).values())
            link["ring"] = probe_ring(net, link_dir, numel, args.ring_repeats, args.exchange_timeout_s, chunk_mb=args.chunk_mb,
                                      security=args.ring_security)
            for mode, by in link["ring"]["by_security"].items():
                by["median_s"] = statistics.median(by["durations_s"])
                by["mbps"] = ring_rate_mbps(4 * numel, net.peers, by["median_s"])
                print(f"[{b:g} Mbit/s] ring all-reduce ({mode}) of {4 * numel / 1e6:.2f} MB among {net.peers}: "
                      f"{by['median_s']:.3f} s = {by['mbps']:.2f} Mbit/s ({100 * by['mbps'] / b:.1f}% of B)", flush=True)
            link["ring_mbps"] = link["ring"]["by_security"][args.ring_security[0]]["mbps"]
        if args.swap_mb > 0:
            link["swap"] = probe_swap(net, link_dir, args.swap_mb, args.chunk_mb, args.heartbeat_timeout_s,
                                      args.exchange_timeout_s)
            print(f"[{b:g} Mbit/s] {swap_line(link['swap'], b)}", flush=True)
        for preset in presets:
            plan = make_plan(preset, b, args)
            port += 1
            run = run_plan(net, plan, args, args.out / f"{preset}-{b:g}mbit", port, link.get("tcp", {}).get("mbps"))
            results["runs"].append(run)
            if "error" in run:
                broken = True
                print(f"[{b:g} Mbit/s] {preset}: ERROR {run['error']}", flush=True)
            else:
                print(f"[{b:g} Mbit/s] {preset:24s} predicted {run['predicted_pct']:5.1f}%  measured {run['measured_median_pct']:5.1f}% "
                      f"({run['measured_min_pct']:.1f}-{run['measured_max_pct']:.1f})  diff {run['diff_pts']:+.1f}  "
                      f"{'pass' if run['pass'] else 'MISS'}  ({run['wall_s']:.0f} s)", flush=True)
            path.write_text(json.dumps(results, indent=1, default=str))
    results["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    path.write_text(json.dumps(results, indent=1, default=str))
    table = markdown(results)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    print(f"results: {path}  table: {args.out / 'table.md'}")
    if broken:
        return 1
    missed = [r for r in results["runs"] if not r.get("pass")]
    slow = [link for link in results["links"] if link.get("ring_mbps") and link["ring_mbps"] < 0.9 * link["bandwidth_mbps"]]
    return 1 if args.strict and (missed or slow) else 0


if __name__ == "__main__":
    sys.exit(main())
