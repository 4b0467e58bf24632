"""Length-prefixed frames on a p2pd stream, with the length checked before anything is read.

hivemind's ``P2P.receive_raw_data`` reads whatever length the 8-byte prefix announces (``readexactly(n)``
buffers until ``n`` bytes came): a stranger announcing a 1 TiB frame grows the reader's process by
whatever it sends. ``receive_frame`` refuses a prefix above the caller's limit at once, before reading
the body. ``send_frame`` is hivemind's own writer (the same wire format), so either end may be hivemind's.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from gossiploco.errors import MalformedMessage


class OversizedFrame(MalformedMessage):
    """A frame's length prefix announced more than the reader accepts (nothing of its body was read)."""


async def receive_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """One frame of at most ``max_bytes`` bytes; ``OversizedFrame`` (a ``MalformedMessage``) for a longer one,
    ``asyncio.IncompleteReadError`` when the stream ends first. Put a deadline around it (``asyncio.wait_for``)."""
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > max_bytes:
        raise OversizedFrame(f"a frame of {length} bytes announced; at most {max_bytes} accepted")
    return await reader.readexactly(length)


async def send_frame(data: bytes, writer: asyncio.StreamWriter) -> None:
    """Write ``data`` as one length-prefixed frame and drain."""
    await P2P.send_raw_data(data, writer)
