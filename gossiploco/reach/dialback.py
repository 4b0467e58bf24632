"""Can the others reach this peer's data port? A dial-back by a node already in the swarm.

The asking peer opens a temporary TCP listener on its data port and asks a checker (a bootstrap
node, or any peer: every gossiploco DHT node serves ``DIALBACK_PROTOCOL`` on its libp2p daemon)
over a libp2p stream. The checker dials back **only the address it sees the request come from**
(the AutoNAT rule: it never becomes a port scanner for someone else's machine) on the asked port,
within ``DIAL_S``, and reads the 16-byte nonce the listener sends: reaching the listener proves
the port reaches *this* process, not another machine behind the same public address. It answers
with the outcome, the address it saw, and its wall clock (for the clock-skew check of ``doctor``).

Wire format (msgpack, each message one length-prefixed frame, ``reach.framing``): request
``{"port": int, "nonce": bytes(16)}`` (at most ``MAX_REQUEST_BYTES``: a longer length prefix is refused
before its body is read), answer ``{"outcome": str, "reachable": bool, "ip": str, "detail": str,
"time": float}``. ``outcome`` is ``REACHED`` or ``UNREACHED`` (the checker dialled: a verdict) or
``REFUSED`` (it did not dial: busy, too many requests from the asker, a malformed or relayed request:
no verdict). ``reachable`` repeats it as a bool for askers of the first version (which read only that).

Bounds on the checker (``DialbackService``), against a stranger who opens streams: at most
``MAX_PER_SOURCE`` requests in flight per remote libp2p peer id and per source address (an IPv6
address counts by its /64, what one host usually holds), ``MAX_IN_FLIGHT`` in all, and
``MAX_CONCURRENT_CHECKS`` dial-backs at once; a request beyond them is answered ``REFUSED`` at once
(nothing read), counted by cause (``DialbackStats``) and logged (rate-limited: a flood does not flood
the log). Each request lives at most ``DIAL_S`` to arrive plus two ``DIAL_S`` of dialling.

The asking side is ``gossiploco.reach.reachability``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

log = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "/gossiploco/dialback/1"
DIAL_S = 3.0
"""How long the checker tries to connect to the asked port, and then to read the nonce."""
NONCE_BYTES = 16
MAX_REQUEST_BYTES = 256
MAX_ANSWER_BYTES = 4096
"""What an asker reads of an answer at most."""
MAX_CONCURRENT_CHECKS = 16
"""Dial-backs one checker runs at once; more requests are refused as "busy" (bounded work per node)."""
MAX_PER_SOURCE = 2
"""Requests in flight (read, dialled, answered) from one libp2p peer id, and from one source address."""
MAX_IN_FLIGHT = 64
"""Requests in flight in all (those still arriving included)."""
LINGER_S = 1.0
LINGER_BYTES = 4096
"""After its answer the checker reads and drops at most this much, for at most ``LINGER_S``, until the
asker closes its side (``_linger``)."""
LOG_EVERY_S = 10.0
"""A checker logs a refusal's cause at once the first time, then at most this often (with the count)."""

REACHED, UNREACHED, REFUSED = "reached", "unreached", "refused"
"""A checker's answer: it dialled and reached the port; it dialled and did not; it did not dial."""


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


def source_address(ip: str) -> str:
    """What counts as one source: an IPv4 address, or an IPv6 address's /64 (one host's usual share)."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


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


class SourceLimits:
    """Admission of requests in flight: at most ``per_source`` for any one key (a peer id, a source
    address) and ``total`` in all. Not thread-safe: the checker's handlers share one event loop."""

    def __init__(self, per_source: int = MAX_PER_SOURCE, total: int = MAX_IN_FLIGHT):
        self.per_source, self.total = per_source, total
        self.in_flight: Counter[str] = Counter()
        self.count = 0

    def admit(self, keys: Sequence[str]) -> str | None:
        """Take a slot for a request from ``keys`` and return None, or return why not (nothing taken)."""
        if self.count >= self.total:
            return f"checker busy ({self.count} requests in flight)"
        for key in keys:
            if self.in_flight[key] >= self.per_source:
                return f"too many requests from {key} ({self.in_flight[key]} in flight, at most {self.per_source})"
        self.count += 1
        for key in keys:
            self.in_flight[key] += 1
        return None

    def release(self, keys: Sequence[str]) -> None:
        """Give back the slot ``admit(keys)`` took."""
        self.count -= 1
        for key in keys:
            self.in_flight[key] -= 1
            if self.in_flight[key] <= 0:
                del self.in_flight[key]


@dataclass
class DialbackStats:
    """A checker's counters (each DHT process has its own: ``dialback_stats``)."""

    requests: int = 0
    reached: int = 0
    unreached: int = 0
    refused: Counter = field(default_factory=Counter)
    """Refused requests by cause: busy, per source, malformed, relayed."""
    gone: int = 0
    """Askers that closed their stream before the answer was sent."""

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "reached": self.reached, "unreached": self.unreached,
                "refused": dict(self.refused), "gone": self.gone}


class DialbackService:
    """The checker's handler: requests admitted by ``SourceLimits``, at most ``max_checks`` dialling at once."""

    def __init__(self, *, per_source: int = MAX_PER_SOURCE, in_flight: int = MAX_IN_FLIGHT,
                 max_checks: int = MAX_CONCURRENT_CHECKS, dial_s: float = DIAL_S):
        self.limits = SourceLimits(per_source, in_flight)
        self.max_checks, self.dial_s = max_checks, dial_s
        self.running = 0
        self.stats = DialbackStats()
        self._logged: dict[str, tuple[float, int]] = {}  # cause: (when last logged, refusals since)

    def _refused(self, cause: str, detail: str) -> dict[str, Any]:
        self.stats.refused[cause] += 1
        last, since = self._logged.get(cause, (-LOG_EVERY_S, 0))
        now = time.monotonic()
        if now - last >= LOG_EVERY_S:
            log.warning("dial-back: refused a request (%s: %s)%s", cause, detail,
                        f"; {since} more refused for this cause since the last report" if since else "")
            self._logged[cause] = (now, 0)
        else:
            self._logged[cause] = (last, since + 1)
        return {"outcome": REFUSED, "detail": detail}

    async def answer(self, info: Any, reader: asyncio.StreamReader) -> dict[str, Any]:
        """The answer to one request arriving on ``reader`` from ``info`` (a p2pd ``StreamInfo``)."""
        from gossiploco.reach.framing import receive_frame

        self.stats.requests += 1
        ip = observed_ip(info.addr)
        if ip is None:
            return self._refused("relayed", f"the request came over {info.addr}, not a direct connection: "
                                            "cannot dial back")
        keys = (f"peer {info.peer_id}", f"address {source_address(ip)}")
        why = self.limits.admit(keys)
        if why is not None:
            return self._refused("busy" if why.startswith("checker busy") else "per source", why)
        try:
            try:
                port, nonce = parse_request(await asyncio.wait_for(receive_frame(reader, MAX_REQUEST_BYTES),
                                                                   self.dial_s))
            except Exception as exc:  # noqa: BLE001 - a bad request gets an answer saying why, never a crash
                return self._refused("malformed", f"bad request: {type(exc).__name__}: {exc}"[:200])
            if self.running >= self.max_checks:
                return self._refused("busy", f"checker busy ({self.running} dial-backs running)")
            self.running += 1
            try:
                reached, detail = await dial_and_read(ip, port, nonce, self.dial_s)
            finally:
                self.running -= 1
            if reached:
                self.stats.reached += 1
            else:
                self.stats.unreached += 1
            return {"outcome": REACHED if reached else UNREACHED, "ip": ip, "detail": detail}
        finally:
            self.limits.release(keys)

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from gossiploco.reach.framing import send_frame

        try:
            answer = await self.answer(info, reader)
            await send_frame(msgpack.packb({"reachable": answer["outcome"] == REACHED, "ip": "", **answer,
                                            "time": time.time()}), writer)
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            self.stats.gone += 1  # it closed its stream before the answer: nothing to tell it
        except Exception:  # noqa: BLE001 - a bug here must not take the DHT node's handler down: logged
            log.exception("dial-back: answering %s failed", info.peer_id)
        finally:
            await _linger(reader)
            writer.close()


async def _linger(reader: asyncio.StreamReader) -> None:
    """Wait (``LINGER_S``, ``LINGER_BYTES`` at most) for the asker to close its side, discarding what comes.
    Closing first, with its request unread (a refusal answers before reading), makes p2pd reset the stream,
    and the reset can overtake the answer."""
    deadline = time.monotonic() + LINGER_S
    taken = 0
    try:
        while taken <= LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
            data = await asyncio.wait_for(reader.read(LINGER_BYTES), left)
            if not data:
                return
            taken += len(data)
    except (asyncio.TimeoutError, OSError, ConnectionError):
        pass


SERVICE: DialbackService | None = None
"""This process's checker (``serve_dialback``), for ``dialback_stats``."""


async def serve_dialback(_dht: Any, node: Any) -> None:
    """Run in a DHT node's process (``dht.run_coroutine(serve_dialback)``): answer dial-back requests."""
    global SERVICE
    SERVICE = DialbackService()
    await node.p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, SERVICE.handle)


async def dialback_stats(_dht: Any, _node: Any) -> dict[str, Any]:
    """``dht.run_coroutine(dialback_stats)``: the checker's counters in that DHT process ({} if it serves none)."""
    return SERVICE.stats.as_dict() if SERVICE is not None else {}
