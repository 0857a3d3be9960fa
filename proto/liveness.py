"""Liveness checks shared by the daemon (sweeping stale instances) and the client.

A pid alone can be reused, and a daemon killed with SIGKILL leaves its heartbeat fresh for a
few seconds; so the daemon records who it is: its pid, its start time (clock ticks after boot,
field 22 of /proc/PID/stat) and the inode of its pid namespace. A reader in the same pid
namespace decides from these alone: that process gone (no such pid, a zombie, or a pid now
held by a process that started at another time) is a dead daemon, whatever the heartbeat says.
"""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (zombies count as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state != b"Z"
    except (FileNotFoundError, IndexError):
        return False
    except OSError:
        return True


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot, or None when it cannot be read
    (no such process, or no /proc). 0 is never a valid answer: the field is read as given."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    try:
        return int(fields[19])  # field 22 of the whole line; fields here start at field 3
    except (IndexError, ValueError):
        return None


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 when /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_alive(pid: int, started: int) -> bool:
    """The process recorded as (pid, start ticks) still runs: the pid exists, is not a zombie
    and was started at that time (a reused pid was not). Call only in the same pid namespace."""
    if not pid_alive(pid):
        return False
    now = start_ticks(pid)
    return now is None or now == started  # unreadable /proc: the pid check alone decides
