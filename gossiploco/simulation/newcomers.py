"""Brand-new peers in the simulator: an id nobody has seen joins the running swarm (``Fault`` kind ``newcomer``).

A restart keeps its id, which every other peer already has in its view; a volunteer who pastes the bootstrap
address brings an id nobody knows. The runtime's members learn of it only from the run's directory: its record
(``PeerRecord``) is published when it starts, and each member admits its key once it has read that record
(``transport.zmq_auth``), its connections refused until then. A refused key makes that member's next read due
soon (``membership.read_pacing``: within ``timeouts.discovery_s``). So here:

* a newcomer reads the directory at its start: it knows every peer whose record is there (``SimSwarm.records``
  over links on demand, the static list in a full mesh, as a restart does);
* each member finds the newcomer's record at a time drawn uniformly within ``Settings.discovery_s`` of its start
  (a knocked read), then adds it as the runtime's discovery does (``PeerNode.add_peer`` with the record's join round
  over links on demand) and, while its record says it has not decided, reads it again at the runtime's paced
  interval (``ReadPacing``);
* until a member has found it, no connection between the two comes up (``admits``: the refused handshake; the
  newcomer's side retries as ZeroMQ does, or over links on demand gives up after the handshake's deadline);
* a member that starts (a restart) after the newcomer reads the directory then, and knows it from the start.

Pure bookkeeping; ``SimSwarm`` applies it.
"""

from __future__ import annotations


class Newcomers:
    """Which running peers have not yet found which newcomer's record."""

    def __init__(self) -> None:
        self._unfound: dict[int, set[int]] = {}
        """newcomer -> the peers that have not read its record yet."""

    def arrived(self, newcomer: int, others: list[int]) -> None:
        """``newcomer`` started (its record is published); ``others``: every peer of the swarm but it."""
        self._unfound[newcomer] = set(others) - {newcomer}

    def found(self, peer: int, newcomer: int) -> bool:
        """``peer`` read ``newcomer``'s record; False if it had found it already (a restart read the directory)."""
        unfound = self._unfound.get(newcomer)
        if unfound is None or peer not in unfound:
            return False
        unfound.discard(peer)
        return True

    def read_directory(self, peer: int) -> None:
        """``peer`` starts and reads every record: it has found every newcomer that started before."""
        for unfound in self._unfound.values():
            unfound.discard(peer)

    def admits(self, a: int, b: int) -> bool:
        """Whether a connection between ``a`` and ``b`` can come up: neither is a newcomer the other has not found."""
        return a not in self._unfound.get(b, ()) and b not in self._unfound.get(a, ())
