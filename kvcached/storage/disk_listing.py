"""The disk tier's index rebuild: what the shard directories hold, as the disk tier names its
files (`{root}/{key[0] as 2 hex}/{key as 32 hex}.kvb`, disk.py)."""
from __future__ import annotations

import logging
import os
import re
import stat

from . import owned

log = logging.getLogger("kvcached.storage.disk")

_NAME_RE = re.compile(r"^[0-9a-f]{32}\.kvb$")
_SHARD_RE = re.compile(r"^[0-9a-f]{2}$")
PROGRESS_EVERY = 100_000
MAX_DELETED_WHILE_INDEXING = 262_144  # keys (~25 MB) kept for the merge; more: the delete waits


def list_records(root: str, unusable: set[int]) -> tuple[list, int]:
    """(mtime_ns, key, size) of every record file of this uid in the usable shards, and how
    many other files were removed (temp files of a crashed write, links, FIFOs, another user's
    files); a directory where a record goes is left alone, and so is a temp file of this
    process (a put running beside the listing: removing it failed that put). (A tier that does
    not write lists nothing: disk_read.py.)"""
    found, removed = [], 0
    foreign = 0
    own_temp = f".kvb.{os.getpid()}."  # disk.py names its temp files {record}.{pid}.{thread}.tmp
    for shard in os.scandir(root):
        if not (shard.is_dir(follow_symlinks=False) and _SHARD_RE.match(shard.name)) \
                or int(shard.name, 16) in unusable:
            continue
        try:
            records, gone, others = _list_shard(shard, own_temp)
        except OSError as exc:  # this shard alone: the others' records are indexed
            log.error("[disk] shard %s cannot be listed (%s): left unused (no record in it is "
                      "served or written) until a start lists it", shard.path, exc)
            unusable.add(int(shard.name, 16))
            continue
        found += records
        removed, foreign = removed + gone, foreign + others
        if len(found) // PROGRESS_EVERY > (len(found) - len(records)) // PROGRESS_EVERY:
            log.info("[disk] indexing %s: %d files", root, len(found))
    if foreign:
        log.warning("[disk] %s: %d files of other users among the records (planted?); removed, "
                    "never served", root, foreign)
    return found, removed


def _list_shard(shard: os.DirEntry, own_temp: str) -> tuple[list, int, int]:
    """list_records' part for one shard: its records, the files removed, the other users'."""
    found, removed, foreign = [], 0, 0
    for entry in os.scandir(shard.path):
        st = entry.stat(follow_symlinks=False)
        if (_NAME_RE.match(entry.name) and entry.name.startswith(shard.name)
                and stat.S_ISREG(st.st_mode) and owned.is_ours(st)):
            found.append((st.st_mtime_ns, bytes.fromhex(entry.name[:32]), st.st_size))
        elif stat.S_ISDIR(st.st_mode):
            log.warning("[disk] %s: a directory where records go; left alone", entry.path)
        elif own_temp in entry.name and entry.name.endswith(".tmp") and owned.is_ours(st):
            continue  # this process's write in progress
        else:  # temp files of a crashed write, links, FIFOs, another user's files
            foreign += not owned.is_ours(st)
            try:
                os.unlink(entry.path)
                removed += 1
            except OSError as exc:  # left, never read (a read-only filesystem's)
                log.warning("[disk] %s cannot be removed (%s); left, never read", entry.path,
                            exc.strerror)
    return found, removed, foreign


class WhileIndexing:
    """What happened while the index was rebuilt, which what the listing found must not undo:
    the keys deleted meanwhile and whether a clear came (DiskBackend._merge). The keys are kept
    until the index is whole - for ever on a filesystem whose listing hangs - so a delete that
    would keep more than MAX_DELETED_WHILE_INDEXING waits (`refused`: BUSY, nothing changed;
    60 deletes of 65,536 keys grew the daemon by 380 MB in 8 s with the listing hung)."""

    def __init__(self):
        self.deleted: set[bytes] = set()
        self.cleared = False
        # what is owed on record in the run dir until the merge has removed the files it found:
        # deletes of keys the listing had not reached, a clear whose mark could not be written
        # (a stop before then: the next start does them again); each called once it has
        self.owed: list = []

    def refused(self, n: int) -> str | None:
        if len(self.deleted) + n <= MAX_DELETED_WHILE_INDEXING:
            return None
        return (f"rebuilding its index, it keeps the keys deleted meanwhile (at most "
                f"{MAX_DELETED_WHILE_INDEXING}); delete these keys once storage is ready "
                "(status: storage_ready), or fewer at a time")

    def clear(self) -> bool:
        """A clear came: True at the first (its mark is held for the merge)."""
        first, self.cleared = not self.cleared, True
        return first

    def reset(self) -> tuple[bool, list]:
        """The index is whole: forget the keys; whether a clear came meanwhile, and what
        to call once the merge's unlinks are done."""
        cleared, self.cleared = self.cleared, False
        owed, self.owed = self.owed, []
        self.deleted.clear()
        return cleared, owed
