"""What one peer's process may use of its machine for ZeroMQ: libzmq I/O threads, open files, and how freed memory
is kept for the next message."""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

OPEN_FILES_WANTED = 65536
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (malloc.h)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations below this come from malloc's heaps, not from a mapping of their own (glibc's largest allowed value on
64-bit): a received data message (a 4 MiB chunk by default) among them."""
TRIM_THRESHOLD_BYTES = 128 << 20
"""Free memory at the top of a heap is given back to the system only beyond this (a thread's heap holds at most 64 MiB,
so those are never trimmed: the pages of the messages it received are there for the next ones)."""
MALLOC_SETTINGS_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
"""A user who tunes glibc's malloc through these keeps their settings (``reuse_freed_memory`` leaves it alone)."""
_reuse: bool | None = None


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


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep the memory of freed data messages for the next ones, once per process; True if it
    does (False: not glibc, refused, or the user's own malloc settings in the environment, ``MALLOC_SETTINGS_ENV``).

    libzmq receives each large message into a buffer of its own (``malloc`` of the message's size), and glibc's
    defaults serve such a buffer from a fresh mapping or give the top of a heap back to the system after a free,
    so the next message's pages were new: the kernel faults in and zeroes one page per 4 KiB before copying the
    data into it. Measured on this project's 2-core machine (``bench/page_faults.py``: 4 peers, in-place all-reduces
    of one 400 MB tensor back to back): 25,800-39,500 page faults per peer and all-reduce (up to 183,000 with one
    of the two thresholds set alone), 5-8 after; the all-reduce 0.83-0.86 s -> 0.69-0.71 s, sealed 1.10-1.18 s ->
    0.90-0.97 s. Both thresholds are set: either
    alone turns the other's dynamic adjustment off and faults more than the defaults. The cost: freed memory below
    ``MMAP_THRESHOLD_BYTES`` stays in the process for reuse instead of going back to the system (bounded by the
    peak of such allocations, e.g. the messages in flight), as with any allocator that caches."""
    global _reuse
    if _reuse is None:
        _reuse = _set_malloc_thresholds()
    return _reuse


def _set_malloc_thresholds() -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    chosen = [name for name in MALLOC_SETTINGS_ENV if os.environ.get(name)]
    if chosen:
        log.info("malloc left as set in the environment (%s)", ", ".join(chosen))
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) != 1:
        log.warning("glibc refused the malloc thresholds for reused message buffers: received data faults in fresh "
                    "pages (slower exchanges)")
        return False
    return True
