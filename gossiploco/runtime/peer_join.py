"""How a network peer starts and rejoins: the lifecycle programs of ``protocol.lifecycle`` (the same code the
simulator runs), driven on this peer's exchange (``ZmqExchange.drive``) with the run's settings, and what
they decide installed into the peer: the round to start with and, after a catch-up, the downloaded state.
``provide_state`` is the other side: the state this peer gives to peers catching up.

``join``: after discovery (with a directory), wait for the others and ask where they are; a new peer starts
round 0 with them, a resumed one its checkpoint's round, and one that finds the swarm further downloads the
state of its next round boundary. ``maybe_catch_up``: at every round start, the same decision for a peer
the swarm went on without. The rules themselves (when, from whom, what is checked) are in the lifecycle."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from gossiploco.mixing.packing import pack, unpack
from gossiploco.protocol import lifecycle
from gossiploco.runtime.waiting_line import short_start_line
from gossiploco.transport.zmq_exchange import random_nonce

if TYPE_CHECKING:
    from gossiploco.runtime.peer import NetworkPeer

log = logging.getLogger("gossiploco.runtime.peer")


def settings(peer: NetworkPeer) -> lifecycle.Settings:
    """The lifecycle's settings for ``peer``: its timeouts, the size of a usable state, whether it can rejoin."""
    cfg, t = peer.cfg, peer.cfg.timeouts
    state_size = None
    if cfg.mode == "factored":  # z and the outer momentum, then the inner optimizer's moments
        state_size = 2 * sum(peer.algo.z[n].numel() for n in peer.names) + peer.trainer.inner_opt.moments_size()
    return lifecycle.Settings(
        rounds=cfg.rounds, hello_s=t.hello_s, connect_s=t.startup_s if peer.directory is None else t.hello_s,
        boundary_s=t.startup_s, state_s=t.exchange_s, nonce=random_nonce, state_size=state_size,
        solo=cfg.workers == 1 and peer.directory is None,
        late_join_s=t.grace_s * lifecycle.LATE_JOIN_GRACE,
        rejoin_error="the sync-dp baseline cannot rejoin a running swarm; restart every peer" if cfg.mode == "sync-dp" else None)


def join(peer: NetworkPeer) -> int:
    """Find the others (with a directory), wait for them, ask where they are; returns the round this peer starts with."""
    started = time.monotonic()
    deadline = peer.discovery.discover_at_start() if peer.discovery is not None else None
    quorum = peer.cfg.workers if peer.directory is not None else 1  # start together once `workers` peers are in
    life = settings(peer)
    position = peer.exchange.join_swarm(life, peer.start_round, quorum, deadline)
    if position.members and len(position.members) < quorum:
        log.warning("rank %d: %s", peer.rank, short_start_line(position.round, position.members, quorum,
                                                               time.monotonic() - started))
    return install(peer, position)


def maybe_catch_up(peer: NetworkPeer, r: int) -> int:
    """At the start of round ``r``: the round to train (``r`` unless the swarm went on without this peer)."""
    life = settings(peer)
    return install(peer, peer.exchange.catch_up_if_behind(life, r))


def install(peer: NetworkPeer, position: lifecycle.Position) -> int:
    """Put a downloaded state into the peer (z, momentum, the donor's AdamW moments as a warm start, its step
    count the schedule's); returns the round to go on from."""
    if position.catchup_s:
        peer.clock.add("catchup_s", position.catchup_s)
    refused = peer.budget.adopt(position.clocks, time.monotonic())  # a shared round clock: the swarm's anchor
    if refused:
        log.warning("rank %d: %s", peer.rank, refused)
        peer.progress.count("round_clock_refused")
    if position.state is None:
        return position.round
    algo, flat, k = peer.algo, position.state, position.round
    outer = 2 * sum(algo.z[n].numel() for n in peer.names)
    algo.set_state(*unpack(flat[:outer], [algo.z, algo.momentum], peer.names))
    peer.trainer.inner_opt.import_moments(flat[outer:], k * peer.cfg.inner_steps)
    peer.progress.count("catchups")
    peer.progress.merge({"catchup_from": position.donor})
    return k


def provide_state(peer: NetworkPeer) -> tuple[int, torch.Tensor] | None:
    """State for a catching-up peer: (k, [z_k, momentum_k, AdamW moments]): the outer state of the
    round this peer last started, and its inner optimizer's moments after its latest inner step."""
    snapshot = peer.progress.round_start
    if snapshot is None:
        return None
    k, z, momentum = snapshot
    return k, torch.cat([pack([z, momentum], peer.names), peer.trainer.inner_opt.export_moments()])
