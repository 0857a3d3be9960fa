"""The host tier's changes of what it can load, in order, for clients that follow them (the
key_events op): an engine's scheduler that reports its offloaded blocks to a KV-aware router
(vLLM's KV events, client/vllm/kv_events.py).

Each change is one event: a key became loadable (READY and not doomed) or stopped being so
(evicted, deleted, cleared, doomed), as the index tells `on_visible`. The events sit in a ring of
the last CAPACITY, numbered from 1; a client asks for those after the last number it saw. One
that asks from before the ring's oldest, or from a number this daemon never gave, is told
`gap`: it missed changes and must take none of what it believed as still true. A new block
geometry voids every host block unheard (HostTier.reset_index): that is a gap for everyone.

Called with the host tier's lock held (on_visible is, and the op takes it), so it needs no
lock of its own. The service hands it the index's news only from the first key_events request
on (`followed`): until then a daemon pays nothing per key for it (a call and an append, about
0.2 us, on every key that lands or leaves).
"""
from __future__ import annotations

CAPACITY = 65536


class KeyEvents:
    """Event number n sits in slot (n - 1) % capacity, its key in `_keys` and its loadable flag
    in `_flags`: a reply is two slices at most, whatever its place in the ring (a walk from the
    oldest, as a deque's, cost a caught-up follower 0.4 ms under the host lock per poll)."""

    def __init__(self, capacity: int = CAPACITY):
        self._cap = capacity
        self._keys: list = [None] * capacity
        self._flags = bytearray(capacity)
        self._next = 1  # the number of the next event
        self._oldest = 1  # the number of the ring's oldest event (== _next: none)
        self.followed = False  # set by the service at the first request: changes are kept

    def host(self, key: bytes, loadable: bool) -> None:
        """(Host lock held.) `key` became loadable, or stopped being so."""
        slot = (self._next - 1) % self._cap
        self._keys[slot] = key
        self._flags[slot] = loadable
        self._next += 1
        if self._next - self._oldest > self._cap:
            self._oldest += 1

    def voided(self) -> None:
        """(Host lock held.) Every host block is gone unheard: a gap for every reader (the
        number skipped marks it even for one that had seen every event). Before any event
        (a first registration) nothing was loadable: nothing is missed."""
        if self._next > 1:
            self._keys = [None] * self._cap  # the old keys are not kept alive
            self._next += 1
            self._oldest = self._next

    @property
    def last(self) -> int:
        """The number of the newest event (0: none yet)."""
        return self._next - 1

    def since(self, after: int, limit: int) -> tuple[list[bytes], bytes, int, bool]:
        """(Host lock held.) Up to `limit` events after number `after`: (their keys, one byte
        each: 1 loadable / 0 not, the number of the last one returned - the next `after` -,
        gap). With a gap, the events are the ring's oldest on."""
        gap = after + 1 < self._oldest or after >= self._next
        first = self._oldest if gap else after + 1
        count = max(0, min(limit, self._next - first))
        slot = (first - 1) % self._cap
        end = slot + count
        if end <= self._cap:
            keys, flags = self._keys[slot:end], bytes(self._flags[slot:end])
        else:  # it wraps
            end -= self._cap
            keys = self._keys[slot:] + self._keys[:end]
            flags = bytes(self._flags[slot:]) + bytes(self._flags[:end])
        return keys, flags, first + count - 1, gap
