"""File I/O off the caller's thread, with bounded waits.

A read or write on a hung filesystem (an NFS server gone, a FUSE daemon stopped) can block in
the kernel for as long as the filesystem likes, and no signal ends it. The storage tiers
therefore never do file I/O on a thread that anything else waits on without a deadline: the
work runs on these threads, and `run_bounded` waits for it until a deadline. Work that misses
the deadline is reported late; what it was given (a host page it reads into or writes from)
stays the caller's concern until `on_late_done` says it returned.

The threads are daemon threads: one stuck in a system call never holds up the process's exit,
which concurrent.futures' pool would (it joins its threads at interpreter exit).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11
from typing import Callable, Sequence

log = logging.getLogger(__name__)


class IOThreads:
    def __init__(self, threads: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    def shutdown(self, timeout: float) -> bool:
        """Stop the threads; False when some are still stuck after `timeout` (they are daemon
        threads: the process can exit anyway)."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            log.error("[storage] I/O threads %s still blocked in a system call at shutdown", stuck)
        return not stuck


def run_bounded(pool: IOThreads, fn: Callable, items: Sequence[tuple], timeout: float,
                on_late: Callable[[int], None], on_late_done: Callable[[int], None]) -> list:
    """fn(*item) for every item on the pool; waits until `timeout` for all of them. Returns
    each result, or None for an item still running at the deadline: on_late(i) is called for
    it at once and on_late_done(i) when it finally returns (from the thread that ran it). Work
    that had not started by the deadline is cancelled and reported late-and-done at once."""
    futures = [pool.submit(fn, *item) for item in items]
    deadline = time.monotonic() + timeout
    results: list = []
    for i, future in enumerate(futures):
        try:
            results.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
        except FutureTimeout:
            results.append(None)
            on_late(i)
            if future.cancel():
                on_late_done(i)
            else:
                future.add_done_callback(lambda _f, i=i: on_late_done(i))
    return results
