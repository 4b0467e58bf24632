"""The ZeroMQ driver of the peer protocol: ``Exchange`` over real sockets (with ``zmq_sockets``, the only zmq importers).

The protocol itself (membership, group agreement, ring all-reduce, swaps, state transfer, aborts)
lives in ``gossiploco.protocol`` as sans-I/O state machines; this module turns sockets and
``time.monotonic()`` into its events and carries out its actions.

Sockets (``zmq_sockets``): a ROUTER per peer, and per other peer a data DEALER with a monitor
and a control DEALER (``Ready``, ``Decision``, ``Abort``: never behind megabytes of data). For a
peer behind NAT the DEALERs listen instead of dialing and that peer's ROUTER dials them
(``add_peer(listen=True)``, ``dial_reverse``: reverse connections, ``gossiploco.reach.paths``). With
``trust`` every socket is CurveZMQ and only members' keys get in (``zmq_auth``); a message's
claimed sender must match the routing id of the connection it came on and the peer its key
authenticated, and each peer is pinned to one process at a time (``_check_incarnation``).
Rejections are counted by reason (``security_counts``). Peer ids are
ints below ``MAX_PEER_ID``, known from a static list or added by discovery (``add_peer``).

Threads (zmq sockets are not thread-safe; one lock and condition guard the ``PeerNode``):

* the receiver thread owns the ROUTER and the DEALERs' monitor sockets: it validates each
  message (``codec.decode``, ``messages.from_wire``), feeds it to the node, and hands the node's
  actions to the service thread; malformed messages are dropped, logged and counted. Monitor
  events (ZMTP handshake, disconnect: a dead process at once, a frozen one after the heartbeat
  timeout) become ``connected``/``disconnected`` events;
* the service thread sends what the receiver decided (hello replies, decisions, aborts) and
  serves state uploads, so the receiver never waits on a socket;
* callers (the training thread, the Mix1 thread) run their calls with ``protocol.call.run_call``:
  they send their own data chunks (``NOBLOCK`` with a poll/retry loop bounded by the call's
  deadline; the ring sends views of its buffer without copying and waits for zmq to release a
  segment before overwriting it) and wait on the condition with the call's deadline.

If the receiver or service thread dies, the exchange is *broken*: the cause is logged, and every
call in progress or later raises ``ExchangeBroken`` (never a silent identity), which stops the peer.

Deadlines: a swap or all-reduce gets ``deadlines.deadline_s(key)`` (``AdaptiveDeadlines``: a
multiple of recent durations of that kind, at most ``timeout_s``); group agreement waits at most
``grace_s`` (leader) or ``2 * grace_s`` plus one control send (follower); control sends
``CONTROL_SEND_S``; state transfers ``timeout_s``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from gossiploco.errors import ExchangeClosed, ExchangeError, MalformedMessage
from gossiploco.mixing.exchange import Exchange
from gossiploco.protocol.agreement import CONTROL_SEND_S
from gossiploco.protocol.call import Call, run_call
from gossiploco.protocol.collectives import AllToAll, FetchState, RingAllReduce, Swap, state_chunks
from gossiploco.protocol.messages import (CONTROL, MAX_PEER_ID, PROBE, Data, Hello, Ready, Send, ServeState, StateRequest,
                                          from_wire, to_wire)
from gossiploco.protocol.node import PeerNode
from gossiploco.protocol import codec
from gossiploco.transport.deadlines import AdaptiveDeadlines
from gossiploco.transport.fault_injection import FAULT_ENV, Fault
from gossiploco.security.identity import peer_id_of
from gossiploco.security.trust import Trust, parse_routing_id
from gossiploco.transport.zmq_sockets import ZmqSockets

log = logging.getLogger(__name__)

__all__ = ["ZmqExchange", "MAX_PEER_ID", "FAULT_ENV", "StateProvider"]

POLL_MS = 100
"""How often the receiver thread wakes to notice ``close()``."""
PROBE_REPEAT_S = 1.0
"""``peer_rounds`` asks a peer that has not answered again after this long."""
_FLOAT_BYTES = 4

StateProvider = Callable[[], "tuple[int, torch.Tensor] | None"]
"""Returns (round, flat fp32 state) to hand a catching-up peer, or None when there is none yet."""


class ZmqExchange(Exchange):
    """One peer's ``Exchange`` over ZeroMQ; the module docstring describes the threads.

    ``endpoints[i]`` is peer i's address (``"tcp://127.0.0.1:5555"``); this peer binds ``bind``
    (default ``endpoints[rank]``) and connects to all others at construction. ``timeout_s`` is the
    longest deadline of one call. ``join_round=None``: this peer decides later (``announce``) from
    which round it takes part. Construction raises ``ExchangeError`` if the bind fails and
    ``ValueError`` for bad arguments. Every public method is thread-safe.
    """

    def __init__(self, rank: int, endpoints: Sequence[str] | Mapping[int, str], run_id: str, timeout_s: float,
                 max_message_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20, mailbox_bytes: int = 1 << 30,
                 grace_s: float = 10.0, deadlines: AdaptiveDeadlines | None = None, bind: str | None = None,
                 join_round: int | None = 0, heartbeat_s: float | None = None, trust: Trust | None = None,
                 sender_mailbox_bytes: int | None = None):
        endpoints = dict(enumerate(endpoints)) if not isinstance(endpoints, Mapping) else dict(endpoints)
        if rank not in endpoints:
            raise ValueError(f"rank {rank} has no endpoint among {sorted(endpoints)}")
        if any(not 0 <= p < MAX_PEER_ID for p in endpoints):
            raise ValueError(f"peer ids must be in 0..{MAX_PEER_ID - 1}, got {sorted(endpoints)}")
        if chunk_bytes < _FLOAT_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes} must hold at least one float32")
        if chunk_bytes + codec.MAX_HEADER_BYTES + 64 > max_message_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} plus a header does not fit max_message_bytes={max_message_bytes}")
        self.rank = rank
        self.endpoints = endpoints
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.deadlines = deadlines or AdaptiveDeadlines(timeout_s)
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = chunk_bytes
        self._scatter_began: dict[str, float] = {}
        """Start of each compressed mean's first phase, by key (``all_to_all``)."""
        self.bytes_sent = 0
        self.wire_bytes_sent = 0
        """Bytes of every message this peer sent: the codec's frames, headers and payloads, control messages and
        state uploads included (not the transport's own framing, encryption or TCP/IP headers)."""
        self.dropped_messages = 0
        self.rejections: Counter[str] = Counter()
        """Messages refused after decoding, by reason (numbers and quoted values masked)."""
        self._cond = threading.Condition()  # guards the node
        self._node = PeerNode(rank, endpoints, grace_s=grace_s, chunk_elems=max(1, chunk_bytes // _FLOAT_BYTES),
                              mailbox_bytes=mailbox_bytes, sender_mailbox_bytes=sender_mailbox_bytes,
                              join_round=join_round)
        self._closed = False
        self._close_lock = threading.Lock()
        self._state_provider: StateProvider | None = None
        self._tasks: queue.Queue = queue.Queue(maxsize=1024)  # Send / ServeState for the service thread
        self._fault = Fault.from_env()

        self.trust = trust
        if trust is not None and trust.peer_id != rank:
            raise ValueError(f"rank {rank} is not the peer id of this identity ({trust.peer_id})")
        if trust is not None and any(trust.key_of(p) is None for p in endpoints if p != rank):
            raise ValueError("a static peer list needs every rank's key (Trust.static)")
        self._router_dials: queue.SimpleQueue = queue.SimpleQueue()  # (old, new endpoints) for the receiver thread
        self._dialed: dict[int, tuple[str, ...]] = {}  # peer -> the reverse endpoints dialed for it
        self._sockets = ZmqSockets(rank, bind or self.endpoints[rank], self.endpoints[rank], heartbeat_s=heartbeat_s,
                                   max_message_bytes=max_message_bytes, chunk_bytes=chunk_bytes, trust=trust)
        self.endpoints[rank] = self._sockets.endpoint
        self._dealers = self._sockets.dealers
        self._incarnations: dict[int, tuple[bytes, float]] = {}  # peer -> (its process's incarnation, when pinned)
        for peer, endpoint in endpoints.items():
            if peer != rank:
                self._sockets.connect(peer, endpoint, trust.key_of(peer) if trust is not None else None)
        self._receiver = threading.Thread(target=self._guarded, args=(self._receive_loop, "receiver"),
                                          name=f"zmq-exchange-{rank}-recv", daemon=True)
        self._service = threading.Thread(target=self._guarded, args=(self._service_loop, "service"),
                                         name=f"zmq-exchange-{rank}-service", daemon=True)
        self._receiver.start()
        self._service.start()

    # -- the Exchange interface ------------------------------------------------------------------

    @property
    def current_round(self) -> int:
        """The round this peer is in (set by its runtime; -1 before the first); told to peers."""
        return self._node.current_round

    @current_round.setter
    def current_round(self, value: int) -> None:
        with self._cond:
            self._node.current_round = value

    @property
    def bytes_received(self) -> int:
        return self._node.bytes_received

    @property
    def malformed_messages(self) -> int:
        return self._node.malformed_messages

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
        return self._run(call)

    def swap(self, key: str, partner: int, flat: torch.Tensor) -> torch.Tensor:
        if partner == self.rank:
            raise ValueError("cannot swap with oneself")
        if partner not in self._dealers:
            raise ValueError(f"partner {partner} is not a known peer")
        began = time.monotonic()
        mine = flat.detach().reshape(-1)
        mine = mine if mine.dtype == torch.uint8 else mine.to(torch.float32)  # a compressed payload, or values
        path = self._path_class([self.rank, partner])
        call = Swap(key, self.rank, partner, mine, self._node.chunk_elems, began,
                    began + self.deadlines.deadline_s(key, path))
        result = self._run(call)
        self.deadlines.observe(key, time.monotonic() - began, path)
        return result.reshape(flat.shape)

    def all_reduce_mean(self, key: str, flat: torch.Tensor, members: Sequence[int], *,
                        inplace: bool = False) -> torch.Tensor:
        """Mean of ``flat`` over ``members`` (see ``Exchange``). ``inplace=True`` (for a caller that
        hands over a contiguous fp32 CPU ``flat`` it no longer needs, such as Mix1's packed vector)
        reduces in ``flat``'s own memory and returns a view of it: no copy and no new buffer."""
        members = list(dict.fromkeys(members))  # the agreed order is the ring's (``agreement.ring_order``)
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not among members {members}")
        if any(m != self.rank and m not in self._dealers for m in members):
            raise ValueError(f"members {members} include unknown peers (known: {self.known()})")
        if inplace and flat.dtype == torch.float32 and flat.device.type == "cpu" and flat.is_contiguous():
            acc = flat.detach().view(-1)
        else:
            acc = torch.empty(flat.numel(), dtype=torch.float32)
            acc.copy_(flat.detach().reshape(-1))
        if len(members) == 1:
            return acc.view(flat.shape)
        began = time.monotonic()
        path = self._path_class(members)
        call = RingAllReduce(key, self.rank, members, acc, self._node.chunk_elems, began,
                             began + self.deadlines.deadline_s(key, path))
        # Chunks go out zero-copy (zmq reads them from ``acc``): a segment is overwritten only
        # after zmq released the sends that read it, and ``acc`` is divided only at the end.
        in_flight: dict[int, list[zmq.MessageTracker]] = {}

        def before_feed(ring: Call, _message: Data) -> None:
            segment = call.overwrites()
            if segment is not None:
                self._sockets.wait_sent(in_flight.pop(segment, []), call.deadline, call.what)

        def release_all() -> None:
            for trackers in in_flight.values():
                self._sockets.wait_sent(trackers, call.deadline, call.what)

        result = self._run(call, in_flight=in_flight, before_feed=before_feed, before_outcome=release_all)
        self.deadlines.observe(key, time.monotonic() - began, path)
        return result.view(flat.shape)

    def all_to_all(self, key: str, parts: Mapping[int, torch.Tensor], members: Sequence[int],
                   sizes: Mapping[int, int], tag: int = 0) -> dict[int, torch.Tensor]:
        members = list(dict.fromkeys(members))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not among members {members}")
        others = [m for m in members if m != self.rank]
        if any(m not in self._dealers for m in others):
            raise ValueError(f"members {members} include unknown peers (known: {self.known()})")
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
        path = self._path_class(members)
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
        call = FetchState(peer, uuid.uuid4().hex[:16], self._node.chunk_elems, began, began + self.timeout_s)
        return self._run(call)

    def serve_state(self, provider: StateProvider) -> None:
        """Answer other peers' ``fetch_state`` with ``provider()`` (called on the service thread)."""
        self._state_provider = provider

    def close(self, linger_s: float = 0.0) -> None:
        """Stop: calls in progress and later raise ``ExchangeClosed``. ``linger_s > 0`` (a graceful
        leave) gives messages already sent that long to reach their peers. Idempotent."""
        with self._close_lock:
            with self._cond:
                if self._closed:
                    return
                self._closed = self._node.closed = True
                self._cond.notify_all()
            for thread in (self._receiver, self._service):
                if thread is not threading.current_thread():
                    thread.join(timeout=10)
            if self._receiver.is_alive() or self._service.is_alive():
                log.error("rank %d: exchange threads did not stop; leaking their sockets", self.rank)
                return
            self._sockets.close(linger_s)

    # -- membership --------------------------------------------------------------------------------

    def add_peer(self, peer: int, endpoint: str, key: bytes | None = None, *, listen: bool = False,
                 relayed: bool = False) -> bool:
        """Connect to ``peer`` at ``endpoint`` (a peer found by discovery); it stays pending until its
        hello (a probe goes out once its connection is up). A known peer at a new endpoint (it
        restarted elsewhere) or on a new path is reconnected. ``key``: the peer's Curve25519 public key, from its
        signed record (required with ``trust``; it must be the key of id ``peer``). ``listen``: a
        reverse connection (``peer`` is behind NAT): listen on ports of this peer's host for it to
        dial (``reverse_offers``) instead of dialing ``endpoint``. ``relayed``: ``endpoint`` is a
        tunnel through a relay (a longer heartbeat timeout, ``ZmqSockets.connect``). Returns True if anything changed."""
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
                return False
            self.endpoints[peer] = endpoint
            self._node.add_peer(peer)
            where = self._listen_address() if listen else None
            if old is None:
                self._sockets.connect(peer, endpoint, key, listen=where, relayed=relayed)
        if old is not None:
            self._sockets.reattach(peer, old, endpoint, where)
            log.info("rank %d: peer %d moved from %s to %s%s", self.rank, peer, old, endpoint,
                     " (listening for it)" if listen else "")
        return True

    @property
    def bound(self) -> str:
        """The address this peer's ROUTER listens on (``tcp://HOST:PORT``, the port the OS picked)."""
        return self._sockets.bound

    def _listen_address(self) -> str:
        """Where reverse connections listen: this peer's bind host, any port."""
        return self._sockets.bound.rsplit(":", 1)[0] + ":0"

    def reverse_offers(self) -> tuple[tuple[int, int, int], ...]:
        """``(peer, data port, control port)`` of every reverse connection this peer listens for."""
        with self._cond:
            return tuple(sorted((peer, *(int(endpoint.rsplit(":", 1)[1]) for endpoint in endpoints))
                                for peer, endpoints in self._sockets.listening.items()))

    def set_behind_nat(self, peers: set[int], order_rings: bool = True) -> None:
        """The peers behind NAT: for the ring order of groups this peer leads (``agreement.ring_order``;
        ``order_rings=False``: by id), and for the deadlines of exchanges over a relay (``_path_class``)."""
        with self._cond:
            self._node.behind_nat = set(peers)
            self._node.order_rings = order_rings

    def _path_class(self, ring: Sequence[int]) -> str:
        """"relayed" when two neighbours of ``ring`` (a swap's pair, or a ring in its order) are both
        behind NAT, so their hop goes through a relay; else "" (direct and reverse are alike)."""
        nat = self._node.behind_nat
        n = len(ring)
        return "relayed" if any(ring[i] in nat and ring[(i + 1) % n] in nat for i in range(n) if n > 1) else ""

    def dial_reverse(self, peer: int, endpoints: Sequence[str]) -> bool:
        """This peer is behind NAT and ``peer`` offers it a reverse connection: its ROUTER dials
        ``endpoints`` (``peer``'s listening DEALERs; none: stop), replacing what it dialed for ``peer``
        before. Returns False when that is what it dials already."""
        new = tuple(endpoints)
        with self._cond:
            old = self._dialed.get(peer, ())
            if old == new:
                return False
            self._dialed[peer] = new
        self._router_dials.put((old, new))  # the receiver thread owns the ROUTER
        return True

    def announce(self, join_round: int, ask_reply: bool = True, caught_up: bool = False) -> None:
        """Take part in exchanges from round ``join_round`` on, and tell every other peer so
        (best effort). ``join_round = -1`` is a probe: it changes no membership and only asks for
        replies. ``caught_up``: this peer just downloaded that round's state (``PeerNode.announce``)."""
        with self._cond:
            self._dispatch(self._node.announce(join_round, ask_reply, caught_up))

    def leave(self, linger_s: float = 0.5) -> None:
        """Leave gracefully: tell every connected peer (they drop this one at once), then ``close``.
        Best effort, bounded by ``CONTROL_SEND_S`` per peer."""
        with self._cond:
            sends = [] if self._closed else self._node.leave()
        for send in sends:
            try:
                self._send(send, time.monotonic() + CONTROL_SEND_S, "leave")
            except ExchangeError:
                pass
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

    def drop_unconnected(self) -> list[int]:
        """Move peers that never connected to pending (they join with a hello when they come). Returns them."""
        with self._cond:
            return self._node.peers.drop_unconnected()

    def straggling(self, round_index: int) -> bool:
        """This peer was left out of two exchanges since round ``round_index - 1`` for being late (``PeerNode.straggling``)."""
        with self._cond:
            return self._node.straggling(round_index)

    def recently_lost(self, within_s: float) -> list[int]:
        """Peers whose connection dropped within the last ``within_s`` seconds."""
        with self._cond:
            return self._node.peers.recently_lost(within_s, time.monotonic())

    def leader_rounds(self) -> dict[int, int]:
        """The round each group leader was in when it last answered this peer's ``Ready`` (not waited for)."""
        with self._cond:
            return dict(self._node.peers.leader_rounds)

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a connection to every other peer is up (or ``timeout_s``); True if all are."""
        return self._wait_for(lambda: len(self._node.peers.connected) >= len(self._dealers), timeout_s)

    def wait_members(self, round_index: int, count: int, timeout_s: float) -> list[int]:
        """Block until ``members(round_index)`` has ``count`` peers (or ``timeout_s``); returns it."""
        self._wait_for(lambda: len(self._node.members(round_index)) >= count, timeout_s)
        return self.members(round_index)

    def peer_rounds(self, wait_s: float, peers: Sequence[int] | None = None) -> dict[int, int]:
        """Current rounds other peers reported in replies to this peer's last ``announce``; waits
        up to ``wait_s`` for a reply from each of ``peers`` (default: the connected ones)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            want = set(self._node.peers.connected if peers is None else peers)
        while not self._wait_for(lambda: want <= self._node.peers.reported.keys(),
                                 min(PROBE_REPEAT_S, deadline - time.monotonic())):
            if time.monotonic() >= deadline or self._closed:
                break
            # Ask again whoever has not answered: a question or its answer can be lost with a
            # connection that dropped and came back (a restart on either side) while it was on its way.
            with self._cond:
                missing = sorted(want - self._node.peers.reported.keys())
                hello = Hello(PROBE, self._node.current_round, ask=self._node.probe_id)
            self._dispatch([Send(p, hello) for p in missing])
        with self._cond:
            return dict(self._node.peers.reported)

    def check_reachable(self, timeout_s: float) -> bool:
        """True if a ZeroMQ handshake with this peer's own advertised endpoint succeeds within
        ``timeout_s`` (what another peer does first). A failure means the address or port is wrong
        or closed here; success does not prove that peers behind other networks can reach it."""
        return self._sockets.check_reachable(timeout_s)

    def protocol_state(self) -> dict[str, int]:
        """Sizes of the protocol's records and mailbox (bounded; for tests and diagnostics)."""
        with self._cond:
            return self._node.pending_state()

    def security_counts(self) -> dict[str, dict[str, int]]:
        """Connections the ZAP handler refused and messages the receiver rejected, by reason."""
        with self._cond:
            rejected = dict(self.rejections)
        return {"refused_connections": self._sockets.refused_connections(), "rejected_messages": rejected}

    def _wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate() and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return predicate()

    # -- running calls -----------------------------------------------------------------------------

    def _run(self, call: Call, in_flight: dict | None = None, before_feed=None, before_outcome=None):
        """Run ``call`` on this thread (``protocol.call.run_call``) and log what the node noted."""
        def send(sends: list[Send]) -> None:
            for s in sends:
                if isinstance(s.message, (Data, Ready, StateRequest)):  # the caller's own messages: sent here
                    deadline = call.deadline if isinstance(s.message, Data) else time.monotonic() + CONTROL_SEND_S
                    tracker = self._send(s, deadline, call.what, zero_copy=in_flight is not None)
                    if in_flight is not None and s.segment is not None and tracker is not None:
                        in_flight.setdefault(s.segment, []).append(tracker)
                else:  # aborts and decisions: the service thread, so a failing call does not block on them
                    self._submit(s)

        def wait(until: float | None) -> None:
            self._cond.wait(max(0.0, until - time.monotonic()) if until is not None else None)

        try:
            return run_call(call, self._node, locked=lambda: self._cond, wait=wait, clock=time.monotonic,
                            send=send, before_feed=before_feed, before_outcome=before_outcome)
        finally:
            self._flush_notes()

    # -- sending -----------------------------------------------------------------------------------

    def _send(self, send: Send, deadline: float, what: str, zero_copy: bool = False) -> zmq.MessageTracker | None:
        """Queue one message for its peer, retrying a full queue until ``deadline``. By default zmq
        copies the payload; with ``zero_copy`` it reads it in place until the returned tracker is done."""
        message, peer = send.message, send.peer
        if self._fault is not None:
            self._fault.before_send(self.rank, message)
        header, tensors = to_wire(message, self.rank, self.run_id)
        frames = codec.encode(header, tensors)
        tracker = self._sockets.send(peer, frames, control=isinstance(message, CONTROL),
                                     deadline=deadline, what=what, zero_copy=zero_copy, closed=lambda: self._closed)
        with self._cond:
            self.wire_bytes_sent += sum(memoryview(f).nbytes for f in frames)
            if isinstance(message, Data):
                self.bytes_sent += message.data.numel() * message.data.element_size()
        return tracker

    def _submit(self, action: Send | ServeState) -> None:
        try:
            self._tasks.put_nowait(action)
        except queue.Full:
            self.dropped_messages += 1
            log.warning("rank %d: service queue full; dropped a %s for %d", self.rank, type(action).__name__, action.peer)

    def _dispatch(self, actions: list) -> None:
        """Hand the node's actions to the service thread (never sends on the calling thread)."""
        for action in actions:
            self._submit(action)

    # -- the threads ---------------------------------------------------------------------------------

    def _guarded(self, loop: Callable[[], None], name: str) -> None:
        """Run a driver thread; if it dies, the exchange is broken: logged, and every call fails."""
        try:
            loop()
        except Exception as exc:  # noqa: BLE001 - reported below, then every call fails with it
            log.critical("rank %d: the exchange's %s thread died: %s: %s; mixing cannot go on",
                         self.rank, name, type(exc).__name__, exc, exc_info=True)
            with self._cond:
                self._node.broken = f"{name} thread died: {type(exc).__name__}: {exc}"
                self._cond.notify_all()
        finally:
            if name == "receiver":
                self._sockets.close_router()  # the DEALERs' monitors are closed by close(), after their dealers stop them

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        router = self._sockets.router
        poller.register(router, zmq.POLLIN)
        poller.register(self._sockets.router_monitor, zmq.POLLIN)
        while not self._closed:
            while not self._sockets.new_monitors.empty():  # peers added since the last poll
                poller.register(self._sockets.new_monitors.get(), zmq.POLLIN)
            auth = self._sockets.auth
            if auth is not None and not auth.is_alive():
                raise ExchangeError("the ZAP (authentication) thread died: no peer could connect any more")
            while not self._router_dials.empty():
                self._dial_with_router(*self._router_dials.get())
            if self._sockets.retry_at:
                with self._cond:
                    endpoints = dict(self.endpoints)
                self._sockets.retry_refused(time.monotonic(), endpoints)
            for sock, _ in poller.poll(POLL_MS):
                if sock is router:
                    self._drain_router()
                elif sock is self._sockets.router_monitor:
                    self._sockets.count_handshake_failures()
                else:
                    self._drain_monitor(sock)

    def _dial_with_router(self, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        """Receiver thread (it owns the ROUTER): stop dialing ``old``, dial a reverse connection's ``new`` ports."""
        router = self._sockets.router
        for endpoint in old:
            try:
                router.disconnect(endpoint)
            except zmq.ZMQError:
                pass
        for endpoint in new:
            try:
                router.connect(endpoint)
            except zmq.ZMQError as exc:  # an endpoint zmq refuses: that peer stays unreachable, the rest goes on
                log.warning("rank %d: cannot dial a reverse connection at %s: %s", self.rank, endpoint, exc)

    def _drain_router(self) -> None:
        for _ in range(1000):  # bounded, so close() and the monitors are not starved
            try:
                frames = self._sockets.router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._file(frames)
            except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError) as exc:
                # Validation itself failed on this input (a bug in it): the message is refused like
                # a malformed one, loudly, instead of the receiving thread dying for every message.
                reason = f"validation bug: {type(exc).__name__}"
                with self._cond:
                    self._node.malformed_messages += 1
                    self.rejections[reason] += 1
                    first = self.rejections[reason] == 1
                log.error("rank %d: validating a message raised %s: %s (a bug; the message is dropped)", self.rank,
                          type(exc).__name__, exc, exc_info=first)
            except MalformedMessage as exc:
                reason = exc.reason
                with self._cond:
                    self._node.malformed_messages += 1
                    self.rejections[reason] += 1
                    count = self.rejections[reason]
                if count <= 3 or count & (count - 1) == 0:  # the first few, then at powers of two
                    log.warning("rank %d: dropped a malformed message (%d so far for this reason): %s",
                                self.rank, count, exc)
        self._flush_notes()

    def _file(self, frames: list) -> None:
        """Validate one ROUTER message (routing id + codec frames) and feed it to the node."""
        if len(frames) < 2:
            raise MalformedMessage("no codec frames after the routing id")
        identity = frames[0].bytes
        # copy=False: the chunk is a view of the zmq frame (which it keeps alive), not a copy.
        header, tensors = codec.decode(frames[1:], expect_run=self.run_id, max_bytes=self.max_message_bytes, copy=False)
        message = from_wire(header, tensors)
        claimed = parse_routing_id(identity)
        if claimed is None or claimed[0] != header.sender or claimed[2] != isinstance(message, CONTROL):
            raise MalformedMessage(f"sender {header.sender} arrived on connection {identity[:32]!r}")
        if self.trust is not None and frames[1].get("User-Id") != str(header.sender):  # what ZAP authenticated
            raise MalformedMessage(f"sender {header.sender} arrived on a connection authenticated as "
                                   f"{frames[1].get('User-Id')!r}")
        with self._cond:
            self._check_incarnation(header.sender, claimed[1])
            actions = self._node.receive(header.sender, message, time.monotonic())
            self._cond.notify_all()
        self._dispatch(actions)

    def _check_incarnation(self, sender: int, incarnation: bytes) -> None:
        """Pin each peer to the process (incarnation) it speaks from: another process claiming the
        same peer is refused while the pinned one's connection has not dropped since it was pinned
        (a restarted peer's new process is accepted once its old connection is gone). Holds ``_cond``."""
        pinned = self._incarnations.get(sender)
        if pinned is not None and pinned[0] != incarnation:
            if self._node.peers.lost_at.get(sender, -1.0) < pinned[1]:
                raise MalformedMessage(f"another process claims to be peer {sender} while its connection is up")
            log.info("rank %d: peer %d speaks from a new process now", self.rank, sender)
        if pinned is None or pinned[0] != incarnation:
            self._incarnations[sender] = (incarnation, time.monotonic())

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        peer = self._sockets.monitors[monitor]
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            with self._cond:
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._sockets.refusals.pop(peer, None)
                    actions = self._node.connected(peer, time.monotonic())
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    actions = self._node.disconnected(peer, time.monotonic())
                else:  # a failed handshake: libzmq gives up on the connection, so we retry ourselves
                    delay = self._sockets.refused_by(peer, time.monotonic())
                    if self._sockets.refusals[peer] in (4, 16, 64):  # the first few are expected while a peer joins
                        self._node.note(f"peer {peer} refused the handshake ({self._sockets.refusals[peer]} "
                                        f"time(s); it may not have read this peer's record yet, or the keys "
                                        f"differ); trying again in {delay:g} s")
                    actions = []
                self._cond.notify_all()
            self._dispatch(actions)
        self._flush_notes()

    def _service_loop(self) -> None:
        """Sends what the receiver decided and serves state requests, so the receiver never sends."""
        while not self._closed:
            try:
                action = self._tasks.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                continue
            try:
                if isinstance(action, ServeState):
                    self._serve_state(action)
                else:
                    self._send(action, time.monotonic() + CONTROL_SEND_S, type(action.message).__name__)
            except ExchangeClosed:
                return
            except ExchangeError as exc:
                log.info("rank %d: %s to %d not sent: %s", self.rank, type(action).__name__, action.peer, exc)

    def _serve_state(self, action: ServeState) -> None:
        deadline = time.monotonic() + self.timeout_s
        provider = self._state_provider
        try:
            state = provider() if provider is not None else None
        except Exception:  # noqa: BLE001 - a provider bug is logged; the requester gets "none yet"
            log.exception("rank %d: the state provider failed", self.rank)
            state = None
        for chunk in state_chunks(action.nonce, state, self._node.chunk_elems):
            self._send(Send(action.peer, chunk), deadline, f"state upload to {action.peer}")
        if state is not None:
            log.info("rank %d: gave round %d state (%d values) to peer %d", self.rank, state[0], state[1].numel(), action.peer)

    def _flush_notes(self) -> None:
        with self._cond:
            notes, self._node.notes = self._node.notes, []
        for routine, note in notes:
            log.log(logging.INFO if routine else logging.WARNING, "rank %d: %s", self.rank, note)
