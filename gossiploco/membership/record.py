"""A peer's record in its run's directory: what it tells the others about itself, and the strict
validation of such records when they come from the network (``PeerRecord.from_wire``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gossiploco.protocol.messages import MAX_PEER_ID

PROTOCOL_VERSION = 7
"""Version of ``PeerRecord``'s wire format; records of another version are ignored (2: the ``key``
field; 3: reachability, ``p2p``, ``relays`` and ``reverse``; 4: the protocol's ``Leading`` message, which
older peers would refuse as malformed; 5: ``joined``; 6: ``Hello.began_ms_ago``, a hello older peers would refuse;
7: a question says its sender's join round and is not asked back, where older peers' questions say none)."""
MAX_COUNT = 2**63
"""``round`` and ``tokens`` fit a signed 64-bit integer."""
MAX_ENDPOINT_CHARS = 256
ENDPOINT_PATTERN = re.compile(r"tcp://[^\s/]+:([0-9]{1,5})")
"""A data-plane endpoint, matched whole: ``tcp://HOST:PORT`` (no path, no whitespace, ASCII port digits)."""
WIRE_FIELDS = frozenset({"peer", "endpoint", "round", "tokens", "version", "key", "reachable", "p2p", "relays",
                         "reverse", "joined"})
KEY_BYTES = 32
MAX_RELAYS = 8
MAX_REVERSE = 512
"""Reverse connections one reachable peer offers at most (one per member behind NAT)."""
P2P_ID_PATTERN = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}")
"""A libp2p peer id in base58."""
RELAY_PATTERN = re.compile(r"/(ip4|ip6|dns|dns4|dns6)/[^\s/]+/tcp/[0-9]{1,5}/p2p/[1-9A-HJ-NP-Za-km-z]{32,64}")
"""A relay's multiaddr with its peer id."""


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
    reachable: bool = True
    """Whether others can dial ``endpoint`` (the peer's dial-back check, ``gossiploco.reach.dialback``)."""
    p2p: str = ""
    """The libp2p peer id of its DHT node (where its tunnel handler runs; empty: none)."""
    relays: tuple[str, ...] = ()
    """Relays (multiaddrs with ``/p2p/``) through which a peer behind NAT is reached."""
    reverse: tuple[tuple[int, int, int], ...] = ()
    """Reverse connections this (reachable) peer offers: ``(peer behind NAT, data port, control
    port)``, ports on ``endpoint``'s host that the NAT'd peer dials (``gossiploco.reach.paths``)."""
    joined: int = -1
    """The first round the peer takes part in, as its latest news said (``PeerNode.announce``); -1: it has not
    decided (starting, or stepping out while it catches up). With links on demand a peer that finds a new member
    admits it from this, as its news would (``PeerTable.add``): the news goes to a sample of the members only."""

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
        _check_int("joined", self.joined, -1, MAX_COUNT)
        self._check_reach()

    def _check_reach(self) -> None:
        if not isinstance(self.reachable, bool):
            raise ValueError(f"reachable must be a bool, got {type(self.reachable).__name__}")
        if not isinstance(self.p2p, str) or (self.p2p and not P2P_ID_PATTERN.fullmatch(self.p2p)):
            raise ValueError(f"p2p must be a base58 libp2p peer id, got {str(self.p2p)[:80]!r}")
        if not isinstance(self.relays, tuple) or len(self.relays) > MAX_RELAYS:
            raise ValueError(f"relays must be a tuple of at most {MAX_RELAYS} multiaddrs")
        for relay in self.relays:
            if not isinstance(relay, str) or len(relay) > MAX_ENDPOINT_CHARS or not RELAY_PATTERN.fullmatch(relay):
                raise ValueError(f"relay must look like /ip4/HOST/tcp/PORT/p2p/ID, got {str(relay)[:80]!r}")
        if not isinstance(self.reverse, tuple) or len(self.reverse) > MAX_REVERSE:
            raise ValueError(f"reverse must be a tuple of at most {MAX_REVERSE} entries")
        for entry in self.reverse:
            if not isinstance(entry, tuple) or len(entry) != 3:
                raise ValueError("a reverse entry must be (peer, data port, control port)")
            _check_int("reverse peer", entry[0], 0, MAX_PEER_ID)
            _check_int("reverse port", entry[1], 1, 65536)
            _check_int("reverse port", entry[2], 1, 65536)

    @property
    def host(self) -> str:
        """The host part of ``endpoint``."""
        return self.endpoint.removeprefix("tcp://").rsplit(":", 1)[0]

    def reverse_for(self, peer: int) -> tuple[int, int] | None:
        """The (data, control) ports this peer offers ``peer`` to dial, if any."""
        for entry in self.reverse:
            if entry[0] == peer:
                return entry[1], entry[2]
        return None

    def to_wire(self) -> dict[str, Any]:
        """The record as a plain dict of str and int (msgpack-able)."""
        return {"version": self.version, "peer": self.peer, "endpoint": self.endpoint,
                "round": self.round, "tokens": self.tokens, "key": self.key, "reachable": self.reachable,
                "p2p": self.p2p, "relays": list(self.relays), "reverse": [list(entry) for entry in self.reverse],
                "joined": self.joined}

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
        relays, reverse = obj["relays"], obj["reverse"]
        if not isinstance(relays, (list, tuple)) or len(relays) > MAX_RELAYS:
            raise ValueError(f"relays must be a list of at most {MAX_RELAYS} multiaddrs")
        if not isinstance(reverse, (list, tuple)) or len(reverse) > MAX_REVERSE:
            raise ValueError(f"reverse must be a list of at most {MAX_REVERSE} entries")
        if any(not isinstance(entry, (list, tuple)) for entry in reverse):
            raise ValueError("a reverse entry must be a list (peer, data port, control port)")
        return cls(peer=obj["peer"], endpoint=obj["endpoint"], round=obj["round"], tokens=obj["tokens"],
                   version=version, key=obj["key"], reachable=obj["reachable"], p2p=obj["p2p"],
                   relays=tuple(relays), reverse=tuple(tuple(entry) for entry in reverse), joined=obj["joined"])
