"""Child-process accounting for the leak check, from /proc (no psutil dependency)."""
from __future__ import annotations

import os


def live_children() -> list[str]:
    me = str(os.getpid())
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        state, ppid = fields[0], fields[1]
        if ppid == me and state != "Z":
            out.append(f"{pid}: {cmd}")
    return out
