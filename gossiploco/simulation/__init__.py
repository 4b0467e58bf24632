"""Deterministic simulation of the whole peer protocol (``gossiploco.protocol``) under seeded faults.

    network     virtual clock, event queue, connections and link faults
    paths       each connection's path (direct, reverse, relayed) and the relays
    faults      the fault schedule drawn from a seed
    peer        a virtual peer: the real ``PeerNode`` and calls run by cooperative tasks
    invariants  the checked properties, each with a name
    swarm       the peers' round program (``SimSwarm``)
    runs        ``simulate(seed)`` (the chaos seeds' draws) and ``simulate_scale`` (a scaling run)
    costs       what a run costs each peer (round and blocking time, bytes, messages, connections)

``bench/chaos.py sim`` runs it over many seeds; a failing seed replays exactly.
"""

from gossiploco.simulation.runs import simulate
from gossiploco.simulation.swarm import Settings, SimResult

__all__ = ["SimResult", "Settings", "simulate"]
