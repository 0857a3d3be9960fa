"""The disk tier: one file per block under 256 shard directories.

    {root}/{key[0] as 2 hex}/{key as 32 hex}.kvb      (record.py format; the stored key)

Writes go to a temp file in the same shard, then os.replace: a crash leaves either the old state
or the whole new file, never half a block. The file name is the key, so the index is rebuilt by
listing the shards at start (in a background thread; the tier reports no hits until it is done,
and puts, deletes and clears made meanwhile win over what the listing finds), oldest
modification first for LRU. Capacity is enforced by evicting the least recently used files; a
chain put or read together is ordered head-last, so a prefix loses its tail first and what stays
is still a loadable prefix; an offload's chain evicts none of its own earlier blocks and keeps
its head where it is larger than the room (disk_room.py). A filesystem that fills up below the capacity (ENOSPC, of bytes or
inodes: it is smaller, or shared) sets a lower limit - a few blocks under what the filesystem
holds for the tier then - and the tier evicts to stay under it, so new blocks keep coming in;
status says `full` with `limit_bytes` (logged once), and the probe raises the limit again as the
filesystem frees room. fsync is off by default (a crash may lose recent blocks, never corrupt one: torn
files fail their checksum); `?fsync=1` turns it on. One tier per root (disk_lock.py).

No file I/O runs on the caller's thread without a deadline (iothreads.py): reads and writes run
on I/O threads, and one that has not returned after `io_timeout_s` (default 5) is reported late
(its key a miss, its page on loan until it returns), and the tier is `stuck`: unhealthy, no
hits, puts dropped, until every late operation has returned. A probe stats the root once a
second on its own thread, so an idle tier on a hung filesystem shows it too. Records are opened
non-blocking and without following links, and anything but a regular file is damage (a FIFO in
place of a record would otherwise block its reader forever). A read or write that fails with
an error of the filesystem (EIO), or a filesystem gone read-only, is told apart from a damaged
record by a trial record the probe writes (disk_errors.py). A filesystem that fails at start
starts the tier down until it answers, and a volume mounted anew under it is indexed
(disk_root.py).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable, Sequence

from . import disk_lock
from .base import StorageBackend
from .disk_clear import DiskClears
from .disk_errors import DiskErrors
from .disk_health import PROBE_EVERY_S, DiskHealth
from .disk_listing import WhileIndexing, list_records
from .disk_owed import OwedUnlinks, after
from .disk_read import READER_LOOKUP_S, ReaderTier, files_prefix, read_record
from .disk_room import ENOSPC_TRIES, DiskRoom
from .disk_root import DiskRoot
from .disk_unlinks import DiskUnlinks
from .disk_write import NO_ROOM, write_record
from .iothreads import IOThreads, run_bounded
from .record import HEADER_BYTES, BadRecord, nbytes
from .uris import DISK_IO_TIMEOUT_S, parse_disk_uri

log = logging.getLogger(__name__)

# file I/O and checksums release the GIL: a few blocks in flight (2 best on 2 cores; more take more)
IO_THREADS = max(2, min(8, os.cpu_count() or 2))
IO_TIMEOUT_S = DISK_IO_TIMEOUT_S


class DiskBackend(DiskRoot, DiskUnlinks, DiskErrors, DiskHealth, DiskRoom, ReaderTier, StorageBackend):
    local_keys = True  # its index is this process's: the key table can publish it (watch_keys)
    keeps_chains = True  # (StorageBackend: a chain larger than the room keeps its head)

    def __init__(self, root: str, capacity_bytes: int, fsync: bool = False, uri: str = "",
                 io_timeout_s: float = IO_TIMEOUT_S, on_ready: Callable[[], None] | None = None,
                 writer: bool = True):
        self.root = os.path.abspath(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.local_keys = writer  # a reader's index is not the directory's (disk_read.py)
        self._written_after_ns = 0  # (a reader) files written at or before this are not served
        self.uri = uri or f"disk://{self.root}"
        self.io_timeout_s = io_timeout_s
        self._lock = threading.Lock()
        self._evicting = threading.Condition(self._lock)  # victims chosen, files not yet unlinked
        self._victim_bytes = 0  # (their records' bytes)
        self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.used_bytes = 0
        self.counters = {"puts": 0, "gets": 0, "put_errors": 0, "corrupt": 0, "evicted": 0,
                         "dropped_puts": 0, "late_io": 0, "enospc": 0, "io_errors": 0}
        self.last_error = ""
        self.limit_bytes = capacity_bytes  # lowered when the filesystem fills up first
        self._block_bytes = 0  # size of the last record written (the probe's slack)
        self._quota_met = False  # EDQUOT met: the limit stays lowered (disk_room.py)
        self._late = 0  # I/O operations past their deadline that have not returned yet
        self._meanwhile = WhileIndexing()  # deletes and clears before the index was whole
        self._clears = DiskClears(self.root)  # a clear's mark and generations (disk_clear.py)
        # deletes whose files are not gone yet (disk_owed.py), on record under the root alone
        # (a restart with other options, capacity_gb say, finds them)
        self._owed = OwedUnlinks(f"disk://{self.root}")
        self._probe_since = 0.0  # monotonic start of the probe in progress, 0 when none
        self._probe_error = ""
        self._root_id: tuple[int, int] | None = None  # (device, inode) of the root at start
        self._closed = threading.Event()
        self._probe_wake = threading.Event()  # the probe's next round now (a close, an I/O error)
        self._init_errors()  # (disk_errors.py)
        self._init_unlinks()  # failed unlinks tried again (disk_unlinks.py)
        self._unusable: set[int] = set()  # shards of another user (owned.py): never read or written
        self._on_ready = on_ready
        self._on_keys = _ignore  # (stored names, held?) as the index changes, under the lock
        self._on_cleared = _ignore
        self._on_health: Callable[[], None] = _ignore  # the tier stopped or started answering
        self._io = IOThreads(IO_THREADS, "kvcached-disk")
        # (a reader) its lookups' stats: behind loads' reads they missed their deadline
        self._stat_io = None if writer else IOThreads(1, "kvcached-disk-stat")
        self._root_lock = disk_lock.RootLock(writer)  # (taken with the root, by a writer)
        self._start_root()  # (disk_root.py: the index rebuilt once the root answers)
        self._prober = threading.Thread(target=self._probe, name="kvcached-disk-probe", daemon=True)
        self._prober.start()

    @classmethod
    def from_uri(cls, uri: str, on_ready: Callable[[], None] | None = None, writer: bool = True):
        o = parse_disk_uri(uri)
        return cls(o["root"], o["capacity_bytes"], o["fsync"], uri, o["io_timeout_s"], on_ready, writer)

    # index ----------------------------------------------------------------
    def watch_keys(self, on_keys: Callable[[list, bool], None], on_cleared: Callable[[], None],
                   on_health: Callable[[], None]) -> None:
        """Tell on_keys(names, True) every stored name indexed now, then every change of the
        index as it happens (names, held?) and on_cleared() when it is cleared: called under the
        index's lock, so what the watcher sees is the index's order of events. on_health() is
        called (without the lock) when the tier stops answering or answers again."""
        with self._lock:
            self._on_keys, self._on_cleared, self._on_health = on_keys, on_cleared, on_health
            on_keys(list(self._lru), True)

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + ".kvb")

    def _rebuild(self) -> None:
        started, removed = time.monotonic(), 0
        try:
            if not self.local_keys:  # a reader lists nothing: it looks at the files (disk_read.py)
                return self._reader_start()
            for shard in range(256):  # checked once here, not stat'ed on every put
                if not self._usable_shard(os.path.join(self.root, f"{shard:02x}")):
                    self._unusable.add(shard)
            finishing = self._clears.found_at_start()
            found, removed = list_records(self.root, self._unusable)
            self._merge(found, finishing)
            log.info("[disk] %s: %d blocks (%.2f GiB) indexed in %.1f s, %d stray files removed",
                     self.root, len(self._lru), self.used_bytes / 2**30,
                     time.monotonic() - started, removed)
            self._evict_over_capacity(0)  # a smaller capacity than last time
        except OSError as exc:
            self.last_error = f"index rebuild failed: {exc}"
            log.error("[disk] %s", self.last_error)
        finally:
            self.indexed.set()
            if self._on_ready is not None:
                self._on_ready()

    def _merge(self, found: list, finishing: bool = False) -> None:
        """Add what the listing found, oldest first, under what happened meanwhile: a key put
        since is already indexed (and counted once), a key deleted or cleared since goes. With
        finishing (a clear the last run did not finish), everything found goes."""
        found.sort()
        stale, deleted = [], []
        with self._lock:
            cleared = self._meanwhile.cleared or finishing
            known = dict(self._lru)
            self._lru.clear()
            added = []
            for _mtime, key, size in found:
                if key in known:
                    continue
                if cleared or key in self._meanwhile.deleted:
                    stale.append(key)
                    if not cleared:  # (else the clear's mark, or its owed record, covers it)
                        deleted.append(key)
                    continue
                self._lru[key] = size
                self.used_bytes += size
                added.append(key)
            self._lru.update(known)  # newest: the puts made while indexing
            self._on_keys(added, True)
            held, owed = self._meanwhile.reset()  # a clear meanwhile held its mark for this
        self._io.submit(self._unlink_stale, stale, deleted,
                        [self._clears.unlinked] * (held + finishing) + owed)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self.used_bytes -= size
                self._on_keys([key], False)

    # interface ------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        if not self.indexed.is_set() or not self.health():  # stuck, or the root is gone
            return 0
        if not self.local_keys:  # a reader: the writer's files as they are now (disk_read.py)
            paths = [self._path(k) for k in keys]
            n = run_bounded(self._stat_io, files_prefix, [(paths, self._written_after_ns)], READER_LOOKUP_S,
                            self._late_op("a lookup's stat"), lambda _i: self._late_returned())[0]
            return n or 0
        n = 0
        with self._lock:
            suspects = self._suspects  # (disk_errors.py: not served until the probe's trial)
            for key in keys:
                if key not in self._lru or suspects and key in suspects:
                    break
                n += 1
            self._touch_chain(keys[:n])
        return n

    def holds(self, names: Sequence[bytes]) -> list[bool]:
        """Whether the index holds each stored name now (what watch_keys has told)."""
        with self._lock:
            return [name in self._lru for name in names]

    def _touch_chain(self, keys) -> None:
        """Mark a chain's blocks used, its head last: under capacity pressure a prefix loses
        its tail first and what stays is still a whole, loadable prefix (the order does not
        depend on which worker thread finished first). Called under the lock."""
        for key in reversed(keys):
            if key in self._lru:
                self._lru.move_to_end(key)

    def get_into(self, keys, buffers, geometry, release=None) -> list:
        if self._stuck():
            return [False] * len(keys)
        items = [(k, b, geometry) for k, b in zip(keys, buffers)]
        got = run_bounded(self._io, self._get_one, items, self.io_timeout_s,
                          self._late_op("a block read"), self._on_late_done(release))
        with self._lock:
            self._touch_chain([k for k, ok in zip(keys, got) if ok])
        return got

    def _on_late_done(self, release):
        def done(i: int) -> None:
            self._late_returned()
            if release is not None:
                release(i)
        return done

    def _get_one(self, key: bytes, pieces, geometry: bytes) -> bool:
        with self._lock:
            if key not in self._lru and self.local_keys:  # (a reader opens what it was not told)
                return False
        try:
            read_record(self._path(key), key, pieces, geometry, self._written_after_ns)
        except FileNotFoundError:
            self._forget(key)
            return False
        except OSError as exc:  # of the record, the system or the filesystem (disk_errors.py)
            self._read_failed(key, exc)
            return False
        except BadRecord as exc:
            log.warning("[disk] %s: %s; %s", key.hex(), exc, "removed" if self.local_keys else "a miss")
            self.counters["corrupt"] += 1
            self._remove(key) if self.local_keys else self._forget(key)
            return False
        self.counters["gets"] += 1
        return True

    def put(self, keys, buffers, geometry, release=None, chain=None) -> list:
        if not self.health() or self._read_only:  # stuck, the root gone (unmounted, removed,
            # not writable), records that cannot be written (disk_errors.py)
            self.counters["dropped_puts"] += len(keys)
            return [False] * len(keys)
        sizes = [HEADER_BYTES + nbytes(b) for b in buffers]
        n = len(keys)
        if chain is not None:  # the keys' places in it (disk_room.py: a chain keeps its head); none
            for key in keys:  # for blocks in no order (a write-back's, evicted tail first)
                chain.setdefault(key, len(chain))
            n = self._admitted(keys, sizes, chain)
            self.counters["dropped_puts"] += len(keys) - n
        items = [(k, b, geometry, size, chain, chain[k] if chain is not None else 0)
                 for k, b, size in zip(keys[:n], buffers, sizes)]
        stored = run_bounded(self._io, self._put_one, items, self.io_timeout_s,
                             self._late_op("a block write"), self._on_late_done(release))
        with self._lock:
            self._touch_chain([k for k, ok in zip(keys, stored) if ok])
        return stored + [False] * (len(keys) - n)

    def _put_one(self, key: bytes, pieces, geometry: bytes, size: int, batch: dict, at: int) -> bool:
        if self._read_only:  # found by a write of this batch (disk_errors.py): none tried
            self.counters["dropped_puts"] += 1
            return False
        if key[0] in self._unusable:
            return False
        with self._lock:
            if key in self._lru:
                return True
        gen = self._clears.write_begins(key)
        if gen is None:  # the same key being written: that write decides
            return False
        try:
            return self._put_new(key, pieces, geometry, gen, size, (batch, at))
        finally:
            self._clears.write_ends(key, gen)

    def _put_new(self, key: bytes, pieces, geometry: bytes, gen: int, size: int, place) -> bool:
        """place: (the batch, key's place in it): a put evicts no key placed before it."""
        self._block_bytes = size
        if size > self.capacity_bytes:
            return self._too_big(size)
        if not self._evict_over_capacity(size, *place):
            return False
        err, tries = self._write(key, pieces, size, geometry), 1
        while err is not None and err.errno in NO_ROOM and tries < ENOSPC_TRIES:
            with self._lock:  # another I/O thread's write may take the room a retry found
                self.used_bytes -= size  # the reservation, taken again under the new limit
            self._on_full(size, err.errno)
            if not self._evict_over_capacity(size, *place):
                return False
            err, tries = self._write(key, pieces, size, geometry), tries + 1
        if err is not None:
            with self._lock:
                self.used_bytes -= size  # the reservation
            self._write_failed(key, err)
            return False
        with self._lock:
            void = self._clears.void(gen, key)  # a clear (or its delete) came since it began
            if key in self._lru:  # the rebuild listed the file meanwhile: counted once
                self.used_bytes -= size
                size = 0
            if void:
                self.used_bytes -= size
                if key in self._lru:
                    self.used_bytes -= self._lru.pop(key)
                    self._on_keys([key], False)
            elif size:
                self._lru[key] = size
                self._on_keys([key], True)
        if void:  # (no other write of key runs until this one ends)
            unlinks = self._owed.begin([key])  # left: owed as a delete until it is gone (a
            if not self._unlink_unless_indexed([key], [unlinks.done]):  # restart deletes it too)
                self._owed.unconfirmed(unlinks)
            return False
        self.counters["puts"] += 1
        return True

    def _write(self, key: bytes, pieces, size: int, geometry: bytes) -> OSError | None:
        return write_record(self._path(key), key, pieces, size, geometry, self.fsync, self._same_root)

    def _remove(self, key: bytes) -> bool:
        self._forget(key)
        try:
            os.unlink(self._path(key))
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:  # forgotten all the same: never read again by this daemon
            self._unlink_failed(exc, f"removing the damaged record {key.hex()}")
            return False

    def delete(self, keys) -> int:
        """Forget the keys now; their files go on an I/O thread (no file I/O on the caller's),
        waited for up to the tier's deadline: a daemon stopped after the delete's answer would
        index files still there at its next start."""
        if not self.local_keys:  # a reader keeps no index: the writer removes the files
            return 0
        gone, unlisted = [], None
        with self._lock:
            for key in keys:
                self._clears.deleted(key)  # a write of it running now lands void
                size = self._lru.pop(key, None)
                if size is not None:
                    self.used_bytes -= size
                    gone.append(key)
                if not self.indexed.is_set():
                    self._meanwhile.deleted.add(key)
            if gone:
                self._on_keys(gone, False)
            if not self._root_made:  # files no listing reached, the tier down (one under way:
                # in memory; on record, 10,000 keys would make the next start clear it all)
                unlisted = self._owed.begin(set(keys).difference(gone))
                self._meanwhile.owed.append(unlisted.done)  # by the merge, once its unlinks are
        if unlisted is not None:
            self._owed.unconfirmed(unlisted)
        if not gone:  # nothing indexed to unlink (a write of it running is void already)
            return 0
        unlinks = self._owed.begin(gone)
        if not self._stuck():
            run_bounded(self._io, self._unlink_unless_indexed, [(gone, [unlinks.done])],
                        self.io_timeout_s, self._late_op("a delete's unlinks"),
                        lambda _i: self._late_returned())
        else:
            self._unlink_later(gone, [unlinks.done])
        self._owed.unconfirmed(unlinks)  # still there: deleted again by a restart
        return len(gone)

    def delete_refused(self, n: int) -> str | None:  # (deletes run one at a time)
        return None if self.indexed.is_set() else self._meanwhile.refused(n)

    def owe_clear(self, record) -> None:
        """(At start, from the tiers.) Deletes whose files were not gone yet are kept in record
        (disk_owed.py); those the last run owed are deleted now: never indexed, and unlinked
        once the index is whole (unless stored again since). A reader owes none and does none
        (a record from when its instance wrote there is left to a start as a writer)."""
        if not self.local_keys:
            return
        clear, unlinks = self._owed.attach(record)
        if clear:
            log.warning("[disk] %s: the last run owed more deletes than it could keep; the tier "
                        "is cleared", self.root)
            self.clear()
            if not self._owed.clear_owed:  # its mark written (else owed on record still)
                self._owed.cleared()
            return
        if unlinks is None:
            return
        log.warning("[disk] %s: %d deletes the last run could not finish are done now",
                    self.root, len(unlinks.keys))
        self.delete(unlinks.keys)

        def finish() -> None:  # once the index is whole; never after close (owed still)
            while not self.indexed.wait(PROBE_EVERY_S):
                if self._closed.is_set():
                    return
            if not self._closed.is_set():
                try:
                    self._unlink_unless_indexed(unlinks.keys, [unlinks.done])
                except Exception:  # owed still (kept in record): a restart deletes them again
                    log.exception("[disk] %s: the deletes the last run owed failed", self.root)
        threading.Thread(target=finish, name="kvcached-disk-owed", daemon=True).start()

    def clear(self) -> int:
        """Forget every block now (what the index rebuild still finds goes too, and what a
        write begun before lands after); the files go on an I/O thread, under the clear's mark
        (disk_clear.py). Returns how many blocks were indexed."""
        if not self.local_keys:  # a reader: the writer removes the files (disk_read.py)
            return self._reader_clear()
        self._clears.hold()
        then, unmarked = [self._clears.unlinked], None
        try:
            run_bounded(self._io, self._clears.mark, [()], self.io_timeout_s,
                        self._late_op("the clear's mark"), lambda _i: self._late_returned())
        except OSError as exc:  # the clear goes on, owed in the run dir until its files go
            unmarked = self._owed.clear_unmarked()  # (what releases it)
            log.warning("[disk] %s: cannot mark the clear (%s); it is owed in the run dir until "
                        "its files are removed (a start before then clears the tier)", self.root, exc)
        with self._lock:
            self._clears.new_generation()
            keys = list(self._lru)
            self.used_bytes -= sum(self._lru.values())  # writes in flight keep their reservation
            self._lru.clear()
            self._suspects.clear()
            self._on_cleared()
            indexed = self.indexed.is_set()
            if not indexed and self._meanwhile.clear():
                self._clears.hold()  # the rebuild's merge unlinks what it finds, then lets go
            if unmarked:  # owed until these files are gone, and what the listing finds (a merge)
                then.append(unmarked if indexed else after(2, unmarked))
                if not indexed:
                    self._meanwhile.owed.append(then[-1])
        self._unlink_later(keys, then)
        return len(keys)

    def close(self) -> None:
        self._closed.set()
        self._probe_wake.set()
        self._join_rebuild()
        self._io.shutdown(timeout=self.io_timeout_s)
        if self._stat_io is not None:
            self._stat_io.shutdown(timeout=READER_LOOKUP_S)
        self._root_lock.release()


def _ignore(*_args) -> None:
    """No key table watches this tier."""
