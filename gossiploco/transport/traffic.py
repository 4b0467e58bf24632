"""Byte accounting of one peer's sends: what it put on the wire, and what it had to drop.

``payload_sent`` counts the data chunks' values (``Exchange.bytes_sent``: what the mixing moved);
``wire_sent`` every message's codec frames (headers and payloads, control messages and state
uploads included; not the transport's own framing, encryption or TCP/IP headers); ``control_sent``
the messages other than data chunks (hellos, readies, decisions, aborts, state requests; ZMTP
heartbeats are the transport's own and not counted), by kind in ``control_kinds``; ``dropped`` the
control messages the service thread's full queue refused; ``unencodable`` the messages the codec refused to
encode (not sent: that send fails, the thread that tried goes on). Bytes received are counted where chunks
arrive, by the protocol (``PeerNode.bytes_received``). Thread-safe: any sending thread counts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from gossiploco.protocol.messages import Data, Message


class Traffic:
    """Counters of this peer's sends; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.payload_sent = 0
        self.wire_sent = 0
        self.dropped = 0
        self.unencodable = 0
        self.control_sent = 0
        self.control_kinds: dict[str, int] = {}
        """Messages other than ``Data`` sent, by class name (``Ready``, ``Decision``, ``Hello``...)."""

    def sent(self, message: Message, frames: Sequence) -> None:
        """``message`` went out as ``frames`` (bytes, buffers or zmq frames)."""
        wire = sum(memoryview(f).nbytes for f in frames)
        payload = message.data.numel() * message.data.element_size() if isinstance(message, Data) else 0
        with self._lock:
            self.wire_sent += wire
            self.payload_sent += payload
            if not isinstance(message, Data):
                self.control_sent += 1
                kind = type(message).__name__
                self.control_kinds[kind] = self.control_kinds.get(kind, 0) + 1

    def control_counts(self) -> dict[str, int]:
        """A copy of ``control_kinds`` (read from any thread)."""
        with self._lock:
            return dict(self.control_kinds)

    def drop(self) -> None:
        """A message could not even be queued."""
        with self._lock:
            self.dropped += 1

    def refuse(self) -> None:
        """A message could not be encoded (``codec.encode`` refused it), so it was not sent."""
        with self._lock:
            self.unencodable += 1
