"""The companion process (``gossiploco.companion``): the call channel, real exchanges in companion processes, and
their lifetimes tied both ways (a crash of either side is a clear error, never a hang)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.multiprocessing

from conftest import tiny_peer_args, wait_until
from gossiploco.companion.channel import Channel
from gossiploco.companion.exchange import CompanionExchange
from gossiploco.companion.vectors import Ref, Register, Registry, SharedVectors
from gossiploco.mixing.packing import pack
from gossiploco.errors import CompanionDied, ExchangeBroken, PeerFailed
from gossiploco.runtime.launch import LocalPeers, free_ports
from test_peer import ENV, assert_matches_virtual_swarm, reached_round, summary


def pipe_pair(handler_a=None, handler_b=None):
    a, b = torch.multiprocessing.get_context("spawn").Pipe()
    return Channel(a, handler_a, "a"), Channel(b, handler_b, "b")


def test_the_channel_calls_both_ways_shares_tensors_in_place_and_returns_errors():
    def serve(name, args, kwargs):
        if name == "halve":
            args[0].mul_(0.5)  # in place: the caller's tensor, in shared memory
            return args[0].sum().item()
        if name == "fail":
            raise PeerFailed("it failed there")
        raise AttributeError(name)

    a, b = pipe_pair(handler_b=serve)
    x = torch.arange(8, dtype=torch.float32)
    assert a.call("halve", x, timeout_s=10) == 14.0
    assert torch.equal(x, torch.arange(8, dtype=torch.float32) / 2)  # changed in place by the other side
    with pytest.raises(PeerFailed, match="it failed there"):
        a.call("fail", timeout_s=10)
    with pytest.raises(AttributeError):
        a.call("nothing", timeout_s=10)
    a.close()
    b.close()


def test_a_closed_channel_fails_waiting_and_later_calls_at_once():
    release, started = threading.Event(), threading.Event()
    lost = []

    def slow(name, args, kwargs):
        started.set()
        release.wait(10)

    a, b = pipe_pair(handler_b=slow)
    a._on_lost = lost.append
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(_raised(lambda: a.call("slow", timeout_s=30))))
    waiter.start()
    # The call reached the other side (its handler runs): a send still under way when that side closes would fail
    # with a broken pipe instead, and the reason would be the send's, not the close's.
    assert wait_until(started.is_set, 5)
    began = time.monotonic()
    b.close("the other side went away")
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - began < 5
    assert isinstance(errors[0], CompanionDied) and isinstance(errors[0], ExchangeBroken)
    assert lost and "closed the channel" in lost[0]
    with pytest.raises(CompanionDied):
        a.call("slow", timeout_s=1)
    release.set()
    a.close()


def test_a_call_without_an_answer_gives_up_at_its_bound():
    a, b = pipe_pair(handler_b=lambda name, args, kwargs: threading.Event().wait(3))  # a side that does not answer
    began = time.monotonic()
    with pytest.raises(CompanionDied, match="no answer within 0.5 s"):
        a.call("sleep", timeout_s=0.5)
    assert time.monotonic() - began < 2
    a.close()
    b.close()


def test_kept_vectors_are_reused_once_released_and_named_after_their_first_trip():
    vectors, registry = SharedVectors(keep=2), Registry()
    a = vectors.take(100)
    b = vectors.take(100)  # a is held: another
    assert a.is_shared() and a.data_ptr() != b.data_ptr() and vectors.made == 2
    held = a[10:20]
    del a
    c = vectors.take(100)  # a's storage is still held through a view
    assert c.data_ptr() not in (held.data_ptr() - 40, b.data_ptr()) and vectors.made == 3  # beyond keep: not kept
    del held, c
    again = vectors.take(100)
    assert vectors.made == 3  # a kept one came back
    again.copy_(torch.arange(100, dtype=torch.float32))
    first = vectors.wire(again[5:15])
    assert isinstance(first, Register)
    assert torch.equal(registry.resolve(first), torch.arange(5, 15, dtype=torch.float32))
    second = vectors.wire(again[0:4].view(2, 2))
    assert isinstance(second, Ref)  # sent before: named, no descriptor
    assert torch.equal(registry.resolve(second), torch.arange(4, dtype=torch.float32).view(2, 2))
    heap = torch.ones(7, dtype=torch.uint8)
    moved = vectors.shared(heap)
    assert moved.is_shared() and torch.equal(moved, heap) and isinstance(vectors.wire(moved), Register)
    assert vectors.wire(heap) is heap  # not a kept vector: the pickler moves it
    with pytest.raises(ValueError, match="was not sent"):
        Registry().resolve(second)


def test_pack_asks_for_a_vector_for_the_device_its_entries_are_on():
    vectors, asked = SharedVectors(), []

    def vector(numel, device):
        asked.append((numel, device))
        return vectors.take(numel, device=device)
    flat = pack([{"a": torch.ones(2, 3)}, {"a": torch.zeros(2, 3)}], ["a"], vector)
    assert asked == [(12, None)] and flat.is_shared()  # CPU entries: a plain shared vector, nothing to register
    assert torch.equal(flat, torch.cat([torch.ones(6), torch.zeros(6)])) and vectors.unpinned == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kept_vectors_for_a_gpu_are_page_locked_and_drained_before_reuse():
    gpu, numel = torch.device("cuda"), 1 << 22
    vectors = SharedVectors(keep=1)
    source = torch.arange(numel, dtype=torch.float32, device=gpu)
    flat = pack([{"w": source.view(1024, -1)}], ["w"], lambda n, device: vectors.take(n, device=device))
    assert flat.is_shared() and flat.is_pinned() and vectors.unpinned == 0
    assert torch.equal(flat, source.cpu())
    back = flat.to(gpu, non_blocking=True)  # asynchronous: may still read ``flat`` when it is handed out again
    ptr = flat.data_ptr()
    del flat
    again = vectors.take(numel, device=gpu)  # the same kept vector, once the device's queued work is done
    assert again.data_ptr() == ptr and again.is_pinned()
    again.zero_()
    assert torch.equal(back, source)
    vectors.release()
    assert not again.is_pinned()


def _raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def start_companions(count: int, **kwargs) -> list[CompanionExchange]:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]
    made: list[CompanionExchange | None] = [None] * count

    def make(rank):
        made[rank] = CompanionExchange(rank=rank, endpoints=endpoints, run_id="companion-test", timeout_s=20.0,
                                       grace_s=5.0, **kwargs)

    threads = [threading.Thread(target=make, args=(rank,)) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert all(made), "a companion did not start"
    return made


def run_all(exchanges, fn):
    out = [None] * len(exchanges)
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, _call(fn, r, exchanges[r])))
               for r in range(len(exchanges))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return out


def _call(fn, r, ex):
    try:
        return fn(r, ex)
    except BaseException as exc:  # noqa: BLE001
        return exc


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_exchanges_in_companion_processes_reduce_in_shared_vectors_and_swap():
    exchanges = start_companions(3)
    try:
        values = [torch.randn(50_001, generator=torch.Generator().manual_seed(r)) for r in range(3)]
        expected = sum(values) / 3
        for round_index in range(3):  # the second time on, a kept vector is named, not sent
            flats = [ex.vector(50_001).copy_(values[r]) for r, ex in enumerate(exchanges)]
            out = run_all(exchanges, lambda r, ex: ex.all_reduce_mean(f"mean/{round_index}", flats[r], [0, 1, 2],
                                                                      inplace=True))
            for r in range(3):
                assert out[r].data_ptr() == flats[r].data_ptr()  # reduced in the caller's shared vector
                assert out[r] is not flats[r]  # a view, as ZmqExchange returns: ``flat`` itself means "not exchanged"
                assert torch.allclose(flats[r], expected, rtol=0, atol=1e-6)
        heap = [v * 2 for v in values]  # not shared: copied into a kept vector (the caller's is left as it was)
        for inplace in (True, False):
            out = run_all(exchanges, lambda r, ex: ex.all_reduce_mean(f"heap/{inplace}", heap[r], [0, 1, 2],
                                                                      inplace=inplace))
            assert all(torch.allclose(o, 2 * expected, rtol=0, atol=2e-6) for o in out)
            assert all(torch.equal(h, v * 2) for h, v in zip(heap, values))
        pair = [torch.full((10,), 1.0), torch.full((10,), 2.0)]
        got = run_all(exchanges[:2], lambda r, ex: ex.swap("swap/0", 1 - r, pair[r]))
        assert torch.equal(got[0], pair[1]) and torch.equal(got[1], pair[0])
        shared_pair = [ex.vector(10).copy_(pair[r]) for r, ex in enumerate(exchanges[:2])]
        means = run_all(exchanges[:2], lambda r, ex: ex.swap_mean("swap/1", 1 - r, shared_pair[r], inplace=True))
        for r in range(2):  # averaged in the caller's shared vector, returned as a view of it
            assert means[r].data_ptr() == shared_pair[r].data_ptr() and means[r] is not shared_pair[r]
            assert torch.equal(means[r], torch.full((10,), 1.5))
        assert exchanges[0].members() == [0, 1, 2] and exchanges[1].connected() == [0, 2]
        exchanges[2].current_round = 4
        assert exchanges[2].current_round == 4
        exchanges[2].round_ends = (4, 123.5)  # a shared round clock's end, told to peers that ask
        assert exchanges[2].round_ends == (4, 123.5)
        assert exchanges[0].bytes_sent > 50_000 * 4 and exchanges[0].malformed_messages == 0
        state = exchanges[0].deadlines.state()
        exchanges[0].deadlines.load_state(state)
    finally:
        for ex in exchanges:
            ex.close()
    assert all(ex._process.exitcode == 0 for ex in exchanges)


def _thread_nice(pid: int, tid: str) -> int:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of proc(5): nice


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_companion_on_links_on_demand_opens_the_links_its_trainer_asks_for_ahead_at_the_niceness_asked():
    exchanges = start_companions(2, links_idle_s=30.0, niceness=7)
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        for ex in exchanges:  # every thread of the companion (libzmq's, the exchange's, the channel's) inherited it
            nices = [_thread_nice(ex.pid, tid) for tid in os.listdir(f"/proc/{ex.pid}/task")]
            assert len(nices) > 3 and set(nices) == {min(mine + 7, 19)}
        links = exchanges[0].security_counts()["links_on_demand"]
        assert links["opened"] == 0 and links["parked"] == 1  # no socket to its member yet
        exchanges[0].link_ahead("mix2/0", 0)  # what ``factored.begin_round`` asks at each round's start
        assert wait_until(lambda: exchanges[0].security_counts()["links_on_demand"]["up"] == 1, 10.0)
    finally:
        for ex in exchanges:
            ex.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_companion_fails_its_trainers_calls_at_once_never_a_hang():
    exchanges = start_companions(2)
    try:
        result = []
        call = threading.Thread(target=lambda: result.append(_raised(
            lambda: exchanges[0].all_reduce_mean("mean/0", torch.ones(10), [0, 1]))))  # peer 1 never joins it
        call.start()
        assert wait_until(lambda: bool(exchanges[0]._channel._pending), 5)  # the call is in flight
        began = time.monotonic()
        os.kill(exchanges[0].pid, signal.SIGKILL)
        call.join(10)
        assert not call.is_alive() and time.monotonic() - began < 10
        assert isinstance(result[0], CompanionDied) and isinstance(result[0], ExchangeBroken)
        with pytest.raises(CompanionDied):
            exchanges[0].members()
        assert not exchanges[0].alive
    finally:
        for ex in exchanges:
            ex.close()


TRAINER = textwrap.dedent("""
    import sys, time
    from gossiploco.companion.exchange import CompanionExchange
    if __name__ == "__main__":
        ex = CompanionExchange(rank=0, endpoints=[sys.argv[1]], run_id="orphan", timeout_s=10.0)
        print(ex.pid, flush=True)
        if sys.argv[2] == "sleep":
            time.sleep(300)
        # else: exit without closing the exchange
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead
        return stat.read().split(")")[-1].split()[0] != "Z"


def start_trainer(tmp_path, then: str) -> tuple[subprocess.Popen, int]:
    """A trainer process (``TRAINER``) with its companion; ``then``: sleep, or exit without closing. Returns the
    trainer and its companion's pid."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen([sys.executable, str(script), f"tcp://127.0.0.1:{free_ports(1)[0]}", then],
                               stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        return trainer, int(trainer.stdout.readline())
    except ValueError:
        trainer.kill()
        raise


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_companion_exits_when_its_trainer_is_killed(tmp_path):
    trainer, companion = start_trainer(tmp_path, "sleep")
    try:
        assert _alive(companion)
        trainer.kill()
        trainer.wait(10)
        assert wait_until(lambda: not _alive(companion), 15), "the companion outlived its trainer"
    finally:
        trainer.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trainer_that_exits_without_closing_its_exchange_neither_hangs_nor_leaves_its_companion(tmp_path):
    """multiprocessing waits at exit for its children: the companion, which ends when the pipe closes, so the
    trainer closes the pipe first (an exit handler)."""
    trainer, companion = start_trainer(tmp_path, "exit")
    try:
        assert trainer.wait(30) == 0
        assert wait_until(lambda: not _alive(companion), 5)
    finally:
        trainer.kill()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_peers_with_their_exchange_in_a_companion_train_the_virtual_swarm(tmp_path):
    """``compute.companion = on``: every peer's exchange (CurveZMQ and sealed data, agreement, the rings, the
    monitors) runs in a companion process, and the run is the virtual swarm's. (``diloco``: its Mix2 all-reduces in
    place, which once came back as "not exchanged"; the swaps and compressed means run in the conformance suite,
    ``tests/test_exchange.py``, over the companion carrier.)"""
    preset, overrides = "diloco", {}
    overrides = {**overrides, "compute.companion": "on"}
    with LocalPeers(4, tmp_path, tiny_peer_args(preset, **overrides), env=ENV) as peers:
        peers.start()
        codes = peers.wait(180)
    assert_matches_virtual_swarm(peers, codes, preset, **overrides)
    assert all(summary(peers, rank)["exchange_process"] == "companion" for rank in range(4))


def companion_of(pid: int) -> int:
    """The companion process of peer process ``pid`` (its child running ``host.main``; spawn also starts a resource
    tracker, which is not it)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            return child
    raise AssertionError(f"no companion among the children {children} of {pid}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_peer_whose_companion_is_killed_stops_with_the_cause_and_the_others_finish(tmp_path):
    args = tiny_peer_args("globalm1-localm2", rounds=6, **{"compute.companion": "on", "compute.slowdown": 8.0,
                                                           "timeouts.exchange_s": 30.0})
    with LocalPeers(4, tmp_path, args, env=ENV) as peers:
        peers.start()
        assert wait_until(lambda: reached_round(peers, 1, 1), 120), peers.log(1)[-3000:]
        os.kill(companion_of(peers.procs[1].pid), signal.SIGKILL)
        began = time.monotonic()
        codes = peers.wait(150, ranks=[1])
        stopped_s = time.monotonic() - began
        codes.update(peers.wait(150))
    log = peers.log(1)
    assert codes[1] not in (0, None) and "the companion process" in log and "is gone" in log, log[-3000:]
    assert stopped_s < 60, stopped_s  # within a round: its next call to the exchange fails at once
    for rank in (0, 2, 3):
        assert codes[rank] == 0, peers.log(rank)[-3000:]
