"""One DHT node for several peers on one machine: a local socket in front of a hivemind DHT node.

A volunteer with eight GPUs runs eight peers; a local swarm (``gossiploco swarm``) runs dozens. Each peer
starting its own DHT node means a DHT process and a ``p2pd`` per peer: at 32 peers on two cores they starved
each other (DHT reads timing out, records unpublished for minutes). Here one node serves them all.

``NodeService`` (in the process that owns the node: ``gossiploco swarm``'s bootstrap, ``gossiploco dht
--local-peers``) answers requests on a ZeroMQ ``ipc://`` socket inside a directory only its user can enter
(mode 0700). ``membership.shared_node_client.NodeClient`` (in each peer) is what ``DhtEntries`` needs of a hivemind
``DHT`` handle: ``store``/``get`` returning futures, ``is_alive``, ``shutdown``.

Records stay signed by their own peer. The client signs each entry itself (``record_validator.presign``:
the same envelope the peer's own node would have made, over the same key, subkey, value and expiration)
and the node stores the envelope as it is (``SwarmRecordValidator.sign_value`` passes a valid one through):
no peer's key leaves its process, and a client can store only entries it signed, under its own subkey.

Reads of one key coalesce: while one is in flight the others wait for it, and its value answers reads for
``REUSE_S`` after (until a store through the node changes the key).
Requests and replies are msgpack maps: ``{"id", "op": "info"|"store"|"get", ...}`` and ``{"id", "ok",
"result"|"error"}``. A request over ``MAX_REQUEST_BYTES`` is dropped by libzmq; a malformed one, or one over
``MAX_IN_FLIGHT`` pending for its client, is answered with an error and counted (``refused``); each store or
get waits at most its request's deadline (capped at ``MAX_DEADLINE_S``). Nothing a client sends can stop the
service: it stops with ``close()``.

What a shared node does not give its peers: code run in the node (``DhtDirectory.run_in_node`` is None), so a
peer behind NAT on a shared node is reached by reverse connections only, never through a relay.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import msgpack
import zmq

from gossiploco.errors import ConfigError
from gossiploco.membership.zmq_waker import Waker

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256 << 10
"""A request stores a few signed entries (each at most ``record_validator.MAX_ENVELOPE_BYTES``)."""
MAX_REPLY_BYTES = 64 << 20
"""A reply carries one key's entries: a few hundred bytes per peer of the run."""
MAX_ITEMS = 16
"""Entries one store request may carry (a peer stores 3 per heartbeat)."""
MAX_IN_FLIGHT = 32
"""Requests one client may have pending at the node."""
MAX_DEADLINE_S = 60.0
REUSE_S = 1.0
"""How long a key's value read for one peer answers the others' reads of it (a store through the node drops it):
N peers reading the same records every few seconds cost the node one search per key and second, not N."""
MAX_KEYS_KEPT = 256
IDLE_POLL_MS = 1000
"""The service's poll is woken by clients' requests and by finished node requests (``Waker``); this only bounds how
long a ``close`` could go unnoticed if its wake-up were lost."""
ANSWER_SLACK_S = 2.0
"""A client gives a request up this long after the deadline it gave the node for it."""

SOCKET_NAME = "dht.sock"
MAX_SOCKET_PATH = 107


def unpack_message(data: bytes, max_bytes: int) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=max_bytes, max_str_len=max_bytes,
                           max_array_len=max(MAX_ITEMS, 1 << 16), max_map_len=1 << 16)


def _wire_value(found: Any) -> Any:
    """hivemind's ``ValueWithExpiration`` of a key as msgpack-able data (dictionary values entry by entry)."""
    if found is None:
        return None
    value = found.value
    if isinstance(value, dict):
        entries = [[subkey, getattr(item, "value", None), getattr(item, "expiration_time", None)]
                   for subkey, item in value.items()]
        return {"entries": entries, "expiration": found.expiration_time}
    return {"value": value, "expiration": found.expiration_time}


def value_from_wire(data: Any) -> Any:
    """The client's copy of ``_wire_value``'s input (hivemind's ``ValueWithExpiration``s)."""
    from hivemind.utils import ValueWithExpiration

    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("expiration"), (int, float)):
        raise ValueError("not a DHT value")
    if "entries" in data:
        entries = data["entries"]
        if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) == 3 for e in entries):
            raise ValueError("not a dictionary of entries")
        return ValueWithExpiration({subkey: ValueWithExpiration(value, expiration)
                                    for subkey, value, expiration in entries}, data["expiration"])
    return ValueWithExpiration(data.get("value"), data["expiration"])


class NodeService:
    """Serve ``dht`` (a started hivemind ``DHT``) to the peers of this machine until ``close()``.

    ``lock``: held around every request to ``dht`` (its pipe is not thread-safe), shared with any other user
    of the handle in this process. ``directory``: where the socket lives (default: a new private temporary
    directory, removed at ``close``); it must be a directory only this user can enter. ``signed_only``: see
    the attribute.
    """

    def __init__(self, dht: Any, *, lock: threading.Lock | None = None, directory: str | None = None,
                 signed_only: bool = True):
        self.dht = dht
        self.signed_only = signed_only
        """Store only values that are envelopes their peer signed (``record_validator.presign``); False only for a
        node without a record validator (tests of the mechanics)."""
        self.lock = lock or threading.Lock()
        self._own_directory = directory is None
        if directory is not None:
            path = os.path.join(os.path.abspath(directory), SOCKET_NAME)
            if len(path.encode()) > MAX_SOCKET_PATH:  # the kernel's limit on a Unix socket's path (sun_path)
                raise ConfigError("--local-peers", f"the socket path {path} is {len(path.encode())} bytes long; "
                                                   f"Unix sockets allow {MAX_SOCKET_PATH}: choose a shorter directory")
            os.makedirs(directory, mode=0o700, exist_ok=True)
            os.chmod(directory, 0o700)
        self.directory = tempfile.mkdtemp(prefix="gossiploco-dht-") if directory is None else directory
        self.address = f"ipc://{os.path.join(os.path.abspath(self.directory), SOCKET_NAME)}"
        self.served: Counter[str] = Counter()
        """Requests answered, by operation."""
        self.refused: Counter[str] = Counter()
        """Requests refused, by reason (each reason logged once)."""
        self._info = {"pid": os.getpid(), "maddrs": [], "p2p": ""}
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (client, reply) or (None, (key, reply)): node answers
        self._pending: Counter[bytes] = Counter()  # requests in flight per client (service thread only)
        self._reading: dict[str, list[tuple[bytes, Any]]] = {}  # key -> (client, request id) waiting for its read
        self._read: dict[str, tuple[float, dict]] = {}  # key -> (when, reply without id): recent reads
        self._stored_while_read: set[str] = set()  # keys stored through the node while a read of them was in flight
        self._stop = threading.Event()
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._socket.bind(self.address)
        self._waker = Waker(self._context, "dht-service")  # a finished node request wakes the service thread
        os.chmod(os.path.join(self.directory, SOCKET_NAME), 0o600)
        self._thread = threading.Thread(target=self._serve, name="dht-node-service", daemon=True)
        self._thread.start()

    def describe(self, maddrs: list[str], p2p: str) -> None:
        """What ``info`` tells clients: the node's multiaddrs and libp2p id."""
        self._info = {"pid": os.getpid(), "maddrs": list(maddrs), "p2p": p2p}

    def _refuse(self, client: bytes, request_id: Any, reason: str, detail: str = "") -> None:
        self.refused[reason] += 1
        if self.refused[reason] == 1:
            log.warning("shared DHT node: refused a request: %s%s (further ones are only counted)", reason,
                        f" ({detail})" if detail else "")
        self._send(client, {"id": request_id, "ok": False, "error": f"{reason}{': ' + detail if detail else ''}"})

    def _send(self, client: bytes, reply: dict) -> None:
        try:
            self._socket.send_multipart([client, msgpack.packb(reply, use_bin_type=True)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client left, or its queue is full: it times out on its own deadline
            log.debug("shared DHT node: a reply was not sent: %s", exc)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(IDLE_POLL_MS))
                if self._waker.socket in ready:
                    self._waker.drain()
                if self._socket in ready:
                    while True:
                        try:
                            frames = self._socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(frames)
                while True:
                    try:
                        client, reply = self._done.get_nowait()
                    except queue.Empty:
                        break
                    if client is not None:
                        self._answer(client, reply)
                        continue
                    key, reply = reply
                    if reply["ok"] and key not in self._stored_while_read:  # else it may miss the store: not reused
                        if len(self._read) >= MAX_KEYS_KEPT:  # keys are the clients' choice: keep a bounded few
                            self._read.clear()
                        self._read[key] = (time.monotonic(), reply)
                    self._stored_while_read.discard(key)
                    for client, request_id in self._reading.pop(key, []):
                        self._answer(client, {**reply, "id": request_id})
        except Exception:  # noqa: BLE001 - said loudly: the peers of this machine lose their DHT
            log.exception("shared DHT node: the service thread died; the peers using it can no longer reach the DHT")
        finally:
            self._socket.close(0)
            self._waker.close_pull()

    def _answer(self, client: bytes, reply: dict) -> None:
        """Send the answer to a request that was in flight."""
        self._pending[client] -= 1
        if self._pending[client] <= 0:
            del self._pending[client]
        self._send(client, reply)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.refused["malformed"] += 1
            return
        client, payload = frames
        try:
            request = unpack_message(payload, MAX_REQUEST_BYTES)
        except (ValueError, msgpack.UnpackException) as exc:
            self._refuse(client, None, "malformed", type(exc).__name__)
            return
        if not isinstance(request, dict):
            self._refuse(client, None, "malformed", "not a map")
            return
        request_id, op = request.get("id"), request.get("op")
        if op == "info":
            self.served[op] += 1
            self._send(client, {"id": request_id, "ok": True, "result": self._info})
            return
        if self._pending[client] >= MAX_IN_FLIGHT:
            self._refuse(client, request_id, "busy", f"{MAX_IN_FLIGHT} requests of this client in flight")
            return
        deadline = request.get("timeout_s")
        if not isinstance(deadline, (int, float)) or not 0 < deadline <= MAX_DEADLINE_S:
            deadline = MAX_DEADLINE_S
        try:
            if op == "store":
                futures = self._store(request.get("items"))
                for item in request["items"]:
                    self._read.pop(item[0], None)
                    if item[0] in self._reading:
                        self._stored_while_read.add(item[0])
            elif op == "get":
                key = request.get("key")
                if not isinstance(key, str) or len(key) > 1024:
                    raise ValueError("key: a string of at most 1024 characters")
                recent = self._read.get(key)
                if recent is not None and time.monotonic() - recent[0] < REUSE_S:
                    self.served["get (reused)"] += 1
                    self._send(client, {**recent[1], "id": request_id})
                    return
                if key in self._reading:
                    self.served["get (joined)"] += 1
                    self._pending[client] += 1
                    self._reading[key].append((client, request_id))
                    return
                with self.lock:
                    futures = [self.dht.get(key, latest=True, return_future=True)]
                self._reading[key] = [(client, request_id)]
            else:
                raise ValueError(f"unknown operation {op!r}")
        except ValueError as exc:
            self._refuse(client, request_id, "malformed", str(exc)[:200])
            return
        except Exception as exc:  # noqa: BLE001 - a dead node's pipe: the client is told
            self._send(client, {"id": request_id, "ok": False, "error": f"the DHT node failed: {type(exc).__name__}"})
            return
        self.served[op] += 1
        self._pending[client] += 1
        tag = request_id if op == "store" else request["key"]
        threading.Thread(target=self._await, args=(client, tag, op, futures, deadline),
                         name="dht-node-request", daemon=True).start()

    def _store(self, items: Any) -> list:
        if not isinstance(items, list) or not 0 < len(items) <= MAX_ITEMS:
            raise ValueError(f"items: a list of 1..{MAX_ITEMS} entries")
        for item in items:
            if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and len(item[0]) <= 1024
                    and isinstance(item[1], int) and not isinstance(item[1], bool)
                    and isinstance(item[3], (int, float))):
                raise ValueError("an entry: [key, subkey (int), value, expiration]")
            if self.signed_only and not isinstance(item[2], bytes):
                raise ValueError("a value must be an envelope signed by its peer")
        with self.lock:
            return [self.dht.store(key, value, expiration_time=float(expiration), subkey=subkey, return_future=True)
                    for key, subkey, value, expiration in items]

    def _await(self, client: bytes, tag: Any, op: str, futures: list, deadline_s: float) -> None:
        """Wait (on this request's own thread) for the node's answers, within the request's deadline; ``tag``: the
        store's request id, or the key read (its readers are answered together)."""
        end = time.monotonic() + deadline_s
        results = []
        for future in futures:
            try:
                results.append(future.result(timeout=max(0.0, end - time.monotonic())))
            except Exception as exc:  # noqa: BLE001 - a timeout or the node's failure: that entry failed
                results.append(exc)
        if op == "store":
            self._done.put((client, {"id": tag, "ok": True, "result": [r is True for r in results]}))
            self._waker.wake()
            return
        if isinstance(results[0], Exception):
            reply = {"ok": False, "error": f"{type(results[0]).__name__}: {results[0]}"[:300]}
        else:
            reply = {"ok": True, "result": _wire_value(results[0])}
        self._done.put((None, (tag, reply)))
        self._waker.wake()

    def close(self) -> None:
        """Stop serving (waits for the service thread); remove the socket's directory if this service made it."""
        self._stop.set()
        self._waker.wake()
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            log.error("shared DHT node: the service thread did not stop")
        self._waker.close()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> NodeService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
