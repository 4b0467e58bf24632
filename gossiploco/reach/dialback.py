"""Can the others reach this peer's data port? A dial-back by a node already in the swarm.

The asking peer opens a temporary TCP listener on its data port and asks a checker (the bootstrap
node, or any peer: every gossiploco DHT node serves ``DIALBACK_PROTOCOL`` on its libp2p daemon)
over a libp2p stream. The checker dials back **only the address it sees the request come from**
(the AutoNAT rule: it never becomes a port scanner for someone else's machine) on the asked port,
within ``DIAL_S``, and reads the 16-byte nonce the listener sends: reaching the listener proves
the port reaches *this* process, not another machine behind the same public address. It answers
with the outcome, the address it saw, and its wall clock (for the clock-skew check of ``doctor``).

Wire format (msgpack, each message length-prefixed by hivemind's ``P2P.send_raw_data``):
request ``{"port": int, "nonce": bytes(16)}`` (at most ``MAX_REQUEST_BYTES``), answer
``{"reachable": bool, "ip": str, "detail": str, "time": float}``. Anything else is refused.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

log = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "/gossiploco/dialback/1"
DIAL_S = 3.0
"""How long the checker tries to connect to the asked port and read the nonce."""
NONCE_BYTES = 16
MAX_REQUEST_BYTES = 256
MAX_CONCURRENT_CHECKS = 16
"""Dial-backs one checker runs at once; more requests are answered "busy" (bounded work per node)."""


@dataclass(frozen=True)
class Reachability:
    """The outcome of a dial-back check."""

    reachable: bool | None
    """True: the checker reached our port; False: it could not; None: nobody could check."""
    address: str | None
    """``tcp://IP:PORT`` as others reach this peer, when reachable."""
    observed_ip: str | None
    """The address the checker saw the request come from (our public address behind a NAT)."""
    detail: str
    checker: str | None
    """The libp2p peer id of the node that checked."""
    clock_skew_s: float | None
    """The checker's wall clock minus ours (corrected by half the round trip)."""
    rtt_s: float | None


def describe(r: Reachability) -> str:
    """One line for the user."""
    if r.reachable:
        return f"reachable at {r.address}"
    if r.reachable is False:
        return "behind NAT: using reverse connections and relays"
    return f"reachability unknown ({r.detail}): assuming behind NAT, using reverse connections and relays"


# -- the checker (runs in a DHT node's process) ------------------------------------------------------


def observed_ip(maddr: Any) -> str | None:
    """The IP address of a libp2p connection's remote multiaddr, or None (a relayed connection, DNS)."""
    text = str(maddr)
    if "p2p-circuit" in text:
        return None
    parts = text.split("/")
    for proto in ("ip4", "ip6"):
        if proto in parts and parts.index(proto) + 1 < len(parts):
            return parts[parts.index(proto) + 1]
    return None


def parse_request(raw: bytes) -> tuple[int, bytes]:
    """``(port, nonce)`` from a request; ``ValueError`` for anything else."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {len(raw)} bytes")
    obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    if not isinstance(obj, dict) or set(obj) != {"port", "nonce"}:
        raise ValueError("request must be a map of port and nonce")
    port, nonce = obj["port"], obj["nonce"]
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"bad port {port!r}")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ValueError("bad nonce")
    return port, nonce


async def dial_and_read(ip: str, port: int, nonce: bytes, timeout_s: float = DIAL_S) -> tuple[bool, str]:
    """Connect to ``ip:port`` and read the nonce: (reached, why)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
    except asyncio.TimeoutError:
        return False, f"no answer from {ip}:{port} within {timeout_s:g} s (a NAT or firewall drops it)"
    except OSError as exc:
        return False, f"connecting to {ip}:{port} failed: {exc.strerror or exc}"
    try:
        got = await asyncio.wait_for(reader.readexactly(NONCE_BYTES), timeout_s)
        if got != nonce:
            return False, f"{ip}:{port} answers, but it is not this peer (another machine behind that address?)"
        return True, f"dialed {ip}:{port}"
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError):
        return False, f"{ip}:{port} accepted but did not send the check's nonce"
    finally:
        writer.close()


class DialbackService:
    """The checker's handler state: a bound on concurrent checks."""

    def __init__(self) -> None:
        self.running = 0

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from hivemind.p2p import P2P

        answer: dict[str, Any] = {"reachable": False, "ip": "", "detail": "", "time": 0.0}
        try:
            port, nonce = parse_request(await asyncio.wait_for(P2P.receive_raw_data(reader), DIAL_S))
            ip = observed_ip(info.addr)
            if ip is None:
                answer["detail"] = f"the request came over {info.addr}, not a direct connection: cannot dial back"
            elif self.running >= MAX_CONCURRENT_CHECKS:
                answer["detail"] = "checker busy"
            else:
                self.running += 1
                try:
                    answer["reachable"], answer["detail"] = await dial_and_read(ip, port, nonce)
                finally:
                    self.running -= 1
                answer["ip"] = ip
        except Exception as exc:  # noqa: BLE001 - a bad request gets an answer saying why, never a crash
            answer["detail"] = f"bad request: {type(exc).__name__}: {exc}"[:200]
        answer["time"] = time.time()
        try:
            await P2P.send_raw_data(msgpack.packb(answer), writer)
        finally:
            writer.close()


async def serve_dialback(_dht: Any, node: Any) -> None:
    """Run in a DHT node's process (``dht.run_coroutine(serve_dialback)``): answer dial-back requests."""
    await node.p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, DialbackService().handle)


# -- the asking side -----------------------------------------------------------------------------


class NonceListener:
    """A temporary TCP listener on the data port that sends ``nonce`` to whoever connects."""

    def __init__(self, host: str, port: int, nonce: bytes):
        self.nonce = nonce
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dialback-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.sendall(self.nonce)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def peer_ids_of(join: Sequence[str]) -> list[str]:
    """The ``/p2p/<id>`` of each bootstrap multiaddr, in order, without repeats."""
    ids: list[str] = []
    for address in join:
        if "/p2p/" in address:
            pid = address.rsplit("/p2p/", 1)[1].strip("/")
            if pid and pid not in ids:
                ids.append(pid)
    return ids


async def _ask(join: Sequence[str], port: int, nonce: bytes, timeout_s: float) -> Reachability:
    from hivemind.p2p import P2P, PeerID

    p2p = await P2P.create(initial_peers=list(join), host_maddrs=["/ip4/0.0.0.0/tcp/0"], dht_mode="client",
                           auto_nat=False, nat_port_map=False, startup_timeout=timeout_s)
    details = []
    try:
        for pid in peer_ids_of(join):
            try:
                sent = time.time()
                _, reader, writer = await asyncio.wait_for(
                    p2p.call_binary_stream_handler(PeerID.from_base58(pid), DIALBACK_PROTOCOL), timeout_s)
                try:
                    await P2P.send_raw_data(msgpack.packb({"port": port, "nonce": nonce}), writer)
                    raw = await asyncio.wait_for(P2P.receive_raw_data(reader), DIAL_S + timeout_s)
                finally:
                    writer.close()
                now = time.time()
                answer = msgpack.unpackb(raw[:4096], raw=False)
                if not isinstance(answer, dict) or not isinstance(answer.get("reachable"), bool):
                    details.append(f"{pid[-8:]}: malformed answer")
                    continue
                ip = answer.get("ip") if isinstance(answer.get("ip"), str) else None
                ip = ip if ip and _is_ip(ip) else None
                when = answer.get("time")
                skew = (float(when) - (sent + now) / 2) if isinstance(when, (int, float)) else None
                reachable = answer["reachable"] and ip is not None
                return Reachability(reachable=reachable, address=f"tcp://{ip}:{port}" if reachable else None,
                                    observed_ip=ip, detail=str(answer.get("detail", ""))[:200], checker=pid,
                                    clock_skew_s=skew, rtt_s=now - sent)
            except Exception as exc:  # noqa: BLE001 - try the next checker; say why at the end
                details.append(f"{pid[-8:]}: {type(exc).__name__}: {exc}"[:160])
        return Reachability(None, None, None, "; ".join(details) or "no bootstrap address with a /p2p/ id", None,
                            None, None)
    finally:
        await p2p.shutdown()


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def check_reachability(join: Sequence[str], port: int, *, timeout_s: float, host: str = "0.0.0.0") -> Reachability:
    """Ask the nodes at ``join`` (bootstrap multiaddrs with ``/p2p/<id>``), in order, to dial back
    ``port`` (on which a temporary listener runs meanwhile: nothing else may hold it). Bounded by
    about ``2 * timeout_s + DIAL_S``. Never raises for network trouble: ``reachable=None`` says why."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        listener = NonceListener(host, port, nonce)
    except OSError as exc:
        return Reachability(None, None, None, f"cannot listen on {host}:{port}: {exc.strerror or exc}", None, None,
                            None)
    try:
        return asyncio.run(asyncio.wait_for(_ask(join, listener.port, nonce, timeout_s), 2 * timeout_s + DIAL_S + 5))
    except Exception as exc:  # noqa: BLE001 - the daemon did not start, or the whole check timed out
        return Reachability(None, None, None, f"{type(exc).__name__}: {exc}"[:200], None, None, None)
    finally:
        listener.close()
