"""Signed, sealed DHT records: hivemind's record-validator hook, run by every node of the swarm.

Every record gossiploco stores is a dictionary entry ``(key, subkey = the writer's peer id,
value)``. ``sign_value`` (called by the writer's DHT node) wraps the value in an envelope

    msgpack [ENVELOPE_VERSION, writer's Ed25519 public key, body, signature]

where ``body`` is the value sealed with the swarm key (``SwarmKey.seal``; the value itself in an
open run) and the signature covers the DHT key, the subkey, the body and the expiration time.
``validate`` (called by every node before it stores a record and again on each record a search
returns) accepts a record only if the envelope is well formed, the signature verifies, the subkey
is the peer id of the signing key (so nobody writes, overwrites or tombstones another peer's
entry), and, in a private run, the body unseals with the swarm key (so nobody without it writes
at all). ``strip_value`` hands the application the unsealed value. Since the signature covers the
expiration time, a record cannot be replayed with a later one. Regular (non-dictionary) values and
any other key's records are refused, so a node of a private run stores nothing but its run's
records, and a stranger cannot replace the run's dictionary with a value of their own.

Rejections are counted by reason (``rejected``) in the process that runs the DHT node (hivemind's
DHT child process); each reason is logged once.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter

import msgpack
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from gossiploco.security.identity import Identity, curve_public_of, peer_id_of, verify
from gossiploco.security.swarm_key import SwarmKey

log = logging.getLogger(__name__)

ENVELOPE_VERSION = 1
MAX_ENVELOPE_BYTES = 16 << 10
"""A peer's record is a few hundred bytes; anything far larger is refused unread."""
_DOMAIN = b"gossiploco-dht-record-v1|"


def _signed_part(record: DHTRecord, body: bytes) -> bytes:
    return b"|".join([_DOMAIN, record.key, record.subkey, body, struct.pack(">d", record.expiration_time)])


class SwarmRecordValidator(RecordValidatorBase):
    """Signs this node's records with ``identity`` (None: a node that only stores and serves, such as
    the bootstrap node) and accepts only records valid for ``swarm`` (None: an open run)."""

    def __init__(self, identity: Identity | None, swarm: SwarmKey | None):
        self.identity = identity
        self.swarm = swarm
        self.rejected: Counter[str] = Counter()

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.identity is None:
            raise ValueError("this DHT node has no identity to sign records with")
        body = self.swarm.seal(record.value) if self.swarm is not None else record.value
        signature = self.identity.sign(_signed_part(record, body))
        return msgpack.packb([ENVELOPE_VERSION, self.identity.sign_public, body, signature], use_bin_type=True)

    def _open(self, record: DHTRecord) -> bytes:
        """The record's value if the record is valid, else ``ValueError`` saying why."""
        if len(record.value) > MAX_ENVELOPE_BYTES:
            raise ValueError("oversized")
        try:
            envelope = msgpack.unpackb(record.value, raw=False, max_bin_len=MAX_ENVELOPE_BYTES, max_str_len=64,
                                       max_array_len=8, max_map_len=0)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"not an envelope ({type(exc).__name__})") from None
        if not (isinstance(envelope, list) and len(envelope) == 4 and envelope[0] == ENVELOPE_VERSION
                and all(isinstance(part, bytes) for part in envelope[1:])):
            raise ValueError("not an envelope of this version")
        _, sign_public, body, signature = envelope
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False)
        except (ValueError, msgpack.UnpackException):
            subkey = None
        if not isinstance(subkey, int) or isinstance(subkey, bool):
            raise ValueError("not a peer entry (no peer-id subkey)")
        if peer_id_of(curve_public_of(sign_public)) != subkey:
            raise ValueError("signed by another peer than the entry's")
        if not verify(sign_public, _signed_part(record, body), signature):
            raise ValueError("bad signature")
        return self.swarm.unseal(body) if self.swarm is not None else body

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
