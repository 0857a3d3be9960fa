"""A GroupClient's tasks: one task on every present rank, settled together (group.py)."""
from __future__ import annotations

import logging
import time

from kvcached_proto.errors import DaemonUnavailable, KvcachedTimeout, TaskFailed
from kvcached_proto.messages import TaskStatus

log = logging.getLogger("kvcached_client.group")  # the group's logger, as before the split


class GroupTask:
    """A task on every present rank; `wait` returns the ranks' results by rank."""

    kind = "task"

    def __init__(self, group, tasks: dict[int, object], reply: dict):  # group: its GroupClient
        self.group = group
        self.id = next(group._task_ids)
        self.tasks = tasks  # rank -> Task
        self.reply = reply
        self.status: str | None = None
        self.result: dict | None = None

    def done(self) -> bool:
        """Whether every rank's task ended (failed or not: `wait` says how), as Task.done:
        never raises TaskFailed."""
        if self.result is None and all(self._rank_done(r, t) for r, t in self.tasks.items()):
            try:
                self.wait(0)
            except TaskFailed:
                pass  # ended: status and result say so
        return self.result is not None

    def _rank_done(self, rank: int, task) -> bool:
        try:
            return task.done()
        except DaemonUnavailable as exc:
            self.group._lost(rank, exc)
            return True

    def wait(self, timeout: float | None = None) -> dict:
        if self.result is None:
            per_rank, failed = {}, []
            deadline = time.monotonic() + (self.group.timeout if timeout is None else timeout)
            for rank, task in self.tasks.items():
                try:
                    per_rank[rank] = task.wait(max(0.0, deadline - time.monotonic()))
                except DaemonUnavailable as exc:
                    self.group._lost(rank, exc)
                    failed.append(rank)
                except TaskFailed as exc:
                    per_rank[rank] = exc.result
                    failed.append(rank)
            self.status = TaskStatus.FAILED if failed else TaskStatus.DONE
            self.result = {"ranks": per_rank, "failed_ranks": failed}
            self.group._forget(self)
        if self.status == TaskStatus.FAILED:
            raise TaskFailed(f"group {self.kind} task {self.id} failed on ranks "
                             f"{self.result['failed_ranks']}", self.result)
        return self.result

    def cancel(self) -> str:
        for rank, task in self.tasks.items():
            try:
                task.cancel()
            except DaemonUnavailable as exc:
                self.group._lost(rank, exc)
        return "finishing"


class GroupOffloadTask(GroupTask):
    kind = "offload"


class GroupPrefetchTask(GroupTask):
    """A prefetch on every rank; `prefetched` is the minimum over ranks (0 when one is
    missing), as a load would find the blocks on every rank."""

    kind = "prefetch"

    def wait(self, timeout: float | None = None) -> dict:
        result = super().wait(timeout)
        if "prefetched" not in result:
            counts = [int(r.get("prefetched", 0)) for r in result["ranks"].values()]
            full = len(counts) == self.group.tp_size
            result["prefetched"] = min(counts) if counts and full else 0
        return result


class GroupLoadTask(GroupTask):
    """A load on every rank; its count is the minimum over ranks."""

    kind = "load"

    def __init__(self, group, tasks, reply, num_layers: int):
        super().__init__(group, tasks, reply)
        self.num_blocks = reply["blocks"]
        self.num_layers = num_layers

    def wait(self, timeout: float | None = None) -> int:
        """Leading blocks every rank loaded. A rank that timed out, failed or went away counts
        0 (its blocks stay held by its client until its daemon confirms the end)."""
        if self.result is None:
            loaded = {}
            deadline = time.monotonic() + (self.group.timeout if timeout is None else timeout)
            for rank, task in self.tasks.items():
                try:
                    loaded[rank] = task.wait(max(0.0, deadline - time.monotonic()))
                except KvcachedTimeout as exc:
                    log.warning("[group] rank %d: %s", rank, str(exc))
                    loaded[rank] = 0
                except DaemonUnavailable as exc:
                    self.group._lost(rank, exc)
                    self.group._hold_rank(rank, task, task.reply.get("device_blocks", ()))
                    loaded[rank] = 0
            self.result = {"loaded": min(loaded.values(), default=0), "ranks": loaded}
            self.status = TaskStatus.DONE
            self.group._forget(self)
        return min(int(self.result["loaded"]), self.num_blocks)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Waits on the local rank (each worker waits on its own daemon); layer 0 also waits on
        every rank, so that `valid_blocks` (the minimum) is known."""
        ranks = self.tasks if layer == 0 else {self.group.local_rank: self.tasks.get(self.group.local_rank)}
        for rank, task in ranks.items():
            if task is None:
                raise TaskFailed(f"group load {self.id}: rank {rank} has no load", {"loaded": 0})
            try:
                task.wait_layer(layer, timeout)
            except DaemonUnavailable as exc:
                self.group._lost(rank, exc)
                raise TaskFailed(f"group load {self.id}: rank {rank} went away", {"loaded": 0}) from None

    @property
    def valid_blocks(self) -> int:
        return min([t.valid_blocks for t in self.tasks.values()] + [self.num_blocks])
