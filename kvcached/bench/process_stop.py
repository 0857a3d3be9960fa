"""Stopping a process the way a hang looks from outside (SIGSTOP) and letting it go on (SIGCONT),
for the fault benchmark and the tests. `kill()` returns before the target's threads have
stopped: a busy thread can still answer one more request. These return once every thread of the
process is in the stopped state (or none is), read from /proc/PID/task/*/stat.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

WAIT_S = 10.0


def _states(pid: int) -> list[str]:
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # the process is gone
        return states
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return states


def all_stopped(pid: int) -> bool:
    """Whether every thread of pid is in the stopped state (T)."""
    states = _states(pid)
    return bool(states) and all(s == "T" for s in states)


def _signal_and_wait(pid: int, stopped: bool, what: str) -> None:
    os.kill(pid, signal.SIGSTOP if stopped else signal.SIGCONT)
    deadline = time.monotonic() + WAIT_S
    while True:
        states = _states(pid)
        if not states or "Z" in states or "X" in states:  # gone: nothing left to wait for
            return
        if (all(s == "T" for s in states) if stopped else "T" not in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} (pid {pid}) did not {'stop' if stopped else 'go on'} "
                               f"in {WAIT_S:g} s: thread states {sorted(set(states))}")
        time.sleep(0.002)


def stop(pid: int, what: str = "the process") -> None:
    """SIGSTOP; returns once every thread is stopped."""
    _signal_and_wait(pid, True, what)


def go_on(pid: int, what: str = "the process") -> None:
    """SIGCONT; returns once no thread is stopped. Harmless on a running or ended process."""
    try:
        _signal_and_wait(pid, False, what)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def stopped(pid: int, what: str = "the process"):
    """The process stopped for the block, and going on again after it, whatever the block did."""
    stop(pid, what)
    try:
        yield
    finally:
        go_on(pid, what)
