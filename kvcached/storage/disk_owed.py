"""Disk deletes whose files were not gone when the delete answered: the filesystem hung (the
tier stuck, or the unlinks past their deadline) or an unlink failed. The keys are forgotten at
once (never read again by this daemon), but a daemon stopped before the unlinks would index the
files again at its next start and serve what was deleted. So such keys are kept in the daemon's
OwedRecord (owed_clear.py: `{run_dir}/{instance}.clears-owed`, not on the hung filesystem) until
their unlinks are done, and a daemon that finds them there at start deletes them again. Past
MAX_OWED_DELETES keys the record says the tier owes a clear instead (as a remote store's
deletes do), and the next start clears the tier."""
from __future__ import annotations

import threading
from typing import Callable

from .owed_clear import MAX_OWED_DELETES


class Unlinks:
    """One delete's unlinks: `done()` once every file is gone (or the key was stored again)."""

    def __init__(self, owed: "OwedUnlinks", keys):
        self._owed, self.keys = owed, frozenset(keys)
        self.finished = self.noted = False

    def done(self) -> None:
        self._owed._done(self)


class OwedUnlinks:
    def __init__(self, uri: str):
        self.uri = uri
        self._lock = threading.Lock()
        self._record = None
        self._owed: dict[bytes, int] = {}  # key -> deletes of it not done yet
        self.clear_owed = False  # on record: the next start clears the tier
        self._unmarked = 0  # clears whose mark could not be written, their unlinks not done
        self._must_clear = False  # a delete not kept (too many, or under an owed clear)
        self._epoch = 0  # cleared() so far

    def attach(self, record) -> tuple[bool, Unlinks | None]:
        """(At start.) Keep owed keys in record; whether the last run owed a clear (the caller
        clears the tier, then calls cleared()), and the unlinks it still owed, if any (owed
        until the caller has them done)."""
        with self._lock:
            self._record = record
            if record.owed(self.uri):
                return True, None
            keys = record.deletes(self.uri)
            if not keys:
                return False, None
            unlinks = Unlinks(self, keys)
            unlinks.noted = True
            for key in keys:
                self._owed[key] = self._owed.get(key, 0) + 1
            return False, unlinks

    def cleared(self) -> None:
        """The tier was cleared (its own mark keeps that clear whole across a stop)."""
        with self._lock:
            self.clear_owed = self._must_clear = False
            self._unmarked = 0
            self._epoch += 1  # (what an earlier unmarked clear's release says is moot)
            self._owed.clear()
            if self._record is not None:
                self._record.note_deletes(self.uri, ())
                self._record.note(self.uri, False)

    def clear_unmarked(self) -> Callable[[], None]:
        """A clear whose mark could not be written on the tier's filesystem (no inode left,
        read-only): owed on record in the run dir instead, before its index forgets anything,
        so a daemon stopped before its unlinks are done (killed, or they failed) clears the
        tier at its next start rather than index the old blocks again. Returns what releases
        it (from an I/O thread) once every file it forgot is gone: not owed any more, unless
        another such clear is or a delete went unkept meanwhile. One that comes after the
        tier was cleared whole (cleared(): a remount's listing, a start) releases nothing (its
        unlinks, failed and tried again, may end long after)."""
        with self._lock:
            self._unmarked += 1
            self.clear_owed = True
            if self._record is not None:
                self._record.note(self.uri, True)
            epoch = self._epoch

        def done() -> None:
            with self._lock:
                if epoch != self._epoch:
                    return
                self._unmarked -= 1
                if self._unmarked or self._must_clear:
                    return
                self.clear_owed = False
                if self._record is not None:
                    self._record.note(self.uri, False)
                self._write()
        return done

    def begin(self, keys) -> Unlinks:
        return Unlinks(self, keys)

    def unconfirmed(self, unlinks: Unlinks) -> None:
        """The delete answers: its keys are owed unless their unlinks are done already."""
        with self._lock:
            if unlinks.finished or not unlinks.keys:
                return
            if self.clear_owed:  # (not kept: the owed clear removes them)
                self._must_clear = True
                return
            if len(self._owed.keys() | unlinks.keys) > MAX_OWED_DELETES:
                self.clear_owed = self._must_clear = True  # on record before the keys go
                if self._record is not None:
                    self._record.note(self.uri, True)
                self._owed.clear()
                self._write()
                return
            unlinks.noted = True
            for key in unlinks.keys:
                self._owed[key] = self._owed.get(key, 0) + 1
            self._write()

    def _done(self, unlinks: Unlinks) -> None:
        with self._lock:
            unlinks.finished = True
            if not unlinks.noted:
                return
            for key in unlinks.keys:
                left = self._owed.pop(key, 1) - 1  # (gone: an owed clear took them over)
                if left:
                    self._owed[key] = left
            self._write()

    def keys(self) -> set[bytes]:
        with self._lock:
            return set(self._owed)

    def settled(self, keys) -> None:
        """The keys' files are gone (a listing found and removed them, or found none): owed no
        more, whatever unlinks of them are still pending."""
        with self._lock:
            for key in keys:
                self._owed.pop(key, None)
            self._write()

    def count(self) -> int:
        with self._lock:
            return len(self._owed)

    def _write(self) -> None:
        if self._record is not None:
            self._record.note_deletes(self.uri, self._owed.keys())


def after(n: int, call: Callable[[], None]) -> Callable[[], None]:
    """What calls `call` at its n-th call (from any thread)."""
    left, lock = [n], threading.Lock()

    def tick() -> None:
        with lock:
            left[0] -= 1
            now = left[0] == 0
        if now:
            call()
    return tick
