"""Which path each pair of peers takes, chosen from their records, and connecting by it.

A message from peer A to peer B needs a connection that reaches B's ROUTER:

* ``direct``: B is reachable; A's DEALERs dial B's endpoint.
* ``reverse``: B is behind NAT and A is reachable; A's DEALERs *listen* on two ports of A's host and
  offer them to B in A's record (``PeerRecord.reverse``); B's ROUTER dials them. One TCP
  connection, opened from behind B's NAT, then carries A's messages to B (ZeroMQ and CurveZMQ roles
  do not depend on who dialed, so authentication is unchanged).
* ``relayed``: neither is reachable; A's DEALERs dial a local port of A's DHT process, which carries
  each connection as a libp2p stream through one of B's relays to B's ROUTER (``reach.tunnel``).
  Also the fallback of a reverse connection that does not come up within ``REVERSE_WAIT_S`` (A is
  reachable on its data port only, e.g. one forwarded port, so B cannot dial the offered ports).
  hivemind's p2pd has no hole punching (``p2pd -h`` offers no such option), so this is the only
  path between two peers behind NAT.

Every pair's path is logged once when chosen and again when it changes, and counted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from gossiploco.membership.record import PeerRecord

log = logging.getLogger(__name__)

DIRECT, REVERSE, RELAYED = "direct", "reverse", "relayed"
REVERSE_WAIT_S = 20.0
"""How long a reverse connection may take to come up (the NAT'd peer must first read our record)
before this peer relays to that peer instead."""


def path_between(sender_reachable: bool, receiver_reachable: bool) -> str:
    """The path of messages from a sender to a receiver (see the module docstring)."""
    if receiver_reachable:
        return DIRECT
    return REVERSE if sender_reachable else RELAYED


def pair_path(a_reachable: bool, b_reachable: bool) -> str:
    """The path of a pair as a whole: its worst direction."""
    directions = {path_between(a_reachable, b_reachable), path_between(b_reachable, a_reachable)}
    return RELAYED if RELAYED in directions else REVERSE if REVERSE in directions else DIRECT


@dataclass(frozen=True)
class Reach:
    """This peer's reachability, as it publishes it."""

    reachable: bool = True
    relays: tuple[str, ...] = ()
    """Relays (multiaddrs with ``/p2p/``) it keeps connected to, through which others reach it (behind NAT)."""
    p2p: str = ""
    """The libp2p peer id of its DHT node."""
    verified: bool = False
    """A dial-back from another node proved ``reachable`` (else it is declared or assumed)."""


class PathPlanner:
    """Connects this peer to each member by the member's path; see the module docstring.

    ``exchange``: the ``ZmqExchange``; ``run_in_node(fn)``: runs ``fn(dht, node)`` in this peer's DHT
    process and returns its result (None: no DHT, so no relayed path).
    """

    def __init__(self, rank: int, reach: Reach, exchange: Any, run_in_node: Callable[[Any], Any] | None,
                 topology_ring: bool = True, reverse_wait_s: float = REVERSE_WAIT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.rank, self.reach, self.exchange, self.run_in_node = rank, reach, exchange, run_in_node
        self.reverse_wait_s, self.clock = reverse_wait_s, clock
        self._reverse_since: dict[int, float] = {}  # peer -> when its reverse connection was offered; -1: it came up
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
            self.exchange.add_peer(peer, endpoint, record.key or None, listen=path == REVERSE, relayed=path == RELAYED)
            if self.paths.get(peer) != path:
                self.counts[path] += 1
                log.info("rank %d: path to peer %d: %s (%s)", self.rank, peer, path, _why(path, record))
                self.paths[peer] = path
            if path == DIRECT and not self.reach.reachable:
                self._dial_offer(peer, record)
        self.exchange.set_behind_nat({peer for peer, record in records.items() if not record.reachable},
                                     order_rings=self.topology_ring)
        offers = self.exchange.reverse_offers()
        if offers != self.published:
            self.published = offers
            return offers
        return None

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
                          "this peer has no DHT node" if self.run_in_node is None else "it offers no relay")
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
                "unconnectable": sorted(self.unconnectable), "per_peer": {str(p): k for p, k in sorted(self.paths.items())}}


def _why(path: str, record: PeerRecord) -> str:
    if path == DIRECT:
        return f"dialing {record.endpoint}"
    if path == REVERSE:
        return "it is behind NAT: it dials this peer's offered ports"
    return f"both behind NAT: libp2p stream through {', '.join(r.rsplit('/p2p/', 1)[0] for r in record.relays)}"
