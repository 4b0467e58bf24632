"""``Exchange`` over ZeroMQ: the collectives, membership and path control of one peer, on ``ZmqDriver``.

The protocol itself (membership, group agreement, ring all-reduce, swaps, state transfer, aborts)
lives in ``gossiploco.protocol`` as sans-I/O state machines; ``ZmqDriver`` (``zmq_driver``) runs one
``PeerNode`` over sockets and threads. This class is what the runtime calls: each collective becomes
a ``Call`` run on the caller's thread, each request (``announce``, ``add_peer``...) a node method under
the lock. It implements ``mixing.exchange.Exchange`` and ``reach.paths.PathControl``.

Deadlines: a swap or all-reduce gets ``deadlines.deadline_s(key, path class)`` (``AdaptiveDeadlines``:
a multiple of recent durations of that kind, at most ``timeout_s``; the path class is
``reach.paths.path_class``); group agreement waits at most ``grace_s`` (leader) or ``grace_s``
plus one control send (follower; ``2 * grace_s`` plus one once the leader said it leads); control sends ``CONTROL_SEND_S``; state transfers ``timeout_s``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
import zmq

from gossiploco.errors import ExchangeError, PeerFailed
from gossiploco.mixing.exchange import Exchange
from gossiploco.protocol import lifecycle
from gossiploco.protocol.agreement import CONTROL_SEND_S
from gossiploco.protocol.call import Call
from gossiploco.protocol.collectives import AllToAll, FetchState, PairMean, RingAllReduce, Swap
from gossiploco.protocol.messages import MAX_PEER_ID, Data
from gossiploco.reach.paths import PathControl, path_class
from gossiploco.security.identity import peer_id_of
from gossiploco.security.trust import Trust
from gossiploco.transport.deadlines import AdaptiveDeadlines
from gossiploco.transport.fault_injection import SendHook
from gossiploco.transport.zmq_driver import ZmqDriver
from gossiploco.transport.zmq_service import StateProvider

log = logging.getLogger(__name__)

__all__ = ["ZmqExchange", "MAX_PEER_ID", "StateProvider", "random_nonce"]


def random_nonce() -> str:
    """A new state-request nonce (``lifecycle.Settings.nonce``: a module-level function, so that settings holding
    it travel to a companion process)."""
    return uuid.uuid4().hex[:16]



class ZmqExchange(ZmqDriver, Exchange, PathControl):
    """One peer's ``Exchange`` over ZeroMQ; see the module docstring.

    ``endpoints[i]`` is peer i's address (``"tcp://127.0.0.1:5555"``); this peer binds ``bind``
    (default ``endpoints[rank]``) and connects to all others at construction. ``timeout_s`` is the
    longest deadline of one call. ``join_round=None``: this peer decides later (``announce``) from
    which round it takes part. ``trust``: CurveZMQ on every socket, members' keys only. ``fault``: a
    hook run before each send (``fault_injection``; None in normal use). ``io_threads``: libzmq I/O threads, where
    CURVE's crypto runs (None: ``process_limits.default_io_threads``); ``stripes``: data connections to each directly
    dialed peer (None: as many as I/O threads; ``zmq_sockets``). ``sealed_port`` (with ``trust``): the TCP port of
    this peer's sealed port, where peers that dial it directly send their data chunks sealed with AES-256-GCM instead
    of CurveZMQ (``zmq_sealed``; 0: any free port; None: none, so data to this peer stays on CurveZMQ).
    ``links_idle_s`` > 0: links on demand (``zmq_links``), at most ``links_cap`` of them kept (None: no cap but the
    idle time). Construction raises
    ``ExchangeError`` if the bind fails and ``ValueError`` for bad arguments. Every public method is
    thread-safe.
    """

    def __init__(self, rank: int, endpoints: Sequence[str] | Mapping[int, str], run_id: str, timeout_s: float,
                 max_message_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20, mailbox_bytes: int = 1 << 30,
                 grace_s: float = 10.0, deadlines: AdaptiveDeadlines | None = None, bind: str | None = None,
                 join_round: int | None = 0, heartbeat_s: float | None = None, trust: Trust | None = None,
                 sender_mailbox_bytes: int | None = None, fault: SendHook | None = None, io_threads: int | None = None,
                 stripes: int | None = None, sealed_port: int | None = 0, links_idle_s: float = 0.0,
                 links_cap: int | None = None):
        self.deadlines = deadlines or AdaptiveDeadlines(timeout_s)
        self._scatter_began: dict[str, float] = {}
        """Start of each compressed mean's first phase, by key (``all_to_all``)."""
        self._dialed: dict[int, tuple[str, ...]] = {}  # peer -> the reverse endpoints dialed for it
        super().__init__(rank, endpoints, run_id, timeout_s, max_message_bytes, chunk_bytes, mailbox_bytes, grace_s,
                         bind=bind, join_round=join_round, heartbeat_s=heartbeat_s, trust=trust,
                         sender_mailbox_bytes=sender_mailbox_bytes, fault=fault, io_threads=io_threads,
                         stripes=stripes, sealed_port=sealed_port, links_idle_s=links_idle_s, links_cap=links_cap)

    # -- the Exchange interface ------------------------------------------------------------------

    def link_ahead(self, key: str, round_index: int) -> None:
        if self._sockets.links is None:
            return
        with self._cond:
            peers = self._node.links_ahead(key, round_index)
        for peer in peers:
            self._sockets.open_link(peer)

    def completed(self, key: str) -> None:
        with self._cond:
            self._node.completed(key)

    def _knows(self, peer: int) -> bool:
        """Whether ``peer`` has sockets, or is a member parked until something is sent to it (links on demand)."""
        return peer in self._dealers or (self._sockets.links is not None and self._sockets.links.tracks(peer))

    @property
    def isolated_mixes(self) -> int:
        """Exchanges this peer ran alone while it knew peers it could not reach (``PeerNode.isolated``)."""
        with self._cond:
            return self._node.isolated_mixes

    @property
    def joined_round(self) -> int:
        """The first round this peer takes part in, as its latest news said; -1 when it has not decided or steps out
        while it catches up (what its directory record says: ``PeerRecord.joined``)."""
        with self._cond:
            return self._node.record_join_round()

    def members(self, round_index: int | None = None) -> list[int]:
        with self._cond:
            return self._node.members(round_index)

    def group(self, key: str, round_index: int) -> list[int]:
        """Agree with the others on who takes part in exchange ``key`` of round ``round_index``
        (``protocol.agreement``). Raises ``ExchangeError`` when this peer takes no part (identity)."""
        with self._cond:
            call = self._node.group_call(key, round_index, time.monotonic())
        if call is None:
            return [self.rank]  # not taking part in this round yet
        group = self._run(call)
        with self._cond:
            why = self._node.isolated(group, key, round_index)
        if why is not None:
            raise ExchangeError(why)
        return group

    def swap(self, key: str, partner: int, flat: torch.Tensor) -> torch.Tensor:
        mine = flat.detach().reshape(-1)
        mine = mine if mine.dtype == torch.uint8 else mine.to(torch.float32)  # a compressed payload, or values
        result = self._run_pair(key, partner, lambda began, deadline: Swap(key, self.rank, partner, mine,
                                                                        self._node.chunk_elems, began, deadline))
        return result.reshape(flat.shape)

    def swap_mean(self, key: str, partner: int, flat: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """The pair's mean of ``flat`` with ``partner``'s (see ``Exchange``), computed as the partner's chunks
        arrive (``collectives.PairMean``): no receive buffer and no second pass. ``inplace=True`` (a contiguous
        fp32 CPU ``flat`` the caller no longer needs) leaves the mean in ``flat``'s memory and returns a view."""
        if inplace and flat.dtype == torch.float32 and flat.device.type == "cpu" and flat.is_contiguous():
            acc = flat.detach().view(-1)
        else:
            acc = torch.empty(flat.numel(), dtype=torch.float32)
            acc.copy_(flat.detach().reshape(-1))
        # zmq copies each chunk as it is queued, so ``feed`` may average into it at once. With zero-copy sends (as
        # the ring's) an interrupted peer twice did not exit within its grace, in 19 runs of
        # test_ctrl_c_stops_the_whole_swarm_cleanly (0 in 16 with copies); frames in flight are the suspect.
        result = self._run_pair(key, partner, lambda began, deadline: PairMean(key, self.rank, partner, acc,
                                                                            self._node.chunk_elems, began, deadline))
        return result.view(flat.shape)

    def _run_pair(self, key: str, partner: int, make: Callable[[float, float], Call]) -> torch.Tensor:
        """Run the pairwise call ``make(began, deadline)`` with ``partner`` under ``key``'s adaptive deadline."""
        if partner == self.rank:
            raise ValueError("cannot swap with oneself")
        if not self._knows(partner):
            raise ValueError(f"partner {partner} is not a known peer")
        began = time.monotonic()
        path = self.path_class([self.rank, partner])
        result = self._run(make(began, began + self.deadlines.deadline_s(key, path)))
        self.deadlines.observe(key, time.monotonic() - began, path)
        return result

    def all_reduce_mean(self, key: str, flat: torch.Tensor, members: Sequence[int], *,
                        inplace: bool = False) -> torch.Tensor:
        """Mean of ``flat`` over ``members`` (see ``Exchange``). ``inplace=True`` (for a caller that
        hands over a contiguous fp32 CPU ``flat`` it no longer needs, such as Mix1's packed vector)
        reduces in ``flat``'s own memory and returns a view of it: no copy and no new buffer."""
        members = list(dict.fromkeys(members))  # the agreed order is the ring's (``agreement.ring_order``)
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not among members {members}")
        if any(m != self.rank and not self._knows(m) for m in members):
            # a group it cannot run is a failed exchange, never a crash
            raise PeerFailed(f"{key!r}: members {members} include peers this peer does not know (known: {self.known()})")
        if inplace and flat.dtype == torch.float32 and flat.device.type == "cpu" and flat.is_contiguous():
            acc = flat.detach().view(-1)
        else:
            acc = torch.empty(flat.numel(), dtype=torch.float32)
            acc.copy_(flat.detach().reshape(-1))
        if len(members) == 1:
            return acc.view(flat.shape)
        began = time.monotonic()
        path = self.path_class(members)
        call = RingAllReduce(key, self.rank, members, acc, self._node.chunk_elems, began,
                             began + self.deadlines.deadline_s(key, path))
        result = self._run_in_place(call)
        self.deadlines.observe(key, time.monotonic() - began, path)
        return result.view(flat.shape)

    def _run_in_place(self, call: RingAllReduce) -> torch.Tensor:
        """Run a call that sends views of its caller's vector and writes into them (``overwrites``): chunks go
        out zero-copy (zmq reads them from the vector), and a segment is overwritten only after zmq released the
        sends that read it."""
        in_flight: dict[int, list[zmq.MessageTracker]] = {}

        def before_feed(_call: Call, _message: Data) -> None:
            segment = call.overwrites()
            if segment is not None:
                self._sockets.wait_sent(in_flight.pop(segment, []), call.deadline, call.what)

        def release_all() -> None:
            for trackers in in_flight.values():
                self._sockets.wait_sent(trackers, call.deadline, call.what)

        return self._run(call, in_flight=in_flight, before_feed=before_feed, before_outcome=release_all)

    def all_to_all(self, key: str, parts: Mapping[int, torch.Tensor], members: Sequence[int],
                   sizes: Mapping[int, int], tag: int = 0) -> dict[int, torch.Tensor]:
        members = list(dict.fromkeys(members))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not among members {members}")
        others = [m for m in members if m != self.rank]
        if any(not self._knows(m) for m in others):
            # a group it cannot run is a failed exchange, never a crash
            raise PeerFailed(f"{key!r}: members {members} include peers this peer does not know (known: {self.known()})")
        if not others:
            return {}
        # The two phases of a compressed mean (``KEY/scatter``, then ``KEY/gather``) share one deadline from
        # the first's start, as a ring's steps do: a fault costs at most one deadline, and the deadline learns
        # whole exchanges.
        phase, now = key.rpartition("/"), time.monotonic()
        with self._cond:
            if phase[2] == "scatter":
                self._scatter_began[phase[0]] = now
                while len(self._scatter_began) > 64:
                    self._scatter_began.pop(next(iter(self._scatter_began)))
            began = self._scatter_began.pop(phase[0], now) if phase[2] == "gather" else now
        path = self.path_class(members)
        call = AllToAll(key, self.rank, members, {m: parts[m].detach().reshape(-1) for m in others},
                        {m: int(sizes[m]) for m in others}, self._node.chunk_elems, began,
                        began + self.deadlines.deadline_s(key, path), tag)
        result = self._run(call)
        if phase[2] != "scatter":
            self.deadlines.observe(key, time.monotonic() - began, path)
        return result

    def fetch_state(self, peer: int) -> tuple[int, torch.Tensor]:
        """Download ``(round, flat state)`` from ``peer``'s provider within ``timeout_s``. Raises ``ExchangeError``."""
        began = time.monotonic()
        call = FetchState(peer, random_nonce(), self._node.chunk_elems, began, began + self.timeout_s)
        return self._run(call)

    def serve_state(self, provider: StateProvider) -> None:
        """Answer other peers' ``fetch_state`` with ``provider()`` (called on the service thread)."""
        self._service_work.provider = provider


    # -- discovery and paths (``PathControl``) ------------------------------------------------------

    def add_peer(self, peer: int, endpoint: str, key: bytes | None = None, *, listen: bool = False,
                 relayed: bool = False, joined: int | None = None) -> bool:
        """Connect to ``peer`` at ``endpoint`` (a peer found by discovery; ``PathControl.add_peer``); it
        stays pending until its hello (a probe goes out once its connection is up). ``key``: the peer's
        Curve25519 public key, from its signed record (required with ``trust``; it must be the key of id
        ``peer``). ``listen``: its DEALERs listen on this peer's bind host, any port (``reverse_offers``).
        ``relayed``: a longer heartbeat timeout (``ZmqSockets.connect``). ``joined``: its record's join round
        (``PeerRecord.joined``), which with links on demand admits a peer found pending (``PeerTable.add``) at
        every read, and spares asking it: only a peer found without a record is asked where it stands."""
        if peer == self.rank or not 0 <= peer < MAX_PEER_ID:
            return False
        if self.trust is not None:
            key = key if key is not None else self.trust.key_of(peer)
            if key is None or (self.trust.static_keys is None and peer_id_of(key) != peer):
                log.warning("rank %d: not connecting to %d: no key, or not the key of that peer id", self.rank, peer)
                return False
        with self._cond:
            if self._closed:
                return False
            old = self.endpoints.get(peer)
            was_listening = peer in self._sockets.listening
            if old == endpoint and was_listening == listen:
                self._node.add_peer(peer, joined)  # its record's join round may admit it now
                return False
            self.endpoints[peer] = endpoint
            new = self._node.add_peer(peer, joined)
            where = self._sockets.bound.rsplit(":", 1)[0] + ":0" if listen else None
            if old is None:
                self._sockets.connect(peer, endpoint, key, listen=where, relayed=relayed)
            if new and joined is None and self._sockets.links is not None:  # no handshake asks it: ask now
                self._dispatch(self._node.ask_again([peer]))
        if old is not None:
            self._sockets.reattach(peer, old, endpoint, where, relayed=relayed)
            log.info("rank %d: peer %d moved from %s to %s%s", self.rank, peer, old, endpoint,
                     " (listening for it)" if listen else "")
        return True

    def forget_peer(self, peer: int) -> bool:
        """``peer`` is gone for good (discovery no longer finds its record): unless it is connected, close its
        sockets and drop what is kept of it (``PathControl.forget_peer``). True if it was forgotten."""
        with self._cond:
            if self._closed or peer == self.rank or peer not in self.endpoints or not self._node.forget_peer(peer):
                return False
            del self.endpoints[peer]
            self.admission.forget(peer)
            reverse = self._dialed.pop(peer, ())
        self._sockets.forget(peer)
        if reverse:
            self._receiver_work.dial(reverse, ())  # the receiver thread owns the ROUTER
        log.info("rank %d: forgot peer %d (its record is gone and it is not connected)", self.rank, peer)
        return True

    @property
    def bound(self) -> str:
        """The address this peer's ROUTER listens on (``tcp://HOST:PORT``, the port the OS picked)."""
        return self._sockets.bound

    def reverse_offers(self) -> tuple[tuple[int, int, int], ...]:
        with self._cond:
            return tuple(sorted((peer, *(int(endpoint.rsplit(":", 1)[1]) for endpoint in endpoints))
                                for peer, endpoints in self._sockets.listening.items()))

    def set_grouping(self, seed: int, size: int, paired: Collection[str] = (), run_again: Collection[str] = ()) -> None:
        """Key every exchange's buckets and leaders by the run's ``seed`` and split views larger than ``size``
        (``protocol.groups``); the exchanges labelled in ``paired`` pair their members as they become ready
        (``protocol.pairing``), and those labelled in ``run_again`` may run again after a failure
        (``protocol.declines``). Every peer of the run must set the same."""
        with self._cond:
            self._node.group_seed, self._node.group_size = seed, size
            self._node.paired = frozenset(paired)
            self._node.declines.labels = frozenset(run_again)

    def set_behind_nat(self, peers: set[int], order_rings: bool = True) -> None:
        with self._cond:
            self._node.behind_nat = set(peers)
            self._node.order_rings = order_rings

    def path_class(self, ring: Sequence[int]) -> str:
        """The path class of an exchange over ``ring`` for its deadline (``reach.paths.path_class``)."""
        with self._cond:
            behind_nat = set(self._node.behind_nat)
        return path_class(ring, behind_nat)

    def dial_reverse(self, peer: int, endpoints: Sequence[str]) -> bool:
        """Its ROUTER dials ``endpoints`` (``peer``'s listening DEALERs; ``PathControl.dial_reverse``)."""
        new = tuple(endpoints)
        with self._cond:
            old = self._dialed.get(peer, ())
            if old == new:
                return False
            self._dialed[peer] = new
        self._receiver_work.dial(old, new)  # the receiver thread owns the ROUTER
        return True

    def announce(self, join_round: int, ask_reply: bool = True, caught_up: bool = False) -> None:
        """Take part in exchanges from round ``join_round`` on, and tell every other peer so
        (best effort). ``join_round = -1`` is a probe: it changes no membership and only asks for
        replies. ``caught_up``: this peer just downloaded that round's state (``PeerNode.announce``)."""
        with self._cond:
            self._dispatch(self._node.announce(join_round, ask_reply, caught_up))

    def leave(self, linger_s: float = 0.5) -> None:
        """Leave gracefully: tell every connected peer (they drop this one at once), and with links on demand every
        peer heard from or sent to lately (its link here may be up), then ``close``. Best effort, bounded by
        ``CONTROL_SEND_S`` per peer, and with links on demand by the handshake deadline of the links opened to say it
        (a peer not told is logged: it will take this one for lost)."""
        lately = [] if self._sockets.links is None else self._sockets.links.lately()
        with self._cond:
            sends = [] if self._closed else self._node.leave(also=lately)
        for send in sends:
            try:
                self._send(send, time.monotonic() + CONTROL_SEND_S, "leave")
            except ExchangeError:
                pass
        if lately:  # a goodbye on a link opened just now goes once its handshake is done: closing first would drop the
            told = {send.peer for send in sends}  # others' links here before it reached them (a lost link, to them)
            # Until each link is up or reported (a link on demand is, within its handshake deadline): on a loaded
            # machine with many peers leaving at once, 1 s left up to 30 of 30 untold, each then taking it for lost.
            wait_s = self._sockets.links.handshake_s + CONTROL_SEND_S
            reached: set[int] = set()  # links seen up (one may close as idle again while others are waited for)

            def all_told() -> bool:  # under the exchange's lock
                reached.update(told & self._node.peers.connected)
                return told <= reached | self._node.peers.failed.keys()

            if not self._wait_for(all_told, wait_s):
                with self._cond:
                    untold = sorted(told - reached - self._node.peers.failed.keys())
                log.warning("rank %d: leaving without telling %d of %d peer(s) (%s): their links did not come up "
                            "within %.1f s; they will take this peer for lost", self.rank, len(untold), len(told),
                            ", ".join(map(str, untold[:8])) + (" ..." if len(untold) > 8 else ""), wait_s)
        self.close(linger_s=linger_s)

    def known(self) -> list[int]:
        """Every peer this exchange has an endpoint for (including itself)."""
        with self._cond:
            return sorted(self.endpoints)

    def connected(self) -> list[int]:
        """Other peers with a live connection right now."""
        with self._cond:
            return sorted(self._node.peers.connected)

    def pending(self) -> list[int]:
        """Connected peers outside the group: they came back and have not said hello yet."""
        with self._cond:
            return self._node.peers.pending()

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a connection to every other peer is up (or ``timeout_s``); True if all are."""
        return self._wait_for(lambda: len(self._node.peers.connected) >= len(self._dealers), timeout_s)

    def join_swarm(self, life: lifecycle.Settings, start_round: int, quorum: int,
                   quorum_until: float | None) -> lifecycle.Position:
        """``lifecycle.join`` driven on this exchange: where this peer starts (``runtime.peer_join``)."""
        return self.drive(lambda node: lifecycle.join(node, life, start_round, quorum, quorum_until))

    def catch_up_if_behind(self, life: lifecycle.Settings, r: int) -> lifecycle.Position:
        """``lifecycle.maybe_catch_up`` driven on this exchange, at the start of round ``r``."""
        return self.drive(lambda node: lifecycle.maybe_catch_up(node, life, r))

    def is_closed(self) -> bool:
        with self._cond:
            return self._node.closed

    def deadlines_state(self) -> dict:
        """The adaptive deadlines' state (what a checkpoint keeps)."""
        return self.deadlines.state()

    def load_deadlines(self, state: dict) -> None:
        self.deadlines.load_state(state)

    def ask_rounds(self, wait_s: float) -> dict[int, int]:
        """Ask the peers their rounds (``protocol.lifecycle.ask_rounds``: every connected peer, or a sample of
        ``ROUND_SAMPLE`` in a larger swarm; their answers within ``wait_s``, asking again whoever has not answered,
        less uncorroborated claims)."""
        settings = lifecycle.Settings(rounds=0, hello_s=wait_s, connect_s=wait_s, boundary_s=wait_s,
                                      state_s=self.timeout_s, nonce=random_nonce)
        return self.drive(lambda node: lifecycle.ask_rounds(node, settings))
