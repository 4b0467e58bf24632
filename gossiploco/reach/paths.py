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

This module holds the rules (``path_between``, ``pair_path``, ``path_class``) and ``PathControl``, what a
carrier offers whoever chooses the paths: connect a peer by a path, say which connections are up, be told
who is behind NAT, offer and dial reverse connections. ``ZmqExchange`` implements it over sockets,
``MemoryPaths`` in memory (its twin, for unit tests of the choosing). The choosing itself, from the
peers' records, is ``gossiploco.runtime.path_planner``: every pair's path is logged once when chosen
and again when it changes, and counted.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass

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


def path_class(ring: Sequence[int], behind_nat: Collection[int]) -> str:
    """The class of path an exchange over ``ring`` takes, for its deadline (``AdaptiveDeadlines``):
    ``"relayed"`` when two neighbours of ``ring`` (a swap's pair, or a ring in its order) are both
    behind NAT, so their hop goes through a relay; else ``""`` (direct and reverse are alike)."""
    n = len(ring)
    return RELAYED if n > 1 and any(ring[i] in behind_nat and ring[(i + 1) % n] in behind_nat for i in range(n)) else ""


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




class PathControl(ABC):
    """What a carrier offers path selection (``runtime.path_planner``): every method is thread-safe and
    returns at once (a connection comes up later, in the background)."""

    @abstractmethod
    def add_peer(self, peer: int, endpoint: str, key: bytes | None = None, *, listen: bool = False,
                 relayed: bool = False, joined: int | None = None) -> bool:
        """Connect to ``peer`` at ``endpoint`` (``key``: its public key, for an authenticated carrier).
        ``listen``: a reverse connection (``peer`` is behind NAT): listen on ports of this peer's host
        for it to dial (``reverse_offers``) instead of dialing. ``relayed``: ``endpoint`` is a tunnel
        through a relay. ``joined``: the join round its record says (``PeerRecord.joined``). A known peer at a
        new endpoint or on a new path is reconnected. Returns True if anything changed."""

    @abstractmethod
    def forget_peer(self, peer: int) -> bool:
        """``peer`` is gone for good (its record left the directory): unless its connection is up, close it and
        drop what is kept of it (``add_peer`` connects it anew should it come back). True if it was forgotten."""

    @abstractmethod
    def connected(self) -> list[int]:
        """Other peers with a live connection right now."""

    @abstractmethod
    def set_behind_nat(self, peers: set[int], order_rings: bool = True) -> None:
        """The peers behind NAT: rings this peer leads keep them apart (``agreement.ring_order``;
        ``order_rings=False``: by id), and exchanges between two of them get relayed deadlines (``path_class``)."""

    @abstractmethod
    def reverse_offers(self) -> tuple[tuple[int, int, int], ...]:
        """``(peer, data port, control port)`` of every reverse connection this peer listens for, sorted."""

    @abstractmethod
    def dial_reverse(self, peer: int, endpoints: Sequence[str]) -> bool:
        """This peer is behind NAT and ``peer`` offers it a reverse connection: dial ``endpoints``
        (none: stop), replacing what was dialed for ``peer`` before. False when that is dialed already."""


class MemoryPaths(PathControl):
    """``PathControl`` in memory, for unit tests of path selection: it remembers what it was asked
    (``added``, ``dialed``, ``behind_nat``); listening for a peer allocates two made-up ports; a test
    says which connections are up (``up``)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.added: dict[int, tuple[str, bool, bool]] = {}
        """peer -> (endpoint, listen, relayed) of its connection."""
        self.dialed: dict[int, tuple[str, ...]] = {}
        self.joined: dict[int, int | None] = {}
        """peer -> the join round its latest record said."""
        self.behind_nat: set[int] = set()
        self.order_rings = True
        self.up: set[int] = set()
        """Peers whose connection is up (set by the test)."""
        self._offers: dict[int, tuple[int, int]] = {}
        self._next_port = 40000
        self._lock = threading.Lock()

    def add_peer(self, peer: int, endpoint: str, key: bytes | None = None, *, listen: bool = False,
                 relayed: bool = False, joined: int | None = None) -> bool:
        with self._lock:
            if peer != self.rank:
                self.joined[peer] = joined
            if peer == self.rank or self.added.get(peer, (None, None))[:2] == (endpoint, listen):
                return False
            self.added[peer] = (endpoint, listen, relayed)
            if listen:
                self._offers[peer] = (self._next_port, self._next_port + 1)
                self._next_port += 2
            else:
                self._offers.pop(peer, None)
            return True

    def forget_peer(self, peer: int) -> bool:
        with self._lock:
            if peer not in self.added or peer in self.up:
                return False
            del self.added[peer]
            self._offers.pop(peer, None)
            self.dialed.pop(peer, None)
            return True

    def connected(self) -> list[int]:
        with self._lock:
            return sorted(self.up)

    def set_behind_nat(self, peers: set[int], order_rings: bool = True) -> None:
        with self._lock:
            self.behind_nat, self.order_rings = set(peers), order_rings

    def reverse_offers(self) -> tuple[tuple[int, int, int], ...]:
        with self._lock:
            return tuple(sorted((peer, *ports) for peer, ports in self._offers.items()))

    def dial_reverse(self, peer: int, endpoints: Sequence[str]) -> bool:
        with self._lock:
            if self.dialed.get(peer, ()) == tuple(endpoints):
                return False
            self.dialed[peer] = tuple(endpoints)
            return True
