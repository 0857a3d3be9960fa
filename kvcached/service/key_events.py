"""The changes of what the daemon can load, in order, for clients that follow them (the
key_events op): an engine's scheduler that reports its offloaded blocks to a KV-aware router
(vLLM's KV events, client/vllm/kv_events.py).

Each change is one event, of one tier: the host tier's key became loadable (READY and not
doomed) or stopped being so (evicted, deleted, cleared, doomed), as the index tells
`on_visible`; a local storage tier (disk) took a key or lost it, as its index tells the key
table (KeyPublisher.listen). The events sit in a ring of the last CAPACITY, numbered from 1; a
client asks for those after the last number it saw. One that asks from before the ring's
oldest, or from a number this daemon never gave, is told `gap`: it missed changes and must take
none of what it believed as still true. A new block geometry voids every host block unheard
(HostTier.reset_index): that is a gap for everyone. A storage tier's clear, or a change of
whether it answers (its root gone, I/O past its deadline; back again), changes what it can load
unheard: that is a storage gap for the readers of storage events alone (they start over what
they believed of the storage tiers; the host's stands).

Host events come with the host tier's lock held, storage events with the tier's own index lock:
the ring has a lock of its own, taken last. The service hands it the news only from the first
key_events request on (`followed`): until then a daemon pays nothing per key for it (a call and
an append, about 0.3 us, on every key that lands or leaves).
"""
from __future__ import annotations

import threading

CAPACITY = 65536
HOST = 0  # an event's tier: 0 the host tier, n >= 1 the n-th local storage tier
VOID = 255  # a slot that marks a void of the storage tiers (no key; given to no reader)


class KeyEvents:
    """Event number n sits in slot (n - 1) % capacity, its key in `_keys`, its loadable flag in
    `_flags` and its tier in `_tiers`: a reply is two slices at most, whatever its place in the
    ring (a walk from the oldest, as a deque's, cost a caught-up follower 0.4 ms under the host
    lock per poll)."""

    def __init__(self, capacity: int = CAPACITY):
        self._cap = capacity
        self._lock = threading.Lock()
        self._keys: list = [None] * capacity
        self._flags = bytearray(capacity)
        self._tiers = bytearray(capacity)
        self._next = 1  # the number of the next event
        self._oldest = 1  # the number of the ring's oldest event (== _next: none)
        self._storage_void = 0  # the number of the newest storage void (0: none)
        self.voids = {"host": 0, "storage": 0}  # gaps given to everyone, to storage readers
        self.followed = False  # set by the service at the first request: changes are kept

    def host(self, key: bytes, loadable: bool) -> None:
        """(Host lock held.) `key` became loadable, or stopped being so."""
        with self._lock:
            self._add(key, loadable, HOST)

    def storage(self, tier: int, keys, held: bool) -> None:
        """(The tier's index lock held.) Local storage tier `tier` (>= 1) took these keys, or
        lost them."""
        with self._lock:
            for key in keys:
                self._add(key, held, tier)

    def _add(self, key: bytes, on: bool, tier: int) -> None:
        slot = (self._next - 1) % self._cap
        self._keys[slot] = key
        self._flags[slot] = on
        self._tiers[slot] = tier
        self._next += 1
        if self._next - self._oldest > self._cap:
            self._oldest += 1

    def voided(self, storage: bool = False) -> None:
        """Every host block (a new geometry) is gone unheard: a gap for every reader (the
        number skipped marks it even for one that had seen every event; before any event
        nothing was loadable: nothing is missed). With `storage`: what a storage tier holds
        changed unheard (a clear; it stopped answering, or answers again): a storage gap for
        the readers of storage events alone, marked by an event of its own (VOID) that no
        reader is given; the host events before it stand."""
        with self._lock:
            if storage:
                self._add(b"", False, VOID)
                self._storage_void = self._next - 1
                self.voids["storage"] += 1
            elif self._next > 1:
                self.voids["host"] += 1
                self._keys = [None] * self._cap  # the old keys are not kept alive
                self._next += 1
                self._oldest = self._next

    def status(self) -> dict:
        """For `kvcached status`: whether anyone follows, the numbers the ring holds, the voids."""
        with self._lock:
            return {"followed": self.followed, "newest": self._next - 1, "oldest": self._oldest,
                    "capacity": self._cap, "voids": dict(self.voids)}

    @property
    def last(self) -> int:
        """The number of the newest event (0: none yet)."""
        return self._next - 1

    def since(self, after: int, limit: int, storage: bool = False
              ) -> tuple[list[bytes], bytes, bytes, int, bool, bool]:
        """Up to `limit` events after number `after`: (their keys, one byte each: 1 loadable /
        0 not, one byte each: the tier, the number of the last one looked at - the next `after`
        -, gap, storage gap). With a gap, the events are the ring's oldest on. A storage reader
        without a gap whose events given pass a storage void has a storage gap: the storage
        tiers' state is to be started over, their events up to the void left out (the host's
        stand).
        Without `storage`, the storage tiers' events are left out (they still count in `limit`
        and move the number on), and their voids are nothing."""
        with self._lock:
            gap = after + 1 < self._oldest or after >= self._next
            first = self._oldest if gap else after + 1
            void = self._storage_void if storage and not gap and after < self._storage_void else 0
            count = max(0, min(limit, self._next - first))
            slot = (first - 1) % self._cap
            end = slot + count
            if end <= self._cap:
                keys, flags, tiers = self._keys[slot:end], bytes(self._flags[slot:end]), bytes(self._tiers[slot:end])
            else:  # it wraps
                end -= self._cap
                keys = self._keys[slot:] + self._keys[:end]
                flags = bytes(self._flags[slot:]) + bytes(self._flags[:end])
                tiers = bytes(self._tiers[slot:]) + bytes(self._tiers[:end])
        given = tiers.count(HOST) if not storage else len(tiers) - tiers.count(VOID)
        if given != len(tiers) or void:  # a host-only reader's (1.9's) view; the voids for no one
            # (numbers up to `void` are first .. void: a storage reader's before it, left out)
            kept = [i for i, t in enumerate(tiers)
                    if t == HOST or (storage and t != VOID and first + i > void)]
            keys, flags = [keys[i] for i in kept], bytes(flags[i] for i in kept)
            tiers = bytes(tiers[i] for i in kept)
        last = first + count - 1
        return keys, flags, tiers, last, gap, 0 < void <= last  # told as the reader passes it
