"""The Mooncake tier's registered buffers (mooncake_store.py): the arena of record headers, the
staging slots for pages kept in many pieces (record.gather and record.scatter copy in and out)."""
from __future__ import annotations

import threading

import numpy as np

from .record import HEADER_BYTES

HEADER_SLOTS = 1024  # headers in flight at once (a batch takes one per key)


def pointer(piece) -> tuple[int, int]:
    arr = np.frombuffer(piece, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


class HeaderArena:
    """HEADER_SLOTS record headers in one registered buffer, handed out per call."""

    def __init__(self):
        self.buf = np.zeros(HEADER_SLOTS * HEADER_BYTES, dtype=np.uint8)
        self.base = self.buf.ctypes.data
        self._free = list(range(HEADER_SLOTS))
        self._cond = threading.Condition()

    def take(self, n: int, timeout: float) -> list[int] | None:
        """n slots, or None when they are not free within `timeout` (slots held by calls to a
        master that stopped answering come back only when those calls return)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= n, timeout):
                return None
            got, self._free = self._free[:n], self._free[n:]
        return got

    def give(self, slots) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def ptr(self, slot: int) -> int:
        return self.base + slot * HEADER_BYTES

    def view(self, slot: int) -> memoryview:
        return memoryview(self.buf)[slot * HEADER_BYTES:(slot + 1) * HEADER_BYTES]


class Staging:
    """`slots` pages of one size in one registered buffer. A page the host pool keeps in
    more than 2 pieces (layer_first: one per layer and part) is copied here behind its header and
    moved as one buffer: Mooncake moves a page of 64 buffers at half the speed of one of 2, and
    the copy costs less than that. Slots are taken without waiting (none free: the page goes as
    its pieces)."""

    def __init__(self, store, page_bytes: int, slots: int):
        self.store = store
        self.slots = slots
        self.page_bytes = page_bytes
        self.slot_bytes = HEADER_BYTES + page_bytes
        self.buf = np.empty(slots * self.slot_bytes, dtype=np.uint8)
        self.ok = store.register_buffer(self.buf.ctypes.data, self.buf.nbytes) == 0
        self._free = list(range(slots))
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def idle(self) -> bool:
        with self._lock:
            return len(self._free) == self.slots

    def ptr(self, slot: int) -> int:
        return self.buf.ctypes.data + slot * self.slot_bytes

    def view(self, slot: int) -> memoryview:
        return memoryview(self.buf)[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def close(self) -> None:
        if self.ok:
            self.store.unregister_buffer(self.buf.ctypes.data)
