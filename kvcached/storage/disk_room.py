"""The disk tier's room (a part of DiskBackend, disk.py): the limit it evicts to stay under,
which records a put evicts and how much of a chain it takes, the lower limit a filesystem that
fills up below the tier's capacity sets (ENOSPC), the probe raising it again, and the index's
memory at capacity.

- Victims are the least recently used records. A put of a chain's blocks (an offload's backup,
  in order, in chunks that share a dict of places: StorageBackend.keeps_chains) never evicts a
  block of the chain placed before the one it writes: a lookup reaches a block only through
  every block before it. (Blocks put in no order - a write-back's, which the host tier evicts
  tail first - are plain LRU.) Before, a chain larger than the tier's room evicted its own
  first blocks to store its last ones: a tier that a full filesystem had shrunk to 13 blocks
  kept a 16-block chain's last 12 and its first, and a lookup found 1 block of it.
- A chain's put takes the leading blocks that fit - in the room left, and in what evicting
  records of other chains frees - and drops the rest (`dropped_puts`): what follows a block that
  is not stored is never reached by a lookup.
- ENOSPC below the limit lowers it to what the filesystem holds for the tier (its records,
  those evicted and not yet unlinked, and the free space) less a few blocks.
"""
from __future__ import annotations

import errno
import logging
import os

from .record import HEADER_BYTES

log = logging.getLogger("kvcached.storage.disk")  # the tier's logger

ENOSPC_EVICT_BLOCKS = 8  # a full filesystem: the limit goes this many blocks under what it holds
ENOSPC_TRIES = 4  # writes of one block that may meet ENOSPC (room made before each retry)
FS_SLACK_MAX = 4 << 30  # room left free on the filesystem before the probe raises the limit
# the index's memory for a record: an OrderedDict entry, its 16-byte key and its size (204 bytes
# measured on CPython 3.11 for 1,000,000 entries: the RSS before and after)
INDEX_BYTES_PER_RECORD = 200


class DiskRoom:
    """DiskBackend's methods for its room, on the state its __init__ makes (its lock and
    eviction condition, `_lru`, `used_bytes`, `limit_bytes`, `_victim_bytes`)."""

    def index_bytes(self, page_bytes: int) -> int:
        """The index's memory at capacity, full of records of page_bytes."""
        return (self.capacity_bytes // (HEADER_BYTES + page_bytes) + 1) * INDEX_BYTES_PER_RECORD

    def _admitted(self, keys, sizes, batch: dict) -> int:
        """How many leading keys of a put's batch the tier takes: the room left and what evicting
        records of other batches frees; a key the tier holds needs none. A block larger than
        the whole capacity is taken (its put says so) and nothing after it."""
        with self._lock:
            need = sum(s for k, s in zip(keys, sizes) if k not in self._lru)
            room = self.limit_bytes - self.used_bytes
            if need > room:  # least recently used first, until the deficit is met
                for key, size in self._lru.items():
                    if room >= need:
                        break
                    if key not in batch:
                        room += size
            taken = 0
            for n, (key, size) in enumerate(zip(keys, sizes)):
                if size > self.capacity_bytes:
                    return n + 1
                if key not in self._lru:
                    if taken + size > room:
                        return n
                    taken += size
            return len(keys)

    def _evict_over_capacity(self, incoming: int, batch: dict | None = None, at: int = 0) -> bool:
        """Make room for `incoming` bytes and reserve them (0: just enforce the limit), never
        evicting a key of `batch` (key: its place) placed before `at`. False when the room
        cannot be made now (others hold reservations, or only such keys are left)."""
        victims = []
        with self._lock:
            over = self.used_bytes + incoming - self.limit_bytes
            if over > 0:
                for key, size in self._lru.items():
                    if over <= 0:
                        break
                    if batch is None or batch.get(key, at) >= at:
                        victims.append((key, size))
                        over -= size
                for key, size in victims:
                    del self._lru[key]
                    self.used_bytes -= size
                    self._victim_bytes += size  # still on the filesystem until unlinked
                if victims:
                    self._on_keys([key for key, _size in victims], False)
            fits = self.used_bytes + incoming <= self.limit_bytes
            if fits:
                self.used_bytes += incoming  # reserved under the lock: parallel puts cannot overshoot
        self._unlink_victims(victims)
        return fits

    def _unlink_victims(self, victims) -> None:
        """(key, size) pairs, called on an I/O thread (a put's) or the index thread: unlinks
        here. A file that cannot be removed is left (never raised: the put goes on, its
        reservation with it)."""
        failed = None
        for key, size in victims:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                log.debug("[disk] evicted file already gone")
            except OSError as exc:
                failed = exc
            finally:
                with self._evicting:
                    self._victim_bytes -= size
                    self._evicting.notify_all()
        self.counters["evicted"] += len(victims)
        if failed is not None:
            self._unlink_failed(failed, "an eviction's unlink")

    def _on_full(self, size: int, err: int = errno.ENOSPC) -> None:
        """ENOSPC below the limit (the filesystem is smaller, or shared): lower the limit to what
        the filesystem holds for the tier less a few blocks; the caller evicts down to it and
        retries. From the filesystem's state, not from the limit: puts that hit ENOSPC together
        each lowered it again (a few blocks under the last value), and four of them took a 1 MiB
        tier's limit to 0. What the tier holds is read before the filesystem's free space, and
        counts the records evicted and not yet unlinked: another put's eviction between the two
        (its records out of the index, their bytes not yet free) lowered the limit by what it
        evicted, 8 blocks more (a 1 MiB tier's limit went from 20 blocks to 12, under the 16 of
        a chain). Not lowered when the space was only held by such records: once those are gone
        the filesystem has room. EDQUOT (a user's or a directory's quota, which statvfs may not
        show) is a full filesystem whose free space is what the evictions free; the probe does
        not raise that limit again (it cannot see the quota's room): a restart does."""
        self.counters["enospc"] += 1
        with self._evicting:
            self._evicting.wait_for(lambda: not self._victim_bytes, timeout=1.0)
            # records, reservations (written in part at most: the blocks of margin cover them,
            # IO_THREADS of them at most) and evicted records still on the filesystem
            held = self.used_bytes + self._victim_bytes
        free, what = 0, "over its quota" if err == errno.EDQUOT else "full"
        self._quota_met = self._quota_met or err == errno.EDQUOT
        try:
            st = os.statvfs(self.root)
            free = st.f_bavail * st.f_frsize
            if err == errno.EDQUOT:
                free = 0
            elif free >= 2 * size and (not st.f_files or st.f_favail > 2):
                return  # room now (blocks and inodes): the caller retries under the same limit
            elif st.f_files and st.f_favail <= 2:  # out of inodes (one a record), not of bytes:
                free, what = 0, "out of inodes"  # what is freed is the records evicted
        except OSError:
            pass
        with self._lock:
            was = self.limit_bytes
            self.limit_bytes = limit = max(0, min(was, held + free - ENOSPC_EVICT_BLOCKS * size))
            first = was == self.capacity_bytes > limit
        if first:
            log.warning("[disk] %s: the filesystem is %s at %.3f GiB, below the tier's capacity "
                        "(%.3f GiB); the tier now evicts to stay under %.3f GiB", self.root, what,
                        self.used_bytes / 2**30, self.capacity_bytes / 2**30, limit / 2**30)

    def _regrow(self, fs) -> None:
        """(The probe.) Raise a limit the filesystem set, by what it has free beyond a slack:
        bytes, and inodes (one a record) where the filesystem counts them."""
        total, free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
        slack = min(FS_SLACK_MAX, max(total // 20, 16 * self._block_bytes))
        if fs.f_files:  # bytes free but no inodes would raise it only to meet ENOSPC again
            inodes = fs.f_favail - max(fs.f_files // 20, 16)
            free = min(free, slack + max(0, inodes) * self._block_bytes)
        if free <= slack:
            return
        with self._lock:
            self.limit_bytes = min(self.capacity_bytes, self.limit_bytes + free - slack)
            room = self.limit_bytes == self.capacity_bytes
        if room:
            log.info("[disk] %s has room for the tier's whole capacity again", self.root)
