"""The disk tier's clears, kept whole across a crash and against writes begun before them.

A clear forgets every record at once (disk.py's index) and unlinks the files afterwards on an
I/O thread: hundreds of thousands of files take seconds. Two things could bring a cleared
record back - after a weight update, the old weights' KV:

- a stop or a crash before the unlinks are done: the next start would index what is left.
  So a clear first makes the mark `{root}/.clearing` (and syncs the root, so the mark is on
  disk before any record is gone from the index), and removes it once every file it dropped
  is unlinked and no write begun before it is still running. A tier that starts and finds the
  mark finishes the clear: every record it lists goes, none is indexed.
- a write begun before the clear that lands after it (a slow or hung filesystem): each clear
  is a new generation; a write of an older one is void - its file removed, never indexed. So
  is a write of a key deleted while it ran (`delete`).
  While a write of a key runs, no other write of that key starts (it could land first and be
  overwritten by the void one between its rename and its removal).
"""
from __future__ import annotations

import collections
import logging
import os
import threading

log = logging.getLogger("kvcached.storage.disk")

MARK = ".clearing"


class DiskClears:
    def __init__(self, root: str):
        self.path = os.path.join(root, MARK)
        self._root = root
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()  # making and removing the mark, one at a time
        self.gen = 0  # clears so far
        self._writing: collections.Counter = collections.Counter()  # generation -> writes running
        self._keys: set[bytes] = set()  # keys being written
        self._deleted: set[bytes] = set()  # of those, the keys deleted since their write began
        self._unlinking = 0  # clears (or a start's finishing one) whose files are not all gone
        self.marked = False  # the mark is on disk (or may be)

    # writes ---------------------------------------------------------------
    def write_begins(self, key: bytes) -> int | None:
        """The generation a write of key runs under; None while another write of key runs."""
        with self._lock:
            if key in self._keys:
                return None
            self._keys.add(key)
            self._writing[self.gen] += 1
            return self.gen

    def void(self, gen: int, key: bytes) -> bool:
        """A clear came after the write of generation gen began, or a delete of key: its
        record must not stay."""
        with self._lock:
            return gen != self.gen or key in self._deleted

    def deleted(self, key: bytes) -> None:
        """key is deleted: a write of it running now is void."""
        with self._lock:
            if key in self._keys:
                self._deleted.add(key)

    def write_ends(self, key: bytes, gen: int) -> None:
        with self._lock:
            self._keys.discard(key)
            self._deleted.discard(key)
            self._writing[gen] -= 1
            if not self._writing[gen]:
                del self._writing[gen]
        self._maybe_unmark()

    # clears ---------------------------------------------------------------
    def found_at_start(self) -> bool:
        """(The index rebuild.) A clear the last run did not finish: the caller finishes it
        (every record it lists goes) and calls unlinked() once those files are gone."""
        if not os.path.exists(self.path):
            return False
        with self._lock:
            self.marked = True
            self._unlinking += 1
        log.warning("[disk] %s: the last run stopped during a clear; every record found goes",
                    self._root)
        return True

    def hold(self) -> None:
        """A clear begins (or the index rebuild must finish one): the mark stays until the
        matching unlinked()."""
        with self._lock:
            self._unlinking += 1

    def mark(self) -> None:
        """(An I/O thread.) The mark, synced, before the index forgets anything."""
        with self._file_lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _sync_dir(self._root)
            with self._lock:
                self.marked = True

    def new_generation(self) -> None:
        """(Under the tier's lock, as its index is emptied.) Writes begun before are void."""
        with self._lock:
            self.gen += 1

    def unlinked(self) -> None:
        """(An I/O thread.) The files one hold() was for are gone."""
        with self._lock:
            self._unlinking -= 1
        self._maybe_unmark()

    def _maybe_unmark(self) -> None:
        if not self.marked:  # the common case, without waiting on a mark() in progress
            return
        with self._file_lock:  # a mark() of a newer clear waits: this never removes its mark
            with self._lock:
                if not self.marked or self._unlinking or any(g < self.gen for g in self._writing):
                    return
                self.marked = False
            try:
                os.unlink(self.path)
                _sync_dir(self._root)
            except FileNotFoundError:
                pass
            except OSError as exc:  # it stays: the next start clears again (safe, not wrong)
                log.warning("[disk] %s: cannot remove the clear's mark: %s", self._root, exc)


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
