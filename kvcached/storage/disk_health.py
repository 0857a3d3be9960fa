"""The disk tier's health (a part of DiskBackend, disk.py): I/O past its deadline, the probe
that stats the root once a second (and raises a limit a full filesystem set as it frees room:
disk_room.py), and what status reports of the tier (usage)."""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

log = logging.getLogger("kvcached.storage.disk")  # the tier's logger, as before the split

PROBE_EVERY_S = 1.0


class DiskHealth:
    """DiskBackend's methods for its health and its limit, on the state its __init__ makes (its
    lock and eviction condition, the late-I/O and probe fields, the byte counts and limit)."""

    def _late_op(self, what: str):
        def on_late(_i: int) -> None:
            with self._lock:
                first = self._late == 0
                self._late += 1
            self.counters["late_io"] += 1
            self.last_error = (f"{what} has not returned in {self.io_timeout_s:g} s "
                               "(a hung filesystem?); the tier is stuck until it does")
            if first:
                log.error("[disk] %s: %s", self.root, self.last_error)
                self._on_health()
        return on_late

    def _late_returned(self) -> None:
        with self._lock:
            self._late -= 1
            done = self._late == 0
        if done:
            log.warning("[disk] %s: every late I/O operation returned; the tier serves again", self.root)
            self._on_health()

    def _probe(self) -> None:
        while True:
            self._probe_wake.wait(PROBE_EVERY_S)  # (woken by an I/O error of the filesystem)
            self._probe_wake.clear()
            if self._closed.is_set():
                return
            self._probe_since = time.monotonic()
            try:
                st = self._root_now()  # (a tier started down, a volume remounted: disk_root.py)
                if not stat.S_ISDIR(st.st_mode) or self.local_keys and not os.access(self.root, os.W_OK) \
                        and not self._mounted_read_only():
                    raise OSError(errno.EACCES, "not a writable directory")  # (a reader reads)
                self._try_records()  # where records failed to be written or read (disk_errors.py)
                if self._probe_error:
                    self._probe_error = ""
                    log.warning("[disk] %s answers again: the tier serves and stores again", self.root)
                    self._on_health()
                if self.limit_bytes < self.capacity_bytes and not self._quota_met:
                    self._regrow(os.statvfs(self.root))
                self._retry_unlinks()  # (disk_unlinks.py)
            except OSError as exc:
                self._absolve()  # (disk_errors.py)
                first = not self._probe_error
                self._probe_error = f"{self.root}: {exc.strerror or exc}"
                if first:
                    log.error("[disk] %s; the tier serves nothing and drops its puts until it "
                              "answers again", self._probe_error)
                    self._on_health()
            except Exception as exc:  # a defect: the probe goes on (it ended, for good)
                self._said.log(log, logging.ERROR, "probe", "[disk] %s: the probe failed: %r",
                               self.root, exc)
            self._probe_since = 0.0

    def _same_root(self) -> os.stat_result:
        """The root's stat; OSError (ESTALE) where the path names another directory than the
        tier started on: its volume unmounted (the path is then the mount point's own
        directory, on the filesystem beneath), or the directory removed and made again. The
        tier is then unhealthy (no hits, puts dropped) until a volume is mounted where its own
        was (the probe then indexes it: disk_root.py): before, it went on writing blocks onto
        the filesystem beneath - a node's root disk, say."""
        st = os.stat(self.root)
        if self._root_id is not None and (st.st_dev, st.st_ino) != self._root_id:
            raise OSError(errno.ESTALE, "no longer the directory the tier started on (its volume "
                                        "unmounted, or removed and made again); it is used again "
                                        f"once a volume is mounted at {self._volume or self.root}")
        return st

    def _stuck(self) -> str:
        """Why the tier takes no I/O now ("" when it does); never waits on the filesystem."""
        if self._late:
            return f"{self._late} I/O operations past their {self.io_timeout_s:g} s deadline"
        since = self._probe_since
        if since and time.monotonic() - since > self.io_timeout_s:
            return f"a stat of {self.root} has not returned in {self.io_timeout_s:g} s"
        return ""

    def health(self) -> bool:
        return not self._stuck() and not self._probe_error

    def usage(self) -> dict:
        with self._lock:  # (a reader's index is what its start listed: its count says nothing)
            blocks = len(self._lru) if self.local_keys else None
        stuck = self._stuck()
        return {"used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes,
                "limit_bytes": self.limit_bytes, "full": self.limit_bytes < self.capacity_bytes,
                "blocks": blocks, "ready": self.indexed.is_set(), "stuck": bool(stuck),
                "read_only": self._read_only,
                "deletes_owed": self._owed.count(), "clear_owed": self._owed.clear_owed,
                "unlinks_left": self.unlinks_left(),
                "last_error": stuck or self._probe_error or self._read_only_said() or self.last_error,
                **self.counters}

    def _too_big(self, size: int) -> bool:
        """A block larger than the tier's whole capacity: dropped, counted, said once (before,
        a capacity_gb under one block stored nothing, and nothing said why). False."""
        self.counters["dropped_puts"] += 1
        self.last_error = (f"a block of {size} bytes is larger than the tier's capacity "
                           f"({self.capacity_bytes} bytes): nothing is stored; raise capacity_gb")
        if not self._too_big_said:  # (once: another error between puts made it say it again)
            self._too_big_said = True
            log.error("[disk] %s: %s", self.root, self.last_error)
        return False
