"""What a simulated run costs each peer (``SimResult.stats["per_peer"]``): medians over peers, per round each peer
finished, of its round and blocking time, Mix1 completion, bytes, messages and connections; what one peer costs as
the swarm grows (``bench/scale_sim.py``, ``bench/pairing_sim.py``). The per-peer medians are over the swarm's founding
peers (their rounds are the run's); brand-new peers that joined (``simulation.newcomers``) are counted apart: how many,
how many finished, and the control messages each sent over its whole stay (its join's cost). The exchanges that failed
are counted by cause over the whole run (``failure_cause``)."""

from __future__ import annotations

import re
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gossiploco.simulation.swarm import SimSwarm


def failure_cause(error: Exception) -> str:
    """Why an exchange failed, without what differs from one failure of that kind to the next (its key, the peers and
    numbers it names): ``"this peer was not ready within the grace window; [N] went on without it"``."""
    text = str(error).partition(": ")[2] or str(error)  # past "<what>: ", the exchange's name
    return re.sub(r"\b\d+(?:\.\d+)?", "N", re.sub(r"\[[0-9, ]*\]", "[N]", text))


def per_peer_stats(swarm: SimSwarm) -> dict:
    """Medians over peers, per round each peer finished: what one peer costs as the swarm grows."""
    def median(values) -> float:
        values = list(values)
        return statistics.median_high(values) if values else 0.0
    founders = range(swarm.settings.peers)
    newcomers = [p for p in swarm.ids if p >= swarm.settings.peers]
    rounds = {p: max(1, swarm.finished.get(p, 0)) for p in founders}
    live = swarm.net.live_connections()
    mix1 = [ok for *_, ok in swarm.timings]
    return {
        "round_s": round(median(t[2] for t in swarm.timings), 4),
        "blocking_s": round(median(t[3] for t in swarm.timings), 4),
        "blocking_p90_s": round(sorted(t[3] for t in swarm.timings)[int(0.9 * (len(swarm.timings) - 1))], 4)
        if swarm.timings else 0.0,
        "mix1_completion": round(sum(mix1) / len(mix1), 4) if mix1 else 0.0,
        "bytes_per_round": round(median(swarm.bytes_sent.get(p, 0) / rounds[p] for p in founders), 1),
        "messages_per_round": round(median(swarm.net.sent_by.get(p, 0) / rounds[p] for p in founders), 2),
        "control_per_round": round(median(swarm.control_sent.get(p, 0) / rounds[p] for p in founders), 2),
        "control_received_per_round": round(median(swarm.control_received.get(p, 0) / rounds[p]
                                                   for p in founders), 2),
        "connections_live": median(live.get(p, 0) for p in founders),
        "connections_peak": median(swarm.net.peak_links.get(p, 0) for p in founders),
        "connections_peak_max": max((swarm.net.peak_links.get(p, 0) for p in founders), default=0),
        "connections_opened": median(swarm.net.connections_of.get(p, 0) for p in founders),
        "newcomers": len(newcomers),
        "newcomers_finished": sum(swarm.finished.get(p, 0) >= swarm.settings.rounds for p in newcomers),
        "newcomer_control_sent": median(swarm.control_sent.get(p, 0) for p in newcomers),
        "failures": dict(swarm.failures.most_common()),
        "mix1_again": dict(swarm.ran_again)}
