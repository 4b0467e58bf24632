"""Each peer's live status, for observers (``gossiploco dashboard``): one ``StatusEntry`` per peer.

Like the swarm's list of runs (``membership.runs``), every peer of a DHT-joined run stores one
entry under a single key of the swarm, ``status_key(swarm)`` (derived from the swarm key, so only
its holders can find, read or write it; a fixed name in an open run), under the peer's own subkey,
signed by the peer, re-stored by the directory's heartbeat (``DhtDirectory.set_status_source``),
tombstoned when it leaves and expiring ``ttl_s`` after a crash. An observer joins the DHT, announces
nothing, and reads the entries (``read_statuses``); nothing about training waits on them.

Wire form (a plain msgpack-able dict, validated strictly by ``StatusEntry.from_wire`` on every read
and by every DHT node of a private run before it stores one, ``SwarmRecordValidator``)::

    {"version": STATUS_VERSION, "peer": int, "run": str, "round": int, "h": int, "step": int,
     "members": int, "time": float, "loss": float|None, "val_loss": float|None, "cd_l2": float|None,
     "cd_js": float|None, "bytes_sent": int, "bytes_received": int, "rate": float,
     "failures": {kind: int}, "causes": [str], "paths": {peer id as str: path}, "utilization": float|None,
     "mix2": [block pattern], "history": [[step, loss, val_loss, cd_l2, cd_js], ...], "tokens": int}

``tokens`` (the training tokens the peer processed over its run) came later in version 1: an entry without it
(an older peer's) is read as 0 tokens; a DHT node of an older version refuses entries that carry it.

``history`` holds the last ``MAX_HISTORY`` measurements, so a page opened mid-run has curves at once.
Floats are finite (a NaN loss travels as None); texts are printable and short; the encoded entry is
at most ``MAX_STATUS_BYTES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gossiploco.membership.record import IncompatibleRecord, _check_int
from gossiploco.protocol.messages import MAX_PEER_ID

if TYPE_CHECKING:
    from gossiploco.membership.dht_directory import DhtDirectory
    from gossiploco.security.swarm_key import SwarmKey

STATUS_VERSION = 1
MAX_STATUS_BYTES = 12 << 10
"""An entry with a full history is about 3-4 KiB; every DHT node refuses one larger than this unread."""
MAX_HISTORY = 64
MAX_TEXT_CHARS = 160
MAX_CAUSES = 4
MAX_FAILURE_KINDS = 8
MAX_PATHS = 64
MAX_MIX2_BLOCKS = 32
MAX_COUNT = 2**63 - 1
SERIES = ("loss", "val_loss", "cd_l2", "cd_js")
"""The measurements kept in ``history`` (after the step), in this order."""
WIRE_FIELDS = frozenset({"version", "peer", "run", "round", "h", "step", "members", "time", *SERIES, "bytes_sent",
                         "bytes_received", "rate", "failures", "causes", "paths", "utilization", "mix2", "history",
                         "tokens"})
OPTIONAL_FIELDS = frozenset({"tokens"})
"""Fields added after version 1 was first published: an entry without them (an older peer's) is still valid."""


def status_key(swarm: SwarmKey | None) -> str:
    """The DHT key of a swarm's peer statuses: derived from the swarm key (private), or a fixed name (open run)."""
    return swarm.dht_key("*", "status") if swarm is not None else "gossiploco/*/status"


def _text(name: str, value: Any, max_chars: int = MAX_TEXT_CHARS) -> str:
    if not isinstance(value, str) or len(value) > max_chars or not value.isprintable():
        raise ValueError(f"{name} must be a printable text of at most {max_chars} characters, got {str(value)[:40]!r}")
    return value


def _number(name: str, value: Any, optional: bool = True) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{' or None' if optional else ''}, got {str(value)[:40]!r}")
    return float(value)


def _list(name: str, value: Any, max_items: int) -> list:
    if not isinstance(value, list) or len(value) > max_items:
        raise ValueError(f"{name} must be a list of at most {max_items} items")
    return value


def _dict(name: str, value: Any, max_items: int) -> dict:
    if not isinstance(value, dict) or len(value) > max_items:
        raise ValueError(f"{name} must be a dict of at most {max_items} items")
    return value


@dataclass(frozen=True)
class StatusEntry:
    """One peer's live status. Construction validates every field (``ValueError`` naming the first problem)."""

    peer: int
    run_id: str
    round: int = -1
    h: int = 0
    step: int = 0
    members: int = 0
    time: float = 0.0
    """Wall-clock time of the latest measurement (seconds since the epoch)."""
    loss: float | None = None
    val_loss: float | None = None
    cd_l2: float | None = None
    cd_js: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    rate: float = 0.0
    """Bytes per second sent and received together, since the previous measurement."""
    failures: dict = field(default_factory=dict)
    """Failed exchanges by kind (mix1, mix2, monitor, grad) since the peer started."""
    causes: list = field(default_factory=list)
    """The last few failures' causes, newest last."""
    paths: dict = field(default_factory=dict)
    """The path to each partner (direct, reverse, relayed), by its peer id as text."""
    utilization: float | None = None
    """Compute seconds over wall seconds since the peer started."""
    mix2: list = field(default_factory=list)
    """The block patterns Mix2 covers now."""
    history: list = field(default_factory=list)
    """The last measurements: ``[step, loss, val_loss, cd_l2, cd_js]`` each."""
    tokens: int = 0
    """Training tokens the peer has processed over its run (a resumed run's included)."""
    version: int = STATUS_VERSION

    def __post_init__(self) -> None:
        _check_int("peer", self.peer, 0, MAX_PEER_ID)
        _check_int("version", self.version, 1, MAX_PEER_ID)
        _text("run", self.run_id, 256)
        if not self.run_id:
            raise ValueError("run must not be empty")
        _check_int("round", self.round, -1, MAX_COUNT)
        _check_int("h", self.h, 0, MAX_COUNT)
        _check_int("step", self.step, 0, MAX_COUNT)
        _check_int("members", self.members, 0, MAX_PEER_ID)
        _check_int("bytes_sent", self.bytes_sent, 0, MAX_COUNT)
        _check_int("bytes_received", self.bytes_received, 0, MAX_COUNT)
        _check_int("tokens", self.tokens, 0, MAX_COUNT)
        _number("time", self.time, optional=False)
        _number("rate", self.rate, optional=False)
        for name in (*SERIES, "utilization"):
            _number(name, getattr(self, name))
        for kind, count in _dict("failures", self.failures, MAX_FAILURE_KINDS).items():
            _text("failures kind", kind, 16)
            _check_int(f"failures.{kind}", count, 0, MAX_COUNT)
        for cause in _list("causes", self.causes, MAX_CAUSES):
            _text("cause", cause)
        for partner, path in _dict("paths", self.paths, MAX_PATHS).items():
            if not isinstance(partner, str) or not partner.isdigit() or len(partner) > 10:
                raise ValueError(f"paths keys must be peer ids as text, got {str(partner)[:20]!r}")
            _text("path", path, 16)
        for pattern in _list("mix2", self.mix2, MAX_MIX2_BLOCKS):
            _text("mix2 block", pattern, 64)
        for row in _list("history", self.history, MAX_HISTORY):
            if not isinstance(row, list) or len(row) != 1 + len(SERIES):
                raise ValueError(f"history rows must be [step, {', '.join(SERIES)}]")
            _check_int("history step", row[0], 0, MAX_COUNT)
            for name, value in zip(SERIES, row[1:]):
                _number(f"history {name}", value)

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "peer": self.peer, "run": self.run_id, "round": self.round, "h": self.h,
                "step": self.step, "members": self.members, "time": self.time, "loss": self.loss,
                "val_loss": self.val_loss, "cd_l2": self.cd_l2, "cd_js": self.cd_js, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received, "rate": self.rate, "failures": self.failures,
                "causes": self.causes, "paths": self.paths, "utilization": self.utilization, "mix2": self.mix2,
                "history": self.history, "tokens": self.tokens}

    @classmethod
    def from_wire(cls, obj: Any) -> StatusEntry:
        """Validate data from the network and build the entry: ``IncompatibleRecord`` for another
        ``STATUS_VERSION``, ``ValueError`` naming the first problem for anything not exactly a valid entry."""
        if not isinstance(obj, dict):
            raise ValueError(f"status entry must be a dict, got {type(obj).__name__}")
        version = obj.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"status entry version must be an int, got {type(version).__name__}")
        if version != STATUS_VERSION:
            raise IncompatibleRecord(version)
        if not WIRE_FIELDS - OPTIONAL_FIELDS <= set(obj) <= WIRE_FIELDS:
            unknown = sorted(repr(key)[:40] for key in set(obj) - WIRE_FIELDS)[:5]
            raise ValueError(f"status entry has wrong fields (missing {sorted(WIRE_FIELDS - set(obj))}, unknown {unknown})")
        fields = {k: v for k, v in obj.items() if k != "run"}
        return cls(run_id=obj["run"], **fields)


def check_status_bytes(value: bytes) -> None:
    """What a DHT node checks of a serialized status entry (msgpack) before it stores it: ``ValueError``
    unless it is a tombstone (None) or a valid ``StatusEntry`` within ``MAX_STATUS_BYTES``."""
    import msgpack

    if len(value) > MAX_STATUS_BYTES:
        raise ValueError(f"status entry oversized ({len(value)} bytes, at most {MAX_STATUS_BYTES})")
    try:
        obj = msgpack.unpackb(value, raw=False, max_bin_len=0, max_ext_len=0, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"status entry is not msgpack ({type(exc).__name__})") from None
    if obj is not None:
        StatusEntry.from_wire(obj)


def read_statuses(directory: DhtDirectory) -> dict[int, StatusEntry] | None:
    """The swarm's live status entries by peer id, read through ``directory``'s DHT node (blocks at most
    its deadline); None when the DHT did not answer. Bad entries are dropped, counted and logged once
    (the directory's ``malformed_records``/``incompatible_records``)."""
    entries = directory.entries.read(directory.status_key, "status entry", StatusEntry.from_wire)
    return None if entries is None else {peer: entry for peer, (entry, _) in sorted(entries.items())}
