"""The transfer engine: priority queues and one worker per direction.

Queued tasks of the same direction are merged into one batch (up to MERGE_MAX_BLOCKS) so many
small requests become few large copies; a huge task is split into chunks of SPLIT_BLOCKS, with
cancellation checked between chunks. Loads run layer by layer: after a layer's copies for every
task of the batch are in place, each task's progress slot is bumped.

Copies (CPU mode; measured by `kvcached bench transfer`): a run of consecutive host blocks is
one row gather into (offload) or scatter from (load) a host slice, a single pass over the
bytes; scattered host blocks fall back to a gather into a temporary and a scatter. The CUDA
copier (cuda_copier.py) has the same interface: a CopyPlan per chunk, `offload_layer` /
`load_layer` per layer, and the stream and event hooks that are no-ops here.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

import numpy as np
import torch

from kvcached_proto.block_runs import fragmented, host_runs

from .strategies import widen

log = logging.getLogger(__name__)

MERGE_MAX_BLOCKS = 4096
SPLIT_BLOCKS = 2048


class TaskKind(StrEnum):
    """What a task does; also the name of the worker that runs it. Loads and offloads are the
    engine's copies (and a copier's two directions); fetches and prefetches read storage into
    the host tier; backups write it; a flush ends once the offloads accepted before it ended
    and the backups queued before it (theirs too) were written."""
    LOAD = "load"
    OFFLOAD = "offload"
    FETCH = "fetch"
    PREFETCH = "prefetch"
    BACKUP = "backup"
    FLUSH = "flush"


@dataclass(eq=False)
class CopyTask:
    task_id: int
    kind: TaskKind
    client_id: str
    routing_id: bytes
    priority: int
    dev_blocks: np.ndarray
    host_blocks: np.ndarray
    entries: list
    slot: int = -1
    cancelled: bool = False
    started_ns: int = 0  # the copy worker took it
    ready_ns: int = 0  # a load: its plan made and its fence wait queued (its copies may start)
    queued_ns: int = 0  # every copy of it queued (CUDA: on the stream, not yet landed)
    first_layer_ns: int = 0  # a load: its first layer queued and counted (the engine may read it)
    deletes_seen: int = 0  # a backup: the storage flow's deletes when it was queued
    bytes_moved: int = 0
    created_ns: int = field(default_factory=time.monotonic_ns)
    fence: tuple[int, int] | None = None  # the engine's (fence_word, fence) to wait for first
    deadline: float | None = None  # prefetch with the timeout policy: stop then (monotonic s)
    payloads: tuple | None = None  # write_back backup: (keys, pages) copied out at eviction
    # loads and prefetches past the host prefix (service/storage_flow.py)
    keys: list = field(default_factory=list)       # the request's keys (a load re-plans from them)
    fetch: list = field(default_factory=list)      # WRITING entries this task fetches itself
    tail: list = field(default_factory=list)       # load: the entries past `entries`, in key order
    tail_pins: list = field(default_factory=list)  # the entries of another task's write it waits on
    replanned: bool = False
    span: tuple[int, int] = (0, 0)  # prefetch: the keys it brings, keys[start:start+count]
    fetched: int = 0  # prefetch: the blocks it fetched itself
    dev_request: np.ndarray | None = None  # load: every device block the request named

    @property
    def num_blocks(self) -> int:
        return len(self.dev_blocks)


@dataclass(eq=False)
class CopyPlan:
    """One chunk of a task as every layer copies it: device ids, host ids at the same
    positions, and the runs of consecutive host ids. A copier may attach what it derives once
    per chunk (device-side index tensors, say) in `extra`."""
    dev_ids: np.ndarray
    host_ids: np.ndarray
    runs: list
    extra: dict = field(default_factory=dict)  # what a copier derives once for this chunk
    fence: tuple[int, int] | None = None  # the engine's (fence_word, fence) to wait for first

    @classmethod
    def make(cls, dev_ids: np.ndarray, host_ids: np.ndarray) -> "CopyPlan":
        return cls(dev_ids, host_ids, host_runs(host_ids))


def widest_view(t: torch.Tensor) -> np.ndarray:
    """A `[blocks, bytes]` uint8 view as a numpy array of the widest integer type its size,
    stride and address allow: row gathers and scatters run near memcpy speed on wide rows."""
    return widen(t).numpy()


class TaskAbort(Exception):
    """An expected end of a batch (a client's memory went away): one log line, no traceback."""


class CopierHooks:
    """What a copier does around its copies besides moving bytes: the order words (order.py;
    on CPU the fences were checked at request time and progress words are plain stores) and
    the stream hooks, no-ops here (on CPU a copy is done when it returns).
    transfer_cuda.CudaCopier overrides them."""

    order = None  # the registration's DaemonOrder, when the engine sent an order_segment

    def registration_reply(self) -> dict:
        return {}

    def begin_offload(self, task: CopyTask) -> None:
        pass

    def begin_load(self, task: CopyTask) -> None:
        pass

    def layer_loaded(self, task: CopyTask, layer: int) -> None:
        if self.order is not None:
            self.order.loaded(None, task.slot, layer, task.task_id)

    def sync(self, kind: str) -> None:
        pass

    def close(self) -> None:
        pass


class CpuCopier(CopierHooks):
    """Moves blocks between the registered device views and the host views, one layer at a time.

    Measured on CPU (see `kvcached bench transfer`): numpy's fancy-index assignment and
    `take(mode="clip", out=...)` on int64 rows run at ~0.95x of a single-threaded memcpy, where
    torch's index_copy_ reaches ~0.7x and uint8 rows ~0.25x. Block ids are validated before
    a task is queued, so "clip" never changes an index.
    """

    strategy = "numpy"

    def __init__(self, dev_views, host_views):
        self.dev = [[widest_view(t) for t in row] for row in dev_views]
        self.host = [[widest_view(t) for t in row] for row in host_views]
        # device rows a stride apart (vLLM's block-outermost layouts): np.take would copy the
        # whole view to make it contiguous first; torch's index_select reads the rows in place
        self._strided = [[(torch.from_numpy(d), torch.from_numpy(h))
                          if d.strides[0] != d.shape[1] * d.itemsize else None
                          for d, h in zip(dr, hr)] for dr, hr in zip(self.dev, self.host)]

    def close(self) -> None:
        self.dev = self.host = self._strided = []  # the registration can be unmapped now

    def plan(self, kind: str, dev_ids: np.ndarray, host_ids: np.ndarray) -> CopyPlan:
        return CopyPlan.make(dev_ids, host_ids)

    def offload_layer(self, layer: int, plan: CopyPlan) -> int:
        dev_ids, host_ids, runs = plan.dev_ids, plan.host_ids, plan.runs
        moved = 0
        for dev, host, strided in zip(self.dev[layer], self.host[layer], self._strided[layer]):
            if strided is not None:
                dev_t, host_t = strided
                ids = torch.from_numpy(dev_ids)
                for a, b, h in runs:
                    torch.index_select(dev_t, 0, ids[a:b], out=host_t[h : h + (b - a)])
            elif fragmented(len(runs), len(host_ids)):  # fragmented: one gather + one scatter
                host[host_ids] = np.take(dev, dev_ids, axis=0, mode="clip")
            else:
                for a, b, h in runs:
                    np.take(dev, dev_ids[a:b], axis=0, out=host[h : h + (b - a)], mode="clip")
            moved += len(host_ids) * dev.shape[1] * dev.itemsize
        return moved

    def load_layer(self, layer: int, plan: CopyPlan) -> int:
        dev_ids, host_ids, runs = plan.dev_ids, plan.host_ids, plan.runs
        moved = 0
        for dev, host in zip(self.dev[layer], self.host[layer]):
            if fragmented(len(runs), len(host_ids)):
                dev[dev_ids] = np.take(host, host_ids, axis=0, mode="clip")
            else:
                for a, b, h in runs:
                    dev[dev_ids[a:b]] = host[h : h + (b - a)]
            moved += len(host_ids) * dev.shape[1] * dev.itemsize
        return moved


class TransferWorker(threading.Thread):
    """One direction's queue and thread. `execute(batch)` does the copies; errors are reported
    to `on_done` per task, never swallowed."""

    def __init__(self, kind: str, execute: Callable[[list[CopyTask]], None],
                 on_error: Callable[[list[CopyTask], BaseException], None]):
        super().__init__(name=f"kvcached-{kind}", daemon=True)
        self.kind = kind
        self._execute = execute
        self._on_error = on_error
        self._heap: list[tuple[int, int, CopyTask]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopping = False
        self._paused = False
        self._busy = False
        self.inflight: list[CopyTask] = []

    @property
    def queued(self) -> int:
        return len(self._heap)

    def submit(self, task: CopyTask) -> None:
        with self._cv:
            heapq.heappush(self._heap, (-task.priority, next(self._seq), task))
            self._cv.notify()

    def queued_tasks(self) -> list[CopyTask]:
        with self._cv:
            return [t for _, _, t in self._heap]

    def remove_queued(self, pred: Callable[[CopyTask], bool]) -> list[CopyTask]:
        with self._cv:
            taken = [t for _, _, t in self._heap if pred(t)]
            if taken:
                self._heap = [item for item in self._heap if not pred(item[2])]
                heapq.heapify(self._heap)
            return taken

    def pause(self, timeout: float) -> bool:
        """Stop taking tasks and wait until the batch in flight ends. False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._paused = True
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self.join(timeout)
        if self.is_alive():
            log.error("[shutdown] %s worker still busy after %.0f s", self.kind, timeout)

    def _next_batch(self) -> list[CopyTask] | None:
        with self._cv:
            while not self._stopping and (self._paused or not self._heap):
                self._cv.wait(0.1)
            if self._stopping and not self._heap:
                return None
            if self._stopping:
                self._paused = False  # drain what is queued on a graceful stop
            batch = [heapq.heappop(self._heap)[2]]
            total = batch[0].num_blocks
            while self._heap and total + self._heap[0][2].num_blocks <= MERGE_MAX_BLOCKS:
                task = heapq.heappop(self._heap)[2]
                batch.append(task)
                total += task.num_blocks
            self._busy = True
            self.inflight = batch
            return batch

    def run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._execute(batch)
            except BaseException as exc:  # reported to every task of the batch
                if isinstance(exc, TaskAbort):
                    log.error("[%s] batch of %d tasks failed: %s", self.kind, len(batch), exc)
                else:
                    log.exception("[%s] batch of %d tasks failed", self.kind, len(batch))
                self._on_error(batch, exc)
            finally:
                with self._cv:
                    self._busy = False
                    self.inflight = []
                    self._cv.notify_all()
