"""Where a running daemon listens, for an engine that looks for it in another run dir.

The connector and the daemon each resolve their run dir (the connector's extra config
`run_dir`, else $KVCACHED_RUN_DIR, $XDG_RUNTIME_DIR/kvcached, /tmp/kvcached-$UID; the daemon's
--run-dir or the same chain in its own environment). When they differ the engine would find the
daemon's status segment (it is named by the instance alone) but never its socket: zero hits
forever. This tells it where the daemon is instead.
"""
from __future__ import annotations

import os

from kvcached_proto.errors import DaemonUnavailable
from kvcached_proto.paths import request_endpoint


class WrongRunDir(DaemonUnavailable):
    """The daemon runs, but its socket is not in the run dir this client looks in."""


def _proc(pid: int, what: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
    except OSError:
        return []


def daemon_run_dir(pid: int) -> str | None:
    """The run dir daemon `pid` was started with (its --run-dir, else its environment's
    default), or None when this process cannot tell (another pid namespace, another user)."""
    args = _proc(pid, "cmdline")
    for i, arg in enumerate(args):
        if arg == "--run-dir" and i + 1 < len(args):
            return os.path.abspath(args[i + 1])
        if arg.startswith("--run-dir="):
            return os.path.abspath(arg.split("=", 1)[1])
    env = dict(e.split("=", 1) for e in _proc(pid, "environ") if "=" in e)
    if not args or not env:
        return None
    if env.get("KVCACHED_RUN_DIR"):
        return env["KVCACHED_RUN_DIR"]
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "kvcached")
    return f"/tmp/kvcached-{os.getuid()}"


def check_run_dir(instance: str, run_dir: str, pid: int) -> None:
    """Raise WrongRunDir when daemon `pid` (up) has no socket in run_dir."""
    here = request_endpoint(run_dir, instance).removeprefix("ipc://")
    if os.path.exists(here):
        return
    theirs = daemon_run_dir(pid)
    where = f"in run dir {theirs}" if theirs else "but not in this run dir"
    fix = (f"give the engine run_dir {theirs!r} (the connector's kv_connector_extra_config "
           f"run_dir, or $KVCACHED_RUN_DIR) or start the daemon with --run-dir {run_dir}"
           if theirs else f"start it with --run-dir {run_dir}, or give the engine its run dir")
    raise WrongRunDir(f"kvcached daemon {instance!r} (pid {pid}) is running {where}, "
                      f"not in {run_dir}: {fix}")
