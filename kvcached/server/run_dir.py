"""The daemon's files in its run dir: the directory (0700, the daemon's own), the instance lock
and the socket files.

A run dir may have been open to other users before the daemon made it private (a Kubernetes
emptyDir is 0777), and /tmp, where the default one lives, always is. So nothing found there is
followed: the run dir may be a link only if the daemon's user owns the link, the lock is opened
without following links and must be a regular file of the daemon's user (anything else in its
place was planted: it is removed and the lock made anew), and stale socket files are removed
as the names they are, never through a link.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat

from kvcached_proto.paths import lock_path, socket_paths

from ..errors import StartupError

log = logging.getLogger(__name__)

SUN_PATH_MAX = 107  # bytes of a Unix socket's path: sizeof(sockaddr_un.sun_path) - 1 on Linux
_OPEN_LOCK = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def prepare_run_dir(path: str) -> None:
    """Create the run dir 0700, or check that an existing one is ours and make it private."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        link = os.lstat(path)
        st = os.stat(path)
    except OSError as exc:
        raise StartupError(f"--run-dir {path}: cannot create it: {exc.strerror or exc}") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid != os.geteuid():
        raise StartupError(f"run dir {path} is a link of uid {link.st_uid}, not ours "
                           f"({os.geteuid()}): another user may have planted it; remove it")
    if not stat.S_ISDIR(st.st_mode):
        raise StartupError(f"--run-dir {path}: not a directory")
    if st.st_uid != os.geteuid():  # (in /tmp anyone may make the default one first)
        raise StartupError(f"run dir {path} belongs to uid {st.st_uid}, not to us ({os.geteuid()}): "
                           "remove it, or give this daemon and its engines another one "
                           "(--run-dir, $KVCACHED_RUN_DIR, or $XDG_RUNTIME_DIR, which only "
                           "its user can write in)")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def _planted(fd: int) -> str:
    """Why the open lock file is not one this daemon may use ("" when it is)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"a file of uid {st.st_uid}"
    return ""


def _open_lock(path: str) -> int:
    """The lock file's fd: ours, regular, never reached through a link. Whatever else holds
    its name is removed (unlink removes a link itself, not what it names)."""
    for _ in range(3):
        try:
            fd = os.open(path, _OPEN_LOCK, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise
            why = "a link" if exc.errno == errno.ELOOP else "not a regular file"
        else:
            why = _planted(fd)
            if not why:
                return fd
            os.close(fd)
        log.warning("[startup] %s was %s (planted?); removed, the lock is made anew", path, why)
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
    raise StartupError(f"{path}: something keeps putting another file in place of the instance "
                       "lock; the run dir is not private")


def check_socket_paths(run_dir: str, instance: str) -> None:
    """StartupError where a socket's path is longer than a Unix socket may have (a deep run dir:
    a Kubernetes volume's path on the host, say). Binding it failed, and the daemon hung at
    start instead of exiting (the socket that failed to bind kept its ZeroMQ context open)."""
    longest = max(socket_paths(run_dir, instance), key=lambda p: len(os.fsencode(p)))
    if len(os.fsencode(longest)) > SUN_PATH_MAX:
        raise StartupError(f"socket path {longest} is {len(os.fsencode(longest))} bytes; a Unix "
                           f"socket's path may have {SUN_PATH_MAX}: give a shorter --run-dir "
                           "(or instance name)")


def take_instance_lock(run_dir: str, instance: str) -> int:
    """Hold the instance's lock (flock, dropped by the kernel however the daemon dies) and write
    our pid in it; returns its fd. StartupError when a live daemon holds it (or the instance's
    sockets could not be made there: check_socket_paths)."""
    check_socket_paths(run_dir, instance)
    path = lock_path(run_dir, instance)
    try:
        fd = _open_lock(path)
    except OSError as exc:
        raise StartupError(f"{path}: cannot open the instance lock: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StartupError(
            f"instance {instance!r} is already running in {run_dir} (pid {owner or 'unknown'}); "
            "stop it first or pick another --instance"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def sweep_socket_files(run_dir: str, instance: str) -> None:
    """We hold the instance lock: a socket file (or anything by that name) is a dead daemon's."""
    for path in socket_paths(run_dir, instance):
        if os.path.lexists(path):
            log.warning("[startup] removing stale socket %s", path)
            os.unlink(path)


def remove_instance_files(run_dir: str, instance: str, lock_fd: int) -> None:
    """(The run dir, or files in it, may be gone already: instance_files.py.)"""
    for path in [*socket_paths(run_dir, instance), lock_path(run_dir, instance)]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    os.close(lock_fd)
