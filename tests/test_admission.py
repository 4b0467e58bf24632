"""Admission (``gossiploco.transport.admission``): who a sender is, as pure code, no sockets.

The live counterparts (a spoofed routing id, another process claiming a live peer, a key
authenticated as another member) are in tests/test_zmq_exchange.py, test_security.py and test_fuzz_live.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from gossiploco.errors import MalformedMessage
from gossiploco.protocol.messages import Abort, Data, Decision, Hello, Ready
from gossiploco.security.trust import routing_id
from gossiploco.transport.admission import Admission

DATA = Data("mix1/3", 0, (2, 0), torch.zeros(2))
CONTROL_MESSAGES = [Ready("mix1/3", 3), Decision("mix1/3", 3, (0, 1)), Abort("mix1/3")]


def test_a_message_is_admitted_when_the_routing_id_the_header_and_the_channel_agree():
    admission = Admission(authenticated=False)
    assert admission.identify(routing_id(4, "abc123", False), 4, DATA, None) == b"abc123"
    assert admission.identify(routing_id(4, "abc123", False), 4, Hello(0, 0), None) == b"abc123"
    for message in CONTROL_MESSAGES:
        assert admission.identify(routing_id(4, "abc123", True), 4, message, None) == b"abc123"
    for stripe in (1, 2, 15):  # further data connections of one process: the same process, data only
        assert routing_id(4, "abc123", False, stripe) == f"4.abc123/d{stripe}".encode()
        assert admission.identify(routing_id(4, "abc123", False, stripe), 4, DATA, None) == b"abc123"
    with pytest.raises(ValueError):
        routing_id(4, "abc123", True, 1)  # a control connection has no stripes
    with pytest.raises(ValueError):
        routing_id(4, "abc123", False, 16)


@pytest.mark.parametrize("identity, sender, message", [
    (routing_id(4, "abc123", False), 5, DATA),                     # the header names another peer
    (routing_id(4, "abc123", True), 4, DATA),                      # data on the control connection
    (routing_id(4, "abc123", False), 4, CONTROL_MESSAGES[0]),      # a Ready on the data connection
    (b"4", 4, DATA),                                               # no incarnation
    (b"four.abc", 4, DATA),                                        # not a peer id
    (b"4.abc-123", 4, DATA),                                       # an incarnation that is not alphanumeric
    (b"4." + b"a" * 200, 4, DATA),                                 # too long
    (routing_id(4, "abc123", False, 2), 4, CONTROL_MESSAGES[0]),   # a Ready on a further data connection
    (b"4.abc123/d0", 4, DATA),                                     # stripe 0 has no suffix
    (b"4.abc123/d16", 4, DATA),                                    # beyond the most stripes
    (b"4.abc123/d01", 4, DATA),                                    # not the way routing_id writes 1
    (b"4.abc123/dx", 4, DATA),                                     # not a number
    (b"4.abc123/d2/control", 4, CONTROL_MESSAGES[0]),              # a stripe of a control connection
])
def test_a_connection_that_does_not_match_the_sender_is_refused(identity, sender, message):
    with pytest.raises(MalformedMessage, match="arrived on connection"):
        Admission(authenticated=False).identify(identity, sender, message, None)


def test_with_trust_the_authenticated_key_must_be_the_senders():
    admission = Admission(authenticated=True)
    rid = routing_id(4, "abc123", False)
    assert admission.identify(rid, 4, DATA, "4") == b"abc123"
    for authenticated_as in ("5", None, ""):
        with pytest.raises(MalformedMessage, match="authenticated as"):
            admission.identify(rid, 4, DATA, authenticated_as)
    assert Admission(authenticated=False).identify(rid, 4, DATA, "5") == b"abc123"  # no trust: nothing to compare


def test_each_peer_is_pinned_to_one_process_until_its_connection_drops():
    admission = Admission(authenticated=False)
    assert not admission.is_pinned(4)
    assert admission.pin(4, b"first", lost_at=-math.inf, now=10.0) is None
    assert admission.is_pinned(4) and admission.pin(4, b"first", lost_at=-math.inf, now=11.0) is None
    with pytest.raises(MalformedMessage, match="another process claims to be peer 4"):
        admission.pin(4, b"intruder", lost_at=-math.inf, now=12.0)  # the pinned one's connection is up
    with pytest.raises(MalformedMessage):
        admission.pin(4, b"intruder", lost_at=9.0, now=12.0)  # it dropped before it was pinned: still up since
    # The pinned process's connection dropped after it was pinned: a restarted peer, accepted and pinned anew.
    assert admission.pin(4, b"second", lost_at=13.0, now=14.0) == "peer 4 speaks from a new process now"
    with pytest.raises(MalformedMessage):
        admission.pin(4, b"first", lost_at=13.0, now=15.0)  # the old process, back, is now the stranger
    assert admission.pin(5, b"other", lost_at=-math.inf, now=15.0) is None  # peers are pinned independently


def test_rejections_are_counted_by_reason():
    admission = Admission(authenticated=False)
    for sender in (5, 6, 7):
        try:
            admission.identify(routing_id(4, "abc", False), sender, DATA, None)
        except MalformedMessage as exc:
            admission.reject(exc.reason)
    assert admission.reject("validation bug: KeyError") == 1
    assert len(admission.rejected) == 2 and admission.total_rejected == 4
    (reason, count), = [(r, c) for r, c in admission.rejected.items() if r.startswith("sender")]
    assert count == 3 and "5" not in reason  # the particulars are masked, so alike refusals count together
