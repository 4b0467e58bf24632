"""An outsider's tools, for the attack suite (``bench/attacks.py``, ``tests/test_attacks.py``).

Everything here is what someone *without* the swarm key can do: open raw TCP connections, speak
ZMTP by hand, run a pyzmq socket with no (or a random) CurveZMQ key, run a hivemind DHT node with
no record validator, and look at a machine from outside (listening ports, memory of a process).
"""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from pathlib import Path

import zmq
import zmq.utils.z85

from gossiploco.protocol.messages import to_wire
from gossiploco.protocol import codec
from testbed.processes import descendants, process_table

ENV = {"OMP_NUM_THREADS": "1"}


# -- what a port scanner and `ps` would show ---------------------------------------------------------

_ANNOUNCED = re.compile(r"peer (\d+) at (tcp://[0-9.]+:\d+)")


def announced(log_text: str) -> tuple[int, str] | None:
    """(peer id, data-plane endpoint) from a peer's first log line, or None before it is written."""
    found = _ANNOUNCED.search(log_text)
    return (int(found.group(1)), found.group(2)) if found else None


def listening_ports(pid: int, tree: bool = True) -> set[int]:
    """TCP ports some process of ``pid``'s tree listens on (the data port, the sealed port, the DHT's p2pd port);
    ``tree=False``: ``pid`` itself only (a peer's data and sealed ports, not its DHT's)."""
    inodes = set()
    for p in [pid] + ([info.pid for info in descendants(process_table(), pid)] if tree else []):
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                target = os.readlink(f"/proc/{p}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # LISTEN
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def memory_kib(pid: int, field: str = "VmHWM") -> int:
    """``field`` (kB) of /proc/PID/status; 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# -- ZMTP and CurveZMQ by hand ------------------------------------------------------------------------


def wire(message, sender: int, run_id: str) -> list:
    """The codec frames of ``message`` claiming to come from ``sender`` (what a member would send)."""
    return codec.encode(*to_wire(message, sender, run_id))


def outsider_socket(ctx: zmq.Context, endpoint: str, routing_id: bytes | None = None, *,
                    server_key: bytes | None = None, hwm: int = 100_000) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to ``endpoint`` and its monitor: no CurveZMQ at all, or (``server_key``)
    CurveZMQ with a fresh random key pair, which is the most an outsider who somehow learnt the
    server's key can do."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if server_key is not None:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = zmq.utils.z85.encode(server_key)
        sock.curve_publickey, sock.curve_secretkey = public, secret
    monitor = sock.get_monitor_socket()
    monitor.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock, monitor


def close_outsider(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Close an ``outsider_socket`` and its monitor (explicitly: a garbage-collected one can leave its
    monitor's inproc address taken for the next socket that gets the same descriptor)."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    monitor.close(linger=0)
    sock.close(linger=0)


_EVENTS = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake succeeded", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused (auth)",
           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused (protocol)",
           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused (handshake failed)", zmq.EVENT_DISCONNECTED: "disconnected"}


def handshake_outcome(monitor: zmq.Socket, timeout_s: float = 5.0) -> str:
    """What the attacker's own socket saw of its first handshake: "handshake succeeded", "refused
    (...)", "disconnected" (the server hung up) or "no answer"."""
    from zmq.utils.monitor import recv_monitor_message

    deadline = time.monotonic() + timeout_s
    seen = "no answer"
    while time.monotonic() < deadline:
        if not monitor.poll(50):
            continue
        event = recv_monitor_message(monitor)["event"]
        if event in _EVENTS:
            seen = _EVENTS[event]
            if event != zmq.EVENT_DISCONNECTED:
                return seen
            deadline = min(deadline, time.monotonic() + 0.5)  # a reason may follow the hang-up
    return seen


def zmtp_null_greeting(routing_id: bytes) -> bytes:
    """A ZMTP 3.0 NULL-mechanism greeting and READY of a DEALER with ``routing_id``."""
    greet = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    props = (b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
             + b"\x08Identity" + struct.pack(">I", len(routing_id)) + routing_id)
    body = b"\x05READY" + props
    return greet + b"\x04" + bytes([len(body)]) + body


def zmtp_frame(data: bytes, more: bool) -> bytes:
    flags = 1 if more else 0
    if len(data) < 256:
        return bytes([flags, len(data)]) + data
    return bytes([flags | 2]) + struct.pack(">Q", len(data)) + data


def zmtp_raw_attack(host: str, port: int, routing_id: bytes, frames: int = 2000, size: int = 16,
                    send_s: float = 3.0) -> int:
    """A hand-written NULL ZMTP client: greeting, ``frames`` frames, then a reset (SO_LINGER 0).
    Returns the bytes the peer took before it closed the connection or ``send_s`` passed."""
    s = socket.create_connection((host, port), timeout=5)
    buf = bytearray(zmtp_null_greeting(routing_id))
    payload = b"x" * size
    for _ in range(frames):
        buf += zmtp_frame(payload, more=False)
    s.setblocking(False)
    view, off, t0 = memoryview(bytes(buf)), 0, time.monotonic()
    try:
        while off < len(view) and time.monotonic() - t0 < send_s:
            try:
                off += s.send(view[off:off + 65536])
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:  # reset by the peer: it dropped us
                break
    finally:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    return off


class IdleConnections:
    """``count`` TCP connections to ``host:port`` that send nothing (or, ``trickle``, one greeting byte
    now and then: slowloris). ``closed_by_peer()`` counts those the other side has closed."""

    def __init__(self, host: str, port: int, count: int, trickle: bool = False):
        self.socks: list[socket.socket] = []
        self.failed = 0
        for _ in range(count):
            try:
                s = socket.create_connection((host, port), timeout=5)
                s.setblocking(False)
                self.socks.append(s)
            except OSError:
                self.failed += 1
        self.trickle = trickle
        self.sent = 0

    def poke(self) -> None:
        """Slowloris: one more byte of a greeting on every open connection."""
        greet = zmtp_null_greeting(b"x")
        for s in self.socks:
            try:
                s.send(greet[self.sent % len(greet):self.sent % len(greet) + 1])
            except OSError:
                pass
        self.sent += 1

    def closed_by_peer(self) -> int:
        closed = 0
        for s in self.socks:
            try:
                if s.recv(4096) == b"":
                    closed += 1
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return closed

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []


# -- an outsider's DHT node ---------------------------------------------------------------------------


def outsider_dht(initial_peer: str):
    """A plain hivemind DHT node (no record validator: it stores anything) joined to ``initial_peer``."""
    import hivemind

    return hivemind.DHT(initial_peers=[initial_peer], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)


async def _local_items(_dht, node) -> list[tuple[str, object]]:
    """Every (key id, value) this node holds in its storage and cache (what it can "list")."""
    out = []
    for store in (node.protocol.storage, node.protocol.cache):
        for key_id, item in store.items():
            value = item.value
            if hasattr(value, "items"):  # a dictionary value: its subkeys' entries
                for subkey, sub in value.items():
                    out.append((f"{key_id}/{subkey!r}", sub.value))
            else:
                out.append((str(key_id), value))
    return out


def local_items(dht) -> list[tuple[str, object]]:
    return dht.run_coroutine(_local_items)


async def _poison(_dht, node, key: str, subkey, value, expiration: float) -> bool:
    from hivemind.dht.routing import DHTID
    from hivemind.utils.serializer import MSGPackSerializer

    key_id, packed = DHTID.generate(source=key), MSGPackSerializer.dumps(value)
    if subkey is None:
        return node.protocol.storage.store(key_id, packed, expiration)
    return node.protocol.storage.store_subkey(key_id, subkey, packed, expiration)


def poison(dht, key: str, value, expiration: float, subkey=None) -> bool:
    """Put (``key``, ``subkey``) = ``value`` straight into the outsider node's own storage, which it then
    serves to every search that reaches it (a malicious node, not just one that stores anything)."""
    from functools import partial

    return dht.run_coroutine(partial(_poison, key=key, subkey=subkey, value=value, expiration=expiration))


# -- a stranger with a signing identity (an open run admits anyone) ------------------------------------


def stranger_dht(initial_peer: str, identity):
    """A hivemind DHT node whose records are signed by ``identity`` (``gossiploco.security.identity.Identity``)
    as an open run's member's are (``SwarmRecordValidator`` without a swarm key): a throwaway identity."""
    import hivemind

    from gossiploco.membership.record_validator import SwarmRecordValidator

    return hivemind.DHT(initial_peers=[initial_peer], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                        record_validators=[SwarmRecordValidator(identity, None)])


async def _store_signed(_dht, node, keys: list[str], subkey: int, value, expiration: float) -> int:
    stored = await node.store_many(keys, [value] * len(keys), [expiration] * len(keys), subkeys=[subkey] * len(keys),
                                   exclude_self=True)
    return sum(bool(ok) for ok in stored.values())


def store_signed(dht, keys: list[str], subkey: int, value, expiration: float, timeout_s: float = 60.0) -> int:
    """Store ``value`` under each of ``keys`` (subkey ``subkey``: the identity's peer id) on the other nodes;
    how many keys some other node accepted. ``TimeoutError`` after ``timeout_s``."""
    from concurrent.futures import TimeoutError as FutureTimeout
    from functools import partial

    future = dht.run_coroutine(partial(_store_signed, keys=list(keys), subkey=subkey, value=value,
                                       expiration=expiration), return_future=True)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        future.cancel()
        raise TimeoutError(f"storing {len(keys)} records took more than {timeout_s:g} s") from None
