"""What any libp2p node can do to a gossiploco DHT node's stream handlers: ask its relay, hold relayed
streams open, announce a huge frame. Each is a coroutine run inside a DHT node's process
(``dht.run_coroutine(partial(fn, ...))``): an outsider's bare hivemind node (``testbed.outsider.outsider_dht``)
or a member's (``testbed.members.MemberNode``, whose relay requests carry its credentials). For
``tests/test_relay.py`` and ``bench/attacks_relay.py``.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import msgpack

HELD: list[Any] = []
"""Streams ``hold_splices`` keeps open in this process (closed by ``release_splices``)."""


async def _open(node: Any, address: str, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    from gossiploco.reach.relay import split_relay

    transport, peer = split_relay(address)
    await node.p2p._client.connect(peer, [transport])
    _, reader, writer = await node.p2p.call_binary_stream_handler(peer, protocol)
    return reader, writer


async def ask_relay(_dht: Any, node: Any, *, relay: str, target: str, run: str = "", proof: bytes | None = None
                    ) -> str:
    """One relay request for ``target`` (``proof`` None: this process's own credentials, empty for an outsider);
    the relay's status, the stream closed at once."""
    from gossiploco.reach.relay import Credentials, credentials, through
    from gossiploco.reach.streams import close

    creds = credentials() if proof is None else Credentials(run, proof)
    try:
        _, writer, _ = await asyncio.wait_for(through(node.p2p, relay, target, creds), 15)
    except Exception as exc:  # noqa: BLE001 - a refusal, or the daemon's error: reported as such
        return str(exc).removeprefix("the relay refused: ") or type(exc).__name__
    close(writer)
    return "ok"


async def hold_splices(_dht: Any, node: Any, *, relay: str, target: str, count: int, run: str | None = None
                       ) -> list[str]:
    """Ask ``relay`` for ``count`` streams to ``target`` at once with this process's credentials (``run``: naming
    that run with no proof, as an outsider who knows the run id would) and keep the granted ones open (each says
    a tunnel hello, so the target holds its end too): their statuses."""
    from gossiploco.reach.relay import Credentials, through
    from gossiploco.reach.tunnel import HELLO, SESSION_BYTES

    async def one() -> str:
        try:
            creds = None if run is None else Credentials(run, b"")
            reader, writer, _ = await asyncio.wait_for(through(node.p2p, relay, target, creds), 15)
        except Exception as exc:  # noqa: BLE001 - a refusal, or the daemon's error: reported as such
            return str(exc).removeprefix("the relay refused: ") or type(exc).__name__
        writer.write(HELLO + secrets.token_bytes(SESSION_BYTES))
        await writer.drain()
        HELD.append((reader, writer))
        return "ok"

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def release_splices(_dht: Any, _node: Any) -> int:
    """Close the streams ``hold_splices`` holds; how many there were."""
    from gossiploco.reach.streams import close

    count = len(HELD)
    for _, writer in HELD:
        close(writer)
    HELD.clear()
    return count


async def _read_answer(reader: asyncio.StreamReader, limit: int = 4096) -> bytes:
    """The other side's first answer: a whole length-prefixed frame when it sends one (the prefix and the body may
    arrive in separate reads), else whatever came before the stream closed."""
    said = b""
    try:
        said = await reader.readexactly(8)
        length = int.from_bytes(said, "big")
        if length <= limit:
            said += await reader.readexactly(length)
    except asyncio.IncompleteReadError as short:
        said += short.partial
    return said


async def announce_huge_frame(_dht: Any, node: Any, *, address: str, protocol: str, announced: int = 1 << 40,
                              send_bytes: int = 32 << 20, header: bytes | None = None, send_s: float = 10.0) -> dict:
    """Open ``protocol`` on the node at ``address``, announce a frame of ``announced`` bytes (hivemind's 8-byte
    length prefix, or ``header`` as given) and send up to ``send_bytes`` of it within ``send_s``: how many bytes
    the other side took before it closed the stream, and what it answered."""
    reader, writer = await _open(node, address, protocol)
    answer = asyncio.ensure_future(_read_answer(reader))  # whatever the other side says, while we send
    writer.write(header if header is not None else announced.to_bytes(8, "big"))
    chunk, sent, closed = b"\0" * (1 << 16), 0, False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + send_s
    try:
        while sent < send_bytes and loop.time() < deadline:
            if writer.is_closing():  # the other side cut the stream off
                closed = True
                break
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), max(0.01, deadline - loop.time()))
            sent += len(chunk)
    except (OSError, ConnectionError, asyncio.TimeoutError):
        closed = True
    except RuntimeError:  # uvloop's "handler is closed": a write raced the other side's reset
        if not writer.is_closing():
            raise
        closed = True
    try:
        said = await asyncio.wait_for(answer, 2.0)
    except (OSError, ConnectionError, asyncio.TimeoutError):
        said = b""
    writer.close()
    status = None
    if len(said) > 8:
        try:
            status = msgpack.unpackb(said[8:], raw=False).get("status")
        except Exception:  # noqa: BLE001 - not the relay's answer
            status = None
    return {"sent": sent, "cut_off": closed, "answer": status or said[:64].hex()}


RECEIVED = [0]
"""Bytes ``serve_sink``'s handler received in this process."""


async def serve_sink(_dht: Any, node: Any, *, protocol: str) -> None:
    """Serve ``protocol`` on this node: read every stream to its end, counting the bytes (``sink_bytes``)."""
    async def handle(_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                RECEIVED[0] += len(chunk)
        except (OSError, ConnectionError):
            pass
        writer.close()

    await node.p2p.add_binary_stream_handler(protocol, handle)


async def sink_bytes(_dht: Any, _node: Any) -> int:
    return RECEIVED[0]
