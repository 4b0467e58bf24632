"""Byte pipes between asyncio streams: the raw splice a relay runs, and the framed carry of a
tunnel, which can hand a connection over to a new stream without losing a byte.

A tunnel carries one ZeroMQ connection over a sequence of libp2p streams (``reach.tunnel``). On a
stream its bytes travel in frames (``FRAME``: a 4-byte big-endian length, then that many bytes); a
frame of length 0 is ``END``: the sender will send nothing more on this stream. To renew a stream
(before a relay's limits cut it, ``reach.relay.Limits``), the dialing side stops reading its local
connection and sends ``END``; the other side, on ``END``, stops reading its own and answers
``END``. Everything sent before either ``END`` has then been delivered, so both sides go on, over
the next stream, from exactly where they stopped. A stream that breaks without ``END`` (a relay
died) cannot be resumed: the local connection closes and ZeroMQ reconnects, a fault like any other.
"""

from __future__ import annotations

import asyncio
import math
import struct
import time
from dataclasses import dataclass, field

READ_BYTES = 1 << 18
FRAME = struct.Struct(">I")
MAX_FRAME = READ_BYTES
END = FRAME.pack(0)
RENEW_IDLE_S = 1.0
QUIET_BYTES = 4096
"""A connection due for renewal is handed over once it carried less than ``QUIET_BYTES`` each way in
``RENEW_IDLE_S`` (between exchanges: ZeroMQ's heartbeats, a few dozen bytes a second, keep flowing)."""

HANDOVER_S = 10.0
"""How long a side waits for the other's ``END`` (or to drain its own) during a hand-over."""

Pair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class TunnelStats:
    """Counters of one node's tunnels and relaying, for its peer's summary."""

    opened: int = 0
    served: int = 0
    failed: int = 0
    """Sessions no relay could carry: every relay was down, refused, or did not answer in time."""
    unreachable: int = 0
    """Sessions a relay answered but could not carry because the target was unreachable or unknown to it (a peer
    that left: ZeroMQ redials it, with the tunnel's backoff, for as long as this peer runs). Not a relay failure."""
    refused: int = 0
    renewed: int = 0
    resumed: int = 0
    limit_cuts: int = 0
    idle_cuts: int = 0
    relayed: int = 0
    bytes: float = 0.0
    """Payload bytes moved so far (both ways; counted as they move)."""
    last_error: str = ""
    relays_used: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    """Relay requests refused, by reason (``reach.relay``: ``not a member``, ``slots``, ...)."""


STATS = TunnelStats()
"""This process's counters (each DHT process has its own)."""


def close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except Exception:  # noqa: BLE001 - already closed by the other side
        pass


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: list[float],
                limit: float = math.inf, seen: list[float] | None = None) -> None:
    """Copy until EOF, an error, or ``limit`` bytes; ``counter`` = [bytes]; ``seen`` = [monotonic time of the
    last bytes moved] (shared by both directions of a splice, for its idle limit)."""
    try:
        while counter[0] < limit:
            data = await reader.read(int(min(READ_BYTES, max(1, limit - counter[0]))))
            if not data:
                break
            writer.write(data)
            await writer.drain()
            counter[0] += len(data)
            STATS.bytes += len(data)
            if seen is not None:
                seen[0] = time.monotonic()
    except (OSError, asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        close(writer)


async def splice(a: Pair, b: Pair, *, data_limit: float = math.inf, time_limit: float = math.inf,
                 idle_limit: float = math.inf) -> str:
    """A relay's raw copy both ways until one side ends or a limit is reached: ``data_limit`` bytes in
    either direction, ``time_limit`` seconds in all, ``idle_limit`` seconds without a byte either way;
    then both are closed. Returns why it ended: ``"ended"``, ``"data"``, ``"time"`` or ``"idle"`` (a limit
    is counted in ``STATS.limit_cuts`` or ``STATS.idle_cuts``)."""
    up, down, seen = [0.0], [0.0], [time.monotonic()]
    tasks = [asyncio.ensure_future(_pipe(a[0], b[1], up, data_limit, seen)),
             asyncio.ensure_future(_pipe(b[0], a[1], down, data_limit, seen))]
    began = time.monotonic()
    why = "ended"
    try:
        while True:
            now = time.monotonic()
            left = min(time_limit - (now - began), idle_limit - (now - seen[0]))
            if left <= 0:
                why = "time" if now - began >= time_limit else "idle"
                break
            done, _ = await asyncio.wait(tasks, timeout=None if math.isinf(left) else left,
                                         return_when=asyncio.FIRST_COMPLETED)
            if done:
                why = "data" if max(up[0], down[0]) >= data_limit else "ended"
                break
        if why == "idle":
            STATS.idle_cuts += 1
        elif why != "ended":
            STATS.limit_cuts += 1
        return why
    finally:
        for task in tasks:
            task.cancel()
        close(a[1])
        close(b[1])


async def carry(local: Pair, stream: Pair, *, renew_after: tuple[float, float] | None = None) -> bool:
    """Carry ``local`` (a TCP connection to ZeroMQ) over ``stream`` in frames until one ends (False:
    the caller closes ``local``) or the stream is handed over cleanly (True: ``local`` goes on over
    the next stream). ``renew_after`` (bytes, seconds): on the dialing side, hand over once past
    either and quiet (see the module docstring); the other side hands over when asked."""
    began = time.monotonic()
    pause = asyncio.Event()
    moved = [0.0, 0.0]  # bytes up (local -> stream), down

    async def up() -> str:
        read = paused = None
        try:
            while True:
                if pause.is_set():  # hand over: everything read so far is sent; say so
                    stream[1].write(END)
                    await stream[1].drain()
                    return "end"
                read = asyncio.ensure_future(local[0].read(READ_BYTES))
                paused = asyncio.ensure_future(pause.wait())
                await asyncio.wait({read, paused}, return_when=asyncio.FIRST_COMPLETED)
                paused.cancel()
                if not read.done():  # cancelled while waiting, a read takes nothing from the connection
                    read.cancel()
                    continue
                data = read.result()
                if not data:
                    return "eof"
                stream[1].write(FRAME.pack(len(data)) + data)
                await stream[1].drain()
                moved[0] += len(data)
                STATS.bytes += len(data)
        finally:  # cancelled from outside (the carry ended): a read left pending would take the next stream's bytes
            for task in (read, paused):
                if task is not None and not task.done():
                    task.cancel()

    async def down() -> str:
        while True:
            (size,) = FRAME.unpack(await stream[0].readexactly(FRAME.size))
            if size == 0:
                return "end"
            if size > MAX_FRAME:
                return "eof"  # not our framing: drop the connection
            local[1].write(await stream[0].readexactly(size))
            await local[1].drain()
            moved[1] += size
            STATS.bytes += size

    ups, downs = asyncio.ensure_future(up()), asyncio.ensure_future(down())
    seen = (0.0, 0.0)
    try:
        while True:
            done, _ = await asyncio.wait({ups, downs}, timeout=RENEW_IDLE_S, return_when=asyncio.FIRST_COMPLETED)
            if downs in done and _result(downs) == "end" and renew_after is None:
                pause.set()  # the other side handed over: answer END once our side is drained
                await asyncio.wait({ups}, timeout=HANDOVER_S)
                return ups.done() and _result(ups) == "end"
            if downs in done and _result(downs) == "end" and pause.is_set() and not ups.done():
                # the other side answered our END before our side finished sending it (a slow drain): still a clean
                # hand-over once it is sent
                await asyncio.wait({ups}, timeout=HANDOVER_S)
                return ups.done() and _result(ups) == "end"
            if done and not (ups in done and _result(ups) == "end"):
                return False  # EOF or an error on either side
            if ups in done:  # we sent END; the other side's END follows what it sent before
                await asyncio.wait({downs}, timeout=HANDOVER_S)
                return downs.done() and _result(downs) == "end"
            if renew_after is not None and not pause.is_set():
                worn = max(moved) >= renew_after[0] or time.monotonic() - began >= renew_after[1]
                quiet = moved[0] - seen[0] < QUIET_BYTES and moved[1] - seen[1] < QUIET_BYTES
                seen = (moved[0], moved[1])
                if worn and quiet:
                    pause.set()
    except (OSError, asyncio.IncompleteReadError, ConnectionError):
        return False
    finally:
        for task in (ups, downs):
            task.cancel()


def _result(task: asyncio.Future) -> str:
    """A pipe task's outcome; an exception (the stream or the connection broke) reads as EOF."""
    if task.cancelled() or task.exception() is not None:
        return "eof"
    return task.result()
