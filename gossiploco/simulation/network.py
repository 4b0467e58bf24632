"""A simulated network and clock: one event queue, every random choice from one seeded generator.

Peers exchange the protocol's messages over *connections* (one per unordered pair) that behave
like the real carrier's: a connection is up only while both ends run and nothing partitions
them; a crash drops it at once (a TCP reset), a frozen peer or a partition drops it after the
heartbeat timeout, and a dropped connection loses whatever was in flight on it. Messages on an
up connection arrive after a latency (plus size over bandwidth), in order, unless a fault window
adds delay, loss, duplication or reordering. Nothing here knows the protocol: it moves opaque
messages and reports connection changes to ``on_*`` callbacks of whoever owns it.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field


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


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class SimNetwork:
    """Virtual time, an event queue, connections and link faults; see the module docstring."""

    def __init__(self, rng: random.Random, *, latency_s: float = 0.002, bandwidth_bps: float = 1e9,
                 heartbeat_s: float = 2.0, reconnect_s: float = 0.1):
        self.rng = rng
        self.now = 0.0
        self.latency_s, self.bandwidth_bps = latency_s, bandwidth_bps
        self.heartbeat_s, self.reconnect_s = heartbeat_s, reconnect_s
        self.faults: list[LinkFault] = []
        self._queue: list[_Event] = []
        self._seq = itertools.count()
        self._up: dict[frozenset, int] = {}  # pair -> epoch of the live connection
        self._epoch = itertools.count(1)
        self._last_arrival: dict[tuple[int, int], float] = {}
        self.reachable: Callable[[int], bool] = lambda peer: True
        """Whether a peer's process runs and answers (set by the owner: not crashed, not frozen)."""
        self.on_connect: Callable[[int, int], None] = lambda a, b: None
        self.on_disconnect: Callable[[int, int], None] = lambda a, b: None
        self.messages = 0

    # -- time ---------------------------------------------------------------------------------

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, _Event(max(time, self.now), next(self._seq), action))

    def run_until(self, end: float, stop: Callable[[], bool] = lambda: False) -> None:
        while self._queue and self._queue[0].time <= end and not stop():
            event = heapq.heappop(self._queue)
            self.now = event.time
            event.action()

    # -- connections ----------------------------------------------------------------------------

    def is_up(self, a: int, b: int) -> bool:
        return frozenset((a, b)) in self._up

    def partitioned(self, a: int, b: int) -> bool:
        return any(f.kind in ("partition", "oneway") and (f.touches(a, b, self.now) or f.touches(b, a, self.now))
                   for f in self.faults)

    def try_connect(self, a: int, b: int) -> None:
        """Connect ``a`` and ``b`` if both run and nothing separates them; else retry later while both exist."""
        pair = frozenset((a, b))
        if pair in self._up:
            return
        if self.reachable(a) and self.reachable(b) and not self.partitioned(a, b):
            self._up[pair] = next(self._epoch)
            delay = 2 * self.latency_s
            self.at(self.now + delay, lambda: self.on_connect(a, b))
            self.at(self.now + delay, lambda: self.on_connect(b, a))
        else:
            self.at(self.now + self.reconnect_s, lambda: self.try_connect(a, b))

    def drop(self, a: int, b: int, *, after: float = 0.0) -> None:
        """The connection between ``a`` and ``b`` drops (``after`` seconds from now); both ends are told."""
        def go() -> None:
            pair = frozenset((a, b))
            if pair not in self._up:
                return
            del self._up[pair]
            self.on_disconnect(a, b)
            self.on_disconnect(b, a)
            self.at(self.now + self.reconnect_s, lambda: self.try_connect(a, b))
        if after > 0:
            self.at(self.now + after, go)
        else:
            go()

    def watch_heartbeats(self, a: int, b: int) -> None:
        """Drop the connection after the heartbeat timeout unless both ends answer and nothing separates them."""
        def check() -> None:
            if self.is_up(a, b) and (not self.reachable(a) or not self.reachable(b) or self.partitioned(a, b)):
                self.drop(a, b)
        self.at(self.now + self.heartbeat_s, check)

    # -- messages -------------------------------------------------------------------------------

    def send(self, src: int, dst: int, nbytes: int, deliver: Callable[[], None]) -> None:
        """Carry a message of ``nbytes`` from ``src`` to ``dst``; ``deliver`` runs on arrival (if it arrives)."""
        pair = frozenset((src, dst))
        epoch = self._up.get(pair)
        if epoch is None:
            return  # no connection: lost
        self.messages += 1
        delay, copies, reorder = self.latency_s + nbytes / self.bandwidth_bps, 1, False
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

        def arrive() -> None:
            if self._up.get(pair) == epoch:  # a connection that dropped lost what was in flight
                deliver()
        for i in range(copies):
            self.at(arrival + i * self.latency_s, arrive)
