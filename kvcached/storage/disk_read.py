"""Reading disk-tier records (disk.py): one record into a host page, and, for a tier that does
not write (`--no-storage-writer`: the ranks of an MLA model but one, on the writer rank's
directory), which of a chain's records are there now.

A reader's index is only what its start listed: the writer's puts since then, and its
evictions, are not in it. Before, a reader found none of the blocks the writer stored after the
reader started (a tensor-parallel group's lookup, the least of its ranks', had no storage hits
for them), and reported blocks the writer had evicted. So a reader keeps no index (it lists
nothing at start) and looks at the files themselves: its lookups stat them (on an I/O thread, with a lookup's deadline), its reads open
them whether indexed or not, and it removes nothing (a damaged record, a delete's or a clear's
files are the writer's to remove). A clear - a weight update's, fanned out to every rank - hides
from a reader every file written before it (by its mtime) whatever the writer's unlinks have
done yet, and a reader that starts while the writer's clear is under way (its mark) hides the
files written before the mark. (A filesystem's file times come from a clock no later than
time.time_ns(): a file written after a clear in the same tick is hidden too, a miss, not
wrong bytes.)"""
from __future__ import annotations

import errno
import os
import stat
import time

from . import owned
from .record import HEADER_BYTES, BadRecord, check_header, check_payload, nbytes

OPEN_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
READER_LOOKUP_S = 0.25  # a reader's stat of a lookup's files: at most this long (as Redis's)


def read_record(path: str, key: bytes, pieces, geometry: bytes, after_ns: int = 0) -> None:
    """The record of key at path into pieces; BadRecord where it is not a whole, intact record
    of key from this geometry (a FIFO or a link in its place included: opened non-blocking,
    without following links), OSError (FileNotFoundError: not there, or written at or before
    after_ns)."""
    want = nbytes(pieces)
    try:
        fd = os.open(path, OPEN_READ)
    except OSError as exc:  # (ELOOP: O_NOFOLLOW met a link; not an error of the filesystem)
        if exc.errno == errno.ELOOP:
            raise BadRecord("a link in place of the record") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_mtime_ns <= after_ns:
            raise FileNotFoundError(errno.ENOENT, "written before the last clear", path)
        if not stat.S_ISREG(st.st_mode):
            raise BadRecord("not a regular file")
        if not owned.is_ours(st):
            raise BadRecord(f"a file of uid {st.st_uid}, not this daemon's")
        crc = check_header(os.read(fd, HEADER_BYTES), key, want, geometry)
        if os.readv(fd, pieces) != want or os.read(fd, 1):
            raise BadRecord("short or long file")
    finally:
        os.close(fd)
    check_payload(pieces, crc)


def files_prefix(paths, after_ns: int) -> int:
    """How many leading paths are record files of this user written after after_ns."""
    n = 0
    for path in paths:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            break
        if not (stat.S_ISREG(st.st_mode) and owned.is_ours(st)) or st.st_mtime_ns <= after_ns:
            break
        n += 1
    return n


class ReaderTier:
    """DiskBackend's part as a reader (its local_keys False: it keeps no index, lists nothing
    at start and unlinks nothing - a delete of it does nothing), on the clears' mark its
    __init__ makes and `_written_after_ns`."""

    def _reader_clear(self) -> int:
        """A reader's clear: every file written before it is hidden from now on (the writer
        unlinks them). Nothing indexed to count: 0."""
        self._written_after_ns = time.time_ns()
        return 0

    def _reader_start(self) -> None:
        """(In place of its index rebuild.) A reader finishes no clear; one under way, the
        writer's mark there, hides what was written before the mark."""
        try:
            self._written_after_ns = max(self._written_after_ns, os.stat(self._clears.path).st_mtime_ns)
        except OSError:
            pass
