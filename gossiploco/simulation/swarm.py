"""The whole-swarm simulation: M virtual peers run rounds of Factored Gossip DiLoCo's exchanges
under a fault schedule drawn from one seed, while ``Checker`` watches every property.

Each peer's program mirrors the network peer's (``gossiploco.runtime.peer``): per round r it
starts Mix1 (a global all-reduce of z, on a background task), runs its inner steps (a virtual
sleep), then Mix2 (pairwise gossip or a global all-reduce of its pseudo-gradient), waits for Mix1
and takes the outer step. Exchanges go through group agreement; a failed exchange is identity.
Joining, asking the others' rounds, catching up and stepping out are the runtime's own programs
(``protocol.lifecycle``: ``join`` for a restarted peer, ``maybe_catch_up`` at every round start), run by
``SimPeer.drive``; so is the shared round clock (``round_clock``). Over links on demand a restarted peer finds the
others in the run's directory as the runtime's does (``records``: each record's join round, ``PeerRecord.joined``,
read at its start and again each round). Small tensors stand in for the model; the mixing
math is the protocol's own. Some peers may be behind NAT (``Settings.behind_nat``): their connections are reverse or
go through relays, which can go down and reset connections at their limits; peers see all of it as disconnects.

Exchanges run in the buckets of ``protocol.groups`` (``Settings.group_size``; the chaos seeds draw 2 to 16, so even
small swarms split). Links are one LAN value or per peer (``links="consumer"``), compute may be unequal
(``inner_spread``) or overshoot at random (``round_jitter``), rounds may keep to a shared clock (``round_period``),
gossip may pair members as they come (``pairing``), and peers may churn (``churn``: crash and restart each round
with that probability); the per-peer costs of a run (round and blocking time, Mix1 completion, bytes, messages,
connections) are in ``SimResult.stats["per_peer"]`` (``costs``).

``runs.simulate(seed, ...)`` returns a ``SimResult`` with the violations and, if asked, the event log;
the same arguments give the same result, bit for bit. ``runs.simulate_scale`` is the scaling curve's run
(``bench/scale_sim.py``).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import torch

from gossiploco.config_sections import TimeoutConfig
from gossiploco.errors import ExchangeError, NoDecision
from gossiploco.mixing.operators import pair_matching
from gossiploco.protocol import keys, lifecycle
from gossiploco.protocol.collectives import AllToAll, PairMean, RingAllReduce
from gossiploco.protocol.messages import Send
from gossiploco.protocol.ring import segment_bounds
from gossiploco.round_clock import RoundClock
from gossiploco.simulation.costs import failure_cause, per_peer_stats
from gossiploco.simulation.fault_effects import apply_fault
from gossiploco.simulation.faults import Fault
from gossiploco.simulation.invariants import Checker, Violation
from gossiploco.simulation.network import SimNetwork, consumer_link
from gossiploco.simulation.newcomers import Newcomers
from gossiploco.simulation.paths import PATHS, Relays
from gossiploco.simulation.peer import SimPeer, payload_bytes
from gossiploco.simulation.recovery import Recovery
from gossiploco.transport.deadlines import AdaptiveDeadlines


@dataclass
class Settings:
    peers: int = 4
    rounds: int = 5
    inner_s: float = 1.0
    """Virtual seconds of inner steps per round."""
    grace_s: float = 0.5
    exchange_s: float = 6.0
    min_exchange_s: float = 1.0
    hello_s: float = 1.0
    heartbeat_s: float = 1.5
    values: int = 24
    chunk_elems: int = 8
    mailbox_bytes: int = 1 << 20
    mix2: str = "gossip"
    """Mix2's exchange: gossip (a swap), global (the ring) or all-to-all (a compressed mean's two phases)."""
    pairing: str = "bucket"
    """``[groups] pairing`` for gossip Mix2: bucket (the leader waits for its bucket) or ready (``protocol.pairing``)."""
    behind_nat: tuple[int, ...] = ()
    """Peers behind NAT (nobody can dial them); the others are reachable."""
    relays: int = 0
    """Relay nodes r0, r1, ...: what connects two peers behind NAT."""
    relay_bandwidth_bps: float = 1e8
    relay_data_limit: int | None = None
    """Bytes after which a relay resets a connection it carries (None: no limit)."""
    relay_time_limit_s: float | None = None
    """Seconds after which a relay resets a connection it carries (None: no limit)."""
    group_size: int = 16
    """``[groups] size``: views larger than this run each exchange in buckets (``protocol.groups``)."""
    links: str = "lan"
    """lan: every link 2 ms and 1 GB/s; consumer: each peer's access link 50 Mbit/s to 1 Gbit/s (log-uniform) and
    10 to 50 ms one way (a pair: 20 to 100 ms), drawn per peer."""
    inner_spread: float = 0.0
    """Unequal compute: peer p's inner steps take ``inner_s * (1 + inner_spread * u_p)``, u_p uniform in [0, 1]."""
    round_jitter: float = 0.0
    """A round's inner steps take ``U(0, round_jitter)`` s more, drawn per peer and round (a time budget's overshoot)."""
    round_period: float = 0.0
    """Time-budget rounds on the runtime's shared clock (``round_clock``) of this period: round r's compute ends at the
    anchor + (r + 1) ``round_period`` whatever ``inner_s``; a restarted peer adopts the anchor. 0: ``inner_s`` a round."""
    churn: float = 0.0
    """The chance that a peer crashes in a round (it restarts ``churn_down_s`` later and catches up)."""
    churn_down_s: float = 2.0
    links_idle_s: float = 0.0
    """Links on demand (``SimNetwork.idle_s``), each closed after this long idle; 0: every pair connected (a full
    mesh), as the ZeroMQ transport does."""
    links_cap: int = 0
    """Links on demand: the most a peer keeps (``SimNetwork.links_cap``); 0: no bound but the idle time."""
    mix1_again: bool = True
    """``mix1.again``: a failed Mix1 runs once more among its group's survivors while the round has time for it."""

    def draw_inner_s(self, rng: random.Random) -> float:
        """One peer's inner-step time per round (``inner_spread``)."""
        return self.inner_s * (1 + self.inner_spread * rng.random())
    discovery_s: float = 0.5
    """A member reads a newcomer's record (``Fault`` kind ``newcomer``) within this long of its start, at a time drawn
    uniformly: the read its refused handshake brings forward (``timeouts.discovery_s``; ``simulation.newcomers``)."""


@dataclass
class SimResult:
    seed: int
    settings: Settings
    violations: list[Violation]
    faults: list[Fault]
    finished: dict[int, int]
    """Rounds finished by each peer's last incarnation."""
    stats: dict = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


class SimSwarm:
    def __init__(self, seed: int, settings: Settings, log: bool = False):
        self.seed, self.settings = seed, settings
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.net = SimNetwork(self.rng, heartbeat_s=settings.heartbeat_s)
        self.net.idle_s = settings.links_idle_s or None
        self.net.links_cap = settings.links_cap or None
        self.net.behind_nat = frozenset(settings.behind_nat)
        self.net.relays = Relays(settings.relays, settings.relay_bandwidth_bps, settings.relay_data_limit,
                                 settings.relay_time_limit_s)
        self.ids = list(range(settings.peers))
        self.checker = Checker(settings.grace_s, settings.mailbox_bytes,
                               incarnation=lambda p: self.peers[p].incarnation if p in self.peers else -1, group_seed=seed)
        self.peers: dict[int, SimPeer] = {}
        self.crashed: set[int] = set()
        self.gave_up: set[int] = set()  # stopped with an error because every other peer was done or gone
        self.finished: dict[int, int] = {}
        self.snapshots: dict[tuple[int, int], torch.Tensor] = {}  # (peer, round) -> z at that round's start
        self.recovery = Recovery()
        self.deadlines: dict[int, AdaptiveDeadlines] = {}
        self.round_clocks: dict[int, RoundClock] = {}
        """pid -> its shared round clock (``Settings.round_period``), its latest incarnation's."""
        self.logging = log
        self.log: list[str] = []
        self.inner_s = {p: settings.draw_inner_s(self.rng) for p in self.ids}
        """Each peer's inner-step time per round (unequal with ``inner_spread``)."""
        if settings.links == "consumer":
            self.net.links = {p: consumer_link(self.rng) for p in self.ids}
        self.timings: list[tuple[int, int, float, float, bool]] = []
        """(peer, round, round seconds, blocking seconds, Mix1 ok) of every round a peer finished."""
        self.control_sent: dict[int, int] = {}
        """Control messages (every message but data chunks) each peer sent."""
        self.control_received: dict[int, int] = {}
        """Control messages delivered to each peer (from the incarnation that sent them)."""
        self.bytes_sent: dict[int, int] = {}
        self.failures: Counter[str] = Counter()
        """Exchanges that failed, by label and cause (``costs.failure_cause``), over every peer and round."""
        self.ran_again: Counter[str] = Counter()
        """Mix1 exchanges run again after a failure (``mixing.again``), by outcome: "ok" or "failed"."""
        self._done_dirty = True  # whether the run's end condition may have changed since it was last evaluated
        self.net.answers = lambda p: p in self.peers and self.peers[p].running and not self.peers[p].frozen
        self.net.on_connect = lambda a, b: self._to(a, lambda node: node.connected(b, self.net.now,
                                                                                   self._incarnation(b)))
        self.net.on_idle = lambda a, b: self._to(a, lambda node: node.idled(b, self.net.now))
        self.net.on_disconnect = lambda a, b: self._to(a, lambda node: node.disconnected(b, self.net.now))
        self.net.note = self.note
        self.newcomers = Newcomers()
        self.net.admits = self.newcomers.admits

    def note(self, text: str) -> None:
        if self.logging:
            self.log.append(f"{self.net.now:9.4f} {text}")

    # -- wiring ---------------------------------------------------------------------------------

    def _incarnation(self, pid: int) -> int | None:
        """The process at the other end of a link: its incarnation (a carrier that opens links on demand tells it)."""
        peer = self.peers.get(pid)
        return peer.incarnation if peer is not None and self.net.idle_s is not None else None

    def _to(self, pid: int, handle) -> None:
        peer = self.peers.get(pid)
        if peer is not None:
            peer.event(handle)

    def transmit(self, src: int, send: Send) -> None:
        sender = self.peers[src]
        msg = send.message
        if hasattr(msg, "data"):  # the carrier copies what it sends (the sender may reuse its buffer)
            msg = type(msg)(msg.key, msg.chunk, msg.meta, msg.data.clone())
        incarnation = sender.incarnation
        size = payload_bytes(send)
        self.bytes_sent[src] = self.bytes_sent.get(src, 0) + size
        if not hasattr(msg, "data"):
            self.control_sent[src] = self.control_sent.get(src, 0) + 1
        self.note(f"{src} -> {send.peer} {type(msg).__name__} {getattr(msg, 'key', '')} {getattr(msg, 'chunk', '')}")

        def deliver() -> None:
            peer = self.peers.get(send.peer)
            if peer is not None and self.peers.get(src) is not None and self.peers[src].incarnation == incarnation:
                if not hasattr(msg, "data"):
                    self.control_received[send.peer] = self.control_received.get(send.peer, 0) + 1
                peer.event(lambda node: node.receive(src, msg, self.net.now))
        self.net.send(src, send.peer, size, deliver)

    def records(self, pid: int, peers=None) -> dict[int, int]:
        """What ``pid`` reads in the run's directory: the join round each other peer's record says (``peers``: those
        only; a crashed peer's record outlives it, as a DHT record does until its time to live)."""
        chosen = self.peers if peers is None else peers
        return {q: self.peers[q].node.record_join_round() for q in chosen if q != pid and q in self.peers}

    def start_peer(self, pid: int, join_round: int | None, incarnation: int) -> None:
        # A restart over links on demand finds the others in the directory, as the runtime's peer does (its view starts
        # empty, filled from their records' join rounds); a full mesh's restart keeps the static list's view
        records = self.records(pid) if join_round is None and self.net.idle_s is not None else None
        self.newcomers.read_directory(pid)
        peer = SimPeer(self, pid, incarnation, join_round, records)
        self.peers[pid] = peer
        self.deadlines[pid] = AdaptiveDeadlines(self.settings.exchange_s, min_s=self.settings.min_exchange_s)
        if self.net.idle_s is None:  # a full mesh; links on demand open when something is sent
            for other in self.ids:
                if other != pid:
                    self.net.try_connect(pid, other)
        peer.spawn(self.program(peer, restarted=join_round is None), "main")

    # -- the peer program -----------------------------------------------------------------------

    def program(self, peer: SimPeer, restarted: bool):
        s = self.settings
        z = torch.zeros(s.values)
        r = 0
        life = self.life(peer)
        clock = RoundClock(s.round_period) if s.round_period else None  # the runtime's shared clock (round_budget)
        if clock is not None:
            self.round_clocks[peer.pid] = clock
        try:
            if restarted:
                r, z = self.position(peer, (yield from peer.drive(lifecycle.join(peer.node, life, 0))), z, clock)
            while r < s.rounds:
                r, z = self.position(peer, (yield from peer.drive(lifecycle.maybe_catch_up(peer.node, life, r))), z,
                                     clock)
                if r >= s.rounds:
                    break
                z = yield from self.round(peer, r, z, clock)
                r += 1
                self.finished[peer.pid] = r
                self._done_dirty = True
        except ExchangeError as exc:  # the runtime's peer stops with this error
            self.note(f"{peer.pid} stops: {exc}")
            if not any(p != peer.pid and self.peers[p].running and self.finished.get(p, 0) < s.rounds
                       and self.net.could_connect(peer.pid, p) for p in self.peers):
                self._done_dirty = True
                # The swarm finished or is gone, or every peer still training is out of this one's reach (their
                # relay is down): nobody to download a state from, and stopping with that error is the right end
                self.gave_up.add(peer.pid)
            return
        peer.node.begin_round(s.rounds, peer.now)  # as the runtime tells the others it is done
        self.note(f"{peer.pid} finished")

    def round(self, peer: SimPeer, r: int, z: torch.Tensor, clock: RoundClock | None):
        s = self.settings
        peer.node.begin_round(r, peer.now)
        peer.snapshot = (r, z.clone())
        self.snapshots[(peer.pid, r)] = z.clone()
        began = peer.now
        again_by = peer.mix1_again.round_began(peer.now)  # as ``FactoredDiLoCo.begin_round``
        mix1 = peer.spawn(self.mix(peer, "mix1", r, z, "global", again_by), "mix1")
        end = peer.now + self.inner_s[peer.pid] if clock is None else clock.begin(r, peer.now)  # shared: one deadline
        if clock is not None:  # time-budget rounds on the shared clock, whatever the peer's speed
            peer.node.round_ends = (r, clock.ends_at(r))
        end += random.Random(f"jitter-{self.seed}-{peer.pid}-{r}").uniform(0, s.round_jitter)
        if peer.reads_records:  # the directory read again (once a round here): a peer pending since it was found and
            for other, joined in self.records(peer.pid, peer.node.peers.pending()).items():  # decided since is admitted
                peer.node.add_peer(other, joined)
        if s.links_idle_s:  # links on demand: Mix2's handshakes at the round's start (a dead member is found long
            for other in peer.node.links_ahead(f"mix2/{r}", r):  # before Mix2) and half an idle time before it
                self.net.open_link(peer.pid, other)
            yield ("sleep", end - s.links_idle_s / 2)
            for other in peer.node.links_ahead(f"mix2/{r}", r):
                self.net.open_link(peer.pid, other)
        yield ("sleep", end)
        computed = peer.now
        delta = torch.randn(s.values, generator=torch.Generator().manual_seed(self.seed * 1000003 + peer.pid * 1009 + r))
        delta_hat = yield from self.mix(peer, "mix2", r, delta, s.mix2)
        yield ("join", mix1)
        x = mix1.result if mix1.error is None else z
        mixed = mix1.error is None and mix1.result is not z
        self.timings.append((peer.pid, r, peer.now - began, peer.now - computed, mixed))
        return x + 0.1 * delta_hat  # the outer step's shape: x - lr * (-delta_hat); its math is not under test here

    def mix(self, peer: SimPeer, label: str, r: int, value: torch.Tensor, kind: str, again_by: float | None = None):
        """One exchange of ``value``; Mix1 runs a failed one again while ``again_by`` (its round's, from
        ``RunAgain.round_began``) allows, as the runtime's ``FactoredDiLoCo._run_mix1`` does (``mixing.again``).
        Returns the mixed value, or ``value`` (identity)."""
        key, began = f"{label}/{r}", peer.now
        out, ok, grouped = yield from self.exchange(peer, key, label, r, value, kind)
        if label != "mix1":
            return out
        peer.mix1_again.ended(ok, peer.now - began, again=False)
        if ok and grouped:  # its group's mean in hand: it declines the exchange run again (``protocol.declines``)
            peer.node.completed(key)
        if ok or not grouped or not peer.mix1_again.wanted(again_by, peer.now):
            return out
        began = peer.now
        out, ok, _ = yield from self.exchange(peer, keys.again_key(key), label, r, value, kind)
        peer.mix1_again.ended(ok, peer.now - began, again=True)
        self.ran_again["ok" if ok else "failed"] += 1
        return out

    def exchange(self, peer: SimPeer, key: str, label: str, r: int, value: torch.Tensor, kind: str):
        """Exchange ``key`` (agreement, then data): (the mixed value, True, True), or (``value``, False, whether the
        group was agreed or its leader never decided) when it failed (``MixResult.grouped``, ``leaderless``)."""
        began = peer.now
        before = value.clone()
        deadline_s, grouped = None, False
        try:
            call = peer.node.group_call(key, r, peer.now)
            if call is None:
                return value, True, False  # not taking part in this round yet
            group = yield from peer.run_call(call)
            self.recovery.grouped(key, group)
            if len(group) == 1:  # what counts as taking part: ``simulation.recovery``
                if call.view == [peer.pid] and len(peer.node.members(r)) > 1:
                    self.recovery.took_part(peer.pid, r)  # alone in its bucket by the draw
                elif label in peer.node.paired and len(call.view) > 1:
                    self.recovery.told_alone(peer.pid, r, key)
                why = peer.node.isolated(group, key, r)  # counted as the real peer counts it, which fails that mix
                if why is not None:
                    self.failures[f"{label}: isolated"] += 1
                return value, why is None, False
            self.recovery.took_part(peer.pid, r)  # back in a group (an unmatched gossip peer takes part too)
            grouped = True
            deadlines = self.deadlines[peer.pid]
            deadline_s = deadlines.deadline_s(key)
            if kind == "global":
                self.checker.started(key, peer.pid, value, members=group)
                data = RingAllReduce(key, peer.pid, group, value.clone(), peer.node.chunk_elems, peer.now, peer.now + deadline_s)
                out = yield from peer.run_call(data)
            elif kind == "all-to-all":
                self.checker.started(key, peer.pid, value, members=group)
                out = yield from self.two_phase_mean(peer, key, group, value, peer.now + deadline_s)
                self.checker.check_mean(peer.pid, key, group, out, peer.now)
            else:
                partner = pair_matching(self.seed, r, label, group).get(peer.pid)
                if partner is None:
                    return value, True, True
                self.checker.started(key, peer.pid, value, partner)
                start = peer.now
                mean = yield from peer.run_call(PairMean(key, peer.pid, partner, value.reshape(-1).clone(),
                                                         peer.node.chunk_elems, start, start + deadline_s))
                out = mean.view(value.shape)
            deadlines.observe(key, peer.now - began)
            return out, True, True
        except ExchangeError as exc:
            self.failures[f"{label}: {failure_cause(exc)}"] += 1
            self.note(f"{peer.pid} {key} failed: {exc}")
            self.checker.identity_kept(peer.pid, key, before, value, peer.now)
            return value, False, grouped or isinstance(exc, NoDecision)  # ``MixResult.grouped``, ``leaderless``
        finally:
            if deadline_s is not None:
                self.checker.exchange_ended(peer, key, began, peer.now, deadline_s)

    def two_phase_mean(self, peer: SimPeer, key: str, group: list[int], value: torch.Tensor, deadline: float):
        """The compressed group mean's schedule (``mixing.compressed.group_mean``) with fp32 bytes for payloads:
        each member's segment k to owner k, the owner's sum to everyone; both phases within one deadline."""
        n, me = len(group), group.index(peer.pid)
        bounds = segment_bounds(value.numel(), n)
        segments = [value[bounds[k]:bounds[k + 1]].contiguous() for k in range(n)]
        others = [m for m in group if m != peer.pid]
        parts = {m: segments[k].view(torch.uint8) for k, m in enumerate(group) if m != peer.pid}
        got = yield from peer.run_call(AllToAll(f"{key}/scatter", peer.pid, group, parts,
                                                {m: 4 * segments[me].numel() for m in others}, peer.node.chunk_elems,
                                                peer.now, deadline))
        total = segments[me].clone()
        for m in others:
            total += got[m].view(torch.float32)
        mean = total / n
        got = yield from peer.run_call(AllToAll(f"{key}/gather", peer.pid, group, {m: mean.view(torch.uint8) for m in others},
                                                {m: 4 * segments[k].numel() for k, m in enumerate(group) if m != peer.pid},
                                                peer.node.chunk_elems, peer.now, deadline))
        return torch.cat([mean if m == peer.pid else got[m].view(torch.float32) for m in group])

    # -- joining and catching up: the runtime's own programs (``protocol.lifecycle``) ---------------

    def life(self, peer: SimPeer) -> lifecycle.Settings:
        """The lifecycle's settings for ``peer``; the boundary wait stands in for the runtime's ``startup_s``."""
        s = self.settings
        return lifecycle.Settings(
            rounds=s.rounds, hello_s=s.hello_s, connect_s=s.hello_s, boundary_s=s.exchange_s + 2 * s.inner_s,
            state_s=s.exchange_s, state_size=s.values,
            boundary_poll_s=lifecycle.BOUNDARY_POLL_S * s.grace_s / TimeoutConfig().grace_s,  # a real run's ratios
            probe_repeat_s=lifecycle.PROBE_REPEAT_S * s.hello_s / TimeoutConfig().hello_s,
            late_join_s=s.grace_s * lifecycle.LATE_JOIN_GRACE,
            nonce=lambda: f"{peer.pid}-{peer.incarnation}-{self.rng.getrandbits(32):08x}")

    def position(self, peer: SimPeer, position: lifecycle.Position, z: torch.Tensor,
                 clock: RoundClock | None = None) -> tuple[int, torch.Tensor]:
        """Install what a lifecycle program decided; a downloaded state must be the donor's of that round."""
        if clock is not None and position.clocks:
            refused = clock.adopt(position.clocks, peer.now)
            # The peers still in the run (a peer that finished tells no clock, so nobody can take its clock up) and in
            # step with the round this one takes up: a peer rounds behind is on a clock of its own until it catches up
            # too (restarted while cut off from everyone, it started alone)
            others = [c.anchor for p, c in self.round_clocks.items()
                      if p != peer.pid and c.anchor is not None and self.peers[p].running
                      and position.round - 1 <= self.finished.get(p, 0) < self.settings.rounds]
            self.checker.round_clock_adopted(peer.pid, peer.now, refused, clock.anchor, others)
        if position.state is None:
            return position.round, z
        k, donor = position.round, position.donor
        reference = self.snapshots.get((donor, k))
        if reference is None or not torch.equal(reference, position.state):
            self.checker.flag("recovery.state", peer.now, peer.pid, f"state of round {k} from {donor} differs from the donor's")
        self.note(f"{peer.pid} caught up from {donor} at round {k}")
        return k, position.state.clone()

    # -- the run ----------------------------------------------------------------------------------

    def run(self, faults: list[Fault]) -> SimResult:
        s = self.settings
        for pid in self.ids:
            self.start_peer(pid, 0, 0)
        self.faults = faults
        for fault in faults:
            apply_fault(self, fault)
        worst_round = max(self.inner_s.values()) + 2 * (2 * s.grace_s + 1.0 + s.exchange_s) + s.exchange_s + s.hello_s
        last_fault = max((f.end for f in faults), default=0.0)
        horizon = last_fault + (s.rounds + 2) * worst_round
        self.net.at(last_fault, self.changed)  # the end condition asks whether faults are over
        self.net.run_until(horizon, stop=self._all_done)
        self.net.run_until(self.net.now + 2 * s.exchange_s)  # let stragglers' last calls end
        self._final_checks(faults)
        stats = {"messages": self.net.messages, "completed_calls": self.checker.completed,
                 "failed_calls": self.checker.failed, "virtual_s": round(self.net.now, 3),
                 "paths": {path: self.net.paths[path] for path in PATHS},
                 "relay_resets": self.net.relay_resets, "relay_drops": self.net.relay_drops,
                 "per_peer": per_peer_stats(self)}
        return SimResult(self.seed, s, self.checker.violations, faults, dict(self.finished), stats, self.log)

    def changed(self) -> None:
        """The run's end condition may have changed (a peer stopped, finished, came or went; a fault ended)."""
        self._done_dirty = True

    def _all_done(self) -> bool:
        """Every peer finished or crashed and no fault is pending; evaluated only when one of those changed (the
        whole-swarm scan once per event made a 1,000-peer run quadratic)."""
        if not self._done_dirty:
            return False
        self._done_dirty = False
        s = self.settings
        return (all(self.finished.get(p, 0) >= s.rounds or p in self.crashed for p in self.ids)
                and not any(f.end > self.net.now for f in self.faults))

    def _final_checks(self, faults: list[Fault]) -> None:
        s, now = self.settings, self.net.now
        for pid in self.ids:
            if pid in self.crashed or pid in self.gave_up:
                continue
            if self.finished.get(pid, 0) < s.rounds:
                self.checker.flag("liveness.unfinished", now, pid, f"finished {self.finished.get(pid, 0)} of {s.rounds} rounds")
        alive = [p for p in self.ids if p not in self.crashed]
        self.recovery.check(lambda pid, detail: self.checker.flag("recovery.not_mixing", now, pid, detail), faults,
                            self.crashed, len(alive), s.rounds,
                            window_s=3 * (s.inner_s + 2 * s.grace_s + 1.0),  # about 2 rounds after, and its own
                            aftermath_s=s.exchange_s + 2 * s.grace_s + 1.0)  # until the exchanges it hit time out
