"""Giving back to the system the heap that a burst of large request frames leaves behind.

zmq's I/O thread reads each frame into a buffer it mallocs, freed once the daemon has handled
the frame. glibc serves the first such buffers from mmap, then (its mmap threshold rises to the
largest chunk freed, up to 32 MiB) from its heaps, whose free pages it keeps while anything
above them lives: 512 connections flooding 2 MiB frames left the daemon at 1,031 MB after the
flood (279 before), for good; 8 MiB frames at 3,139 MB. Once TRIM_AFTER_BYTES of frames over
LARGE_BYTES have come in and none for QUIET_S, a thread of its own calls malloc_trim(0), which
gives back the free pages of every arena (10-90 ms during such a flood, in the request thread:
hence only once it is over, and off that thread). Without glibc's malloc_trim nothing is done.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

LARGE_BYTES = 64 << 10  # frames past this are counted (most requests are under 1 KiB)
TRIM_AFTER_BYTES = 64 << 20
QUIET_S = 0.5


def _malloc_trim():
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class HeapTrim:
    """took(n) for each large frame handled; maybe_trim(now) from the daemon's loop."""

    def __init__(self):
        self._trim = _malloc_trim()
        self._bytes, self._last = 0, 0.0
        self._thread: threading.Thread | None = None

    def took(self, nbytes: int) -> None:
        self._bytes += nbytes
        self._last = time.monotonic()

    def maybe_trim(self, now: float) -> None:
        if self._bytes < TRIM_AFTER_BYTES or now - self._last < QUIET_S or self._trim is None:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        took, self._bytes = self._bytes, 0
        self._thread = threading.Thread(target=self._run, args=(took,), name="kvcached-heap-trim",
                                        daemon=True)
        self._thread.start()

    def _run(self, took: int) -> None:
        before, t0 = rss_bytes(), time.perf_counter()
        self._trim(0)
        freed = max(0, before - rss_bytes())
        log.info("[memory] gave back %d MiB of heap after %d MiB of large frames (%.0f ms)",
                 freed >> 20, took >> 20, (time.perf_counter() - t0) * 1e3)
