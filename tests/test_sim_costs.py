"""What a simulated run counts of its failed exchanges (``simulation.costs``): each one, by a cause that leaves out
what differs from one failure of that kind to the next, so that a scaling run can say why its exchanges failed."""

from __future__ import annotations

from gossiploco.errors import ExchangeTimeout, PeerFailed
from gossiploco.simulation.costs import failure_cause
from gossiploco.simulation.runs import simulate_scale


def test_a_cause_drops_the_exchange_name_the_peers_and_the_numbers():
    late = ExchangeTimeout("group 'mix1/12' led by 7: this peer was not ready within the grace window; [1, 5, 30] "
                           "went on without it")
    assert failure_cause(late) == "this peer was not ready within the grace window; [N] went on without it"
    views = PeerFailed("group 'mix2/3' led by 41: peer 41 does not lead it (our member views differ)")
    assert failure_cause(views) == "peer N does not lead it (our member views differ)"
    assert failure_cause(PeerFailed("'mix1/6': peer 25 disconnected")) == "peer N disconnected"
    assert failure_cause(ExchangeTimeout("'mix1/3': no chunk 2 from 17 within 12.6s")) == "no chunk N from N within Ns"
    assert failure_cause(PeerFailed("no name")) == "no name"


def test_every_failed_exchange_of_a_run_is_counted_once_by_its_label_and_cause():
    result = simulate_scale(1, 24, rounds=4, churn=0.1, log=True)
    failed = [line for line in result.log if " failed: " in line]
    counted = result.stats["per_peer"]["failures"]
    assert failed and sum(counted.values()) == len(failed)
    for label in ("mix1", "mix2"):
        assert sum(n for cause, n in counted.items() if cause.startswith(f"{label}: ")) == \
            sum(f" {label}/" in line.split(" failed: ")[0] for line in failed)
    assert list(counted.values()) == sorted(counted.values(), reverse=True)
    assert simulate_scale(1, 8, rounds=2, churn=0.0).stats["per_peer"]["failures"] == {}
