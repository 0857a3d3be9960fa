"""Keys deleted while backups were pending, so that no backup puts back what a delete removed.

A `delete` forgets the keys in the host tier and the storage tiers at once, but a backup queued
before it (or running its put while the tiers delete) would store the key again afterwards,
and a later lookup would find it in storage. Each delete is numbered; a backup remembers the
number it was queued under. Before its put it leaves out the keys deleted since, and after its
put it deletes again the keys deleted while the put ran (the put may have landed after the
tiers' delete). Kept only while backups are pending: with none, nothing is recorded.
"""
from __future__ import annotations


class DeletesSeen:
    def __init__(self):
        self.seq = 0  # deletes so far
        self._at: dict[bytes, int] = {}  # key -> the delete that last removed it

    def note(self, keys, backups_pending: bool) -> None:
        """(Lock held.) A delete of keys, before the tiers delete them."""
        self.seq += 1
        if not backups_pending:
            self._at.clear()  # no backup can hold an older number
            return
        for key in keys:
            self._at[key] = self.seq

    def since(self, key: bytes, seq: int) -> bool:
        """(Lock held.) Deleted after delete number `seq`."""
        return self._at.get(key, 0) > seq

    def idle(self) -> None:
        """(Lock held.) No backup is pending any more."""
        self._at.clear()
