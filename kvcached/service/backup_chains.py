"""Backups that continue a chain: the dict of places a storage tier keeps for a chain's puts
(StorageBackend.keeps_chains: the disk tier evicts none of a chain's earlier blocks to store a
later one), carried from one backup to the next of the same request.

An engine offloads a long request in parts (vLLM saves the blocks each step computed: chunked
prefill, then decode blocks; a request that hit a prefix saves only what follows it) and each
offload names the block it continues (protocol 1.15 `parent`), so its first host entry's parent
is the earlier part's last block. A backup whose first block's parent is where a kept chain
ended goes on with that chain's dict; before, each part was a chain of its own, and in a tier
smaller than the request a later part evicted the earlier one's blocks - the head every lookup
goes through.

Bounded: at most MAX_CHAINS chains and MAX_KEPT_KEYS keys in all are kept (the least recently
continued go first); a chain longer than MAX_CHAIN_KEYS is not kept (its next part starts one of
its own). A chain forked (two requests continuing one prefix) goes on in the first to continue
it; the other starts its own.
"""
from __future__ import annotations

from collections import OrderedDict

MAX_CHAINS = 1024
MAX_CHAIN_KEYS = 65536
MAX_KEPT_KEYS = 262144  # about 25 MiB of dicts at most


class BackupChains:
    """(Used by the one backup worker thread only.)"""

    def __init__(self, counters: dict):
        """counters["chains_continued"]: backups that went on with a kept chain."""
        self._ends: OrderedDict[bytes, dict] = OrderedDict()  # a chain's last key -> its places
        self._kept = 0  # keys in the kept chains, as they were when kept
        self.counters = counters
        counters.setdefault("chains_continued", 0)

    def __len__(self) -> int:
        return len(self._ends)

    def start(self, first) -> dict:
        """The places of the chain a backup whose first entry is `first` continues: a kept one
        that ended at its parent (taken out: this backup will end it elsewhere), else a new one."""
        parent = first.parent if first is not None else None
        chain = self._ends.pop(parent.key, None) if parent is not None else None
        if chain is None:
            return {}
        self._kept -= len(chain)
        self.counters["chains_continued"] += 1
        return chain

    def end(self, chain: dict, last) -> None:
        """A backup's chain ended at entry `last`: kept for the backup that continues it."""
        if last is None or not chain or len(chain) > MAX_CHAIN_KEYS:
            return
        old = self._ends.pop(last.key, None)
        if old is not None:
            self._kept -= len(old)
        self._ends[last.key] = chain
        self._kept += len(chain)
        while self._ends and (len(self._ends) > MAX_CHAINS or self._kept > MAX_KEPT_KEYS):
            _key, gone = self._ends.popitem(last=False)
            self._kept -= len(gone)
