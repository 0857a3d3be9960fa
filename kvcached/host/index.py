"""Content-addressed block index: 16-byte key -> host block, with states and pins.

An entry is WRITING while its bytes are copied in and READY after; READY entries with no
readers (`refs == 0`) and no children are the only ones eviction may take, so a block being
written or loaded is never evicted and a prefix loses its tail before its head (descendants
before ancestors). A key's parent is the key before it in the offload that inserted it.

Eviction order comes from a pluggable policy (`priority`: lower goes first) through a heap
with lazy deletion: a heap item is live only while its sequence number matches the entry's,
so a touch is one push (O(log n)) and stale items are skipped or compacted away.

`on_visible(key, loadable)` hears each key as it becomes loadable (READY and not doomed: what
`prefix` answers) and as it stops being so; the daemon's key table (service/key_publisher.py)
publishes it for clients' lookups.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable

from .policies import EvictionPolicy, make_policy

WRITING = 0
READY = 1
NOT_STORED, BACKUP_QUEUED, STORED = 0, 1, 2


class Entry:
    __slots__ = ("key", "block", "state", "refs", "parent", "children", "live", "doomed",
                 "seq", "last", "hits", "score", "stored", "prefetched", "fetched")

    def __init__(self, key: bytes, block: int, parent: "Entry | None"):
        self.key = key
        self.block = block
        self.state = WRITING
        self.refs = 0
        self.parent = parent
        self.children = 0
        self.live = True  # False once removed from the index
        self.doomed = False  # deleted while in use: removed when the last reader leaves
        self.seq = -1
        self.last = 0
        self.hits = 0
        self.score = 0.0
        self.stored = NOT_STORED  # backup state in the storage tiers
        self.prefetched = False  # brought in by a prefetch and not loaded since
        self.fetched = False  # brought in from storage and not loaded since (hit statistics)


class BlockIndex:
    def __init__(self, policy: str | EvictionPolicy = "lru"):
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.bind(self)
        self._entries: dict[bytes, Entry] = {}
        self._heap: list[tuple[float, int, Entry]] = []
        self._seq = itertools.count()
        self._clock = 0
        self.evictions = 0
        self.prefetched = 0  # entries brought in (or being brought in) by prefetch, not used yet
        self.pinned = 0  # entries with readers (loads, backups in flight)
        self.on_visible: Callable[[bytes, bool], None] = unheard

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def blocks(self) -> list[int]:
        return [e.block for e in self._entries.values()]

    def pinned_entries(self) -> list[Entry]:
        return [e for e in self._entries.values() if e.refs]

    def writing_entries(self) -> list[Entry]:
        return [e for e in self._entries.values() if e.state == WRITING]

    def loadable_keys(self) -> list[bytes]:
        """What prefix() would answer for (READY, not doomed): on_visible's state of them all."""
        return [e.key for e in self._entries.values() if e.state == READY and not e.doomed]

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def note_request(self, keys, times: int = 1) -> None:
        """Tell the policy about every key of a request (its history counts misses too), asked
        `times` times."""
        if times == 1:
            self.policy.on_request(keys)
        else:
            self.policy.on_requests(keys, times)

    # queries --------------------------------------------------------------
    def prefix(self, keys: Iterable[bytes], touch: bool = True, times: int = 1) -> list[Entry]:
        """The READY entries of the longest leading run of keys present, each touched as if
        hit `times` times (noted lookups asked again; once by a lookup or load). (Every lookup
        and load runs it under the host lock, so its loops are written out: a 64-key hit took
        15 us, half of it in calls.)"""
        out = []
        get, ready = self._entries.get, READY
        for key in keys:
            e = get(key)
            if e is None or e.state != ready or e.doomed:
                break
            out.append(e)
        if touch and out:
            self._clock += 1
            now, policy = self._clock, self.policy
            if type(policy).on_access is EvictionPolicy.on_access:  # the plain one, inline
                for e in out:
                    e.last = now
                    e.hits += times
            else:
                for _ in range(times):
                    for e in out:
                        policy.on_access(e, now)
            for e in out:
                if e.children == 0:  # (an entry with children is no leaf: not evictable)
                    self._push(e)
        return out

    def touch(self, e: Entry) -> None:
        self._clock += 1
        self.policy.on_access(e, self._clock)
        self._push(e)

    # updates --------------------------------------------------------------
    def insert(self, key: bytes, block: int, parent_key: bytes | None) -> Entry:
        if key in self._entries:
            raise KeyError("key already indexed")
        parent = self._entries.get(parent_key) if parent_key is not None else None
        e = Entry(key, block, parent)
        if parent is not None:
            parent.children += 1
        self._clock += 1
        self.policy.on_insert(e, self._clock)
        self._entries[key] = e
        return e

    def mark_ready(self, e: Entry) -> None:
        e.state = READY
        if not e.doomed:
            self.on_visible(e.key, True)
        self._push(e)

    def set_prefetched(self, e: Entry, on: bool) -> None:
        if e.prefetched != on and e.live:
            e.prefetched = on
            self.prefetched += 1 if on else -1

    def pin(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            if e.refs == 0:
                self.pinned += 1
            e.refs += 1

    def unpin(self, entries: Iterable[Entry]) -> list[int]:
        """Drop a reader; returns host blocks freed by doomed entries that became unused. A
        doomed entry still WRITING stays: its block is the target of its writer's copy (an
        offload, a fetch), which discards the entry when it ends."""
        freed = []
        for e in entries:
            if e.refs <= 0:
                raise RuntimeError("unpin of an entry with no readers")
            e.refs -= 1
            if e.refs == 0:
                self.pinned -= 1
                if e.doomed and e.live and e.state != WRITING:
                    freed.append(self._remove(e))
                else:
                    self._push(e)
        return freed

    def discard(self, e: Entry) -> int:
        """Remove an entry whose write failed or was cancelled; returns its host block."""
        return self._remove(e)

    def delete(self, key: bytes) -> int | None:
        """Delete a key: now if unused (returns its block), else when its readers leave."""
        e = self._entries.get(key)
        if e is None:
            return None
        if e.refs or e.state == WRITING:
            self._doom(e)
            return None
        return self._remove(e)

    def evict(self, n: int) -> list[Entry]:
        """Evict up to n unused leaves in policy order; returns them (their blocks are free
        for the caller to reuse once it has saved what it wants from them)."""
        out: list[Entry] = []
        while len(out) < n and self._heap:
            _prio, seq, e = heapq.heappop(self._heap)
            if seq != e.seq or not self._evictable(e):
                continue
            self._remove(e)
            out.append(e)
            self.evictions += 1
            self.policy.on_evict(e)
        return out

    def clear(self) -> list[int]:
        """Remove every unused entry; in-use ones are doomed. Returns the blocks freed."""
        freed = []
        for e in list(self._entries.values()):
            if e.refs or e.state == WRITING:
                self._doom(e)
            elif e.live:
                freed.append(self._remove(e))
        return freed

    def forget_stored(self) -> None:
        """The storage tiers were cleared: no block is stored (a policy may back it up again)."""
        for e in self._entries.values():
            if e.stored == STORED:
                e.stored = NOT_STORED

    # internals ------------------------------------------------------------
    @staticmethod
    def _evictable(e: Entry) -> bool:
        return e.live and e.state == READY and e.refs == 0 and e.children == 0

    def _push(self, e: Entry) -> None:
        if not self._evictable(e):
            return
        e.seq = next(self._seq)
        heapq.heappush(self._heap, (self.policy.priority(e), e.seq, e))
        if len(self._heap) > 2 * len(self._entries) + 1024:
            self._compact()

    def _compact(self) -> None:
        self._heap = [item for item in self._heap if item[1] == item[2].seq and self._evictable(item[2])]
        heapq.heapify(self._heap)

    def _doom(self, e: Entry) -> None:
        if e.state == READY and not e.doomed:
            self.on_visible(e.key, False)
        e.doomed = True

    def _remove(self, e: Entry) -> int:
        if e.state == READY and not e.doomed:
            self.on_visible(e.key, False)
        del self._entries[e.key]
        if e.prefetched:
            self.prefetched -= 1
            e.prefetched = False
        e.live = False
        e.seq = -1
        p = e.parent
        if p is not None and p.live:
            p.children -= 1
            if p.children == 0:
                self._push(p)
        e.parent = None
        return e.block

    def check(self) -> None:
        """Invariant walk (tests, fuzzing): raises AssertionError on any inconsistency."""
        children: dict[int, int] = {}
        blocks: set[int] = set()
        for key, e in self._entries.items():
            assert e.key == key and e.live, f"entry {key.hex()} mismatched or dead"
            assert e.refs >= 0, f"entry {key.hex()} has negative refs"
            assert e.block not in blocks, f"host block {e.block} indexed twice"
            blocks.add(e.block)
            if e.parent is not None and e.parent.live:  # a deleted parent no longer counts
                children[id(e.parent)] = children.get(id(e.parent), 0) + 1
        for e in self._entries.values():
            assert e.children == children.get(id(e), 0), f"entry {e.key.hex()} child count off"
        live = {id(item[2]) for item in self._heap if item[1] == item[2].seq}
        for e in self._entries.values():
            if self._evictable(e):
                assert id(e) in live, f"evictable entry {e.key.hex()} missing from the heap"


def unheard(_key: bytes, _loadable: bool) -> None:
    """No key table listens."""
