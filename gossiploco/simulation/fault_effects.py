"""What each fault of a simulated run (``simulation.faults``) does to the swarm: crashes, restarts, freezes, relays
going down, link faults, and brand-new peers joining (``simulation.newcomers``)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from gossiploco.config_sections import TimeoutConfig
from gossiploco.membership.read_pacing import ReadPacing
from gossiploco.simulation.faults import RELAY_KINDS, Fault
from gossiploco.simulation.network import consumer_link

if TYPE_CHECKING:
    from gossiploco.simulation.peer import SimPeer
    from gossiploco.simulation.swarm import SimSwarm

DISCOVERY_RECORDS_PER_S = TimeoutConfig().discovery_records_per_s
"""The runtime's pacing of directory reads (``timeouts.discovery_records_per_s``): how often a member reads again."""


def apply_fault(swarm: SimSwarm, fault: Fault) -> None:
    """Schedule what ``fault`` does to ``swarm``."""
    net, pid = swarm.net, fault.peer
    if fault.kind in RELAY_KINDS:
        net.at(fault.start, lambda: net.relay_down(pid))
        if fault.kind == "relay_restart":
            net.at(fault.end, lambda: net.relay_up(pid))
    elif fault.kind in ("crash", "restart"):
        def crash() -> None:
            peer = swarm.peers.get(pid)
            if peer is None or not peer.running:
                return
            swarm.note(f"CRASH {pid}")
            peer.crash()
            swarm.crashed.add(pid)
            swarm.changed()
            for other in swarm.ids:
                if other != pid:
                    net.drop(pid, other, after=net.latency_s)
        net.at(fault.start, crash)
        if fault.kind == "restart":
            def restart() -> None:
                old = swarm.peers.get(pid)
                if old is not None and old.running:
                    return  # an overlapping restart window: this one's crash found it already down
                swarm.note(f"RESTART {pid}")
                swarm.crashed.discard(pid)
                swarm.changed()
                swarm.recovery.came_back(pid, net.now, max(swarm.finished.values(), default=0), fault)
                swarm.start_peer(pid, None, (old.incarnation + 1) if old else 1)
            net.at(fault.end, restart)
    elif fault.kind == "newcomer":
        net.at(fault.start, lambda: arrive(swarm, fault))
    elif fault.kind == "pause":
        def pause() -> None:
            peer = swarm.peers.get(pid)
            if peer is None or not peer.running:
                return
            swarm.note(f"PAUSE {pid}")
            peer.freeze()
            for other in swarm.ids:
                if other != pid:
                    net.watch_heartbeats(pid, other)

        def resume() -> None:
            peer = swarm.peers.get(pid)
            if peer is None or not peer.running or not peer.frozen:
                return
            swarm.note(f"RESUME {pid}")
            swarm.recovery.came_back(pid, net.now, max(swarm.finished.values(), default=0), fault)
            peer.thaw()
            for other in swarm.ids:
                if other != pid and net.idle_s is None:  # links on demand: those that dropped are redialing
                    net.try_connect(pid, other)
        net.at(fault.start, pause)
        net.at(fault.end, resume)
    else:
        net.faults.append(fault.link())
        if fault.kind in ("partition", "oneway"):
            a, b = fault.peers
            net.at(fault.start, lambda: net.watch_heartbeats(a, b))


def arrive(swarm: SimSwarm, fault: Fault) -> None:
    """A brand-new peer starts (``simulation.newcomers``): it reads the directory and joins as a restarted peer
    does; every other peer finds its record within ``discovery_s``."""
    pid, net, s = fault.peer, swarm.net, swarm.settings
    if pid in swarm.peers:
        return
    draw = random.Random(f"newcomer-{swarm.seed}-{pid}")
    swarm.note(f"NEWCOMER {pid}")
    swarm.ids.append(pid)
    swarm.inner_s[pid] = s.draw_inner_s(draw)
    if s.links == "consumer":
        net.links[pid] = consumer_link(draw)
    others = [q for q in swarm.peers if q != pid]
    swarm.newcomers.arrived(pid, others)
    swarm.changed()
    swarm.recovery.came_back(pid, net.now, max(swarm.finished.values(), default=0), fault)
    swarm.start_peer(pid, None, 0)
    for q in others:
        net.at(net.now + draw.uniform(0, s.discovery_s), lambda q=q: discover(swarm, q, pid))


def discover(swarm: SimSwarm, pid: int, newcomer: int) -> None:
    """``pid`` reads ``newcomer``'s record, as the runtime's discovery does (``runtime.peer_discovery``)."""
    peer = swarm.peers.get(pid)
    if not swarm.newcomers.found(pid, newcomer) or peer is None or not peer.running:
        return
    swarm.note(f"{pid} found {newcomer}'s record")
    if swarm.net.idle_s is None:  # a full mesh: known, pending until its hello; the newcomer's dialing connects
        peer.event(lambda node: _found(node, newcomer, None))
        return
    reread(swarm, peer, newcomer)


def reread(swarm: SimSwarm, peer: SimPeer, newcomer: int) -> None:
    """Links on demand: ``peer`` admits ``newcomer`` from its record's join round, reading it again at the runtime's
    paced interval (``ReadPacing.interval_s``) while it is still pending (its record said it had not decided)."""
    if not peer.running or swarm.peers.get(peer.pid) is not peer:
        return  # it crashed: a restart reads the directory afresh
    joined = swarm.peers[newcomer].node.record_join_round()
    peer.event(lambda node: _found(node, newcomer, joined))
    if newcomer in peer.node.peers.pending():
        pacing = ReadPacing(swarm.settings.discovery_s, DISCOVERY_RECORDS_PER_S)
        swarm.net.at(swarm.net.now + pacing.interval_s(len(swarm.peers)), lambda: reread(swarm, peer, newcomer))


def _found(node, newcomer: int, joined: int | None) -> list:
    """A read record's event: the node adds the peer (no message follows from it)."""
    node.add_peer(newcomer, joined)
    return []
