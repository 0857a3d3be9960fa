"""The daemon's side of the key table (layout: kvcached_proto.key_table): it publishes which
keys the host tier holds READY and which its local storage tiers (disk) hold, so clients answer
lookups from shared memory without a message.

The daemon is the only writer. Every update is one C call made with the GIL held (so the
daemon's threads write one at a time), under this object's lock (so a table being replaced is
never written). The host index calls `host()` as an entry becomes loadable or stops being so
(BlockIndex.on_visible); a disk tier calls `stored()` / `storage_cleared()` under its own lock
as its index changes (DiskBackend.watch_keys), with its stored names, which are the keys salted
with the geometry (record.stored_key): XOR with the geometry gives the engine's key back (done
in C, update_many: one call for a tier's whole index).

A table is made for each block geometry the host pool takes (`rebuild`), sized for the pool's
blocks plus what the local tiers can hold of that geometry; the old one is closed (its OPEN flag
cleared, so readers drop it) and unlinked. A table that cannot take a key says so in its flags
(HOST_COMPLETE or STORAGE_COMPLETE cleared) and clients ask the daemon for what it cannot answer.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
from typing import Callable, Iterable

import posix_ipc

from ..storage.record import stored_key
from kvcached_proto import shm_room
from kvcached_proto.paths import segment_inode, segment_owner
from kvcached_proto.key_table import (HOST_BIT, MAX_STORAGE_TIERS, MIN_SLOTS, Flags, max_count, native,
                                      segment_name, table_bytes, table_slots)

log = logging.getLogger(__name__)

MAX_HEALS = 16  # tables made anew in a daemon's life (as for the status segment: status_block.py)


class KeyPublisher:
    def __init__(self, instance: str, epoch: int, tiers=(), enabled: bool = True):
        self.name = segment_name(os.getuid(), instance)
        self.epoch = epoch
        self._kt = native() if enabled else None
        self._lock = threading.RLock()
        self._mm: mmap.mmap | None = None
        self._ino = 0  # the table's file in /dev/shm (heal)
        self.heals = 0
        self._nslots = 0
        self._geometry: bytes | None = None
        self._storage_limit = 0  # storage keys stop here: the rest is kept for the host's
        self._storage_full = False
        self.refused = {"host": 0, "storage": 0}  # keys a full table could not take
        backends = list(getattr(tiers, "backends", ()))
        self._local = [b for b in backends if getattr(b, "local_keys", False)][:MAX_STORAGE_TIERS]
        self._remote = len(self._local) < len(backends)
        self._storage_flags = 0
        self._listener: tuple | None = None  # (on_keys, on_cleared): listen()
        self._answering: list[bool] = []  # each local tier answered at the last refresh (listen)
        self._dumping: set[int] = set()  # the tiers telling their whole index (watch_keys)
        self._sweep()

    @property
    def enabled(self) -> bool:
        return self._kt is not None

    def _sweep(self) -> None:
        """A table a daemon of this instance left when it died (the status segment's sweep has
        shown that no live daemon owns the instance), or one another uid planted under its name
        (clients never read that one; if it cannot be removed, they send their lookups)."""
        uid = segment_owner(self.name)
        if uid is None:
            return
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            return
        except posix_ipc.PermissionsError:
            log.warning("[startup] the key table %s was made by uid %d and this user cannot remove "
                        "it: no key table, clients send their lookups (remove it as that user or "
                        "root)", self.name, uid)
            return
        if uid != os.getuid():
            log.warning("[startup] removed the key table %s: made by uid %d, not this daemon's "
                        "user", self.name, uid)
        else:
            log.warning("[startup] swept the stale key table %s", self.name)

    # the table ------------------------------------------------------------------------------
    def rebuild(self, host_blocks: int, geometry: bytes, page_bytes: int) -> None:
        """(Host lock held.) A new, empty table for a new block geometry; the local storage
        tiers' keys of that geometry are published into it. The tiers are watched with a table
        or without one (none built, or it cannot be made): the storage events (listen) follow
        them all the same."""
        self._geometry = geometry
        storage = sum(getattr(b, "capacity_bytes", 0) // max(page_bytes, 1) + 1 for b in self._local)
        nslots = table_slots(host_blocks + storage)
        made = self._kt is not None and self._new_table(nslots, host_blocks)
        self._watch_local()
        if made:
            self.refresh()
            log.info("[keys] key table %s: %d slots (%.1f MiB) for %d host blocks and %d local "
                     "storage blocks", self.name, self._nslots, table_bytes(self._nslots) / 2**20,
                     host_blocks, storage)

    def _new_table(self, nslots: int, host_blocks: int, host_complete: bool = True) -> bool:
        """The old table closed and a new, empty one made; False where it cannot be.
        host_complete=False: readers ask the daemon for host keys until it is set (heal)."""
        with self._lock:
            self._close_table()
            try:
                shm, nslots = self._make_segment(nslots, host_blocks)
            except (posix_ipc.ExistentialError, OSError, ValueError) as exc:
                log.warning("[keys] cannot make the key table %s (%s): clients send lookups", self.name, exc)
                return False
            try:
                self._mm = mmap.mmap(shm.fd, table_bytes(nslots))
                self._ino, self._nslots = os.fstat(shm.fd).st_ino, nslots
            finally:
                shm.close_fd()
            self._kt.init(self._mm, nslots, self.epoch, secrets.randbits(64), max_count(nslots))
            self._storage_limit = max(0, max_count(nslots) - host_blocks)  # room kept for the host
            self._storage_full = False
            flags = Flags.OPEN | (Flags.HOST_COMPLETE if host_complete else 0)
            if not self._local and not self._remote:
                flags |= Flags.NO_STORAGE
            if self._remote:
                flags |= Flags.STORAGE_REMOTE
                if not self._local:  # nothing local to wait for: the remote part is the daemon's
                    flags |= Flags.STORAGE_COMPLETE
            self._kt.set_flags(self._mm, flags, 0)
            self._storage_flags = 0
        return True

    def _make_segment(self, nslots: int, host_blocks: int) -> tuple[posix_ipc.SharedMemory, int]:
        """The table's segment, its memory taken (a sparse one killed the daemon with SIGBUS
        as its slots were written on a /dev/shm without room: Docker's 64 MiB). It takes at
        most half of what /dev/shm has free (the engines' KV segments live there too): where
        `nslots` do not fit, a table of half as many, down to MIN_SLOTS, holds what it can and
        says in its flags what it lacks (clients ask the daemon for that)."""
        wanted, why = nslots, None
        while True:
            if nslots > MIN_SLOTS and table_bytes(nslots) > shm_room.free_bytes() // 2:
                why, nslots = why or f"/dev/shm has {shm_room.free_bytes() / 2**20:.1f} MiB free", nslots // 2
                continue
            shm = posix_ipc.SharedMemory(self.name, flags=posix_ipc.O_CREX, mode=0o600,
                                         size=table_bytes(nslots))
            try:
                shm_room.reserve(shm.fd, table_bytes(nslots), "key table")
            except BaseException as exc:
                shm.close_fd()
                posix_ipc.unlink_shared_memory(self.name)
                if not isinstance(exc, shm_room.NoShmRoom) or nslots <= MIN_SLOTS:
                    raise
                why, nslots = why or exc.strerror, nslots // 2
                continue
            if why is not None:
                log.warning("[keys] %s: a key table of %d slots (%.1f MiB) instead of %d (%.1f "
                            "MiB), for %d host blocks and the local storage's: lookups of what it "
                            "cannot hold go to the daemon; %s", why, nslots, table_bytes(nslots) / 2**20,
                            wanted, table_bytes(wanted) / 2**20, host_blocks, shm_room.ADVICE)
            return shm, nslots

    def heal(self, loadable: Callable[[], Iterable[bytes]], host_blocks: int) -> bool:
        """(Host lock held; about once a second.) The table's name gone from /dev/shm while the
        daemon ran (status_block.py says by what): a new table under it, holding the host's
        loadable keys and the local tiers' again; readers of the old one see it closed and
        open the new one. True if it was made. A table another process put under the name is
        left alone (clients check whose it is)."""
        with self._lock:
            if self._mm is None or self.heals >= MAX_HEALS or segment_inode(self.name) is not None:
                return False
            self.heals += 1  # (each one re-tells the disk tiers' whole index, under the host lock)
            if not self._new_table(self._nslots, host_blocks, host_complete=False):
                return False
            mm = self._mm
            for key in loadable():  # (a reader asks the daemon until they are all in)
                if self._kt.update(mm, key, HOST_BIT, 0) < 0:
                    self.refused["host"] += 1
                    log.warning("[keys] the key table is full: lookups that need its host keys are "
                                "answered by the daemon until the next table")
                    break
            else:
                self._kt.set_flags(mm, Flags.HOST_COMPLETE, 0)
        self._watch_local()
        self.refresh()
        log.warning("[keys] the key table %s was removed from /dev/shm while the daemon ran: made "
                    "it anew, with the keys it held", self.name)
        return True

    def _watch_local(self) -> None:
        """Each local tier tells its whole index (into the new table), then each change."""
        for n, backend in enumerate(self._local, start=1):
            self._dumping.add(n)  # its whole index now: not a change for the listener
            try:
                backend.watch_keys(lambda keys, on, bit=1 << n: self.stored(bit, keys, on),
                                   lambda bit=1 << n: self.storage_cleared(bit), self.refresh)
            finally:
                self._dumping.discard(n)

    def listen(self, on_keys: Callable[[int, list, bool], None], on_cleared: Callable[[int], None]) -> None:
        """From now on, on_keys(n, keys, held?) hears each change of the n-th local storage
        tier's index (n from 1, `local_tiers`' order), with the engine's keys of the table's
        geometry, and on_cleared(n) each clear of it: called under the tier's index lock, in its
        order of events. A tier that stops answering (its root gone, I/O past its deadline) or
        answers again is told as a clear too (from the next refresh): what it holds could not be
        loaded a while, or can be again, unheard."""
        with self._lock:
            self._answering = self._answers()
            self._listener = (on_keys, on_cleared)

    def _answers(self) -> list[bool]:
        """Whether each local tier answers now (indexed and healthy): what it holds is loadable."""
        return [b.ready() and b.health() for b in self._local]

    @property
    def local_tiers(self) -> list[str]:
        """The local storage tiers' names (as status names them), in the order of their bits."""
        return [getattr(b, "uri", "") for b in self._local]

    def local_holds(self, keys) -> list[int]:
        """For each key, the bits (1 << n) of the local storage tiers that hold it now."""
        geometry = self._geometry
        out = [0] * len(keys)
        if geometry is None:
            return out
        names = [stored_key(k, geometry) for k in keys]
        for n, (backend, answers) in enumerate(zip(self._local, self._answers()), start=1):
            if not answers:  # holds nothing it can serve now
                continue
            for i, held in enumerate(backend.holds(names)):
                if held:
                    out[i] |= 1 << n
        return out

    def _close_table(self) -> None:
        if self._mm is None:
            return
        self._kt.set_flags(self._mm, 0, Flags.OPEN)  # readers that still map it drop it
        self._mm.close()
        self._mm = None
        if segment_inode(self.name) == self._ino:  # (gone, or another's under the name: not unlinked)
            posix_ipc.unlink_shared_memory(self.name)

    def close(self) -> None:
        with self._lock:
            if self._kt is not None:
                self._close_table()

    # updates --------------------------------------------------------------------------------
    def host(self, key: bytes, on: bool) -> None:
        """A host entry became loadable (READY), or stopped being so."""
        with self._lock:
            mm = self._mm
            if mm is None:
                return
            if on:
                if self._kt.update(mm, key, HOST_BIT, 0) < 0:
                    self._refuse("host", Flags.HOST_COMPLETE)
            else:
                self._kt.update(mm, key, 0, HOST_BIT)

    def stored(self, bit: int, stored_keys, on: bool) -> None:
        """A local storage tier took (or lost) these stored names."""
        n = bit.bit_length() - 1
        if self._listener is not None and n not in self._dumping and self._geometry is not None:
            geometry = self._geometry
            self._listener[0](n, [stored_key(k, geometry) for k in stored_keys], on)
        with self._lock:
            mm, geometry = self._mm, self._geometry
            if mm is None:
                return
            names = b"".join(stored_keys)  # one C call for all (a tier's whole index, at once)
            if on:
                if self._kt.update_many(mm, names, geometry, bit, 0, self._storage_limit):
                    self._storage_full = True
                    self._refuse("storage", Flags.STORAGE_COMPLETE)
            else:
                self._kt.update_many(mm, names, geometry, 0, bit)

    def storage_cleared(self, bit: int) -> None:
        if self._listener is not None:
            self._listener[1](bit.bit_length() - 1)
        with self._lock:
            if self._mm is not None:
                self._kt.clear_bits(self._mm, bit)

    def _refuse(self, what: str, flag: Flags) -> None:
        self.refused[what] += 1
        if self._kt.set_flags(self._mm, 0, 0) & flag:
            log.warning("[keys] the key table is full: lookups that need its %s keys are answered "
                        "by the daemon until the next table", what)
            self._kt.set_flags(self._mm, 0, flag)

    def refresh(self) -> None:
        """(Any thread, often.) STORAGE_COMPLETE while every local tier answers (indexed, healthy)
        and the table has held all their keys. A tier whose answering changed since the last
        refresh is told to the listener as a clear."""
        if not self._local:
            return
        now = self._answers()
        with self._lock:
            changed = [n for n, (was, is_) in enumerate(zip(self._answering, now), start=1) if was != is_]
            self._answering = now
            listener = self._listener
        for n in changed if listener is not None else ():
            log.info("[keys] local storage tier %d %s: told as a clear to the key events", n,
                     "answers again" if now[n - 1] else "stopped answering")
            listener[1](n)
        flags = Flags.STORAGE_COMPLETE if all(now) and not self._storage_full else 0
        with self._lock:
            if self._mm is None or flags == self._storage_flags:
                return
            self._storage_flags = flags
            self._kt.set_flags(self._mm, flags, Flags.STORAGE_COMPLETE & ~flags)

    def status(self) -> dict:
        with self._lock:
            if self._kt is None:
                return {"enabled": False, "why": "the C extension kvcached_proto._keytable is not built"}
            if self._mm is None:
                return {"enabled": True, "segment": None}
            keys, limit, nslots = self._kt.count(self._mm)
            flags = Flags(self._kt.set_flags(self._mm, 0, 0))
        return {"enabled": True, "segment": self.name, "keys": keys, "max_keys": limit, "slots": nslots,
                "bytes": table_bytes(nslots), "local_storage_tiers": len(self._local),
                "flags": [f.name.lower() for f in Flags if f & flags], "refused": dict(self.refused)}
