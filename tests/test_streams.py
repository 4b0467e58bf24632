"""``reach.streams.carry`` over loopback TCP (the stream a relay would carry stood in for by a plain connection): a
hand-over moves every byte, and a carry that ends leaves no task of its own behind."""

from __future__ import annotations

import asyncio

import pytest

from gossiploco.reach.streams import carry


async def _pair() -> tuple[tuple, tuple]:
    """Two ends of one loopback TCP connection, each a (reader, writer)."""
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()
    server = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    dialed = await asyncio.open_connection("127.0.0.1", port)
    other = await accepted
    server.close()
    return dialed, other


def _pending_reads() -> list[asyncio.Task]:
    """carry's own tasks still pending: a read of a connection, or a wait for the hand-over signal."""
    return [t for t in asyncio.all_tasks() if not t.done()
            and getattr(t.get_coro(), "__qualname__", "") in ("StreamReader.read", "Event.wait")]


def test_a_carry_that_ends_leaves_no_pending_read_behind():
    """The stream ends (its relay died) while the local side is idle: carry returns False, and no read of the local
    connection is left waiting (one left would take bytes from the connection, or be destroyed while pending: logged
    as an error by asyncio in every peer's DHT process)."""

    async def scenario() -> None:
        (local_app, local), (stream, stream_far) = await _pair(), await _pair()
        task = asyncio.ensure_future(carry(local, stream, renew_after=(1e9, 1e9)))
        await asyncio.sleep(0.05)
        stream_far[1].close()  # the far end of the stream goes away
        assert await asyncio.wait_for(task, 5.0) is False
        await asyncio.sleep(0)  # cancellations take one step of the loop
        assert _pending_reads() == []
        for _, writer in (local_app, local, stream, stream_far):
            writer.close()

    asyncio.run(scenario())


@pytest.mark.slow  # two of carry's one-second looks at a quiet link
def test_a_hand_over_moves_every_byte_both_ways_and_the_connection_goes_on_over_the_next_stream():
    async def scenario() -> None:
        (app, local), (dial_stream, serve_stream) = await _pair(), await _pair()
        (router, router_local) = await _pair()
        dialing = asyncio.ensure_future(carry(local, dial_stream, renew_after=(1.0, 1e9)))  # due once a byte moved
        serving = asyncio.ensure_future(carry(router_local, serve_stream))
        app[1].write(b"a" * 10_000)
        router[1].write(b"b" * 10_000)
        assert await asyncio.wait_for(asyncio.gather(dialing, serving), 10.0) == [True, True]  # quiet: handed over
        assert _pending_reads() == []
        (dial_next, serve_next) = await _pair()
        dialing = asyncio.ensure_future(carry(local, dial_next))
        serving = asyncio.ensure_future(carry(router_local, serve_next))
        app[1].write(b"c" * 5)
        router[1].write(b"d" * 5)
        assert await asyncio.wait_for(router[0].readexactly(10_005), 5.0) == b"a" * 10_000 + b"c" * 5
        assert await asyncio.wait_for(app[0].readexactly(10_005), 5.0) == b"b" * 10_000 + b"d" * 5
        for task in (dialing, serving):
            task.cancel()
        await asyncio.gather(dialing, serving, return_exceptions=True)
        for _, writer in (app, local, dial_stream, serve_stream, router, router_local, dial_next, serve_next):
            writer.close()

    asyncio.run(scenario())
