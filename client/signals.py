"""Read-only view of a daemon's signal segment (layout: kvcached_proto.shm_layout)."""
from __future__ import annotations

import mmap
import os
import time

import posix_ipc

from kvcached_proto.errors import DaemonUnavailable, KvcachedTimeout
from kvcached_proto.liveness import pid_alive
from kvcached_proto.shm_layout import LAYOUT_VERSION, MAGIC, SEGMENT_BYTES, Flag, SignalView, segment_name

# A dead daemon is seen at once through its pid; the heartbeat catches a hung one (or one in
# another pid namespace). Stalls of 0.5-0.9 s were seen on a loaded 2-vCPU VM in healthy
# daemons, so the heartbeat threshold leaves room for them.
HEARTBEAT_STALE_S = 3.0


class SignalReader:
    def __init__(self, instance: str):
        self.name = segment_name(os.getuid(), instance)
        try:
            shm = posix_ipc.SharedMemory(self.name, flags=0)
        except posix_ipc.ExistentialError:
            raise DaemonUnavailable(
                f"no kvcached daemon named {instance!r} (segment {self.name} missing); "
                f"start one with `kvcached serve --instance {instance}`"
            ) from None
        try:
            if shm.size < SEGMENT_BYTES:
                raise DaemonUnavailable(f"segment {self.name} is too small: not a kvcached daemon")
            self._mm = mmap.mmap(shm.fd, SEGMENT_BYTES, prot=mmap.PROT_READ)
        finally:
            shm.close_fd()
        self.view = SignalView(self._mm)
        if self.view.magic != MAGIC or self.view.layout_version != LAYOUT_VERSION:
            self.close()
            raise DaemonUnavailable(f"segment {self.name} has no valid kvcached header (yet)")
        self.pid = self.view.pid
        self.epoch = self.view.epoch
        # In another pid namespace (a sidecar container without a shared process namespace)
        # the daemon's pid means nothing here: then only the heartbeat tells it is alive.
        self.pid_visible = pid_alive(self.pid) or not self._beating()

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
        return (time.monotonic_ns() - self.view.heartbeat_ns) / 1e9 <= HEARTBEAT_STALE_S

    def check_alive(self) -> None:
        """Raise DaemonUnavailable if the daemon exited, stopped or stopped beating."""
        if self.pid_visible and not pid_alive(self.pid):
            raise DaemonUnavailable(f"kvcached daemon pid {self.pid} has exited")
        if not self.view.flags & Flag.UP:
            raise DaemonUnavailable(f"kvcached daemon pid {self.pid} is stopping or stopped")
        age = (time.monotonic_ns() - self.view.heartbeat_ns) / 1e9
        if age > HEARTBEAT_STALE_S:
            raise DaemonUnavailable(
                f"kvcached daemon pid {self.pid} missed its heartbeat for {age:.2f} s"
            )

    def close(self) -> None:
        if self._mm is not None:
            self.view.release()
            self._mm.close()
            self._mm = None
