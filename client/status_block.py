"""The shared-memory status block, read-only (layout: kvcached_proto.shm_layout): readiness,
heartbeat, the daemon's identity and the load-progress slots."""
from __future__ import annotations

import mmap
import os
import time

import posix_ipc

from kvcached_proto.errors import DaemonStopping, DaemonUnavailable, KvcachedTimeout
from kvcached_proto.liveness import pid_alive, pid_namespace, process_alive
from kvcached_proto.paths import SHM_DIR
from kvcached_proto.shm_layout import (LAYOUT_VERSION, MAGIC, SEGMENT_BYTES, Flag, StatusView, State,
                                      segment_name)

# A dead daemon is seen at once through its recorded identity (pid and start time); the
# heartbeat catches a hung one (or one in another pid namespace). The hang threshold is how
# long a heartbeat may be missed before the daemon counts as hung: its loads in flight are then
# load errors and the engine goes on without it until it beats again. The largest heartbeat gap
# of 148 healthy daemons over a whole test-suite run on a 2-core VM was 0.24 s (stalls of
# 0.5-0.9 s were seen there earlier under heavier load; docs/performance.md, "A daemon fault"), so 2 s leaves
# room for them; a false "hung" costs cache hits only, never correctness.
DEFAULT_HANG_S = 2.0
HANG_ENV = "KVCACHED_HANG_S"
HEARTBEAT_STALE_S = DEFAULT_HANG_S  # the name before the threshold became a setting


def hang_threshold(hang_s: float | None = None) -> float:
    """hang_s if given, else $KVCACHED_HANG_S, else DEFAULT_HANG_S."""
    if hang_s is None:
        raw = os.environ.get(HANG_ENV, "")
        if not raw:
            return DEFAULT_HANG_S
        try:
            hang_s = float(raw)
        except ValueError:
            raise ValueError(f"{HANG_ENV}={raw!r}: expected seconds, e.g. 2") from None
    if not 0 < hang_s < 3600:
        raise ValueError(f"hang threshold {hang_s!r} s: expected seconds in (0, 3600)")
    return float(hang_s)


def other_users(instance: str) -> list[int]:
    """The uids, other than this process's, of the status segments under `instance`'s name in
    /dev/shm: a daemon of another user there (or one that died) is not this user's."""
    suffix, me, out = f".{instance}", os.getuid(), []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return out
    for name in names:
        uid = name.removeprefix("kvcached.").removesuffix(suffix)
        if name.startswith("kvcached.") and name.endswith(suffix) and uid.isdigit() and int(uid) != me:
            out.append(int(uid))
    return sorted(out)


class StatusReader:
    def __init__(self, instance: str, hang_s: float | None = None, run_dir: str | None = None):
        self.hang_s = hang_threshold(hang_s)
        self.pidfd = -1  # a pidfd of the daemon, readable once it exited (-1: none)
        self._mm = None
        self.name = segment_name(os.getuid(), instance)
        try:
            shm = posix_ipc.SharedMemory(self.name, flags=0)
        except posix_ipc.ExistentialError:
            others = other_users(instance)
            raise DaemonUnavailable(
                f"no kvcached daemon of this user (uid {os.getuid()}) named {instance!r} "
                f"(segment {self.name} missing); "
                + (f"a daemon of uid {', '.join(map(str, others))} has that name: a daemon serves "
                   f"its own user's engines only, so run the engine as that user, or a daemon as "
                   f"this one (`kvcached serve --instance {instance}`)" if others else
                   f"start one with `kvcached serve --instance {instance}"
                   f"{f' --run-dir {run_dir}' if run_dir else ''}`")
            ) from None
        try:
            owner = os.fstat(shm.fd).st_uid
            if owner != os.getuid():  # another user made it under this user's instance name
                raise DaemonUnavailable(f"segment {self.name} belongs to uid {owner}, not to this "
                                        "user: not a kvcached daemon of yours")
            if shm.size < SEGMENT_BYTES:
                raise DaemonUnavailable(f"segment {self.name} is too small: not a kvcached daemon")
            self._mm = mmap.mmap(shm.fd, SEGMENT_BYTES, prot=mmap.PROT_READ)
        finally:
            shm.close_fd()
        self.view = StatusView(self._mm)
        if self.view.magic != MAGIC or self.view.layout_version != LAYOUT_VERSION:
            self.close()
            raise DaemonUnavailable(f"segment {self.name} has no valid kvcached header (yet)")
        self.pid = self.view.pid
        self.epoch = self.view.epoch
        self.pid_start = self.view.pid_start
        # In another pid namespace (a sidecar container without a shared process namespace)
        # the daemon's pid means nothing here: then only the heartbeat tells it is alive.
        self._identity = bool(self.pid_start and self.view.pid_ns)
        if self._identity:
            self.pid_visible = self.view.pid_ns == pid_namespace()
        else:  # a daemon that records no identity: guess the namespace from the pid
            self.pid_visible = pid_alive(self.pid) or not self._beating()
        self.pidfd = self._open_pidfd()

    def _open_pidfd(self) -> int:
        """A pidfd of the daemon, readable once it exited (a poll of it takes half a
        microsecond: the key table's C lookup asks it, client/key_table.py), when it is in this
        pid namespace and the kernel has pidfds; else -1."""
        if not (self.pid_visible and self._identity and hasattr(os, "pidfd_open")):
            return -1
        try:
            fd = os.pidfd_open(self.pid)
        except OSError:
            return -1
        if not process_alive(self.pid, self.pid_start):  # the pid was reused before we opened it
            os.close(fd)
            return -1
        return fd

    def ready(self) -> bool:
        return bool(self.view.flags & Flag.UP)

    def storage_ready(self) -> bool:
        """Every storage tier is ready (the disk tier's index rebuilt): lookups see it all."""
        return bool(self.view.flags & Flag.STORAGE_READY)

    def wait_storage_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.storage_ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise KvcachedTimeout(f"the daemon's storage tiers were not ready within "
                                      f"{timeout:g} s (the disk index is still being rebuilt?); "
                                      "set the wait's timeout")
            time.sleep(0.01)

    def _beating(self) -> bool:
        return (time.monotonic_ns() - self.view.heartbeat_ns) / 1e9 <= self.hang_s

    def gone(self) -> bool:
        """The daemon's process is known to be gone (never true across pid namespaces)."""
        if not self.pid_visible:
            return False
        if self._identity:
            return not process_alive(self.pid, self.pid_start)
        return not pid_alive(self.pid)

    def lost(self) -> bool:
        """Gone, or silent past the hang threshold (what releases the engine's stream waits)."""
        return self.gone() or not self._beating()

    def identity_check(self):
        """A `lost` test that outlives this reader (it reads no shared memory): the recorded
        process is gone. Across pid namespaces it cannot tell, and says False."""
        pid, start, identity, visible = self.pid, self.pid_start, self._identity, self.pid_visible
        if not visible:
            return lambda: False
        if identity:
            return lambda: not process_alive(pid, start)
        return lambda: not pid_alive(pid)

    def check_alive(self, drains: bool = False) -> None:
        """Raise DaemonUnavailable if the daemon exited, is stopping, or has missed its
        heartbeat for longer than the hang threshold. A stopping daemon answers no request, but
        runs the tasks queued before its stop and sends their ends: with `drains` (a wait for
        such an end) it is no error."""
        if self.gone():
            raise DaemonUnavailable(f"kvcached daemon pid {self.pid} has exited")
        if not drains and self.view.state == State.STOPPING:
            raise DaemonStopping(f"kvcached daemon pid {self.pid} is stopping: it answers no "
                                 "request (the tasks queued before its stop still end)")
        if not self.view.flags & Flag.UP:
            state = "starting" if self.view.state == State.STARTING else "stopping or stopped"
            raise DaemonUnavailable(f"kvcached daemon pid {self.pid} is {state}")
        age = (time.monotonic_ns() - self.view.heartbeat_ns) / 1e9
        if age > self.hang_s:
            raise DaemonUnavailable(
                f"kvcached daemon pid {self.pid} missed its heartbeat for {age:.2f} s "
                f"(hung: the hang threshold is {self.hang_s:g} s)"
            )

    def close(self) -> None:
        if self._mm is not None:
            self.view.release()
            self._mm.close()
            self._mm = None
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def __getattr__(name: str):
    if name == "SignalReader":  # the name before the status block was called so
        import warnings

        warnings.warn("kvcached_client.status_block.SignalReader is StatusReader now", DeprecationWarning,
                      stacklevel=2)
        return StatusReader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
