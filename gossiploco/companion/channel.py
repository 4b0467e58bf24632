"""Calls both ways between a training process and its companion, over one pipe.

Each side holds a ``Channel`` on its end of a ``multiprocessing`` pipe that the training process made for the
child it started: nothing from the network ever travels on it, so its messages are pickled (with torch's
reductions, which hand a CPU tensor over in shared memory instead of copying it through the pipe: a tensor sent
is moved into shared memory and the other side maps the same pages, so a change made in place by one side is
seen by the other). ``call(name, *args)`` sends ``("call", id, name, args, kwargs)`` and waits for the matching
``("result", id, ok, value)``; calls from the other side run on a pool of threads (``handler(name, args,
kwargs)``), so a collective that blocks for seconds does not hold up a counter read behind it.

Failure is loud and bounded: when the other side's end closes (its process died or closed the channel) every
waiting call and every later one raises ``CompanionDied`` with the cause (``why``), and ``on_lost`` is told once.
A call waits at most its ``timeout_s`` (then ``CompanionDied`` too: a side that stops answering is as good as
dead). An exception raised by the handler travels back and is raised in the caller; one that cannot be pickled
arrives as a ``RuntimeError`` with its text.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from typing import Any

import torch.multiprocessing  # noqa: F401 (it registers the shared-memory reductions with the pipe's pickler)

from gossiploco.errors import CompanionDied

log = logging.getLogger(__name__)

Handler = Callable[[str, tuple, dict], Any]
"""What a side does with a call from the other: ``handler(name, args, kwargs)`` returns the result or raises."""

WORKERS = 32
"""Calls from the other side served at once (the exchange's collectives block; a handful run at a time)."""


class Channel:
    """This side's end of the pipe; see the module docstring. Thread-safe."""

    def __init__(self, conn: Connection, handler: Handler | None, name: str,
                 on_lost: Callable[[str], None] | None = None):
        self._conn = conn
        self._handler = handler
        self._name = name
        self._on_lost = on_lost
        self._send_lock = threading.Lock()
        self._state = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self.why: str | None = None
        """Why the channel is down (None while it is up)."""
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix=f"{name}-call") if handler is not None else None
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    def call(self, name: str, *args, timeout_s: float | None = None, **kwargs) -> Any:
        """Run ``name(*args, **kwargs)`` on the other side and return its result (or raise its exception); waits
        at most ``timeout_s`` (None: until the other side answers or is gone)."""
        future: Future = Future()
        with self._state:
            if self.why is not None:
                raise CompanionDied(self.why)
            ident = next(self._ids)
            self._pending[ident] = future
        try:
            self._send(("call", ident, name, args, kwargs))
        except CompanionDied:
            with self._state:
                self._pending.pop(ident, None)
            raise
        try:
            ok, value = future.result(timeout=timeout_s)
        except FutureTimeout:
            with self._state:
                self._pending.pop(ident, None)
            raise CompanionDied(f"{self._name}: {name} got no answer within {timeout_s:g} s") from None
        if not ok:
            raise value
        return value

    def close(self, why: str = "closed") -> None:
        """Close this end (the other side sees its end close) and fail the calls still waiting."""
        self._lost(why, tell=False)
        try:
            # Shut the socket down before closing it: a close alone leaves it open while this side's reading thread
            # is blocked on it, so the other side would never see its end close.
            with socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._conn.close()
        except OSError:
            pass
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ---------------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            if self.why is not None:
                raise CompanionDied(self.why)
            try:
                self._conn.send(message)
            except (OSError, EOFError) as exc:  # a closed end: OSError("handle is closed"), or a broken pipe
                cause = f"{self._name}: the other side is gone ({type(exc).__name__}: {exc})"
            else:
                return
        self._lost(cause)
        raise CompanionDied(cause)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._lost(f"{self._name}: the other side closed the channel ({type(exc).__name__})")
                return
            except Exception as exc:  # noqa: BLE001 - a message that cannot be read ends the channel, loudly
                log.exception("%s: unreadable message from the other side", self._name)
                self._lost(f"{self._name}: unreadable message from the other side: {exc}")
                return
            kind = message[0]
            if kind == "result":
                _, ident, ok, value = message
                with self._state:
                    future = self._pending.pop(ident, None)
                if future is not None:
                    future.set_result((ok, value))
            elif kind == "call" and self._pool is not None:
                try:
                    self._pool.submit(self._serve, message)
                except RuntimeError:  # shut down: this side is closing
                    return
            else:
                log.error("%s: unexpected message %r from the other side", self._name, kind)

    def _serve(self, message: tuple) -> None:
        _, ident, name, args, kwargs = message
        try:
            reply = ("result", ident, True, self._handler(name, args, kwargs))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("result", ident, False, exc)
        try:
            self._send(reply)
        except CompanionDied:
            return
        except Exception as exc:  # noqa: BLE001 - e.g. an exception that does not pickle: its text goes instead
            try:
                self._send(("result", ident, False, RuntimeError(f"{name}: {type(exc).__name__}: {exc}")))
            except CompanionDied:
                return

    def _lost(self, why: str, tell: bool = True) -> None:
        with self._state:
            if self.why is not None:
                return
            self.why = why
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_result((False, CompanionDied(why)))
        if tell and self._on_lost is not None:
            self._on_lost(why)
