"""The cache service: the data-path ops on top of KV registration, the host tier (index, pool),
the task table, the storage flow and the copy workers.

Called from the server thread (ops) and from the transfer workers (completions); one lock (the
host tier's) guards the index, the allocator and the task table, and is never held during a
copy.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch

from kvcached_proto import OP_SPECS, ErrorCode, Op, TaskStatus
from kvcached_proto.shm_layout import NUM_SLOTS, Flag, State

from ..config import DaemonConfig
from ..copy.cuda_copier import make_copier
from ..copy.kv_mapping import KVRegistration
from ..copy.transfer import LOAD, OFFLOAD, SPLIT_BLOCKS, CopyTask, TaskAbort, TransferWorker
from ..errors import OpError
from ..host.index import READY, WRITING
from .host_tier import HostTier
from .registration import checked_layout
from .report import check_service, status_of
from .storage_flow import BACKUP, PREFETCH, StorageFlow
from .task_table import TaskTable

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0


class KVLost(TaskAbort):
    """The registered KV memory went away under a copy (a CPU segment truncated by its owner)."""


class CacheService:
    """The ops and the copy workers' work, over the host tier (index, pool, lock), the task
    table and the storage flow."""

    def __init__(self, cfg: DaemonConfig, signals, events):
        self.cfg = cfg
        self.signals = signals
        self.events = events
        torch.set_num_threads(cfg.copy_threads)
        self.host = HostTier(cfg)
        signals.set_flag(Flag.HOST_POOL_READY)
        self.kv: KVRegistration | None = None
        self.copier = None  # CpuCopier, StrategyCopier or CudaCopier (transfer_cuda.make_copier)
        self.table = TaskTable(self.host.lock, signals, events)  # ids, slots, counters, the end
        self._parked: list[CopyTask] = []  # loads waiting for another task's fetch of their tail
        self.hits = {"lookups": 0, "keys": 0, "host_hits": 0, "storage_hits": 0,
                     "loaded_from_host": 0, "loaded_from_storage": 0}
        self.loader = TransferWorker(LOAD, self._run_loads, self._batch_failed)
        self.offloader = TransferWorker(OFFLOAD, self._run_offloads, self._batch_failed)
        self.loader.start()
        self.offloader.start()
        # STORAGE_READY once every tier is (the disk index rebuilt)
        self.storage = StorageFlow(cfg, self.host, self.table, signals, self._route_load,
                                   self._wake_parked, self._batch_failed)
        self.host.on_evicted = self.storage.on_evicted  # write_back saves what is evicted
        # runs work that may block (a drain) off the request thread; the server sets its
        # control worker's run_later here
        self.defer: Callable[[Callable[[], None]], None] = lambda work: work()
        self._handlers = {
            Op.REGISTER_KV: self._register_kv,
            Op.UNREGISTER_KV: self._unregister_kv,
            Op.OFFLOAD: self._offload,
            Op.LOOKUP: self._lookup,
            Op.LOAD: self._load,
            Op.PREFETCH: self._prefetch,
            Op.FLUSH: self.storage.flush,
            Op.CANCEL: self._cancel,
            Op.DELETE: self._delete,
            Op.CLEAR: self._clear,
            Op.PAUSE: self._pause,
            Op.RESUME: self._resume,
        }

    # dispatch -------------------------------------------------------------
    def handle(self, client, req) -> dict:
        """An op from a client the server has checked (hello; for the ops that need the KV
        cache, that it is registered and this client's)."""
        if OP_SPECS[req.op].needs_kv and self.kv.lost:
            raise OpError(ErrorCode.KV_MISMATCH, self.kv.lost)
        return self._handlers[req.op](client, req)

    def capabilities(self) -> list[str]:
        return ["layerwise_load", "host_tier", f"host_layout:{self.cfg.host_layout}",
                "cuda_ipc" if self.cfg.device.startswith("cuda") else "cpu_shm"]

    # registration ---------------------------------------------------------
    def _register_kv(self, client, req) -> dict:
        spec = checked_layout(req.body["layout"], client.client_id, self.kv, self.cfg.device,
                              self.host.pool.capacity_bytes)
        reg = KVRegistration(spec, client.client_id, self.cfg.device)  # maps or raises, changing nothing
        try:
            copier, kept = self._install(spec, reg)
        except BaseException:
            reg.close()  # refused (BUSY, the pool's pinning, a CUDA error): unmapped
            if self.kv is None:
                self.signals.set_flag(Flag.KV_REGISTERED, False)
            raise
        self.signals.set_flag(Flag.KV_REGISTERED)
        log.info("[kv] %s registered %d layers x %d parts, %d device blocks; %d host blocks kept (copy "
                 "strategy %s)", client.client_id, spec.num_layers, len(spec.parts), spec.num_blocks, kept,
                 copier.strategy)
        return {"host_blocks": self.host.pool.num_blocks, "kept_blocks": kept,
                "page_bytes": spec.page_bytes, "num_slots": NUM_SLOTS,
                "copy_strategy": copier.strategy, **copier.registration_reply()}

    def _install(self, spec, reg) -> tuple:
        """`reg` and its copier made the registration: (copier, host blocks kept). A drain timeout
        or a pool that cannot take the layout leaves the old one; a copier error leaves none."""
        known = self.host.pool.spec  # a new geometry voids the host blocks: queued work on them goes
        self._drain("register_kv", cancel_queued=known is not None and known.geometry() != spec.geometry())
        try:
            with self.host.lock:
                old, old_copier = self.kv, self.copier
                try:
                    new_geometry = self.host.pool.configure(spec)
                except RuntimeError as exc:  # pinning the new layout; the pool is as it was
                    raise OpError(ErrorCode.KV_MISMATCH, f"host pool: {exc}") from None
                if new_geometry:  # old blocks are void
                    self.host.reset_index()
                    self.storage.drop_queued_backups()
                kept = len(self.host.index)
                try:
                    copier = make_copier(spec.device, self.cfg.copy_strategy, reg.views,
                                         self.host.pool, spec.num_layers, reg.order)
                finally:  # the old registration goes either way (a CUDA error leaves none)
                    for gone in (old_copier, old):
                        if gone is not None:
                            gone.close()
                    self.kv = self.copier = None
                self.kv, self.copier = reg, copier
        finally:
            self._undrain()
        return copier, kept

    def _unregister_kv(self, client, req) -> dict:
        if self.kv is None:
            raise OpError(ErrorCode.NOT_REGISTERED, "no KV is registered")
        self._drop_kv("unregister_kv")
        return {}

    def _drop_kv(self, why: str) -> None:
        """Unmap the engine's KV once the copies in flight have drained."""
        self._drain(why)
        try:
            with self.host.lock:
                old, self.kv, copier, self.copier = self.kv, None, self.copier, None
            if copier is not None:
                copier.close()
            old.close()
        finally:
            self._undrain()
        self.signals.set_flag(Flag.KV_REGISTERED, False)

    # data ops -------------------------------------------------------------
    def _check_blocks(self, blocks: np.ndarray) -> None:
        if len(blocks) and int(blocks.max()) >= self.kv.spec.num_blocks:
            raise OpError(ErrorCode.BAD_FIELD,
                          f"blocks: id {int(blocks.max())} >= {self.kv.spec.num_blocks} device blocks")

    def _check_queue(self) -> None:
        queued = self.loader.queued + self.offloader.queued + self.storage.fetcher.queued
        if queued >= self.cfg.max_queued_tasks:
            raise OpError(ErrorCode.BUSY, f"{self.cfg.max_queued_tasks} tasks queued "
                          "(--max-queued-tasks); retry later")

    def _lookup(self, client, req) -> dict:
        keys = req.body["keys"]
        seen, past = self.storage.past_host(keys)
        with self.host.lock:
            self.host.index.note_request(keys)  # the eviction policy's history (lookups only: a load
            entries = self.host.index.prefix(keys)  # follows the lookup of the same request)
            hit = len(entries)
            self.storage.after_hits(entries)
            stored = past if hit == seen else 0  # the host prefix moved meanwhile: no guess
            self.hits["lookups"] += 1
            self.hits["keys"] += len(keys)
            self.hits["host_hits"] += hit
            self.hits["storage_hits"] += stored
        return {"host": hit, "storage": stored}

    def _prefetch(self, client, req) -> dict:
        self._check_queue()
        return self.storage.prefetch(client, req)

    def _offload(self, client, req) -> dict:
        keys, blocks = req.body["keys"], req.body["blocks"]
        self._check_blocks(blocks)
        self._check_queue()
        fence = self._fence(req)  # the engine's KV writes are done once the fence is reached
        with self.host.lock:
            new_pos, host_ids, entries, held = [], [], [], []
            accepted = len(keys)
            for i, key in enumerate(keys):
                present = self.host.index.get(key)
                if present is not None:
                    # hold it while we allocate, so eviction cannot cut the chain we extend
                    self.host.index.touch(present)
                    self.host.index.pin([present])
                    held.append(present)
                    continue
                got = self.host.alloc(1)
                if not got:
                    accepted = i  # pool full of blocks in use: keep the leading ones only
                    break
                entries.append(self.host.index.insert(key, got[0], keys[i - 1] if i else None))
                new_pos.append(i)
                host_ids.append(got[0])
            self.host.unpin(held)
            task = self.table.new(OFFLOAD, client, req, blocks[new_pos], host_ids, entries)
            task.fence = fence
        if entries:
            self.offloader.submit(task)
        else:
            self.table.finish(task, TaskStatus.DONE, {"stored": 0})
        return {"task": task.task_id, "stored": len(entries), "skipped": len(held),
                "accepted": accepted}

    def _fence(self, req) -> tuple[int, int] | None:
        word, fence = req.body.get("fence_word", 0), req.body.get("fence", 0)
        if self.kv.order is None:
            if fence:
                raise OpError(ErrorCode.BAD_FIELD, "fence: this registration has no order_segment")
            return None
        return self.kv.order.check_fence(word, fence)

    def _load(self, client, req) -> dict:
        keys, blocks = req.body["keys"], req.body["blocks"]
        self._check_blocks(blocks)
        self._check_queue()
        fence = self._fence(req)  # the engine's work on the target blocks, before they are written
        host_only = req.body["host_only"]  # (no storage lookup either)
        seen, past = (-1, 0) if host_only else self.storage.past_host(keys)
        with self.host.lock:
            slot = self.table.take_slot()
            entries: list = []
            try:
                entries = self.host.index.prefix(keys)
                self.host.index.pin(entries)
                n = len(entries)
                tail, own, shared = [], [], []
                if n < len(keys) and self.storage.tiers and not host_only:  # the rest: from storage
                    tail, own, shared = self.storage.plan_tail(keys, n, past if n == seen else 0)
            except BaseException:  # nothing of the request stays: slot, pins
                self.table.slots_busy.discard(slot)
                self.host.unpin(entries)
                raise
            self.storage.after_hits(entries)
            task = self.table.new(LOAD, client, req, blocks[: n + len(tail)],
                                  [e.block for e in entries], entries)
            task.slot, task.keys, task.dev_request = slot, list(keys), blocks
            task.fence = fence
            task.tail, task.fetch, task.tail_pins = tail, own, shared
        self.signals.slot_begin(slot, task.task_id, self.kv.spec.num_layers)
        self._route_load(task)
        return {"task": task.task_id, "slot": slot, "blocks": n + len(tail), "host_blocks": n,
                "storage_blocks": len(tail), "num_layers": self.kv.spec.num_layers}

    def _route_load(self, task: CopyTask) -> None:
        """Send a load on: to the fetcher while it has entries of its own to fetch; parked
        while another task still writes entries of its tail (their fetch is shared); else to
        the loader with the leading entries that are in place."""
        while True:
            with self.host.lock:
                if task.cancelled:
                    step = "cancelled"
                elif task.fetch:
                    step = "fetch"
                elif any(e.live and e.state == WRITING for e in task.tail_pins):
                    self._parked.append(task)
                    return
                else:
                    step = "load" if self._absorb_tail(task) else "replan"
            if step != "replan":
                break
            # an entry it waited on went before it arrived (its owner was cancelled, say):
            # plan the rest once more from storage (outside the lock: a store may be remote)
            stored = self.storage.prefix(task.keys[len(task.entries):])
            with self.host.lock:
                task.replanned = True
                start = len(task.entries)
                task.tail, task.fetch, task.tail_pins = self.storage.plan_tail(task.keys, start, stored)
        if step == "cancelled":
            self._finish_cancelled([task])
        elif step == "fetch":
            self.storage.fetcher.submit(task)
        elif task.entries:
            self.loader.submit(task)
        else:
            self._complete_load(task)

    def _absorb_tail(self, task: CopyTask) -> bool:
        """(Lock held.) Move the tail's leading READY entries into the load; False when one
        was lost before arriving and the load has not re-planned yet."""
        valid = []
        for e in task.tail:
            if not (e.live and e.state == READY):
                break
            valid.append(e)
        short = len(valid) < len(task.tail)
        keep = {id(e) for e in valid}
        self.host.unpin([e for e in task.tail_pins if id(e) not in keep])
        task.entries = task.entries + valid
        task.tail, task.tail_pins = [], []
        if short and not task.replanned and self.storage.tiers:
            return False
        task.host_blocks = np.array([e.block for e in task.entries], dtype=np.int64)
        task.dev_blocks = np.asarray(task.dev_request[: len(task.entries)], dtype=np.int64)
        return True

    def _wake_parked(self) -> None:
        """Loads whose shared entries all arrived (or went) continue."""
        if not self._parked:
            return
        with self.host.lock:
            woken = [t for t in self._parked
                     if t.cancelled or not any(e.live and e.state == WRITING for e in t.tail_pins)]
            if not woken:
                return
            gone = {id(t) for t in woken}
            self._parked = [t for t in self._parked if id(t) not in gone]
        for task in woken:
            self._route_load(task)

    def _take_parked(self, pred) -> list[CopyTask]:
        with self.host.lock:
            taken = [t for t in self._parked if pred(t)]
            gone = {id(t) for t in taken}
            self._parked = [t for t in self._parked if id(t) not in gone]
        return taken

    def _cancel(self, client, req) -> dict:
        task_id = req.body["task"]
        with self.host.lock:
            task = self.table.tasks.get(task_id)
            if task is None or task.client_id != client.client_id:
                raise OpError(ErrorCode.UNKNOWN_TASK, f"task {task_id} is not a live task of this client")
            task.cancelled = True
        workers = {LOAD: (self.storage.fetcher, self.loader), OFFLOAD: (self.offloader,),
                   PREFETCH: (self.storage.fetcher,)}.get(task.kind, ())
        if (any(w.remove_queued(lambda t: t is task) for w in workers)
                or self._take_parked(lambda t: t is task)):
            self._finish_cancelled([task])
            return {"state": "cancelled"}
        return {"state": "finishing"}  # in flight: it stops at the next layer or chunk

    def _delete(self, client, req) -> dict:
        deleted = 0
        keys = list(req.body["keys"])
        with self.host.lock:
            for key in keys:
                block = self.host.index.delete(key)
                if block is not None:
                    self.host.free([block])
                    deleted += 1
        stored = self.storage.tiers.delete(keys, self.host.pool.geometry) if self.storage.tiers else 0
        return {"deleted": deleted, "storage_deleted": stored}

    def _clear(self, client, req) -> dict:
        weights = req.body["weights_update"]
        prior = self.signals.state
        if weights:
            self.signals.set_state(State.CLEARING)
        tier = req.body["tier"]
        self._drain("clear", cancel_queued=True)
        try:
            freed, stored = [], 0
            if tier in ("host", "all"):
                with self.host.lock:
                    freed = self.host.index.clear()
                    self.host.free(freed)
            if tier in ("storage", "all") and self.storage.tiers:
                stored = self.storage.tiers.clear()
        finally:
            self._undrain()
        self.signals.set_state(State.CLEARED if weights else prior)
        log.info("[clear] %d host blocks and %d stored blocks dropped (tier %s, weights_update=%s)",
                 len(freed), stored, tier, weights)
        return {"cleared": len(freed) + stored, "host_cleared": len(freed),
                "storage_cleared": stored}

    def _pause(self, client, req) -> dict:
        self._drain("pause", undrain_on_timeout=True)
        self.signals.set_state(State.PAUSED)
        return {}

    def _resume(self, client, req) -> dict:
        self._undrain()
        self.signals.set_state(State.NORMAL)
        return {}

    @property
    def _workers(self) -> tuple[TransferWorker, ...]:
        return (self.storage.fetcher, self.loader, self.offloader, self.storage.backer)

    def _drain(self, why: str, cancel_queued: bool = False, undrain_on_timeout: bool = True) -> None:
        ok = all(w.pause(DRAIN_TIMEOUT_S) for w in self._workers)
        if not ok:
            if undrain_on_timeout:
                self._undrain()
            raise OpError(ErrorCode.BUSY, f"{why}: in-flight copies did not drain in {DRAIN_TIMEOUT_S} s")
        if cancel_queued:
            for worker in (self.storage.fetcher, self.loader, self.offloader):
                self._finish_cancelled(worker.remove_queued(lambda t: True))
            self._finish_cancelled(self._take_parked(lambda t: True))

    def _undrain(self) -> None:
        for w in self._workers:
            w.resume()

    # execution (worker threads) ------------------------------------------
    def _run_offloads(self, batch: list[CopyTask]) -> None:
        for task in batch:
            task.started_ns = time.monotonic_ns()
            dev_all = task.dev_blocks
            self.copier.begin_offload(task)  # the copies wait for the engine's fence
            for start in range(0, task.num_blocks, SPLIT_BLOCKS):
                if task.cancelled:
                    break
                end = min(start + SPLIT_BLOCKS, task.num_blocks)
                plan = self.copier.plan(OFFLOAD, dev_all[start:end], task.host_blocks[start:end])
                for layer in range(self.kv.spec.num_layers):
                    task.bytes_moved += self.copier.offload_layer(layer, plan)
            self.copier.sync(OFFLOAD)  # the host blocks hold the bytes before they are marked ready
            self._check_kv_intact()  # raised: the batch fails, its host blocks are discarded
            self._complete_offload(task)

    def _run_loads(self, batch: list[CopyTask]) -> None:
        num_layers = self.kv.spec.num_layers
        plans = []
        for task in batch:
            task.started_ns = time.monotonic_ns()
            self.signals.slot_set_valid(task.slot, task.num_blocks)
            plans.append((task, self.copier.plan(LOAD, task.dev_blocks, task.host_blocks)))
            self.copier.begin_load(task)  # the copies wait for the engine's fence
        for layer in range(num_layers):
            for task, plan in plans:
                if task.cancelled:
                    continue
                task.bytes_moved += self.copier.load_layer(layer, plan)
                self.copier.layer_loaded(task, layer)  # the slot's order word for the layer
                self.signals.slot_layer_done(task.slot, layer + 1)
        self.copier.sync(LOAD)  # every copy landed before the host blocks are unpinned
        self._check_kv_intact()
        for task, _ in plans:
            self._complete_load(task)

    def _check_kv_intact(self) -> None:
        """After a batch's copies: a segment that shrank under them means what was copied is
        zero pages, not the engine's KV. Raising fails the whole batch (it is all this
        registration's: one engine per instance)."""
        lost = self.kv.lost
        if lost:
            raise KVLost(lost)

    def _complete_offload(self, task: CopyTask) -> None:
        order = self.kv.order if self.kv is not None else None
        if order is not None and order.revoked(task.fence):
            task.cancelled = True  # the engine reused the blocks before the copy was confirmed
        with self.host.lock:
            if task.cancelled:
                freed = [self.host.index.discard(e) for e in task.entries]
                self.host.free(freed)
            else:
                freed = []
                for e in task.entries:
                    if e.doomed:
                        freed.append(self.host.index.discard(e))
                    else:
                        self.host.index.mark_ready(e)
                self.host.free(freed)
                self.table.counters.bytes["d2h"] += task.bytes_moved
        if task.cancelled:
            self.table.finish(task, TaskStatus.CANCELLED, {"stored": 0})
        else:
            if self.storage.tiers and self.storage.tiers.write_policy == "write_through":
                with self.host.lock:
                    self.storage.queue_backup([e for e in task.entries if e.live and not e.doomed])
            self.table.finish(task, TaskStatus.DONE, {"stored": task.num_blocks})
        self._wake_parked()  # loads that shared its entries

    def _complete_load(self, task: CopyTask) -> None:
        loaded = 0 if task.cancelled else task.num_blocks
        with self.host.lock:
            for e in task.entries[:loaded]:  # by where each block was: what a load served
                self.hits["loaded_from_storage" if e.fetched else "loaded_from_host"] += 1
                e.fetched = False
            self.host.unpin(task.entries)
            task.entries = []
            self.table.counters.bytes["h2d"] += task.bytes_moved
        self.table.finish(task, TaskStatus.CANCELLED if task.cancelled else TaskStatus.DONE, {"loaded": loaded})

    def _batch_failed(self, batch: list[CopyTask], exc: BaseException) -> None:
        for task in batch:
            with self.host.lock:
                if task.kind != BACKUP and task.task_id not in self.table.tasks:
                    continue  # it ended before the failure: nothing of it is held any more
                self._release_failed(task)
            if task.task_id not in self.table.tasks:
                continue  # an internal task (backup)
            result = {"loaded": 0} if task.kind == LOAD else {"stored": 0}
            result["error"] = f"{type(exc).__name__}: {exc}"
            self.table.finish(task, TaskStatus.FAILED, result)
        self._wake_parked()

    def _release_failed(self, task: CopyTask) -> None:
        """Give back every host block and pin a failed task holds (called with the lock)."""
        self._release_fetch(task)
        if task.kind == LOAD:
            self.host.unpin(task.entries)
            task.entries = []
        elif task.kind == OFFLOAD:
            self.host.free([self.host.index.discard(e) for e in task.entries if e.live])
        elif task.kind == BACKUP:
            self.storage.release_backup(task)

    def _release_fetch(self, task: CopyTask) -> None:
        """(Lock held.) The entries a load or prefetch was to fetch, and its tail's pins."""
        self.storage.discard_fetched(task.fetch)
        self.host.unpin(task.tail_pins)
        task.fetch, task.tail, task.tail_pins = [], [], []

    def _finish_cancelled(self, tasks: list[CopyTask]) -> None:
        for task in tasks:
            task.cancelled = True
            if task.kind == LOAD:
                with self.host.lock:
                    self._release_fetch(task)
                self._complete_load(task)
            elif task.kind == OFFLOAD:
                self._complete_offload(task)
            elif task.kind == PREFETCH:
                with self.host.lock:
                    self._release_failed(task)
                self.table.finish(task, TaskStatus.CANCELLED, {"prefetched": 0})
        if tasks:
            self._wake_parked()

    # clients and lifecycle -------------------------------------------------
    def drop_client(self, client, dead: bool = False) -> None:
        """A client left or died: cancel its queued tasks; in-flight ones end at the next layer.
        With dead (it died, or said bye) the KV mapping it registered is dropped too (the host
        tier's content stays for the engine that restarts)."""
        mine = lambda t: t.client_id == client.client_id  # noqa: E731
        self.table.cancel_client(client.client_id)
        for worker in (self.storage.fetcher, self.loader, self.offloader):
            self._finish_cancelled(worker.remove_queued(mine))
        self._finish_cancelled(self._take_parked(mine))
        if dead and self.kv is not None and self.kv.owner == client.client_id:
            if self.kv.order is not None:  # copies waiting for fences it will never write go on
                self.kv.order.release_fences()  # (its tasks are cancelled: nothing is kept)
            # no op may use the mapping from now on (a hello reusing the client id included),
            # though it is unmapped only after the drain, off this thread
            self.kv.retired = f"the engine that registered this KV cache ({client.client_id}) is gone"
            self.defer(lambda: self._drop_kv_of(client.client_id))

    def _drop_kv_of(self, client_id: str) -> None:
        """The KV mapping of a client that went away, once the copies in flight drained (if
        they do not within the drain timeout, the mapping stays retired: the next engine's
        register_kv replaces it)."""
        if self.kv is not None and self.kv.owner == client_id:
            self._drop_kv("client gone")
            log.info("[clients] dropped the KV mapping of client %s (gone)", client_id)

    def check(self) -> str:
        """Walk the invariants (report.py); "ok" or what is wrong."""
        return check_service(self)

    def _live_tasks(self) -> list[CopyTask]:
        """Every task that may hold pins: the client tasks, and backups queued or in flight."""
        backer = self.storage.backer
        tasks = list(self.table.tasks.values()) + backer.queued_tasks() + list(backer.inflight)
        return list({id(t): t for t in tasks}.values())  # a flush is in both

    def status(self) -> dict:
        return status_of(self)

    def close(self) -> None:
        # graceful: copies first, then the backups they queued (write_through's promise that
        # what reached the host tier is in storage after a stop)
        self._finish_cancelled(self._take_parked(lambda t: True))
        self.storage.fetcher.stop()
        self.loader.stop()
        self.offloader.stop()
        self.storage.backer.stop(timeout=DRAIN_TIMEOUT_S)
        self.storage.tiers.close()
        with self.host.lock:
            if self.kv is not None:
                self.kv.close()
                self.kv = None
        self.host.pool.close()
