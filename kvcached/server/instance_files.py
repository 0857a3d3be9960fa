"""The instance's files in the run dir, made again when they go while the daemon runs (a part
of Daemon, daemon.py).

The run dir can go from under a running daemon: the default one under $XDG_RUNTIME_DIR is
removed at the user's last logout, tmp cleaners age files out of /tmp, an operator cleans up.
Engines attached go on (their connections do not need the files); without the socket files no
new engine could attach, and without the lock a second daemon could start under the same name.
So about once a second the request thread checks its lock file and its request socket's file;
one gone: the dir is made again (prepare_run_dir's checks), the lock taken anew, the request
socket bound to its path again. The status and fd sockets' threads do the same for theirs
(status.py, fd_inbox.py). The status segment in /dev/shm heals itself (status_block.py).
"""
from __future__ import annotations

import logging
import os
import stat
import time

from kvcached_proto.paths import lock_path, request_endpoint

from ..errors import StartupError
from .run_dir import prepare_run_dir, take_instance_lock

log = logging.getLogger("kvcached.server.daemon")

CHECK_EVERY_S = 1.0


def socket_file_there(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def lock_held_there(path: str, fd: int) -> bool:
    """The lock file under its name is the one this fd locks."""
    try:
        return os.lstat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


class HealsFiles:
    """Daemon's check of its run-dir files and key table; uses cfg, _lock_fd, _router, service."""

    _next_files_check = 0.0

    def _heal_files(self) -> None:
        now = time.monotonic()
        if now < self._next_files_check or self._lock_fd is None:
            return
        self._next_files_check = now + CHECK_EVERY_S
        if self.service is not None:
            self.service.heal_key_table()  # (the status segment heals itself: status_block.py)
        run_dir, instance = self.cfg.run_dir, self.cfg.instance
        endpoint = request_endpoint(run_dir, instance)
        lock_there = lock_held_there(lock_path(run_dir, instance), self._lock_fd)
        socket_there = socket_file_there(endpoint[len("ipc://"):])
        if lock_there and socket_there:
            return
        try:
            prepare_run_dir(run_dir)
            if not lock_there:
                fd = take_instance_lock(run_dir, instance)
                os.close(self._lock_fd)
                self._lock_fd = fd
            if not socket_there:
                self._router.bind(endpoint)
        except (StartupError, OSError) as exc:  # (zmq.ZMQError is an OSError)
            log.error("[files] the run dir %s lost %s and cannot have it again: %s; engines "
                      "attached go on, new ones cannot attach", run_dir,
                      "its lock" if not lock_there else "the request socket", exc)
            self._next_files_check = now + 30 * CHECK_EVERY_S
            return
        gone = [what for what, there in (("lock", lock_there), ("request socket", socket_there))
                if not there]
        log.warning("[files] the %s of instance %s %s gone from the run dir %s (removed while the "
                    "daemon ran: a $XDG_RUNTIME_DIR is removed at its user's last logout, tmp "
                    "cleaners age files out): made again", " and ".join(gone), instance,
                    "were" if len(gone) > 1 else "was", run_dir)
