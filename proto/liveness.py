"""Liveness checks shared by the daemon (sweeping stale instances) and the client."""
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
