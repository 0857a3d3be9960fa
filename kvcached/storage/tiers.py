"""The storage tiers behind the host pool: backends in search order, and write policies.

Reads search the backends in order (a key is fetched from the first that has it); writes go
to every backend, and only from the writer rank (`--no-storage-writer` on the others, for MLA
models whose KV is the same on every rank).

Write policies (host -> storage):
- write_through: back up a block as soon as it is READY in the host tier (default);
- write_through_selective: back up once a block has been hit `selective_hits` times;
- write_back: back up only when the host tier evicts it.
"""
from __future__ import annotations

import logging
from typing import Sequence

from .base import StorageBackend
from .disk import DiskBackend

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def open_backend(uri: str) -> StorageBackend:
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme == "disk":
        return DiskBackend.from_uri(uri)
    if scheme in ("redis", "redis+cluster"):
        from .redis_store import RedisBackend

        return RedisBackend(uri)
    raise ValueError(f"storage URI {uri!r}: expected disk:///path, redis://host:port/db "
                     "or redis+cluster://host:port")


class StorageTiers:
    def __init__(self, uris: Sequence[str], write_policy: str = "write_through",
                 writer: bool = True, selective_hits: int = 2):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy {write_policy!r}: expected one of {WRITE_POLICIES}")
        self.write_policy = write_policy
        self.writer = writer
        self.selective_hits = selective_hits
        self.backends: list[StorageBackend] = []
        try:
            for uri in uris:
                self.backends.append(open_backend(uri))
        except BaseException:
            self.close()
            raise

    def __bool__(self) -> bool:
        return bool(self.backends)

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys present in some backend (each may come from a different one)."""
        n = 0
        while n < len(keys):
            best = 0
            for b in self.backends:
                best = max(best, b.exists_prefix(keys[n:]))
                if best:
                    break
            if not best:
                return n
            n += best
        return n

    def fetch(self, keys: Sequence[bytes], buffers: Sequence) -> int:
        """Fill buffers from the first backend holding each key; returns the leading count
        filled (the first miss or corrupt record ends the prefix)."""
        ok = [False] * len(keys)
        todo = list(range(len(keys)))
        for b in self.backends:
            if not todo:
                break
            got = b.get_into([keys[i] for i in todo], [buffers[i] for i in todo])
            rest = []
            for i, g in zip(todo, got):
                if g:
                    ok[i] = True
                else:
                    rest.append(i)
            todo = rest
        n = 0
        while n < len(ok) and ok[n]:
            n += 1
        return n

    def put(self, keys: Sequence[bytes], buffers: Sequence) -> list[bool]:
        """Store in every backend; per key, whether it reached at least one."""
        stored = [False] * len(keys)
        if not self.writer:
            return stored
        for b in self.backends:
            for i, ok in enumerate(b.put(keys, buffers)):
                stored[i] |= ok
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        return max((b.delete(keys) for b in self.backends), default=0)

    def clear(self) -> int:
        return sum(b.clear() for b in self.backends)

    def status(self) -> list[dict]:
        return [{"uri": b.uri, "healthy": b.health(), **b.usage()} for b in self.backends]

    def ready(self) -> bool:
        return all(getattr(b, "ready", None) is None or b.ready.is_set() for b in self.backends)

    def close(self) -> None:
        for b in self.backends:
            b.close()
