"""Shared fixtures: small, fast configurations for the tiny model."""

from __future__ import annotations

import compileall
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gossiploco.config import TINY_OVERRIDES, load_config
from gossiploco.runtime.launch import free_ports
from testbed.overrides import peer_args
from testbed.processes import once_free, wait_until  # noqa: F401 - every test that waits for something uses these

torch.set_num_threads(2)
ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session) -> None:
    """Compile the project's modules to bytecode once (a no-op when it is fresh): the suite starts hundreds of
    interpreters (peers, companions, DHT nodes, benches), and where PYTHONDONTWRITEBYTECODE is set, as on this
    project's machines, none of them writes the cache, so each compiled every module it imported again: about 1 s of
    CPU per process (measured: tests/test_peer.py -k every_preset, 198 s of CPU before, 185 s after). This process
    keeps its caches too, the rewritten test modules' included (pytest reads ``sys.dont_write_bytecode`` per module:
    about 9 s of every later run's collection)."""
    sys.dont_write_bytecode = False
    for package in ("gossiploco", "testbed", "bench"):
        compileall.compile_dir(str(ROOT / package), quiet=1)


def assert_three_peers_exchange_exactly(exchanges, run_all) -> None:
    """Three connected exchanges run an all-reduce, a swap and a compressed all-to-all, each exact (``run_all``:
    the test's way of running one call per peer at once)."""
    values = [torch.randn(200_003, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    out = run_all([lambda r=r: exchanges[r].all_reduce_mean("mix1/0", values[r], [0, 1, 2]) for r in range(3)])
    expected = (sum(v.double() for v in values) / 3).float()
    assert all(torch.allclose(o, expected, atol=1e-6) and torch.equal(o, out[0]) for o in out)
    swapped = run_all([lambda r=r: exchanges[r].swap("mix2/0", 1 - r, values[r]) for r in (0, 1)])
    assert torch.equal(swapped[0], values[1]) and torch.equal(swapped[1], values[0])
    parts = {r: {m: torch.full((5000 + m,), r, dtype=torch.uint8) for m in range(3) if m != r} for r in range(3)}
    got = run_all([lambda r=r: exchanges[r].all_to_all("mix2/1/scatter", parts[r], [0, 1, 2],
                                                       {m: 5000 + r for m in range(3) if m != r}) for r in range(3)])
    assert all(torch.equal(got[r][m], torch.full((5000 + r,), m, dtype=torch.uint8)) for r in range(3) for m in got[r])


def assert_pair_mean_with_a_partner_ahead(exchanges, chunks: int, chunk_elems: int) -> None:
    """Two exchanges' ``swap_mean(inplace=True)``, the second started first: all its chunks wait in the first's mailbox,
    so the first averages them into its vector as fast as it can, while its own chunks of that vector may still be
    queued: both sides end with (a + b) / 2 exactly, in their own vectors (a chunk sent without copying and
    overwritten before it left would give the partner the average instead)."""
    import threading

    values = [torch.randn(chunks * chunk_elems - 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    flats = [v.clone() for v in values]
    out: dict[int, torch.Tensor] = {}
    ahead = threading.Thread(target=lambda: out.update({1: exchanges[1].swap_mean("mix2/0", 0, flats[1],
                                                                                  inplace=True)}))
    ahead.start()
    try:
        assert wait_until(lambda: exchanges[0].inspect(lambda node: node.pending_state()["mailbox_chunks"]) == chunks)
        out[0] = exchanges[0].swap_mean("mix2/0", 1, flats[0], inplace=True)
    finally:
        ahead.join(30)
    expected = (values[0] + values[1]) / 2
    for r in range(2):
        assert out[r].data_ptr() == flats[r].data_ptr() and torch.equal(out[r], expected), f"peer {r}"


TINY = {**TINY_OVERRIDES, "workers": 4}
"""``config.TINY_OVERRIDES`` with 4 workers: what the tests scale presets down to."""


def tiny_config(preset: str, **overrides):
    """A preset scaled down for tests (``TINY``), plus ``overrides``."""
    return load_config(preset, {**TINY, **overrides})


def tiny_peer_args(preset: str, **overrides) -> list[str]:
    """``gossiploco peer`` arguments giving the same config as ``tiny_config(preset, **overrides)``."""
    return peer_args(preset, {**TINY, **overrides})  # without workers: a peer's world size is the length of --peers


@pytest.fixture
def make_config():
    return tiny_config


@pytest.fixture(scope="session")
def corpus():
    """The tiny configs' corpus, loaded once."""
    from gossiploco.data import load_corpus

    return load_corpus(tiny_config("diloco").data)


@dataclass(frozen=True)
class Bootstrap:
    address: str
    """Its multiaddr, for ``--join``."""
    swarm_key: Path
    """The key file of its swarm (the peers' ``--swarm-key``)."""


@pytest.fixture
def bootstrap(tmp_path_factory):
    """A real hivemind bootstrap DHT node of a new private swarm on loopback (shut down after the test)."""
    from gossiploco.membership.bootstrap import start_bootstrap
    from gossiploco.security.swarm_key import SwarmKey

    key = SwarmKey.generate()
    key_file = key.save(tmp_path_factory.mktemp("swarm") / "swarm.key")
    dht, addresses = start_bootstrap("127.0.0.1", 0, swarm=key)
    try:
        yield Bootstrap(addresses[0], key_file)
    finally:
        dht.shutdown()


CHROMIUM = "/usr/bin/chromium"
"""Debian's Chromium, which the browser tests drive through Playwright."""


def browser_or_skip() -> None:
    """Skip a browser test where Chromium or Playwright is missing (fail instead with GOSSIPLOCO_REQUIRE_BROWSER=1)."""
    why = None
    if not os.path.exists(CHROMIUM):
        why = f"no Chromium at {CHROMIUM} (as root: apt-get install -y chromium)"
    elif importlib.util.find_spec("playwright") is None:
        why = "playwright is not installed (pip install -e .[dev])"
    if why is not None:
        if os.environ.get("GOSSIPLOCO_REQUIRE_BROWSER") == "1":
            pytest.fail(f"GOSSIPLOCO_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the kernel's ephemeral range
    (``gossiploco.runtime.launch.free_ports``)."""
    return free_ports(1)[0]


@pytest.fixture
def groups():
    """``make(world, timeout_s, **options)``: a ``ZmqGroup`` of real ``ZmqExchange`` peers on loopback (random ports),
    every one closed in teardown (which fails if a receiver thread is left running)."""
    from tests.test_exchange import ZmqGroup  # that module imports this one

    made: list = []

    def make(world: int, timeout_s: float = 10.0, **options):
        g = ZmqGroup(world, timeout_s, **options)
        made.append(g)
        return g

    try:
        yield make
    finally:
        for g in made:
            g.close()
