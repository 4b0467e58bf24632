"""When a running peer reads its run's records from the directory again (``runtime.peer_discovery``'s loop).

Every read returns every member's record (one DHT key, one subkey a member: ``dht_directory``), so reading every
``discovery_s`` costs a peer M records each time and the DHT nodes holding the key M x M every period: at 1,000
peers and 2 s, 500 records a second to each peer and half a million a second from the key's holders. A running
peer needs few reads: members it exchanges with reach it over their links, their news tells it who joined, and
the records' own expiry tells it who left. So reads are paced to at most ``records_per_s`` records a second on
average: every ``discovery_s`` while the run has up to ``records_per_s x discovery_s`` members (64 by default:
nothing changes for smaller swarms), every ``M / records_per_s`` seconds beyond (31 s at 1,000 peers).

What must not wait that long is a newcomer: its connections are refused until this peer has read its record (its
key is admitted from it, ``transport.zmq_auth``). So a refused key of no member (``knocks``) makes the next read
due ``discovery_s`` after the last one, as before. A stranger knocking all the time thus gets reads every
``discovery_s``, what every peer did before, never more. So does a peer behind NAT waiting for a reachable
member's offer of a reverse connection, which it learns from that member's record (``urgent``:
``PathPlanner.awaiting_offers``, for at most the reverse connection's wait).

Pure bookkeeping: times are given (``time.monotonic``), one thread.
"""

from __future__ import annotations


class ReadPacing:
    """See the module docstring. ``every_s``: ``timeouts.discovery_s``; ``records_per_s``:
    ``timeouts.discovery_records_per_s``."""

    def __init__(self, every_s: float, records_per_s: float):
        if every_s <= 0 or records_per_s <= 0:
            raise ValueError(f"every_s and records_per_s must be positive, got {every_s} and {records_per_s}")
        self.every_s, self.records_per_s = every_s, records_per_s
        self._last_read: float | None = None
        self._records = 0  # how many the last read returned
        self._knocks_seen = 0  # the refusals counter as of the last read
        self.reads = 0
        """Reads so far."""
        self.early_reads = 0
        """Reads made before ``interval_s`` had passed: a key of no member knocked, or an offer was awaited."""

    def interval_s(self, records: int) -> float:
        """Seconds between reads when the run has ``records`` members and nobody knocks."""
        return max(self.every_s, records / self.records_per_s)

    def due(self, now: float, knocks: int, urgent: bool = False) -> bool:
        """Whether to read now. ``knocks``: how many connections from keys of no member were refused so far (a
        counter that only grows); ``urgent``: something is awaited from the records (a reverse connection's offer)."""
        if self._last_read is None:
            return True
        waited = now - self._last_read
        if waited >= self.interval_s(self._records):
            return True
        return (urgent or knocks > self._knocks_seen) and waited >= self.every_s

    def read(self, now: float, records: int, knocks: int) -> None:
        """A read was made at ``now`` and returned ``records`` records; ``knocks`` as ``due`` was given."""
        if self._last_read is not None and now - self._last_read < self.interval_s(self._records):
            self.early_reads += 1
        self._last_read, self._records, self._knocks_seen = now, records, knocks
        self.reads += 1

    def counts(self) -> dict[str, int]:
        """What a peer's summary says of its reads: how many, and how many a knock or an awaited offer brought
        forward."""
        return {"reads": self.reads, "early": self.early_reads}
