"""torch's shared-memory helper, started once per process with the handled signals held back.

hivemind shares tensors between a process and its DHT child (``MPFuture``) with torch's ``file_system`` strategy,
which it sets when imported. The first tensor a process shares starts torch's helper process,
``torch_shm_manager``, and reads its socket's name from a pipe. If a signal with a handler (SIGINT, SIGTERM,
faulthandler's SIGUSR1) interrupts that read, torch retries its check of the read's result, not the read, and spins
for ever holding the GIL (``torch/lib/libshm/core.cpp``, ``start_manager``). Seen: ``gossiploco swarm`` stopped with
Ctrl+C 1-2 s into its start-up hung there until killed, its helper a zombie.

``start_helper`` shares one tensor first, with those signals blocked in the calling thread: the read completes, the
helper is up for every later share, and a signal that came meanwhile is delivered as soon as the mask is restored
(a stop asked for during those 0.15 s happens right after them). The helper inherits the mask and runs on with
those signals held; it exits by itself once its last client is gone.
"""

from __future__ import annotations

import signal
import threading

_lock = threading.Lock()
_started = False


def handled_signals() -> set[signal.Signals]:
    """Signals this process handles (not the default action, not ignored): those that interrupt a system call."""
    handled = set()
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
        if handler not in (signal.SIG_DFL, signal.SIG_IGN):  # None: a handler installed outside Python
            handled.add(signum)
    return handled


def start_helper() -> None:
    """Start torch's shared-memory helper now, with this process's handled signals blocked (module docstring); once
    per process. Call before anything shares a tensor (a hivemind DHT)."""
    global _started
    with _lock:
        if _started:
            return
        import torch

        held = signal.pthread_sigmask(signal.SIG_BLOCK, handled_signals())
        try:
            torch.empty(1).share_memory_()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        _started = True
