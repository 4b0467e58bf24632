"""Data messages sealed with AES-256-GCM: the keys, the envelope, and who may open what (no sockets).

CurveZMQ encrypts with XSalsa20-Poly1305 inside libzmq's I/O thread: 0.6 GB/s a core here, which made an
encrypted all-reduce 2.8x the plaintext one on loopback (``bench/results/allreduce.md``). AES-GCM with the CPU's
AES and carry-less multiply instructions (OpenSSL, through ``cryptography``) seals 5.7 GB/s and opens 8 GB/s a
core, and releases the GIL while it runs. So data chunks, the bulk of every byte, may travel sealed this way over
a second, NULL-mechanism connection (``zmq_sockets``: the sealed port), while everything else, and the keys
themselves, keep CurveZMQ's authenticated, encrypted connections.

Keys: the receiver chooses them. Peer R, once its CurveZMQ connection to peer S is up, makes a fresh random
256-bit key for what S will send it and offers it to S over that connection (``offer_frames``, on R's control
connection: authenticated as R by CurveZMQ and ZAP, encrypted). S seals its data for R with the newest key R
offered (``Sealer``); R opens with the keys it issued (``Opener``). A key is never reused across processes: R
issues a new one whenever its connection to S is made again (S restarted, or the link dropped), and keeps the
previous ``KEEP_KEYS - 1`` per sender so messages already in flight under an older key still open.

Envelope (first frame, 20 bytes): the key's id (8 random bytes), the message's counter (8 bytes, big endian:
the sender counts each key's messages from 0) and the number of sealed frames (4 bytes). Frame ``i`` is sealed
with the nonce (counter, ``i``) and the envelope as associated data, so a frame cannot be moved to another
message or position, nor a message truncated, without its tag failing. A nonce never repeats under one key: the
counter only grows (2**64 messages), and each key belongs to one sending process.

Replays: ``Opener`` accepts each counter of a key once. Messages may arrive out of order (several sending
threads take counters and then race to the socket), so it keeps the highest counter seen and a bitmap of the
``WINDOW`` counters below it; a counter older than that window, or already seen, is refused. A message from an
unknown key (a stranger, a key of a previous process, one dropped as stale) is refused. Every refusal raises
``MalformedMessage`` and costs one AES-GCM tag check at most: nothing unauthenticated is decoded.

Thread rules: ``Opener`` belongs to the receiving thread. ``Sealer`` is thread-safe (any sending thread seals, each
message with its own ``AESGCM`` object; the receiving thread accepts offers).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gossiploco.errors import MalformedMessage

OFFER = b"gossiploco/sealed-key/1"
"""First frame of a key offer (on a control connection; the rest: key id, key, port)."""
ENVELOPE = struct.Struct(">8sQI")
"""Key id, message counter, sealed frames."""
KEY_ID_BYTES = 8
KEY_BYTES = 32
TAG_BYTES = 16
MAX_FRAMES = 64
"""Most sealed frames in one message (a data message has a header and a few tensors)."""
KEEP_KEYS = 2
"""Keys an ``Opener`` keeps per sender: the newest and the one before it."""
LINKS_KEEP_KEYS = 8
"""The same with links on demand (``zmq_links``), where each idle link made again issues a key: a message sealed by
a sender under a key several link cycles old (queued behind a slow receiver) still opens. Each key keeps its own
replay window, and every key is still fresh per link: no nonce is reused."""
WINDOW = 4096
"""How far below the highest counter seen a message may still arrive (out of order) and be accepted once."""
_PORT = struct.Struct(">H")


def _nonce(counter: int, index: int) -> bytes:
    return struct.pack(">QI", counter, index)


@dataclass
class _OpenKey:
    peer: int
    aead: AESGCM
    highest: int = -1
    seen: int = 0
    """Bit ``j`` set: counter ``highest - j`` arrived."""

    def admit(self, counter: int) -> None:
        """Accept ``counter`` once (module docstring: replays); ``MalformedMessage`` otherwise."""
        if counter > self.highest:
            shift = counter - self.highest
            self.seen = ((self.seen << shift) | 1) & ((1 << WINDOW) - 1) if shift < WINDOW else 1
            self.highest = counter
            return
        age = self.highest - counter
        if age >= WINDOW:
            raise MalformedMessage(f"sealed message {counter} is older than the replay window")
        if self.seen >> age & 1:
            raise MalformedMessage("sealed message replayed")
        self.seen |= 1 << age


class Opener:
    """The keys this peer issued to its senders, and the opening of what they seal; see the module docstring."""

    def __init__(self, keep: int = KEEP_KEYS) -> None:
        if keep < 2:
            raise ValueError(f"an opener keeps at least 2 keys per sender, got {keep}")
        self.keep = keep
        """Keys kept per sender (``KEEP_KEYS``; more where links are made afresh often: ``LINKS_KEEP_KEYS``)."""
        self._keys: dict[bytes, _OpenKey] = {}
        self._by_peer: dict[int, list[bytes]] = {}  # peer -> its key ids, oldest first

    def issue(self, peer: int) -> tuple[bytes, bytes]:
        """A fresh (key id, key) for ``peer`` to seal what it sends here; forgets its keys beyond ``keep``."""
        key_id, key = os.urandom(KEY_ID_BYTES), AESGCM.generate_key(bit_length=8 * KEY_BYTES)
        ids = self._by_peer.setdefault(peer, [])
        ids.append(key_id)
        self._keys[key_id] = _OpenKey(peer, AESGCM(key))
        while len(ids) > self.keep:
            del self._keys[ids.pop(0)]
        return key_id, key

    def forget(self, peer: int) -> None:
        """Drop every key issued to ``peer`` (it left)."""
        for key_id in self._by_peer.pop(peer, []):
            del self._keys[key_id]

    def keys_of(self, peer: int) -> int:
        """How many keys of ``peer`` are kept (for tests and diagnostics)."""
        return len(self._by_peer.get(peer, ()))

    def open(self, frames: Sequence) -> tuple[int, list[memoryview | bytearray]]:
        """(sender, plaintext frames) of one sealed message (envelope, sealed frames: bytes or buffers; a writable
        frame is opened in place and its plaintext is a view of it). ``MalformedMessage`` if it is not one this
        peer's keys sealed, or a replay."""
        if not frames:
            raise MalformedMessage("sealed message without an envelope")
        envelope = bytes(memoryview(frames[0]))
        if len(envelope) != ENVELOPE.size:
            raise MalformedMessage(f"sealed envelope of {len(envelope)} bytes")
        key_id, counter, count = ENVELOPE.unpack(envelope)
        if count != len(frames) - 1 or not 1 <= count <= MAX_FRAMES:
            raise MalformedMessage(f"sealed message with {len(frames) - 1} frames, envelope says {count}")
        key = self._keys.get(key_id)
        if key is None:
            raise MalformedMessage("sealed message under an unknown key")
        plain = []
        for index, frame in enumerate(frames[1:]):
            sealed = memoryview(frame).cast("B")
            if sealed.nbytes < TAG_BYTES:
                raise MalformedMessage("sealed frame shorter than its tag")
            # In place when the frame is writable (a received zmq frame is): no new buffer, no second pass over
            # memory; the codec then views tensors in it without a copy. A failed tag leaves garbage in a frame that
            # is dropped at once.
            out = sealed[:-TAG_BYTES] if not sealed.readonly else bytearray(sealed.nbytes - TAG_BYTES)
            try:
                key.aead.decrypt_into(_nonce(counter, index), sealed, envelope, out)
            except InvalidTag:
                raise MalformedMessage("sealed frame failed authentication") from None
            plain.append(out)
        key.admit(counter)  # only an authentic message moves the window
        return key.peer, plain


@dataclass
class _SealKey:
    key_id: bytes
    key: bytes
    port: int
    counter: int = 0


@dataclass
class Sealer:
    """The keys peers offered this one, and the sealing of data for them; see the module docstring."""

    _keys: dict[int, _SealKey] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def accept(self, peer: int, frames: Sequence) -> int:
        """Take ``peer``'s key offer (``offer_frames``, without the ``OFFER`` frame); returns its sealed port.
        ``MalformedMessage`` for a malformed offer."""
        key_id, key, port = (bytes(memoryview(f)) for f in frames) if len(frames) == 3 else (b"", b"", b"")
        if len(key_id) != KEY_ID_BYTES or len(key) != KEY_BYTES or len(port) != _PORT.size:
            raise MalformedMessage("malformed sealed key offer")
        (number,) = _PORT.unpack(port)
        if number == 0:
            raise MalformedMessage("sealed key offer without a port")
        with self._lock:
            self._keys[peer] = _SealKey(key_id, key, number)
        return number

    def port_of(self, peer: int) -> int | None:
        """The sealed port ``peer`` offered with its newest key, or None."""
        with self._lock:
            key = self._keys.get(peer)
        return None if key is None else key.port

    def forget(self, peer: int) -> None:
        with self._lock:
            self._keys.pop(peer, None)

    def seal(self, peer: int, frames: Sequence, into: Callable[[int], memoryview | None] | None = None) -> list | None:
        """``frames`` (bytes or buffers) sealed for ``peer``: envelope first; None without a key from it. ``into(n)``:
        a writable buffer of exactly ``n`` bytes to seal a frame into (None: a new ``bytes``), so that a sender can
        reuse buffers whose pages are already mapped instead of faulting in fresh ones for every chunk."""
        with self._lock:
            key = self._keys.get(peer)
            if key is None:
                return None
            counter = key.counter
            key.counter += 1
        if not 1 <= len(frames) <= MAX_FRAMES:
            raise ValueError(f"a sealed message has 1 to {MAX_FRAMES} frames, got {len(frames)}")
        envelope = ENVELOPE.pack(key.key_id, counter, len(frames))
        aead = AESGCM(key.key)  # one per message (2.7 us): whether threads may share one is not documented
        sealed: list = [envelope]
        for i, frame in enumerate(frames):
            out = into(memoryview(frame).nbytes + TAG_BYTES) if into is not None else None
            if out is None:
                sealed.append(aead.encrypt(_nonce(counter, i), frame, envelope))
            else:
                aead.encrypt_into(_nonce(counter, i), frame, envelope, out)
                sealed.append(out)
        return sealed


def offer_frames(key_id: bytes, key: bytes, port: int) -> list[bytes]:
    """The control message offering ``key`` (id ``key_id``) for sealed data to ``port``."""
    return [OFFER, key_id, key, _PORT.pack(port)]
