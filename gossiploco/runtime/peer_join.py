"""How a network peer starts and rejoins: ``join`` waits for the others and asks where they are (a new peer
starts round 0 with them, a resumed one its checkpoint's round); when the swarm went on without this peer
(started late, restarted, frozen, left out) it downloads the state of the next round boundary from a live
peer and trains that round in step with them (``catch_up``). ``provide_state`` is the other side: the
state this peer gives. Round claims only count when another member backs them (``corroborated``).
Functions of the ``NetworkPeer`` they serve (``runtime.peer``); the module docstring there tells the story."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from gossiploco.errors import ExchangeClosed, ExchangeError
from gossiploco.mixing.operators import all_finite, pack, unpack
from gossiploco.protocol.messages import STEPPING_OUT
from gossiploco.runtime.waiting_line import short_start_line

if TYPE_CHECKING:
    from gossiploco.factored import FactoredDiLoCo
    from gossiploco.runtime.peer import NetworkPeer

log = logging.getLogger("gossiploco.runtime.peer")

CATCH_UP_LAG = 1
"""A peer this many rounds behind another at the start of a round downloads the state instead of
trailing the swarm. While it takes part, no peer can start a later round before it (each round's
Mix2 includes it), so any lag at a round start means the swarm went on without it."""
RECENT_LOSS_S = 10.0
"""A peer alone at a round start that lost connections this recently first waits (``hello_s``)
for them to come back, then asks where the others are."""
BOUNDARY_POLL_S = 0.25
"""How often a catching-up peer asks the others' rounds while it waits for the next round to begin."""


def corroborated(rounds: dict[int, int]) -> dict[int, int]:
    """The round claims another member backs: peer ``p``'s round ``k`` stands if some other peer reports
    round ``k - 1`` or later (a round boundary may fall between two answers). Where one peer answered,
    its claim stands. So a lone member claiming a far later round (a bug, or a lie) cannot make the
    others download its state; honest peers differ by at most one round at a boundary."""
    if len(rounds) < 2:
        return dict(rounds)
    return {p: k for p, k in rounds.items() if any(q != p and j >= k - 1 for q, j in rounds.items())}


def join(peer: NetworkPeer) -> int:
    """Wait for the others, ask where they are; returns the round this peer starts with."""
    ex, t = peer.exchange, peer.cfg.timeouts
    started = time.monotonic()
    deadline = peer.discovery.discover_at_start() if peer.discovery is not None else started + t.startup_s
    if not ex.wait_connected(t.startup_s if peer.directory is None else t.hello_s):
        log.warning("rank %d: peers %s not connected after %.0fs; starting without them until they say hello",
                    peer.rank, ex.drop_unconnected(), t.startup_s)
    rounds = ask_rounds(peer)
    # A new peer starts at round 0, a resumed one at its checkpoint's round k (a whole swarm restarting
    # starts again where it stopped); where others are further, the swarm went on: download its state.
    k = peer.start_round
    ahead = {p: r for p, r in rounds.items() if r > k}
    if not ahead:
        ex.announce(k)
        if peer.directory is not None:  # start together once `workers` peers are in, or with those here by the deadline
            # (at least hello_s more: peers found just before it are still saying which round they start)
            members = ex.wait_members(k, peer.cfg.workers, max(deadline - time.monotonic(), t.hello_s))
            if len(members) < peer.cfg.workers:
                log.warning("rank %d: %s", peer.rank, short_start_line(k, members, peer.cfg.workers,
                                                                       time.monotonic() - started))
        return k
    return catch_up(peer, ahead, fresh=k == 0, current=k, resumed=k > 0)


def ask_rounds(peer: NetworkPeer) -> dict[int, int]:
    """The rounds members report (over their authenticated connections), less uncorroborated claims."""
    ex = peer.exchange
    ex.announce(-1)  # a probe: changes no membership, asks every peer for its round
    rounds = ex.peer_rounds(peer.cfg.timeouts.hello_s)
    kept = corroborated(rounds)
    if kept != rounds:
        log.warning("rank %d: ignoring round claims no other member backs: %s (all reported: %s)", peer.rank,
                    {p: k for p, k in rounds.items() if p not in kept}, rounds)
    return kept


def maybe_catch_up(peer: NetworkPeer, r: int) -> int:
    """At a round start: the swarm went on without us when we are alone while others are
    connected or were lost just now (all at once: we were frozen, they dropped us), when a
    group leader that left us out is already in a later round, or when a leader left us out as a
    straggler last round (we run behind the swarm's clock within the same round number)."""
    ex, t = peer.exchange, peer.cfg.timeouts
    if peer.cfg.workers == 1 and peer.directory is None:
        return r
    lost = ex.recently_lost(RECENT_LOSS_S)
    alone = ex.members(r) == [peer.rank] and bool(ex.pending() or lost)
    left_behind = any(k >= r + CATCH_UP_LAG for k in ex.leader_rounds().values())
    straggling = ex.straggling(r)  # same round, but behind the swarm's clock: re-align at its next round
    if not (alone or left_behind or straggling):
        return r
    if lost:
        ex.wait_connected(t.hello_s)  # they reconnect within moments if they are alive
    rounds = ask_rounds(peer)
    ahead = {p: k for p, k in rounds.items() if k >= r + (0 if straggling else CATCH_UP_LAG)}
    if ahead:
        return catch_up(peer, ahead, fresh=False, current=r)
    if alone:
        ex.announce(r)  # they are not ahead: just take part again from this round
    return r


def catch_up(peer: NetworkPeer, ahead: dict[int, int], fresh: bool, current: int = 0, resumed: bool = False) -> int:
    """At the next round boundary k, download (z, momentum, round k) from a peer in round k; train round k in step.
    If no peer gives its state (the others finished or are gone), a peer that has a state of its own
    goes on from ``current`` with it; a fresh process has nothing to go on with and raises ``ExchangeError``.
    ``resumed``: this process starts from its checkpoint of round ``current``; peers one round further
    (a swarm stopped across a round boundary and started again: they wait for the others at its start)
    give their state at once, without waiting for the next boundary."""
    if peer.cfg.mode == "sync-dp":
        raise ExchangeError(f"rank {peer.rank}: the swarm is past round 0 (peers' rounds {ahead}) and the "
                            "sync-dp baseline cannot rejoin a running swarm; restart every peer")
    start = time.perf_counter()
    if not fresh and not resumed:  # the others count on us: tell them we step out, or each exchange waits a grace window for us
        peer.exchange.announce(STEPPING_OUT, ask_reply=False)
    if not (resumed and max(ahead.values()) == current + 1):
        ahead = next_round_begins(peer, ahead)
    latest = max(ahead.values())
    donors = sorted(p for p, k in ahead.items() if k == latest)
    donors = donors[peer.rank % len(donors):] + donors[:peer.rank % len(donors)]  # spread newcomers over donors
    algo: FactoredDiLoCo = peer.algo  # type: ignore[assignment]
    for donor in donors:
        try:
            k, flat = peer.exchange.fetch_state(donor)
        except ExchangeClosed:
            raise
        except ExchangeError as exc:
            log.warning("rank %d: state download from %d failed: %s", peer.rank, donor, exc)
            continue
        outer = 2 * sum(algo.z[n].numel() for n in peer.names)
        opt = peer.trainer.inner_opt
        if flat.numel() != outer + opt.moments_size() or not all_finite(flat):
            log.warning("rank %d: peer %d sent an unusable state (%d values); trying another", peer.rank, donor, flat.numel())
            continue
        algo.set_state(*unpack(flat[:outer], [algo.z, algo.momentum], peer.names))
        # The donor's AdamW moments: a warm start instead of fresh ones (its step count is the schedule's).
        opt.import_moments(flat[outer:], k * peer.cfg.inner_steps)
        # Replies re-admit every peer this one had dropped while it was away (they tell their own rounds).
        peer.exchange.announce(k, caught_up=True)
        peer.progress.count("catchups")
        peer.clock.add("catchup_s", time.perf_counter() - start)
        log.warning("rank %d: %s; caught up from peer %d at the start of round %d, mixing again",
                    peer.rank, "joined a running swarm" if fresh else "fell behind the swarm", donor, k)
        peer.progress.merge({"catchup_from": donor})
        return k
    peer.clock.add("catchup_s", time.perf_counter() - start)
    if not fresh:  # it has a state of its own (the others finished or are gone): it goes on with that
        log.warning("rank %d: no peer gave its state (rounds %s); going on from round %d with this peer's own",
                    peer.rank, ahead, current)
        peer.exchange.announce(current)
        return current
    raise ExchangeError(f"rank {peer.rank}: the swarm is ahead (rounds {ahead}) and no peer gave its state")


def next_round_begins(peer: NetworkPeer, ahead: dict[int, int]) -> dict[int, int]:
    """Wait until some peer begins a round after those in ``ahead`` (asking every ``BOUNDARY_POLL_S``,
    at most ``timeouts.startup_s``); returns the peers in the newest round then."""
    latest = max(ahead.values())
    if latest >= peer.cfg.rounds:
        log.warning("rank %d: the others finished all %d rounds already (rounds %s)", peer.rank, peer.cfg.rounds, ahead)
        return ahead
    deadline = time.monotonic() + peer.cfg.timeouts.startup_s
    while time.monotonic() < deadline:
        rounds = ask_rounds(peer)
        if max(rounds.values(), default=-1) > latest:
            newest = max(rounds.values())
            return {p: k for p, k in rounds.items() if k == newest}
        if peer.wait_closing(BOUNDARY_POLL_S):
            break
    log.warning("rank %d: no peer began a round after %d within %.0fs; catching up from round %d",
                peer.rank, latest, peer.cfg.timeouts.startup_s, latest)
    return ahead


def provide_state(peer: NetworkPeer) -> tuple[int, torch.Tensor] | None:
    """State for a catching-up peer: (k, [z_k, momentum_k, AdamW moments]): the outer state of the
    round this peer last started, and its inner optimizer's moments after its latest inner step."""
    snapshot = peer.progress.round_start
    if snapshot is None:
        return None
    k, z, momentum = snapshot
    return k, torch.cat([pack([z, momentum], peer.names), peer.trainer.inner_opt.export_moments()])

