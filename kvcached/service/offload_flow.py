"""The offload flow: an engine's offload from request to end. On the request thread each key
not in the host tier gets a WRITING entry and a host block (the leading ones, while the pool has
room); the offload worker copies the engine's blocks into them layer by layer, then they are
marked READY (write_through also queues their backup) - or discarded, when the task was
cancelled or the engine revoked the blocks before the copy was confirmed.

Each entry's parent is the key before it: keys[i-1], and for keys[0] the offload's `parent`
(1.15: the last block of the engine's earlier offload of the same request - chunked prefill,
decode blocks). Eviction takes no entry with children, so a request offloaded in parts loses
its tail first, as one offloaded whole does; before, each part's head had no parent and the
earlier part's tail, older, went first, leaving the later parts where no lookup reaches them."""
from __future__ import annotations

import time
from typing import Callable

from kvcached_proto import TaskStatus
from kvcached_proto.replies import OffloadReply

from ..copy.transfer import SPLIT_BLOCKS, CopyTask, TaskKind, TransferWorker
from .host_tier import HostTier
from .load_flow import LoadFlow, run_now
from .registration import Registered
from .task_table import TaskTable


class OffloadFlow:
    def __init__(self, host: HostTier, table: TaskTable, registered: Registered, loads: LoadFlow):
        """`loads`: loads parked on entries an offload writes continue when it ends; a failed
        batch ends there like every worker's."""
        self.host, self.table, self.reg, self.loads = host, table, registered, loads
        self.worker = TransferWorker(TaskKind.OFFLOAD, self.run, loads.failed)
        self.worker.start()
        self.after_reply: Callable[[CopyTask, Callable[[], None]], None] = run_now  # the service defers it

    def start(self, client, req, blocks, fence) -> OffloadReply:
        """Host entries for req's keys not held yet, and the task that fills them from `blocks`
        (checked)."""
        keys = req.body["keys"]
        parent = req.body.get("parent") or None  # (1.15) the chain this offload continues
        with self.host.lock:
            new_pos, host_ids, entries, held = [], [], [], []
            up = self.host.index.get(parent) if parent is not None else None
            ups = [up] if up is not None else []  # held too: keys[0]'s allocation must not evict it
            self.host.index.pin(ups)
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
                entries.append(self.host.index.insert(key, got[0], keys[i - 1] if i else parent))
                new_pos.append(i)
                host_ids.append(got[0])
            self.host.unpin(held + ups)
            task = self.table.new(TaskKind.OFFLOAD, client, req, blocks[new_pos], host_ids, entries)
            task.fence = fence
        if entries:
            self.after_reply(task, lambda: self.worker.submit(task))
        else:
            self.table.finish(task, TaskStatus.DONE, {"stored": 0})
        return OffloadReply(task=task.task_id, stored=len(entries), skipped=len(held), accepted=accepted)

    def run(self, batch: list[CopyTask]) -> None:
        """The offload worker: each task's copies, chunk by chunk and layer by layer, with its
        own engine's copier."""
        for task in self.loads.runnable(batch):
            copier, num_layers = self.reg.copier_of(task.client_id), self.reg.num_layers
            task.started_ns = time.monotonic_ns()
            dev_all = task.dev_blocks
            copier.begin_offload(task)  # the copies wait for the engine's fence
            for start in range(0, task.num_blocks, SPLIT_BLOCKS):
                if task.cancelled:
                    break
                end = min(start + SPLIT_BLOCKS, task.num_blocks)
                plan = copier.plan(TaskKind.OFFLOAD, dev_all[start:end], task.host_blocks[start:end])
                for layer in range(num_layers):
                    task.bytes_moved += copier.offload_layer(layer, plan)
            task.queued_ns = time.monotonic_ns()
            copier.sync(TaskKind.OFFLOAD)  # the host blocks hold the bytes before they are marked ready
            if self.loads.intact([task]):  # else it failed: its host blocks are discarded
                self.complete(task)

    def complete(self, task: CopyTask) -> None:
        """The end of an offload that ran, or of one cancelled before it ran."""
        kv = self.reg.of(task.client_id)
        order = kv.order if kv is not None else None
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
            task.entries = [e for e in task.entries if e.live]  # (what it wrote and is indexed)
        storage = self.loads.storage
        if task.cancelled:
            self.table.finish(task, TaskStatus.CANCELLED, {"stored": 0})
        else:
            if storage.tiers and storage.tiers.write_policy == "write_through":
                with self.host.lock:
                    storage.queue_backup([e for e in task.entries if e.live and not e.doomed])
            self.table.finish(task, TaskStatus.DONE, {"stored": task.num_blocks})
        self.loads.wake_parked()  # loads that shared its entries
