"""The exchange interface every mixing operator is written against, and its in-memory implementation.

An ``Exchange`` is one peer's handle on its group. It offers three collectives, each identified
by a ``key`` that every participant uses for the same operation (``"mix1/12"``: Mix1 of round 12):

* ``all_reduce_mean(key, flat, members)``: the element-wise mean of a flat fp32 CPU tensor over
  ``members`` (which includes this peer). Every member receives the same result.
* ``swap(key, partner, flat)``: send ``flat`` (fp32, or the uint8 bytes of a compressed payload) to
  ``partner`` and receive theirs, of the same size and dtype.
* ``swap_mean(key, partner, flat)``: the pair's mean ``(flat + partner's) / 2`` of fp32 vectors, the same
  bits on both sides (gossip's Mix2). By default a ``swap`` and the sum; the ZeroMQ transport computes it as
  the partner's chunks arrive.
* ``all_to_all(key, parts, members, sizes, tag)``: send ``parts[m]`` (uint8) to each other member
  ``m`` and receive ``sizes[m]`` bytes from each: the direct sends of the compressed collectives
  (``gossiploco.mixing.compressed``), which do their arithmetic outside the exchange. A member whose
  ``tag`` differs (it encodes against another reference) fails the exchange at once, for everyone.
  A compressed mean's two calls, ``KEY/scatter`` then ``KEY/gather``, share one deadline over the
  network (the in-memory hub gives each its own).

Contract for implementations:

* Both calls block until done or until the exchange deadline (``timeouts.exchange_s``).
* They raise ``ExchangeTimeout`` when a peer did not answer in time, ``PeerFailed`` when a peer
  is gone or sent invalid data, and ``ExchangeClosed`` after ``close()``. Nothing else.
* They are thread-safe: Mix1 runs on a background thread while Mix2 or gradient reductions run
  on another, always with different keys.
* They never modify the input tensor; the result is a new tensor owned by the caller. The one
  exception is opt-in: ``all_reduce_mean`` or ``swap_mean(..., inplace=True)`` means the caller hands ``flat`` over
  (a temporary it will not read again, such as a packed vector), and the implementation may
  reduce in its memory and return a view of it, saving a parameter-sized copy and buffer.
* ``bytes_sent`` / ``bytes_received`` count payload bytes this peer put on (or took off) the wire,
  as the network implementation would.

``MemoryHub`` connects the workers of the one-process virtual swarm; the ZeroMQ transport
implements the same interface for real peers. ``tests/test_exchange.py`` holds the conformance
suite run against every implementation.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch

from gossiploco.errors import ExchangeClosed, ExchangeTimeout, PeerFailed
from gossiploco.mixing.packing import host_vector
from gossiploco.protocol import groups


class Exchange(ABC):
    """One peer's handle on the group; see the module docstring for the contract."""

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0

    @abstractmethod
    def members(self, round_index: int | None = None) -> list[int]:
        """The ranks taking part in round ``round_index``'s exchanges (sorted, including this peer
        when it takes part). ``None``: the ranks taking part now. Non-blocking."""

    def group(self, key: str, round_index: int) -> list[int]:
        """The members that take part in exchange ``key`` of round ``round_index``, agreed with the
        others (every member of the returned list gets the same list). Blocks for at most the
        grace window; raises ``ExchangeError`` when this peer is left out. Default: ``members``,
        right for transports where every view is the same (the in-memory hub)."""
        return self.members(round_index)

    def link_ahead(self, key: str, round_index: int) -> None:
        """Exchange ``key`` of round ``round_index`` comes later: open the links it will need now (a transport with
        links on demand, ``PeerNode.links_ahead``), so no handshake falls on its critical path. Default: nothing
        (every link is up already). Never blocks."""

    def completed(self, key: str) -> None:
        """This peer completed exchange ``key`` over a group ``group`` agreed: it takes no part in ``key`` run again
        (``keys.again_key``), and tells the peers that would wait for it (``protocol.declines``). Default: nothing
        (no exchange runs again where every view is the same). Never blocks."""

    @abstractmethod
    def all_reduce_mean(self, key: str, flat: torch.Tensor, members: Sequence[int], *,
                        inplace: bool = False) -> torch.Tensor:
        """Mean of ``flat`` over ``members``; blocks until every member contributed or the deadline.
        ``inplace``: the caller gives ``flat`` up (module docstring); implementations may ignore it."""

    @abstractmethod
    def swap(self, key: str, partner: int, flat: torch.Tensor) -> torch.Tensor:
        """Send ``flat`` to ``partner``, return the partner's tensor; blocks until done or the deadline."""

    def swap_mean(self, key: str, partner: int, flat: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """``(flat + partner's flat) / 2`` for fp32 values, computed identically on both sides (IEEE addition
        commutes, halving is exact), so the pair's sum is kept; blocks as ``swap``. ``inplace``: as for
        ``all_reduce_mean``. Raises ``PeerFailed`` when the partner's vector has another shape."""
        theirs = self.swap(key, partner, flat)
        if theirs.shape != flat.shape:
            raise PeerFailed(f"{key!r}: partner {partner} sent shape {tuple(theirs.shape)}, "
                             f"expected {tuple(flat.shape)}")
        return theirs.add_(flat).div_(2)  # in the received tensor: no further buffer

    @abstractmethod
    def all_to_all(self, key: str, parts: Mapping[int, torch.Tensor], members: Sequence[int],
                   sizes: Mapping[int, int], tag: int = 0) -> dict[int, torch.Tensor]:
        """Send the uint8 vector ``parts[m]`` to every other member ``m``, return what each sent this peer
        (``sizes[m]`` bytes from ``m``, checked); blocks until done or the deadline. ``parts`` may hold
        one tensor several times (an all-gather); it is not modified. Every member must give the same
        ``tag`` (an int64): a member that sent another raises ``PeerFailed``."""

    def close(self) -> None:
        """Stop taking part; pending and later calls raise ``ExchangeClosed``. Idempotent."""

    def vector(self, numel: int, device: torch.device | None = None) -> torch.Tensor:
        """A new fp32 CPU vector for the caller to fill and give to a collective (``inplace=True``); page-locked
        when ``device`` is a GPU whose tensors are copied into it and back (DMA, asynchronous). Where the exchange
        runs in another process (``companion``) it lies in shared memory, so giving it copies nothing."""
        return host_vector(numel, device)


class MemoryHub:
    """Rendezvous point for ``world`` in-process workers (the virtual swarm's "network").

    ``fail(rank)`` simulates a crashed peer: its partners' exchanges raise ``PeerFailed``. With
    ``group_size``, exchanges run in the buckets a network peer's would (``protocol.groups``, keyed by ``seed``).
    """

    def __init__(self, world: int, timeout_s: float, *, seed: int = 0, group_size: int | None = None):
        self.world = world
        self.timeout_s = timeout_s
        self.seed, self.group_size = seed, group_size
        self._cond = threading.Condition()
        self._deposits: dict[tuple[str, int], torch.Tensor] = {}
        self._results: dict[tuple[str, tuple[int, ...]], list] = {}  # (key, members) -> [mean, readers left]
        self._failed: set[int] = set()
        self._closed: set[int] = set()

    def exchange(self, rank: int) -> MemoryExchange:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world of {self.world}")
        return MemoryExchange(self, rank)

    def fail(self, rank: int) -> None:
        with self._cond:
            self._failed.add(rank)
            self._cond.notify_all()

    def alive(self) -> list[int]:
        with self._cond:
            return [r for r in range(self.world) if r not in self._failed and r not in self._closed]

    # -- collectives, called by MemoryExchange -------------------------------------------------

    def _wait(self, rank: int, ready, peers: Sequence[int], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if rank in self._closed:
                raise ExchangeClosed(f"rank {rank}: exchange closed during {what}")
            gone = [p for p in peers if p in self._failed or p in self._closed]
            if gone:
                raise PeerFailed(f"{what}: peer(s) {gone} failed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ExchangeTimeout(f"{what}: no answer within {self.timeout_s:.1f}s")
            self._cond.wait(remaining)

    def _all_reduce_mean(self, rank: int, key: str, flat: torch.Tensor, members: Sequence[int]) -> torch.Tensor:
        members = sorted(members)
        # One result per group: with ``group_size`` the buckets of one exchange share its key.
        slot = (key, tuple(members))
        with self._cond:
            self._check_open(rank)
            self._deposits[(key, rank)] = flat
            self._cond.notify_all()
            try:
                self._wait(rank, lambda: slot in self._results or all((key, m) in self._deposits for m in members),
                           [m for m in members if m != rank], f"all-reduce {key!r}")
            except Exception:
                self._deposits.pop((key, rank), None)
                raise
            if slot not in self._results:
                # The first member to see every contribution computes the mean, summing in rank order.
                total = self._deposits.pop((key, members[0])).to(torch.float32).clone()
                for m in members[1:]:
                    total += self._deposits.pop((key, m))
                self._results[slot] = [total / len(members), len(members)]
            entry = self._results[slot]
            entry[1] -= 1
            if entry[1] == 0:
                del self._results[slot]
            return entry[0].clone()

    def _swap(self, rank: int, key: str, partner: int, flat: torch.Tensor) -> torch.Tensor:
        with self._cond:
            self._check_open(rank)
            self._deposits[(key, rank)] = flat
            self._cond.notify_all()
            try:
                self._wait(rank, lambda: (key, partner) in self._deposits, [partner], f"swap {key!r} with {partner}")
            except Exception:
                self._deposits.pop((key, rank), None)
                raise
            return self._deposits.pop((key, partner)).clone()

    def _all_to_all(self, rank: int, key: str, parts: Mapping[int, torch.Tensor], members: Sequence[int],
                    sizes: Mapping[int, int], tag: int) -> dict[int, torch.Tensor]:
        others = [m for m in members if m != rank]
        with self._cond:
            self._check_open(rank)
            self._deposits[(key, rank)] = {**parts, "tag": tag}
            self._cond.notify_all()
            try:
                self._wait(rank, lambda: all((key, m) in self._deposits and rank in self._deposits[(key, m)]
                                             for m in others), others, f"all-to-all {key!r}")
            except Exception:
                self._deposits.pop((key, rank), None)
                raise
            got, tags = {}, {}
            for m in others:
                box = self._deposits[(key, m)]
                got[m], tags[m] = box.pop(rank).clone(), box["tag"]
                if len(box) == 1:  # every recipient took its part
                    del self._deposits[(key, m)]
        for m, part in got.items():
            if tags[m] != tag:
                raise PeerFailed(f"all-to-all {key!r}: peer {m} sent tag {tags[m]}, this peer's is {tag}")
            if part.dtype != torch.uint8 or part.numel() != sizes[m]:
                raise PeerFailed(f"all-to-all {key!r}: peer {m} sent {part.numel()} {part.dtype} values, expected {sizes[m]} bytes")
        return got

    def _check_open(self, rank: int) -> None:
        if rank in self._closed:
            raise ExchangeClosed(f"rank {rank}: exchange is closed")
        if rank in self._failed:
            raise ExchangeClosed(f"rank {rank}: this peer was marked failed")

    def _close(self, rank: int) -> None:
        with self._cond:
            self._closed.add(rank)
            self._cond.notify_all()


class MemoryExchange(Exchange):
    """``Exchange`` over a ``MemoryHub``: the virtual swarm's transport."""

    def __init__(self, hub: MemoryHub, rank: int):
        self.hub = hub
        self.rank = rank
        self.bytes_sent = 0
        self.bytes_received = 0
        self._lock = threading.Lock()

    def members(self, round_index: int | None = None) -> list[int]:
        return self.hub.alive()

    def group(self, key: str, round_index: int) -> list[int]:
        """Everyone alive, or this peer's bucket of them when the hub splits exchanges (every view is the same here)."""
        alive = self.hub.alive()
        if self.hub.group_size is None:
            return alive
        return groups.group_of(self.hub.seed, key, alive, self.rank, self.hub.group_size)

    def all_reduce_mean(self, key: str, flat: torch.Tensor, members: Sequence[int], *,
                        inplace: bool = False) -> torch.Tensor:
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not among members {list(members)}")
        if len(members) == 1:
            return flat.to(torch.float32).clone()
        result = self.hub._all_reduce_mean(self.rank, key, flat, members)
        # What a bandwidth-optimal ring moves per peer: 2 (M - 1) / M of the payload each way.
        n = len(members)
        moved = 2 * (n - 1) * flat.numel() * flat.element_size() // n
        self._count(moved, moved)
        return result

    def swap(self, key: str, partner: int, flat: torch.Tensor) -> torch.Tensor:
        if partner == self.rank:
            raise ValueError("cannot swap with oneself")
        result = self.hub._swap(self.rank, key, partner, flat)
        self._count(flat.numel() * flat.element_size(), result.numel() * result.element_size())
        return result

    def all_to_all(self, key: str, parts: Mapping[int, torch.Tensor], members: Sequence[int],
                   sizes: Mapping[int, int], tag: int = 0) -> dict[int, torch.Tensor]:
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not among members {list(members)}")
        got = self.hub._all_to_all(self.rank, key, parts, members, sizes, tag)
        self._count(sum(p.numel() for m, p in parts.items() if m != self.rank), sum(p.numel() for p in got.values()))
        return got

    def _count(self, sent: int, received: int) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def close(self) -> None:
        self.hub._close(self.rank)
