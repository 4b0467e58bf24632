"""testbed/nat.py: home hosts behind source NAT (and a carrier-grade NAT) reach the public
internet and are seen as their router's address; nothing reaches them from outside; no namespace is
ever left behind.

The tests that build namespaces need root, ``ip``/``tc`` (iproute2), ``sysctl`` and ``nft`` (nftables)
and a kernel with network namespaces, veth, bridge, htb and nf_tables (``nat_preflight``). Where those
are missing they skip, with the reason; with ``GOSSIPLOCO_REQUIRE_NETNS=1`` (set by ``.ci/run``, which
runs as root and installs the tools) they fail instead. Every test uses its own name prefix.

The shared testbed: public=2 (pub0 10.88.0.10, pub1 10.88.0.11), homes=3 of which cgnat_homes=1
(home0 behind rtr0 = 10.88.0.100, home1 behind rtr1 = 10.88.0.101, home2 behind rtr2 behind the CGN =
10.88.0.200), every host's link shaped to 200 Mbit/s. Listeners in the namespaces answer with the
source address they saw (``NatTestbed.listen``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from testbed import nat as nt

pytestmark = pytest.mark.slow  # network namespaces (the quick subset leaves them out)

PROBLEM = nt.nat_preflight()
REQUIRE_ENV = "GOSSIPLOCO_REQUIRE_NETNS"
PREFIX = f"gnt{os.getpid() % 10**6}"
PORT = 5000
BLOCKED_TIMEOUT_S = 1.0
"""A connection that the NAT should block: how long to try (a dropped SYN times out)."""


def require_netns() -> None:
    """Skip (or fail, under ``GOSSIPLOCO_REQUIRE_NETNS=1``) where the testbed cannot be built."""
    if PROBLEM is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1, but the NAT testbed cannot run here: {PROBLEM}")
    pytest.skip(f"the NAT testbed cannot run here: {PROBLEM} (set {REQUIRE_ENV}=1 to fail instead)")


@pytest.fixture(scope="module")
def bed():
    require_netns()
    with nt.NatTestbed(public=2, homes=3, cgnat_homes=1, rate_mbit=200, prefix=PREFIX) as testbed:
        for name in ("pub0", "pub1", "rtr0", "rtr1", "home0", "home1", "cgn"):
            testbed.listen(testbed.host(name), PORT)
        yield testbed
    assert nt.list_namespaces(PREFIX, nt.NS_SUFFIX) == []


@pytest.mark.timeout(60)
def test_nat_testbed_topology(bed):
    names = [f"{PREFIX}-{n}" for n in ("cgn", "home0", "home1", "home2", "net", "pub0", "pub1", "rtr0", "rtr1", "rtr2")]
    assert bed.namespaces() == names
    home0, home2, rtr2 = bed.host("home0"), bed.host("home2"), bed.host("rtr2")
    assert (home0.address, home0.public_address) == ("192.168.1.2", "10.88.0.100")
    assert (home2.address, home2.public_address) == ("192.168.3.2", "10.88.0.200")
    assert (rtr2.address, rtr2.public_address) == ("100.64.0.12", "10.88.0.200")
    assert home0.exec_prefix() == ["ip", "netns", "exec", f"{PREFIX}-home0"]
    assert "masquerade" in bed.run(bed.host("rtr1"), ["nft", "list", "table", "ip", "gnat"]).stdout
    for host in bed.all_hosts():  # no IPv6 anywhere: nothing leaks around the NAT
        assert "inet6" not in bed.run(host, ["ip", "-6", "addr", "show"]).stdout, host
    with pytest.raises(KeyError, match="no host 'home9'"):
        bed.host("home9")


@pytest.mark.timeout(60)
def test_nat_testbed_home_reaches_public_as_its_routers_address(bed):
    pub0, pub1 = bed.host("pub0"), bed.host("pub1")
    assert bed.observed_source(pub1, pub0.address, PORT) == pub1.address  # no NAT between public hosts
    for home, seen_as in (("home0", "10.88.0.100"), ("home1", "10.88.0.101"), ("home2", "10.88.0.200")):
        host = bed.host(home)
        assert host.public_address == seen_as
        assert bed.observed_source(host, pub0.address, PORT) == seen_as, home  # rtr's wan, or the CGN's
        assert bed.can_connect(host, pub1.address, PORT)


@pytest.mark.timeout(60)
def test_nat_testbed_public_cannot_reach_a_home(bed):
    pub0, home0, rtr0 = bed.host("pub0"), bed.host("home0"), bed.host("rtr0")
    # The listeners are there: from inside the home both answer (so a failure below is the NAT's doing).
    assert bed.observed_source(home0, "192.168.1.1", PORT) == home0.address
    assert bed.observed_source(rtr0, home0.address, PORT) == "192.168.1.1"
    assert not bed.can_connect(pub0, home0.address, PORT, BLOCKED_TIMEOUT_S)  # a private address
    assert not bed.can_connect(pub0, rtr0.address, PORT, BLOCKED_TIMEOUT_S)  # the router's wan: dropped
    assert not bed.can_connect(pub0, bed.host("cgn").address, PORT, BLOCKED_TIMEOUT_S)  # the CGN's wan
    assert not bed.can_connect(pub0, bed.host("rtr2").address, PORT, BLOCKED_TIMEOUT_S)  # behind the CGN
    # Even a neighbour on the public segment with a route to the lan (as the ISP would have) is dropped
    # by the router's forward chain.
    route = ["ip", "route", "add", "192.168.1.0/24", "via", rtr0.address]
    bed.run(pub0, route)
    try:
        assert not bed.can_connect(pub0, home0.address, PORT, BLOCKED_TIMEOUT_S)
    finally:
        bed.run(pub0, ["ip", "route", "del", *route[3:]])


@pytest.mark.timeout(60)
def test_nat_testbed_homes_cannot_reach_each_other(bed):
    home0, home1, home2 = bed.host("home0"), bed.host("home1"), bed.host("home2")
    assert not bed.can_connect(home0, home1.address, PORT, BLOCKED_TIMEOUT_S)
    assert not bed.can_connect(home0, home1.public_address, PORT, BLOCKED_TIMEOUT_S)
    assert not bed.can_connect(home2, home0.public_address, PORT, BLOCKED_TIMEOUT_S)
    assert not bed.can_connect(home2, home1.address, PORT, BLOCKED_TIMEOUT_S)


@pytest.mark.timeout(60)
def test_nat_testbed_shapes_both_directions(bed):
    home1, rtr1 = bed.host("home1"), bed.host("rtr1")
    assert home1.links == ((home1.ns, "eth0"), (rtr1.ns, "lan0"))
    for ns, dev in home1.links:
        assert "htb" in nt.sh(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout
        assert "rate 200Mbit" in nt.sh(["tc", "-n", ns, "class", "show", "dev", dev]).stdout
    bed.shape(home1, 50)  # re-shaping replaces the rate
    for ns, dev in home1.links:
        text = nt.sh(["tc", "-n", ns, "class", "show", "dev", dev]).stdout
        assert "rate 50Mbit" in text and "200Mbit" not in text
    assert bed.observed_source(home1, bed.host("pub0").address, PORT) == "10.88.0.101"


@pytest.mark.timeout(10)
def test_nat_testbed_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in (nt.nat_preflight() or "") or not sys.platform.startswith("linux")
    with pytest.raises(nt.NatUnavailable, match="cannot build a NAT testbed here"):
        with nt.NatTestbed(prefix=f"{PREFIX}r"):
            pass
    if shutil.which("ip"):
        assert nt.list_namespaces(f"{PREFIX}r", nt.NS_SUFFIX) == []


@pytest.mark.timeout(10)
def test_nat_testbed_ensure_tools_never_installs_without_root(monkeypatch):
    def no_commands(*args, **kwargs):
        raise AssertionError(f"ran {args} without root")

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(nt.shutil, "which", lambda tool: None)
    monkeypatch.setattr(nt.subprocess, "run", no_commands)
    nt.ensure_nat_tools()


def test_nat_testbed_rejects_bad_arguments():
    with pytest.raises(ValueError, match="cgnat_homes"):
        nt.NatTestbed(homes=1, cgnat_homes=2)
    with pytest.raises(ValueError, match="prefix"):
        nt.NatTestbed(prefix="Bad-Prefix")


@pytest.mark.timeout(60)
def test_nat_testbed_leaves_nothing_after_an_exception():
    require_netns()
    prefix = f"{PREFIX}x"
    with pytest.raises(RuntimeError, match="boom"):
        with nt.NatTestbed(public=1, homes=1, cgnat_homes=1, prefix=prefix) as bed:
            sleeper = bed.popen(bed.host("home0"), [sys.executable, "-c", "import time; time.sleep(600)"],
                                stdout=subprocess.DEVNULL)
            assert len(bed.namespaces()) == 5
            with pytest.raises(nt.NatUnavailable, match="active"):  # one testbed per prefix at a time
                with nt.NatTestbed(public=1, homes=0, prefix=prefix):
                    pass
            assert len(bed.namespaces()) == 5  # the refused one touched nothing
            raise RuntimeError("boom")
    assert nt.list_namespaces(prefix, nt.NS_SUFFIX) == []
    assert sleeper.poll() is not None  # killed with its namespace, and reaped
    # A crashed run's leftovers (made here by hand) are removed when the next testbed of the prefix starts.
    nt.sh(["ip", "netns", "add", f"{prefix}-pub7"])
    try:
        with nt.NatTestbed(public=1, homes=1, prefix=prefix) as bed:
            assert bed.namespaces() == [f"{prefix}-{n}" for n in ("home0", "net", "pub0", "rtr0")]
    finally:
        nt.remove_namespaces(prefix, nt.NS_SUFFIX)
    assert nt.list_namespaces(prefix, nt.NS_SUFFIX) == []
