"""Reading disk-tier records (disk.py): one record into a host page, and, for a tier that does
not write (`--no-storage-writer`: the ranks of an MLA model but one, on the writer rank's
directory), which of a chain's records are there now.

A reader's index is only what its start listed: the writer's puts since then, and its
evictions, are not in it. Before, a reader found none of the blocks the writer stored after the
reader started (a tensor-parallel group's lookup, the least of its ranks', had no storage hits
for them), and reported blocks the writer had evicted. So a reader looks at the files
themselves: its lookups stat them (on an I/O thread, with a lookup's deadline), its reads open
them whether indexed or not, and it removes nothing it reads (a damaged record is the writer's
to remove)."""
from __future__ import annotations

import os
import stat

from . import owned
from .record import HEADER_BYTES, BadRecord, check_header, check_payload, nbytes

OPEN_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
READER_LOOKUP_S = 0.25  # a reader's stat of a lookup's files: at most this long (as Redis's)


def read_record(path: str, key: bytes, pieces, geometry: bytes) -> None:
    """The record of key at path into pieces; BadRecord where it is not a whole, intact record
    of key from this geometry (a FIFO or a link in its place included: opened non-blocking,
    without following links), OSError (FileNotFoundError: not there)."""
    want = nbytes(pieces)
    fd = os.open(path, OPEN_READ)
    try:
        st = os.fstat(fd)
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


def files_prefix(paths) -> int:
    """How many leading paths are record files of this user now."""
    n = 0
    for path in paths:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            break
        if not (stat.S_ISREG(st.st_mode) and owned.is_ours(st)):
            break
        n += 1
    return n
