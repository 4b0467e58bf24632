"""State requests are rate-limited per requester in the protocol (``protocol.state_limit``), so a member cannot
make the others upload their state on demand; the requester of a refused download learns why at once."""

from __future__ import annotations

import pytest
import torch

from gossiploco.errors import PeerFailed
from gossiploco.protocol.collectives import FetchState, state_chunks
from gossiploco.protocol.messages import Send, ServeState, StateRequest
from gossiploco.protocol.node import PeerNode
from gossiploco.protocol.state_limit import BURST, REFILL_ROUNDS, REFUSED, StateRequestLimit


def _node() -> PeerNode:
    return PeerNode(0, range(4), grace_s=1.0, chunk_elems=5, mailbox_bytes=1 << 20)


def _served(actions) -> bool:
    if actions and isinstance(actions[0], ServeState):
        return True
    assert len(actions) == 1 and isinstance(actions[0], Send) and actions[0].message.tag == REFUSED
    assert actions[0].message.data.numel() == 0  # the refusal uploads nothing
    return False


def test_a_flooding_requester_gets_its_burst_then_one_upload_per_refill_period_and_others_are_unaffected():
    node = _node()
    node.current_round = 10
    served = [_served(node.receive(1, StateRequest(f"n{i}"), 0.0)) for i in range(5)]
    assert served == [True] * BURST + [False] * (5 - BURST)
    assert _served(node.receive(2, StateRequest("other"), 0.0))  # another member keeps its own budget
    uploads = 0
    for k in range(11, 11 + 4 * REFILL_ROUNDS):  # 5 requests a round for 4 refill periods
        node.current_round = k
        uploads += sum(_served(node.receive(1, StateRequest(f"{k}/{i}"), 0.0)) for i in range(5))
    assert uploads == 4
    assert node.state_limit.refused[1] == 5 * 4 * REFILL_ROUNDS + (5 - BURST) - 4
    assert node.state_limit.refused_total == node.state_limit.refused[1]
    logged = [text for _, text in node.notes if "refused a state request from peer 1" in text]
    assert 1 <= len(logged) <= 8  # logged at powers of two, not once per request


def test_an_honest_catch_up_pattern_is_never_refused():
    """A fresh process's two attempts, then one catch-up every few rounds: all served."""
    limit = StateRequestLimit()
    assert limit.allow(3, 5) and limit.allow(3, 6)
    assert all(limit.allow(3, k) for k in range(6 + REFILL_ROUNDS, 200, REFILL_ROUNDS))
    assert limit.refused_total == 0


def test_the_requester_table_stays_bounded():
    limit = StateRequestLimit(max_requesters=8)
    for peer in range(100):
        limit.allow(peer, 0)
        limit.allow(peer, 0)
        limit.allow(peer, 0)
    assert len(limit) == 8 and len(limit.refused) <= 8 and limit.refused_total == 100


def test_a_refused_download_fails_at_once_with_the_cause():
    node = _node()
    node.current_round = 3
    fetch = FetchState(0, "abc", 5, 0.0, 10.0)
    for i in range(BURST):
        assert _served(node.receive(1, StateRequest(f"x{i}"), 0.0))
    (refused,) = node.receive(1, fetch.start(_node())[-1].message, 0.0)
    with pytest.raises(PeerFailed, match="refused the request"):
        fetch.feed(refused.message)
    # a served request still downloads and verifies as before
    ok = FetchState(0, "ok", 5, 0.0, 10.0)
    for chunk in state_chunks("ok", (3, torch.arange(12.0)), 5):
        ok.feed(chunk)
    assert ok.outcome()[0] == 3 and torch.equal(ok.outcome()[1], torch.arange(12.0))


def test_a_request_sent_while_the_donor_was_unreachable_goes_again_once_it_is_back_and_is_served_once():
    """Seen in the chaos simulator (seed 910331): a relay reset the only path to the donor just before a restarted
    peer asked for the state; the request went nowhere and the download waited out its deadline twice, until the swarm
    had finished. Now the request is sent again when the donor is back, and the donor serves a nonce once."""
    requester = PeerNode(1, range(2), grace_s=1.0, chunk_elems=5, mailbox_bytes=1 << 20)
    requester.connected(0, 0.0)
    requester.disconnected(0, 1.0)  # the path dropped
    fetch = FetchState(0, "n1", 5, 1.1, 10.0)
    (first,) = [s for s in fetch.start(requester) if isinstance(s.message, StateRequest)]
    step = fetch.poll(requester, 1.2)
    assert not step.sends and step.wait_until is not None  # still gone: nothing to send it over
    requester.connected(0, 1.3)  # back
    step = fetch.poll(requester, 1.3)
    assert step.sends == [first] and step.error is None
    assert not fetch.poll(requester, 1.4).sends  # once
    donor = _node()
    donor.current_round = 2
    assert _served(donor.receive(1, first.message, 1.35))
    assert donor.receive(1, first.message, 1.36) == []  # the same request again (both got through): served once
    assert donor.state_limit.served == 1
    # a download whose donor was reachable when it asked never sends again
    steady = FetchState(0, "n2", 5, 2.0, 10.0)
    steady.start(requester)
    requester.disconnected(0, 2.1)
    requester.connected(0, 2.2)
    assert not steady.poll(requester, 2.3).sends


def test_a_flood_of_state_requests_over_zeromq_gets_bounded_uploads():
    """Real sockets: one member asks 12 times; the donor uploads ``BURST`` states, refuses the rest at once
    (each refusal a tiny frame), and counts them in its security counts."""
    from tests.test_exchange import ZmqGroup

    g = ZmqGroup(2, 5.0, chunk_bytes=4096, max_message_bytes=1 << 20)
    try:
        donor, flooder = g.exchanges
        state = torch.randn(20_000)  # 80 kB
        donor.serve_state(lambda: (2, state))
        before = donor.bytes_sent
        outcomes = []
        for _ in range(12):
            try:
                outcomes.append(torch.equal(flooder.fetch_state(0)[1], state))
            except PeerFailed as exc:
                assert "refused the request" in str(exc)
                outcomes.append(False)
        assert outcomes == [True] * BURST + [False] * (12 - BURST)
        uploaded = donor.bytes_sent - before
        assert BURST * state.numel() * 4 <= uploaded < (BURST + 1) * state.numel() * 4  # refusals cost ~nothing
        assert donor.security_counts()["refused_state_requests"] == {"1": 12 - BURST}
    finally:
        g.close()
