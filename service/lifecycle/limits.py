"""What a process may hold: file descriptors and freed memory (Linux, glibc).

- :func:`raise_open_file_limit`: every connection to the router is a
  descriptor, and the usual soft limit (1,024) is far below what a server
  needs; the hard limit is what the administrator allows. The supervisor
  raises the soft limit to the hard one at start, and its children inherit it.
- :func:`watch_descriptors`: a warning in the log when descriptors run short
  (at 80% of the limit), since grpc then only retries its accept quietly and
  new connections, health checks included, wait in the kernel's backlog.
- :func:`return_large_frees`: very large message buffers (from
  :data:`LARGE_ALLOCATION`, 16 MiB) go to their own mappings, so their memory
  goes back to the system when they are freed instead of staying in the heap
  (glibc's adaptive threshold would otherwise move 30 MiB buffers into the
  heap after the first one is freed). Smaller ones, tensors up to 16 MiB,
  come from the heap and are reused: a fresh mapping costs its page faults
  and the kernel's zeroing on every message (a 9.2 MiB ``bytes`` copy took
  0.65 ms from the heap and 7.2 ms into a fresh mapping, issue 20 §4), which
  was half of the router's CPU per 9.2 MiB echo with the former 1 MiB
  threshold. The heap keeps at most :data:`LARGE_ALLOCATION` x 2 free at its
  top (M_TRIM_THRESHOLD); :func:`trim_freed_memory` returns what freed
  buffers leave elsewhere.
- :class:`HeapTrimmer` (:func:`trim_heap`): does so by itself once the
  process has grown and malloc holds as much free (what a request refused
  for its size leaves, which no handler hears of).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import resource
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

SHORT_RATIO = 0.8  # warn above this share of the soft limit
WARN_EVERY_S = 60.0  # while it stays short, repeat the warning this often
M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
LARGE_ALLOCATION = 16 * 1024 * 1024  # from this size, a malloc gets its own mapping


def raise_open_file_limit() -> tuple[int, int]:
    """Raises the soft RLIMIT_NOFILE to the hard limit; returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1024 * 1024
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


def open_file_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_descriptors() -> int | None:
    """How many descriptors this process holds; None when it cannot open one more
    (listing /proc/self/fd takes a descriptor itself)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return None
        raise


class DescriptorWatch:
    """Says in the log when descriptors run short, and when they no longer do."""

    def __init__(self, where: str, now: float = 0.0) -> None:
        self.where = where
        self.short = False
        self._warned_at = now - WARN_EVERY_S

    def check(self, used: int | None, limit: int, now: float) -> None:
        short = used is None or used >= SHORT_RATIO * limit
        if short and now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            held = "all" if used is None else f"{used}"
            log.warning(
                "%s: file descriptors are running short: %s of %d in use (soft "
                "RLIMIT_NOFILE); new connections wait until some close. Raise the "
                "limit (LimitNOFILE= under systemd, ulimit -n) or lower "
                "max_connection_idle_s and handshake_timeout_s",
                self.where,
                held,
                limit,
            )
        elif not short and self.short:
            percent = int(SHORT_RATIO * 100)
            log.info("%s: file descriptors back under %d%% of %d", self.where, percent, limit)
        self.short = short


async def watch_descriptors(where: str, interval_s: float) -> None:
    """Checks this process's descriptors every ``interval_s``, for good."""
    loop = asyncio.get_running_loop()
    watch = DescriptorWatch(where, loop.time())
    while True:
        watch.check(open_descriptors(), open_file_limit(), loop.time())
        await asyncio.sleep(interval_s)


def trim_freed_memory() -> bool:
    """Gives free heap memory back to the system (glibc's malloc_trim)."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))


def return_large_frees() -> bool:
    """Gives every allocation of LARGE_ALLOCATION or more its own mapping
    (returned to the system at free), and lets the heap keep twice that free
    at its top for reuse; False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trimmed = mallopt(M_TRIM_THRESHOLD, 2 * LARGE_ALLOCATION)
    return bool(mallopt(M_MMAP_THRESHOLD, LARGE_ALLOCATION)) and bool(trimmed)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def free_heap_bytes() -> int | None:
    """Bytes malloc holds free in its heaps (glibc's mallinfo2 ``fordblks``);
    None where malloc is not glibc's (2.33 or later)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.argtypes = []
    mallinfo2.restype = _Mallinfo2
    return int(mallinfo2().fordblks)


def resident_bytes() -> int | None:
    """This process's resident set (RSS), from /proc/self/statm; None when it
    cannot be read (no descriptor left to open it)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        return None


PAGE = os.sysconf("SC_PAGE_SIZE")
TRIM_AFTER_GROWTH = 16 * 1024 * 1024  # RSS grown this much, and as much free in malloc
TRIM_EVERY_S = 10.0  # at most one trim this often: under load, freed buffers are reused


class HeapTrimmer:
    """Gives freed heap memory back when the process has grown and malloc
    holds that much free (:func:`trim_freed_memory`), at most once per growth.

    A message grpc refuses for its size (over max_message_size) is read
    into many small buffers first, and freed before any handler sees it:
    an 80 MiB request left the router 70 MiB larger for good (issue 28 §7),
    in malloc's per-thread arenas, which glibc trims only from their top.
    Nothing in the router hears of such a refusal, so it looks: each check
    reads RSS (one /proc read), and only when RSS has grown by
    :data:`TRIM_AFTER_GROWTH` since the last trim asks malloc how much is
    free. A busy router whose memory is in use is trimmed once per such
    growth, not at every check, and never more than once per
    :data:`TRIM_EVERY_S`: memory given back is faulted in again when it is
    used again (9.2 MiB tensors at c8 would otherwise lose some of their
    reuse, issue 20 §4).
    """

    def __init__(
        self,
        rss: Callable[[], int | None] = resident_bytes,
        free: Callable[[], int | None] = free_heap_bytes,
        trim: Callable[[], object] = trim_freed_memory,
        growth: int = TRIM_AFTER_GROWTH,
        every_s: float = TRIM_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rss = rss
        self.free = free
        self.trim = trim
        self.growth = growth
        self.every_s = every_s
        self.clock = clock
        self.trimmed_at = clock() - every_s
        self.floor = rss() or 0  # RSS after the last trim (or the lowest seen since)

    def check(self) -> bool:
        """Trims when due; True if it did."""
        now = self.rss()
        if now is None:
            return False  # descriptors ran out: the next check will see
        if now < self.floor:
            self.floor = now
            return False
        if now - self.floor < self.growth or self.clock() - self.trimmed_at < self.every_s:
            return False
        free = self.free()
        if free is not None and free < self.growth:
            return False  # the growth is in use: nothing to give back
        self.trim()
        self.trimmed_at = self.clock()
        self.floor = self.rss() or now
        return True


async def trim_heap(interval_s: float) -> None:
    """:class:`HeapTrimmer` every ``interval_s``, for good."""
    trimmer = HeapTrimmer()
    while True:
        await asyncio.sleep(interval_s)
        trimmer.check()
