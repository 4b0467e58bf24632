"""Who this peer is and whom it lets in: the one object the data plane asks (``Trust``).

A connection to peer ``q``'s ROUTER is a CurveZMQ client whose handshake proves it holds the
secret key of the public key it presents. ``q``'s ZAP handler (``gossiploco.transport.zmq_auth``)
lets it in only if that key is a member's: a rank's key of a static list (derived from the swarm
key), or a key taken from a peer's DHT record, which only swarm-key holders can write
(``gossiploco.membership.record_validator``), and whose id is ``peer_id_of(key)``. The handler gives the
connection the user id ``<peer>``, and the receiver refuses any message whose claimed sender (in
its header and in the connection's routing id ``"<peer>.<incarnation>"``) differs from it. A
client knows the server's key before it connects (from the same record, or derived), so nobody
can impersonate a server either.
"""

from __future__ import annotations

from dataclasses import dataclass

from gossiploco.security.identity import Identity
from gossiploco.security.swarm_key import OPEN_KEY, SwarmKey

MAX_ROUTING_ID = 64
"""Longest routing id a peer makes; longer ones are refused."""


MAX_STRIPES = 16
"""Most data connections one peer opens to another (``routing_id``'s ``stripe``)."""


def routing_id(peer: int, incarnation: str, control: bool, stripe: int = 0, link: int = 0) -> bytes:
    """``b"<peer>.<incarnation>"`` for a data connection (``/d<stripe>`` appended for the second and later of
    several data connections to one peer), plus ``b"/control"`` for a control one. ``link`` > 0: the number of the
    link made on demand (``transport.zmq_links``), as ``~<link>`` after the incarnation: a link made again is a new
    connection to the other end's ROUTER, not a takeover of the last one, whose messages not yet read there would
    then arrive under a routing id of libzmq's own and be refused."""
    if not 0 <= stripe < MAX_STRIPES or (control and stripe) or link < 0:
        raise ValueError(f"a data connection's stripe is in 0..{MAX_STRIPES - 1} (control: 0), got {stripe}; "
                         f"a link number is at least 0, got {link}")
    suffix = "/control" if control else f"/d{stripe}" if stripe else ""
    return f"{peer}.{incarnation}{f'~{link}' if link else ''}{suffix}".encode()


def parse_routing_id(identity: bytes) -> tuple[int, bytes, bool] | None:
    """(peer, incarnation, is control) of a routing id made by ``routing_id`` (its link number dropped); None for
    anything else."""
    if len(identity) > MAX_ROUTING_ID:
        return None
    control = identity.endswith(b"/control")
    body = identity.removesuffix(b"/control")
    if not control:
        body, slash, stripe = body.partition(b"/d")
        if slash and not (stripe.isdigit() and not stripe.startswith(b"0") and int(stripe) < MAX_STRIPES):
            return None
    head, dot, incarnation = body.partition(b".")
    incarnation, tilde, link = incarnation.partition(b"~")
    if tilde and not (link.isdigit() and not link.startswith(b"0")):
        return None
    if not dot or not head.isdigit() or not incarnation.isalnum():
        return None
    return int(head), incarnation, control


@dataclass(frozen=True)
class Trust:
    """This peer's ``identity`` and the run's ``swarm`` key (None: an open run). ``static_keys``: the
    Curve25519 public key of each rank of a static peer list (None when peers come from the DHT)."""

    identity: Identity
    swarm: SwarmKey | None
    static_keys: tuple[bytes, ...] | None = None

    @classmethod
    def static(cls, swarm: SwarmKey | None, rank: int, count: int) -> Trust:
        """Rank ``rank`` of a static list of ``count`` peers: every rank's identity is derived from the swarm key."""
        key = swarm or OPEN_KEY
        return cls(key.static_identity(rank), swarm, tuple(key.static_identity(r).curve_public for r in range(count)))

    @property
    def open(self) -> bool:
        return self.swarm is None

    @property
    def peer_id(self) -> int:
        """This peer's id: its rank in a static list, else derived from its key."""
        if self.static_keys is not None:
            return self.static_keys.index(self.identity.curve_public)
        return self.identity.peer_id

    def key_of(self, peer: int) -> bytes | None:
        """The public key peer ``peer`` must present, where it is known without asking (static lists)."""
        if self.static_keys is not None and 0 <= peer < len(self.static_keys):
            return self.static_keys[peer]
        return None
