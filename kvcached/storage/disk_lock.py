"""One daemon per disk-tier directory. A tier's index is its own process's (built from the files
at start, kept in memory after), so two daemons on one directory - one config file for every GPU
of a node is enough - each evicted for a capacity it thought its own, neither found what the
other wrote, a clear of one emptied both, and a start of one removed the other's writes in
progress as a crashed write's leftovers. The root holds a lock file (flock: the kernel drops it
however the daemon dies) for the tier's life; a second tier on it is refused at start, naming
the holder. Daemons share blocks through a redis:// or mooncake:// tier; the one exception, the
ranks of an MLA model, share the writer rank's directory with `--no-storage-writer` (RootLock).
Holding the lock, a writer writes a trial record there as its puts do, reads it back and
removes it (disk_write.trial): a filesystem that cannot keep a record is refused at start (one
that fails - EIO - starts the tier down: disk_root.py), one
that is read-only (EROFS) is a tier that serves what it holds and stores nothing, with no lock
(no one writes there), until a restart finds the filesystem writable (disk_errors.py).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat

from . import disk_write
from .disk_write import NO_ROOM

LOCK_NAME = ".kvcached.lock"
UNLOCKABLE = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # NFS mounted nolock, some FUSE
log = logging.getLogger(__name__)
_OPEN = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class DiskInUse(OSError):
    """Another disk tier (this daemon's or another's) holds the directory."""


def hold(root: str) -> int:
    """Take the root's lock and write this pid in it; its fd (close it to let go), -1 where a
    filesystem without room (no inode) cannot make the lock file: a full filesystem must not
    keep the daemon from starting (the tier evicts for room), so that is a warning, as a
    filesystem that takes no locks is. DiskInUse where another tier holds it. A lock file that
    is not a regular file of this user was planted: it is removed and made anew."""
    path = os.path.join(root, LOCK_NAME)
    for _ in range(2):
        try:
            fd = os.open(path, _OPEN, 0o600)
        except OSError as exc:
            if exc.errno in NO_ROOM:
                log.warning("[disk] %s: no room for the lock file (%s): nothing keeps a second "
                            "daemon off this directory until a start makes it", root, exc.strerror)
                return -1
            if exc.errno == errno.EROFS:  # nothing writes there: the tier stays read-only
                return -1
            if exc.errno != errno.ELOOP:  # (a link in its place: removed below)
                raise
            os.unlink(path)
            continue
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            break
        os.close(fd)
        os.unlink(path)
    else:
        raise OSError(errno.EEXIST, f"{path} is not this user's file and keeps coming back")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        why = ("in use by this daemon already: its --storage names the directory twice"
               if holder == str(os.getpid()) else
               f"in use by the daemon of pid {holder}; give each daemon a directory of its own "
               "(daemons share blocks through a redis:// or mooncake:// tier)")
        raise DiskInUse(errno.EBUSY, why) from None
    except OSError as exc:
        if exc.errno not in UNLOCKABLE:
            os.close(fd)
            raise
        log.warning("[disk] %s: the filesystem takes no locks (%s): nothing keeps a second daemon "
                    "off this directory; give each daemon its own", root, exc.strerror)
    os.ftruncate(fd, 0)
    try:
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:  # held all the same: a second tier is refused, not told by whom
        if exc.errno not in NO_ROOM:
            os.close(fd)
            raise
    return fd


class RootLock:
    """A tier's hold on its root: taken once, released at the tier's close (or by the kernel).
    A tier that does not write (`--no-storage-writer`: the ranks of an MLA model but one, which
    share the writer's directory and read it) takes none, and removes nothing it finds."""

    def __init__(self, writer: bool = True):
        self.writer = writer
        self._fd = -1

    def take(self, root: str, fsync: bool = False) -> bool:
        """A writer's hold, then a trial record (disk_write.trial: OSError where the
        filesystem cannot keep one, the hold let go). True where the filesystem is read-only
        (EROFS: no lock file, no trial): the tier serves what is there, until a restart."""
        if not self.writer:
            return False
        read_only = read_only_fs(root)
        self._fd = -1 if read_only else hold(root)
        try:
            if not read_only:
                disk_write.trial(root, fsync=fsync)
        except OSError as exc:
            if exc.errno != errno.EROFS:
                self.release()
                raise
            read_only = True
        except BaseException:
            self.release()
            raise
        if read_only:
            self.release()
        return read_only

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def read_only_fs(root: str) -> bool:
    """Whether the filesystem of root is mounted read-only (ext4 gone read-only at an error
    is not: its writes say so, EROFS)."""
    return bool(os.statvfs(root).f_flag & os.ST_RDONLY)
