"""Writing one disk-tier record: a temp file in the key's shard, then os.replace, so a crash
leaves either the old state or the whole new file, never half a block (disk.py)."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from typing import Callable

from .disk_read import read_record
from .record import GEOMETRY_BYTES, HEADER_BYTES, BadRecord, pack_header

log = logging.getLogger(__name__)

NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # a full filesystem, or a quota met
_OPEN_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_record(path: str, key: bytes, pieces, size: int, geometry: bytes,
                 fsync: bool, check_root: Callable[[], None] | None = None) -> OSError | None:
    """The record of key at path; None when it is in place, else the error (nothing of it is
    left behind). A missing shard directory is made (its first put, or removed under us), once
    check_root() has not raised: the root is still the tier's own directory."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        try:
            fd = os.open(tmp, _OPEN_TEMP, 0o600)
        except FileNotFoundError:
            if check_root is not None:
                check_root()
            with contextlib.suppress(FileExistsError):  # (another I/O thread's put made it)
                os.mkdir(os.path.dirname(path), 0o700)
            fd = os.open(tmp, _OPEN_TEMP, 0o600)
        try:
            _write_all(fd, [pack_header(key, pieces, geometry), *pieces], size)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno != errno.EEXIST:  # EEXIST: not our file, leave it
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                log.debug("[disk] no temp file to remove after the failed write")
        return exc
    return None


def _write_all(fd: int, pieces, total: int) -> None:
    """writev, continuing after a short write (a full disk raises ENOSPC from the next call)."""
    done = os.writev(fd, pieces)
    if done == total:
        return
    flat = memoryview(b"".join(bytes(p) for p in pieces))  # rare: finish the rest plainly
    while done < total:
        done += os.write(fd, flat[done:])


TRIAL = ".kvcached.trial"  # (in the root, beside the shards: the listing never reads it)


def trial(root: str, say_full: bool = True, fsync: bool = False) -> None:
    """(A writing tier's start, and its probe after I/O errors: disk_errors.py.) One record
    written as every put writes it (a temp file opened O_EXCL|O_NOFOLLOW, then os.replace), read
    back and removed: a filesystem that cannot do one of these (a bucket mount without rename)
    raises OSError here, named, rather than failing every put of the daemon's life, each logged.
    A full one passes (said where say_full): the tier evicts for room. With fsync, synced as
    the tier's puts are (a disk whose fsync fails fails it)."""
    for name in os.listdir(root):
        if name.startswith(TRIAL) and name.endswith(".tmp"):  # a crashed start's
            os.unlink(os.path.join(root, name))
    path, payload, key = os.path.join(root, TRIAL), os.urandom(4096), os.urandom(16)
    geometry = os.urandom(GEOMETRY_BYTES)
    size = HEADER_BYTES + len(payload)
    err = write_record(path, key, [payload], size, geometry, fsync)
    if err is not None and err.errno in NO_ROOM:
        if say_full:
            log.warning("[disk] %s: no room for a trial record (%s); the tier starts full", root,
                        err.strerror)
        return
    if err is not None:
        raise OSError(err.errno, f"a record cannot be written there ({err.strerror})")
    try:
        back = bytearray(len(payload))
        read_record(path, key, [back], geometry)  # as a get reads it
        if back != payload:
            raise BadRecord("other bytes")
    except BadRecord as exc:
        raise OSError(errno.EIO, f"a record written there reads back otherwise ({exc})") from None
    except OSError as exc:
        raise OSError(exc.errno, f"a record written there cannot be read back ({exc.strerror})") from None
    finally:
        os.unlink(path)
