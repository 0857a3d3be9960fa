"""Every thread's stack in the daemon's log: on `kill -USR1 PID`, and when the request loop stalls.

Both are written by the heartbeat thread (status_block.py) holding the GIL, so no thread's frames
change while they are read. faulthandler's own signal dump (faulthandler.register) reads them
inside the signal handler, without the GIL: a daemon at work (an engine offloading and loading)
sent SIGUSR1 every 5 ms died of SIGSEGV within 13-38 signals, 4 runs of 4, its dump cut off in a
thread that was making a Future. Here the signal only asks: Python's handler writes its number to
a pipe (signal.set_wakeup_fd: from whichever thread it interrupted, the request thread stuck or
not) and the heartbeat reads the pipe every beat. At most one USR1 dump a second (the signals in
between are one request). A daemon one of whose threads keeps the GIL (it does not beat: engines
call it hung) writes neither; `py-spy dump --pid PID` or gdb reads it from outside.

A stalled loop's dump: at most STALL_DUMPS in a daemon's life, once a stall, not while the daemon
stops (its drain does not turn the loop). faulthandler writes the stacks into a memfd, and they go
to the log as lines of their own (`[stacks] ...`, JSON objects where the log is JSON), through the
log's queue (logs.py): a stderr that takes nothing holds neither the heartbeat nor the daemon. A
dump that cannot be taken turns the dumps off, said once; the heartbeat goes on.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

STALL_DUMPS = 5
USR1_EVERY_S = 1.0


def stacks() -> str:
    """Every thread's stack as faulthandler writes it (it writes to a file descriptor only)."""
    fd = os.memfd_create("kvcached-stacks", os.MFD_CLOEXEC)
    try:
        with open(fd, "w+b", closefd=False) as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0).decode(errors="replace")
    finally:
        os.close(fd)


def _asked(_signum, _frame) -> None:
    """(The main thread, later.) Nothing: the heartbeat has read the signal from the pipe."""


class StackDumps:
    def __init__(self) -> None:
        self._stall_left = STALL_DUMPS
        self._off = False  # a dump could not be taken (said once)
        self._lag: Callable[[], float] | None = None  # watch_loop
        self._stall_s = 0.0
        self._stalled = False  # (this stall of the loop's dumped already)
        self._pipe: tuple[int, int] | None = None  # (read, write): the wakeup fd's
        self._old: tuple[object, int] | None = None  # the handler and wakeup fd before ours
        self._usr1_asked = False
        self._usr1_last = -USR1_EVERY_S

    def listen_for_usr1(self) -> bool:
        """(The main thread; once.) SIGUSR1 asks for a dump from now on. False where it cannot
        (another thread than the main one; an embedding with a wakeup fd of its own): USR1 is
        then left as it was."""
        if threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        handler = signal.signal(signal.SIGUSR1, _asked)
        signal.siginterrupt(signal.SIGUSR1, False)  # (SA_RESTART: no EINTR for calls it lands in)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if old_fd != -1:  # not ours to take: put everything back
            signal.set_wakeup_fd(old_fd)
            signal.signal(signal.SIGUSR1, handler)
            os.close(r)
            os.close(w)
            log.warning("[startup] kill -USR1 writes no stacks: this process has a signal wakeup fd "
                        "of its own")
            return False
        self._pipe, self._old = (r, w), (handler, old_fd)
        return True

    def watch_loop(self, lag: Callable[[], float], stall_s: float) -> None:
        """From now on a loop that has not turned for stall_s (lag() says how long) has its dump."""
        self._lag, self._stall_s = lag, stall_s

    def on_beat(self, stopping: bool) -> None:
        """(The heartbeat thread, every beat.) Write what was asked for, holding the GIL."""
        pipe = self._pipe
        if pipe is not None and self._read_signals(pipe[0]):
            self._usr1_asked = True
        now = time.monotonic()
        if self._usr1_asked and now - self._usr1_last >= USR1_EVERY_S:
            self._usr1_asked, self._usr1_last = False, now
            self._write("[heartbeat] kill -USR1: every thread's stack follows")
        if self._lag is None:
            return
        lag = self._lag()
        if lag < self._stall_s or stopping:
            self._stalled = False
            return
        if self._stalled or self._stall_left <= 0:
            return
        self._stalled = True
        if self._write("[heartbeat] the request loop has not turned for %.1f s; every thread's "
                       "stack follows", lag):
            self._stall_left -= 1

    @staticmethod
    def _read_signals(fd: int) -> bool:
        """True if SIGUSR1 is among the signals the pipe holds (all read)."""
        seen = False
        while True:
            try:
                got = os.read(fd, 512)
            except (BlockingIOError, InterruptedError):
                return seen
            except OSError:  # closed under us (a stop)
                return seen
            if not got:
                return seen
            seen = seen or signal.SIGUSR1 in got

    def _write(self, *line) -> bool:
        if self._off:
            return False
        try:
            text = stacks()
        except (RuntimeError, ValueError, OSError, AttributeError) as exc:
            log.warning("[heartbeat] stack dumps are off: %s", exc)  # (once: the heartbeat goes on)
            self._off = True
            return False
        log.warning(*line)
        for row in text.splitlines():
            if row:
                log.warning("[stacks] %s", row)
        return True

    def close(self) -> None:
        """(The main thread, after the heartbeat stopped.) USR1 and the wakeup fd as they were."""
        if self._pipe is None:
            return
        handler, old_fd = self._old
        try:
            signal.set_wakeup_fd(old_fd)
            signal.signal(signal.SIGUSR1, handler)
        except ValueError:  # not the main thread: the pipe stays (a signal must not write to
            return  # whatever file takes its number next)
        pipe, self._pipe = self._pipe, None
        for fd in pipe:
            os.close(fd)
