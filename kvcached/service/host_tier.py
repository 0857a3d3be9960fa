"""The host tier: the index of host blocks and the pool that holds their bytes, under one lock.

The lock also guards the task table (a task's entries and pins are the index's) and is never
held during a copy or storage I/O. Every allocation goes through `alloc`, which evicts unpinned
blocks when the pool is full and hands them to `on_evicted` before their blocks are reused
(write_back saves them there).
"""
from __future__ import annotations

import threading

from ..host import numa
from ..host.index import BlockIndex, Entry, unheard
from ..host.pool import HostPool


class HostTier:
    def __init__(self, cfg):
        self.lock = threading.RLock()
        self.pool = HostPool(cfg.host_cache_bytes, cfg.device, cfg.host_layout,
                             numa.resolve_node(cfg.numa, cfg.device))
        self._eviction = cfg.eviction
        self.index = BlockIndex(cfg.eviction)
        self.on_evicted = lambda entries: None

    def publish_to(self, on_visible) -> None:
        """(Lock held, or before any op.) Tell on_visible(key, loadable) what the index can load."""
        self.index.on_visible = on_visible

    def reset_index(self) -> None:
        """(Lock held.) A new block geometry: every block held so far is void. The old index's
        entries still in use leave it later, unheard (a new key table is made for the new
        geometry)."""
        on_visible, self.index.on_visible = self.index.on_visible, unheard
        self.index = BlockIndex(self._eviction)
        self.index.on_visible = on_visible

    def alloc(self, n: int) -> list[int]:
        """(Lock held.) Up to n free host blocks, evicting unpinned ones when the pool is full."""
        got = self.pool.allocator.alloc(n)
        if len(got) < n:
            evicted = self.index.evict(n - len(got))
            self.on_evicted(evicted)  # write_back saves them before their blocks are reused
            self.pool.allocator.free([e.block for e in evicted])
            got += self.pool.allocator.alloc(n - len(got))
        return got

    def free(self, blocks) -> None:
        """(Lock held.) Give host blocks back to the pool."""
        self.pool.allocator.free(blocks)

    def unpin(self, entries: list[Entry]) -> None:
        """(Lock held.) Drop one pin of each entry; blocks of entries deleted meanwhile go back."""
        self.pool.allocator.free(self.index.unpin(entries))
