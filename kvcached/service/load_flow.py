"""The load flow: an engine's load from request to end. Planned on the request thread (the host
prefix pinned, the part past it planned from storage), it goes to the fetcher while it has
entries of its own to fetch (storage_flow.py), waits parked while another task still writes
entries of its tail, then runs its device copies on the load worker layer by layer and ends.

It is also where every worker's failed batch and every cancelled load or prefetch gives back
what it holds: the storage flow hands its tasks back here (its FetchEnds).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

from kvcached_proto import TaskStatus
from kvcached_proto.replies import LoadReply

from ..copy.transfer import CopyTask, TaskKind, TransferWorker
from ..host.index import READY, WRITING
from .host_tier import HostTier
from .registration import KVLost, Registered
from .storage_flow import StorageFlow
from .task_table import TaskTable

log = logging.getLogger(__name__)


def run_now(task: CopyTask, start: Callable[[], None]) -> None:
    start()


class LoadFlow:
    def __init__(self, cfg, host: HostTier, table: TaskTable, status_block, registered: Registered,
                 hits: dict):
        self.host, self.table, self.status_block, self.reg, self.hits = host, table, status_block, registered, hits
        self.parked: list[CopyTask] = []  # loads waiting for another task's fetch of their tail
        self.after_reply: Callable[[CopyTask, Callable[[], None]], None] = run_now  # the service defers it
        self.worker = TransferWorker(TaskKind.LOAD, self.run, self.failed)
        self.worker.start()
        self.storage = StorageFlow(cfg, host, table, status_block, self)  # STORAGE_READY once every tier is

    # the request thread -----------------------------------------------------
    def start(self, client, req, blocks, fence) -> LoadReply:
        """Plan the load of req's keys into `blocks` (checked) and send it on."""
        keys = req.body["keys"]
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
            task = self.table.new(TaskKind.LOAD, client, req, blocks[: n + len(tail)],
                                  [e.block for e in entries], entries)
            task.slot, task.keys, task.dev_request = slot, list(keys), blocks
            task.fence = fence
            task.tail, task.fetch, task.tail_pins = tail, own, shared
        num_layers = self.reg.num_layers
        self.status_block.slot_begin(slot, task.task_id, num_layers)
        self.after_reply(task, lambda: self.route(task))
        return LoadReply(task=task.task_id, slot=slot, blocks=n + len(tail), host_blocks=n,
                         storage_blocks=len(tail), num_layers=num_layers)

    # where a load goes next ---------------------------------------------------
    def route(self, task: CopyTask) -> None:
        """Send a load or a prefetch on: to the fetcher while it has entries of its own to
        fetch; parked while another task still writes entries of its tail (their fetch is
        shared); else a load goes to the loader with the leading entries that are in place,
        and a prefetch ends."""
        while True:
            with self.host.lock:
                if task.cancelled:
                    step = "cancelled"
                elif task.fetch:
                    step = "fetch"
                elif any(e.live and e.state == WRITING for e in task.tail_pins):
                    self.parked.append(task)
                    return
                elif task.kind == TaskKind.PREFETCH:
                    step = "prefetched" if self.storage.settle_prefetch(task) else "again"
                else:
                    step = "load" if self._absorb_tail(task) else "replan"
            if step == "again":  # a prefetch planned again (settle_prefetch)
                continue
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
            self.end_cancelled([task])
        elif step == "prefetched":
            self.storage.end_prefetch(task)
        elif step == "fetch":
            self.storage.fetcher.submit(task)
        elif task.entries:
            self.worker.submit(task)
        else:
            self.complete(task)

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

    def wake_parked(self) -> None:
        """Loads whose shared entries all arrived (or went) continue."""
        if not self.parked:
            return
        with self.host.lock:
            woken = [t for t in self.parked
                     if t.cancelled or not any(e.live and e.state == WRITING for e in t.tail_pins)]
            if not woken:
                return
            gone = {id(t) for t in woken}
            self.parked = [t for t in self.parked if id(t) not in gone]
        for task in woken:
            self.route(task)

    def expire_parked(self) -> None:
        """Prefetches parked past their timeout_ms (the `timeout` policy: the daemon stops then)
        end with what they fetched; the task they wait on may take much longer (an offload
        behind an engine's fence, a hung tier)."""
        if not self.parked:
            return
        now = time.monotonic()
        late = self.take_parked(lambda t: t.kind == TaskKind.PREFETCH and t.deadline is not None
                                and now > t.deadline)
        for task in late:
            with self.host.lock:
                self.release_fetch(task)
            self.storage.end_prefetch(task)

    def take_parked(self, pred) -> list[CopyTask]:
        with self.host.lock:
            taken = [t for t in self.parked if pred(t)]
            gone = {id(t) for t in taken}
            self.parked = [t for t in self.parked if id(t) not in gone]
        return taken

    # the load worker ----------------------------------------------------------
    def run(self, batch: list[CopyTask]) -> None:
        """The load worker: the batch's copies layer by layer, each task with its own engine's
        copier."""
        plans = []
        for task in self.runnable(batch):
            copier = self.reg.copier_of(task.client_id)
            task.started_ns = time.monotonic_ns()
            self.status_block.slot_set_valid(task.slot, task.num_blocks)
            plans.append((task, copier, copier.plan(TaskKind.LOAD, task.dev_blocks, task.host_blocks),
                          self.reg.of(task.client_id).order))
            copier.begin_load(task)  # the copies wait for the engine's fence
            task.ready_ns = time.monotonic_ns()
        for layer in range(self.reg.num_layers if plans else 0):
            for task, copier, plan, order in plans:
                if task.cancelled:
                    continue
                if order is not None and order.load_revoked(task.fence):  # read before each layer:
                    task.cancelled = True  # the engine reuses the blocks (a request preempted
                    continue  # while this daemon hung: its cancel is not read yet)
                task.bytes_moved += copier.load_layer(layer, plan)
                copier.layer_loaded(task, layer)  # the slot's order word for the layer
                self.status_block.slot_layer_done(task.slot, layer + 1)
                if layer == 0:
                    task.first_layer_ns = time.monotonic_ns()
        queued = time.monotonic_ns()
        for task, *_ in plans:
            task.queued_ns = queued
        for copier in {id(c): c for _, c, _, _ in plans}.values():
            copier.sync(TaskKind.LOAD)  # every copy landed before the host blocks are unpinned
        for task in self.intact([t for t, *_ in plans]):
            self.complete(task)

    def runnable(self, batch: list[CopyTask]) -> list[CopyTask]:
        """The batch's tasks whose engine is still registered; the others fail here."""
        gone = [t for t in batch if self.reg.of(t.client_id) is None]
        if gone:
            self.failed(gone, KVLost("its KV cache was unregistered before the copy ran"))
        return [t for t in batch if self.reg.of(t.client_id) is not None]

    def intact(self, tasks: list[CopyTask]) -> list[CopyTask]:
        """After the copies: the tasks whose engine's memory held (the others fail: what they
        copied is zero pages where a segment shrank, not that engine's KV)."""
        lost = self.reg.lost_owners(tasks)
        for owner, why in lost.items():
            self.failed([t for t in tasks if t.client_id == owner], KVLost(why))
        return [t for t in tasks if t.client_id not in lost]

    def complete(self, task: CopyTask) -> None:
        loaded = 0 if task.cancelled else task.num_blocks
        with self.host.lock:
            for e in task.entries[:loaded]:  # by where each block was: what a load served
                self.hits["loaded_from_storage" if e.fetched else "loaded_from_host"] += 1
                e.fetched = False
            self.host.unpin(task.entries)
            task.entries = []
            self.table.counters.bytes["h2d"] += task.bytes_moved
        status = TaskStatus.CANCELLED if task.cancelled else TaskStatus.DONE
        self.table.finish(task, status, {"loaded": loaded})

    # ends other than done -------------------------------------------------------
    def end_cancelled(self, tasks: list[CopyTask]) -> None:
        """Loads and prefetches that will not run (taken from a queue, or found cancelled)."""
        for task in tasks:
            task.cancelled = True
            with self.host.lock:
                self.release_fetch(task)
            if task.kind == TaskKind.LOAD:
                self.complete(task)
            else:  # a prefetch: what it fetched before is on the host tier all the same
                self.storage.end_prefetch(task)
        if tasks:
            self.wake_parked()

    def failed(self, batch: list[CopyTask], exc: BaseException) -> None:
        """Every worker's failure path: the batch's tasks give back what they hold and end."""
        for task in batch:
            with self.host.lock:
                if task.kind != TaskKind.BACKUP and task.task_id not in self.table.tasks:
                    continue  # it ended before the failure: nothing of it is held any more
                self._release_failed(task)
            if task.task_id not in self.table.tasks:
                continue  # an internal task (backup)
            result = {"loaded": 0} if task.kind == TaskKind.LOAD else {"stored": 0}
            result["error"] = f"{type(exc).__name__}: {exc}"
            self.table.finish(task, TaskStatus.FAILED, result)
        self.wake_parked()

    def _release_failed(self, task: CopyTask) -> None:
        """(Lock held.) Give back every host block and pin a failed task holds."""
        self.release_fetch(task)
        if task.kind == TaskKind.LOAD:
            self.host.unpin(task.entries)
            task.entries = []
        elif task.kind == TaskKind.OFFLOAD:
            self.host.free([self.host.index.discard(e) for e in task.entries if e.live])
            task.entries = []
        elif task.kind == TaskKind.BACKUP:
            self.storage.release_backup(task)

    def release_fetch(self, task: CopyTask) -> None:
        """(Lock held.) The entries a load or prefetch was to fetch, and its tail's pins."""
        self.storage.discard_fetched(task.fetch)
        self.host.unpin(task.tail_pins)
        task.fetch, task.tail, task.tail_pins = [], [], []
