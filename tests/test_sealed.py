"""The AES-256-GCM sealing of data messages (``gossiploco.transport.sealed``), pure: keys, envelope, refusals."""

from __future__ import annotations

import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gossiploco.errors import MalformedMessage
from gossiploco.transport.sealed import (ENVELOPE, KEEP_KEYS, OFFER, TAG_BYTES, WINDOW, Opener, Sealer,
                                         offer_frames)

PORT = 40123


def _pair(peer: int = 7) -> tuple[Opener, Sealer]:
    """A receiver's opener that issued a key to ``peer``, and ``peer``'s sealer that accepted it."""
    opener, sealer = Opener(), Sealer()
    key_id, key = opener.issue(peer)
    offer = offer_frames(key_id, key, PORT)
    assert offer[0] == OFFER
    assert sealer.accept(3, offer[1:]) == PORT  # the sealer's peer 3 is the receiver
    return opener, sealer


def test_a_sealed_message_opens_to_its_frames_and_its_sender():
    opener, sealer = _pair(peer=7)
    frames = [b"7.abc", b"header", bytes(range(256)) * 100]
    sealed = sealer.seal(3, frames)
    assert len(sealed) == 1 + len(frames) and all(len(s) == len(f) + TAG_BYTES for s, f in zip(sealed[1:], frames))
    assert all(f not in s for s, f in zip(sealed[1:], frames[1:]))  # the payload is not on the wire in clear
    peer, plain = opener.open(sealed)
    assert peer == 7 and [bytes(p) for p in plain] == frames


def test_the_wire_format_is_the_documented_one():
    """Reference: frame i of message n is AES-256-GCM under the offered key, nonce (n as 8 bytes, i as 4 bytes,
    big endian), associated data the 20-byte envelope (key id, n, frame count)."""
    opener, sealer = Opener(), Sealer()
    key_id, key = opener.issue(1)
    sealer.accept(0, offer_frames(key_id, key, PORT)[1:])
    for n in range(3):
        frames = [b"routing", b"x" * (n + 5)]
        sealed = sealer.seal(0, frames)
        assert sealed[0] == ENVELOPE.pack(key_id, n, 2) == key_id + struct.pack(">QI", n, 2)
        for i, frame in enumerate(frames):
            assert AESGCM(key).decrypt(struct.pack(">QI", n, i), sealed[1 + i], sealed[0]) == frame


def test_writable_frames_open_in_place_and_read_only_ones_into_new_memory():
    opener, sealer = _pair()
    sealed = sealer.seal(3, [b"r", b"h", b"p" * 1000])
    writable = [sealed[0], *(bytearray(s) for s in sealed[1:])]
    _, plain = opener.open(writable)
    assert isinstance(plain[2], memoryview) and plain[2].obj is writable[3] and bytes(plain[2]) == b"p" * 1000
    _, plain = opener.open(sealer.seal(3, [b"r", b"h", b"q" * 10]))  # bytes: read-only
    assert isinstance(plain[2], bytearray) and bytes(plain[2]) == b"q" * 10


@pytest.mark.parametrize("tamper", ["payload bit", "tag bit", "envelope counter", "envelope key id", "frame count",
                                    "frames swapped", "frame dropped", "frame from another message", "no envelope",
                                    "short frame"])
def test_a_tampered_message_is_refused(tamper):
    opener, sealer = _pair()
    first = sealer.seal(3, [b"r", b"h", b"a" * 64])
    sealed = sealer.seal(3, [b"r", b"h", b"b" * 64])
    key_id, counter, count = ENVELOPE.unpack(sealed[0])
    if tamper == "payload bit":
        sealed[3] = bytes([sealed[3][0] ^ 1]) + sealed[3][1:]
    elif tamper == "tag bit":
        sealed[3] = sealed[3][:-1] + bytes([sealed[3][-1] ^ 0x80])
    elif tamper == "envelope counter":
        sealed[0] = ENVELOPE.pack(key_id, counter + 1, count)
    elif tamper == "envelope key id":
        sealed[0] = ENVELOPE.pack(bytes(8), counter, count)
    elif tamper == "frame count":
        sealed[0] = ENVELOPE.pack(key_id, counter, count - 1)
    elif tamper == "frames swapped":
        sealed[2], sealed[3] = sealed[3], sealed[2]
    elif tamper == "frame dropped":
        sealed = sealed[:3]
    elif tamper == "frame from another message":
        sealed[3] = first[3]
    elif tamper == "no envelope":
        sealed = []
    elif tamper == "short frame":
        sealed[1] = sealed[1][:TAG_BYTES - 1]
    with pytest.raises(MalformedMessage):
        opener.open(sealed)
    peer, plain = opener.open(first)  # a refusal changes nothing: the honest message still opens
    assert peer == 7 and bytes(plain[2]) == b"a" * 64


def test_each_message_opens_once_in_any_order_within_the_window():
    opener, sealer = _pair()
    messages = [sealer.seal(3, [b"r", bytes([n % 256])]) for n in range(WINDOW + 10)]
    order = [5, 0, 3, 9, 1, 2, 4, 8, 6, 7]  # several senders race to the socket: out of order is normal
    for n in order:
        opener.open(messages[n])
    for n in order:
        with pytest.raises(MalformedMessage, match="replayed"):
            opener.open(messages[n])
    opener.open(messages[WINDOW + 9])  # the window moves up to counter WINDOW + 9
    with pytest.raises(MalformedMessage, match="older than the replay window"):
        opener.open(messages[9])  # never seen, but too old to tell: refused
    opener.open(messages[10])  # exactly WINDOW - 1 below the highest: still accepted once
    with pytest.raises(MalformedMessage, match="replayed"):
        opener.open(messages[10])
    with pytest.raises(MalformedMessage, match="replayed"):
        opener.open(messages[WINDOW + 9])


def test_a_refused_message_does_not_move_the_replay_window():
    opener, sealer = _pair()
    messages = [sealer.seal(3, [b"r", b"x"]) for _ in range(WINDOW + 2)]
    forged = list(messages[WINDOW + 1])
    forged[1] = bytes(len(forged[1]))  # right envelope, wrong ciphertext
    with pytest.raises(MalformedMessage, match="authentication"):
        opener.open(forged)
    opener.open(messages[0])  # had the forgery moved the window, this would be "older than the window"


def test_keys_rotate_and_old_ones_are_forgotten():
    opener, sealer = Opener(), Sealer()
    sealed_under = []
    for _ in range(KEEP_KEYS + 1):
        key_id, key = opener.issue(7)
        sealer.accept(3, offer_frames(key_id, key, PORT)[1:])
        sealed_under.append(sealer.seal(3, [b"r", b"h"]))
    assert opener.keys_of(7) == KEEP_KEYS
    with pytest.raises(MalformedMessage, match="unknown key"):
        opener.open(sealed_under[0])  # the oldest key is gone
    for message in sealed_under[1:]:  # messages in flight under the previous key still open
        assert opener.open(message)[0] == 7
    opener.forget(7)
    with pytest.raises(MalformedMessage, match="unknown key"):
        opener.open(sealer.seal(3, [b"r", b"h"]))


def test_a_key_issued_to_one_peer_opens_as_that_peer_only():
    opener = Opener()
    seven, eight = Sealer(), Sealer()
    for peer, sealer in ((7, seven), (8, eight)):
        key_id, key = opener.issue(peer)
        sealer.accept(3, offer_frames(key_id, key, PORT)[1:])
    assert opener.open(seven.seal(3, [b"8.fake", b"h"]))[0] == 7  # the key says who, whatever the frames claim
    assert opener.open(eight.seal(3, [b"r", b"h"]))[0] == 8


def test_malformed_offers_are_refused_and_no_key_means_no_sealing():
    sealer = Sealer()
    assert sealer.seal(3, [b"r"]) is None and sealer.port_of(3) is None
    good = offer_frames(b"k" * 8, b"K" * 32, PORT)[1:]
    for bad in (good[:2], [b"k" * 7, good[1], good[2]], [good[0], b"K" * 31, good[2]], [good[0], good[1], b"\0\0"],
                [*good, b"extra"]):
        with pytest.raises(MalformedMessage):
            sealer.accept(3, bad)
    assert sealer.port_of(3) is None
    sealer.accept(3, good)
    assert sealer.port_of(3) == PORT
    sealer.forget(3)
    assert sealer.seal(3, [b"r"]) is None


def test_counters_never_repeat_under_one_key():
    """A nonce reused under one AES-GCM key would leak the XOR of two plaintexts and the authentication key."""
    _, sealer = _pair()
    envelopes = {sealer.seal(3, [b"r"])[0] for _ in range(1000)}
    assert len(envelopes) == 1000
