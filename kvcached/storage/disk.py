"""The disk tier: one file per block under 256 shard directories.

    {root}/{key[0] as 2 hex}/{key as 32 hex}.kvb      (record.py format)

Writes go to a temp file in the same shard, then os.replace: a crash leaves either the old
state or the whole new file, never half a block. The file name is the key, so the index is
rebuilt by listing the shards at start (in a background thread; the tier reports no hits until
it is done), oldest modification first for LRU. Capacity is enforced by evicting the least
recently used files; a chain put or read together is ordered head-last, so a prefix loses its
tail first and what stays is still a loadable prefix. fsync is off by default (a crash may lose
recent blocks, never corrupt one: torn files fail their checksum); `?fsync=1` turns it on.
"""
from __future__ import annotations

import collections
import concurrent.futures
import errno
import logging
import os
import re
import threading
import time
from typing import Sequence
from urllib.parse import parse_qs, urlparse

from .base import StorageBackend
from .record import HEADER_BYTES, BadRecord, check_header, check_payload, nbytes, pack_header

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[0-9a-f]{32}\.kvb$")
_SHARD_RE = re.compile(r"^[0-9a-f]{2}$")
PROGRESS_EVERY = 100_000
# file I/O and checksums release the GIL: a few blocks in flight at once (2 measured best on
# 2 cores; more cores take more)
IO_THREADS = max(2, min(8, os.cpu_count() or 2))


class DiskBackend(StorageBackend):
    def __init__(self, root: str, capacity_bytes: int, fsync: bool = False, uri: str = ""):
        self.root = os.path.abspath(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.uri = uri or f"disk://{self.root}"
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.used_bytes = 0
        self.counters = {"puts": 0, "gets": 0, "put_errors": 0, "corrupt": 0, "evicted": 0}
        self.last_error = ""
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        for shard in range(256):  # made once here, not stat'ed on every put
            os.makedirs(os.path.join(self.root, f"{shard:02x}"), mode=0o700, exist_ok=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvcached-disk")
        self.ready = threading.Event()
        self._rebuild_thread = threading.Thread(target=self._rebuild, name="kvcached-disk-index",
                                                daemon=True)
        self._rebuild_thread.start()

    @classmethod
    def from_uri(cls, uri: str) -> "DiskBackend":
        url = urlparse(uri)
        if not url.path.startswith("/") or url.netloc:
            raise ValueError(f"{uri!r}: expected disk:///absolute/path[?capacity_gb=F]")
        q = parse_qs(url.query)
        unknown = set(q) - {"capacity_gb", "fsync"}
        if unknown:
            raise ValueError(f"{uri!r}: unknown option(s) {sorted(unknown)}")
        capacity_gb = float(q.get("capacity_gb", ["16"])[0])
        if not capacity_gb > 0:
            raise ValueError(f"{uri!r}: capacity_gb must be positive")
        fsync = q.get("fsync", ["0"])[0] in ("1", "true", "yes")
        return cls(url.path, int(capacity_gb * (1 << 30)), fsync, uri)

    # index ----------------------------------------------------------------
    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + ".kvb")

    def _rebuild(self) -> None:
        started, found, removed = time.monotonic(), [], 0
        try:
            for shard in os.scandir(self.root):
                if not (shard.is_dir(follow_symlinks=False) and _SHARD_RE.match(shard.name)):
                    continue
                for entry in os.scandir(shard.path):
                    if _NAME_RE.match(entry.name) and entry.name.startswith(shard.name):
                        st = entry.stat(follow_symlinks=False)
                        found.append((st.st_mtime_ns, bytes.fromhex(entry.name[:32]), st.st_size))
                        if len(found) % PROGRESS_EVERY == 0:
                            log.info("[disk] indexing %s: %d files", self.root, len(found))
                    else:  # temp files of a crashed write, or anything foreign: not ours to serve
                        os.unlink(entry.path)
                        removed += 1
            found.sort()
            with self._lock:
                for _mtime, key, size in found:
                    self._lru[key] = size
                    self.used_bytes += size
            log.info("[disk] %s: %d blocks (%.2f GiB) indexed in %.1f s, %d stray files removed",
                     self.root, len(found), self.used_bytes / 2**30, time.monotonic() - started, removed)
            self._evict_over_capacity(0)  # a smaller capacity than last time
        except OSError as exc:
            self.last_error = f"index rebuild failed: {exc}"
            log.error("[disk] %s", self.last_error)
        finally:
            self.ready.set()

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self.used_bytes -= size

    def _evict_over_capacity(self, incoming: int) -> bool:
        """Make room for `incoming` bytes and reserve them (0: just enforce the capacity).
        False when even an empty tier cannot take them now (others hold reservations)."""
        victims = []
        with self._lock:
            while self._lru and self.used_bytes + incoming > self.capacity_bytes:
                key, size = self._lru.popitem(last=False)
                self.used_bytes -= size
                victims.append(key)
            fits = self.used_bytes + incoming <= self.capacity_bytes
            if fits:
                self.used_bytes += incoming  # reserved under the lock: parallel puts cannot overshoot
        self._unlink_victims(victims)
        return fits

    def _unlink_victims(self, victims) -> None:
        for key in victims:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                log.debug("[disk] evicted file already gone")
        self.counters["evicted"] += len(victims)

    # interface ------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        if not self.ready.is_set():
            return 0
        n = 0
        with self._lock:
            for key in keys:
                if key not in self._lru:
                    break
                n += 1
            self._touch_chain(keys[:n])
        return n

    def _touch_chain(self, keys) -> None:
        """Mark a chain's blocks used, its head last: under capacity pressure a prefix loses
        its tail first and what stays is still a whole, loadable prefix (the order does not
        depend on which worker thread finished first). Called under the lock."""
        for key in reversed(keys):
            if key in self._lru:
                self._lru.move_to_end(key)

    def get_into(self, keys, buffers) -> list[bool]:
        got = list(self._pool.map(self._get_one, keys, buffers))
        with self._lock:
            self._touch_chain([k for k, ok in zip(keys, got) if ok])
        return got

    def _get_one(self, key: bytes, pieces) -> bool:
        with self._lock:
            if key not in self._lru:
                return False
        want = nbytes(pieces)
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
            try:
                crc = check_header(os.read(fd, HEADER_BYTES), key, want)
                if os.readv(fd, pieces) != want or os.read(fd, 1):
                    raise BadRecord("short or long file")
            finally:
                os.close(fd)
            check_payload(pieces, crc)
        except FileNotFoundError:
            self._forget(key)
            return False
        except (BadRecord, OSError) as exc:
            log.warning("[disk] %s: %s; removed", key.hex(), exc)
            self.counters["corrupt"] += 1
            self._remove(key)
            return False
        self.counters["gets"] += 1
        return True

    def put(self, keys, buffers) -> list[bool]:
        stored = list(self._pool.map(self._put_one, keys, buffers))
        with self._lock:
            self._touch_chain([k for k, ok in zip(keys, stored) if ok])
        return stored

    def _put_one(self, key: bytes, pieces) -> bool:
        with self._lock:
            if key in self._lru:
                return True
        size = HEADER_BYTES + nbytes(pieces)
        if size > self.capacity_bytes or not self._evict_over_capacity(size):
            return False
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            except FileNotFoundError:  # the shard dir was removed under us: make it again
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, [pack_header(key, pieces), *pieces], size)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            self.counters["put_errors"] += 1
            self.last_error = f"write failed: {errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror}"
            log.warning("[disk] put %s: %s", key.hex(), self.last_error)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                log.debug("[disk] no temp file to remove after the failed write")
            with self._lock:
                self.used_bytes -= size  # the reservation
            return False
        with self._lock:
            if key in self._lru:  # the same key written twice at once: count it once
                self.used_bytes -= size
            else:
                self._lru[key] = size
        self.counters["puts"] += 1
        return True

    def _remove(self, key: bytes) -> bool:
        self._forget(key)
        try:
            os.unlink(self._path(key))
            return True
        except FileNotFoundError:
            return False

    def delete(self, keys) -> int:
        n = 0
        for key in keys:
            with self._lock:
                present = key in self._lru
            if present:
                self._remove(key)
                n += 1
        return n

    def clear(self) -> int:
        self.ready.wait(60)
        with self._lock:
            keys = list(self._lru)
        for key in keys:
            self._remove(key)
        return len(keys)

    def health(self) -> bool:
        return os.path.isdir(self.root) and os.access(self.root, os.W_OK)

    def usage(self) -> dict:
        with self._lock:
            blocks = len(self._lru)
        return {"used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes,
                "blocks": blocks, "ready": self.ready.is_set(), "last_error": self.last_error,
                **self.counters}

    def close(self) -> None:
        self._rebuild_thread.join(timeout=5)
        self._pool.shutdown(wait=True)


def _write_all(fd: int, pieces, total: int) -> None:
    """writev, continuing after a short write (a full disk raises ENOSPC from the next call)."""
    done = os.writev(fd, pieces)
    if done == total:
        return
    flat = memoryview(b"".join(bytes(p) for p in pieces))  # rare: finish the rest plainly
    while done < total:
        done += os.write(fd, flat[done:])
