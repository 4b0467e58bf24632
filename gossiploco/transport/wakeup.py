"""Waking the receiving thread when another thread gives it work, so that it need not wake up to look.

The receiving thread (``zmq_receiver``) sleeps in one poll over the ROUTER and every connection's monitor socket.
Other threads hand it work through queues (monitors of new peers to poll, closed ones to drop, reverse endpoints to
dial, sealed ports to dial) and by closing. It used to wake every 100 ms to look, polling all its sockets each time,
which made a peer's idle CPU grow with its connections (measured: 2.7 ms a second per peer at 40 peers,
``bench/results/scale.md``). Now whoever hands it work also writes a byte to a pipe that the poll watches (``Waker``),
and the thread sleeps up to a second when it has nothing timed to do. A missed wake-up costs at most that second,
never the work itself.
"""

from __future__ import annotations

import os
import queue
import threading


class Waker:
    """A pipe: ``wake`` (any thread) makes the reader's poll return; ``fd`` is what the poll watches; ``drain`` empties
    it (the reader, after its poll)."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._closed = False
        self.wakes = 0
        """Wake-ups asked for (for tests and diagnostics)."""

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            self.wakes += 1
            try:
                os.write(self._write_fd, b"w")
            except BlockingIOError:  # the pipe is full: the reader has wake-ups enough waiting
                pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.fd)
            os.close(self._write_fd)


class WakingQueue:
    """A ``queue.SimpleQueue`` whose ``put`` also wakes ``waker``'s reader."""

    def __init__(self, waker: Waker) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waker = waker

    def put(self, item) -> None:
        self._queue.put(item)
        self._waker.wake()

    def get(self):
        return self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()
