"""A client's task events and holds: the events read for each task, and the device blocks of
tasks that timed out, or whose daemon hung, which the daemon may still write until it confirms
the task's end (hold_keeper.py keeps them out of an engine's free list). A part of Client
(client.py): it uses the client's `_holds`, `_events`, `_lock`, `_pump`, `_wait`,
`_check_daemon`, `status_block` and `_gone_after_close`."""
from __future__ import annotations

from kvcached_proto import DaemonUnavailable

from .renamed import Renamed


class KeepsHolds:
    def take_event(self, task_id: int) -> dict | None:
        return self._events.pop(task_id, None)

    def wait_event(self, task_id: int, timeout: float | None) -> dict:
        return self._wait(lambda: self._events.pop(task_id, None), timeout,
                          f"completion of task {task_id}", "wait(timeout=...)")

    def poll_events(self) -> None:
        """Read whatever has arrived without blocking (for task.done())."""
        self._check_daemon()
        if self._lock.acquire(blocking=False):
            try:
                self._pump(0)
            finally:
                self._lock.release()

    def hold(self, task_id: int, blocks) -> None:
        """Hold `blocks` out of reuse until task_id's end event arrives."""
        if task_id not in self._events:  # an end already read needs no hold
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
                self.poll_events()
            except DaemonUnavailable:
                sig = self.status_block
                gone = sig.gone() if sig is not None else self._gone_after_close()
                if gone:
                    self._holds.clear()  # a daemon that is gone writes nothing more
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
