"""The reply of each op and the task event, as types (requests are typed in messages.py).

A reply on the wire is `{"rid", "ok": True, **fields}`; these are the fields. `REPLIES` maps
each op to its type and `EVENT_RESULTS` names what the `result` of a task's end event holds
(besides `blocks` and `bytes`, which every task event has, and `error` on a failure). The
PROTOCOL.md test checks the document's tables against these, field by field.
"""
from __future__ import annotations

from typing import Any, TypedDict

from .ops import Op


class HelloReply(TypedDict):
    daemon_version: str
    protocol_version: list[int]
    instance: str
    epoch: int
    pid: int
    device: str
    shm: str
    capabilities: dict[str, Any]


class _StatusChecked(TypedDict, total=False):
    check: str  # with `check`: "ok" or what the invariant walk found wrong


class StatusReply(_StatusChecked):
    status: dict[str, Any]


class RegisterKvReply(TypedDict):
    host_blocks: int
    kept_blocks: int
    page_bytes: int
    num_slots: int
    copy_strategy: str


class OffloadReply(TypedDict):
    task: int
    stored: int
    skipped: int
    accepted: int


class LookupReply(TypedDict):
    host: int
    storage: int


class KeyEventsReply(TypedDict):
    keys: bytes  # the events' keys back to back
    visible: bytes  # one byte per key: 1 it became loadable, 0 it stopped being so
    last: int  # the number of the last event given: the next request's `after`
    gap: bool  # events after `after` are lost (or `after` is not this daemon's): start over
    newest: int  # the number of the newest event (a new reader may start after it)
    tiers: bytes  # (1.10) one byte per key: 0 the host tier's event, n the n-th local storage tier's
    storage_tiers: list  # (1.10) the local storage tiers' names, n = 1 first
    held: bytes  # (1.10) one byte per key asked: bit 0 the host tier can load it, bit n tier n holds it
    storage_gap: bool  # (1.10) what the storage tiers hold changed unheard (not the host's): start it over


class LoadReply(TypedDict):
    task: int
    slot: int
    blocks: int
    host_blocks: int
    storage_blocks: int
    num_layers: int


class _PrefetchMaybe(TypedDict, total=False):
    host: int
    skipped: str  # why the daemon did not start it (then task is 0)


class PrefetchReply(_PrefetchMaybe):
    task: int  # 0 when skipped
    blocks: int


class CancelReply(TypedDict):
    state: str  # "cancelled" (was queued) or "finishing"


class FlushReply(TypedDict):
    task: int


class DeleteReply(TypedDict):
    deleted: int
    storage_deleted: int
    storage_missed: list  # the tiers that could not delete (down or failing), as status names them


class ClearReply(TypedDict):
    cleared: int
    host_cleared: int
    storage_cleared: int


class Empty(TypedDict):
    pass


class TaskEvent(TypedDict):
    event: str  # "task"
    task: int
    status: str  # a TaskStatus value
    result: dict[str, Any]


REPLIES: dict[Op, type] = {
    Op.HELLO: HelloReply, Op.PING: Empty, Op.STATUS: StatusReply, Op.SHUTDOWN: Empty,
    Op.BYE: Empty, Op.REGISTER_KV: RegisterKvReply, Op.UNREGISTER_KV: Empty,
    Op.OFFLOAD: OffloadReply, Op.LOOKUP: LookupReply, Op.LOAD: LoadReply, Op.LOOKUP_NOTES: Empty,
    Op.KEY_EVENTS: KeyEventsReply,
    Op.PREFETCH: PrefetchReply, Op.CANCEL: CancelReply, Op.FLUSH: FlushReply,
    Op.DELETE: DeleteReply, Op.CLEAR: ClearReply, Op.PAUSE: Empty, Op.RESUME: Empty,
}
EVENT_RESULTS: dict[Op, tuple[str, ...]] = {
    Op.OFFLOAD: ("stored",), Op.LOAD: ("loaded",), Op.PREFETCH: ("prefetched",),
}


def reply_fields(op: Op) -> set[str]:
    return set(REPLIES[op].__annotations__)


def missing_fields(op: Op, reply: dict) -> set[str]:
    """The required fields of op's reply that `reply` lacks."""
    return set(REPLIES[op].__required_keys__) - set(reply)
