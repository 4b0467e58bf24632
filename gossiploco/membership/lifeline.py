"""A hivemind DHT whose processes die with the process that started it, even by SIGKILL.

hivemind runs a DHT node in a child process (``hivemind.DHT`` is a ``multiprocessing``
``ForkProcess``), and that child starts the libp2p daemon ``p2pd`` (a Go binary) with
``asyncio.subprocess.create_subprocess_exec`` from its event loop. When the process that started
the DHT dies without shutting it down (SIGKILL, the OOM killer, a crash), nothing tells the DHT
child: it waits for requests on a pipe whose write end it also holds (inherited through the fork),
so it never reads EOF, and it would run for ever, reparented to pid 1, with its p2pd.
(hivemind's p2pd happens to exit about a second after *its* parent, the DHT child, dies; that is
not relied on here.)

``TiedDHT``, which ``gossiploco.membership.dht_node.start_dht`` starts (for peers and for the
bootstrap node alike), ties both processes to their parent with three mechanisms:

1. The DHT child asks the kernel for SIGKILL when its parent dies (Linux
   ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, via ctypes), first thing in ``run()``; then it checks
   that its parent id is still the pid that started it, and exits at once if not (the parent
   died between the fork and the ``prctl``, and the signal would never come). Caveat: for the
   kernel the "parent" is the *thread* that forked, so the signal also fires when that thread
   ends while the process lives on. It is therefore set only when the DHT is started from the
   main thread (the case of every gossiploco command); a DHT started from another thread relies
   on mechanism 3.
2. Every process the DHT child starts (p2pd) gets the same ``PR_SET_PDEATHSIG, SIGKILL``, set by a
   ``preexec_fn`` between its fork and its exec (the setting survives the exec of p2pd), followed
   by the same check of the parent id. In the DHT child, ``asyncio.subprocess.create_subprocess_exec``
   (what hivemind calls) is wrapped to pass it; the patch exists in that child process only, which
   runs nothing but the DHT node. p2pd is forked by the DHT child's only event-loop thread, its
   main thread, which lives as long as the process, so p2pd gets its SIGKILL exactly when the
   DHT child dies, whatever killed it (mechanism 1, hivemind's ``terminate()`` after a shutdown
   timeout, the OOM killer).
3. A daemon watchdog thread in the DHT child checks every ``WATCHDOG_POLL_S`` that its parent id
   has not changed; when it has, it SIGKILLs the processes the DHT child started that still run
   and exits (``os._exit``). It is the only mechanism where ``prctl`` is missing (macOS and
   other non-Linux systems, where a warning is logged once) or not set (a DHT started from a
   thread other than the main one), and a backstop elsewhere.

So when a peer or a bootstrap node is SIGKILLed on Linux, the kernel kills its DHT process at
once and then that process's p2pd: both are gone within about 50 ms (measured on loopback).
``tests/test_orphans.py`` checks the whole process tree is gone within 10 s; the last to go, after
about 2 s, is torch's ``torch_shm_manager``, which torch starts and which exits by itself once its
clients are gone. Without the parent-death signal it takes up to ``WATCHDOG_POLL_S`` more. SIGKILL,
not SIGTERM: an orphaned node has nothing worth saving (its records are replicated and expire). What a
SIGKILL leaves behind is p2pd's unix socket file in the temporary directory (``hivemind-p2pd-*.sock``,
empty).

Stopping signals are its parent's (``gossiploco.runtime.stopping``): the DHT child is shut down by the
process that started it, never stopped behind its back. A terminal's Ctrl+C sends SIGINT to the whole
foreground process group, and ``kill -TERM -PGID`` SIGTERM; reaching the DHT child and p2pd, such a
signal made p2pd close its sockets (a go-libp2p ``[ERROR] ... use of closed network connection``), the
parent's shutdown then time out, and the child, which had inherited the parent's Python handler
across the fork, die with a ``KeyboardInterrupt`` traceback from inside uvloop (or exit under a
watching ``DhtDirectory``, which reports that at ERROR). So the DHT child, first thing, moves to a
process group of its own (its p2pd inherits it), ignores SIGINT (as hivemind does) and takes SIGTERM's
default action: quiet death, for hivemind's "hard way" ``terminate()`` and for ``multiprocessing``'s
at exit. SIGINT and SIGTERM are blocked from before the fork until then, so a signal sent to the
parent's group in between is dropped, not delivered with the parent's handler.

Normal shutdown is unchanged: ``DHT.shutdown()`` asks the child to stop, which terminates and
waits for p2pd, and the child exits; neither signal is sent, and the watchdog dies with the child.

This module imports hivemind: import it only where the DHT is used (``start_dht`` does).
"""

from __future__ import annotations

import asyncio.subprocess
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import hivemind

log = logging.getLogger(__name__)

WATCHDOG_POLL_S = 0.25
"""How often the DHT process's watchdog checks that its parent is still alive."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a gossiploco command (``gossiploco.runtime.stopping``); never the DHT process's own."""

PR_SET_PDEATHSIG = 1
"""``prctl`` option (linux/prctl.h): the signal this process gets when its parent thread dies."""

_warned = False  # the "no parent-death signal on this OS" warning is logged once per process


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), or None where it is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # the process's own libc
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_prctl = _load_prctl()


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent (thread) dies; False if not possible.

    Fit for a ``preexec_fn`` (between fork and exec): one foreign call, no lock taken.
    """
    if _prctl is None:
        return False
    return _prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def _die_with_parent(parent_pid: int, chained: Callable[[], Any] | None) -> None:
    """``preexec_fn`` of the DHT process's children: SIGKILL when it dies, exit now if it already did."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
    if chained is not None:
        chained()


class _Lifeline:
    """What the DHT child needs to die with its parent; created in the parent just before the fork."""

    def __init__(self) -> None:
        self.parent_pid = os.getpid()
        # PR_SET_PDEATHSIG fires when the *thread* that forked dies: safe only from the main thread.
        self.from_main_thread = threading.current_thread() is threading.main_thread()
        self.children: list[Any] = []  # asyncio processes the DHT child started (p2pd)
        self.signal_mask: set[int] = set()  # the forking thread's signal mask before ``TiedDHT.start`` blocked any
        global _warned
        if _prctl is None and not _warned:
            _warned = True
            log.warning("no parent-death signal on %s (Linux prctl): the DHT process checks every %g s whether "
                        "this process is alive instead, and kills its p2pd when it is not", sys.platform,
                        WATCHDOG_POLL_S)
        elif _prctl is not None and not self.from_main_thread:
            log.debug("DHT started from thread %s: its process watches this one every %g s instead of a "
                      "parent-death signal", threading.current_thread().name, WATCHDOG_POLL_S)

    def hold(self) -> None:
        """In the DHT child, first thing: leave the parent's stopping signals and tie it and its future children
        to the parent (see the module doc)."""
        self._leave_stop_signals()
        if self.from_main_thread and not set_parent_death_signal(signal.SIGKILL) and _prctl is not None:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); the DHT process watches its parent every %g s "
                        "instead", ctypes.get_errno(), WATCHDOG_POLL_S)
        if os.getppid() != self.parent_pid:  # the parent died before the prctl: no signal will come
            os._exit(1)
        self._wrap_subprocess_creation()
        threading.Thread(target=self._watch, name="dht-parent-watchdog", daemon=True).start()

    def _leave_stop_signals(self) -> None:
        """In the DHT child, with SIGINT and SIGTERM still blocked (``TiedDHT.start``): a process group of its
        own, SIGINT ignored, SIGTERM default; a stopping signal sent to the parent's group meanwhile is dropped."""
        try:
            os.setpgid(0, 0)
        except OSError as exc:  # not expected for a forked child; then a group's Ctrl+C reaches it as before
            log.warning("the DHT process could not leave its parent's process group: %r", exc)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.signal_mask)  # pending ones are ignored, so dropped
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _wrap_subprocess_creation(self) -> None:
        original = asyncio.subprocess.create_subprocess_exec
        lifeline = self

        async def create_subprocess_exec(program, *args, **kwargs):
            if _prctl is not None:
                kwargs["preexec_fn"] = _preexec(os.getpid(), kwargs.get("preexec_fn"))
            process = await original(program, *args, **kwargs)
            lifeline.children.append(process)
            return process

        # Only in the DHT child, which runs nothing but hivemind's node: hivemind looks the function up
        # at each call (asyncio.subprocess.create_subprocess_exec); asyncio re-exports the same function.
        asyncio.subprocess.create_subprocess_exec = create_subprocess_exec
        asyncio.create_subprocess_exec = create_subprocess_exec

    def _watch(self) -> None:
        while os.getppid() == self.parent_pid:
            time.sleep(WATCHDOG_POLL_S)
        for process in list(self.children):
            if process.returncode is None:  # not reaped yet, so the pid is still this process's
                try:
                    os.kill(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        os._exit(1)


def _preexec(parent_pid: int, chained: Callable[[], Any] | None) -> Callable[[], None]:
    return lambda: _die_with_parent(parent_pid, chained)


class TiedDHT(hivemind.DHT):
    """A ``hivemind.DHT`` whose process, and the p2pd it starts, die with the process that started it.

    Same arguments and behaviour as ``hivemind.DHT``; see the module docstring for the mechanism.
    """

    _lifeline: _Lifeline | None = None

    def start(self) -> None:
        self._lifeline = _Lifeline()
        # Blocked across the fork, unblocked in the child once it ignores them (``_Lifeline.hold``); here at once
        self._lifeline.signal_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._lifeline.signal_mask)

    def run(self) -> None:
        if self._lifeline is not None:
            self._lifeline.hold()
        super().run()
