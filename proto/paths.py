"""Where an instance's files live: run dir, socket endpoints, lock file, shm name."""
from __future__ import annotations

import os
import re

_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
DEFAULT_INSTANCE = "default"


def check_instance(instance: str) -> str:
    if not isinstance(instance, str) or not _INSTANCE_RE.match(instance):
        raise ValueError(
            f"instance name {instance!r} must be 1-64 characters of letters, digits, '_' or '-'"
        )
    return instance


def default_run_dir() -> str:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "kvcached")
    return f"/tmp/kvcached-{os.getuid()}"


def resolve_run_dir(run_dir: str | None) -> str:
    return os.path.abspath(run_dir or os.environ.get("KVCACHED_RUN_DIR") or default_run_dir())


def request_endpoint(run_dir: str, instance: str) -> str:
    return f"ipc://{os.path.join(run_dir, instance)}.sock"


def status_endpoint(run_dir: str, instance: str) -> str:
    return f"ipc://{os.path.join(run_dir, instance)}.status.sock"


def lock_path(run_dir: str, instance: str) -> str:
    return os.path.join(run_dir, f"{instance}.lock")


KV_SEGMENT_RE = re.compile(r"^/kvcached\.(\d+)\.kv\.(\d+)\.(\d+)$")  # uid, pid, n


def kv_segment_name(uid: int, pid: int, n: int) -> str:
    """The POSIX shared-memory name of an engine's n-th CPU KV allocation."""
    return f"/kvcached.{uid}.kv.{pid}.{n}"


def kv_segment_prefix(uid: int, pid: int) -> str:
    """What every KV segment of that engine starts with, as listed in /dev/shm."""
    return kv_segment_name(uid, pid, 0)[1:-1]


def socket_paths(run_dir: str, instance: str) -> list[str]:
    """Every socket file of an instance: requests, status, fds (fd_pass.py)."""
    return [os.path.join(run_dir, f"{instance}.sock"), os.path.join(run_dir, f"{instance}.status.sock"),
            fd_socket_path(run_dir, instance)]


def fd_socket_path(run_dir: str, instance: str) -> str:
    """Where the daemon takes file descriptors (kvcached_proto.fd_pass)."""
    return os.path.join(run_dir, f"{instance}.fds.sock")


SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments, as files


def segment_inode(name: str) -> int | None:
    """The inode of shared-memory segment `name`'s file under /dev/shm (not followed), or None
    when there is none: whether the name is still the segment a process made (its fstat)."""
    try:
        return os.lstat(os.path.join(SHM_DIR, name.lstrip("/"))).st_ino
    except FileNotFoundError:
        return None


def segment_owner(name: str) -> int | None:
    """The uid owning shared-memory segment `name` (its file under /dev/shm, not followed:
    shm_open does not follow links either), or None when there is none. A segment named for
    this user's instance but owned by another uid was planted: never a daemon of this user's."""
    try:
        return os.lstat(os.path.join(SHM_DIR, name.lstrip("/"))).st_uid
    except FileNotFoundError:
        return None
