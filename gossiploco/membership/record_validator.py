"""Signed, sealed DHT records: hivemind's record-validator hook, run by every node of the swarm.

Every record gossiploco stores is a dictionary entry ``(key, subkey, value)`` whose subkey names
the writer: ``entry_subkey(swarm, peer id)``, a keyed hash of the peer id in a private run (so a
node that only stores the run's records learns neither who the members are nor their keys), the
peer id itself in an open run. ``sign_value`` (called by the writer's DHT node) signs the DHT key,
the subkey, the value and the expiration time with the writer's Ed25519 key, and wraps them:

    private run:  msgpack [ENVELOPE_VERSION, seal(msgpack [public key, value, signature])]
    open run:     msgpack [ENVELOPE_VERSION, public key, value, signature]

``validate`` (called by every node before it stores a record and again on each record a search
returns) accepts a record only if the envelope is well formed, it unseals with the swarm key
(private runs: so nobody without it writes at all), the signature verifies, and the subkey is the
one of the signing key's peer id (so nobody writes, overwrites or tombstones another peer's entry).
Entries of the swarm's list of runs (``membership.runs``, key ``runs_key(swarm)``) must moreover
be tombstones or valid ``RunEntry`` values within ``MAX_ENTRY_BYTES``, so no member can fill the
list every starting peer reads with junk; entries of the peers' live statuses (``membership.status``,
key ``status_key(swarm)``) likewise valid ``StatusEntry`` values within ``MAX_STATUS_BYTES``. ``strip_value`` hands the application the value.
Since the signature covers the expiration time, a record cannot be replayed with a later one.
Regular (non-dictionary) values and any other key's records are refused, so a node of a private
run stores nothing but its run's records, and a stranger cannot replace the run's dictionary with
a value of their own. What an outsider's DHT
node that holds replicas still sees: how many entries there are and when they expire.

Rejections are counted by reason (``rejected``) in the process that runs the DHT node (hivemind's
DHT child process); each reason is logged once.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections import Counter
from typing import Any

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from gossiploco.membership.runs import check_entry_bytes, runs_key
from gossiploco.membership.status import check_status_bytes, status_key
from gossiploco.security.identity import Identity, curve_public_of, peer_id_of, verify
from gossiploco.security.swarm_key import SwarmKey

log = logging.getLogger(__name__)

ENVELOPE_VERSION = 1
MAX_ENVELOPE_BYTES = 16 << 10
"""A peer's record is a few hundred bytes; anything far larger is refused unread."""
_DOMAIN = b"gossiploco-dht-record-v1|"


def _signed_part(record: DHTRecord, value: bytes) -> bytes:
    return b"|".join([_DOMAIN, record.key, record.subkey, value, struct.pack(">d", record.expiration_time)])


def entry_subkey(swarm: SwarmKey | None, peer: int) -> int:
    """The DHT subkey of peer ``peer``'s entry: a keyed hash of its id in a private run, the id in an open one."""
    if swarm is None:
        return peer
    return int.from_bytes(swarm.derive(f"subkey/{peer}".encode(), 7), "big")


class SwarmRecordValidator(RecordValidatorBase):
    """Signs this node's records with ``identity`` (None: a node that only stores and serves, such as
    the bootstrap node) and accepts only records valid for ``swarm`` (None: an open run)."""

    def __init__(self, identity: Identity | None, swarm: SwarmKey | None):
        self.identity = identity
        self.swarm = swarm
        self.rejected: Counter[str] = Counter()
        self._runs_key_id = DHTID.generate(source=runs_key(swarm)).to_bytes()
        self._status_key_id = DHTID.generate(source=status_key(swarm)).to_bytes()

    def sign_value(self, record: DHTRecord) -> bytes:
        presigned = self._presigned(record)
        if presigned is not None:
            return presigned
        if self.identity is None:
            raise ValueError("this DHT node has no identity to sign records with")
        signature = self.identity.sign(_signed_part(record, record.value))
        if self.swarm is None:
            return msgpack.packb([ENVELOPE_VERSION, self.identity.sign_public, record.value, signature])
        inner = msgpack.packb([self.identity.sign_public, record.value, signature])
        return msgpack.packb([ENVELOPE_VERSION, self.swarm.seal(inner)])

    def _presigned(self, record: DHTRecord) -> bytes | None:
        """The envelope a peer signed itself (``presign``) and handed a shared node as the value, if the value is
        one (a value that is bytes at all must be: a node never signs another's bytes with its own key)."""
        try:
            inner = msgpack.unpackb(record.value, raw=False, max_bin_len=MAX_ENVELOPE_BYTES, max_str_len=0,
                                    max_array_len=0, max_map_len=0)
        except (ValueError, msgpack.UnpackException):
            return None  # not bytes: a value this node signs itself
        if not isinstance(inner, bytes):
            return None
        self._open(dataclasses.replace(record, value=inner))  # ValueError: not signed by the entry's peer
        return inner

    @staticmethod
    def _unpack(data: bytes, parts: int) -> list:
        try:
            obj = msgpack.unpackb(data, raw=False, max_bin_len=MAX_ENVELOPE_BYTES, max_str_len=64,
                                  max_array_len=8, max_map_len=0)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"not an envelope ({type(exc).__name__})") from None
        if not (isinstance(obj, list) and len(obj) == parts and all(isinstance(p, bytes) for p in obj[-parts + 1:])):
            raise ValueError("not an envelope of this version")
        return obj

    def _open(self, record: DHTRecord) -> bytes:
        """The record's value if the record is valid, else ``ValueError`` saying why."""
        if len(record.value) > MAX_ENVELOPE_BYTES:
            raise ValueError("oversized")
        if self.swarm is None:
            version, sign_public, value, signature = self._unpack(record.value, 4)
        else:
            version, sealed = self._unpack(record.value, 2)
            sign_public, value, signature = self._unpack(self.swarm.unseal(sealed), 3)
        if version != ENVELOPE_VERSION or not isinstance(sign_public, bytes):
            raise ValueError("not an envelope of this version")
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False)
        except (ValueError, msgpack.UnpackException):
            subkey = None
        if not isinstance(subkey, int) or isinstance(subkey, bool):
            raise ValueError("not a peer entry (no peer subkey)")
        if entry_subkey(self.swarm, peer_id_of(curve_public_of(sign_public))) != subkey:
            raise ValueError("signed by another peer than the entry's")
        if not verify(sign_public, _signed_part(record, value), signature):
            raise ValueError("bad signature")
        if record.key == self._runs_key_id:
            try:
                check_entry_bytes(value)
            except ValueError as exc:
                raise ValueError(f"bad run entry: {exc}") from None  # one reason however it is bad
        if record.key == self._status_key_id:
            try:
                check_status_bytes(value)
            except ValueError as exc:
                raise ValueError(f"bad status entry: {exc}") from None
        return value

    def validate(self, record: DHTRecord) -> bool:
        try:
            self._open(record)
            return True
        except ValueError as exc:
            reason = str(exc).split(":")[0]
            self.rejected[reason] += 1
            if self.rejected[reason] == 1:
                log.warning("refused a DHT record: %s (further ones for this reason are only counted)", exc)
            return False

    def strip_value(self, record: DHTRecord) -> bytes:
        return self._open(record)

    @property
    def priority(self) -> int:
        return 10  # applied last when signing, first when validating: the outermost layer


def presign(identity: Identity, swarm: SwarmKey | None, key: str, subkey: int, value: Any, expiration: float) -> bytes:
    """The envelope ``identity``'s own DHT node would store for ``value`` under ``key``/``subkey`` expiring at
    ``expiration``: what a peer hands a shared node (``membership.shared_node``), which stores it as it is."""
    from hivemind.utils.serializer import MSGPackSerializer

    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), expiration)
    return SwarmRecordValidator(identity, swarm).sign_value(record)
