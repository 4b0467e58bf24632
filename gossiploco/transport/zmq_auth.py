"""The ZAP handler of a peer's ROUTER: pyzmq's ``ThreadAuthenticator`` admitting members' keys.

libzmq asks the handler about every CurveZMQ client once its handshake has proved the client's
key. The handler lets in the keys it was told are members' (``allow``: a static list's ranks, or
keys from peers' signed DHT records, see ``gossiploco.security.trust``) with the user id
``<peer>``, which the receiver checks against every message's claimed sender, and refuses any
other key. A joining peer's connections are refused until this peer has read its record (its
zmq sockets retry every 100 ms, so they get in within one discovery period). Every refusal
is counted by reason and logged (at most one line per reason and ``LOG_EVERY_S``), so a peer under
attack says so without flooding its log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import zmq
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from gossiploco.security.trust import Trust

log = logging.getLogger(__name__)

DOMAIN = "gossiploco"
LOG_EVERY_S = 10.0
EXPECTED_REFUSALS = 8


class SwarmAuthenticator(ThreadAuthenticator):
    """Admits the keys given to ``allow`` (and this peer's own); ``refused`` counts the others."""

    def __init__(self, context: zmq.Context, trust: Trust, owner: str):
        super().__init__(context, log=logging.getLogger(f"{__name__}.zap"))
        self.owner = owner
        self.refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._members: dict[bytes, int] = {trust.identity.curve_public: trust.peer_id}
        self._last_log = -LOG_EVERY_S
        self.configure_curve_callback(domain=DOMAIN, credentials_provider=self)

    def refusals(self) -> dict[str, int]:
        """A copy of ``refused`` (the ZAP thread updates it)."""
        with self._lock:
            return dict(self.refused)

    def allow(self, key: bytes, peer: int) -> None:
        """Let the holder of ``key`` in as peer ``peer`` (a key replaces any earlier one of the same peer)."""
        with self._lock:
            for old in [k for k, p in self._members.items() if p == peer and k != key]:
                del self._members[old]
            self._members[key] = peer

    def callback(self, domain: str, z85_key: bytes) -> bool:
        key = zmq.utils.z85.decode(z85_key)
        with self._lock:
            if key in self._members:
                return True
            self.refused["key of no member"] += 1
            count = self.refused["key of no member"]
            now = time.monotonic()
            if now - self._last_log >= LOG_EVERY_S:
                self._last_log = now
                # A joining member's first tries are refused until its record is read: expected, so
                # only repeated refusals are warnings.
                log.log(logging.WARNING if count > EXPECTED_REFUSALS else logging.INFO,"%s: refused a connection from a key of no member (%s...; %d refused so far): a "
                            "stranger, another run, or a member whose record this peer has not read yet",
                            self.owner, z85_key[:8].decode(errors="replace"), count)
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        with self._lock:
            return str(self._members.get(client_public_key, -1))


def secure_server(router: zmq.Socket, trust: Trust) -> None:
    """Make ``router`` a CurveZMQ server that needs the ZAP handler's yes (no handler: nobody gets in)."""
    router.setsockopt(zmq.CURVE_SERVER, 1)
    router.setsockopt(zmq.CURVE_SECRETKEY, trust.identity.curve_secret)
    router.setsockopt(zmq.CURVE_PUBLICKEY, trust.identity.curve_public)
    router.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
    router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def secure_client(sock: zmq.Socket, trust: Trust, server_key: bytes) -> None:
    """Make ``sock`` a CurveZMQ client of the server whose public key is ``server_key``."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, trust.identity.curve_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, trust.identity.curve_public)
