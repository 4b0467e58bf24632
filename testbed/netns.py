"""Linux network namespaces, veth pairs and bridges: build small private networks, always remove them.

Every name a tool makes starts with its prefix (``PREFIX-...``), and nothing is added to the root
namespace. ``remove_namespaces(prefix)`` kills every process inside, then deletes every namespace of a
prefix: the clean-up of every exit path, and of a crashed earlier run's leftovers at start.
``prefix_lock`` keeps two runs with one prefix apart. Every command has a deadline (``sh``).

``Star`` is the usual topology: a switch namespace ``PREFIX-sw`` holding bridges, and one namespace
``PREFIX-pI`` per rank I whose ``eth0`` is a veth whose other end is port ``pI`` of bridge ``br0``::

    namespace PREFIX-sw:  bridge br0 with ports pI (and more bridges, for partitions)
    namespace PREFIX-pI:  eth0 = ADDRESS(I)/24, veth peer of PREFIX-sw's pI

Needs root (CAP_NET_ADMIN) and ``ip`` (iproute2); ``preflight()`` says why a machine cannot.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

CMD_TIMEOUT_S = 20.0
"""Deadline of one ``ip`` / ``tc`` / ``sysctl`` command."""
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")
"""A prefix is short: interface and namespace names are built from it."""
STAR_SUFFIX = r"sw|p\d+"
"""The namespaces a ``Star`` makes, after ``PREFIX-``."""


class Unavailable(Exception):
    """This machine cannot build the network (not root, a tool missing, namespaces refused, prefix in use)."""


def sh(cmd: Sequence[str], *, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one command with a deadline (text output captured); raise RuntimeError with its stderr when
    ``check`` and it fails, and when it does not answer within ``timeout`` seconds."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{shlex.join(cmd)}: no answer after {timeout:.0f}s") from exc
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def preflight() -> str | None:
    """Why this machine cannot build namespaces with shaped links (not Linux, not root, no ``ip``/``tc``,
    ``ip netns`` refused), or None when it can."""
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


def exec_prefix(ns: str) -> list[str]:
    """The command prefix that runs a command inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns]


# -- finding and removing namespaces ------------------------------------------------------------


def list_namespaces(prefix: str, suffix: str = STAR_SUFFIX) -> list[str]:
    """The namespaces ``PREFIX-SUFFIX`` that exist now; ``suffix`` is a regular expression (default: a
    ``Star``'s)."""
    pattern = re.compile(rf"^{re.escape(prefix)}-({suffix})$")
    out = sh(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if pattern.match(n))


def namespace_pids(ns: str) -> list[int]:
    """The processes living in namespace ``ns``."""
    proc = sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def kill_namespace_processes(ns: str) -> list[int]:
    """SIGKILL every process living in namespace ``ns`` (only ever one of ours), by pid."""
    pids = namespace_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def remove_namespaces(prefix: str, suffix: str = STAR_SUFFIX) -> list[str]:
    """Kill the processes in, then delete, every namespace with ``prefix`` (and ``suffix``, as in
    ``list_namespaces``). Returns what was removed."""
    names = list_namespaces(prefix, suffix)
    for ns in names:
        kill_namespace_processes(ns)
    if names:
        time.sleep(0.3)  # let the killed processes go (a namespace lives while a process is in it)
    for ns in names:
        sh(["ip", "netns", "del", ns], check=False)
    return names


@contextlib.contextmanager
def prefix_lock(prefix: str) -> Iterator[None]:
    """Hold ``/run/lock/gossiploco-netns-PREFIX.lock`` (or under /tmp): one run per prefix at a time, whichever
    tool it is. Raises ``Unavailable`` when another run holds it."""
    lock_dir = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    path = lock_dir / f"gossiploco-netns-{prefix}.lock"
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise Unavailable(f"another run with namespace prefix {prefix!r} is active ({path}); "
                              "wait for it or use another prefix") from None
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # still holding it: a run starting now makes a fresh file
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- building blocks -------------------------------------------------------------------------------


def add_namespace(ns: str, *, forward: bool | None = None, ipv6: bool = True) -> None:
    """Create namespace ``ns`` with loopback up (``Unavailable`` if namespaces are refused). ``forward``: set
    ``net.ipv4.ip_forward`` (a router); ``ipv6`` False disables IPv6 in it."""
    try:
        sh(["ip", "netns", "add", ns])
    except RuntimeError as exc:
        raise Unavailable(f"cannot create a network namespace: {exc}") from exc
    sysctls = [] if ipv6 else ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
    if forward is not None:
        sysctls.append(f"net.ipv4.ip_forward={int(forward)}")
    if sysctls:
        sh([*exec_prefix(ns), "sysctl", "-q", "-w", *sysctls])
    sh(["ip", "-n", ns, "link", "set", "lo", "up"])


def add_bridge(ns: str, name: str, address: str | None = None, mtu: int | None = None) -> None:
    """A bridge ``name`` in ``ns`` (no STP, no forwarding delay), up, with ``address`` (CIDR) if given."""
    try:
        sh(["ip", "-n", ns, "link", "add", name, "type", "bridge", "stp_state", "0", "forward_delay", "0"])
    except RuntimeError as exc:
        raise Unavailable(f"cannot create a bridge: {exc}") from exc
    if address:
        sh(["ip", "-n", ns, "addr", "add", address, "dev", name])
    sh(["ip", "-n", ns, "link", "set", name, *(["mtu", str(mtu)] if mtu else []), "up"])


def add_veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str, address_b: str, *, bridge: str | None = None,
             address_a: str | None = None, mtu: int | None = None) -> None:
    """A veth pair, both ends up: ``dev_a`` in ``ns_a`` (a port of ``bridge``, and/or with ``address_a``) and
    ``dev_b`` in ``ns_b`` with ``address_b`` (CIDR)."""
    mtu_args = ["mtu", str(mtu)] if mtu else []
    sh(["ip", "-n", ns_a, "link", "add", dev_a, *mtu_args, "type", "veth", "peer", "name", dev_b, *mtu_args,
        "netns", ns_b])
    if bridge:
        sh(["ip", "-n", ns_a, "link", "set", dev_a, "master", bridge])
    if address_a:
        sh(["ip", "-n", ns_a, "addr", "add", address_a, "dev", dev_a])
    sh(["ip", "-n", ns_a, "link", "set", dev_a, "up"])
    sh(["ip", "-n", ns_b, "addr", "add", address_b, "dev", dev_b])
    sh(["ip", "-n", ns_b, "link", "set", dev_b, "up"])


def set_congestion_control(namespaces: Sequence[str], name: str) -> str:
    """TCP congestion control in every namespace of ``namespaces``, whose connections also start fresh (no
    ssthresh or RTT remembered from an earlier connection). ``auto``: cubic (Linux's default) when the host
    allows it, else reno; ``inherit``: leave what the namespaces got. Returns the one in use."""
    allowed = sh([*exec_prefix(namespaces[0]), "sysctl", "-n", "net.ipv4.tcp_allowed_congestion_control"],
                 check=False).stdout.split()
    if name == "auto":
        name = "cubic" if "cubic" in allowed else "reno"
    for ns in namespaces:
        sh([*exec_prefix(ns), "sysctl", "-w", "net.ipv4.tcp_no_metrics_save=1"], check=False)
    if name != "inherit":
        for ns in namespaces:
            proc = sh([*exec_prefix(ns), "sysctl", "-w", f"net.ipv4.tcp_congestion_control={name}"], check=False)
            if proc.returncode != 0:
                raise Unavailable(f"cannot use TCP congestion control {name!r} in the namespaces (allowed here: "
                                  f"{' '.join(allowed) or '?'}): {proc.stderr.strip()}")
    return sh([*exec_prefix(namespaces[0]), "sysctl", "-n", "net.ipv4.tcp_congestion_control"]).stdout.strip()


# -- a star: peers on the bridges of a switch ------------------------------------------------------


class Star:
    """Namespaces ``PREFIX-pI`` (I in ``ranks``), each linked to a port ``pI`` of bridge ``br0`` in the switch
    namespace ``PREFIX-sw`` (module docstring). ``bridges``: the switch's bridges (more than br0: places to
    move ports to, cutting them off from br0). ``switch_address``: an address (CIDR) of the switch itself on
    br0, for a process that runs in the switch namespace."""

    def __init__(self, prefix: str, ranks: Sequence[int], address: Callable[[int], str], *,
                 bridges: Sequence[str] = ("br0",), switch_address: str | None = None, mtu: int = 1500):
        if not PREFIX_RE.match(prefix):
            raise ValueError(f"prefix must match {PREFIX_RE.pattern} (short: interface and namespace names), "
                             f"got {prefix!r}")
        self.prefix = prefix
        self.ranks = list(ranks)
        self._address = address
        self.bridges = list(bridges)
        self.switch_address = switch_address
        self.mtu = mtu

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def ns(self, rank: int) -> str:
        return f"{self.prefix}-p{rank}"

    def address(self, rank: int) -> str:
        return self._address(rank)

    def exec_prefix(self, rank: int | None) -> list[str]:
        """``ip netns exec`` of rank ``rank``'s namespace (None: the switch's)."""
        return exec_prefix(self.switch if rank is None else self.ns(rank))

    def links(self, ranks: Sequence[int] | None = None) -> list[tuple[str, str]]:
        """(namespace, device) of each rank's upload (its eth0) and download (its switch port)."""
        return [link for r in (self.ranks if ranks is None else ranks) for link in ((self.ns(r), "eth0"), (self.switch, f"p{r}"))]

    def build(self) -> None:
        """Create the namespaces, bridges and veth pairs. Raises ``Unavailable`` if namespaces or bridges are refused."""
        sw = self.switch
        add_namespace(sw)
        for i, bridge in enumerate(self.bridges):
            add_bridge(sw, bridge, self.switch_address if i == 0 else None, self.mtu)
        for rank in self.ranks:
            add_namespace(self.ns(rank))
            add_veth(sw, f"p{rank}", self.ns(rank), "eth0", f"{self.address(rank)}/24", bridge=self.bridges[0], mtu=self.mtu)

    def move_port(self, rank: int, bridge: str, check: bool = True) -> None:
        """Attach rank ``rank``'s switch port to ``bridge`` (a partition moves ports off br0, healing moves them back)."""
        sh(["ip", "-n", self.switch, "link", "set", f"p{rank}", "master", bridge], check=check)

    def namespaces(self) -> list[str]:
        return list_namespaces(self.prefix, STAR_SUFFIX)

    def destroy(self) -> list[str]:
        """Kill every process in, and delete, every namespace with this prefix (idempotent); returns them."""
        return remove_namespaces(self.prefix, STAR_SUFFIX)
