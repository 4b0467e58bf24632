"""Choosing each pair's path from the peers' records, and connecting by it (see ``gossiploco.reach.paths``).

Each time discovery reads the run's records (``PeerRecord``), ``PathPlanner.sync`` connects this
peer to every other by the path their reachability gives (``path_between``): ``direct``, ``reverse``
(this peer listens on ports it offers in its record, the NAT'd peer dials them) or ``relayed``
(a libp2p tunnel through the other's relay, ``reach.tunnel``), falling back from a reverse connection
that did not come up within ``REVERSE_WAIT_S`` to the relay. It drives the carrier through
``PathControl`` only, so ``MemoryPaths`` stands in for the sockets in its unit tests.
Every pair's path is logged once when chosen and again when it changes, and counted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from gossiploco.membership.record import PeerRecord
from gossiploco.reach.paths import DIRECT, RELAYED, REVERSE, REVERSE_WAIT_S, PathControl, Reach, path_between

log = logging.getLogger(__name__)

FORGET_AFTER_S = 30.0
"""A peer is forgotten once its record has been missing from every read for this long (longer than a record's time
to live, ``timeouts.announce_ttl_s``): a read that missed a record for a moment (records still spreading at the
start, a DHT node that did not answer) forgets nobody."""


class PathPlanner:
    """Connects this peer to each member by the member's path; see the module docstring.

    ``exchange``: the carrier (``PathControl``: the ``ZmqExchange``, or ``MemoryPaths`` in a test);
    ``run_in_node(fn)``: runs ``fn(dht, node)`` in this peer's DHT process and returns its result
    (None: no DHT, so no relayed path). Not thread-safe: one thread (discovery's) calls ``sync``.
    """

    def __init__(self, rank: int, reach: Reach, exchange: PathControl, run_in_node: Callable[[Any], Any] | None,
                 topology_ring: bool = True, reverse_wait_s: float = REVERSE_WAIT_S,
                 clock: Callable[[], float] = time.monotonic, forget_after_s: float = FORGET_AFTER_S):
        self.rank, self.reach, self.exchange, self.run_in_node = rank, reach, exchange, run_in_node
        self.reverse_wait_s, self.clock = reverse_wait_s, clock
        self._reverse_since: dict[int, float] = {}  # peer -> when its reverse connection was offered; -1: it came up
        self._offer_awaited: dict[int, float] = {}  # behind NAT: reachable peer -> since when no offer of it was read
        self.fell_back: set[int] = set()
        """Peers whose reverse connection never came up: relayed instead."""
        self.topology_ring = topology_ring
        """Tell the exchange who is behind NAT, so that rings keep them apart (``agreement.ring_order``)."""
        self.paths: dict[int, str] = {}
        self.counts: Counter[str] = Counter()
        """Paths chosen (including changes), by kind."""
        self.unconnectable: set[int] = set()
        self._tunnels: dict[int, tuple[str, tuple[str, ...], int]] = {}  # peer -> (its p2p id, its relays, local port)
        self.published: tuple[tuple[int, int, int], ...] = ()
        self.forget_after_s = forget_after_s
        self._missing_since: dict[int, float] = {}  # peer -> when a read first missed its record (cleared when seen)
        self.forgotten = 0
        """Peers forgotten so far (``_forget_gone``)."""

    def sync(self, records: dict[int, PeerRecord]) -> tuple[tuple[int, int, int], ...] | None:
        """Connect to every other peer of ``records`` by its path. Returns this peer's reverse offers
        when they changed since last published (the caller puts them in its record), else None."""
        for peer, record in sorted(records.items()):
            if peer == self.rank:
                continue
            path = self._fallback(peer, path_between(self.reach.reachable, record.reachable))
            endpoint = self._tunnel(peer, record) if path == RELAYED else record.endpoint
            if endpoint is None:
                continue
            self.exchange.add_peer(peer, endpoint, record.key or None, listen=path == REVERSE, relayed=path == RELAYED,
                                   joined=record.joined)
            if self.paths.get(peer) != path:
                self.counts[path] += 1
                log.info("rank %d: path to peer %d: %s (%s)", self.rank, peer, path, _why(path, record))
                self.paths[peer] = path
            if path == DIRECT and not self.reach.reachable:
                self._dial_offer(peer, record)
                if record.reverse_for(self.rank) is None:
                    self._offer_awaited.setdefault(peer, self.clock())
                else:
                    self._offer_awaited.pop(peer, None)
        self._forget_gone(records)
        self.exchange.set_behind_nat({peer for peer, record in records.items() if not record.reachable},
                                     order_rings=self.topology_ring)
        offers = self.exchange.reverse_offers()
        if offers != self.published:
            self.published = offers
            return offers
        return None

    def awaiting_offers(self) -> bool:
        """Behind NAT: whether a reachable member's offer of a reverse connection is awaited (not in its record at the
        last read), for at most ``reverse_wait_s`` since it was first awaited (then that member relays
        to this peer instead): the records are worth reading again soon (``membership.read_pacing``)."""
        now = self.clock()
        return any(now - since < self.reverse_wait_s for since in self._offer_awaited.values())

    def _forget_gone(self, records: dict[int, PeerRecord]) -> None:
        """Forget the peers this planner connected whose record has been gone for ``forget_after_s`` (a tombstone: it
        left; or it expired: it died) and whose connection is down, tunnel included: what a peer keeps stays bounded
        by the peers of the run now, not by every peer that ever came and went. One that is still connected is kept;
        it is forgotten at a later read if it is gone by then. One that comes back is connected anew."""
        self.unconnectable &= set(records)
        now = self.clock()
        for peer in [p for p in self._missing_since if p in records]:
            del self._missing_since[peer]
        for peer in sorted(set(self.paths) - set(records)):
            if now - self._missing_since.setdefault(peer, now) < self.forget_after_s:
                continue
            if not self.exchange.forget_peer(peer):
                continue
            del self._missing_since[peer]
            path = self.paths.pop(peer)
            self._reverse_since.pop(peer, None)
            self._offer_awaited.pop(peer, None)
            self.fell_back.discard(peer)
            tunnel = self._tunnels.pop(peer, None)
            if tunnel is not None and self.run_in_node is not None:
                from gossiploco.reach.tunnel import close_tunnel

                self.run_in_node(partial(close_tunnel, peer_id=tunnel[0]))
            self.forgotten += 1
            log.info("rank %d: peer %d is gone (no record, no connection): forgot it and its %s path", self.rank,
                     peer, path)

    def _fallback(self, peer: int, path: str) -> str:
        """``path``, or relayed for a reverse connection that has not come up in ``reverse_wait_s``."""
        if path != REVERSE:
            return path
        if peer in self.fell_back:
            return RELAYED
        since = self._reverse_since.setdefault(peer, self.clock())
        if since < 0 or peer in self.exchange.connected():
            self._reverse_since[peer] = -1.0  # it came up once: it works (a later drop is a fault, not a path)
            return path
        if self.clock() - since < self.reverse_wait_s:
            return path
        self.fell_back.add(peer)
        log.warning("rank %d: peer %d did not dial its reverse connection within %.0f s (are this peer's "
                    "ephemeral ports closed, e.g. only --port forwarded?); relaying to it instead",
                    self.rank, peer, self.reverse_wait_s)
        return RELAYED

    def _dial_offer(self, peer: int, record: PeerRecord) -> None:
        """``peer`` is reachable and this peer is not: dial the ports it offers this peer (if any yet;
        none any more: stop dialing)."""
        ports = record.reverse_for(self.rank) or ()
        endpoints = tuple(f"tcp://{record.host}:{port}" for port in ports)
        if self.exchange.dial_reverse(peer, endpoints) and endpoints:
            log.info("rank %d: dialing peer %d's reverse connection at %s", self.rank, peer, ", ".join(endpoints))

    def _tunnel(self, peer: int, record: PeerRecord) -> str | None:
        """The local endpoint that carries connections to ``peer`` through its relays (None: not possible now)."""
        if self.run_in_node is None or not record.p2p or not record.relays:
            if peer not in self.unconnectable:
                self.unconnectable.add(peer)
                log.error("rank %d: peer %d and this peer are both behind NAT and %s: no path between them (is "
                          "a relay configured: --relay, or a reachable bootstrap node?)", self.rank, peer,
                          "this peer has no DHT node of its own (none, or a shared one)" if self.run_in_node is None
                          else "it offers no relay")
            return None
        self.unconnectable.discard(peer)
        known = self._tunnels.get(peer)
        if known is None or known[:2] != (record.p2p, record.relays):
            from gossiploco.reach.tunnel import open_tunnel

            port = self.run_in_node(partial(open_tunnel, peer_id=record.p2p, relays=list(record.relays)))
            known = (record.p2p, record.relays, int(port))
            self._tunnels[peer] = known
        return f"tcp://127.0.0.1:{known[2]}"

    def summary(self) -> dict:
        """The paths in use, for the peer's summary."""
        in_use = Counter(self.paths.values())
        return {"reachable": self.reach.reachable, "paths": dict(in_use), "path_changes": dict(self.counts),
                "reverse_fell_back": sorted(self.fell_back),
                "unconnectable": sorted(self.unconnectable), "forgotten": self.forgotten,
                "per_peer": {str(p): k for p, k in sorted(self.paths.items())}}


def _why(path: str, record: PeerRecord) -> str:
    if path == DIRECT:
        return f"dialing {record.endpoint}"
    if path == REVERSE:
        return "it is behind NAT: it dials this peer's offered ports"
    return f"both behind NAT: libp2p stream through {', '.join(r.rsplit('/p2p/', 1)[0] for r in record.relays)}"
