"""The storage backend interface. Backends move whole host pages (one block, all layers).

Keys reaching a backend are already the stored keys (record.stored_key: the block's key
salted with its KV geometry), so each geometry has a key space of its own; the geometry digest
comes along for the records' headers. A page is passed as its list of pieces (memoryviews in page order): one piece for the page_first
host layout, one per (layer, part) for layer_first. The disk tier writes and reads them in place
with writev/readv and checksums them in a stream, so a page is never staged just to be stored.

Methods must not raise for I/O trouble: a failed put or get is reported per key (False), and a
backend that cannot reach its store reports `health() == False` and 0 hits until it recovers.
`exists_prefix`, `delete`, `clear`, `health` and `usage` run on the daemon's request and status
threads: they never wait on the store without a short bound. `get_into` and `put` run on
storage worker threads and return within the backend's I/O deadline: a key whose I/O is still
running then is reported None (late), and its page stays in use by that I/O until the backend
calls `release(i)` (i: the key's position) - the caller must not reuse the page before.
"""
from __future__ import annotations

import abc
from typing import Callable, Sequence


class StorageBackend(abc.ABC):
    uri: str
    lookup_keys = 1 << 62  # keys of one request a remote store is asked at most (URI `lookup_keys`)
    # a store that evicts for its own puts (the disk tier): its put takes `chain`, a dict the
    # caller keeps for one chain's puts (an offload's chunks, in order), empty at the first; the
    # store keeps each key's place there and evicts no key placed before the one it stores. A
    # store whose server evicts (Redis, Mooncake) is not given it.
    keeps_chains = False

    @abc.abstractmethod
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys present."""

    @abc.abstractmethod
    def get_into(self, keys: Sequence[bytes], pages: Sequence[list], geometry: bytes,
                 release=None) -> list:
        """Fill pages[i]'s pieces with key i's verified payload, written from this geometry;
        False where missing, corrupt, of another geometry or failed (the pieces may then hold
        garbage: the caller drops them); None where the read missed its deadline (release(i)
        follows once it returned)."""

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], pages: Sequence[list], geometry: bytes,
            release=None) -> list:
        """Store pages written from this geometry (its tag goes in each record); a key already
        stored is not rewritten (and counts as True). None where the write missed its deadline
        (release(i) follows once it returned)."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many were there."""

    def delete_refused(self, n: int) -> str | None:
        """Why a delete of n keys must wait (the request is BUSY and changes nothing), or None:
        what the store would have to keep for it is bounded (a remote store that is down owes
        at most MAX_OWED_DELETES keys; the disk tier keeps the keys deleted while it rebuilds
        its index)."""
        return None

    @abc.abstractmethod
    def clear(self) -> int:
        """Remove every block of this store; returns how many."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the store answers."""

    @abc.abstractmethod
    def usage(self) -> dict:
        """{"used_bytes", "capacity_bytes", "blocks"} plus backend counters."""

    def ready(self) -> bool:
        """False while the backend is still starting (the disk tier rebuilding its index)."""
        return True

    def register_memory(self, ptr: int, size: int) -> None:
        """The host pool's memory, once: a backend that moves pages without a copy (Mooncake's
        registered buffers) registers it; the others need nothing."""

    def close(self) -> None:
        """Release connections and threads."""


def prefix_walk(keys: Sequence[bytes], chunk: int,
                present: Callable[[Sequence[bytes]], int | None]) -> int | None:
    """The leading keys a remote store holds, asked `chunk` keys at a time (`present(part)`:
    the leading keys of part it holds; None: the store failed, and so does the walk)."""
    n = 0
    for start in range(0, len(keys), chunk):
        part = keys[start:start + chunk]
        found = present(part)
        if found is None:
            return None
        n += found
        if found < len(part):
            return n
    return n
