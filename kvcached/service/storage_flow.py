"""The storage flow of the cache service: backups (host -> storage), fetches (storage -> host)
for loads and prefetches, and flush. Built from the host tier (its index, pool and lock) and the
task table by the load flow, which plans what a load takes from storage and gets the load back
(FetchEnds) when its fetch is done.

A fetch inserts WRITING host entries for the storage part of a request, reads their pages
straight into those host blocks on the fetch worker, and keeps the leading ones that arrived
intact; a load then continues with its device copy on the load worker. A backup writes
straight from the host blocks and keeps them pinned until the write is done.

Storage I/O that misses its deadline (a hung filesystem) still owns the host page it reads into
or writes from: such a page is *lent* (IOLoans) - a fetched block is not freed, a backed-up
block stays pinned - until the I/O returns, however late.
"""
from __future__ import annotations

import os
import logging
import time
from typing import Protocol

import numpy as np

from kvcached_proto import ErrorCode
from kvcached_proto.messages import TaskStatus
from kvcached_proto.replies import FlushReply, PrefetchReply
from kvcached_proto.shm_layout import Flag

from ..copy.transfer import CopyTask, TaskKind, TransferWorker
from ..errors import OpError, StartupError
from ..host.index import BACKUP_QUEUED, NOT_STORED, STORED, WRITING
from ..storage.tiers import StorageTiers
from .backup_chains import BackupChains
from .backup_deletes import DeletesSeen
from .io_loans import IOLoans
from .host_tier import HostTier
from .task_table import TaskTable

log = logging.getLogger(__name__)

IO_CHUNK_BLOCKS = 16  # pages staged per storage call: bounds staging memory
MAX_PENDING_BACKUPS = 4096  # blocks queued for backup before new ones are dropped (and counted)


class FetchEnds(Protocol):
    """Where the storage flow hands its tasks back: the load flow (load_flow.py)."""

    def route(self, task: CopyTask) -> None:
        """A load whose fetch ended goes on."""

    def wake_parked(self) -> None:
        """Loads waiting for entries another task writes look again."""

    def failed(self, batch: list[CopyTask], exc: BaseException) -> None:
        """A worker's batch failed: its tasks give back what they hold and end."""


class StorageFlow:
    def __init__(self, cfg, host: HostTier, table: TaskTable, status_block, ends: FetchEnds):
        self.cfg, self.host, self.table, self.status_block, self.ends = cfg, host, table, status_block, ends
        self.loans = IOLoans()
        self.lent_blocks: set[int] = set()  # host blocks a late read still writes into
        self.lent_pins: dict[int, object] = {}  # entries a late write still reads (pinned)
        try:
            self.tiers = StorageTiers(cfg.storage, cfg.storage_write_policy, cfg.storage_writer,
                                      cfg.selective_hits, self._ready,
                                      os.path.join(cfg.run_dir, f"{cfg.instance}.clears-owed"))
        except ValueError as exc:  # a store that cannot be opened (a disk root not creatable)
            raise StartupError(f"--storage {exc}") from None
        self.counters = {"backups": 0, "backup_dropped": 0, "deleted_again": 0, "fetched": 0,
                         "fetched_bytes": 0, "fetch_failed": 0, "prefetched": 0}
        self.chains = BackupChains(self.counters)  # chains a later backup goes on with (the backer's)
        self.pending_backups = 0
        self.deletes = DeletesSeen()  # what a backup queued before a delete must not put back
        self.fetcher = TransferWorker(TaskKind.FETCH, self._run_fetches, ends.failed)
        self.backer = TransferWorker(TaskKind.BACKUP, self._run_backups, ends.failed)
        self.fetcher.start()
        self.backer.start()

    def _ready(self) -> None:
        """Every tier is ready (the disk index rebuilt): lookups see what storage holds."""
        self.status_block.set_flag(Flag.STORAGE_READY)
        log.info("[storage] ready")

    def prefix(self, keys) -> int:
        """How many leading keys the storage tiers hold. Never with the lock held: a store may
        be remote (a Redis round trip), and every worker completion needs the lock."""
        return self.tiers.exists_prefix(keys, self.host.pool.geometry) if self.tiers else 0

    def past_host(self, keys) -> tuple[int, int]:
        """(host prefix seen, storage run past it), the storage part looked up outside the
        lock. A caller that finds another host prefix under the lock uses no storage run (a
        miss, never a wrong hit)."""
        if not self.tiers:
            return -1, 0
        with self.host.lock:
            seen = len(self.host.index.prefix(keys, touch=False))
        return seen, (self.prefix(keys[seen:]) if seen < len(keys) else 0)

    # request-thread helpers (called with self.host.lock held) ------------------

    def plan_tail(self, keys, start: int, stored: int) -> tuple[list, list, list]:
        """Entries for keys[start:start+stored] (the part a load takes from storage), in key
        order: (tail, own, shared). `own` are new WRITING entries this load fetches; `shared`
        were already in the index - being written by another task's fetch or offload (the
        load waits for it instead of fetching twice), or READY - and are pinned here. Stops
        where the host pool is full or a key is being deleted. On an error nothing stays."""
        tail, own, shared = [], [], []
        try:
            for i in range(start, start + stored):
                e = self.host.index.get(keys[i])
                if e is None:
                    e = self._new_fetch_entry(keys, i)  # may evict: `shared` is pinned by now
                    if e is None:
                        break
                    own.append(e)
                elif e.doomed:
                    break
                else:
                    self.host.index.pin([e])
                    shared.append(e)
                tail.append(e)
        except BaseException:
            self._undo_plan(own, shared)
            raise
        return tail, own, shared

    def _insert_for_fetch(self, keys, start: int, count: int, room: int) -> tuple[list, list]:
        """Prefetch: (own, shared) for keys[start:start+count]. `own` are new WRITING entries
        for the keys not in the index (at most `room`: the prefetch share; fewer if the pool is
        full); `shared` are entries another task is writing (a fetch or an offload), pinned
        here: the prefetch ends only once they arrived or went, and fetches those that went
        itself. Keys READY or being deleted are passed over. On an error nothing stays."""
        own, shared = [], []
        try:
            for i in range(start, start + count):
                e = self.host.index.get(keys[i])
                if e is not None:
                    if e.state == WRITING and not e.doomed:
                        self.host.index.pin([e])
                        shared.append(e)
                    continue
                if len(own) >= room:
                    break
                e = self._new_fetch_entry(keys, i)
                if e is None:
                    break
                self.host.index.set_prefetched(e, True)
                own.append(e)
        except BaseException:
            self._undo_plan(own, shared)
            raise
        return own, shared

    def _new_fetch_entry(self, keys, i: int):
        """(Lock held.) A WRITING entry for keys[i] that a fetch fills, or None: the pool is full."""
        got = self.host.alloc(1)
        if not got:
            return None
        e = self.host.index.insert(keys[i], got[0], keys[i - 1] if i else None)
        e.fetched = True
        return e

    def _undo_plan(self, own, shared) -> None:
        self.host.unpin(shared)
        self.host.free([self.host.index.discard(e) for e in own if e.live])

    def _prefetch_room(self) -> int:
        """(Lock held.) Host blocks prefetches may still take (--prefetch-max-share)."""
        share = int(self.host.pool.num_blocks * self.cfg.prefetch_max_share)
        return max(0, share - self.host.index.prefetched)

    def settle_prefetch(self, task: CopyTask) -> bool:
        """(Lock held.) A prefetch whose own fetch ended and whose shared entries all arrived
        or went. False (once, before its deadline) when some went before arriving - the other
        task was cancelled, timed out, or its record was bad: the prefetch then plans its span
        again and fetches what is still missing itself (True: it ends)."""
        went = any(not e.live for e in task.tail_pins)
        self.host.unpin(task.tail_pins)
        task.tail_pins = []
        late = task.deadline is not None and time.monotonic() > task.deadline
        if not went or task.replanned or late or task.cancelled:
            return True
        task.replanned = True
        start, count = task.span
        task.fetch, task.tail_pins = self._insert_for_fetch(task.keys, start, count, self._prefetch_room())
        return False

    def end_prefetch(self, task: CopyTask) -> None:
        self.counters["prefetched"] += task.fetched
        status = TaskStatus.CANCELLED if task.cancelled else TaskStatus.DONE
        self.table.finish(task, status, {"prefetched": task.fetched})

    def queue_backup(self, entries, client_routing=b"") -> None:
        if not (self.tiers and self.tiers.writer):
            return
        todo = [e for e in entries if e.stored == NOT_STORED and e.live]
        if not todo:
            return
        if self.pending_backups + len(todo) > MAX_PENDING_BACKUPS:
            self.counters["backup_dropped"] += len(todo)
            return
        for e in todo:
            e.stored = BACKUP_QUEUED
        self.host.index.pin(todo)
        self.pending_backups += len(todo)
        task = CopyTask(self.table.next_id(), TaskKind.BACKUP, "", client_routing, -10,
                        np.zeros(len(todo), np.int64), np.array([e.block for e in todo]), todo)
        task.deletes_seen = self.deletes.seq
        self.backer.submit(task)

    def _queue_backup_payloads(self, keys, pages) -> None:
        """write_back: pages already copied out of evicted blocks."""
        if self.pending_backups + len(keys) > MAX_PENDING_BACKUPS:
            self.counters["backup_dropped"] += len(keys)
            return
        self.pending_backups += len(keys)
        task = CopyTask(self.table.next_id(), TaskKind.BACKUP, "", b"", -10,
                        np.zeros(len(keys), np.int64), np.zeros(len(keys), np.int64), [])
        task.payloads = (keys, pages)
        task.deletes_seen = self.deletes.seq
        self.backer.submit(task)

    def on_evicted(self, evicted) -> None:
        if not (self.tiers and self.tiers.writer and self.tiers.write_policy == "write_back"):
            return
        keys, pages = [], []
        for e in evicted:
            if e.stored == NOT_STORED:  # its block is reused right after: copy the page out
                page = np.empty(self.host.pool.page_bytes, dtype=np.uint8)
                self.host.pool.read_page(e.block, page)
                keys.append(e.key)
                pages.append([memoryview(page)])
        if keys:
            self._queue_backup_payloads(keys, pages)

    def after_hits(self, entries) -> None:
        """write_through_selective: a block earns its backup by being hit often enough."""
        if self.tiers and self.tiers.write_policy == "write_through_selective":
            self.queue_backup([e for e in entries if e.hits >= self.tiers.selective_hits])
        for e in entries:
            if e.prefetched:
                self.host.index.set_prefetched(e, False)

    # ops ------------------------------------------------------------------
    def prefetch(self, client, req) -> PrefetchReply:
        if not self.tiers:
            return PrefetchReply(task=0, blocks=0, skipped="no storage tier")
        keys = req.body["keys"]
        seen, past = self.past_host(keys)
        with self.host.lock:
            host = len(self.host.index.prefix(keys, touch=False))
            stored = past if host == seen else 0
            tokens = stored * req.body["block_tokens"]
            if tokens < self.cfg.prefetch_threshold_tokens:
                return PrefetchReply(task=0, blocks=0, host=host,
                                     skipped=f"storage hit {tokens} tokens < threshold "
                                             f"{self.cfg.prefetch_threshold_tokens}")
            entries, shared = self._insert_for_fetch(keys, host, stored, self._prefetch_room())
            task = self.table.new(TaskKind.PREFETCH, client, req, np.zeros(len(entries), np.int64),
                                  [e.block for e in entries], [])
            task.fetch, task.tail_pins = entries, shared
            task.keys, task.span = list(keys), (host, stored)
            if req.body["policy"] == "timeout" and req.body["timeout_ms"]:
                task.deadline = time.monotonic() + req.body["timeout_ms"] / 1000
        self.ends.route(task)  # to the fetcher; or parked on the shared entries; or it ends
        return PrefetchReply(task=task.task_id, blocks=len(entries), host=host)

    def flush(self, client, req) -> FlushReply:
        task = CopyTask(self.table.next_id(), TaskKind.FLUSH, client.client_id, client.routing_id,
                        -1000, np.zeros(0, np.int64), np.zeros(0, np.int64), [])
        with self.host.lock:  # after the offloads accepted before it: their backups queued
            self.table.add(task)
            self.table.when_ended(TaskKind.OFFLOAD, lambda: self.backer.submit(task))
        return FlushReply(task=task.task_id)

    # worker side ----------------------------------------------------------
    def _run_fetches(self, batch: list[CopyTask]) -> None:
        for task in batch:
            try:
                self._fetch_task(task)
            except Exception as exc:  # this task only: the others of the batch went on already
                log.exception("[fetch] task %d failed", task.task_id)
                self.ends.failed([task], exc)
            self.ends.wake_parked()

    def _fetch_task(self, task: CopyTask) -> None:
        entries = task.fetch
        n_ok = self._fetch_pages(task, entries)  # on an exception `fetch` stays for cleanup
        with self.host.lock:
            task.fetch = []
            good, bad = entries[:n_ok], entries[n_ok:]
            self.discard_fetched(bad)
            for e in good:
                e.stored = STORED
                if e.doomed:
                    self.host.free([self.host.index.discard(e)])
                else:
                    self.host.index.mark_ready(e)
            if task.kind == TaskKind.LOAD:  # held for the device copy, from the moment they are READY
                arrived = [e for e in good if e.live]
                self.host.index.pin(arrived)
                task.tail_pins = task.tail_pins + arrived
            self.counters["fetched"] += n_ok
            self.counters["fetch_failed"] += len(bad)
        if task.kind != TaskKind.LOAD:
            task.fetched += n_ok
        self.ends.route(task)

    def _fetch_pages(self, task: CopyTask, entries) -> int:
        """Read pages into their host blocks, in chunks; returns the leading count intact."""
        page_bytes = self.host.pool.page_bytes
        done = 0
        deadline = task.deadline
        while done < len(entries):
            if task.cancelled or (deadline is not None and time.monotonic() > deadline):
                break
            chunk = entries[done : done + IO_CHUNK_BLOCKS]
            release, token = self.loans.tokens()
            # straight into the (still WRITING, invisible) host blocks: no staging copy
            got, late = self.tiers.fetch([e.key for e in chunk],
                                         [self.host.pool.page_pieces(e.block) for e in chunk],
                                         self.host.pool.geometry, release)
            if late:
                with self.host.lock:
                    for i in late:
                        self._lend_block(token(i), chunk[i])
            self.counters["fetched_bytes"] += got * page_bytes
            if task.kind != TaskKind.LOAD:  # a load's bytes are its device copies (h2d), counted once
                task.bytes_moved += got * page_bytes
            done += got
            if got < len(chunk):
                break
        return done

    def _lend_block(self, token, e) -> None:
        """(Lock held.) A late read still writes into e's host block: it goes back to the
        pool only once the read returned and the entry is gone (whichever comes last)."""
        block = e.block

        def back() -> None:
            with self.host.lock:
                self.lent_blocks.discard(block)
                if not e.live:
                    self.host.free([block])

        if self.loans.lend(token, back):
            self.lent_blocks.add(block)

    def discard_fetched(self, entries) -> None:
        """(Lock held.) Drop fetch entries whose page did not arrive; a block lent to a late
        read is freed when that read returns instead."""
        for e in entries:
            if e.live:
                block = self.host.index.discard(e)
                if block not in self.lent_blocks:
                    self.host.free([block])

    def _run_backups(self, batch: list[CopyTask]) -> None:
        for task in batch:
            if task.kind == TaskKind.FLUSH:
                self.table.finish(task, TaskStatus.DONE, {})
                continue
            if task.payloads is not None:  # private copies: a late write may keep them
                (keys, pages), task.payloads = task.payloads, None
                with self.host.lock:
                    keep = [i for i, k in enumerate(keys) if not self.deletes.since(k, task.deletes_seen)]
                    self._backups_done(len(keys) - len(keep), dropped=True)
                    seen = self.deletes.seq
                keys, pages = [keys[i] for i in keep], [pages[i] for i in keep]
                stored, _late = self.tiers.put(keys, pages, self.host.pool.geometry)
                with self.host.lock:
                    again = self._deleted_during(keys, seen)
                    self._backups_done(len(keys))
                self._delete_again(again)
                self.counters["backups"] += sum(stored)
                continue
            # the task's blocks, a chain in order (or going on with an earlier backup's): their
            chain = self.chains.start(task.entries[0] if task.entries else None)  # places (tiers.put)
            last = task.entries[-1] if task.entries else None
            while task.entries:  # task.entries: the blocks still pinned for it
                with self.host.lock:
                    chunk, gone = [], []
                    for e in task.entries[:IO_CHUNK_BLOCKS]:
                        (gone if self.deletes.since(e.key, task.deletes_seen) else chunk).append(e)
                    task.entries = chunk + task.entries[len(chunk) + len(gone):]
                    for e in gone:
                        e.stored = NOT_STORED
                    self.host.unpin(gone)
                    self._backups_done(len(gone), dropped=True)
                    seen = self.deletes.seq
                release, token = self.loans.tokens()
                # written straight from the host blocks, which stay pinned until it is done
                keys = [e.key for e in chunk]
                ok, late = self.tiers.put(keys, [self.host.pool.page_pieces(e.block) for e in chunk],
                                          self.host.pool.geometry, release, chain)
                with self.host.lock:
                    task.entries = task.entries[len(chunk):]
                    for e, stored in zip(chunk, ok):
                        e.stored = STORED if stored else NOT_STORED
                    done = [e for i, e in enumerate(chunk)
                            if i not in late or not self._lend_pin(token(i), e)]
                    self.host.unpin(done)
                    again = self._deleted_during(keys, seen)
                    self._backups_done(len(done))
                self._delete_again(again)
                self.counters["backups"] += sum(ok)
            self.chains.end(chain, last)

    def _backups_done(self, n: int, dropped: bool = False) -> None:
        """(Lock held.) n pending backups ended (or, dropped, will not run)."""
        self.pending_backups -= n
        if dropped:
            self.counters["backup_dropped"] += n
        if not self.pending_backups:
            self.deletes.idle()

    def delete(self, keys: list) -> tuple[int, int, list[str]]:
        """The keys out of the host tier (blocks in use go when their readers leave) and the
        storage tiers; no backup pending now stores them afterwards. (host blocks freed, blocks
        the tiers deleted, the tiers that could not delete them)"""
        deleted = 0
        refusing = self.tiers.delete_refusals(len(keys)) if self.tiers else []
        if refusing:  # before anything changes
            raise OpError(ErrorCode.BUSY, f"a delete of {len(keys)} keys must wait: "
                          + "; ".join(refusing))
        with self.host.lock:
            self.deletes.note(keys, self.pending_backups > 0)
            for key in keys:
                block = self.host.index.delete(key)
                if block is not None:
                    self.host.free([block])
                    deleted += 1
        stored, missed = self.tiers.delete(keys, self.host.pool.geometry) if self.tiers else (0, [])
        if missed:
            log.warning("[delete] %d keys not deleted from %s now (down or failing): owed, done "
                        "before the tier serves again", len(keys), ", ".join(missed))
        return deleted, stored, missed

    def _deleted_during(self, keys, seen: int) -> list:
        """(Lock held, before the backups are counted done.) Keys a delete removed while a put
        of them ran: the put may have landed after the tiers' delete - also one that said it
        failed or came back late (a remote write past its deadline lands when it lands; the
        tier, stuck meanwhile, owes the delete until it returned)."""
        return [k for k in keys if self.deletes.since(k, seen)]

    def _delete_again(self, keys) -> None:
        if keys:
            self.tiers.delete(keys, self.host.pool.geometry)  # a tier down now: see delete()
            self.counters["deleted_again"] += len(keys)

    def drop_queued_backups(self, unpin: bool = False) -> None:
        """(Lock held, workers drained.) The backups not begun are dropped. After a new
        geometry the host blocks are void: a backup would store other bytes, or these bytes
        under the new geometry's keys. After a clear of the storage tiers (or a weight update)
        a backup would put back what the clear removed. With unpin, their host blocks' pins
        are given back (their index lives on: a clear)."""
        for task in self.backer.remove_queued(lambda t: t.kind == TaskKind.BACKUP):
            n = len(task.payloads[0]) if task.payloads is not None else len(task.entries)
            self._backups_done(n, dropped=True)
            entries, task.entries, task.payloads = task.entries, [], None
            if unpin and entries:
                for e in entries:
                    e.stored = NOT_STORED
                self.host.unpin(entries)

    def release_backup(self, task: CopyTask) -> None:
        """(Lock held.) A failed backup gives its pins back."""
        if task.entries:
            self._backups_done(len(task.entries))
            self.host.unpin(task.entries)
            task.entries = []

    def _lend_pin(self, token, e) -> bool:
        """(Lock held.) A late write still reads e's host block: e stays pinned until it
        returned. False when it has already (the caller unpins now)."""
        def back() -> None:
            with self.host.lock:
                if self.lent_pins.pop(id(e), None) is not None:
                    self.host.unpin([e])
                    self._backups_done(1)

        if not self.loans.lend(token, back):
            return False
        self.lent_pins[id(e)] = e
        return True

    def status(self) -> list[dict]:
        return self.tiers.status() if self.tiers else []
