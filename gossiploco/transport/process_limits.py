"""What one peer's process may use of its machine for ZeroMQ: libzmq I/O threads, and open files."""

from __future__ import annotations

import os

OPEN_FILES_WANTED = 65536


def default_io_threads() -> int:
    """libzmq I/O threads for one peer's context: half the cores this process may run on, 1 to 8. CurveZMQ encrypts
    and decrypts in the I/O thread that owns a connection, so with one thread a peer's whole encrypted traffic is
    bounded by one core's XSalsa20-Poly1305 rate (0.65 GB/s on this project's 2-core machine, about 5 Gbit/s),
    while a ring all-reduce sends on one connection as it receives on another, and a group mean talks to several
    peers at once: more threads put those connections' crypto on more cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


def raise_open_file_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open files towards ``wanted`` (never above the hard limit):
    every connection, including a stranger's until its handshake fails or times out, holds a file
    descriptor, and the common default of 1,024 is easy to exhaust. Returns the limit now in force."""
    try:
        import resource
    except ImportError:  # not on this OS
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            pass
    return soft
