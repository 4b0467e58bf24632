"""Waking a thread that waits in a ``zmq.Poller`` from any other thread.

A zmq socket belongs to one thread, so the thread that owns a poll loop cannot be handed work through its sockets
by others. ``Waker`` is an inproc PUSH/PULL pair: any thread calls ``wake`` (the PUSH, under a lock), the loop polls
``socket`` (the PULL) beside its own and calls ``drain`` when it is readable. Used by the shared DHT node's service
(finished node requests) and client (requests to send), so neither polls on a timer.
"""

from __future__ import annotations

import threading

import zmq


class Waker:
    """An inproc PUSH/PULL pair in ``context``; ``socket`` is the PULL the polling thread registers."""

    def __init__(self, context: zmq.Context, name: str):
        address = f"inproc://gossiploco-{name}-{id(self)}"
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self._push = context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(address)
        self._lock = threading.Lock()  # the PUSH is used by one thread at a time
        self._closed = False

    def wake(self) -> None:
        """Any thread: make the polling thread's next (or current) poll return. Never blocks; a wake-up already
        queued suffices, and one after ``close`` is a no-op."""
        with self._lock:
            if self._closed:
                return
            try:
                self._push.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the queue is full of wake-ups not yet drained: the thread wakes anyway
                pass

    def drain(self) -> None:
        """The polling thread: take the queued wake-ups."""
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close_pull(self) -> None:
        """The polling thread, when it stops."""
        self.socket.close(0)

    def close(self) -> None:
        """Any thread, once the polling thread stopped waking on it: later ``wake`` calls do nothing."""
        with self._lock:
            self._closed = True
            self._push.close(0)
