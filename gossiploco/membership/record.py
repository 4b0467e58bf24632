"""A peer's record in its run's directory: what it tells the others about itself, and the strict
validation of such records when they come from the network (``PeerRecord.from_wire``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gossiploco.protocol.messages import MAX_PEER_ID

PROTOCOL_VERSION = 2
"""Version of ``PeerRecord``'s wire format; records of another version are ignored (2: the ``key`` field)."""
MAX_COUNT = 2**63
"""``round`` and ``tokens`` fit a signed 64-bit integer."""
MAX_ENDPOINT_CHARS = 256
ENDPOINT_PATTERN = re.compile(r"tcp://[^\s/]+:([0-9]{1,5})")
"""A data-plane endpoint, matched whole: ``tcp://HOST:PORT`` (no path, no whitespace, ASCII port digits)."""
WIRE_FIELDS = frozenset({"peer", "endpoint", "round", "tokens", "version", "key"})
KEY_BYTES = 32


class IncompatibleRecord(ValueError):
    """A record of another ``PROTOCOL_VERSION`` (a peer running another gossiploco release)."""

    def __init__(self, version: Any):
        self.version = version
        super().__init__(f"record has protocol version {version!r}, this peer speaks {PROTOCOL_VERSION}")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) with ``low <= value < high``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value < high:
        raise ValueError(f"{name} must be in {low}..{high - 1}, got {value}")


@dataclass(frozen=True)
class PeerRecord:
    """What a peer tells the run about itself. Construction validates every field (``ValueError``)."""

    peer: int
    """Peer id, unique within a run: ``0 <= peer < 2**31``."""
    endpoint: str
    """``tcp://HOST:PORT`` of the peer's ZeroMQ data-plane socket."""
    round: int
    """The round the peer is in; -1 before its first round."""
    tokens: int
    """Tokens the peer has processed so far."""
    version: int = PROTOCOL_VERSION
    """Wire-format version of the record."""
    key: bytes = b""
    """The peer's Curve25519 public key (its data-plane identity; ``peer`` is derived from it), or
    empty where no key is used (unit tests of the directory)."""

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) not in (0, KEY_BYTES):
            raise ValueError(f"key must be {KEY_BYTES} bytes (or empty), got {type(self.key).__name__} "
                             f"of length {len(self.key) if isinstance(self.key, (bytes, str)) else '?'}")
        _check_int("peer", self.peer, 0, MAX_PEER_ID)
        if not isinstance(self.endpoint, str):
            raise ValueError(f"endpoint must be a str, got {type(self.endpoint).__name__}")
        if len(self.endpoint) > MAX_ENDPOINT_CHARS:
            raise ValueError(f"endpoint is {len(self.endpoint)} characters long, at most {MAX_ENDPOINT_CHARS} allowed")
        match = ENDPOINT_PATTERN.fullmatch(self.endpoint)
        if match is None:
            raise ValueError(f"endpoint must look like tcp://HOST:PORT, got {self.endpoint!r}")
        if not 1 <= int(match.group(1)) <= 65535:
            raise ValueError(f"endpoint port must be in 1..65535, got {self.endpoint!r}")
        _check_int("round", self.round, -1, MAX_COUNT)
        _check_int("tokens", self.tokens, 0, MAX_COUNT)
        _check_int("version", self.version, 1, MAX_PEER_ID)

    def to_wire(self) -> dict[str, Any]:
        """The record as a plain dict of str and int (msgpack-able)."""
        return {"version": self.version, "peer": self.peer, "endpoint": self.endpoint,
                "round": self.round, "tokens": self.tokens, "key": self.key}

    @classmethod
    def from_wire(cls, obj: Any) -> PeerRecord:
        """Validate data from the network and build the record.

        Raises ``IncompatibleRecord`` (a ``ValueError``) when ``obj`` is a record of another
        ``PROTOCOL_VERSION``, and ``ValueError`` naming the first problem for anything else that is
        not exactly a valid record of this version (wrong type, missing or unknown field, out of range).
        """
        if not isinstance(obj, dict):
            raise ValueError(f"record must be a dict, got {type(obj).__name__}")
        version = obj.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"record version must be an int, got {type(version).__name__}")
        if version != PROTOCOL_VERSION:
            raise IncompatibleRecord(version)
        keys = set(obj)
        if keys != WIRE_FIELDS:
            problems = []
            if WIRE_FIELDS - keys:
                problems.append("missing " + ", ".join(sorted(WIRE_FIELDS - keys)))
            if keys - WIRE_FIELDS:
                unknown = sorted(repr(key)[:40] for key in keys - WIRE_FIELDS)
                problems.append("unknown " + ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else ""))
            raise ValueError(f"record has wrong fields ({'; '.join(problems)}); version {PROTOCOL_VERSION} "
                             f"records have exactly {', '.join(sorted(WIRE_FIELDS))}")
        return cls(peer=obj["peer"], endpoint=obj["endpoint"], round=obj["round"], tokens=obj["tokens"],
                   version=version, key=obj["key"])
