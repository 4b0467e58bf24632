"""ZeroMQ exchange beyond the conformance suite: large and chunked rings, hostile input, run ids, close.

Every call has a deadline of a few seconds, ports are random, sockets linger 0, and every exchange
is closed in teardown (the group's close also fails if a receiver thread is left running).
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import torch
import zmq

from conftest import assert_pair_mean_with_a_partner_ahead, wait_until
from gossiploco.errors import ExchangeClosed, ExchangeError, ExchangeTimeout, PeerFailed
from gossiploco.protocol import codec
from gossiploco.protocol.messages import Ready, Send
from gossiploco.protocol.messages import op_and_round as _op_and_round
from gossiploco.transport.zmq_exchange import ZmqExchange
from tests.test_exchange import free_ports, run_all


def test_ring_all_reduce_of_three_million_floats_is_exact_and_bitwise_equal(groups):
    g = groups(4)
    values = [torch.randn(3_000_000, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    copies = [v.clone() for v in values]
    out = run_all([lambda r=r: g.exchanges[r].all_reduce_mean("mix1/3", values[r], [0, 1, 2, 3]) for r in range(4)])
    expected = (sum(v.double() for v in values) / 4).float()
    for o in out:
        assert o.dtype == torch.float32 and o.shape == (3_000_000,)
        assert torch.allclose(o, expected, atol=1e-5)
        assert torch.equal(o, out[0])
    assert all(torch.equal(v, c) for v, c in zip(values, copies)), "inputs were modified"
    assert g.exchanges[1].bytes_sent == g.exchanges[1].bytes_received == 2 * 3 * 3_000_000 * 4 // 4


def test_tiny_chunks_stream_uneven_segments(groups):
    g = groups(3, chunk_bytes=1000, max_message_bytes=1 << 20)
    n = 10_007  # not a multiple of 3 segments, nor of the 250-float chunks
    values = [torch.randn(n, generator=torch.Generator().manual_seed(10 + r)) for r in range(3)]
    out = run_all([lambda r=r: g.exchanges[r].all_reduce_mean("mix2/1", values[r], [0, 1, 2]) for r in range(3)])
    expected = (sum(v.double() for v in values) / 3).float()
    for o in out:
        assert torch.allclose(o, expected, atol=1e-6)
        assert torch.equal(o, out[0])
    swapped = run_all([lambda: g.exchanges[0].swap("mix2/2", 2, values[0]),
                       lambda: g.exchanges[2].swap("mix2/2", 0, values[2])])
    assert torch.equal(swapped[0], values[2]) and torch.equal(swapped[1], values[0])


def test_all_reduce_with_fewer_elements_than_peers(groups):
    g = groups(4, chunk_bytes=8, max_message_bytes=1 << 20)
    out = run_all([lambda r=r: g.exchanges[r].all_reduce_mean("k/0", torch.tensor([float(r), 1.0]), [0, 1, 2, 3])
                   for r in range(4)])
    assert all(torch.equal(o, torch.tensor([1.5, 1.0])) for o in out)


def test_swap_size_mismatch_is_a_peer_failure(groups):
    g = groups(2, timeout_s=3.0)
    with ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(g.exchanges[0].swap, "s/0", 1, torch.zeros(5))
        b = pool.submit(g.exchanges[1].swap, "s/0", 0, torch.zeros(6))
        for f in (a, b):
            with pytest.raises(PeerFailed):
                f.result(timeout=10)


def test_swap_mean_in_place_overwrites_no_chunk_before_its_send_left(groups):
    """The pair mean averages into the caller's vector while its own chunks of it may still be queued (chunks over
    pyzmq's 64 KiB copy threshold, which a zero-copy send would read in place): what the partner receives is
    never the average."""
    g = groups(2, chunk_bytes=8 << 20)
    assert_pair_mean_with_a_partner_ahead(g.exchanges, 4, 2 << 20)


def test_swap_mean_size_mismatch_is_a_peer_failure(groups):
    g = groups(2, timeout_s=3.0)
    with ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(g.exchanges[0].swap_mean, "m/0", 1, torch.zeros(5), inplace=True)
        b = pool.submit(g.exchanges[1].swap_mean, "m/0", 0, torch.zeros(6), inplace=True)
        for f in (a, b):
            with pytest.raises(PeerFailed):
                f.result(timeout=10)


def _valid_frames(run: str, sender: int, key: str = "s/0", data: torch.Tensor | None = None) -> list:
    data = torch.zeros(2) if data is None else data
    header = codec.Header(run=run, round=0, op="monitor", chunk=0, sender=sender, key=key)
    return codec.encode(header, [torch.tensor([data.numel()], dtype=torch.int64), data])


def test_malformed_messages_are_dropped_counted_and_harmless(groups):
    g = groups(2, timeout_s=5.0, run_id="run-ok", chunk_bytes=1000, max_message_bytes=100_000)
    target = g.exchanges[0]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    spoof = ctx.socket(zmq.DEALER)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"7")
        raw.connect(target.endpoints[0])
        hostile = [
            [b"\xc1garbage"],                                               # not msgpack
            [msgpack.packb([1, 2, 3])],                                     # not a map
            _valid_frames("other-run", sender=7),                           # wrong run id
            _valid_frames("run-ok", sender=7, data=torch.zeros(30_000)),    # 120 kB > max_message_bytes
            _valid_frames("run-ok", sender=1),                              # sender does not match the connection
            _valid_frames("run-ok", sender=7),                              # not a peer of this group
            [_valid_frames("run-ok", sender=7)[0]],                         # payload frames missing
        ]
        for frames in hostile:
            raw.send_multipart(frames, copy=True)
        assert wait_until(lambda: target.malformed_messages == len(hostile)), target.malformed_messages
        # Another process claiming to be peer 1 (a well-formed routing id of another incarnation)
        # while peer 1's own connection is up is refused: its chunk never lands.
        out = run_all([lambda: g.exchanges[0].swap("s/9", 1, torch.tensor([1.0, 2.0])),
                       lambda: g.exchanges[1].swap("s/9", 0, torch.tensor([3.0, 4.0]))])
        assert out[0].tolist() == [3.0, 4.0]
        assert target.inspect(lambda node: target.admission.is_pinned(1))  # peer 1's chunks pinned its process
        spoof.setsockopt(zmq.LINGER, 0)
        spoof.setsockopt(zmq.ROUTING_ID, b"1.deadbeef")
        spoof.connect(target.endpoints[0])
        spoof.send_multipart(_valid_frames("run-ok", sender=1, data=torch.tensor([9.0, 9.0])), copy=True)
        assert wait_until(lambda: target.malformed_messages == len(hostile) + 1)
        assert target.members() == [0, 1]
        out = run_all([lambda: g.exchanges[0].swap("s/0", 1, torch.tensor([1.0, 2.0])),
                       lambda: g.exchanges[1].swap("s/0", 0, torch.tensor([3.0, 4.0]))])
        assert out[0].tolist() == [3.0, 4.0] and out[1].tolist() == [1.0, 2.0]
    finally:
        raw.close(linger=0)
        spoof.close(linger=0)
        ctx.term()


def test_different_run_ids_never_mix():
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    a = ZmqExchange(0, endpoints, "run-a", timeout_s=0.5)
    b = ZmqExchange(1, endpoints, "run-b", timeout_s=0.5)
    try:
        assert a.wait_connected(5.0) and b.wait_connected(5.0)
        with ThreadPoolExecutor(max_workers=2) as pool:
            fa = pool.submit(a.swap, "s/0", 1, torch.ones(3))
            fb = pool.submit(b.swap, "s/0", 0, torch.zeros(3))
            for f in (fa, fb):
                with pytest.raises(ExchangeTimeout):
                    f.result(timeout=10)
        assert a.malformed_messages >= 1 and b.malformed_messages >= 1
    finally:
        a.close()
        b.close()


def test_close_wakes_a_waiting_call_with_exchange_closed(groups):
    g = groups(2, timeout_s=30.0)
    ex = g.exchanges[0]
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(ex.swap, "s/0", 1, torch.zeros(4))
        assert wait_until(lambda: ex.inspect(lambda node: "s/0" in node.active_keys()))
        start = time.monotonic()
        ex.close()
        with pytest.raises(ExchangeClosed):
            future.result(timeout=5)
        assert time.monotonic() - start < 2.0
    with pytest.raises(ExchangeClosed):
        ex.all_reduce_mean("k", torch.zeros(1), [0, 1])
    ex.close()  # idempotent


def test_header_op_and_round_come_from_the_key():
    assert _op_and_round("mix1/12") == ("mix1", 12)
    assert _op_and_round("mix2/3/embed") == ("mix2", 3)
    assert _op_and_round("grad/7") == ("grad", 7)
    assert _op_and_round("cd/4") == ("monitor", 4)
    assert _op_and_round("k") == ("monitor", 0)


# -- membership, aborts, state transfer, fault injection -------------------------------------------


def test_a_returning_peer_is_pending_until_it_says_hello_and_joins_from_its_round(groups):
    g = groups(3)
    ex0, ex1 = g.exchanges[0], g.exchanges[1]
    assert ex0.members(0) == [0, 1, 2]
    g.crash(2)
    assert wait_until(lambda: ex0.members() == [0, 1] and ex1.members() == [0, 1])
    back = g.restart(2)
    assert back.wait_connected(10.0)
    assert wait_until(lambda: 2 in ex0.pending() and 2 in ex1.pending())
    assert ex0.members(5) == [0, 1]  # connected again, but not taking part yet

    ex0.current_round, ex1.current_round = 7, 6
    assert back.ask_rounds(5.0) == {0: 7, 1: 6}  # a probe changes nothing and asks for rounds
    assert ex0.members(5) == [0, 1]
    back.announce(8, ask_reply=False)
    assert wait_until(lambda: 2 in ex0.members(8) and 2 in ex1.members(8))
    assert ex0.members(7) == [0, 1] and ex0.pending() == []
    assert back.members(7) == [2] and back.members(8) == [0, 1, 2]  # alone before its join round
    values = [torch.full((10,), float(r)) for r in range(3)]
    out = run_all([lambda r=r: g.exchanges[r].all_reduce_mean("mix1/8", values[r], [0, 1, 2]) for r in range(3)])
    assert all(torch.equal(o, torch.full((10,), 1.0)) for o in out)


def test_a_failed_call_aborts_the_others_at_once(groups):
    g = groups(3, timeout_s=20.0)
    sizes = [100, 100, 77]  # rank 2 is inconsistent: its neighbour detects it and abandons the call
    start = time.monotonic()
    results = run_all([lambda r=r: _outcome(lambda: g.exchanges[r].all_reduce_mean("k/1", torch.ones(sizes[r]), [0, 1, 2]))
                       for r in range(3)])
    assert time.monotonic() - start < 5.0, "the others must not wait out the 20 s deadline"
    assert all(isinstance(res, PeerFailed) for res in results), results


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc


def test_state_download_is_chunked_exact_and_refused_when_there_is_none(groups):
    g = groups(2, chunk_bytes=1024, max_message_bytes=1 << 20)
    donor, newcomer = g.exchanges
    with pytest.raises(PeerFailed, match="no state"):
        newcomer.fetch_state(0)
    state = torch.randn(5000)
    donor.serve_state(lambda: (12, state))
    round_index, got = newcomer.fetch_state(0)
    assert round_index == 12 and torch.equal(got, state)
    assert newcomer.bytes_received >= state.numel() * 4


def test_fault_injection_spec_is_parsed_strictly():
    import signal

    from gossiploco.transport.fault_injection import parse_fault as _parse_fault

    assert _parse_fault(None) is None
    assert _parse_fault("KILL:mix1/2:3") == (int(signal.SIGKILL), "mix1/2", 3)
    assert _parse_fault("stop:monitor/1/0:0") == (int(signal.SIGSTOP), "monitor/1/0", 0)
    for bad in ("KILL", "NOPE:mix1/2:3", "KILL:mix1/2:x"):
        with pytest.raises(ValueError, match="SIGNAL:KEY:CHUNK"):
            _parse_fault(bad)


def test_fault_injection_is_a_hook_passed_in_and_read_from_the_environment_only_where_a_peer_is_built(monkeypatch):
    from gossiploco.errors import ConfigError
    from gossiploco.protocol.messages import Data
    from gossiploco.transport.fault_injection import FAULT_ENV, Fault, hook_from_env

    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert hook_from_env() is None
    monkeypatch.setenv(FAULT_ENV, "KILL:mix1/2:3")
    hook = hook_from_env()
    assert hook.__self__ == Fault(int(signal.SIGKILL), "mix1/2", 3)
    monkeypatch.setenv(FAULT_ENV, "KILL:mix1")
    with pytest.raises(ConfigError, match=FAULT_ENV):
        hook_from_env()
    # The exchange never reads the variable (it is malformed here); it calls the hook it was given before each send.
    seen: list[tuple[int, object]] = []
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    ex = [ZmqExchange(r, endpoints, "hook", 5.0, chunk_bytes=4096, fault=(lambda rank, m: seen.append((rank, m))) if r == 0
                      else None) for r in range(2)]
    try:
        assert ex[0].wait_connected(5.0) and ex[1].wait_connected(5.0)
        run_all([lambda r=r: ex[r].swap("s/0", 1 - r, torch.zeros(3000)) for r in range(2)])
        chunks = sorted(m.chunk for rank, m in seen if isinstance(m, Data) and m.key == "s/0")
        assert chunks == [0, 1, 2] and {rank for rank, _ in seen} == {0}  # 3000 floats in 1024-float chunks
    finally:
        for e in ex:
            e.close()


def test_peers_that_disagree_on_the_member_list_fail_at_once(groups):
    g = groups(3, timeout_s=20.0)
    views = [[0, 1, 2], [0, 1, 2], [1, 2]]  # rank 2 missed that rank 0 is back
    start = time.monotonic()
    results = run_all([lambda r=r: _outcome(lambda: g.exchanges[r].all_reduce_mean("mix1/3", torch.ones(300), views[r]))
                       for r in range(3)])
    assert time.monotonic() - start < 5.0, "a member-list mismatch must not wait out the deadline"
    assert all(isinstance(res, PeerFailed) for res in results), results
    assert any("another member list" in str(res) for res in results)


def test_a_message_that_cannot_be_encoded_fails_its_send_counted_and_never_the_thread(groups):
    """A message the codec refuses (here a key naming a round past what a header holds) is not sent: logged, counted
    in ``traffic.unencodable``, and only that send fails. Sent by the service thread (the node's replies) or by a
    caller (its own chunks), the exchange stays whole and the next exchange completes."""
    g = groups(2, timeout_s=5.0)
    ex = g.exchanges[0]
    beyond = f"mix2/{2**64}"
    ex._dispatch([Send(1, Ready(beyond, 2**64))])  # as if the node had decided to reply so
    assert wait_until(lambda: ex.traffic.unencodable == 1)
    with pytest.raises(ExchangeError, match="cannot be encoded"):
        ex.swap(beyond, 1, torch.ones(3))
    assert wait_until(lambda: ex.traffic.unencodable == 3)  # its chunk, then the abort the failed call sends
    assert ex.broken is None and all(t.is_alive() for t in ex.threads)
    out = run_all([lambda: g.exchanges[0].swap("s/1", 1, torch.tensor([1.0])),
                   lambda: g.exchanges[1].swap("s/1", 0, torch.tensor([2.0]))])
    assert [o.tolist() for o in out] == [[2.0], [1.0]]
