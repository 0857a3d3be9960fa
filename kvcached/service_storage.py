"""The storage half of the cache service: backups (host -> storage), fetches (storage -> host)
for loads and prefetches, and flush. Mixed into CacheService; shares its lock and index.

A fetch inserts WRITING host entries for the storage part of a request, reads their pages
straight into those host blocks on the fetch worker, and keeps the leading ones that arrived
intact; a load then continues with its device copy on the load worker. A backup writes
straight from the host blocks and keeps them pinned until the write is done.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from .index import BACKUP_QUEUED, NOT_STORED, STORED
from .storage.tiers import StorageTiers
from .transfer import LOAD, CopyTask, TransferWorker

log = logging.getLogger(__name__)

FETCH, BACKUP, PREFETCH = "fetch", "backup", "prefetch"
IO_CHUNK_BLOCKS = 16  # pages staged per storage call: bounds staging memory
MAX_PENDING_BACKUPS = 4096  # blocks queued for backup before new ones are dropped (and counted)


class StorageFlow:
    def _init_storage(self) -> None:
        cfg = self.cfg
        self.tiers = StorageTiers(cfg.storage, cfg.storage_write_policy, cfg.storage_writer,
                                  cfg.selective_hits)
        self.storage_counters = {"backups": 0, "backup_dropped": 0, "fetched": 0,
                                 "fetch_failed": 0, "prefetched": 0}
        self._pending_backups = 0
        self.fetcher = TransferWorker(FETCH, self._run_fetches, self._batch_failed)
        self.backer = TransferWorker(BACKUP, self._run_backups, self._batch_failed)
        self.fetcher.start()
        self.backer.start()

    # request-thread helpers (called with self._lock held) ------------------
    def _storage_prefix(self, keys) -> int:
        return self.tiers.exists_prefix(keys) if self.tiers else 0

    def _insert_for_fetch(self, keys, start: int, count: int) -> list:
        """WRITING host entries for keys[start:start+count]; fewer if the pool is full."""
        entries = []
        for i in range(start, start + count):
            got = self._alloc_host(1)
            if not got:
                break
            entries.append(self.index.insert(keys[i], got[0], keys[i - 1] if i else None))
        return entries

    def _queue_backup(self, entries, client_routing=b"") -> None:
        if not (self.tiers and self.tiers.writer):
            return
        todo = [e for e in entries if e.stored == NOT_STORED and e.live]
        if not todo:
            return
        if self._pending_backups + len(todo) > MAX_PENDING_BACKUPS:
            self.storage_counters["backup_dropped"] += len(todo)
            return
        for e in todo:
            e.stored = BACKUP_QUEUED
        self.index.pin(todo)
        self._pending_backups += len(todo)
        task = CopyTask(next(self._task_ids), BACKUP, "", client_routing, -10,
                        np.zeros(len(todo), np.int64), np.array([e.block for e in todo]), todo)
        self.backer.submit(task)

    def _queue_backup_payloads(self, keys, pages) -> None:
        """write_back: pages already copied out of evicted blocks."""
        if self._pending_backups + len(keys) > MAX_PENDING_BACKUPS:
            self.storage_counters["backup_dropped"] += len(keys)
            return
        self._pending_backups += len(keys)
        task = CopyTask(next(self._task_ids), BACKUP, "", b"", -10, np.zeros(len(keys), np.int64),
                        np.zeros(len(keys), np.int64), [])
        task.extra["payloads"] = (keys, pages)
        self.backer.submit(task)

    def _on_evicted(self, evicted) -> None:
        if not (self.tiers and self.tiers.writer and self.tiers.write_policy == "write_back"):
            return
        keys, pages = [], []
        for e in evicted:
            if e.stored == NOT_STORED:  # its block is reused right after: copy the page out
                page = np.empty(self.pool.page_bytes, dtype=np.uint8)
                self.pool.read_page(e.block, page)
                keys.append(e.key)
                pages.append([memoryview(page)])
        if keys:
            self._queue_backup_payloads(keys, pages)

    def _after_hits(self, entries) -> None:
        """write_through_selective: a block earns its backup by being hit often enough."""
        if self.tiers and self.tiers.write_policy == "write_through_selective":
            self._queue_backup([e for e in entries if e.hits >= self.tiers.selective_hits])
        for e in entries:
            self.index.set_prefetched(e, False)

    # ops ------------------------------------------------------------------
    def _prefetch(self, client, req) -> dict:
        if not self.tiers:
            return {"task": 0, "blocks": 0, "skipped": "no storage tier"}
        keys = req.body["keys"]
        self._check_queue()
        with self._lock:
            host = len(self.index.prefix(keys, touch=False))
            stored = self._storage_prefix(keys[host:])
            tokens = stored * req.body["block_tokens"]
            if tokens < self.cfg.prefetch_threshold_tokens:
                return {"task": 0, "blocks": 0, "host": host,
                        "skipped": f"storage hit {tokens} tokens < threshold "
                                   f"{self.cfg.prefetch_threshold_tokens}"}
            room = int(self.pool.num_blocks * self.cfg.prefetch_max_share) - self.index.prefetched
            entries = self._insert_for_fetch(keys, host, max(0, min(stored, room)))
            for e in entries:
                self.index.set_prefetched(e, True)
            task = self._new_task(PREFETCH, client, req, np.zeros(len(entries), np.int64),
                                  [e.block for e in entries], [])
            task.extra["fetch"] = entries
            if req.body["policy"] == "timeout" and req.body["timeout_ms"]:
                task.extra["deadline"] = time.monotonic() + req.body["timeout_ms"] / 1000
        if entries:
            self.fetcher.submit(task)
        else:
            self._finish(task, "done", {"prefetched": 0})
        return {"task": task.task_id, "blocks": len(entries), "host": host}

    def _flush(self, client, req) -> dict:
        task = CopyTask(next(self._task_ids), BACKUP, client.client_id, client.routing_id, -1000,
                        np.zeros(0, np.int64), np.zeros(0, np.int64), [])
        task.extra["flush"] = True
        with self._lock:
            self.tasks[task.task_id] = task
        self.backer.submit(task)
        return {"task": task.task_id}

    # worker side ----------------------------------------------------------
    def _run_fetches(self, batch: list[CopyTask]) -> None:
        for task in batch:
            entries = task.extra["fetch"]
            n_ok = self._fetch_pages(task, entries)  # on an exception "fetch" stays for cleanup
            with self._lock:
                task.extra.pop("fetch")
                good, bad = entries[:n_ok], entries[n_ok:]
                freed = [self.index.discard(e) for e in bad if e.live]
                self.pool.allocator.free(freed)
                for e in good:
                    e.stored = STORED
                    if e.doomed:
                        self.pool.allocator.free([self.index.discard(e)])
                    else:
                        self.index.mark_ready(e)
                self.storage_counters["fetched"] += n_ok
                self.storage_counters["fetch_failed"] += len(bad)
            if task.kind == LOAD:
                self._continue_load(task, good)
            else:
                self.storage_counters["prefetched"] += n_ok
                status = "cancelled" if task.cancelled else "done"
                self._finish(task, status, {"prefetched": n_ok})

    def _fetch_pages(self, task: CopyTask, entries) -> int:
        """Read pages into their host blocks, in chunks; returns the leading count intact."""
        page_bytes = self.pool.page_bytes
        done = 0
        deadline = task.extra.get("deadline")
        while done < len(entries):
            if task.cancelled or (deadline is not None and time.monotonic() > deadline):
                break
            chunk = entries[done : done + IO_CHUNK_BLOCKS]
            # straight into the (still WRITING, invisible) host blocks: no staging copy
            got = self.tiers.fetch([e.key for e in chunk],
                                   [self.pool.page_pieces(e.block) for e in chunk])
            task.bytes_moved += got * page_bytes
            done += got
            if got < len(chunk):
                break
        return done

    def _continue_load(self, task: CopyTask, fetched) -> None:
        """After its storage part arrived: pin what came, then copy host -> device."""
        with self._lock:
            self.index.pin(fetched)
            n_host = len(task.entries)
            task.entries = task.entries + list(fetched)
            task.host_blocks = np.array([e.block for e in task.entries], dtype=np.int64)
            task.dev_blocks = task.dev_blocks[: len(task.entries)]
        if task.cancelled:
            self._finish_cancelled([task])
            return
        if not task.entries:
            self._complete_load(task)
            return
        log.debug("[load] task %d: %d host + %d storage blocks", task.task_id, n_host, len(fetched))
        self.loader.submit(task)

    def _run_backups(self, batch: list[CopyTask]) -> None:
        for task in batch:
            if task.extra.get("flush"):
                self._finish(task, "done", {})
                continue
            if "payloads" in task.extra:
                keys, pages = task.extra.pop("payloads")
                stored = self.tiers.put(keys, pages)
                with self._lock:
                    self._pending_backups -= len(keys)
                self.storage_counters["backups"] += sum(stored)
                continue
            for start in range(0, len(task.entries), IO_CHUNK_BLOCKS):
                chunk = task.entries[start : start + IO_CHUNK_BLOCKS]
                # written straight from the host blocks, which stay pinned until it is done
                ok = self.tiers.put([e.key for e in chunk],
                                    [self.pool.page_pieces(e.block) for e in chunk])
                with self._lock:
                    self.pool.allocator.free(self.index.unpin(chunk))
                    self._pending_backups -= len(chunk)
                    for e, stored in zip(chunk, ok):
                        e.stored = STORED if stored else NOT_STORED
                self.storage_counters["backups"] += sum(ok)

    def _drain_backups(self, timeout: float) -> bool:
        """Wait until the backups queued so far are written (graceful stop, flush)."""
        deadline = time.monotonic() + timeout
        while self.backer.queued or self.backer.inflight:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _storage_status(self) -> list[dict]:
        return self.tiers.status() if self.tiers else []
