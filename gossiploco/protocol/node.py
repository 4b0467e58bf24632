"""``PeerNode``: one peer's protocol state, driven by events, answering with actions.

Events (each a method; ``now`` is the driver's clock):

* ``connected(peer, now)`` / ``disconnected(peer, now)``: the carrier's view of a connection
  (for ZeroMQ: a ZMTP handshake, a dropped connection or a missed heartbeat);
* ``idled(peer, now)``: a carrier that opens links on demand closed one for idleness (``PeerTable``'s
  ``links_on_demand``): no failure;
* ``receive(sender, message, now)``: a validated message from ``sender`` (the carrier has
  checked that ``sender`` is who sent it);
* ``add_peer``, ``announce``, ``leave``: the owner's requests; exchanges are ``Call`` objects run
  against the node (``call``).

Actions returned: ``Send`` (a message for a peer) and ``ServeState`` (answer a state request off
the receive path). The node owns no socket, thread or clock; its owner holds one lock around
every method and wakes the callers waiting on it after each event.

What it keeps (all bounded): the membership view (``PeerTable``), the mailbox of early chunks,
and per-key agreement records (``protocol.records``: the last ``MAX_KEYS`` keys), namely followers ready
for a key this peer leads, groups it decided, decisions it was told, peers that abandoned a
key, and groups it agreed on. Chunks of a key from a peer outside the group this peer agreed on,
or outside the senders its running call expects, are refused at once with an ``Abort``: a peer
that believes it is our gossip partner learns it is not within one message, instead of waiting
out its deadline (the cycle of swaps seen after a leader crash).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from gossiploco.errors import ExchangeBroken, ExchangeClosed, ExchangeError, MalformedMessage, PeerFailed
from gossiploco.protocol import agreement, declines, groups, keys, pairing
from gossiploco.protocol.mailbox import Mailbox
from gossiploco.protocol.messages import (LEAVING, MAX_ENDS_IN_MS, PROBE, STEPPING_OUT, Abort, Action, Data, Decision,
                                          Hello, Leading, Message, Ready, Send, ServeState, StateRequest, op_and_round)
from gossiploco.protocol.peer_table import FAILED_GRACE_S, PeerTable
from gossiploco.protocol.records import Records
from gossiploco.protocol.state_limit import StateRequestLimit, refusal

MONITOR_ROUNDS_KEPT = 3
"""Early chunks of a measurement up to this many rounds back are kept (a background measurement's second exchange,
its terms, may start a round or two after the peers that sent them moved on); other exchanges: one round."""
class PeerNode:
    """One peer's protocol state machine; see the module docstring. Not thread-safe: the owner locks."""

    def __init__(self, rank: int, known, *, grace_s: float, chunk_elems: int, mailbox_bytes: int,
                 sender_mailbox_bytes: int | None = None,
                 join_round: int | None = 0, links_on_demand: bool = False):
        self.rank = rank
        self.grace_s = grace_s
        self.chunk_elems = chunk_elems
        self.peers = PeerTable(rank, known, join_round, links_on_demand)
        self.mailbox = Mailbox(mailbox_bytes, sender_mailbox_bytes)
        self.unexpected_chunks = 0
        """Chunks dropped on arrival because no exchange can use them (``_unexpected``)."""
        self.probe_id = 1
        """Id of this peer's latest question to the others (``announce``); only replies echoing it count."""
        self.current_round = -1
        """The round this peer is in (``begin_round``; -1 before the first); told to peers in hellos and decisions."""
        self.round_began: float | None = None
        """When this peer began ``current_round`` (``begin_round``; None: not said): answers to hellos say how long ago."""
        self.round_ends: tuple[int, float] | None = None
        """(round, when its training ends) on a shared round clock (``round_clock``; set by its owner, None on each
        peer's own clock): answers to hellos sent while in that round say how long that is from now, so a joiner takes
        up the clock (never for another round: a peer that finished, say, says nothing)."""
        self.closed = False
        self.broken: str | None = None
        """Why the carrier under this node died (a driver thread crashed); every call then fails with it."""
        self.behind_nat: set[int] = set()
        """Peers known to be behind NAT (their records say so): a group this peer leads is ordered
        by ``agreement.ring_order`` to keep them apart in the ring (when ``order_rings``)."""
        self.order_rings = True
        self.group_seed = 0
        """The run's seed: it keys the buckets and leaders of every exchange (``groups``); every peer of a run holds the same."""
        self.group_size = groups.DEFAULT_SIZE
        """Views larger than this split into buckets (``groups``); every peer of a run holds the same."""
        self.ready: Records[str, set[int]] = Records()
        self.first_ready: Records[str, float] = Records()
        """key -> when the first follower's ``Ready`` for it came: a leader waits one grace window from then, not from
        its own (possibly later) start."""
        self.decided: Records[str, tuple[list[int], float]] = Records()  # key -> (group, when decided)
        self.told: Records[str, tuple[int, tuple[int, ...]]] = Records()
        self.leading: Records[str, int] = Records()
        """key -> the peer that said it leads it and is waiting for the group (``Leading``)."""
        self.leading_now: Records[str, bool] = Records()
        """Keys this peer is leading right now (``agreement.Lead`` between its start and its decision)."""
        self.paired: frozenset[str] = frozenset()
        """Labels of the exchanges whose members pair as they become ready (``protocol.pairing``; gossip Mix2)."""
        self.pairings: Records[str, pairing.Pairing] = Records(limit=pairing.PAIRINGS_KEPT)
        """key -> the matchmaking this peer runs as the leader of a paired exchange."""
        self.aborted: Records[str, set[int]] = Records()
        self.declines = declines.Declines()
        """Exchanges this peer completed whose run again it declines (``protocol.declines``)."""
        self.other_lists: Records[str, dict[int, object]] = Records()
        """key -> {sender: the member-list digest on a chunk of it this peer refused}: a call whose member runs the
        exchange over another list fails at once, saying so (``fault``), whatever reaches whom first."""
        self.grouped: Records[str, frozenset[int]] = Records()
        self.finished: Records[str, frozenset[int]] = Records()
        self.left_out: Records[str, int] = Records(limit=16)
        """key -> round of the exchanges this peer was left out of as a straggler (cleared when it (re)joins)."""
        self.isolated_mixes = 0
        """Exchanges this peer had to run alone while it knew peers it could not reach (``isolated``)."""
        self.caught_up_into = -1
        """The last round this peer caught up into (being left out of its exchanges is expected)."""
        self._refused: Records[tuple[str, int], bool] = Records()
        self._expected: dict[str, list[set[int]]] = {}  # key -> expected senders of each running call
        self.bytes_received = 0
        self.refused_chunks = 0
        self.unknown_members = 0
        """Decisions that named a member this peer does not know yet (``agreement.Follow``): failed groups."""
        self.notes: list[tuple[bool, str]] = []
        """Log lines the owner should write, each with whether it is routine (a peer joining or leaving: an info
        line) or a sign of trouble (a warning). The node does not log itself, so a simulator can stay quiet."""
        self._left: set[int] = set()  # peers that said goodbye: their connection dropping is no news
        self.state_limit = StateRequestLimit()
        """How often each requester may have this peer's state (``state_limit``)."""
        self.state_nonces: Records[tuple[int, str], bool] = Records(limit=256)
        """(requester, nonce) of the state requests heard: each is answered once (``_state_request``)."""

    # -- views ----------------------------------------------------------------------------------

    def members(self, round_index: int | None = None) -> list[int]:
        return self.peers.members(round_index)

    def note(self, text: str, routine: bool = False) -> None:
        self.notes.append((routine, text))
        del self.notes[:-256]

    # -- events from the carrier ------------------------------------------------------------------

    def connected(self, peer: int, now: float, incarnation: object = None) -> list[Action]:
        """A link to ``peer`` is up; ``incarnation``: its process, where the carrier tells it
        (``PeerTable.on_connected``)."""
        if peer not in self.peers.known:
            return []
        if self.peers.on_connected(peer, now, incarnation):
            # A new or returning peer: ask where it stands (its reply carries its join round). Asked
            # once the connection is up, so the question is not lost in a reconnection.
            return [Send(peer, self._question(self.probe_id))]
        return []

    def idled(self, peer: int, now: float) -> list[Action]:
        """The carrier closed the idle link to ``peer`` (it opens one again when something is sent): it stays a
        member."""
        self.peers.on_idle(peer)
        return []

    def restarted(self, peer: int, now: float) -> list[Action]:
        """The carrier admitted a new process of ``peer`` while no link to it was up (links on demand): pending until
        its news, and asked where it stands (its news may go to others only)."""
        if peer not in self.peers.known or peer == self.rank:
            return []
        self.peers.on_restart(peer, now)
        self.note(f"peer {peer} restarted (a new process of it spoke)", routine=True)
        return [Send(peer, self._question(self.probe_id))]

    def disconnected(self, peer: int, now: float) -> list[Action]:
        if self.peers.on_disconnected(peer, now) and peer not in self._left:
            self.note(f"lost the connection to peer {peer}")
        return pairing.on_disconnected(self, peer, now)

    def receive(self, sender: int, message: Message, now: float) -> list[Action]:
        """A message from ``sender``; raises ``MalformedMessage`` for one that breaks the protocol."""
        if sender not in self.peers.known or sender == self.rank:
            if isinstance(message, Hello):
                return []  # a peer of this run that discovery has not found yet; it is probed once found
            raise MalformedMessage(f"sender {sender} is not a known peer (not discovered yet, or not of this run)")
        if isinstance(message, Data):
            return self._data(sender, message, now)
        if isinstance(message, Hello):
            return self._hello(sender, message, now)
        if isinstance(message, Ready):
            return agreement.on_ready(self, sender, message, now)
        if isinstance(message, Decision):
            agreement.on_decision(self, sender, message)
            return []
        if isinstance(message, Leading):
            self.leading.put(message.key, sender)
            return []
        if isinstance(message, Abort):
            self.aborted.put(message.key, self.aborted.get(message.key, set()) | {sender})
            return pairing.on_abort(self, message.key, sender, now) + self.declines.on_abort(message.key, sender)
        if isinstance(message, StateRequest):
            return self._state_request(sender, message)
        raise MalformedMessage(f"unknown message {type(message).__name__}")

    def _state_request(self, sender: int, message: StateRequest) -> list[Action]:
        """Serve the state, or refuse it cheaply past the requester's limit (``state_limit``); a request heard
        already (a requester sends it again when its peer comes back: ``FetchState``) is answered once."""
        if (sender, message.nonce) in self.state_nonces:
            return []
        self.state_nonces.put((sender, message.nonce), True)
        if self.state_limit.allow(sender, self.current_round):
            return [ServeState(sender, message.nonce)]
        mine = self.state_limit.refused[sender]
        if mine & (mine - 1) == 0:  # logged at powers of two: a flood is one line a doubling
            self.note(f"refused a state request from peer {sender}: over its limit of {self.state_limit.burst} "
                      f"plus one per {self.state_limit.refill_rounds} rounds ({mine} refused from it so far)")
        return [Send(sender, refusal(message.nonce))]

    def _data(self, sender: int, message: Data, now: float) -> list[Action]:
        key = message.key
        running = self._expected.get(key)
        allowed = set().union(*running) if running else self.grouped.get(key, self.finished.get(key))
        if allowed is not None and sender not in allowed:
            self.refused_chunks += 1
            if (key, sender) in self._refused:
                return []
            self._refused.put((key, sender), True)
            if len(message.meta) >= 3:
                self._other_list(key, {sender: message.meta[2]})
            self.note(f"refused chunks of {key!r} from {sender}: not a partner of this peer in that exchange")
            return [Send(sender, Abort(key))]
        if not running and key in self.finished:
            return []  # a late duplicate of a chunk already used
        if not running and self._unexpected(key):
            self.unexpected_chunks += 1
            if self.unexpected_chunks in (1, 10, 100, 1000) or self.unexpected_chunks % 10000 == 0:
                self.note(f"dropped chunks no exchange can use ({self.unexpected_chunks} so far; the latest: "
                          f"{key!r} from {sender}, this peer is in round {self.current_round})")
            return []
        dropped = self.mailbox.dropped
        notes = self.mailbox.put(sender, message, now, self._expected)
        if self.mailbox.dropped == dropped or self.mailbox.dropped & (self.mailbox.dropped - 1) == 0:
            for note in notes:  # drops are logged at powers of two: a flood of them is one line a doubling
                self.note(note)
        return []

    def _unexpected(self, key: str) -> bool:
        """Chunks of ``key`` can never be used: a state reply nobody asked for (replies find their
        download running), or an exchange of a round before the previous one (those are over), or for a
        consensus measurement (which runs in the background and may trail: ``runtime.peer_monitor``) before
        ``MONITOR_ROUNDS_KEPT`` rounds back."""
        op, round_index = op_and_round(key)
        kept = MONITOR_ROUNDS_KEPT if op == "monitor" else 1
        return op == "state" or (self.current_round >= kept and round_index < self.current_round - kept)

    def _hello(self, sender: int, message: Hello, now: float) -> list[Action]:
        if message.join_round == LEAVING:
            self.peers.on_leave(sender, now)
            self._left.add(sender)
            self.note(f"peer {sender} left", routine=True)
            return []
        sends: list[Action] = []
        if message.join_round >= 0:
            news = self.peers.joined.get(sender) != message.join_round  # hellos repeat; say it once
            self.peers.on_join(sender, message.join_round)
            self._left.discard(sender)
            if news and message.join_round != STEPPING_OUT:
                sends = agreement.went_on_without(self, sender, message.join_round)
            if news and message.join_round == STEPPING_OUT:
                self.note(f"peer {sender} steps out while it catches up (it is in round {message.current_round})", routine=True)
            elif news:
                self.note(f"peer {sender} takes part from round {message.join_round} (it is in round {message.current_round})",
                          routine=True)
        if message.echo == self.probe_id:  # an answer to our latest question (not an older one that crossed it)
            self.peers.reported[sender] = message.current_round
        if message.ends_in_ms is not None and message.current_round >= 0:
            self.peers.round_clocks[sender] = (message.current_round, now + message.ends_in_ms / 1000)
        if message.began_ms_ago is not None and message.current_round >= 0:
            self.peers.round_starts[sender] = (message.current_round, now - message.began_ms_ago / 1000)
        if message.ask_reply:
            left = began = None
            if self.round_ends is not None and self.round_ends[0] == self.current_round:
                left = max(-MAX_ENDS_IN_MS, min(round((self.round_ends[1] - now) * 1000), MAX_ENDS_IN_MS))
            if self.round_began is not None and self.current_round >= 0:
                began = max(0, min(round((now - self.round_began) * 1000), MAX_ENDS_IN_MS))
            # Not asked back: a question says its sender's join round once it has one (``_question``), and an
            # undecided sender's news comes later (its ``announce``, or its record: ``PeerTable.add``)
            sends.append(Send(sender, Hello(self.peers.joined.get(self.rank, PROBE), self.current_round,
                                            echo=message.ask, ends_in_ms=left, began_ms_ago=began)))
        return sends

    # -- the owner's requests -----------------------------------------------------------------------

    def record_join_round(self) -> int:
        """The join round this peer's directory record says (``PeerRecord.joined``): the first round it takes part in,
        as its latest news said; -1 while it has not decided or steps out to catch up."""
        joined = self.peers.joined.get(self.rank, -1)
        return joined if 0 <= joined < STEPPING_OUT else -1

    def begin_round(self, round_index: int, now: float) -> None:
        """The owner: this peer is in round ``round_index`` from ``now`` (the run's rounds once it finished them all)."""
        self.current_round, self.round_began = round_index, now

    def add_peer(self, peer: int, joined: int | None = None) -> bool:
        """A peer found by discovery (``joined``: its record's join round, ``PeerTable.add``); True if it is new."""
        return peer != self.rank and self.peers.add(peer, joined)

    def forget_peer(self, peer: int) -> bool:
        """The owner's discovery found ``peer`` gone for good (``PeerTable.forget``); False if it is connected."""
        if not self.peers.forget(peer):
            return False
        self._left.discard(peer)
        return True

    def announce(self, join_round: int, ask_reply: bool = True, caught_up: bool = False,
                 to: list[int] | None = None) -> list[Action]:
        """Take part from ``join_round`` (``PROBE``: no change, only ask) and tell every known peer (or ``to``; with
        links on demand a bounded few, ``PeerTable.news_targets``);
        with ``ask_reply``, ``peers.reported`` then collects the answers (their current rounds) of the peers asked:
        a probe asks every peer it goes to, news of a join round only the peers outside this peer's view (their
        answers re-admit them). The members already in the view owe no answer: asking them made every peer of
        the swarm answer every joiner, control messages per peer growing with the swarm's size.
        ``caught_up``: this peer just downloaded round ``join_round``'s state (see ``straggling``)."""
        if join_round >= 0:
            self.peers.on_join(self.rank, join_round)
            self.left_out = Records(limit=16)
            if caught_up:  # it downloaded round ``join_round``'s state after that round's Mix1 began
                self.caught_up_into = join_round
        self.peers.reported.clear()
        self.probe_id += 1
        question = self._question(self.probe_id if ask_reply else 0)  # says ``join_round`` when that is one
        news = question if join_round == PROBE else Hello(join_round, self.current_round)
        if to is None:
            to = self.peers.news_targets(random.Random(f"{self.group_seed}/{self.rank}/news/{self.probe_id}"))
        return [Send(p, news if p in self.peers.joined else question) for p in sorted(to) if p != self.rank]

    def ask_again(self, peers) -> list[Action]:
        """Repeat this peer's latest question (``announce``) to ``peers`` that have not answered it: a question
        or its answer can be lost with a connection that dropped and came back while it was on its way."""
        hello = self._question(self.probe_id)
        return [Send(p, hello) for p in peers if p != self.rank]

    def _question(self, ask: int) -> Hello:
        """A question (``ask``) that also says this peer's join round once it has one, so the peer asked learns it
        without asking back (``PROBE`` while undecided)."""
        return Hello(self.peers.joined.get(self.rank, PROBE), self.current_round, ask=ask)

    def leave(self, also: Iterable[int] = ()) -> list[Action]:
        """Messages telling every connected peer that this one leaves now, and the known peers ``also`` (with links on
        demand: those whose own links to this peer may be up while this peer's to them were closed idle)."""
        hello = Hello(LEAVING, self.current_round)
        told = self.peers.connected | (set(also) & self.peers.known)
        return [Send(p, hello) for p in sorted(told - {self.rank})]

    def group_call(self, key: str, round_index: int, now: float) -> agreement.Lead | agreement.Follow | None:
        """The agreement call for ``key`` of round ``round_index``; None when this peer takes no part in that round."""
        if not self.peers.takes_part(round_index):
            return None
        candidates = self._bucket(key, round_index)
        leader = declines.leader_of(self, key, candidates)
        if leader == self.rank:
            return self.lead_call(key, round_index, candidates, now)
        return agreement.Follow(key, leader, round_index, candidates, now, self.grace_s)

    def lead_call(self, key: str, round_index: int, candidates: list[int], now: float) -> agreement.Lead:
        """The call leading ``candidates`` (this peer's bucket) in exchange ``key`` of round ``round_index``."""
        lead = pairing.PairLead if self.pairs_as_ready(key) else agreement.Lead
        return lead(key, candidates, now, self.grace_s, self.buckets(round_index))

    def links_ahead(self, key: str, round_index: int) -> list[int]:
        """The peers exchange ``key`` of round ``round_index`` may need a link to, by this peer's view (its bucket):
        a carrier that opens links on demand opens these ahead (during the inner steps) or keeps them open, so that
        no handshake falls on the exchange's critical path. Empty for a carrier with every link up, and where this
        peer takes no part."""
        if not self.peers.links_on_demand or not self.peers.takes_part(round_index):
            return []
        return [p for p in self._bucket(key, round_index) if p != self.rank]

    def pairs_as_ready(self, key: str) -> bool:
        """Whether exchange ``key`` pairs its members as they become ready (its label is in ``paired``)."""
        return key.partition("/")[0] in self.paired

    def pair_ready(self, key: str, sender: int, round_index: int, now: float) -> list[Send]:
        """A follower ready for paired exchange ``key`` (``pairing.ready``), matched within this peer's bucket of it."""
        return pairing.ready(self, key, sender, self._bucket(key, round_index), now)

    def leads(self, key: str, round_index: int, sender: int) -> bool:
        """Whether this peer leads ``sender``'s bucket of exchange ``key`` in round ``round_index`` (by its own view), or
        may come to lead it (a key run again: ``declines.holds``)."""
        candidates = self._bucket(key, round_index)
        if declines.leader_of(self, key, candidates) != self.rank:
            return declines.holds(key, sender, candidates)
        return sender in candidates or groups.in_bucket(self.group_seed, key, self.buckets(round_index), self.rank,
                                                        sender)

    def _bucket(self, key: str, round_index: int | None) -> list[int]:
        """This peer's bucket of exchange ``key`` in its view of round ``round_index`` (``groups.group_of``)."""
        return groups.group_of(self.group_seed, key, self.members(round_index), self.rank, self.group_size,
                               self.buckets(round_index))

    def buckets(self, round_index: int | None) -> int:
        """How many buckets this peer's view of round ``round_index`` splits into (counted a round late: ``counted``)."""
        return groups.bucket_count(self.peers.counted(round_index), self.group_size)

    def isolated(self, group: list[int], key: str = "", round_index: int | None = None) -> str | None:
        """Why a group of this peer alone is not a mix (it knows peers it cannot reach), counted; None when it is
        not alone or knows nobody else (a swarm of one mixes with nobody, rightly)."""
        cut_off = self.peers.unreachable() if group == [self.rank] else []
        if cut_off and key:  # only those that would share this peer's bucket: the others were never its candidates
            buckets = self.buckets(round_index)
            cut_off = [p for p in cut_off if groups.in_bucket(self.group_seed, key, buckets, self.rank, p)]
        if not cut_off:
            return None
        self.isolated_mixes += 1
        shown = ", ".join(map(str, cut_off[:8])) + (", ..." if len(cut_off) > 8 else "")
        return f"isolated: {len(cut_off)} known peer(s) unreachable ({shown}); mixing alone is no mix"

    # -- used by calls ------------------------------------------------------------------------------

    def begin(self, key: str, expected: set[int]) -> list[Send]:
        """A data call of ``key`` starts, taking chunks from ``expected``. Chunks already here from
        anyone else are dropped and refused (an ``Abort`` tells the sender at once)."""
        error = self.open_error(f"the start of {key!r}")
        if error is not None:
            raise error
        self._expected.setdefault(key, []).append(set(expected))
        strangers = self.mailbox.senders(key) - set().union(*self._expected[key])
        if not strangers:
            return []
        self._other_list(key, self.mailbox.lists(key, strangers))
        self.mailbox.discard(key, strangers)
        self.refused_chunks += 1
        self.note(f"refused chunks of {key!r} from {sorted(strangers)}: not partners of this peer in that exchange")
        for s in strangers:
            self._refused.put((key, s), True)
        return self.aborts(key, sorted(strangers))

    def _other_list(self, key: str, digests: dict[int, object]) -> None:
        if digests:
            self.other_lists.put(key, {**self.other_lists.get(key, {}), **digests})

    def completed(self, key: str) -> None:
        """This peer completed exchange ``key`` (the whole exchange, not a phase): it declines ``key`` run again."""
        self.declines.complete(key, self.grouped.get(key))

    def end(self, key: str) -> None:
        """A data call of ``key`` ended: forget its leftovers (a failed call's late chunks are useless)."""
        running = self._expected.get(key)
        if running:
            self.finished.put(key, frozenset(running.pop(0)))
            if running:
                return
        self._expected.pop(key, None)
        self.mailbox.discard(key)

    def aborts(self, key: str, peers) -> list[Send]:
        return [Send(p, Abort(key)) for p in peers if p != self.rank]

    def open_error(self, what: str) -> ExchangeError | None:
        """The error every call gets once the node is closed or its carrier broke; None while open."""
        if self.closed:
            return ExchangeClosed(f"rank {self.rank}: exchange closed during {what}")
        if self.broken:
            return ExchangeBroken(f"rank {self.rank}: exchange broken ({self.broken}) during {what}")
        return None

    def fault(self, key: str, sender: int, watch: list[int], began: float, now: float,
              digest: object = None) -> tuple[ExchangeError | None, float | None]:
        """Why a call of ``key`` that began at ``began`` waiting on ``sender`` cannot go on (None if it
        can), and the time at which a lost connection will count (to wake up for it). A call over a member
        list (its ``digest``) fails once a peer of ``watch`` sent chunks of it over another list."""
        error = self.open_error(repr(key))
        if error is not None:
            return error, None
        if digest is not None:
            others = self.other_lists.get(key, {})
            mismatched = sorted(p for p in watch if p in others and others[p] != digest)
            if mismatched:
                return PeerFailed(f"{key!r}: peer(s) {mismatched} run this exchange over another member list"), None
        lost = self.peers.lost_since(sender, began)
        if lost is not None and now >= lost + FAILED_GRACE_S:
            return PeerFailed(f"{key!r}: peer {sender} disconnected"), None
        # A peer that abandoned an exchange runs none of its later phases ('monitor/0/2/terms' after 'monitor/0/2'):
        # seen in a real swarm, where one peer finished a phase the others failed and waited a whole deadline in the next.
        quit_ = sorted(p for p in watch if any(p in self.aborted.get(k, ()) for k in keys.phases(key)))
        if quit_:
            return PeerFailed(f"{key!r}: peer(s) {quit_} abandoned the exchange"), None
        return None, None if lost is None else lost + FAILED_GRACE_S

    def straggling(self, round_index: int) -> bool:
        """Left out as a straggler in round ``round_index - 1``: a leader waited a whole grace window
        and decided before this peer's ``Ready`` came, so it runs that far behind the swarm's clock
        and should re-align (a round it caught up into does not count: it joins after that round's Mix1 began)."""
        first = max(round_index - 1, self.caught_up_into + 1)
        return any(k >= first for k in self.left_out.values())

    def active_keys(self) -> list[str]:
        return sorted(self._expected)

    def pending_state(self) -> dict[str, int]:
        """Sizes of everything the node keeps, to check it stays bounded."""
        return {"mailbox_bytes": self.mailbox.bytes, "mailbox_chunks": len(self.mailbox), "ready": len(self.ready),
                "decided": len(self.decided), "told": len(self.told), "aborted": len(self.aborted),
                "other_lists": len(self.other_lists),
                "leading": len(self.leading), "leading_now": len(self.leading_now),
                "grouped": len(self.grouped), "finished": len(self.finished), "running": len(self._expected),
                "notes": len(self.notes)}
