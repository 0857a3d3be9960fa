"""What the service reports: its status map, and its invariant walk (`status --check`,
tests, fuzzing: the index's own; every indexed host block allocated and not free; every pin
held by a live task and every live task's pins held; every entry being written indexed and
its writer's; every busy progress slot a live load's)."""
from __future__ import annotations

import time

from kvcached_proto import ErrorCode

from ..copy.transfer import TaskKind
from ..errors import OpError
from ..host.index import WRITING

WALK_SHARE = 0.1  # of the daemon's time the invariant walk may take, at most


class InvariantWalk:
    """check_service(svc) on demand (`status` with `check`), at most WALK_SHARE of the time:
    the walk holds the host lock and the request thread for as long as it takes (0.65 s for
    500,000 indexed blocks), so after one the next is BUSY, with when it may run, for 9 times
    as long - a client asking in a loop cannot stall every other."""

    def __init__(self, svc):
        self.svc = svc
        self.next_at = 0.0

    def __call__(self) -> str:
        start = time.monotonic()
        if start < self.next_at:
            raise OpError(ErrorCode.BUSY, f"an invariant walk may run again in "
                          f"{self.next_at - start:.3f} s (at most {WALK_SHARE:.0%} of the time)")
        try:
            return check_service(self.svc)
        finally:
            end = time.monotonic()
            self.next_at = end + (end - start) * (1 / WALK_SHARE - 1)


def check_service(svc) -> str:
    """Walk the invariants: the index's own; every indexed host block allocated and not
    free; every pin held by a live task and every live task's pins held; every entry a load
    copies from, an offload or a fetch copies into, still indexed, and every entry being
    written a live task's; every busy progress slot a live load's. Returns "ok" or what
    is wrong."""
    with svc.host.lock:
        try:
            svc.host.index.check()
            alloc = svc.host.pool.allocator
            free = set(alloc._free)
            if len(free) != len(alloc._free):
                return "failed: a host block is in the free list twice"
            for block in free:
                if alloc.is_used(block):
                    return f"failed: host block {block} is free and in use"
            for block in svc.host.index.blocks():
                if not alloc.is_used(block) or block in free:
                    return f"failed: indexed host block {block} is not allocated"
            return _check_pins_and_slots(svc)
        except AssertionError as exc:
            return f"failed: {exc}"


def _check_pins_and_slots(svc) -> str:
    held: dict[int, int] = {}
    pinned: dict[int, object] = {}
    written: set[int] = set()
    for task in svc._live_tasks():
        gone = next((e for e in task.entries if not e.live), None) if task.kind == TaskKind.LOAD else None
        if gone is not None:  # what a load copies from stays indexed until it ends
            return (f"failed: entry {gone.key.hex()} left the index while load task {task.task_id} "
                    "copies from it (its host block can be reused under the copy)")
        for e in _written_by(task):  # and what an offload or a fetch copies into
            if not e.live:
                return (f"failed: entry {e.key.hex()} left the index while task {task.task_id} "
                        "writes its host block (the block can be given to another under the copy)")
            written.add(id(e))
        pins = (task.entries + task.tail_pins
                if task.kind in (TaskKind.LOAD, TaskKind.BACKUP, TaskKind.PREFETCH) else [])
        for e in pins:
            held[id(e)] = held.get(id(e), 0) + 1
            pinned[id(e)] = e
    for e in svc.storage.lent_pins.values():  # backups whose write is late: pinned until it returns
        held[id(e)] = held.get(id(e), 0) + 1
        pinned[id(e)] = e
    for e in pinned.values():
        if e.refs != held[id(e)]:
            return f"failed: entry {e.key.hex()} has {e.refs} pins, live tasks hold {held[id(e)]}"
    for e in svc.host.index.pinned_entries():
        if id(e) not in pinned:
            return f"failed: entry {e.key.hex()} is pinned by no live task"
    if svc.host.index.pinned != len(pinned):
        return f"failed: {svc.host.index.pinned} pinned entries counted, live tasks pin {len(pinned)}"
    for e in svc.host.index.writing_entries():
        if id(e) not in written:
            return f"failed: entry {e.key.hex()} is being written by no live task"
    wrong = svc.table.check_slots()
    return f"failed: {wrong}" if wrong else "ok"


def _written_by(task) -> list:
    """The entries whose host blocks a task copies into: an offload's still WRITING, a load's
    or a prefetch's own fetch."""
    if task.kind == TaskKind.OFFLOAD:
        return [e for e in task.entries if e.state == WRITING]
    return task.fetch if task.kind in (TaskKind.LOAD, TaskKind.PREFETCH) else []


def status_of(svc) -> dict:
    """The service's part of `kvcached status --json`."""
    with svc.host.lock:
        kv = svc.kv
        queued = svc.loads.worker.queued + svc.offloads.worker.queued + svc.storage.fetcher.queued
        return {
            "host": {
                "capacity_bytes": svc.host.pool.capacity_bytes,
                "used_bytes": svc.host.pool.used_bytes,
                "blocks": len(svc.host.index),
                "capacity_blocks": svc.host.pool.num_blocks,
                "layout": svc.cfg.host_layout,
                "evictions": svc.host.index.evictions,
                "pinned_blocks": svc.host.index.pinned,
                "writing_blocks": sum(len(t.entries) for t in svc.table.tasks.values()
                                      if t.kind == TaskKind.OFFLOAD),
            },
            "kv": {
                "registered": kv is not None,
                "owner": kv.owner if kv else None,
                "engines": len(svc.reg.all_kv()),  # host pools side by side (fd_pass): several
                "copy_strategy": svc.reg.copier_of(kv.owner).strategy if kv else None,
                "dma_threads": getattr(svc.reg.copier_of(kv.owner), "dma_threads", 1) if kv else None,
                "lost": kv.lost if kv else None,
                "num_layers": kv.spec.num_layers if kv else 0,
                "num_blocks": kv.spec.num_blocks if kv else 0,
                "page_bytes": kv.spec.page_bytes if kv else 0,
                "kv_layout": kv.spec.kv_layout if kv else None,  # the engine's name for its bytes' order
                # the storage tiers' key space (record.stored_key): the host pool's geometry
                "geometry": svc.host.pool.geometry.hex() if svc.host.pool.geometry else None,
            },
            "storage": svc.storage.status(),
            "storage_ready": svc.storage.tiers.ready(),
            "tasks": svc.table.status(queued, len(svc.loads.parked)),
            "bytes": dict(svc.table.counters.bytes),
            "lookups": dict(svc.hits),
            "storage_io": dict(svc.storage.counters),
            "fds": _fds_status(svc.fd_inbox),
            "key_table": svc.keys.status(),  # clients' lookups without a message (key_publisher.py)
            "key_events": svc.key_events.status(),  # what followers of the changes are told
        }


def _fds_status(inbox) -> dict:
    """The fd socket (fd_pass.py): sets of fds waiting for a registration, taken, refused."""
    if inbox is None:
        return {"pending": 0, "received": 0, "refused": 0}
    return {"pending": inbox.pending, "received": inbox.received, "refused": inbox.refused}
