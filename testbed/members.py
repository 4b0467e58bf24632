"""Members of a run as bare DHT nodes: what a relay sees of a peer, without the peer.

A ``MemberNode`` is one real hivemind DHT node with the run's record validator (sealed records in a
private run, signed ones in an open run), whose ``PeerRecord`` (behind NAT, naming its DHT node's libp2p
id and its relays) is in the run's DHT, and which can serve a tunnel to a local port: exactly what
``gossiploco.reach.relay`` checks before it splices a stream to or from a peer behind NAT. For the tests
of relays and tunnels (``tests/test_exchange.py``, ``tests/test_relay.py``) and ``bench/attacks_relay.py``.
"""

from __future__ import annotations

from functools import partial

from gossiploco.membership.dht_directory import dht_key
from gossiploco.membership.dht_entries import DhtEntries, dht_time
from gossiploco.membership.dht_node import start_dht, visible_maddrs
from gossiploco.membership.record import PeerRecord
from gossiploco.membership.record_validator import SwarmRecordValidator
from gossiploco.security.identity import Identity
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust

LISTEN = ["/ip4/127.0.0.1/tcp/0"]
RECORD_TTL_S = 600.0


def relay_node(swarm: SwarmKey | None, *, open_run: bool = False, relay_limits: tuple[float, float] | None = None):
    """A reachable DHT node that relays (a bootstrap node's DHT: it stores and validates, it signs nothing)."""
    validator = SwarmRecordValidator(None, swarm) if swarm is not None or open_run else None
    return start_dht(initial_peers=[], host_maddrs=LISTEN, announce_maddrs=None, timeout_s=30,
                     record_validator=validator, relay_limits=relay_limits)


class MemberNode:
    """A member of run ``run`` of ``swarm`` (None: an open run) behind NAT, reached through ``relay``.
    ``publish``: store its record (False: a node of the swarm that never announced itself)."""

    def __init__(self, swarm: SwarmKey | None, run: str, relay: str, *, publish: bool = True):
        self.swarm, self.run = swarm, run
        self.identity = Identity.generate()
        self.trust = Trust(self.identity, swarm)
        self.dht = start_dht(initial_peers=[relay], host_maddrs=LISTEN, announce_maddrs=None, timeout_s=30,
                             record_validator=SwarmRecordValidator(self.identity, swarm), behind_nat=True,
                             relays=[relay], run=run)
        self.p2p = self.dht.peer_id.to_base58()
        self.entries = DhtEntries(self.dht, run_id=run, timeout_s=10.0, trust=self.trust)
        self.record = PeerRecord(self.trust.peer_id, "tcp://127.0.0.1:9", 0, 0, key=self.identity.curve_public,
                                 reachable=False, p2p=self.p2p, relays=(relay,))
        if publish:
            self.publish()

    @property
    def dht_address(self) -> str:
        """This node's own multiaddr (with ``/p2p/``), as a stranger on the same network could dial it."""
        return visible_maddrs(self.dht, 10)[0]

    def publish(self) -> None:
        key = self.swarm.dht_key(self.run) if self.swarm is not None else dht_key(self.run)
        stored = self.entries.store_each([(key, self.record.peer, self.record.to_wire())], dht_time() + RECORD_TTL_S)
        assert stored == [True], "the member's record was not stored"

    def serve_tunnel(self, port: int) -> None:
        """Carry the relayed streams that reach this node to ``127.0.0.1:port``."""
        from gossiploco.reach.tunnel import serve_tunnel

        self.dht.run_coroutine(partial(serve_tunnel, router_host="127.0.0.1", router_port=port))

    def open_tunnel(self, target: MemberNode, relay: str) -> int:
        """A local port whose connections are carried to ``target``'s tunnel through ``relay``."""
        from gossiploco.reach.tunnel import open_tunnel

        return self.dht.run_coroutine(partial(open_tunnel, peer_id=target.p2p, relays=[relay]))

    def shutdown(self) -> None:
        self.dht.shutdown()


def relay_address(node) -> str:
    """The first multiaddr (with ``/p2p/``) of a relay node."""
    return visible_maddrs(node, 10)[0]
