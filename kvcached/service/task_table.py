"""The daemon's table of client tasks: ids, the load-progress slots, counters, and the one way
a task ends (counted, its slot finished, its event sent).

It shares the service's lock (the host tier's), since a task's entries and pins live there.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Callable

import numpy as np

from kvcached_proto import ErrorCode, TaskStatus, task_event
from kvcached_proto.shm_layout import NUM_SLOTS, SlotStatus

from ..copy.transfer import CopyTask
from ..errors import OpError

log = logging.getLogger("kvcached.service")

_SLOT_STATUS = {TaskStatus.DONE: SlotStatus.DONE, TaskStatus.FAILED: SlotStatus.FAILED}


class TaskCounters:
    def __init__(self):
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.bytes = {"d2h": 0, "h2d": 0}
        # per kind of copied task (offload, load): seconds spent waiting for the copy worker,
        # queueing the copies (the CPU's share), then until they landed and the task ended
        self.phases: dict[str, dict[str, float]] = {}

    def add_phases(self, phases: dict[str, float], kind: str) -> None:
        p = self.phases.setdefault(kind, {"tasks": 0})
        p["tasks"] += 1
        for name, seconds in phases.items():
            p[name] = p.get(name, 0.0) + seconds


class TaskTable:
    def __init__(self, lock, status_block, events):
        self.lock = lock
        self.status_block = status_block
        self.events = events
        self.tasks: dict[int, CopyTask] = {}
        self.slots_busy: set[int] = set()
        self.counters = TaskCounters()
        self.on_task_end: Callable[[str, float], None] = lambda kind, seconds: None  # metrics
        # when_ended's, per kind: (bound, then) in the order of their bounds (ids only grow)
        self._waiters: dict[str, collections.deque] = {}
        # the ids of each kind's tasks in the table (new()'s), oldest first: a lookup, not a scan
        self._live: dict[str, dict[int, None]] = {}
        self.of_client: collections.Counter = collections.Counter()  # client id -> its tasks here
        self._ids = itertools.count(1)
        self._slot_cursor = 0

    def next_id(self) -> int:
        """A task id (backups, which are not in the table, draw from the same count)."""
        return next(self._ids)

    def new(self, kind, client, req, dev_blocks, host_ids, entries) -> CopyTask:
        """(Lock held.) A task of `client` for request `req`, in the table."""
        task = CopyTask(next(self._ids), kind, client.client_id, client.routing_id,
                        req.body.get("priority", 0), np.asarray(dev_blocks, dtype=np.int64),
                        np.asarray(host_ids, dtype=np.int64), entries)
        self.add(task)
        return task

    def add(self, task: CopyTask) -> None:
        """(Lock held.) A task made elsewhere (a flush) in the table, until its finish()."""
        self.tasks[task.task_id] = task
        self._live.setdefault(task.kind, {})[task.task_id] = None
        self.of_client[task.client_id] += 1

    def live(self, kind: str) -> int:
        """(Lock held.) How many tasks of `kind` are in the table."""
        return len(self._live.get(kind, ()))

    def when_ended(self, kind: str, then: Callable[[], None]) -> None:
        """(Lock held.) then() once every task of `kind` in the table now (new()'s) has ended -
        at once when there is none, else on the thread that ends the last of them (after its
        end's own work: an offload's backups are queued before its end). A waiter costs one
        entry however many tasks it waits for, and an end looks at the oldest waiters only (a
        flood of flushes behind a paused daemon is a queue, not a set of ids each, nor a scan
        of the table)."""
        if self._live.get(kind):
            self._waiters.setdefault(kind, collections.deque()).append((next(self._ids), then))
        else:
            then()

    def take_slot(self) -> int:
        """(Lock held.) A free load-progress slot, round robin; BUSY when none is."""
        for _ in range(NUM_SLOTS):
            slot = self._slot_cursor
            self._slot_cursor = (self._slot_cursor + 1) % NUM_SLOTS
            if slot not in self.slots_busy:
                self.slots_busy.add(slot)
                return slot
        raise OpError(ErrorCode.BUSY, f"all {NUM_SLOTS} load-progress slots are in use; retry later")

    def finish(self, task: CopyTask, status: TaskStatus, result: dict) -> None:
        """End a task once: count it, finish its slot, send its event (a second end is a no-op)."""
        with self.lock:
            if self.tasks.pop(task.task_id, None) is None:
                return
            self._live.get(task.kind, {}).pop(task.task_id, None)
            self.of_client[task.client_id] -= 1
            if not self.of_client[task.client_id]:
                del self.of_client[task.client_id]
            ready = self._ended(task.kind) if task.kind in self._waiters else ()
            phases = _phases(task, time.monotonic_ns())
            if status == TaskStatus.DONE:
                self.counters.completed += 1
                if phases:
                    self.counters.add_phases(phases, task.kind)
            elif status == TaskStatus.FAILED:
                self.counters.failed += 1
            else:
                self.counters.cancelled += 1
            if task.slot >= 0:
                self.status_block.slot_finish(task.slot, _SLOT_STATUS.get(status, SlotStatus.CANCELLED),
                                         result.get("loaded", 0))
                self.slots_busy.discard(task.slot)
        result["blocks"] = task.num_blocks
        result["bytes"] = task.bytes_moved
        seconds = (time.monotonic_ns() - task.created_ns) / 1e9
        self.on_task_end(task.kind, seconds)
        if log.isEnabledFor(logging.DEBUG):
            said = (f" (worker took it after {phases['wait_s'] * 1e3:.2f} ms, queued its copies in "
                    f"{phases['queue_s'] * 1e3:.2f} ms, ended {phases['land_s'] * 1e3:.2f} ms later)"
                    if phases else "")
            log.debug("[task] %d %s %s: %d blocks, %d bytes, %.2f ms%s", task.task_id, task.kind,
                      status, task.num_blocks, task.bytes_moved, seconds * 1e3, said)
        self.events.emit(task.routing_id, task_event(task.task_id, status, result))
        for then in ready:
            then()

    def _ended(self, kind: str) -> list[Callable[[], None]]:
        """(Lock held; a task of `kind` just ended.) The when_ended callbacks all of whose tasks
        have ended: those whose bound is at most the oldest task of `kind` still in the table."""
        waiters = self._waiters[kind]
        oldest = next(iter(self._live.get(kind, ())), None)
        ready = []
        while waiters and (oldest is None or waiters[0][0] <= oldest):
            ready.append(waiters.popleft()[1])
        if not waiters:
            del self._waiters[kind]
        return ready

    def cancel_client(self, client_id: str) -> None:
        """Mark every task of a client cancelled (in-flight ones stop at the next layer)."""
        with self.lock:
            for task in self.tasks.values():
                if task.client_id == client_id:
                    task.cancelled = True

    def check_slots(self) -> str | None:
        """(Lock held.) What is wrong with the slots, or None: every busy slot a live load's."""
        slots = {t.slot for t in self.tasks.values() if t.slot >= 0}
        if slots != self.slots_busy:
            return (f"progress slots {sorted(self.slots_busy - slots)[:8]} busy without a live "
                    f"load, {sorted(slots - self.slots_busy)[:8]} of live loads not busy")
        return None

    def status(self, queued: int, parked: int = 0) -> dict:
        """(Lock held.) The `tasks` part of the daemon's status (`parked`: of the inflight, the
        loads and prefetches waiting for another task's fetch of their keys)."""
        return {"queued": queued, "inflight": len(self.tasks) - queued, "parked": parked,
                "completed": self.counters.completed, "failed": self.counters.failed,
                "cancelled": self.counters.cancelled, "slots_busy": len(self.slots_busy),
                "copy_phases": {k: {n: round(v, 6) for n, v in p.items()}
                                for k, p in self.counters.phases.items()}}


def _phases(task, end_ns: int) -> dict[str, float]:
    """Where a copied task's time went, in seconds: waiting for the copy worker, queueing its
    copies (the CPU's share: CUDA launches, or the copies themselves on CPU), then until they
    landed and it ended; a load's, also the part of queueing before its first copy (its plan,
    the fence wait) and from its request to its first layer counted. Empty for a task that
    copied nothing."""
    if not (task.started_ns and task.queued_ns):
        return {}
    out = {"wait_s": (task.started_ns - task.created_ns) / 1e9,
           "queue_s": (task.queued_ns - task.started_ns) / 1e9,
           "land_s": (end_ns - task.queued_ns) / 1e9}
    if task.ready_ns:
        out["prepare_s"] = (task.ready_ns - task.started_ns) / 1e9
    if task.first_layer_ns:
        out["first_layer_s"] = (task.first_layer_ns - task.created_ns) / 1e9
    return out
