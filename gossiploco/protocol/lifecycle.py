"""The peer's lifecycle as sans-I/O programs, written once: joining, asking where the others are, deciding
to catch up, waiting for the swarm's next round boundary, choosing donors, downloading and checking a
state, stepping out and back in. The ZeroMQ driver (``ZmqExchange.drive``, with ``drive`` below) and the
simulator (``SimPeer.drive``) run these same generators; neither holds a rule of its own.

A program is a generator over a ``PeerNode``. It reads and changes the node directly (its driver holds the
node's lock whenever the program runs) and yields what it needs done, as one of these effects:

    Act(actions)   carry out the node's actions (sends; never blocks)   -> the time after
    Now()          nothing                                              -> the time now
    Wait(until)    until the node changes (an event came) or ``until``  -> the time after
    Sleep(until)   until ``until``, whatever arrives                    -> the time after
    Run(call)      run an exchange ``Call`` to its end (lock released)  -> its outcome; its ``ExchangeError``
                                                                           is thrown into the program

Times are the driver's clock (``time.monotonic`` or the simulator's virtual clock). Programs log through
``node.note`` like the rest of the protocol (the driver writes the notes). What they decide they return as a
``Position``: the round to start with and, after a catch-up, the downloaded state for the owner to install.

The rules, in the order a peer meets them:

* ``join``: wait (``connect_s``) for every known peer to connect, leaving out those that did not (they join
  with a hello when they come); ask the others' rounds (``ask_rounds``). Nobody further than this peer's
  start round (0, or a checkpoint's): take part from it, and optionally wait for a quorum of members.
  Otherwise the swarm went on: ``catch_up``.
* ``maybe_catch_up`` at every round start: the swarm went on without this peer when it is alone while
  others are connected or were lost just now (all at once: it was frozen, they dropped it), when a group
  leader is already ``CATCH_UP_LAG`` rounds further, or when a leader left it out as a straggler (it runs
  behind the swarm's clock within the same round number).
* ``ask_rounds``: a probe to a sample of the reachable peers (``ROUND_SAMPLE``); their answers within ``hello_s``
  (asking again every ``PROBE_REPEAT_S`` whoever has not answered: a question or its answer can be lost with a
  connection that dropped and came back). Only ``corroborated`` claims count.
* ``catch_up``: step out of the others' views (they would wait a grace window for this peer at every
  exchange), wait for the next round boundary (``next_round_begins``), then download that round's state from
  a peer in it (donors rotated by this peer's id, so newcomers spread over them), check its size and that
  it is finite, and take part again from that round. No donor gives a usable state: a peer with a state of
  its own goes on with it; a fresh process retries once the swarm begins another round, then gives up
  (``ExchangeError``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from gossiploco.errors import ExchangeClosed, ExchangeError
from gossiploco.protocol.call import Call
from gossiploco.protocol.collectives import FetchState
from gossiploco.protocol.messages import PROBE, STEPPING_OUT, Action
from gossiploco.protocol.node import PeerNode

CATCH_UP_LAG = 1
"""A peer this many rounds behind another at the start of a round downloads the state instead of
trailing the swarm. While it takes part, no peer can start a later round before it (each round's
Mix2 includes it), so any lag at a round start means the swarm went on without it."""
RECENT_LOSS_S = 10.0
"""A peer alone at a round start that lost connections this recently first waits (``hello_s``)
for them to come back, then asks where the others are."""
BOUNDARY_POLL_S = 0.25
"""How often a catching-up peer asks the others' rounds while it waits for the next round to begin (by default;
``Settings.boundary_poll_s``): a fortieth of the default grace window (``[timeouts] grace_s`` = 10 s), so a peer
that caught up at a boundary lags the others by far less than the window its next exchange waits for it."""
LATE_JOIN_GRACE = 0.5
"""``Settings.late_join_s`` in grace windows: a joiner that late into the others' round would keep its bucket waiting
for up to that much of its window, so it waits for the boundary instead (``joined_late``)."""
BOUNDARY_SAMPLE = 2
"""While it waits for a round boundary a catching-up peer asks this many peers of the newest round each poll, the
next ones each time (not the whole swarm every ``BOUNDARY_POLL_S``: at 128 peers that was 45 hellos per peer per
restart). Two, not one: a lone answer's claim is taken as it is (``corroborated``), two check each other. With 8
asked every poll, the 8 peers a newcomer asked answered 80 polls a round each: most control messages those peers
sent."""
ROUND_SAMPLE = 16
"""``ask_rounds`` with no peers named asks at most this many reachable peers (a random sample; all of them in a
smaller swarm): where the swarm is needs a few answers, not one from every peer. Asking every peer made each
peer answer every joiner and every peer that looked for its place, control messages growing with the swarm."""
PROBE_REPEAT_S = 1.0
"""``ask_rounds`` asks a reachable peer that has not answered again after this long."""
FRESH_ATTEMPTS = 2
"""How many times a fresh process (nothing of its own to go on with) tries a catch-up before giving up; so does a
peer with a state of its own whose download failed while a donor is still there to ask at the next boundary (its
connection dropped mid-download and came back: a relay's reset, say), rather than trail the swarm on its own state."""


# -- effects ---------------------------------------------------------------------------------------

@dataclass
class Act:
    actions: list[Action]


@dataclass
class Now:
    pass


@dataclass
class Wait:
    until: float


@dataclass
class Sleep:
    until: float


@dataclass
class Run:
    call: Call


Effect = Act | Now | Wait | Sleep | Run
Program = Generator[Effect, Any, Any]


# -- settings and results --------------------------------------------------------------------------

@dataclass
class Settings:
    """What the lifecycle needs from the run's configuration; one per peer."""

    rounds: int
    """Rounds of the run (a swarm that finished them begins no other)."""
    hello_s: float
    """How long to wait for the others' answers, or for lost connections to come back."""
    connect_s: float
    """How long ``join`` waits for every known peer to connect."""
    boundary_s: float
    """At most this long waiting for the swarm's next round boundary before a catch-up."""
    state_s: float
    """The deadline of one state download."""
    nonce: Callable[[], str]
    """A new state-request nonce (unique to this process: the driver's randomness)."""
    state_size: int | None = None
    """The number of values a usable state has (None: not checked)."""
    solo: bool = False
    """A one-peer run with a static list: nobody to catch up with."""
    rejoin_error: str | None = None
    """Why this peer cannot download a state and rejoin (the sync-dp baseline); None: it can."""
    boundary_poll_s: float = BOUNDARY_POLL_S
    """How often a catching-up peer asks the others' rounds while it waits for a round boundary (the simulator, whose
    clock runs rounds and grace windows 20 times shorter than a real run's, shortens it in proportion)."""
    probe_repeat_s: float = PROBE_REPEAT_S
    """After how long ``ask_rounds`` asks a peer that has not answered again (the simulator: in proportion to its
    shorter ``hello_s``, so that a question lost on a lossy link is asked again within the window, as in a real run)."""
    late_join_s: float | None = None
    """``join`` takes part in the round the others are in only if they began it at most this long ago (the lower
    median of what they answered, ``Hello.began_ms_ago``); later, it catches up at the next boundary instead
    (``joined_late``). ``LATE_JOIN_GRACE`` grace windows in the runtime and the simulator; None: no limit."""


@dataclass
class Position:
    """Where a peer stands after a lifecycle program: the round it starts (or goes on) with."""

    round: int
    state: torch.Tensor | None = None
    """The downloaded flat state of ``round`` (z, momentum, inner optimizer moments) to install; None: keep its own."""
    donor: int | None = None
    """Who gave ``state``."""
    fresh_join: bool = False
    """``state`` was downloaded by a peer joining a running swarm (rather than one that fell behind)."""
    catchup_s: float = 0.0
    """Seconds spent catching up (waiting for the boundary and downloading), 0 without a catch-up."""
    members: list[int] = field(default_factory=list)
    """``join``: the members of the start round when it returned (fewer than a quorum: the owner says so)."""
    clocks: tuple[tuple[int, float], ...] = ()
    """What the peers asked said of their round clocks, ``(round, when it ends on this peer's clock)`` each (``join``
    and a catch-up): on a shared round clock the owner takes up theirs (``round_clock.RoundClock.adopt``)."""


def round_clocks(node: PeerNode) -> tuple[tuple[int, float], ...]:
    """The round clocks the reachable peers last told this one of (``Position.clocks``)."""
    reachable = node.peers.reachable()
    return tuple(clock for p, clock in sorted(node.peers.round_clocks.items()) if p in reachable)


def corroborated(rounds: dict[int, int]) -> dict[int, int]:
    """The round claims another member backs: peer ``p``'s round ``k`` stands if some other peer reports
    round ``k - 1`` or later (a round boundary may fall between two answers). Where one peer answered,
    its claim stands. So a lone member claiming a far later round (a bug, or a lie) cannot make the
    others download its state; honest peers differ by at most one round at a boundary."""
    if len(rounds) < 2:
        return dict(rounds)
    return {p: k for p, k in rounds.items() if any(q != p and j >= k - 1 for q, j in rounds.items())}


# -- the programs ------------------------------------------------------------------------------------

def _wait(node: PeerNode, effect: Wait | Sleep, what: str) -> Program:
    """Yield ``effect``; raise the node's error if it closed (or its carrier broke) meanwhile."""
    now = yield effect
    error = node.open_error(what)
    if error is not None:
        raise error
    return now


def wait_connected(node: PeerNode, until: float) -> Program:
    """Until every known peer is reachable (a connection up, or an idle member's link that opens on demand), or
    ``until``; returns whether all are."""
    now = yield Now()
    while len(node.peers.reachable()) < len(node.peers.known) - 1 and now < until:
        now = yield from _wait(node, Wait(until), "the wait for connections")
    return len(node.peers.reachable()) >= len(node.peers.known) - 1


def round_sample(node: PeerNode, size: int = ROUND_SAMPLE) -> list[int]:
    """Up to ``size`` of the reachable peers, drawn afresh for each question (keyed by the run's seed, this peer
    and its question's id, so a simulated run replays)."""
    reachable = sorted(node.peers.reachable() - {node.rank})
    if len(reachable) <= size:
        return reachable
    return sorted(random.Random(f"{node.group_seed}/{node.rank}/{node.probe_id}").sample(reachable, size))


def ask_rounds(node: PeerNode, s: Settings, peers: list[int] | None = None) -> Program:
    """The rounds that ``peers`` (default: a ``round_sample`` of the reachable peers) report within ``hello_s``,
    less uncorroborated claims."""
    if peers is None:
        peers = round_sample(node)
    now = yield Act(node.announce(PROBE, to=peers))  # a probe: asks the peers' rounds (and says this one's join round)
    deadline, asked = now + s.hello_s, now
    want = set(peers) & node.peers.reachable()
    while now < deadline:
        missing = sorted((want & node.peers.reachable()) - node.peers.reported.keys())  # one that dropped: not waited for
        if not missing:
            break
        if now >= asked + s.probe_repeat_s:
            now = yield Act(node.ask_again(missing))
            asked = now
        now = yield from _wait(node, Wait(min(deadline, asked + s.probe_repeat_s)), "asking the others' rounds")
    rounds = dict(node.peers.reported)
    kept = corroborated(rounds)
    if kept != rounds:
        node.note(f"ignoring round claims no other member backs: {({p: k for p, k in rounds.items() if p not in kept})} "
                  f"(all reported: {rounds})")
    return kept


def join(node: PeerNode, s: Settings, start_round: int, quorum: int = 1, quorum_until: float | None = None) -> Program:
    """Start: wait for the others, ask where they are; a ``Position`` with the round to start with. A new peer
    starts at round 0 with them, a resumed one at its checkpoint's ``start_round`` (a whole swarm restarting
    starts again where it stopped); where others are further, the swarm went on: ``catch_up``. ``quorum``:
    having taken part, wait for that many members of the start round until ``quorum_until`` (at least
    ``hello_s``: peers found just before it are still saying which round they start)."""
    now = yield Now()
    if not (yield from wait_connected(node, now + s.connect_s)):
        node.note(f"peers {node.peers.drop_unconnected()} not connected after {s.connect_s:.0f}s; "
                  "starting without them until they say hello")
    rounds = yield from ask_rounds(node, s)
    now = yield Now()
    ahead = {p: k for p, k in rounds.items() if k > start_round} or joined_late(node, s, rounds, start_round, now)
    if ahead:
        return (yield from catch_up(node, s, ahead, current=start_round,
                                    fresh=start_round == 0, resumed=start_round > 0))
    now = yield Act(node.announce(start_round))
    until = max(quorum_until if quorum_until is not None else now, now + s.hello_s) if quorum > 1 else now
    while len(node.members(start_round)) < quorum and now < until:
        # A swarm stopped across a round boundary resumes: a peer that stopped a round later answered the question
        # with round -1 (not started yet), then says (its hello, not a join inferred from a Ready) that it takes part
        # from the next round, and does not wait for this one (this peer counts among its members). Waiting for the
        # quorum would wait out the start-up timeout for a member that never comes to this round: take its state.
        later = {p: k for p, k in node.peers.said_joins().items() if k == start_round + 1} if start_round > 0 else {}
        if later:
            node.note(f"peers {sorted(later)} resumed at round {start_round + 1}: taking their state")
            return (yield from catch_up(node, s, later, current=start_round, fresh=False, resumed=True))
        now = yield from _wait(node, Wait(until), "the wait for the others at the start")
    return Position(start_round, members=node.members(start_round), clocks=round_clocks(node))


def joined_late(node: PeerNode, s: Settings, rounds: dict[int, int], start_round: int, now: float) -> dict[int, int]:
    """The peers in ``start_round`` (of ``rounds``, the answers ``join`` got) if they began it too long ago for this
    peer to take part in it (the median of what they said, past ``late_join_s``), else {}.

    A peer that joins a round late trains it late: its Mix2 comes that much after theirs, and every member of its
    bucket (and every follower whose leader it is by the draw) waits for it, up to a grace window each, where the
    others' views hold it already. It waits for the round's end and downloads the next round's state instead, as a
    peer that arrives in a later round does. Not on a shared round clock (their answers said when the round ends:
    the joiner takes up that clock and ends the round with them), nor where the peer cannot download a state. The
    median (the lower of two), so that one member's claim alone decides nothing where several answered: a liar makes a
    joiner wait a round at worst, or join late as it did before this rule."""
    if s.late_join_s is None or s.rejoin_error is not None:
        return {}
    in_round = {p for p, k in rounds.items() if k == start_round}
    if any(node.peers.round_clocks.get(p, (None,))[0] == start_round for p in in_round):
        return {}
    ages = sorted(now - began for p in in_round
                  for k, began in [node.peers.round_starts.get(p, (None, now))] if k == start_round)
    median = ages[(len(ages) - 1) // 2] if ages else None  # the lower one of two: a lone claim of a long round loses
    if median is None or median <= s.late_join_s:
        return {}
    node.note(f"the others began round {start_round} {median:.1f}s ago (median of {len(ages)}): "
              f"taking part from the next round, with its state")
    return {p: start_round for p in in_round}


def maybe_catch_up(node: PeerNode, s: Settings, r: int) -> Program:
    """At the start of round ``r``: the ``Position`` to go on from (``r`` itself unless the swarm went on)."""
    if s.solo:
        return Position(r)
    now = yield Now()
    lost = node.peers.recently_lost(RECENT_LOSS_S, now)
    alone = node.members(r) == [node.rank] and bool(node.peers.pending() or lost)
    left_behind = any(k >= r + CATCH_UP_LAG for k in node.peers.leader_rounds.values())
    straggling = node.straggling(r)  # same round, but behind the swarm's clock: re-align at its next round
    if not (alone or left_behind or straggling):
        return Position(r)
    if lost:
        yield from wait_connected(node, now + s.hello_s)  # they reconnect within moments if they are alive
    rounds = yield from ask_rounds(node, s)
    ahead = {p: k for p, k in rounds.items() if k >= r + (0 if straggling else CATCH_UP_LAG)}
    if ahead:
        return (yield from catch_up(node, s, ahead, current=r))
    if alone:
        yield Act(node.announce(r))  # they are not ahead: just take part again from this round
    return Position(r)


def catch_up(node: PeerNode, s: Settings, ahead: dict[int, int], current: int, fresh: bool = False,
             resumed: bool = False) -> Program:
    """At the next round boundary k, download round k's state from a peer in round k; take part from round k.
    ``fresh``: this process has no state of its own to go on with. ``resumed``: it starts from its
    checkpoint of round ``current``; peers one round further (a swarm stopped across a round boundary and
    started again: they wait for the others at its start) give their state at once, without waiting for
    the next boundary."""
    if s.rejoin_error is not None:
        raise ExchangeError(f"rank {node.rank}: the swarm is past round {current} (peers' rounds {ahead}) and "
                            f"{s.rejoin_error}")
    began = yield Now()
    if not fresh and not resumed:  # the others count on this peer: step out, or each exchange waits a grace window for it
        yield Act(node.announce(STEPPING_OUT, ask_reply=False))
    for attempt in range(FRESH_ATTEMPTS):
        if attempt or not (resumed and max(ahead.values()) == current + 1):
            ahead = yield from next_round_begins(node, s, ahead)
        got = yield from download(node, s, ahead)
        now = yield Now()
        if got is not None:
            k, flat, donor = got
            yield Act(node.announce(k, caught_up=True))  # replies re-admit peers dropped meanwhile
            node.note(f"{'joined a running swarm' if fresh else 'fell behind the swarm'}; caught up from peer "
                      f"{donor} at the start of round {k}, mixing again")
            return Position(k, state=flat, donor=donor, fresh_join=fresh, catchup_s=now - began,
                            clocks=round_clocks(node))
        retry = not fresh and attempt + 1 < FRESH_ATTEMPTS
        reachable = node.peers.reachable() if retry else set()
        back = sorted(p for p in ahead if p in reachable and node.peers.lost_at.get(p, began - 1) >= began)
        if back:
            # A donor's connection dropped during this catch-up and came back (a relay's reset, say): downloading
            # now, mid-round, would leave this peer behind the swarm's clock; it asks again at the next boundary
            node.note(f"no peer gave its state (rounds {ahead}); peers {back} lost their connection meanwhile and "
                      "are back: trying again at the next round boundary")
            continue
        if not fresh:  # it has a state of its own (the others finished or are gone): it goes on with that
            node.note(f"no peer gave its state (rounds {ahead}); going on from round {current} with this peer's own")
            yield Act(node.announce(current))
            return Position(current, catchup_s=now - began)
        rounds = yield from ask_rounds(node, s)
        ahead = {p: k for p, k in rounds.items() if k > current}
        if not ahead and rounds:  # those who answered are at round ``current`` or before (they restarted too, and
            # had no state to give while they did): this peer starts with them, as ``join`` does
            node.note(f"no peer gave its state, and none is past round {current} any more (rounds {rounds}); "
                      f"taking part from round {current} with them")
            yield Act(node.announce(current))
            return Position(current, members=node.members(current), clocks=round_clocks(node))
        if not ahead:
            break
    raise ExchangeError(f"rank {node.rank}: no peer gave its state "
                        + (f"(rounds {ahead})" if ahead else "and no peer answered where it stands"))


def next_round_begins(node: PeerNode, s: Settings, ahead: dict[int, int]) -> Program:
    """Until some peer begins a round after those in ``ahead`` (asking at most ``BOUNDARY_SAMPLE`` of the newest
    round's peers every ``boundary_poll_s``, at most ``boundary_s``); returns the peers in the newest round then
    (``ahead`` if none began one)."""
    latest = max(ahead.values())
    if latest >= s.rounds:
        node.note(f"the others finished all {s.rounds} rounds already (rounds {ahead})")
        return ahead
    now = yield Now()
    deadline = now + s.boundary_s
    newest_peers = sorted(p for p, k in ahead.items() if k == latest)
    shift = node.rank % len(newest_peers)
    rotated = newest_peers[shift:] + newest_peers[:shift]  # their next round is the boundary
    polls = 0
    while now < deadline:
        if all(p in node.peers.failed or p in node.peers.left for p in newest_peers):
            # Each lost its connection or said it leaves (a swarm's last other peer finishing its run, say): nobody
            # is left to begin a round, and waiting out ``boundary_s`` for one would only stall this peer
            node.note(f"every peer in round {latest} is gone ({newest_peers}); not waiting for a round boundary")
            return ahead
        reachable = node.peers.reachable()
        live = [p for p in rotated if p in reachable]
        start = polls * BOUNDARY_SAMPLE % max(len(live), 1)
        sample = (live[start:] + live[:start])[:BOUNDARY_SAMPLE]  # the live ones, the next few each poll
        polls += 1
        rounds = yield from ask_rounds(node, s, sample)
        newest = max(rounds.values(), default=-1)
        if newest > latest:
            return {p: k for p, k in rounds.items() if k == newest}
        now = yield Now()
        if now >= deadline:  # the question itself ran to the deadline (answers slow to come)
            break
        now = yield from _wait(node, Sleep(min(deadline, now + s.boundary_poll_s)), "the wait for a round boundary")
    node.note(f"no peer began a round after {latest} within {s.boundary_s:.1f}s; catching up from round {latest}")
    return ahead


def download(node: PeerNode, s: Settings, ahead: dict[int, int]) -> Program:
    """The state of the newest round in ``ahead`` from one of its peers, checked: ``(round, flat, donor)``,
    or None if no donor gave a usable one (each failure noted with its cause)."""
    latest = max(ahead.values())
    donors = sorted(p for p, k in ahead.items() if k == latest)
    shift = node.rank % len(donors)
    for donor in donors[shift:] + donors[:shift]:  # newcomers spread over the donors
        began = yield Now()
        try:
            k, flat = yield Run(FetchState(donor, s.nonce(), node.chunk_elems, began, began + s.state_s))
        except ExchangeClosed:
            raise
        except ExchangeError as exc:
            node.note(f"state download from {donor} failed: {exc}")
            continue
        if s.state_size is not None and flat.numel() != s.state_size:
            node.note(f"peer {donor} sent a state of {flat.numel()} values, not {s.state_size}; trying another")
            continue
        if not bool(torch.isfinite(flat).all()):
            node.note(f"peer {donor} sent a state with non-finite values; trying another")
            continue
        return k, flat, donor
    return None


# -- drivers -----------------------------------------------------------------------------------------

def advance(program: Program, value: Any, error: ExchangeError | None) -> tuple[bool, Any]:
    """Resume ``program`` with ``value`` (or throw ``error`` into it): ``(False, its next effect)``, or
    ``(True, its result)`` once it returned. The one step every driver repeats."""
    try:
        return False, program.throw(error) if error is not None else program.send(value)
    except StopIteration as stop:
        return True, stop.value


def drive(program: Program, *, locked: Callable, act: Callable[[list[Action]], None],
          wait: Callable[[float], None], sleep: Callable[[float], None], clock: Callable[[], float],
          run: Callable[[Call], Any]) -> Any:
    """Run ``program`` to its end on a driver that may block; returns its result or raises its error.

    ``locked()`` is a context manager holding the node's lock: the program runs inside it, as do ``act``
    (hand the actions to the carrier without blocking), ``wait(until)`` (sleep until ``until`` or until the
    node changes) and ``sleep(until)`` (until ``until`` or the node closes). ``run(call)`` is called
    without the lock and runs an exchange call to its end (``protocol.call.run_call``)."""
    value: Any = None
    error: ExchangeError | None = None
    while True:
        with locked():
            while True:
                done, effect = advance(program, value, error)
                if done:
                    return effect
                error = None
                if isinstance(effect, Run):
                    break
                if isinstance(effect, Act):
                    act(effect.actions)
                elif isinstance(effect, Wait):
                    wait(effect.until)
                elif isinstance(effect, Sleep):
                    sleep(effect.until)
                value = clock()
        try:
            value = run(effect.call)
        except ExchangeError as exc:
            error = exc
