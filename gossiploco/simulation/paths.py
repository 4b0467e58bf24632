"""How a simulated connection reaches the other peer: its path, and the relays that carry some of them.

A peer is *reachable* (others can dial it) or behind NAT. The connection of a pair takes the
runtime's path for the pair (``gossiploco.reach.paths.pair_path``, its worse direction):

    direct    both are reachable: an ordinary dial
    reverse   only one is reachable: it asks the NAT'd one, through a rendezvous, to dial it;
              one more latency to set up, then one connection carries both ways
    relayed   neither is reachable: the connection goes through a relay, a reachable third party
              with its own id space (r0, r1, ...); up only while the relay runs, two hops of
              latency, the relay's bandwidth on top of the link's, and reset by the relay once it
              has carried ``data_limit`` bytes or been up ``time_limit_s`` seconds (when set)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gossiploco.reach.paths import DIRECT, RELAYED, REVERSE, pair_path

__all__ = ["DIRECT", "PATHS", "RELAYED", "REVERSE", "SETUP_LATENCIES", "Connection", "Relays", "pair_path"]

PATHS = (DIRECT, REVERSE, RELAYED)

SETUP_LATENCIES = {DIRECT: 2, REVERSE: 3, RELAYED: 4}
"""Latencies a connection of each path takes to come up: a handshake, plus the rendezvous, or through the relay."""


@dataclass(eq=False)
class Connection:
    """One live connection between two peers; what is in flight on it is lost with it."""

    path: str
    relay: int | None = None
    """The relay it goes through (relayed only)."""
    carried: int = 0
    """Bytes the relay has carried on it."""
    announced: bool = False
    """Whether it came up (its ends were told); one that drops before that fails silently, like a dial."""


@dataclass
class Relays:
    """The relay nodes ``0 .. count - 1``, which of them are down, and what each relayed connection may use."""

    count: int = 0
    bandwidth_bps: float = 1e8
    data_limit: int | None = None
    """Bytes after which the relay resets a connection (None: no limit)."""
    time_limit_s: float | None = None
    """Seconds after which the relay resets a connection (None: no limit)."""
    down: set[int] = field(default_factory=set)

    def pick(self) -> int | None:
        """The relay a new relayed connection goes through: the lowest id that runs (None: none runs)."""
        return next((relay for relay in range(self.count) if relay not in self.down), None)

    def over_data_limit(self, connection: Connection, nbytes: int) -> bool:
        """Whether carrying ``nbytes`` more would take ``connection`` past the data limit."""
        return self.data_limit is not None and connection.carried + nbytes > self.data_limit

    def transit_s(self, nbytes: int, latency_s: float) -> float:
        """The relay's share of a message's delay: its hop's latency and its bandwidth."""
        return latency_s + nbytes / self.bandwidth_bps
