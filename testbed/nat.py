"""A small "internet" of Linux network namespaces with home routers doing source NAT, for tests of peers behind NAT.

``with NatTestbed(public=2, homes=3, cgnat_homes=1) as bed:`` builds, and on leaving always removes
(processes inside killed first), this topology; every name starts with ``prefix`` (default ``gnat``)
and nothing is added to the root namespace::

                                PREFIX-net: bridge br0 = the public internet, 10.88.0.0/24
      +--------------------+------------------+--------------------------+---------------------------+
      |                    |                  |                          |                           |
  PREFIX-pub0        PREFIX-pub1         PREFIX-rtr0                PREFIX-rtr1               PREFIX-cgn (CGN)
  eth0 10.88.0.10    eth0 10.88.0.11     wan0 10.88.0.100           wan0 10.88.0.101          wan0 10.88.0.200
                                         lan0 192.168.1.1           lan0 192.168.2.1          lan0 100.64.0.1/24 (a bridge)
                                          |  NAT + firewall          |                         |  NAT + firewall
                                         PREFIX-home0               PREFIX-home1             PREFIX-rtr2
                                         eth0 192.168.1.2           eth0 192.168.2.2         wan0 100.64.0.12
                                                                                             lan0 192.168.3.1
                                                                                              |  NAT + firewall
                                                                                             PREFIX-home2
                                                                                             eth0 192.168.3.2

- public host ``pubI``: ``eth0`` = 10.88.0.(10+I)/24 on br0 (port ``pubI``), no default route;
- ``homes`` counts every home; home J has router ``rtrJ`` (``wan0`` = 10.88.0.(100+J)/24 on br0, port
  ``rtrJ``; ``lan0`` = 192.168.(J+1).1/24) and host ``homeJ`` (``eth0`` = 192.168.(J+1).2/24, default
  route via its router). The LAST ``cgnat_homes`` homes sit behind one carrier-grade NAT ``cgn``
  (``wan0`` = 10.88.0.200/24 on br0; its ``lan0`` is a bridge, 100.64.0.1/24, whose ports are those
  routers' links): their routers' ``wan0`` = 100.64.0.(10+J)/24, default route via 100.64.0.1, so those
  hosts are behind two levels of NAT. Other routers and the CGN have no default route (every public
  address is on the /24).
- every router (the CGN too): ip_forward=1 and an nftables table ``ip gnat`` (``ROUTER_RULES``):
  masquerade of lan0 -> wan0 traffic; forward policy drop except lan0 -> wan0 and established/related
  back; anything NEW arriving on wan0 for the router itself is dropped (no port forwarding).
- IPv6 is disabled and loopback is up in every namespace.
- ``rate_mbit`` (and ``delay_ms``, which needs sch_netem) shapes every host's access link in both
  directions (``testbed.links.shape_links``): for a public host its eth0 and its br0 port;
  for a home host its eth0 and its router's lan0. ``bed.shape(host, rate)`` (re)shapes one host
  (a router or the CGN: its wan link).

``Host.address`` is a host's own address; ``Host.public_address`` the one the internet sees (its router's
wan0 for a home host, the CGN's wan0 behind the CGN). ``bed.listen(host, port)`` starts a listener that
answers every connection with the source address it saw; ``bed.observed_source(src, address, port)``
connects to it; ``bed.can_connect`` makes one TCP connection from a namespace.

Needs root, iproute2, procps and nftables (``ensure_nat_tools()`` installs it, as root). A crashed run's
leftovers are removed at start, a lock file keeps two testbeds of one prefix apart, an atexit hook removes
one never exited, every command has a deadline. ``sudo .venv/bin/python -m testbed.nat [--cleanup]``:
build (and list) a small testbed, or remove the leftovers of ``--prefix``.

``bed.start_dht_node`` runs a ``gossiploco dht`` node in a host (``testbed.peers.netns_peers``: peers).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import select
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from testbed.links import shape_links
from testbed.netns import (PREFIX_RE, Unavailable, add_bridge, add_namespace, add_veth, list_namespaces, preflight,
                           prefix_lock, remove_namespaces, sh)
from testbed.peers import start_dht_node
from testbed.processes import ProcessGroup

DEFAULT_PREFIX = "gnat"
NS_SUFFIX = r"net|cgn|pub\d+|rtr\d+|home\d+"
"""The namespaces a testbed makes, after ``PREFIX-`` (what clean-up removes)."""
PUBLIC_NET = "10.88.0"
CGN_NET = "100.64.0"
MAX_HOSTS = 50
INSTALL_TIMEOUT_S = 300.0
DHT_PORT = 4100
"""The TCP port of the ``gossiploco dht`` nodes started here."""
READY_TIMEOUT_S = 15.0

ROUTER_RULES = """
table ip gnat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" masquerade
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" oifname "wan0" accept
    }
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "wan0" ct state established,related accept
        iifname "wan0" drop
    }
}
"""
"""A home router's (and the CGN's) nftables ruleset: source NAT out wan0, nothing NEW in from wan0."""

_LISTENER = r"""
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(64)
print("ready", flush=True)
while True:
    conn, (ip, port) = server.accept()
    with conn:
        conn.sendall(f"{ip} {port}\n".encode())
"""

_CONNECT = r"""
import socket, sys
address, port, timeout, read = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "read"
try:
    conn = socket.create_connection((address, port), timeout=timeout)
    print(conn.makefile().readline().strip() if read else "connected")
except OSError as exc:
    sys.exit(f"failed: {exc}")
"""


class NatUnavailable(Unavailable):
    """This machine cannot build the testbed (not root, a tool missing, namespaces or nftables refused)."""


@dataclass(frozen=True)
class Host:
    """One namespace of the testbed: a public host, a home host, a home router or the CGN."""

    name: str
    """``pub0``, ``home1``, ``rtr0``, ``cgn``."""
    ns: str
    """Its full namespace name (``PREFIX-NAME``)."""
    address: str
    """Its own IP (a home host: its private 192.168.x.2; a router: its wan0)."""
    public_address: str
    """The address the internet sees it as (== address for public hosts and the CGN)."""
    links: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    """Its access link's egresses (namespace, device): its upload, then its download."""

    def exec_prefix(self) -> list[str]:
        """The command prefix that runs a command inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns]


def nat_preflight() -> str | None:
    """Why this machine cannot build a testbed (not root, no ``ip``/``tc``/``nft``, no namespace or nftables
    table can be made), or None when it can."""
    problem = preflight()
    if problem is not None:
        return problem
    for tool in ("nft", "sysctl"):
        if shutil.which(tool) is None:
            package = "nftables" if tool == "nft" else "procps"
            return f"needs the `{tool}` command ({package}), not found on PATH; ensure_nat_tools() or `apt-get install {package}`"
    probe = f"gnatpf{os.getpid()}"
    try:
        proc = sh(["ip", "netns", "add", probe], check=False)
        if proc.returncode != 0:
            return f"cannot create a network namespace: {proc.stderr.strip()}"
        proc = sh(["ip", "netns", "exec", probe, "nft", "add", "table", "ip", "gnatprobe"], check=False)
        if proc.returncode != 0:
            return f"nftables does not work in a network namespace (kernel lacks nf_tables?): {proc.stderr.strip()}"
    except RuntimeError as exc:
        return str(exc)
    finally:
        with contextlib.suppress(RuntimeError):
            sh(["ip", "netns", "del", probe], check=False)
    return None


def ensure_nat_tools() -> None:
    """Install nftables with apt-get when ``nft`` is missing and this is root; otherwise do nothing. A failed
    install raises nothing: ``nat_preflight()`` then still says what is missing."""
    if shutil.which("nft") is not None or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nftables"]
    for cmds in ([install], [["apt-get", "update", "-qq"], install]):  # then again, in case the lists are stale
        for cmd in cmds:
            try:
                if subprocess.run(cmd, env=env, capture_output=True, timeout=INSTALL_TIMEOUT_S).returncode != 0:
                    break
            except subprocess.TimeoutExpired:
                break
        if shutil.which("nft") is not None:
            return


class NatTestbed:
    """The topology of the module docstring. ``homes`` counts every home; the last ``cgnat_homes`` of them
    sit behind the CGN. ``__enter__`` builds (removing everything again on any failure), ``__exit__`` always
    removes every namespace of the prefix."""

    def __init__(self, *, public: int = 2, homes: int = 2, cgnat_homes: int = 0, rate_mbit: float | None = None,
                 delay_ms: float = 0.0, prefix: str = DEFAULT_PREFIX):
        if not PREFIX_RE.match(prefix):
            raise ValueError(f"prefix must match {PREFIX_RE.pattern}, got {prefix!r}")
        if not (0 <= public <= MAX_HOSTS and 0 <= homes <= MAX_HOSTS and 0 <= cgnat_homes <= homes):
            raise ValueError(f"need 0 <= public, homes <= {MAX_HOSTS} and 0 <= cgnat_homes <= homes; "
                             f"got public={public} homes={homes} cgnat_homes={cgnat_homes}")
        if rate_mbit is None and delay_ms > 0:
            raise ValueError("delay_ms needs rate_mbit (the delay sits under the HTB class)")
        self.prefix, self.rate_mbit, self.delay_ms = prefix, rate_mbit, delay_ms
        self.net = f"{prefix}-net"
        behind = set(range(homes - cgnat_homes, homes))
        cgn_wan = f"{PUBLIC_NET}.200"
        self.cgn: Host | None = None
        if cgnat_homes:
            self.cgn = Host("cgn", f"{prefix}-cgn", cgn_wan, cgn_wan, ((f"{prefix}-cgn", "wan0"), (self.net, "cgn")))
        self.public_hosts: list[Host] = []
        for i in range(public):
            addr = f"{PUBLIC_NET}.{10 + i}"
            self.public_hosts.append(Host(f"pub{i}", f"{prefix}-pub{i}", addr, addr,
                                          ((f"{prefix}-pub{i}", "eth0"), (self.net, f"pub{i}"))))
        self.routers: list[Host] = []
        self.home_hosts: list[Host] = []
        for j in range(homes):
            rtr = f"{prefix}-rtr{j}"
            if j in behind:
                wan, public_address, upstream = f"{CGN_NET}.{10 + j}", cgn_wan, f"{prefix}-cgn"
            else:
                wan, public_address, upstream = f"{PUBLIC_NET}.{100 + j}", f"{PUBLIC_NET}.{100 + j}", self.net
            self.routers.append(Host(f"rtr{j}", rtr, wan, public_address, ((rtr, "wan0"), (upstream, f"rtr{j}"))))
            self.home_hosts.append(Host(f"home{j}", f"{prefix}-home{j}", f"192.168.{j + 1}.2", public_address,
                                        ((f"{prefix}-home{j}", "eth0"), (rtr, "lan0"))))
        self._behind_cgn = behind
        self._forwarding = {host.ns for host in self.routers} | ({self.cgn.ns} if self.cgn else set())
        """The namespaces that route (ip_forward=1): the routers and the CGN."""
        self._stack: contextlib.ExitStack | None = None
        self.group = ProcessGroup()
        """Every process started in the testbed (killed with its namespace on close, and reaped)."""

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> "NatTestbed":
        problem = nat_preflight()
        if problem is not None:
            raise NatUnavailable(f"cannot build a NAT testbed here: {problem}")
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(prefix_lock(self.prefix))
        except Unavailable:
            raise NatUnavailable(f"another NAT testbed (or another run of the test bed) with prefix {self.prefix!r} "
                                 "is active; wait for it or use another prefix") from None
        self._stack = stack
        atexit.register(self.close)
        try:
            remove_namespaces(self.prefix, NS_SUFFIX)  # a crashed earlier run's
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in, and delete, every namespace of the prefix; release the lock (idempotent)."""
        if self._stack is None:
            return
        try:
            remove_namespaces(self.prefix, NS_SUFFIX)
            self.group.stop(grace_s=0)  # killed with their namespace already: reap them
            for proc in self.group.children:
                for pipe in (proc.stdin, proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
            self.group = ProcessGroup()
        finally:
            stack, self._stack = self._stack, None
            atexit.unregister(self.close)
            stack.close()

    def namespaces(self) -> list[str]:
        """The namespaces of this testbed's prefix that exist now."""
        return list_namespaces(self.prefix, NS_SUFFIX)

    # -- building -------------------------------------------------------------------------------

    def all_hosts(self) -> list[Host]:
        """Every host: public hosts, the CGN (if any), routers, home hosts."""
        return self.public_hosts + ([self.cgn] if self.cgn else []) + self.routers + self.home_hosts

    def _router_rules(self, host: Host) -> None:
        proc = subprocess.run([*host.exec_prefix(), "nft", "-f", "-"], input=ROUTER_RULES, capture_output=True,
                              text=True, timeout=20)
        if proc.returncode != 0:
            raise RuntimeError(f"nft -f - in {host.ns}: exit {proc.returncode}: {proc.stderr.strip()}")

    def _build(self) -> None:
        for ns in [self.net] + [host.ns for host in self.all_hosts()]:
            try:
                add_namespace(ns, forward=ns in self._forwarding, ipv6=False)
            except Unavailable as exc:
                raise NatUnavailable(str(exc)) from exc
        add_bridge(self.net, "br0")
        if self.cgn:
            add_veth(self.net, "cgn", self.cgn.ns, "wan0", f"{self.cgn.address}/24", bridge="br0")
            add_bridge(self.cgn.ns, "lan0", f"{CGN_NET}.1/24")
            self._router_rules(self.cgn)
        for host in self.public_hosts:
            add_veth(self.net, host.name, host.ns, "eth0", f"{host.address}/24", bridge="br0")
        for j, (rtr, home) in enumerate(zip(self.routers, self.home_hosts)):
            upstream_ns, bridge = (self.cgn.ns, "lan0") if j in self._behind_cgn and self.cgn else (self.net, "br0")
            add_veth(upstream_ns, rtr.name, rtr.ns, "wan0", f"{rtr.address}/24", bridge=bridge)
            if upstream_ns != self.net:
                sh(["ip", "-n", rtr.ns, "route", "add", "default", "via", f"{CGN_NET}.1"])
            add_veth(rtr.ns, "lan0", home.ns, "eth0", f"{home.address}/24", address_a=f"192.168.{j + 1}.1/24")
            sh(["ip", "-n", home.ns, "route", "add", "default", "via", f"192.168.{j + 1}.1"])
            self._router_rules(rtr)
        if self.rate_mbit is not None:
            for host in self.public_hosts + self.home_hosts:
                self.shape(host, self.rate_mbit, self.delay_ms)

    # -- using it -------------------------------------------------------------------------------

    def host(self, name: str) -> Host:
        """The host called ``name`` (``pub0``, ``home1``, ``rtr0``, ``cgn``)."""
        for host in self.all_hosts():
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} in this testbed; it has {', '.join(h.name for h in self.all_hosts())}")

    def popen(self, host: Host, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside ``host``'s namespace, in a session of its own (killed when the testbed closes);
        ``kwargs`` go to ``subprocess.Popen``."""
        return self.group.start([*host.exec_prefix(), *cmd], **kwargs)

    def start_dht_node(self, host: Host, out: Path, name: str = "bootstrap", *, join: str | None = None,
                       extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                       timeout_s: float = 90.0) -> tuple[subprocess.Popen, str]:
        """``gossiploco dht`` on port ``DHT_PORT`` in ``host``'s namespace with the run's key ``out/swarm.key``
        (a bootstrap node and relay; with ``join`` a second node of the same DHT), logging to ``out/NAME.log``;
        returns it and its ``--join`` multiaddr (``testbed.peers.start_dht_node``)."""
        return start_dht_node(self.group, out / f"{name}.log", host=host.address, port=DHT_PORT,
                              swarm_key=out / "swarm.key", where=host.exec_prefix(), join=join, extra=extra,
                              env={**(env or os.environ), "PYTHONUNBUFFERED": "1"}, timeout_s=timeout_s)

    def run(self, host: Host, cmd: list[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside ``host``'s namespace to completion (text output captured); with ``check`` a
        non-zero exit raises RuntimeError with its stderr. Past ``timeout`` seconds it raises RuntimeError."""
        return sh([*host.exec_prefix(), *cmd], check=check, timeout=timeout)

    def shape(self, host: Host, rate_mbit: float, delay_ms: float = 0.0) -> None:
        """(Re)shape ``host``'s access link to ``rate_mbit`` in both directions (HTB; ``delay_ms`` needs sch_netem)."""
        shape_links(host.links, rate_mbit, delay_ms)

    def listen(self, host: Host, port: int, address: str = "0.0.0.0") -> subprocess.Popen:
        """Start a TCP listener in ``host``'s namespace that answers every connection with the source
        ``address port`` it saw; returns once it listens (RuntimeError if it does not within a deadline)."""
        proc = self.popen(host, [sys.executable, "-I", "-c", _LISTENER, address, str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            proc.kill()
            rest = proc.communicate(timeout=5)[0]
            raise RuntimeError(f"listener on {address}:{port} in {host.ns} did not start: {(line + rest).strip()}")
        return proc

    def _connect(self, src: Host, address: str, port: int, timeout_s: float, read: bool) -> str | None:
        cmd = [sys.executable, "-I", "-c", _CONNECT, address, str(port), str(timeout_s), "read" if read else "no"]
        proc = self.run(src, cmd, timeout=timeout_s + 20, check=False)  # + python's start-up on a busy machine
        return proc.stdout.strip() if proc.returncode == 0 else None

    def can_connect(self, src: Host, dst_address: str, port: int, timeout_s: float = 2.0) -> bool:
        """Whether a real TCP connection from ``src``'s namespace to ``dst_address:port`` is accepted within ``timeout_s``."""
        return self._connect(src, dst_address, port, timeout_s, read=False) is not None

    def observed_source(self, src: Host, dst_address: str, port: int, timeout_s: float = 2.0) -> str | None:
        """The source address a ``listen()`` listener at ``dst_address:port`` saw a connection from ``src`` come
        from, or None when the connection failed."""
        answer = self._connect(src, dst_address, port, timeout_s, read=True)
        return answer.split()[0] if answer else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cleanup", action="store_true", help="remove the namespaces of --prefix (a crashed run's)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    args = parser.parse_args(argv)
    problem = nat_preflight()
    if problem is not None:
        print(f"testbed.nat cannot run here: {problem}", file=sys.stderr)
        return 2
    if args.cleanup:
        print(f"removed: {' '.join(remove_namespaces(args.prefix, NS_SUFFIX)) or 'nothing'}")
        return 0
    with NatTestbed(prefix=args.prefix, public=1, homes=2, cgnat_homes=1) as bed:  # a smoke test
        for host in bed.all_hosts():
            print(f"{host.ns:16} {host.address:14} seen as {host.public_address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
