"""A DHT-joined network peer's discovery: at its start, the checks (the swarm key, the run's settings, its own
reachability), its announcement, and the wait for the run's peers (saying who is here and who is missing);
afterwards, every ``timeouts.discovery_s`` on a thread of its own, new peers found and connected and its own
round and tokens published. Functions of the ``NetworkPeer`` they serve (``runtime.peer``)."""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import TYPE_CHECKING

from gossiploco.errors import ExchangeError
from gossiploco.errors import DirectoryClosed
from gossiploco.membership.record import PeerRecord
from gossiploco.reach.tunnel import serve_tunnel
from gossiploco.runtime.waiting_line import WaitingReport

if TYPE_CHECKING:
    from gossiploco.runtime.peer import NetworkPeer

log = logging.getLogger("gossiploco.runtime.peer")

RUN_WATCH_EVERY = 5
"""A running peer reads the swarm's list of runs every this many ``discovery_s`` (a run started beside it)."""


def discover_at_start(peer: NetworkPeer) -> float:
    """Check this peer's settings match the run going in the swarm (``RunMismatch`` if not) and that it
    is reachable, announce it, and wait (up to ``timeouts.startup_s``, saying so) until ``workers`` peers
    of the run are known or the run is found already going. Returns that deadline (``time.monotonic``)."""
    ex, t, directory = peer.exchange, peer.cfg.timeouts, peer.directory
    assert directory is not None
    directory.confirm_swarm()  # a wrong swarm key stops here, with the reason
    others = peer.runs.check_start(directory.runs())  # other settings than the run going here stop here, named
    if others:
        log.info("rank %d: starting run %s beside the other runs of this swarm (--new-run): %s", peer.rank,
                 peer.run_id, "; ".join(run.label() for run in others))
    if peer.reach.reachable and not peer.reach.verified and not ex.check_reachable(t.hello_s):
        host_port = peer.endpoint.removeprefix("tcp://")
        raise ExchangeError(
            f"peer {peer.rank}: its advertised endpoint {peer.endpoint} does not answer a ZeroMQ handshake "
            f"within {t.hello_s:.0f}s. Other peers connect to it: make sure {host_port} is this machine's "
            "address as others see it (pass --announce HOST with your public or LAN address), and that the "
            "TCP port is open in the firewall (or forwarded by the NAT router); see README, 'Running across the internet'.")
    taken = directory.peers().get(peer.rank)
    if taken is not None and taken.endpoint != peer.endpoint:
        log.warning("rank %d: peer id %d was announced by %s (a previous run of this peer?); taking it over. "
                    "If another live peer uses this identity, give one of them another --identity",
                    peer.rank, peer.rank, taken.endpoint)
    key = peer.trust.identity.curve_public if peer.trust is not None else b""
    reach = peer.reach
    if not reach.reachable and peer.paths.run_in_node is not None:  # others' relayed streams end at our ROUTER
        bind_host, port = peer.exchange.bound.removeprefix("tcp://").rsplit(":", 1)
        peer.paths.run_in_node(partial(serve_tunnel, router_host=bind_host, router_port=int(port)))
    directory.announce_run(peer.runs.entry)
    directory.announce(PeerRecord(peer.rank, peer.endpoint, round=-1, tokens=0, key=key, reachable=reach.reachable,
                                  p2p=reach.p2p, relays=reach.relays))
    deadline = time.monotonic() + t.startup_s
    waiting, runs_read = WaitingReport(peer.cfg.workers, deadline), time.monotonic()
    while True:
        records = sync_peers(peer)
        going = {p: r.round for p, r in records.items() if r.round >= 1}
        if going:
            log.info("rank %d: run %s is already going (%d peers, in round %d at most): joining it", peer.rank,
                     peer.run_id, len(going), max(going.values()))
        now = time.monotonic()
        if len(records) >= peer.cfg.workers or going or now > deadline:
            break  # short of peers: one warning when the first round starts (_join)
        line = waiting.update(now, list(records))
        if line is not None:
            log.info("rank %d: %s", peer.rank, line)
        if now - runs_read >= t.discovery_s:  # a run started beside this one at the same moment
            runs_read = now
            watch_runs(peer)
        if peer._stop_discovery.wait(0.25):
            break
    peer._discovery = threading.Thread(target=discovery_loop, args=(peer,), name=f"discovery-{peer.rank}", daemon=True)
    peer._discovery.start()
    return deadline


def watch_runs(peer: NetworkPeer) -> None:
    """Warn once about each run with other settings that started beside this one (``run_match``)."""
    assert peer.directory is not None
    for warning in peer.runs.warnings(peer.directory.runs()):
        log.warning("rank %d: %s", peer.rank, warning)


def sync_peers(peer: NetworkPeer) -> dict[int, PeerRecord]:
    """The run's announced peers; connects to new ones (or ones that moved)."""
    assert peer.directory is not None
    records = peer.directory.peers()
    offers = peer.paths.sync(records)
    if offers is not None:  # reverse connections for peers behind NAT: they dial the ports in our record
        peer.directory.update(reverse=offers)
        peer.directory.publish_now()
    return records


def discovery_loop(peer: NetworkPeer) -> None:
    """Every ``timeouts.discovery_s``: find new peers, publish this one's round and tokens."""
    assert peer.directory is not None
    ticks = 0
    while not peer._stop_discovery.wait(peer.cfg.timeouts.discovery_s):
        ticks += 1
        try:
            sync_peers(peer)
            peer.directory.update(round=max(peer.exchange.current_round, -1), tokens=peer._tokens)
            if ticks % RUN_WATCH_EVERY == 0:
                watch_runs(peer)
        except DirectoryClosed:
            return
        except Exception:  # noqa: BLE001 - discovery must outlive surprises; they are logged
            log.exception("rank %d: peer discovery failed; retrying", peer.rank)
