"""The disk tier's root at start (a part of DiskBackend, disk.py): the directory made and checked,
the lock taken and a trial record written (disk_lock.py), then the index rebuilt from a listing.

What the operator must change refuses the start, naming it: a path that is no directory or not
this user's, one not writable, a directory another daemon holds, a filesystem that cannot keep
a record (a bucket mount without rename). A filesystem that fails (FAILING: a dead disk's EIO, a
FUSE mount whose server died - ENOTCONN, ECONNABORTED - a network filesystem that is down or
stale) does not: the tier starts down - unhealthy with the reason, no hits, puts dropped, the
host tier serving - and the probe tries the root again every round; once it answers, the lock
is taken, the trial passes and the index is rebuilt as at a start (the deletes and clears made
meanwhile kept: disk_listing.WhileIndexing, and on record in the run dir) - once a volume is
mounted where the failing one was (volume_of): a dead mount the operator takes away leaves a
directory of the filesystem beneath, which the tier must not fill. Before, such a
start refused the whole daemon ("cannot use ... Transport endpoint is not connected"), and
with it the host tier: a restarted engine found no cache at all.

The same under a running tier whose root becomes another directory (a volume mounted anew where
its own was: a FUSE or network filesystem remounted): the old index is forgotten and the new
directory taken as at a start (_root_now). It was down until a restart.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import threading

from . import owned
from .disk_errors import TRANSIENT
from .disk_health import PROBE_EVERY_S
from .disk_lock import DiskInUse, read_only_fs
from .iothreads import run_bounded

log = logging.getLogger("kvcached.storage.disk")  # the tier's logger

FAILING = TRANSIENT | frozenset({
    errno.EIO, errno.ENOTCONN, errno.ECONNABORTED, errno.ECONNRESET, errno.ECONNREFUSED,
    errno.ESTALE, errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETDOWN,
    errno.ENETUNREACH, errno.ENODEV, errno.ENXIO, errno.ENOMEDIUM, errno.EREMOTEIO,
    errno.EUCLEAN, errno.ENOLINK, errno.ECOMM})


class DiskRoot:
    """DiskBackend's methods for its root, on the state its __init__ makes (the lock, the I/O
    threads, the probe's fields, `_rebuild`)."""

    def _start_root(self) -> None:
        """(__init__.) The root made on an I/O thread (a hung filesystem leaves the tier stuck,
        not the start), then the index rebuilt on a thread of its own; ValueError where the
        operator must change something; a failing filesystem starts the tier down."""
        self.indexed = threading.Event()
        self._root_made = False
        self._started_down = False  # ready() all the same: there is nothing to wait for
        self._rebuild_thread: threading.Thread | None = None
        self._volume = volume_of(self.root)  # where its volume must be mounted to be used
        self._start_pending = True  # the start's make has not returned (a hung filesystem)
        ended: list = []  # its error, or None, once it has
        try:
            made = run_bounded(self._io, self._make_root_at_start, [(ended,)], self.io_timeout_s,
                               self._late_op("mkdir of the root"), lambda _i: self._late_start(ended))
        except OSError as exc:
            if exc.errno not in FAILING or isinstance(exc, DiskInUse):
                raise ValueError(f"{self.uri}: cannot use {self.root} as the disk tier: "
                                 f"{exc.strerror or exc}") from None
            return self._start_down(exc)
        if made[0]:  # (else it returns past the deadline: _late_start)
            self._start_pending = False
            self._root_ready()

    def _start_down(self, exc: OSError) -> None:
        self._started_down = True
        self._probe_error = f"cannot use {self.root}: {exc.strerror or exc}"
        self._start_pending = False
        log.error("[disk] %s; the tier starts down: it serves nothing and drops its puts "
                  "until the probe finds the directory answering (every %g s)",
                  self._probe_error, PROBE_EVERY_S)
        if self._on_ready is not None:  # nothing to wait for (a start past its deadline)
            self._on_ready()

    def _late_start(self, ended: list) -> None:
        """(The I/O thread.) The start's make returned past its deadline: the index is rebuilt
        now, or, where it failed, the tier is down until the probe finds the root answering
        (whatever the error: the start cannot be refused any more). Before, the rebuild ran
        beside it, and a make that failed left a tier that stored without its lock."""
        self._late_returned()
        if not ended:  # cancelled before it ran: the probe makes it
            ended.append(OSError(errno.ETIMEDOUT, "the root was not made in time"))
        if ended[0] is not None:
            return self._start_down(ended[0])
        self._start_pending = False
        if self._closed.is_set():
            return self._root_lock.release()
        self._root_ready()

    def _make_root_at_start(self, ended: list) -> bool:
        try:  # (a root reached through a link: the volume of what it names; here, under the
            self._volume = volume_of(os.path.realpath(self.root))  # deadline: it stats the path)
            self._make_root()
        except OSError as exc:  # (on the I/O thread, under the start's deadline)
            ended.append(exc)
            raise
        ended.append(None)
        return True

    def _make_root(self) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)  # (a reader's may be a read-only view)
        self._root_id = owned.secure_root(self.root, tighten=self.local_keys)
        if self.local_keys and not os.access(self.root, os.W_OK) and not read_only_fs(self.root):
            raise PermissionError(errno.EACCES, "not writable", self.root)
        if self._root_lock.take(self.root, self.fsync):  # read-only (disk_errors.py)
            self._read_only_at_start()

    def _root_ready(self) -> None:
        self._root_made = True
        self._rebuild_thread = threading.Thread(target=self._rebuild, name="kvcached-disk-index",
                                                daemon=True)
        self._rebuild_thread.start()

    def _root_again(self) -> None:
        """(The probe, each round while the tier has no root: it started down, or its volume
        was mounted anew.) OSError while nothing is mounted where its volume was, the root does
        not answer, or another daemon took it meanwhile (DiskInUse); else the tier is up and
        its index rebuilt."""
        if self._root_made or self._start_pending:
            return
        if not is_mounted(self._volume):
            raise OSError(errno.ENODEV, f"nothing is mounted at {self._volume} (the filesystem "
                                        "beneath is not used)")
        self._make_root()
        if self._closed.is_set():
            self._root_lock.release()
            return
        log.warning("[disk] %s answers: the tier's lock is taken, its index is rebuilt", self.root)
        self._root_ready()

    def _root_now(self) -> os.stat_result:
        """(The probe, each round.) The root's stat, the tier up where it started down and the
        root answers (_root_again). A root that is another directory than the one indexed
        (_same_root: ESTALE) - a volume mounted anew where the tier's was (a FUSE or network
        filesystem remounted, another disk), or the directory removed and made again - is
        taken as at a start: the index forgotten, the lock taken there, the trial written and
        the directory listed, the deletes and the clear still owed done on what it holds.
        Before, the tier was down until the daemon restarted."""
        self._root_again()
        try:
            return self._same_root()
        except OSError as exc:
            if exc.errno != errno.ESTALE or self._late or not self.indexed.is_set() \
                    or not is_mounted(self._volume):
                raise  # (I/O on the old one, a listing not done; the filesystem beneath)
        log.warning("[disk] %s is another directory than the tier indexed (a volume mounted "
                    "anew): its index is forgotten and the directory indexed", self.root)
        self._forget_volume()
        self._root_again()
        return self._same_root()

    def _forget_volume(self) -> None:
        """(The probe.) The index of a directory the root no longer is: forgotten, and what is
        owed (deletes whose files were not removed, a clear not done) kept for the listing
        of the new one to do."""
        owed, clear = self._owed.keys(), self._owed.clear_owed
        with self._lock:
            self.used_bytes -= sum(self._lru.values())  # writes in flight keep their reservation
            self._lru.clear()
            self._suspects.clear()
            self._on_cleared()
            self.indexed.clear()
            self._meanwhile.deleted.update(owed)
            if clear and self._meanwhile.clear():
                self._clears.hold()  # the merge unlinks what it finds, then lets go
            self._meanwhile.owed.append(self._owed.cleared if clear else lambda: self._owed.settled(owed))
        self._unusable.clear()
        self._read_only = self._read_only_fixed = False  # (the new one's trial says)
        self._root_lock.release()
        self._root_made = False
        self._root_id = None

    def ready(self) -> bool:
        """Whether the tier has anything left to wait for: its index whole, or its root down
        since the start (it serves nothing until the probe finds it; status says why)."""
        return self.indexed.is_set() or self._started_down and not self._root_made

    def _join_rebuild(self) -> None:
        if self._rebuild_thread is not None:
            self._rebuild_thread.join(timeout=1.0)


def volume_of(root: str) -> str:
    """Where the volume root is on is mounted: the longest mount point of the mount table that
    holds root (a dead FUSE or network mount is still in it). The tier is used where its
    volume was only while a volume is mounted there: a dead mount the operator unmounts, or a
    volume unmounted under a running tier, leaves that path a directory of the filesystem
    beneath - a node's root disk, say - which the tier must not write onto."""
    points = _mount_points()
    if points is None:  # no mount table (not Linux): the root's filesystem, by its device
        return _mount_point_by_device(root)
    best = "/"
    for point in points:
        if (root == point or root.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best = point
    return best


def is_mounted(path: str) -> bool:
    """Whether a filesystem is mounted at path now ("/" is)."""
    points = _mount_points()
    if points is None:
        parent = os.path.dirname(path)
        return parent == path or os.stat(path).st_dev != os.stat(parent).st_dev
    return path == "/" or path in points


def _mount_points() -> set[str] | None:
    """The mount points of this process's mount table (/proc/self/mountinfo's fifth field,
    its octal escapes undone); None where there is none."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = f.read()
    except OSError:
        return None
    points = set()
    for line in table.splitlines():
        fields = line.split(b" ")
        if len(fields) > 4:
            points.add(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]),
                              fields[4]).decode(errors="surrogateescape"))
    return points


def _mount_point_by_device(root: str) -> str:
    path = root
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    dev = os.stat(path).st_dev
    while (parent := os.path.dirname(path)) != path and os.stat(parent).st_dev == dev:
        path = parent
    return path
