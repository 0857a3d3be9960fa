"""Eviction policies for the block index. Lower `priority` is evicted first.

A policy sees inserts, accesses and evictions of entries; the index only evicts leaves (a
prefix is never cut in its middle), so a policy orders leaves, not arbitrary blocks.
"""
from __future__ import annotations


class EvictionPolicy:
    name = "base"

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


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
