"""Eviction policies for the block index. Lower `priority` is evicted first.

A policy sees inserts, accesses and evictions of entries; the index only evicts leaves (a
prefix is never cut in its middle), so a policy orders leaves, not arbitrary blocks.
"""
from __future__ import annotations


class EvictionPolicy:
    name = "base"

    def bind(self, index) -> None:
        """Called once by the index that uses this policy."""
        self.index = index

    def on_request(self, keys) -> None:
        """Every key a lookup, load or offload asked for, present or not (history)."""

    def on_requests(self, keys, times: int) -> None:
        """The same request asked `times` times (noted lookups, client/key_table.py)."""
        for _ in range(times):
            self.on_request(keys)

    def on_insert(self, e, now: int) -> None:
        e.last = now

    def on_access(self, e, now: int) -> None:
        e.last = now
        e.hits += 1

    def on_evict(self, e) -> None:
        pass

    def priority(self, e) -> float:
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Least recently used leaf first."""

    name = "lru"

    def priority(self, e) -> float:
        return e.last


class S2LRU(EvictionPolicy):
    """Frequency-aware, prefix-preserving: two classes of leaves, LRU within each.

    A block whose key has been requested at least twice (present or not: a bounded history of
    request counts survives eviction, as TinyLFU's sketch does) is *protected*: it ranks as if
    it had been used `PROTECT_TURNOVERS` cache-turnovers later than it was, so one-time blocks
    (58 % of the distinct blocks in the Mooncake trace) go first, and protected blocks still
    age out. The history is halved when it outgrows HISTORY_LIMIT keys.
    """

    name = "s2lru"
    PROTECT_TURNOVERS = 10
    HISTORY_LIMIT = 4_000_000

    def __init__(self):
        self.seen: dict[bytes, int] = {}

    def on_request(self, keys) -> None:
        self.on_requests(keys, 1)

    def on_requests(self, keys, times: int) -> None:
        seen = self.seen
        for key in keys:
            seen[key] = seen.get(key, 0) + times
        if len(seen) > self.HISTORY_LIMIT:
            self.seen = {k: c >> 1 for k, c in seen.items() if c > 1}

    def priority(self, e) -> float:
        if self.seen.get(e.key, 0) >= 2:
            return e.last + self.PROTECT_TURNOVERS * max(len(self.index), 1)
        return e.last


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "s2lru": S2LRU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
