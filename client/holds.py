"""A client's task events, holds and revokes: the events read for each task, and the device
blocks of tasks that timed out, or whose daemon hung, which the daemon may still write until it
confirms the task's end (hold_keeper.py keeps them out of an engine's free list); a load whose
reply never came is held the same way, under its request id. A part of Client (client.py): it
uses the client's `_holds`, `_unanswered`, `_late_loads`, `_events`, `_ended_ids`, `_replies`,
`_lock`, `_pump`, `_wait`, `_check_daemon`, `order`, `status_block` and `_gone_after_close`."""
from __future__ import annotations

import collections
import weakref

from kvcached_proto import DaemonUnavailable, KvcachedError

from .renamed import Renamed
from .tasks import UnansweredLoad

ENDED_KEPT = 4096  # ids of the tasks whose end was read last: a hold made after it is not kept
LET_GO_KEPT = 65536  # ids of the Tasks let go before their end (~6 MB at most): it is not kept


def _let_go(client_ref, task_id: int) -> None:
    client = client_ref()
    if client is not None:
        client._task_let_go(task_id)


class KeepsHolds:
    def _init_task_books(self) -> None:
        self._ended_ids: collections.deque[int] = collections.deque(maxlen=ENDED_KEPT)
        self._let_go: collections.OrderedDict[int, None] = collections.OrderedDict()

    def _track_task(self, task) -> None:
        """A Task made for this client (tasks.py): once its caller lets it go, nobody can take
        its end event, so none is kept for it. Each end was kept for good: an engine that sends
        backups and never waits for them grew by one event per offload."""
        if task.id:  # (the client weakly: a strong one kept it, and its KV, while the Task lived,
            # and for good where the two referred to each other - a cycle the GC no longer freed)
            weakref.finalize(task, _let_go, weakref.ref(self), task.id).atexit = False

    def _task_let_go(self, task_id: int) -> None:
        """(Any thread, lock-free: `_ended` files an end and then looks here, this notes the id
        and then takes the end, so whichever comes second drops it.)"""
        self._let_go[task_id] = None
        if len(self._let_go) > LET_GO_KEPT:
            self._let_go.popitem(last=False)
        self._events.pop(task_id, None)

    def take_event(self, task_id: int) -> dict | None:
        return self._events.pop(task_id, None)

    def wait_event(self, task_id: int, timeout: float | None) -> dict:
        return self._wait(lambda: self._events.pop(task_id, None), timeout,
                          f"completion of task {task_id}", "wait(timeout=...)", drains=True)

    def poll_events(self, drains: bool = False) -> None:
        """Read whatever has arrived without blocking (for task.done()). DaemonUnavailable for
        a daemon of no use; `drains` (a task's own waits): not for one stopping, which still
        sends the ends of the tasks it drains."""
        self._check_daemon(drains)
        if self._lock.acquire(blocking=False):
            try:
                self._pump(0)
            finally:
                self._lock.release()

    def _ended(self, event: dict) -> None:
        """File a task's end event; the task's hold lifts (a late load's: nobody waits for it)."""
        task = event.get("task", 0)
        self._ended_ids.append(task)
        self._holds.pop(task, None)
        key = self._late_loads.pop(task, None)
        if key is None:
            self._events[task] = event
            if task in self._let_go:  # its Task let go: nobody takes it (see _task_let_go)
                self._events.pop(task, None)
        else:
            self._holds.pop(key, None)

    def _hold_unanswered(self, rid: int, blocks, exc: KvcachedError, fence: int = 0) -> KvcachedError:
        """A load was sent and its reply did not come: a daemon that only hung may still take
        it when it wakes and write `blocks`. They are held under -rid until its late reply
        refuses it or the task it made ends (`_late_load`), or the daemon is gone."""
        sig = self.status_block
        blocks = [int(b) for b in blocks]
        if sig is None or sig.gone():  # (closed: no late reply could be read either)
            exc.held_blocks = exc.fenced_blocks = []
            return exc
        with self._lock:  # no pump files rid's reply meanwhile; one filed before: read here
            self._unanswered[rid] = -rid
            self._holds[-rid] = blocks
            came = self._replies.pop(rid, None)
            if came is not None:
                self._late_load(came)
        exc.held_blocks = exc.fenced_blocks = blocks
        exc.unanswered = UnansweredLoad(self, -rid, fence)
        exc.args = (f"{exc.args[0]}; the load was sent and a daemon that wakes may still take it: "
                    f"device blocks {blocks[:8]}{'...' if len(blocks) > 8 else ''} stay held",)
        return exc

    def _late_load(self, reply: dict) -> None:
        """The reply to a load the caller no longer waits for: a load refused writes nothing
        (the hold lifts); one accepted keeps its hold until its end event."""
        key = self._unanswered.pop(reply.get("rid", 0), None)
        if key is None:  # (the daemon gone meanwhile: its holds were cleared)
            return
        task = reply.get("task", 0) if reply.get("ok") else 0
        if task and task not in self._events:
            self._late_loads[task] = key
        else:
            self._holds.pop(key, None)

    def revoke(self, task) -> None:
        """The engine reuses a task's blocks before the task ended (e.g. a preempted request):
        the daemon discards an offload, and this registration's earlier offloads that have not
        completed, rather than store what it read; a load, and the earlier loads still running,
        stop before their next layer (cancelled). Shared memory: works with a hung daemon, read
        as soon as it wakes (a cancel is read later: after the next layers were copied)."""
        self._revoke(task.reply.get("fence", 0), load=task.kind == "load")

    def _revoke(self, fence: int, load: bool = False) -> None:
        if self.order is not None and fence:
            self.order.revoke(fence, load)

    def hold(self, task_id: int, blocks) -> None:
        """Hold `blocks` out of reuse until task_id's end event arrives. An end already read
        needs none, taken by its task or not (a hold made after a wait took the end of a load
        that failed lasted until the daemon's process was gone)."""
        if task_id not in self._events and task_id not in self._ended_ids:
            self._holds[task_id] = list(blocks)

    def held_blocks(self) -> set[int]:
        """Device blocks of loads that timed out and whose end the daemon has not confirmed
        yet: the engine must not reuse them. A method: it reads pending events off the socket
        (and forgets the holds of a daemon that is gone)."""
        self._refresh_holds()
        return {b for blocks in self._holds.values() for b in blocks}

    def held_tasks(self) -> set[int]:
        """The ids of the tasks whose holds last (read like held_blocks)."""
        self._refresh_holds()
        return set(self._holds)

    def _refresh_holds(self) -> None:
        if self._holds:
            try:
                self.poll_events(drains=True)
            except DaemonUnavailable:
                sig = self.status_block
                gone = sig.gone() if sig is not None else self._gone_after_close()
                if gone:  # a daemon that is gone writes nothing more
                    self._holds.clear()
                    self._unanswered.clear()
                    self._late_loads.clear()
                # else it may be hung and come back: its writes could still land

    @property
    def has_holds(self) -> bool:
        return bool(self._holds)

    @property
    def held_without_check(self) -> set[int]:
        """The held device blocks as last known, without reading events."""
        return {b for blocks in self._holds.values() for b in blocks}

    # earlier names ("fence" names the order words only)
    fence, fenced_blocks, fenced_tasks = Renamed("hold"), Renamed("held_blocks"), Renamed("held_tasks")
    has_fences, fenced_without_check = Renamed("has_holds"), Renamed("held_without_check")
