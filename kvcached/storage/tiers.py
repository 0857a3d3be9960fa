"""The storage tiers behind the host pool: backends in search order, and write policies.

Reads search the backends in order (a key is fetched from the first that has it); writes go
to every backend, and only from the writer rank (`--no-storage-writer` on the others, for MLA
models whose KV is the same on every rank).

Write policies (host -> storage):
- write_through: back up a block as soon as it is READY in the host tier (default);
- write_through_selective: back up once a block has been hit `selective_hits` times;
- write_back: back up only when the host tier evicts it.

Every call names the KV geometry (LayoutSpec.geometry_digest) of the blocks it asks about:
backends see each block under its stored key (record.stored_key), so blocks of different
geometries never meet. With no geometry (no KV was ever registered) storage holds nothing.
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence

from .base import StorageBackend
from .disk import DiskBackend
from .owed_clear import OwedRecord
from .record import StoredKeys
from .uris import REDIS_SCHEMES, redact, scheme_of

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
EXPECTED = ("disk:///path, redis[s]://host:port/db, redis[s]+cluster://host:port, "
            "redis[s]+sentinel://host:port[,host:port...]/db?service=NAME or mooncake://master_host:port")


def parse_uri(uri: str) -> dict:
    """Check a storage URI's form and options without opening anything."""
    scheme = scheme_of(uri)
    if scheme == "disk":
        from .uris import parse_disk_uri as parse
    elif scheme in REDIS_SCHEMES:
        from .uris import parse_redis_uri as parse
    elif scheme == "mooncake":
        from .uris import parse_mooncake_uri as parse
    else:
        raise ValueError(f"{redact(uri)!r}: expected {EXPECTED}")
    return parse(uri)


def open_backend(uri: str, on_ready=None, writer: bool = True) -> StorageBackend:
    scheme = scheme_of(uri)
    if scheme == "disk":
        return DiskBackend.from_uri(uri, on_ready, writer)
    if scheme in REDIS_SCHEMES:
        from .redis_store import RedisBackend

        return RedisBackend(uri)
    if scheme == "mooncake":
        from .mooncake_store import MooncakeBackend

        return MooncakeBackend(uri, on_ready)
    raise ValueError(f"storage URI {redact(uri)!r}: expected {EXPECTED}")


class StorageTiers:
    def __init__(self, uris: Sequence[str], write_policy: str = "write_through",
                 writer: bool = True, selective_hits: int = 2, on_ready=None,
                 owed_path: str | None = None):
        """on_ready() is called once every backend is ready (at once when they all are);
        owed_path keeps the clears a remote store owes across a restart (owed_clear.py)."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy {write_policy!r}: expected one of {WRITE_POLICIES}")
        self.write_policy = write_policy
        self.writer = writer
        self.selective_hits = selective_hits
        self.backends: list[StorageBackend] = []
        self._on_ready = on_ready
        self._ready_lock = threading.Lock()
        self._opened = self._ready_said = False
        try:
            for uri in uris:
                self.backends.append(open_backend(uri, self._backend_ready, writer))
        except BaseException:
            self.close()
            raise
        owing = [b for b in self.backends if hasattr(b, "owe_clear")]  # remote ones, disk
        if owed_path is not None and owing:
            record = OwedRecord(owed_path)
            for b in owing:
                b.owe_clear(record)
        self._opened = True
        self._backend_ready()

    def _backend_ready(self) -> None:
        with self._ready_lock:
            if self._ready_said or not self._opened or not self.ready():
                return
            self._ready_said = True
        if self._on_ready is not None:
            self._on_ready()

    def __bool__(self) -> bool:
        return bool(self.backends)

    def index_bytes(self, page_bytes: int) -> list[tuple[StorageBackend, int]]:
        """Each local disk tier with the memory its index takes at capacity, full of records of
        page_bytes (an entry a record: disk_room.INDEX_BYTES_PER_RECORD)."""
        return [(b, b.index_bytes(page_bytes)) for b in self.backends
                if isinstance(b, DiskBackend) and b.local_keys]

    def register_memory(self, ptr: int, size: int) -> None:
        """The host pool's memory, for the backends that move pages without a copy."""
        for b in self.backends:
            b.register_memory(ptr, size)

    def exists_prefix(self, keys: Sequence[bytes], geometry: bytes | None) -> int:
        """Leading keys present in some backend (each may come from a different one). A remote
        store is asked at most its `lookup_keys` keys of one request (this runs on the request
        thread: a 65,536-key lookup of keys all in Redis held it, and every other client, 212
        ms); past them the rest is a miss, counted as its `lookups_cut`."""
        if geometry is None:
            return 0
        keys = StoredKeys(keys, geometry)
        n, left = 0, {}  # the keys each backend may still be asked in this request
        while n < len(keys):
            best = 0
            for b in self.backends:
                room = left.setdefault(b, b.lookup_keys)
                if room <= 0:
                    continue
                best = b.exists_prefix(keys[n:n + room])
                left[b] = room - best
                if best == room and n + best < len(keys):
                    b.counters["lookups_cut"] += 1
                if best:
                    break
            if not best:
                return n
            n += best
        return n

    def fetch(self, keys: Sequence[bytes], buffers: Sequence, geometry: bytes | None,
              release=None) -> tuple[int, set]:
        """Fill buffers from the first backend holding each key. Returns the leading count
        filled (the first miss or corrupt record ends the prefix) and the positions whose read
        missed its deadline: their buffers stay in use until release(i) is called. A buffer
        on loan is never handed to another backend."""
        ok = [False] * len(keys)
        late: set[int] = set()
        todo = list(range(len(keys))) if geometry is not None else []
        keys = StoredKeys(keys, geometry)
        for b in self.backends:
            if not todo:
                break
            got = b.get_into([keys[i] for i in todo], [buffers[i] for i in todo], geometry,
                             _remap(release, todo))
            rest = []
            for i, g in zip(todo, got):
                if g:
                    ok[i] = True
                elif g is None:
                    late.add(i)
                else:
                    rest.append(i)
            todo = rest
        n = 0
        while n < len(ok) and ok[n]:
            n += 1
        return n, late

    def put(self, keys: Sequence[bytes], buffers: Sequence, geometry: bytes | None,
            release=None, chain: dict | None = None) -> tuple[list[bool], set]:
        """Store in every backend; per key, whether it reached at least one, and the positions
        whose write missed its deadline in some backend: their buffers stay in use until
        release(i), called once every backend's late write of them returned. chain: a dict the
        caller keeps for one chain's puts, empty at the first (StorageBackend.keeps_chains)."""
        stored = [False] * len(keys)
        if not keys or not self.writer or geometry is None:  # none: a backup whose keys were all deleted
            return stored, set()
        keys = list(StoredKeys(keys, geometry))
        late: dict[int, int] = {}
        writes = _LateWrites(release)
        for b in self.backends:
            more = {"chain": chain} if b.keeps_chains else {}
            for i, ok in enumerate(b.put(keys, buffers, geometry, writes.returned, **more)):
                if ok is None:
                    late[i] = late.get(i, 0) + 1
                stored[i] |= bool(ok)
        writes.count(late)
        return stored, set(late)

    def delete(self, keys: Sequence[bytes], geometry: bytes | None) -> tuple[int, list[str]]:
        """(blocks deleted, as many as the tier that deleted most; the tiers that could not
        delete: down, or failing the call)"""
        if geometry is None:
            return 0, []
        keys = list(StoredKeys(keys, geometry))
        got = [b.delete(keys) for b in self.backends]
        return max(got, default=0), [b.uri for b in self.backends if not b.health()]

    def delete_refusals(self, n: int) -> list[str]:
        """Why a delete of n keys must wait, a line for each tier that says so
        (StorageBackend.delete_refused), named as status names it."""
        return [f"{b.uri}: {why}" for b in self.backends if (why := b.delete_refused(n))]

    def clear(self) -> int:
        return sum(b.clear() for b in self.backends)

    def status(self) -> list[dict]:
        return [{"uri": b.uri, "healthy": b.health(), **b.usage()} for b in self.backends]

    def ready(self) -> bool:
        return all(b.ready() for b in self.backends)

    def close(self) -> None:
        for b in self.backends:
            b.close()


def _remap(release, positions: list[int]):
    """A backend's release(j) for the j-th key it was given, as the caller's release(i)."""
    if release is None:
        return None
    return lambda j: release(positions[j])


class _LateWrites:
    """One page may be late in several backends: the caller's release(i) comes once all of
    them returned (a backend may return before they are counted)."""

    def __init__(self, release):
        self._release = release
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}
        self._counted = False

    def returned(self, i: int) -> None:
        with self._lock:
            self._open[i] = self._open.get(i, 0) - 1
            done = self._counted and self._open[i] == 0
        if done and self._release is not None:
            self._release(i)

    def count(self, late: dict[int, int]) -> None:
        with self._lock:
            for i, n in late.items():
                self._open[i] = self._open.get(i, 0) + n
            self._counted = True
            done = [i for i in late if self._open[i] == 0]
        if self._release is not None:
            for i in done:
                self._release(i)
