"""A peer's side of a shared DHT node (``membership.shared_node``): requests over the node's ``ipc://`` socket, each
with a deadline, answered as futures, entries signed here before they leave (``record_validator.presign``)."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from gossiploco.errors import DirectoryError
from gossiploco.membership.zmq_waker import Waker
from gossiploco.membership.shared_node import (ANSWER_SLACK_S, MAX_DEADLINE_S, MAX_REPLY_BYTES, unpack_message,
                                               value_from_wire)

log = logging.getLogger(__name__)


class NodeClient:
    """A peer's handle on a ``NodeService`` at ``address`` (``ipc://...``): the part of a hivemind ``DHT`` that
    ``DhtEntries`` uses. ``identity`` and ``swarm`` sign each stored entry here (``record_validator.presign``;
    no identity: entries are stored as given, for tests of the mechanics). Connecting asks the node's ``info``
    within ``timeout_s``: ``DirectoryError`` saying what to check when it does not answer."""

    def __init__(self, address: str, *, timeout_s: float, identity: Any = None, swarm: Any = None):
        if not isinstance(address, str) or not address.startswith("ipc://"):
            raise DirectoryError(f"a shared DHT node's address is ipc://PATH, got {address!r}")
        self.address, self.timeout_s = address, float(timeout_s)
        self.identity, self.swarm = identity, swarm
        self._ids = itertools.count(1)
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._readers: dict[int, Callable[[Any], Any]] = {}  # request id -> what makes its reply the future's result
        self._lock = threading.Lock()  # guards _futures, _readers and _deadlines
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._context = zmq.Context.instance()
        self._waker = Waker(self._context, "dht-client")  # any thread's request wakes the I/O thread through it
        self._deadlines: dict[int, float] = {}  # request id -> when it is given up (guarded by _lock)
        self._thread = threading.Thread(target=self._io, name="dht-node-client", daemon=True)
        self._thread.start()
        try:
            info = self._request({"op": "info"}).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self.shutdown()
            raise DirectoryError(f"the shared DHT node at {address} did not answer within {self.timeout_s:g} s: is "
                                 "the `gossiploco swarm` or `gossiploco dht --local-peers` that serves it running, "
                                 "as this user?") from None
        except Exception as exc:
            self.shutdown()
            raise DirectoryError(f"the shared DHT node at {address} refused this peer: {exc}") from exc
        self.host_pid = int(info.get("pid", 0))
        self.maddrs = [str(a) for a in info.get("maddrs", [])]
        self.p2p = str(info.get("p2p", ""))

    def _io(self) -> None:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._waker.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(200))
                if self._waker.socket in ready:
                    self._waker.drain()
                    while True:
                        try:
                            socket.send(self._outbox.get_nowait(), zmq.NOBLOCK)
                        except queue.Empty:
                            break
                        except zmq.Again:  # the node is gone or stalled: the request times out on its deadline
                            break
                if socket in ready:
                    while True:
                        try:
                            self._settle(socket.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                self._expire(time.monotonic())
        finally:
            socket.close(0)
            self._waker.close_pull()

    def _settle(self, payload: bytes) -> None:
        try:
            reply = unpack_message(payload, MAX_REPLY_BYTES)
            request_id = reply["id"]
        except Exception:  # noqa: BLE001 - a reply that is not one: its request times out
            log.warning("shared DHT node: an unreadable reply was ignored")
            return
        with self._lock:
            future, read = self._futures.pop(request_id, None), self._readers.pop(request_id, None)
        if future is None or future.done():
            return
        if not reply.get("ok"):
            future.set_exception(DirectoryError(f"the shared DHT node: {reply.get('error')}"))
            return
        try:
            future.set_result(read(reply.get("result")))
        except Exception as exc:  # noqa: BLE001 - a result that is not what was asked for
            future.set_exception(exc)

    def _request(self, request: dict, read: Callable[[Any], Any] = lambda result: result) -> concurrent.futures.Future:
        """Send ``request``; a future of ``read(the node's result)``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set():
            future.set_exception(DirectoryError("the shared DHT node's client was shut down"))
            return future
        request_id = next(self._ids)
        with self._lock:
            self._futures[request_id], self._readers[request_id] = future, read
            # Unanswered (the node lost it, or is gone): failed a little after the node's own deadline for it, so
            # nothing waits or is kept for ever
            self._deadlines[request_id] = time.monotonic() + request.get("timeout_s", self.timeout_s) + ANSWER_SLACK_S
        future.add_done_callback(lambda _f, rid=request_id: self._forget(rid))
        self._outbox.put(msgpack.packb({**request, "id": request_id}, use_bin_type=True))
        self._waker.wake()  # a no-op once the client stopped: the request fails below
        if self._stop.is_set() and not future.done():
            future.set_exception(DirectoryError("the shared DHT node's client was shut down"))
        return future

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._futures.pop(request_id, None)
            self._readers.pop(request_id, None)
            self._deadlines.pop(request_id, None)

    def _expire(self, now: float) -> None:
        """Fail the requests the node has not answered by their deadline (the I/O thread, at each wake-up)."""
        with self._lock:
            late = [rid for rid, deadline in self._deadlines.items() if deadline <= now]
            futures = [self._futures.pop(rid, None) for rid in late]
            for rid in late:
                del self._deadlines[rid]
                self._readers.pop(rid, None)
        for future in futures:
            if future is not None and not future.done():
                future.set_exception(DirectoryError("the shared DHT node did not answer in time"))

    def pending(self) -> int:
        """Requests awaiting the node's answer (each is failed by its deadline, so this stays bounded)."""
        with self._lock:
            return len(self._futures)

    def is_alive(self) -> bool:
        """Whether the process serving the node runs (and this client has not been shut down)."""
        if self._stop.is_set() or not self._thread.is_alive():
            return False
        try:
            os.kill(self.host_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def store(self, key: str, value: Any, *, expiration_time: float, subkey: int,
              return_future: bool = True) -> concurrent.futures.Future:
        """Store ``key``'s ``subkey`` (signed here when this client has an identity); a future of whether at
        least one DHT node accepted it."""
        if self.identity is not None:
            from gossiploco.membership.record_validator import presign

            value = presign(self.identity, self.swarm, key, subkey, value, expiration_time)
        return self._request({"op": "store", "items": [[key, subkey, value, expiration_time]],
                              "timeout_s": min(self.timeout_s, MAX_DEADLINE_S)},
                             lambda result: bool(result[0]) if isinstance(result, list) and result else False)

    def get(self, key: str, *, latest: bool = True, return_future: bool = True) -> concurrent.futures.Future:
        """``key``'s latest value as hivemind's ``ValueWithExpiration`` (a future)."""
        return self._request({"op": "get", "key": key, "timeout_s": min(self.timeout_s, MAX_DEADLINE_S)},
                             value_from_wire)

    def run_coroutine(self, fn: Any, return_future: bool = True) -> Any:
        raise DirectoryError("a shared DHT node runs no code for its peers (no relays, tunnels or reconnects)")

    def shutdown(self) -> None:
        """Stop this client (the node goes on serving the others); pending requests fail."""
        self._stop.set()
        self._thread.join(timeout=2)
        self._waker.close()
        with self._lock:
            pending, self._futures, self._readers = list(self._futures.values()), {}, {}
        for future in pending:
            if not future.done():
                future.set_exception(DirectoryError("the shared DHT node's client was shut down"))
