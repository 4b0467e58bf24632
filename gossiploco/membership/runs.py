"""The runs going in one swarm: each peer's line in a list every run can read (``RunEntry``).

A peer's own records live under its run's key (``directory``), so peers of different runs never
see each other there. A peer started with other settings than the others (another preset,
``--workers``, timeouts...) gets another run id and would wait alone in a run of its own. So
every peer also announces one ``RunEntry`` under a single key of the swarm, ``runs_key(swarm)``
(derived from the swarm key like the run keys and the beacon, so outsiders can neither read nor
write it): its peer id, its run id and its run's shared config (``checkpoint.shared_config``, in
the bounded form ``announced_config``). The entry lives exactly as long as the peer's record:
stored under the peer's own subkey (``records.entry_subkey``), signed by the peer, refreshed by the
directory's heartbeat, tombstoned when it leaves, expiring ``ttl_s`` after a crash. Before it
announces anything, a starting peer reads the list and can tell which runs are going and how
their settings differ from its own (``runtime.run_match``).

Wire form (a plain msgpack-able dict, validated strictly by ``RunEntry.from_wire`` on every read,
and by every DHT node of a private run before it stores one, ``SwarmRecordValidator``)::

    {"version": RUNS_VERSION, "peer": int, "run": str, "config": {str: value or {str: value...}},
     "separate": bool}

``separate``: the peer was started with ``--new-run``, so the other runs' peers are not warned about it.

Config values are None, bool, int, float, str (at most ``MAX_TEXT_CHARS``) or lists of those (at
most ``MAX_LIST_ITEMS``), nested at most ``MAX_DEPTH`` dicts deep, ``MAX_FIELDS`` values in all;
the encoded entry is at most ``MAX_ENTRY_BYTES``. ``announced_config`` keeps a config within those
bounds by replacing a longer list or text with its digest (``"<N items, sha256 ...>"``), so two
peers still compare equal exactly when their values are equal.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gossiploco.membership.record import IncompatibleRecord, _check_int
from gossiploco.protocol.messages import MAX_PEER_ID

if TYPE_CHECKING:
    from gossiploco.security.swarm_key import SwarmKey

RUNS_VERSION = 1
"""Version of ``RunEntry``'s wire format; entries of another version are ignored."""
MAX_ENTRY_BYTES = 12 << 10
"""An encoded entry is about 1.3 KiB; every DHT node refuses one larger than this unread."""
MAX_RUN_ID_CHARS = 256
MAX_KEY_CHARS = 64
MAX_TEXT_CHARS = 160
MAX_LIST_ITEMS = 32
MAX_DEPTH = 4
MAX_FIELDS = 512
WIRE_FIELDS = frozenset({"version", "peer", "run", "config", "separate"})
_SCALARS = (type(None), bool, int, float, str)


def runs_key(swarm: SwarmKey | None) -> str:
    """The DHT key of a swarm's list of runs: derived from the swarm key (private), or a fixed name (open run)."""
    return swarm.dht_key("*", "runs") if swarm is not None else "gossiploco/*/runs"


def _digest_text(kind: str, count: int, value: Any) -> str:
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"<{count} {kind}, sha256 {digest}>"


def announced_config(config: dict) -> dict:
    """``config`` (a shared config) within the wire bounds: tuples become lists, a list longer than
    ``MAX_LIST_ITEMS`` (or holding non-scalars) and a text longer than ``MAX_TEXT_CHARS`` become their
    digest, other types their text. Pure and idempotent."""

    def bounded(value: Any, depth: int) -> Any:
        if isinstance(value, dict) and depth < MAX_DEPTH:
            return {str(k)[:MAX_KEY_CHARS]: bounded(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [bounded(v, MAX_DEPTH) for v in value]
            if len(items) > MAX_LIST_ITEMS or not all(isinstance(v, _SCALARS) for v in items):
                return _digest_text("items", len(items), items)
            return items
        if isinstance(value, str):
            return value if len(value) <= MAX_TEXT_CHARS else _digest_text("chars", len(value), value)
        if isinstance(value, _SCALARS):
            return value
        return bounded(str(value), depth)

    return bounded(config, 0)


def _check_config(config: Any) -> None:
    """Raise ``ValueError`` naming the first way ``config`` leaves the wire bounds (module docstring)."""
    fields = 0

    def check(value: Any, where: str, depth: int) -> None:
        nonlocal fields
        if isinstance(value, dict):
            if depth >= MAX_DEPTH:
                raise ValueError(f"config nests deeper than {MAX_DEPTH} at {where or 'the top'}")
            for key, item in value.items():
                if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS or not key.isprintable():
                    raise ValueError(f"config field names are printable texts of at most {MAX_KEY_CHARS} characters, "
                                     f"got {repr(key)[:40]} in {where or 'the top'}")
                check(item, f"{where}.{key}" if where else key, depth + 1)
            return
        fields += 1
        if fields > MAX_FIELDS:
            raise ValueError(f"config has more than {MAX_FIELDS} values")
        if depth == 0:
            raise ValueError(f"config must be a dict, got {type(value).__name__}")
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list) and len(value) > MAX_LIST_ITEMS:
            raise ValueError(f"config value {where} is a list of {len(value)} items, at most {MAX_LIST_ITEMS} allowed")
        for item in items:
            if not isinstance(item, _SCALARS):
                raise ValueError(f"config value {where} has a {type(item).__name__}")
            if isinstance(item, int) and not isinstance(item, bool) and not -2**63 <= item < 2**64:
                raise ValueError(f"config value {where} is out of 64-bit range")
            if isinstance(item, str) and (len(item) > MAX_TEXT_CHARS or not item.isprintable()):
                raise ValueError(f"config value {where} is not a printable text of at most {MAX_TEXT_CHARS} characters")
            if isinstance(item, float) and math.isnan(item):
                raise ValueError(f"config value {where} is NaN")

    check(config, "", 0)


@dataclass(frozen=True)
class RunEntry:
    """One peer's line in the swarm's list of runs. Construction validates every field (``ValueError``)."""

    peer: int
    """The announcing peer's id (the DHT entry is stored under its subkey, and signed by it)."""
    run_id: str
    config: dict
    """Its run's shared config, as ``announced_config`` bounds it."""
    separate: bool = False
    """Started with ``--new-run``: a run beside the others on purpose."""
    version: int = RUNS_VERSION

    def __post_init__(self) -> None:
        _check_int("peer", self.peer, 0, MAX_PEER_ID)
        _check_int("version", self.version, 1, MAX_PEER_ID)
        run = self.run_id
        if not isinstance(run, str) or not run or len(run) > MAX_RUN_ID_CHARS or not run.isprintable():
            raise ValueError(f"run must be a printable text of 1 to {MAX_RUN_ID_CHARS} characters, got {str(run)[:40]!r}")
        _check_config(self.config)
        if not isinstance(self.separate, bool):
            raise ValueError(f"separate must be a bool, got {type(self.separate).__name__}")

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "peer": self.peer, "run": self.run_id, "config": self.config,
                "separate": self.separate}

    @classmethod
    def from_wire(cls, obj: Any) -> RunEntry:
        """Validate data from the network and build the entry. ``IncompatibleRecord`` (a ``ValueError``)
        for an entry of another ``RUNS_VERSION``; ``ValueError`` naming the first problem for anything
        else that is not exactly a valid entry (wrong type, missing or unknown field, out of bounds)."""
        if not isinstance(obj, dict):
            raise ValueError(f"run entry must be a dict, got {type(obj).__name__}")
        version = obj.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"run entry version must be an int, got {type(version).__name__}")
        if version != RUNS_VERSION:
            raise IncompatibleRecord(version)
        if set(obj) != WIRE_FIELDS:
            unknown = sorted(repr(key)[:40] for key in set(obj) - WIRE_FIELDS)[:5]
            raise ValueError(f"run entry has wrong fields (missing {sorted(WIRE_FIELDS - set(obj))}, unknown {unknown}); "
                             f"version {RUNS_VERSION} entries have exactly {', '.join(sorted(WIRE_FIELDS))}")
        return cls(peer=obj["peer"], run_id=obj["run"], config=obj["config"], separate=obj["separate"], version=version)


def check_entry_bytes(value: bytes) -> None:
    """What a DHT node checks of a serialized entry (msgpack) before it stores it: ``ValueError`` unless
    it is a tombstone (None) or a valid ``RunEntry`` within ``MAX_ENTRY_BYTES``."""
    import msgpack

    if len(value) > MAX_ENTRY_BYTES:
        raise ValueError(f"run entry oversized ({len(value)} bytes, at most {MAX_ENTRY_BYTES})")
    try:
        obj = msgpack.unpackb(value, raw=False, max_bin_len=0, max_ext_len=0, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"run entry is not msgpack ({type(exc).__name__})") from None
    if obj is not None:
        RunEntry.from_wire(obj)
