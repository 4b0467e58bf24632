"""The ZeroMQ driver's retry policy (``transport.retry``): a full send queue, a refused handshake, a reverse
connection that failed or dropped. Pure, no sockets."""

from __future__ import annotations

import pytest

from gossiploco.transport.retry import (REDIAL_FIRST_S, REDIAL_MAX_S, RETRY_FIRST_S, RETRY_MAX_S, SEND_RETRY_S,
                                        HandshakeBackoff, Redials, refused_delay_s, send_wait_s)


def test_a_full_send_queue_is_polled_in_short_steps_and_given_up_at_the_deadline():
    assert send_wait_s(deadline=10.0, now=0.0) == SEND_RETRY_S  # far from the deadline: one step
    assert send_wait_s(deadline=10.0, now=9.99) == pytest.approx(0.01)  # never past the deadline
    assert send_wait_s(deadline=10.0, now=10.0) is None  # the deadline has come: give up
    assert send_wait_s(deadline=10.0, now=11.0) is None
    assert send_wait_s(deadline=10.0, now=0.0, step_s=0.2) == 0.2


def test_a_refused_handshake_is_retried_soon_then_backing_off_to_a_ceiling():
    delays = [refused_delay_s(n) for n in range(1, 9)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert delays[0] == RETRY_FIRST_S and max(delays) == RETRY_MAX_S
    assert refused_delay_s(3, first_s=0.1, max_s=0.3) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="at least 1"):
        refused_delay_s(0)


def test_handshake_backoff_schedules_each_peer_once_and_a_success_starts_the_count_again():
    backoff = HandshakeBackoff()
    assert not backoff.pending and backoff.due(100.0) == [] and backoff.refusals(3) == 0
    assert backoff.refused(3, now=10.0) == 0.5
    assert backoff.refused(7, now=10.2) == 0.5
    assert backoff.pending and backoff.refusals(3) == 1
    assert backoff.due(10.4) == []  # not yet
    assert backoff.due(10.5) == [3]  # its time has come; 7's not yet
    assert backoff.due(10.6) == []  # each is returned once
    assert backoff.due(11.0) == [7] and not backoff.pending
    assert backoff.refused(3, now=11.0) == 1.0  # a second refusal in a row waits twice as long
    assert backoff.due(11.9) == [] and backoff.due(12.0) == [3]
    assert backoff.refused(3, now=12.01) == 2.0 and backoff.refused(3, now=12.5) == pytest.approx(1.51)
    assert backoff.refusals(3) == 3  # the same try's other socket refused too: counted once, scheduled once
    assert backoff.due(14.0) == [] and backoff.due(14.01) == [3]
    for now in range(20, 25):
        backoff.refused(3, now=float(now))
        assert backoff.due(float(now) + RETRY_MAX_S) == [3]
    assert backoff.refusals(3) == 8 and backoff.refused(3, now=40.0) == RETRY_MAX_S  # capped
    assert backoff.due(40.0 + RETRY_MAX_S) == [3]
    backoff.succeeded(3)
    assert backoff.refusals(3) == 0 and backoff.refused(3, now=60.0) == RETRY_FIRST_S
    backoff.succeeded(99)  # a peer that never refused: nothing to forget


def test_a_refusing_peer_that_speaks_is_tried_again_at_once_but_only_once_per_refusal():
    """A message from a peer that refused this one's handshake says it has admitted this peer since: the next try comes
    forward to now. A peer that keeps talking but still refuses is hurried once per refusal: at most twice the tries
    the backoff alone makes."""
    backoff = HandshakeBackoff()
    assert not backoff.hurry(4, now=0.0)  # nothing scheduled: nothing to hurry
    for now in range(4):
        backoff.refused(4, now=float(now))
        assert backoff.due(float(now) + RETRY_MAX_S) == [4]  # tried again, refused again
    assert backoff.refused(4, now=13.0) == RETRY_MAX_S and backoff.due(14.0) == []  # the fifth try waits 8 s
    assert backoff.hurry(4, now=14.0) and backoff.due(14.0) == [4]
    assert not backoff.hurry(4, now=14.1)  # tried already: nothing pending
    backoff.refused(4, now=14.2)  # refused again (it still does not admit this peer): 8 s, hurried once more at most
    assert backoff.hurry(4, now=15.0)
    assert not backoff.hurry(4, now=15.1)  # once per refusal
    assert backoff.due(15.1) == [4]
    backoff.refused(4, now=15.4)
    assert backoff.hurry(4, now=15.5) and backoff.due(15.5) == [4]
    assert not backoff.hurry(4, now=16.0) and not backoff.pending
    backoff.refused(9, now=0.0)
    assert not backoff.hurry(9, now=RETRY_FIRST_S)  # its time has come anyway: nothing to bring forward
    backoff.refused(2, now=0.0)
    backoff.cancel(2)
    assert not backoff.hurry(2, now=0.1)  # forgotten


def test_due_peers_come_in_the_order_they_were_scheduled():
    backoff = HandshakeBackoff(first_s=1.0, max_s=1.0)
    for peer in (5, 2, 9):
        backoff.refused(peer, now=0.0)
    assert backoff.due(1.0) == [5, 2, 9]


def test_a_wanted_reverse_endpoint_is_redialed_backing_off_and_a_dropped_one_never_again():
    redials = Redials()
    a, b = "tcp://10.0.0.2:4000", "tcp://10.0.0.3:4000"
    assert redials.lost(a, now=0.0) is None and not redials.pending  # never wanted: its events are not ours
    redials.want(a)
    redials.want(b)
    # a keeps failing: REDIAL_FIRST_S, doubling, at most REDIAL_MAX_S (the delays the policy gives, written out)
    now, delays = 0.0, []
    for _ in range(7):
        delay = redials.lost(a, now)
        delays.append(delay)
        assert redials.due(now + delay - 1e-6) == [] and redials.due(now + delay) == [a]
        now += delay
    expected = [min(REDIAL_MAX_S, REDIAL_FIRST_S * 2 ** n) for n in range(7)]
    assert delays == pytest.approx(expected) and max(delays) == REDIAL_MAX_S and redials.losses(a) == 7
    redials.up(a)  # a handshake: its next loss is redialed soon again
    assert redials.losses(a) == 0 and redials.lost(a, now) == REDIAL_FIRST_S
    # dropped while a redial was scheduled: never due, and its later events change nothing
    redials.lost(b, now)
    redials.drop(a)
    redials.drop(b)
    assert redials.due(now + 100.0) == [] and not redials.pending
    assert redials.lost(a, now) is None and redials.lost(b, now) is None and not redials.wanted(a)
    # wanted again (its peer came back there): counted from none
    redials.want(a)
    assert redials.wanted(a) and redials.losses(a) == 0 and redials.lost(a, now) == REDIAL_FIRST_S
