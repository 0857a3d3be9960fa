"""The disk tier's unlinks of forgotten records (a part of DiskBackend, disk.py), and their
retry once the filesystem answers again.

A delete, a clear, a void write and the index rebuild's merge forget their records at once and
unlink the files on an I/O thread; what waits on those unlinks (`then`: a clear's hold on its
mark, disk_clear.py; a delete owed in the run dir, disk_owed.py; a clear owed there) is called
once no file is left. An unlink that fails (EIO, EROFS, the volume away) leaves its file, never
read by this daemon. Before, what waited on it waited for the life of the daemon: a clear's mark
stayed and the next start cleared the tier again (every block stored since lost), an owed
clear or delete stayed on record likewise, and `deletes_owed` never went down. Such a batch is
kept - the keys whose files are still there, and what waits on them - and the probe tries it
again once the tier answers, is indexed and is writable, backing off while it keeps failing
(a file that cannot be removed for good costs a try a minute, never a busy loop). A key stored
again meanwhile is not unlinked (its new record is the one indexed).
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("kvcached.storage.disk")

RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0


class DiskUnlinks:
    """DiskBackend's unlinks, on the state its __init__ makes (its lock and index, `_io`, the
    probe's state); `_init_unlinks()` makes this part's own."""

    def _init_unlinks(self) -> None:
        self._unlinks_left: list[tuple[list, list]] = []  # (keys, then) to try again, under _lock
        self._unlinks_due = 0.0  # monotonic: not tried again before
        self._unlinks_wait = RETRY_FIRST_S  # the back-off, doubled by each try that fails
        self._unlinks_trying = 0  # files of the batches a retry has out of the list, not done

    def _unlink_later(self, keys, then=()) -> None:
        """Unlink on an I/O thread, unless the key was stored again meanwhile; then each of
        `then`."""
        if keys or then:
            self._io.submit(self._unlink_unless_indexed, list(keys), list(then))

    def _unlink_unless_indexed(self, keys, then=(), retried=False) -> bool:
        """True where no file is left (or the key was stored again); then each of `then`. Else
        the keys left and `then` are kept for the probe to try again (_retry_unlinks). `retried`:
        a batch a retry took out of the list (counted meanwhile, in `_unlinks_trying`)."""
        trying = len(keys) if retried else 0
        left, error, missing = [], None, []
        for key in keys:
            with self._lock:
                if key in self._lru:
                    continue
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                missing.append(key)  # never written, or gone already: nothing to remove
            except OSError as exc:  # left: not indexed, so never read (a clear's mark stays)
                left.append(key)
                error = exc
        if missing:  # unless the root is not the tier's directory now (its volume unmounted):
            try:  # the files may come back with it (disk_root.py)
                self._same_root()
            except OSError as exc:
                left, error = left + missing, exc
        if error is not None:
            self._unlink_failed(error, f"removing {len(left)} of {len(keys)} files")
            with self._lock:  # (back in the list as it leaves the count: never read as none)
                self._unlinks_trying -= trying
                if then:
                    self._unlinks_left.append((left, list(then)))
            return False
        try:
            for call in then:
                call()
        finally:  # (counted until what waited on them is let go: never 0 with it still owed)
            if trying:
                with self._lock:
                    self._unlinks_trying -= trying
        return True

    def _unlink_stale(self, stale, deleted, then) -> None:
        """(An I/O thread: the index rebuild's merge.) The files the listing found of keys
        cleared or deleted meanwhile. The deleted ones whose files are left are owed as deletes
        on record until they are gone, as a delete's are: before, only this run knew of them,
        and a restart indexed and served them."""
        unlinks = self._owed.begin(deleted)
        if not self._unlink_unless_indexed(stale, list(then) + [unlinks.done]):
            self._owed.unconfirmed(unlinks)

    def _retry_unlinks(self) -> None:
        """(The probe, a round that passed.) The unlinks that failed, tried again on an I/O
        thread while the tier is whole and writable, every RETRY_FIRST_S at first, then less
        often while they keep failing."""
        now = time.monotonic()
        with self._lock:
            if not self._unlinks_left or now < self._unlinks_due or not self.indexed.is_set() \
                    or self._read_only or self._late or not self._root_made:
                return
            batches, self._unlinks_left = self._unlinks_left, []
            self._unlinks_trying += sum(len(keys) for keys, _then in batches)
            self._unlinks_due = now + self._unlinks_wait
            self._unlinks_wait = min(RETRY_MAX_S, self._unlinks_wait * 2)
        log.info("[disk] %s: trying again %d unlinks that failed", self.root,
                 sum(len(keys) for keys, _then in batches))
        self._io.submit(self._try_again, batches)  # (one job: the I/O threads' reads and
        # writes are not queued behind thousands of small batches - failed void writes, say)

    def _try_again(self, batches) -> None:
        passed = [self._unlink_unless_indexed(keys, then, retried=True) for keys, then in batches]
        if all(passed):
            with self._lock:  # (what fails again is back in the list: it backs off still)
                if not self._unlinks_left:
                    self._unlinks_wait = RETRY_FIRST_S

    def unlinks_left(self) -> int:
        """Files that unlinks failed to remove, kept to try again or being tried again
        (status: `unlinks_left`)."""
        with self._lock:
            return sum(len(keys) for keys, _then in self._unlinks_left) + self._unlinks_trying
