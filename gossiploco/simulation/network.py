"""A simulated network and clock: one event queue, every random choice from one seeded generator.

Peers exchange the protocol's messages over *connections* (one per unordered pair) that behave
like the real carrier's: a connection is up only while both ends run and nothing partitions
them; a crash drops it at once (a TCP reset), a frozen peer or a partition drops it after the
heartbeat timeout, and a dropped connection loses whatever was in flight on it. Messages on an
up connection arrive after a latency (plus size over bandwidth), in order, unless a fault window
adds delay, loss, duplication or reordering. Latency and bandwidth are one value for every link, or per peer
(``links``: a consumer link model, where a pair's latency is the sum of its ends' and its bandwidth the
narrower end's). Each connection takes a path (``paths``): direct,
reverse, or through a relay, which can go down (dropping every connection through it) and resets
connections at its limits. Nothing here knows the protocol: it moves opaque messages and reports
connection changes to ``on_*`` callbacks of whoever owns it.

**Links on demand** (``idle_s`` set; ``None``: the owner connects every pair, a full mesh). A message for a peer
with no connection waits while one is opened (a connection setup, as above, tried again every ``reconnect_s``); one
that cannot be opened (the peer does not answer, a partition, no relay) fails after ``heartbeat_s``, as a handshake's
deadline would: its messages
are lost and only the sender hears of it (``on_disconnect``), then retries every ``reconnect_s`` like a dropped
connection. A connection nothing went over for ``idle_s`` either way closes, and both ends hear of it
(``on_idle``): no failure, nothing in flight lost. ``peak_links`` counts the most connections each peer had up.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from gossiploco.simulation.paths import RELAYED, SETUP_LATENCIES, Connection, Relays, pair_path


def consumer_link(rng: random.Random) -> tuple[float, float]:
    """One peer's consumer access link: 10 to 50 ms one way, 50 Mbit/s to 1 Gbit/s (log-uniform), in bytes a second."""
    return rng.uniform(0.010, 0.050), 10 ** rng.uniform(math.log10(50e6), 9) / 8


MIN_IDLE_S = 1.0
"""Links on demand: a link is closed to make room (``links_cap``) only when nothing went over it for this long."""


@dataclass
class LinkFault:
    """A fault window on the link(s) of ``peers`` (both ends among them; empty: every link) from ``start`` to ``end``."""

    kind: str  # "delay" | "loss" | "dup" | "reorder" | "slow" | "partition" | "oneway"
    start: float
    end: float
    peers: tuple[int, ...] = ()
    amount: float = 0.0
    """Seconds of extra delay, a probability, or bytes per second (slow)."""

    def touches(self, a: int, b: int, now: float) -> bool:
        if not self.start <= now < self.end:
            return False
        if self.kind == "oneway":  # only a -> b where peers = (a, b)
            return (a, b) == self.peers
        return not self.peers or (a in self.peers and b in self.peers)


class SimNetwork:
    """Virtual time, an event queue, connections and link faults; see the module docstring."""

    def __init__(self, rng: random.Random, *, latency_s: float = 0.002, bandwidth_bps: float = 1e9,
                 heartbeat_s: float = 2.0, reconnect_s: float = 0.1):
        self.rng = rng
        self.now = 0.0
        self.latency_s, self.bandwidth_bps = latency_s, bandwidth_bps
        self.heartbeat_s, self.reconnect_s = heartbeat_s, reconnect_s
        self.faults: list[LinkFault] = []
        self._queue: list[tuple[float, int, Callable[[], None]]] = []  # (time, sequence, action): compared in C
        self._seq = itertools.count()
        self._up: dict[frozenset, Connection] = {}  # pair -> its live connection
        self._last_arrival: dict[tuple[int, int], float] = {}
        self.behind_nat: frozenset[int] = frozenset()
        """Peers nobody can dial (the others are reachable)."""
        self.relays = Relays()
        self.answers: Callable[[int], bool] = lambda peer: True
        """Whether a peer's process runs and answers (set by the owner: not crashed, not frozen)."""
        self.admits: Callable[[int, int], bool] = lambda a, b: True
        """Whether ``a`` and ``b`` accept each other's handshake (set by the owner: a newcomer's is refused until the
        other has read its record, ``simulation.newcomers``)."""
        self.on_connect: Callable[[int, int], None] = lambda a, b: None
        self.on_disconnect: Callable[[int, int], None] = lambda a, b: None
        self.on_idle: Callable[[int, int], None] = lambda a, b: None
        self.idle_s: float | None = None
        """Links on demand, closed after this long idle (module docstring); None: a full mesh."""
        self._waiting: dict[frozenset, tuple[int, list[tuple[int, int, int, Callable[[], None]]]]] = {}
        """pair -> (the end that opens it, messages (src, dst, bytes, deliver)) waiting for a link opened on demand."""
        self._last_use: dict[frozenset, float] = {}
        """pair -> when the last message went on, or will arrive over, its connection."""
        self.links_cap: int | None = None
        """Links on demand: the most links a peer keeps; a new one past it closes the peer's least recently used link
        idle for ``MIN_IDLE_S`` (none such: the peer goes over, until one is). None: no bound but ``idle_s``."""
        self._links: Counter[int] = Counter()
        self._pairs_of: dict[int, set[frozenset]] = {}
        self.peak_links: Counter[int] = Counter()
        """The most connections each peer had up at once."""
        self.note: Callable[[str], None] = lambda text: None
        """Where connection events go in the owner's event log."""
        self.messages = 0
        self.paths: Counter[str] = Counter()
        """Connections that came up, by path."""
        self.relay_resets = 0
        """Relayed connections reset at the relay's data or time limit."""
        self.relay_drops = 0
        """Relayed connections dropped because their relay went down."""
        self.links: dict[int, tuple[float, float]] = {}
        """peer -> (one-way latency in s, bandwidth in bytes/s) of its access link; a peer absent: the defaults."""
        self.sent_by: Counter[int] = Counter()
        """Messages each peer put on a connection."""
        self.connections_of: Counter[int] = Counter()
        """Connections each peer saw come up over the run (a reconnection counts again)."""

    def latency(self, a: int, b: int) -> float:
        """One-way latency between ``a`` and ``b``."""
        if not self.links:
            return self.latency_s
        return self.links.get(a, (self.latency_s / 2, 0.0))[0] + self.links.get(b, (self.latency_s / 2, 0.0))[0]

    def bandwidth(self, a: int, b: int) -> float:
        """Bytes per second between ``a`` and ``b`` (the narrower end)."""
        if not self.links:
            return self.bandwidth_bps
        return min(self.links.get(a, (0.0, self.bandwidth_bps))[1], self.links.get(b, (0.0, self.bandwidth_bps))[1])

    def live_connections(self) -> Counter[int]:
        """How many connections each peer has up now."""
        count: Counter[int] = Counter()
        for pair in self._up:
            count.update(pair)
        return count

    # -- time ---------------------------------------------------------------------------------

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(time, self.now), next(self._seq), action))

    def run_until(self, end: float, stop: Callable[[], bool] = lambda: False) -> None:
        queue = self._queue
        while queue and queue[0][0] <= end and not stop():
            self.now, _, action = heapq.heappop(queue)
            action()

    # -- connections ----------------------------------------------------------------------------

    def is_up(self, a: int, b: int) -> bool:
        return frozenset((a, b)) in self._up

    def could_connect(self, a: int, b: int) -> bool:
        """Whether ``a`` and ``b`` have a connection up, or (links on demand) could open one now."""
        return self.is_up(a, b) or (self.idle_s is not None and self._connection(a, b) is not None)

    def partitioned(self, a: int, b: int) -> bool:
        return any(f.kind in ("partition", "oneway") and (f.touches(a, b, self.now) or f.touches(b, a, self.now))
                   for f in self.faults)

    def try_connect(self, a: int, b: int) -> None:
        """Connect ``a`` and ``b`` if both run, nothing separates them and their path is open (a relayed
        one needs a live relay); else retry every ``reconnect_s``."""
        pair = frozenset((a, b))
        if pair in self._up:
            return
        connection = self._connection(a, b)
        if connection is not None:
            self._open(a, b, connection)
        else:
            self.at(self.now + self.reconnect_s, lambda: self.try_connect(a, b))

    def _connection(self, a: int, b: int) -> Connection | None:
        """A new connection between ``a`` and ``b`` if both run, nothing separates them and their path is open (a
        relayed one needs a live relay); None otherwise."""
        path = pair_path(a not in self.behind_nat, b not in self.behind_nat)
        relay = self.relays.pick() if path == RELAYED else None
        if (self.answers(a) and self.answers(b) and self.admits(a, b) and not self.partitioned(a, b)
                and (path != RELAYED or relay is not None)):
            return Connection(path, relay)
        return None

    def _open(self, a: int, b: int, connection: Connection) -> None:
        """Open ``connection`` between ``a`` and ``b``: it comes up, and both ends hear of it, once its
        path is set up, unless it dropped meanwhile (then neither end ever saw it)."""
        pair = frozenset((a, b))
        self._up[pair] = connection

        def come_up() -> None:
            if self._up.get(pair) is not connection:
                return
            connection.announced = True
            self.paths[connection.path] += 1
            self.connections_of.update((a, b))
            for end in (a, b):
                self._links[end] += 1
                self._pairs_of.setdefault(end, set()).add(pair)
                if self.links_cap is not None and self._links[end] > self.links_cap:
                    self._evict(end, pair)
                self.peak_links[end] = max(self.peak_links[end], self._links[end])
            via = f" via r{connection.relay}" if connection.relay is not None else ""
            self.note(f"PATH {a}-{b} {connection.path}{via}")
            self.on_connect(a, b)
            self.on_connect(b, a)
            if self.idle_s is not None:
                self._last_use[pair] = self.now
                self.at(self.now + self.idle_s, lambda: self._idle_check(pair, connection))
                for src, dst, nbytes, deliver in self._waiting.pop(pair, (a, []))[1]:
                    self.send(src, dst, nbytes, deliver)
        self.at(self.now + SETUP_LATENCIES[connection.path] * self.latency(a, b), come_up)
        if connection.relay is not None and self.relays.time_limit_s is not None:
            self.at(self.now + self.relays.time_limit_s, lambda: self._reset(a, b, connection, "time limit"))

    def drop(self, a: int, b: int, *, after: float = 0.0) -> None:
        """The connection between ``a`` and ``b`` drops (``after`` seconds from now); both ends are told if they knew of it."""
        def go() -> None:
            connection = self._up.pop(frozenset((a, b)), None)
            if connection is None:
                return
            if connection.announced:
                self._unlink(a, b)
                self.on_disconnect(a, b)
                self.on_disconnect(b, a)
            elif frozenset((a, b)) in self._waiting:  # a link opened on demand failed before it came up
                src = self._waiting.pop(frozenset((a, b)))[0]
                self.on_disconnect(src, b if src == a else a)
            self.at(self.now + self.reconnect_s, lambda: self.try_connect(a, b))
        if after > 0:
            self.at(self.now + after, go)
        else:
            go()

    def watch_heartbeats(self, a: int, b: int) -> None:
        """Drop the connection after the heartbeat timeout unless both ends answer and nothing separates them."""
        def check() -> None:
            if self.is_up(a, b) and (not self.answers(a) or not self.answers(b) or self.partitioned(a, b)):
                self.drop(a, b)
        self.at(self.now + self.heartbeat_s, check)

    # -- links on demand ---------------------------------------------------------------------------

    def open_link(self, src: int, dst: int) -> None:
        """Open a link from ``src`` to ``dst`` ahead of its use (links on demand), unless one is opening; one up is
        kept (its idle time starts again). ``src`` hears if it cannot come up, as for a message."""
        pair = frozenset((src, dst))
        if self.idle_s is None or pair in self._waiting:
            return
        if pair in self._up:  # kept for its coming use: its idle time starts again
            self._last_use[pair] = max(self._last_use.get(pair, 0.0), self.now)
            return
        self._waiting[pair] = (src, [])
        self._dial(src, dst)

    def _dial(self, src: int, dst: int, deadline: float | None = None) -> None:
        """Open a link from ``src`` to ``dst`` for the messages waiting on it, trying every ``reconnect_s`` (a
        handshake's retries) until ``heartbeat_s`` from the first try; then tell ``src`` that it could not."""
        pair = frozenset((src, dst))
        if pair in self._up or pair not in self._waiting:
            return  # it came up meanwhile (another dial), or nothing waits any more
        deadline = self.now + self.heartbeat_s if deadline is None else deadline
        connection = self._connection(src, dst)
        if connection is not None:
            self._open(src, dst, connection)
            return
        if self.now + self.reconnect_s < deadline:
            self.at(self.now + self.reconnect_s, lambda: self._dial(src, dst, deadline))
            return

        def give_up() -> None:
            if pair in self._up or self._waiting.pop(pair, None) is None:
                return
            self.note(f"LINK {src}-{dst} could not be opened")
            self.on_disconnect(src, dst)
            self.at(self.now + self.reconnect_s, lambda: self.try_connect(src, dst))
        self.at(deadline, give_up)

    def _idle_check(self, pair: frozenset, connection: Connection) -> None:
        if self._up.get(pair) is not connection:
            return
        idle_from = self._last_use.get(pair, self.now)
        if idle_from + self.idle_s > self.now:
            self.at(idle_from + self.idle_s, lambda: self._idle_check(pair, connection))
            return
        self._close_idle(pair)

    def _close_idle(self, pair: frozenset) -> None:
        del self._up[pair]
        a, b = sorted(pair)
        self._unlink(a, b)
        self.note(f"LINK {a}-{b} closed idle")
        self.on_idle(a, b)
        self.on_idle(b, a)

    def _unlink(self, a: int, b: int) -> None:
        self._links.subtract((a, b))
        for end in (a, b):
            self._pairs_of.get(end, set()).discard(frozenset((a, b)))

    def _evict(self, peer: int, keep: frozenset) -> None:
        """``peer`` is over ``links_cap``: close its least recently used link idle for ``MIN_IDLE_S``, if any."""
        idle = [(self._last_use.get(pair, 0.0), sorted(pair)) for pair in self._pairs_of.get(peer, ())
                if pair != keep and pair not in self._waiting and self._last_use.get(pair, 0.0) + MIN_IDLE_S <= self.now
                and self._up[pair].announced]
        if idle:
            self._close_idle(frozenset(min(idle)[1]))

    # -- relays ---------------------------------------------------------------------------------

    def relay_down(self, relay: int) -> None:
        """Relay ``relay`` stops: every connection through it drops at once (they reconnect through another)."""
        self.relays.down.add(relay)
        through = sorted(tuple(sorted(pair)) for pair, connection in self._up.items() if connection.relay == relay)
        self.note(f"RELAY r{relay} DOWN: drops {' '.join(f'{a}-{b}' for a, b in through) or 'nothing'}")
        self.relay_drops += len(through)
        for a, b in through:
            self.drop(a, b)

    def relay_up(self, relay: int) -> None:
        """Relay ``relay`` runs again: connections waiting for one get it at their next retry."""
        self.relays.down.discard(relay)
        self.note(f"RELAY r{relay} UP")

    def _reset(self, a: int, b: int, connection: Connection, why: str) -> None:
        """The relay resets ``connection`` (if it is still up) at one of its limits; it reconnects."""
        if self._up.get(frozenset((a, b))) is connection:
            self.relay_resets += 1
            self.note(f"RELAY r{connection.relay} RESET {a}-{b}: {why}")
            self.drop(a, b)

    # -- messages -------------------------------------------------------------------------------

    def send(self, src: int, dst: int, nbytes: int, deliver: Callable[[], None]) -> None:
        """Carry a message of ``nbytes`` from ``src`` to ``dst``; ``deliver`` runs on arrival (if it arrives)."""
        pair = frozenset((src, dst))
        connection = self._up.get(pair)
        if connection is None or (self.idle_s is not None and not connection.announced):
            if self.idle_s is None:
                return  # no connection: lost
            dial = pair not in self._waiting
            self._waiting.setdefault(pair, (src, []))[1].append((src, dst, nbytes, deliver))
            if dial and connection is None:
                self._dial(src, dst)
            return
        if connection.relay is not None and self.relays.over_data_limit(connection, nbytes):
            self.at(self.now, lambda: self._reset(src, dst, connection, "data limit"))  # not inside the sender's step
            return  # the relay did not carry it
        self.messages += 1
        self.sent_by[src] += 1
        latency = self.latency(src, dst)
        delay, copies, reorder = latency + nbytes / self.bandwidth(src, dst), 1, False
        if connection.relay is not None:
            connection.carried += nbytes
            delay += self.relays.transit_s(nbytes, latency)
        for f in self.faults:
            if not f.touches(src, dst, self.now):
                continue
            if f.kind in ("partition", "oneway"):
                return
            if f.kind == "delay":
                delay += self.rng.uniform(0, f.amount)
            elif f.kind == "slow":
                delay += nbytes / f.amount
            elif f.kind == "loss" and self.rng.random() < f.amount:
                return
            elif f.kind == "dup" and self.rng.random() < f.amount:
                copies = 2
            elif f.kind == "reorder" and self.rng.random() < f.amount:
                reorder = True
        arrival = self.now + delay
        if not reorder:  # in order on its connection, like TCP
            arrival = max(arrival, self._last_arrival.get((src, dst), 0.0))
            self._last_arrival[(src, dst)] = arrival
        if self.idle_s is not None:
            self._last_use[pair] = max(self._last_use.get(pair, 0.0), arrival + (copies - 1) * latency)

        def arrive() -> None:
            if self._up.get(pair) is connection:  # a connection that dropped lost what was in flight
                deliver()
        for i in range(copies):
            self.at(arrival + i * latency, arrive)
