"""Who may use a relay: the members of a run, as the relay's DHT node reads them from the run's records.

A relay (``gossiploco.reach.relay``) runs in a DHT node that validates every record of its swarm
(``record_validator.SwarmRecordValidator``: sealed with the swarm key in a private run, signed by the
entry's peer in an open run). Each member's ``PeerRecord`` names the libp2p peer id of its DHT node
(``p2p``), and libp2p authenticates the peer id of every stream. So a stream's peer id found in a
currently valid record of run R is a member of R (or a node a member vouched for, which in a private
run takes the swarm key). ``RunMembers`` admits a request when:

1. private run: its ``proof`` is ``proof_of(swarm, asker)``, a MAC of the asker's own libp2p id under the
   swarm key; checked first, with no I/O, so a stranger costs the relay no DHT lookup. A proof is bound
   to one libp2p id: copied by another node it is worth nothing (the stream's id differs);
2. the asker and the target each appear (``p2p``) in a valid, unexpired record of the run named in the
   request, read from the DHT (``DHTNode.get(latest=True)``, validated by the node's validator and then
   parsed like any record, ``PeerRecord.from_wire``, its subkey and key checked as ``DhtDirectory`` does).

What the relay knows of a run's members is kept per run until each record's own expiration; it reads
the run's records again only when someone needed is missing, at most every ``MIN_READ_S`` per run and
``MAX_READS`` at once (more are refused as busy, never queued), for at most ``MAX_RUNS`` runs with members
(a read that finds nobody is not kept, so a stranger's made-up run ids cost at most ``MAX_READS`` reads in
flight and never push a real run's members out). In an open
run anyone may sign a record, so there this admits any node that announced itself in the run: what
bounds it there are the relay's per-asker limits.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from gossiploco.errors import ConfigError
from gossiploco.membership.directory import check_run_id
from gossiploco.membership.dht_directory import dht_key
from gossiploco.membership.record import IncompatibleRecord, PeerRecord
from gossiploco.membership.record_validator import entry_subkey
from gossiploco.reach.relay import RelayAdmission
from gossiploco.security.identity import peer_id_of
from gossiploco.security.swarm_key import SwarmKey

log = logging.getLogger(__name__)

PROOF_BYTES = 16
MIN_READ_S = 0.25
"""A run's records are read again at most this often (someone missing: a member that just joined). Shorter
than a tunnel's first retry (``reach.tunnel.BACKOFF_FIRST_S``), so a member refused because the relay read
the run a moment before its record arrived is admitted at its next try."""
ADMIT_WAIT_S = 2.0
"""How long a request naming someone the relay does not know yet waits for the run's records to show them (read
again every ``MIN_READ_S``): peers that start together ask for tunnels while their records still spread. The
request holds one of its asker's pending slots meanwhile (``reach.relay``)."""
MAX_READS = 4
"""DHT reads of runs' records at once; a request that needs one more is refused as busy."""
READ_S = 5.0
"""Deadline of one read of a run's records."""
MAX_RUNS = 64
"""Runs with members that one relay remembers (the least recently read is forgotten first); a run whose read
found nobody is not kept, so made-up run ids cannot push a real run out."""
MAX_READ_TIMES = 4096
"""Runs whose last read time one relay remembers (for ``MIN_READ_S``)."""


def proof_of(swarm: SwarmKey, asker: str) -> bytes:
    """The proof that the holder of libp2p id ``asker`` holds ``swarm``."""
    return swarm.derive(b"relay-proof/" + asker.encode(), PROOF_BYTES)


class RunMembers(RelayAdmission):
    """Admits members of a run of ``swarm`` (None: an open run; see the module docstring). Picklable until first
    used (it is sent to the DHT process); then used only on that process's event loop."""

    def __init__(self, swarm: SwarmKey | None):
        self.swarm = swarm
        self.reads = 0
        """DHT reads of runs' records so far."""
        self._members: dict[str, dict[str, float]] = {}  # run -> {p2p id: its record's expiration (DHT time)}
        self._read_at: dict[str, float] = {}  # run -> when its records were last read (monotonic)
        self._reading: dict[str, asyncio.Future] = {}  # run -> its read in flight (awaited by alike requests)

    def proof(self, run: str, asker: str) -> bytes:
        return b"" if self.swarm is None else proof_of(self.swarm, asker)

    async def refuse(self, node: Any, *, asker: str, target: str, run: str, proof: bytes) -> str | None:
        if self.swarm is not None and not hmac.compare_digest(proof, proof_of(self.swarm, asker)):
            return "not a member: no proof of the swarm key for this libp2p id"
        try:
            check_run_id(run)
        except ConfigError:
            return "malformed: not a run id"
        missing = self._missing(run, (asker, target))
        deadline = time.monotonic() + ADMIT_WAIT_S
        while missing:
            refusal = await self._read_once(node, run)
            if refusal is not None:
                return refusal
            missing = self._missing(run, (asker, target))
            wait = self._read_at.get(run, 0.0) + MIN_READ_S - time.monotonic()
            if not missing or time.monotonic() + max(wait, 0.0) > deadline:
                break
            await asyncio.sleep(max(wait, 0.0))  # a member that just joined: its record is on its way
        if asker in missing:
            return f"not a member: no valid record of run {run!r} names this libp2p id"
        if target in missing:
            return f"unknown target: no valid record of run {run!r} names {target[:64]}"
        return None

    async def _read_once(self, node: Any, run: str) -> str | None:
        """Read ``run``'s records if none was read in the last ``MIN_READ_S`` (joining a read under way); a refusal
        when too many reads are in flight."""
        if run in self._reading:  # a read of this run is under way: its outcome decides
            await asyncio.shield(self._reading[run])
        elif time.monotonic() - self._read_at.get(run, -MIN_READ_S) >= MIN_READ_S:
            if len(self._reading) >= MAX_READS:
                return f"busy: {MAX_READS} reads of runs' records in flight"
            self._reading[run] = reading = asyncio.ensure_future(self._read(node, run))
            try:
                await asyncio.shield(reading)
            finally:
                if reading.done():
                    self._reading.pop(run, None)
        return None

    def _missing(self, run: str, ids: tuple[str, ...]) -> set[str]:
        from hivemind.utils import get_dht_time

        known, now = self._members.get(run, {}), get_dht_time()
        return {i for i in ids if known.get(i, 0.0) <= now}

    async def _read(self, node: Any, run: str) -> None:
        """Read run ``run``'s records from the DHT into ``_members`` (bounded; a failure is logged, never raised)."""
        key = self.swarm.dht_key(run) if self.swarm is not None else dht_key(run)
        self._read_at[run] = time.monotonic()
        self.reads += 1
        try:
            found = await asyncio.wait_for(node.get(key, latest=True), READ_S)
        except Exception as exc:  # noqa: BLE001 - a timeout or a DHT error: what is known stays
            log.info("relay: reading run %r's records failed: %s: %s", run, type(exc).__name__, exc)
            return
        finally:
            self._reading.pop(run, None)
        members = {}
        entries = getattr(found, "value", None)
        for subkey, item in (entries.items() if isinstance(entries, dict) else ()):
            member = self._member(subkey, getattr(item, "value", None))
            if member is not None:
                members[member] = max(members.get(member, 0.0), float(getattr(item, "expiration_time", 0.0)))
        if members:
            self._members[run] = members
        else:  # a run nobody is in (a stranger's made-up run id) takes no room, only its read time
            self._members.pop(run, None)
        while len(self._members) > MAX_RUNS:
            self._members.pop(min(self._members, key=lambda r: self._read_at.get(r, 0.0)))
        while len(self._read_at) > MAX_READ_TIMES:
            self._read_at.pop(min(self._read_at, key=self._read_at.__getitem__))

    def _member(self, subkey: Any, value: Any) -> str | None:
        """The libp2p id a valid record names, or None (a tombstone, a bad or foreign record)."""
        if value is None:
            return None
        try:
            record = PeerRecord.from_wire(value)
        except (IncompatibleRecord, ValueError, TypeError):
            return None
        if subkey != entry_subkey(self.swarm, record.peer) or not record.key or peer_id_of(record.key) != record.peer:
            return None
        return record.p2p or None
