"""The disk tier's failed reads, writes and unlinks (a part of DiskBackend, disk.py): what each
says - of its record, of the system, or of the filesystem - and the trial record the probe
writes to tell which, logged so that a disk that fails does not fill the log.

- A record found damaged (record.BadRecord: its checksum, header or key) is removed (disk.py).
- EMFILE, ENFILE, ENOMEM, ENOBUFS, EAGAIN, EINTR say nothing of the record or the filesystem
  (TRANSIENT): a read is a miss and its record stays indexed; a write is a put error.
- EROFS: the filesystem went read-only - ext4's default at a disk error (errors=remount-ro),
  which access(2) does not show. The tier is `read_only`: it serves what it holds (every read
  checked as always) and drops its puts without evicting, until the probe's trial record can
  be written again. Before, every put evicted records it could not unlink, forgot them and
  leaked its reservation, and its error failed the whole backup: a tier that held 16 readable
  records served none, reported none, and said nothing in status. A tier that starts on a
  read-only filesystem (a restart after the error) serves what it finds and takes no lock; it
  stores nothing until a restart (its start was refused: the host tier was lost with it).
- Anything else (EIO from a disk that fails, ESTALE, ENOTCONN, ...): the read's record is not
  served, and the probe is woken to write a trial record at once, then every round while it
  fails: a trial that fails makes the tier unhealthy - no hits, puts dropped - until one
  passes, and the record stays (the filesystem's fault: served again with it); a trial that
  passes forgets the record and unlinks its file where the filesystem lets it (a bad sector
  costs that record alone). Before, a disk that failed every I/O (an ext4 shut down under the
  tier) left the tier `healthy`, its lookups finding hits that every load failed, and each block
  logged two lines per read and one per put; and every record whose read failed was forgotten:
  a network filesystem's outage cost each record a load was reading, until a restart.
"""
from __future__ import annotations

import errno
import logging

from ..logs import LineBudget
from . import owned
from .disk_lock import read_only_fs
from .disk_write import NO_ROOM, trial

log = logging.getLogger("kvcached.storage.disk")  # the tier's logger

TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN,
                       errno.EINTR})
LOG_LINES, LOG_EVERY_S = 2, 10.0  # of each kind (a read, a write, an unlink); the rest counted


def _said(exc: OSError) -> str:
    return f"{errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror or exc}"


class DiskErrors:
    """DiskBackend's methods for its failed I/O, on the state its __init__ makes (counters,
    last_error, the probe's wake event, `_suspect`, `_read_only`, `_trial_failing`, `_said`)."""

    def _init_errors(self) -> None:
        self._suspect = False  # an I/O error of the filesystem since the last trial
        self._trial_failing = False  # the last trial failed (not read-only): the tier is down
        self._read_only = False  # the filesystem is read-only: served, nothing stored
        self._read_only_fixed = False  # read-only at start (no lock taken): until a restart
        self._said = LineBudget(lines=LOG_LINES, window_s=LOG_EVERY_S)
        self._too_big_said = False  # a block over the whole capacity, logged (disk_health.py)
        # records whose read failed with an error of the filesystem: not served until the
        # probe's trial says whose the fault was (_try_records), under the tier's lock
        self._suspects: set[bytes] = set()

    def _read_failed(self, key: bytes, exc: OSError) -> None:
        """A record's read raised an OSError other than its file missing (a miss either way)."""
        self.counters["io_errors"] += 1
        self.last_error = f"a read failed: {_said(exc)}"
        self._said.log(log, logging.WARNING, "read", "[disk] %s: read %s: %s", self.root, key.hex(),
                       self.last_error)
        if exc.errno in TRANSIENT or not self.local_keys:  # (a reader removes nothing)
            return
        if self._read_only_fixed:  # (no trial there: the record's fault)
            return self._blame([key])
        with self._lock:
            self._suspects.add(key)
        self._filesystem_error(exc)

    def _blame(self, keys) -> None:
        """The records' reads failed, the filesystem's trial did not: theirs was the fault (a
        bad sector). Forgotten, and their files removed unless stored again meanwhile."""
        with self._lock:
            self._suspects.difference_update(keys)
        for key in keys:
            self._forget(key)
        self._unlink_later(keys)

    def _absolve(self) -> None:
        """(The probe, a round that failed: the root or the trial.) The records whose reads
        failed meanwhile failed with the filesystem: they stay, served once it answers again.
        Before, each was forgotten (its file left, not indexed, until a restart)."""
        with self._lock:
            self._suspects.clear()

    def _write_failed(self, key: bytes, exc: OSError) -> None:
        """A record's write failed (for room: still none after ENOSPC_TRIES writes)."""
        self.counters["put_errors"] += 1
        self.last_error = f"write failed: {_said(exc)}"
        self._said.log(log, logging.WARNING, "write", "[disk] %s: put %s: %s", self.root, key.hex(),
                       self.last_error)
        if exc.errno not in TRANSIENT and exc.errno not in NO_ROOM:
            self._filesystem_error(exc)

    def _unlink_failed(self, exc: OSError, what: str = "unlink") -> None:
        """An unlink (an eviction's, a delete's, a damaged record's) failed: its file is left,
        not indexed, never read by this daemon."""
        self.last_error = f"{what} failed: {_said(exc)}"
        self._said.log(log, logging.WARNING, "unlink", "[disk] %s: %s", self.root, self.last_error)
        if exc.errno not in TRANSIENT:
            self._filesystem_error(exc)

    def _filesystem_error(self, exc: OSError) -> None:
        if exc.errno == errno.EROFS:
            self._set_read_only(True)
        elif not self._suspect:
            self._suspect = True
            self._probe_wake.set()

    def _set_read_only(self, read_only: bool) -> None:
        if read_only == self._read_only:
            return
        self._read_only = read_only
        if read_only:
            log.error("[disk] %s: %s", self.root, self._read_only_said())
        else:
            log.warning("[disk] %s: the filesystem is writable again: the tier stores again", self.root)

    def _usable_shard(self, path: str) -> bool:
        """owned.usable_shard, a shard it cannot mend (a read-only filesystem) left unused
        alone: before, its error ended the index rebuild, and no record was served."""
        try:
            return owned.usable_shard(path)
        except OSError as exc:
            log.error("[disk] shard %s cannot be made the tier's (%s): left unused", path, _said(exc))
            return False

    def _read_only_at_start(self) -> None:
        """(The start, on a read-only filesystem: EROFS.) The tier serves what it finds there;
        it took no lock (no one writes there), so it stores nothing until a restart."""
        self._read_only_fixed = True
        self._set_read_only(True)

    def _mounted_read_only(self) -> bool:
        """(The probe, the root not writable.) True where its filesystem is mounted read-only:
        the tier is read_only (it serves), not down."""
        if not read_only_fs(self.root):
            return False
        self._set_read_only(True)
        return True

    def _read_only_said(self) -> str:
        if not self._read_only:
            return ""
        return ("the filesystem is read-only: the tier serves what it holds and stores nothing "
                + ("until a restart finds it writable" if self._read_only_fixed
                   else "until it is writable again"))

    def _try_records(self) -> None:
        """(The probe, each round.) Where a read or write failed with an error of the filesystem,
        the filesystem is read-only, or the last trial failed: write a trial record, read it
        back, remove it (disk_write.trial). OSError where it fails other than read-only."""
        if not (self._suspect or self._read_only or self._trial_failing) or not self.local_keys \
                or self._read_only_fixed:
            return
        self._suspect = False
        with self._lock:
            tried = list(self._suspects)  # (reads that fail from now on wait for the next trial)
        try:
            trial(self.root, say_full=False, fsync=self.fsync)
        except OSError as exc:
            self._trial_failing = exc.errno != errno.EROFS
            if self._trial_failing:
                raise  # (the probe absolves them)
            self._set_read_only(True)
            return self._blame(tried)
        self._trial_failing = False
        self._set_read_only(False)
        self._blame(tried)
