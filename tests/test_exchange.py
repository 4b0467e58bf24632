"""Conformance suite for ``Exchange`` implementations.

Every implementation is driven through the same cases via the ``group`` fixture, which builds a
group of exchanges (one per rank) and a way to crash a rank. Transport issues add their
implementation to ``IMPLEMENTATIONS``: the in-memory hub, ZeroMQ over direct TCP, ZeroMQ over
the libp2p carrier (every connection a libp2p stream through a relay node, ``gossiploco.reach.tunnel``),
so the protocol is proven over both carriers by the same tests, and ZeroMQ in companion processes
(``gossiploco.companion``: the tensors cross a pipe and shared memory both ways).
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gossiploco.companion.exchange import CompanionExchange
from gossiploco.errors import ExchangeClosed, ExchangeError, ExchangeTimeout, PeerFailed
from gossiploco.mixing import MemoryHub
from gossiploco.runtime.launch import free_ports
from gossiploco.transport.zmq_exchange import ZmqExchange


class MemoryGroup:
    def __init__(self, world: int, timeout_s: float):
        self.hub = MemoryHub(world, timeout_s)
        self.exchanges = [self.hub.exchange(r) for r in range(world)]

    def crash(self, rank: int) -> None:
        self.hub.fail(rank)

    def close(self) -> None:
        for ex in self.exchanges:
            ex.close()


class ZmqGroup:
    """``world`` ZmqExchanges on loopback; ``crash`` closes a rank (its peers see the disconnect)."""

    def __init__(self, world: int, timeout_s: float, run_id: str | None = None, **options):
        run_id = run_id or f"test-{uuid.uuid4().hex[:8]}"
        self.exchanges: list[ZmqExchange] = []
        for attempt in range(5):  # a free port may be taken between the probe and the bind
            endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(world)]
            try:
                self.endpoints, self.run_id, self.timeout_s, self.options = endpoints, run_id, timeout_s, options
                for r in range(world):
                    self.exchanges.append(ZmqExchange(r, endpoints, run_id, timeout_s, **options))
                break
            except ExchangeError:
                self.close()
                self.exchanges = []
                if attempt == 4:
                    raise
        assert all(ex.wait_connected(10.0) for ex in self.exchanges), "loopback peers did not connect"

    def crash(self, rank: int) -> None:
        self.exchanges[rank].close()

    def restart(self, rank: int) -> ZmqExchange:
        """A fresh exchange for ``rank`` at its old address (a restarted process: it has not decided
        yet from which round it takes part, as ``NetworkPeer`` constructs it)."""
        self.exchanges[rank].close()
        self.exchanges[rank] = ZmqExchange(rank, self.endpoints, self.run_id, self.timeout_s, join_round=None,
                                           **self.options)
        return self.exchanges[rank]

    def close(self) -> None:
        for ex in self.exchanges:
            ex.close()
        leaked = [t.name for t in threading.enumerate() if t.name.startswith("zmq-exchange-") and
                  any(t in ex.threads for ex in self.exchanges)]
        assert not leaked, f"exchange threads still running after close: {leaked}"


class Libp2pCarrier:
    """A relay DHT node and ``world`` members of a private run behind NAT (``testbed.members``), each
    serving a tunnel to a ROUTER port picked here, with a tunnel from every node to every other through
    the relay: what ``gossiploco.reach.paths`` sets up between two peers behind NAT."""

    def __init__(self, world: int, relay_limits: tuple[float, float] | None = None):
        from gossiploco.security.swarm_key import SwarmKey
        from testbed.members import MemberNode, relay_address, relay_node

        swarm, run = SwarmKey.generate(), f"carrier-{uuid.uuid4().hex[:8]}"
        self.relay = relay_node(swarm, relay_limits=relay_limits)
        relay = relay_address(self.relay)
        self.ports = free_ports(world)
        self.members = [MemberNode(swarm, run, relay) for _ in range(world)]
        self.nodes = [self.relay] + [member.dht for member in self.members]
        for member, port in zip(self.members, self.ports):
            member.serve_tunnel(port)
        self.views = [{r: f"tcp://127.0.0.1:{self.ports[r]}"} for r in range(world)]
        for r, member in enumerate(self.members):
            for other in range(world):
                if other != r:
                    self.views[r][other] = f"tcp://127.0.0.1:{member.open_tunnel(self.members[other], relay)}"

    def close(self) -> None:
        for node in self.nodes:
            node.shutdown()


class Libp2pGroup(ZmqGroup):
    """``world`` ZmqExchanges whose every connection is carried by ``Libp2pCarrier``'s tunnels."""

    carriers: dict[int, Libp2pCarrier] = {}

    def __init__(self, world: int, timeout_s: float, run_id: str | None = None, **options):
        carrier = Libp2pGroup.carriers.get(world) or Libp2pGroup.carriers.setdefault(world, Libp2pCarrier(world))
        self.carrier, self.run_id, self.timeout_s, self.options = carrier, run_id or f"test-{uuid.uuid4().hex[:8]}", timeout_s, options
        self.endpoints = [carrier.views[r][r] for r in range(world)]
        self.exchanges = [self._make(r) for r in range(world)]
        assert all(ex.wait_connected(20.0) for ex in self.exchanges), "peers did not connect through the relay"

    def _make(self, rank: int, **extra) -> ZmqExchange:
        return ZmqExchange(rank, self.carrier.views[rank], self.run_id, self.timeout_s, bind=self.endpoints[rank],
                           **self.options, **extra)

    def restart(self, rank: int) -> ZmqExchange:
        self.exchanges[rank].close()
        self.exchanges[rank] = self._make(rank, join_round=None)
        return self.exchanges[rank]

    @classmethod
    def close_carriers(cls) -> None:
        for carrier in cls.carriers.values():
            carrier.close()
        cls.carriers.clear()


class CompanionGroup:
    """``world`` peers whose exchanges run in companion processes (``compute.companion``), on loopback; ``crash``
    closes a rank (its companion leaves; its peers see the disconnect)."""

    def __init__(self, world: int, timeout_s: float):
        endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(world)]
        with ThreadPoolExecutor(max_workers=world) as pool:  # each starts an interpreter: in parallel
            run_id = f"test-{uuid.uuid4().hex[:8]}"
            futures = [pool.submit(CompanionExchange, rank=r, endpoints=endpoints, run_id=run_id, timeout_s=timeout_s)
                       for r in range(world)]
            self.exchanges = [f.result(timeout=120) for f in futures]
        assert all(ex.wait_connected(10.0) for ex in self.exchanges), "loopback peers did not connect"

    def crash(self, rank: int) -> None:
        self.exchanges[rank].close()

    def close(self) -> None:
        with ThreadPoolExecutor(max_workers=len(self.exchanges)) as pool:  # each waits for its process: in parallel
            list(pool.map(lambda ex: ex.close(), self.exchanges))
        assert not any(ex.alive for ex in self.exchanges), "a companion process outlived close"


IMPLEMENTATIONS = {"memory": MemoryGroup, "zmq": ZmqGroup, "libp2p": Libp2pGroup, "companion": CompanionGroup}


@pytest.fixture(scope="module", autouse=True)
def _carriers():
    yield
    Libp2pGroup.close_carriers()


@pytest.fixture(params=["memory", "zmq", pytest.param("libp2p", marks=pytest.mark.slow),
                        pytest.param("companion", marks=pytest.mark.slow)])
def group(request):
    made = []

    def make(world: int, timeout_s: float = 10.0):
        g = IMPLEMENTATIONS[request.param](world, timeout_s)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def run_all(fns):
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout=60) for f in futures]


def test_all_reduce_mean_gives_every_member_the_same_mean(group):
    g = group(5)
    values = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(5)]
    members = list(range(5))
    out = run_all([lambda r=r: g.exchanges[r].all_reduce_mean("k/0", values[r], members) for r in range(5)])
    expected = sum(v.double() for v in values) / 5
    for o in out:
        assert torch.allclose(o.double(), expected, atol=1e-6)
        assert torch.equal(o, out[0])
    assert all(torch.equal(v, torch.randn(1000, generator=torch.Generator().manual_seed(r))) for r, v in enumerate(values))


def test_all_reduce_on_a_subgroup_and_repeated_keys(group):
    g = group(4)
    for round_index in range(3):
        out = run_all([lambda r=r: g.exchanges[r].all_reduce_mean(f"k/{round_index}", torch.full((3,), float(r)), [0, 2])
                       for r in (0, 2)])
        assert all(torch.equal(o, torch.full((3,), 1.0)) for o in out)


def test_swap_exchanges_values_between_partners(group):
    g = group(4)
    out = run_all([
        lambda: g.exchanges[0].swap("s/0", 3, torch.tensor([0.0, 0.5])),
        lambda: g.exchanges[3].swap("s/0", 0, torch.tensor([3.0, 3.5])),
        lambda: g.exchanges[1].swap("s/0", 2, torch.tensor([1.0])),
        lambda: g.exchanges[2].swap("s/0", 1, torch.tensor([2.0])),
    ])
    assert [o.tolist() for o in out] == [[3.0, 3.5], [0.0, 0.5], [2.0], [1.0]]


def test_swap_mean_is_the_pairs_mean_with_the_same_bits_on_both_sides(group):
    """Gossip's pair mean, against its equation written here: x_i <- (x_i + x_j) / 2 for the pair (i, j), the
    same float32 bits on both sides (so the pair's sum is kept). ``inplace`` may use the caller's vector and
    returns a new tensor object either way; without it the input is left as it was."""
    g = group(4)
    values = [torch.randn(3, 1001, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    pairs = {0: 3, 3: 0, 1: 2, 2: 1}
    for inplace in (False, True):
        flats = [v.clone() for v in values]
        out = run_all([lambda r=r: g.exchanges[r].swap_mean(f"m/{inplace}", pairs[r], flats[r], inplace=inplace)
                       for r in range(4)])
        for r in range(4):
            expected = (values[r] + values[pairs[r]]) / 2  # elementwise, in float32
            assert out[r].shape == (3, 1001) and out[r].dtype == torch.float32 and out[r] is not flats[r]
            assert torch.equal(out[r], expected) and torch.equal(out[r], out[pairs[r]])
            if not inplace:
                assert torch.equal(flats[r], values[r])


def test_concurrent_operations_with_different_keys_do_not_mix(group):
    g = group(2)
    fns = []
    for r in range(2):
        fns.append(lambda r=r: g.exchanges[r].all_reduce_mean("mix1/0", torch.full((4,), 10.0 * r), [0, 1]))
        fns.append(lambda r=r: g.exchanges[r].swap("mix2/0", 1 - r, torch.full((4,), float(r))))
    out = run_all(fns)
    assert torch.equal(out[0], torch.full((4,), 5.0)) and torch.equal(out[2], torch.full((4,), 5.0))
    assert torch.equal(out[1], torch.ones(4)) and torch.equal(out[3], torch.zeros(4))


def test_byte_counters_follow_the_ring_volume(group):
    g = group(4)
    run_all([lambda r=r: g.exchanges[r].all_reduce_mean("k", torch.zeros(1000), list(range(4))) for r in range(4)])
    assert g.exchanges[0].bytes_sent == 2 * 3 * 4000 // 4


def test_missing_peer_times_out_within_the_deadline(group):
    g = group(3, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(ExchangeTimeout):
        g.exchanges[0].all_reduce_mean("k", torch.zeros(3), [0, 1, 2])
    with pytest.raises(ExchangeTimeout):
        g.exchanges[0].swap("s", 1, torch.zeros(3))
    assert time.monotonic() - start < 3.0


def test_crashed_peer_fails_the_exchange_promptly(group):
    g = group(3, timeout_s=20.0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(g.exchanges[0].swap, "s", 1, torch.zeros(3))
        g.crash(1)
        start = time.monotonic()
        with pytest.raises(PeerFailed):
            future.result(timeout=10)
        assert time.monotonic() - start < 5.0
    assert 1 not in g.exchanges[0].members()


def test_closed_exchange_raises_closed(group):
    g = group(2)
    g.exchanges[0].close()
    with pytest.raises(ExchangeClosed):
        g.exchanges[0].swap("s", 1, torch.zeros(1))


# -- the compressed collectives' byte moves (gossiploco.mixing.compressed) -----------------------------


def test_all_to_all_delivers_each_part_to_its_member(group):
    g = group(4)
    members = [2, 0, 3, 1]  # an agreed order need not be sorted

    def parts(r):
        return {m: torch.full((r + 2 * m + 1,), 16 * r + m, dtype=torch.uint8) for m in members if m != r}

    sizes = {r: {m: 2 * r + m + 1 for m in members if m != r} for r in members}
    out = run_all([lambda r=r: g.exchanges[r].all_to_all("mix2/0/scatter", parts(r), members, sizes[r]) for r in range(4)])
    for r, got in enumerate(out):
        assert set(got) == set(members) - {r}
        for m, part in got.items():
            assert part.dtype == torch.uint8 and torch.equal(part, parts(m)[r])
    assert g.exchanges[0].bytes_sent == sum(p.numel() for p in parts(0).values())


def test_swap_carries_compressed_bytes_and_all_to_all_checks_their_size(group):
    g = group(2, timeout_s=5.0)
    out = run_all([lambda r=r: g.exchanges[r].swap("mix2/0", 1 - r, torch.arange(5, dtype=torch.uint8) + r) for r in range(2)])
    assert out[0].dtype == torch.uint8 and out[0].tolist() == [1, 2, 3, 4, 5] and out[1].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(PeerFailed):  # rank 1 sends 3 bytes where rank 0 expects 4
        run_all([lambda: g.exchanges[0].all_to_all("mix2/1/scatter", {1: torch.zeros(4, dtype=torch.uint8)}, [0, 1], {1: 4}),
                 lambda: g.exchanges[1].all_to_all("mix2/1/scatter", {0: torch.zeros(3, dtype=torch.uint8)}, [0, 1], {0: 4})])


def test_all_to_all_fails_promptly_when_a_member_crashes(group):
    g = group(3, timeout_s=20.0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(g.exchanges[0].all_to_all, "mix2/0/scatter", {1: torch.zeros(8, dtype=torch.uint8),
                             2: torch.zeros(8, dtype=torch.uint8)}, [0, 1, 2], {1: 8, 2: 8})
        g.crash(1)
        start = time.monotonic()
        with pytest.raises(PeerFailed):
            future.result(timeout=10)
        assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("compression", ["int8", "4bit", "topk"])
def test_a_compressed_group_mean_gives_the_same_bits_on_every_carrier(group, compression):
    from gossiploco.mixing.compressed import group_mean
    from gossiploco.mixing.compression import build_codec

    codec = build_codec(compression, block=32, density=0.1, chunk=64)
    values = [torch.randn(1001, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    members = [1, 2, 0]

    def run(exchanges):
        return run_all([lambda r=r: group_mean("mix2/0", values[r], members, exchanges[r], codec, feedback=True) for r in range(3)])

    reference = run(_memory_exchanges(3))
    out = run(group(3).exchanges)
    for (mean, residual, sent), (ref_mean, ref_residual, ref_sent) in zip(out, reference):
        assert torch.equal(mean, out[0][0]) and torch.equal(mean, ref_mean) and torch.equal(residual, ref_residual)
        assert sent == ref_sent


def _memory_exchanges(world: int):
    hub = MemoryHub(world, 10.0)
    return [hub.exchange(r) for r in range(world)]


def test_all_to_all_with_another_tag_fails_at_once_for_both(group):
    g = group(2, timeout_s=20.0)
    start = time.monotonic()
    results = []

    def call(r):
        try:
            g.exchanges[r].all_to_all("mix1/0/scatter", {1 - r: torch.zeros(8, dtype=torch.uint8)}, [0, 1], {1 - r: 8},
                                      tag=7 if r == 0 else 9)
            results.append((r, "ok"))
        except PeerFailed as exc:
            results.append((r, str(exc)))

    run_all([lambda: call(0), lambda: call(1)])
    # both fail; one may hear the other's abort before it reads the chunk with the other tag
    assert sorted(r for r, _ in results) == [0, 1] and "ok" not in dict(results).values(), results
    assert any("tag" in text for _, text in results), results
    assert time.monotonic() - start < 5.0
