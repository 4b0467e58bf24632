"""The ZAP handler of a peer's ROUTER: pyzmq's ``ThreadAuthenticator`` admitting members' keys.

libzmq asks the handler about every CurveZMQ client once its handshake has proved the client's
key. The handler lets in the keys it was told are members' (``allow``: a static list's ranks, or
keys from peers' signed DHT records, see ``gossiploco.security.trust``) with the user id
``<peer>``, which the receiver checks against every message's claimed sender, and refuses any
other key. A joining peer's connections are refused until this peer has read its record (its
zmq sockets retry every 100 ms, so they get in within one discovery period). Every refusal
is counted by reason and logged (at most one line per reason and ``LOG_EVERY_S``), so a peer under
attack says so without flooding its log.

The sealed port (``zmq_sealed``) has no keys to check at the handshake (ZeroMQ's NULL mechanism: its messages are
authenticated one by one with AES-GCM). Its connections are admitted by address instead: only from an address a
member's CurveZMQ connection came from (``SEALED_DOMAIN``), so a stranger elsewhere cannot even hold a connection
open there. A member dials the sealed port only after it received its key over CurveZMQ, from the same host.
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
SEALED_DOMAIN = "gossiploco-sealed"
"""The ZAP domain of the sealed port (``zmq_sealed``): NULL-mechanism connections, admitted by address."""
LOG_EVERY_S = 10.0
EXPECTED_REFUSALS = 8
MAX_MEMBER_ADDRESSES = 4096
"""Addresses remembered as members' (the newest kept): those the sealed port admits."""
SEALED_REFUSAL = "sealed port: address of no member"
STRANGER_REFUSAL = "key of no member"
"""A CurveZMQ key this peer has not admitted: a stranger, another run, or a member whose record it has not read yet
(``membership.read_pacing`` reads the directory sooner when one knocks)."""


class SwarmAuthenticator(ThreadAuthenticator):
    """Admits the keys given to ``allow`` (and this peer's own); ``refused`` counts the others."""

    def __init__(self, context: zmq.Context, trust: Trust, owner: str):
        super().__init__(context, log=logging.getLogger(f"{__name__}.zap"))
        self.owner = owner
        self.refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._members: dict[bytes, int] = {trust.identity.curve_public: trust.peer_id}
        self._own = trust.peer_id
        self._addresses: dict[str, None] = {}  # where members' CurveZMQ connections came from, oldest first
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

    def revoke(self, peer: int) -> None:
        """Let ``peer``'s key in no more (it left the run and was forgotten; ``allow`` admits it again should it
        come back). Never this peer's own key."""
        with self._lock:
            for key in [k for k, p in self._members.items() if p == peer and p != self._own]:
                del self._members[key]

    def admitted(self, peer: int) -> bool:
        """Whether a key of ``peer``'s is let in now."""
        with self._lock:
            return peer in self._members.values()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        """The sealed port's NULL connections: admitted from members' addresses only. CurveZMQ ones: as pyzmq
        does (``callback``), remembering the address of each member's."""
        if len(msg) >= 6 and msg[5] == b"NULL" and msg[2] == SEALED_DOMAIN.encode():
            address = msg[3].decode("utf-8", "replace")
            with self._lock:
                admitted = address in self._addresses
                if not admitted:
                    self.refused[SEALED_REFUSAL] += 1
            if not admitted:
                self._log_refusal(SEALED_REFUSAL, address)
            self._send_zap_reply(msg[1], b"200" if admitted else b"400", b"OK" if admitted else b"address of no member")
            return
        if len(msg) >= 7 and msg[5] == b"CURVE":
            address = msg[3].decode("utf-8", "replace")
            with self._lock:
                if msg[6] in self._members:
                    self._addresses.pop(address, None)
                    self._addresses[address] = None
                    while len(self._addresses) > MAX_MEMBER_ADDRESSES:
                        del self._addresses[next(iter(self._addresses))]
        await super().handle_zap_message(msg)

    def _log_refusal(self, reason: str, who: str) -> None:
        with self._lock:
            count = self.refused[reason]
            now = time.monotonic()
            due = now - self._last_log >= LOG_EVERY_S
            if due:
                self._last_log = now
        if due:
            log.log(logging.WARNING if count > EXPECTED_REFUSALS else logging.INFO,
                    "%s: refused a connection (%s, from %s; %d so far)", self.owner, reason, who, count)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        key = zmq.utils.z85.decode(z85_key)
        with self._lock:
            if key in self._members:
                return True
            self.refused[STRANGER_REFUSAL] += 1
            count = self.refused[STRANGER_REFUSAL]
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
