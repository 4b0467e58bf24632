"""One job at a time on a background thread: what keeps a peer's measurements off its main thread.

A ``BackgroundSlot`` runs at most one job (a callable) at a time on its own daemon thread; ``submit`` refuses a
second one while the first runs (the caller decides what a refused job means: the monitors skip and count it, so
at most one measurement, and its parameter snapshot, is ever in flight). Finished jobs' results wait in the slot
until the owner ``take``s them, so the owner applies them on its own thread, in its own order.

Contract: ``submit``, ``busy``, ``take``, ``wait_idle`` and ``close`` are called from one owner thread. A job
runs on the slot's thread; whatever it raises is caught and handed back as the result's ``error`` (nothing is
raised through the owner). ``close`` waits for the running job (bounded) and stops the thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Finished:
    """A job's outcome: its ``tag`` (given at ``submit``), its return ``value`` or the ``error`` it raised, and the
    ``seconds`` it ran on the slot's thread."""

    tag: Any
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


class BackgroundSlot:
    def __init__(self, name: str):
        self._cond = threading.Condition()
        self._job: tuple[Any, Callable[[], Any]] | None = None
        self._running = False
        self._done: list[Finished] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a job was submitted and has not finished yet."""
        with self._cond:
            return self._job is not None or self._running

    def submit(self, tag: Any, job: Callable[[], Any]) -> bool:
        """Run ``job`` on the slot's thread; False (and nothing runs) while another job is in flight or after
        ``close``."""
        with self._cond:
            if self._closed or self._job is not None or self._running:
                return False
            self._job = (tag, job)
            self._cond.notify_all()
            return True

    def take(self) -> list[Finished]:
        """The jobs finished since the last call, in the order they finished (non-blocking)."""
        with self._cond:
            done, self._done = self._done, []
            return done

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no job is in flight (or ``timeout_s``); True when idle."""
        with self._cond:
            return self._cond.wait_for(lambda: self._job is None and not self._running, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Refuse new jobs, wait up to ``timeout_s`` for the running one and stop the thread; True when it stopped.
        Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:  # closed and nothing left to run
                    return
                (tag, job), self._job, self._running = self._job, None, True
            start = time.perf_counter()
            finished = Finished(tag)
            try:
                finished.value = job()
            except BaseException as exc:  # noqa: BLE001 - handed to the owner, which logs and counts it
                finished.error = exc
            finished.seconds = time.perf_counter() - start
            with self._cond:
                self._done.append(finished)
                self._running = False
                self._cond.notify_all()
