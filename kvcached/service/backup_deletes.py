"""Keys deleted while backups were pending, so that no backup puts back what a delete removed.

A `delete` forgets the keys in the host tier and the storage tiers at once, but a backup queued
before it (or running its put while the tiers delete) would store the key again afterwards,
and a later lookup would find it in storage. Each delete is numbered; a backup remembers the
number it was queued under. Before its put it leaves out the keys deleted since, and after its
put it deletes again the keys deleted while the put ran (the put may have landed after the
tiers' delete). Kept only while backups are pending: with none, nothing is recorded. Under a
steady stream of backups (one always pending) the keys of every delete would pile up without
end; past MAX_KEYS they are forgotten, and a backup queued before then takes each of its keys
for deleted (it stores nothing, and deletes again what its write stored): backups lost, never
a deleted key served.
"""
from __future__ import annotations


class DeletesSeen:
    MAX_KEYS = 1 << 20  # keys remembered at most (about 100 MiB)

    def __init__(self):
        self.seq = 0  # deletes so far
        self._at: dict[bytes, int] = {}  # key -> the delete that last removed it
        self._forgot = 0  # the deletes up to this one may have removed any key (_at overflowed)

    def note(self, keys, backups_pending: bool) -> None:
        """(Lock held.) A delete of keys, before the tiers delete them."""
        self.seq += 1
        if not backups_pending:
            self.idle()  # no backup can hold an older number
            return
        if len(self._at) + len(keys) > self.MAX_KEYS:
            self._at.clear()
            self._forgot = self.seq
            return
        for key in keys:
            self._at[key] = self.seq

    def since(self, key: bytes, seq: int) -> bool:
        """(Lock held.) Deleted after delete number `seq` - or maybe, where forgotten since."""
        return seq < self._forgot or self._at.get(key, 0) > seq

    def idle(self) -> None:
        """(Lock held.) No backup is pending any more."""
        self._at.clear()
        self._forgot = 0
