"""Message types: the header, each op's typed fields, and their validation.

A request is one msgpack map: header fields `proto` ([major, minor]), `op` (int), `rid` (int)
and `client` (str), plus the op's body fields. `parse_request` checks every field before
anything executes and raises ProtocolError naming the bad field.

A reply is `{"rid", "ok": True, ...fields}` or `{"rid", "ok": False, "error": {"code",
"name", "message"}}`. A task event is `{"event": "task", "task", "status", "result"}`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .codec import KEY_BYTES, MAX_REQUEST_BYTES, MAX_STR_BYTES, encode, unpack_block_ids, unpack_keys
from .errors import CodedError, ProtocolError
from .ops import ErrorCode, Op
from .version import PROTOCOL_VERSION, check_version

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
TIERS = ("host", "storage", "all")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
ROLES = ("engine", "operator")


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # int | uint | str | bool | bytes | keys | blocks | map | choice
    required: bool = True
    default: Any = None
    max_len: int = MAX_STR_BYTES
    lo: int = -(2**63)
    hi: int = 2**63 - 1
    choices: tuple = ()


@dataclass(frozen=True)
class OpSpec:
    op: Op
    fields: tuple[Field, ...] = ()
    needs_kv: bool = False  # refused with NOT_REGISTERED before register_kv
    admin: bool = False  # changes the daemon for every client: the registered engine or an
    #                      operator only (FORBIDDEN otherwise)
    blocking: bool = False  # may wait on a drain or storage I/O: the daemon runs it off its
    #                         request thread and its reply comes when done (by rid, as always)


KEYS = Field("keys", "keys")
BLOCKS = Field("blocks", "blocks")
PRIORITY = Field("priority", "int", required=False, default=0, lo=-1000, hi=1000)
# the engine's fence (kvcached_proto.order_words): the copies wait for word >= fence; 0 = none
FENCE = (Field("fence_word", "uint", False, 0, hi=2**31 - 1), Field("fence", "uint", False, 0, hi=2**62))

OP_SPECS: dict[Op, OpSpec] = {
    s.op: s
    for s in (
        OpSpec(Op.HELLO, (Field("pid", "uint", hi=2**31 - 1), Field("name", "str", False, "", 256),
                          Field("role", "choice", False, "engine", choices=ROLES))),
        OpSpec(Op.PING),
        OpSpec(Op.STATUS, (Field("check", "bool", False, False),)),
        OpSpec(Op.SHUTDOWN, admin=True),
        OpSpec(Op.BYE),
        OpSpec(Op.REGISTER_KV, (Field("layout", "map"),), blocking=True),
        OpSpec(Op.UNREGISTER_KV, admin=True, blocking=True),
        # 1.15: `parent`, the key of the block before keys[0] in its chain (an earlier offload's)
        OpSpec(
            Op.OFFLOAD,
            (KEYS, BLOCKS, PRIORITY, *FENCE, Field("parent", "bytes", False, b"", max_len=KEY_BYTES)),
            needs_kv=True,
        ),
        OpSpec(Op.LOOKUP, (KEYS,)),
        # the lookups a client answered from the key table: their keys back to back, each one's
        # key count (int32, >= 1, summing to the keys) and how many times it was asked (int32
        # >= 1 each; none: once), the storage hits answered, and how many lookups' notes it
        # dropped since the last message (its socket was full)
        OpSpec(Op.LOOKUP_NOTES, (KEYS, Field("counts", "blocks"), Field("repeats", "bytes", False, b"",
                                                                        max_len=4 * 65536),
                                 Field("storage_hits", "uint", False, 0, hi=2**62),
                                 Field("unnoted", "uint", False, 0, hi=2**62))),
        # the host tier's changes after event number `after`, at most `limit` of them; 1.10:
        # the local storage tiers' too (`storage`), and which tiers hold the keys asked now
        OpSpec(Op.KEY_EVENTS, (Field("after", "uint", hi=2**62),
                               Field("limit", "uint", False, 4096, hi=65536),
                               Field("storage", "bool", False, False),
                               Field("ask", "keys", False, ()))),
        OpSpec(Op.LOAD, (KEYS, BLOCKS, PRIORITY, *FENCE, Field("host_only", "bool", False, False)),
               needs_kv=True),
        OpSpec(
            Op.PREFETCH,
            (KEYS, PRIORITY,
             Field("policy", "choice", False, "best_effort", choices=PREFETCH_POLICIES),
             Field("timeout_ms", "uint", False, 0, hi=3_600_000),
             Field("block_tokens", "uint", False, 1, hi=1 << 20)),
        ),
        OpSpec(Op.CANCEL, (Field("task", "uint", hi=UINT64_MAX),)),
        OpSpec(Op.FLUSH),
        OpSpec(Op.DELETE, (KEYS,), blocking=True),
        OpSpec(
            Op.CLEAR,
            (Field("tier", "choice", False, "all", choices=TIERS),
             Field("weights_update", "bool", False, False)),
            admin=True, blocking=True,
        ),
        OpSpec(Op.PAUSE, admin=True, blocking=True),
        OpSpec(Op.RESUME, admin=True, blocking=True),  # (after a pause still draining)
    )
}


@dataclass
class Request:
    op: Op
    rid: int
    client: str
    body: dict = field(default_factory=dict)


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name}: expected int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name}: {value} outside [{lo}, {hi}]")
    return value


def _check_field(f: Field, value: Any) -> Any:
    kind = f.kind
    if kind == "int":
        return _check_int(f.name, value, f.lo, f.hi)
    if kind == "uint":
        return _check_int(f.name, value, 0, f.hi)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{f.name}: expected bool")
        return value
    if kind in ("str", "choice"):
        if not isinstance(value, str) or len(value.encode()) > f.max_len:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{f.name}: expected str of <= {f.max_len} bytes")
        if kind == "choice" and value not in f.choices:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{f.name}: {value!r} is not one of {f.choices}")
        return value
    if kind in ("bytes", "keys", "blocks"):
        if not isinstance(value, bytes):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{f.name}: expected bin, got {type(value).__name__}")
        if kind == "keys":
            return unpack_keys(value, f.name)
        if kind == "blocks":
            return unpack_block_ids(value, f.name)
        if len(value) > f.max_len:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{f.name}: over {f.max_len} bytes")
        return value
    if kind == "map":
        if not isinstance(value, dict):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{f.name}: expected map")
        return value
    raise AssertionError(f"unknown field kind {kind}")


def parse_header(msg: dict) -> tuple[Op, int, str]:
    """Check the header; returns (op, rid, client). rid is -1 when it cannot be read."""
    rid = msg.get("rid")
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid <= UINT64_MAX:
        raise ProtocolError(ErrorCode.BAD_HEADER, "rid: missing or not a uint64")
    version = msg.get("proto")
    if (
        not isinstance(version, (list, tuple))
        or len(version) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in version)
    ):
        raise ProtocolError(ErrorCode.BAD_HEADER, "proto: missing or not [major, minor]")
    check_version(version, "client")
    client = msg.get("client")
    if not isinstance(client, str) or not 0 < len(client) <= 128:
        raise ProtocolError(ErrorCode.BAD_HEADER, "client: missing or not a str of 1..128 chars")
    op = msg.get("op")
    if isinstance(op, bool) or not isinstance(op, int):
        raise ProtocolError(ErrorCode.BAD_HEADER, "op: missing or not an int")
    try:
        return Op(op), rid, client
    except ValueError:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op {op} is not a known op") from None


HEADER_FIELDS = ("proto", "op", "rid", "client")


def parse_request(msg: dict) -> Request:
    op, rid, client = parse_header(msg)
    spec = OP_SPECS[op]
    body: dict = {}
    known = {f.name for f in spec.fields}
    for name in msg:
        if name not in known and name not in HEADER_FIELDS:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{name}: not a field of {op.name.lower()}")
    for f in spec.fields:
        if f.name in msg:
            body[f.name] = _check_field(f, msg[f.name])
        elif f.required:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{f.name}: required by {op.name.lower()}")
        else:
            body[f.name] = f.default
    _check_pairs(op, body)
    return Request(op, rid, client, body)


def _check_pairs(op: Op, body: dict) -> None:
    if len(body.get("parent", b"")) not in (0, KEY_BYTES):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"parent: not a {KEY_BYTES}-byte digest (nor empty)")
    if "keys" in body and "blocks" in body:
        if len(body["keys"]) != len(body["blocks"]):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"keys and blocks differ in length ({len(body['keys'])} != {len(body['blocks'])})",
            )
        ordered = np.sort(body["blocks"])  # (np.unique: 6x the time)
        if (ordered[1:] == ordered[:-1]).any():
            raise ProtocolError(ErrorCode.BAD_FIELD, "blocks: a block id is repeated in one request")


def make_request(op: Op, rid: int, client: str, **fields) -> dict:
    msg = {"proto": list(PROTOCOL_VERSION), "op": int(op), "rid": rid, "client": client}
    msg.update(fields)
    return msg


def encode_request(op: Op, rid: int, client: str, **fields) -> bytes:
    """The frame of a request, or ProtocolError (FRAME_TOO_LARGE) for one the daemon would not
    take: past MAX_REQUEST_BYTES it refuses it, or, much past, drops the connection unanswered."""
    try:
        frame = encode(make_request(op, rid, client, **fields))
    except (OverflowError, TypeError, ValueError) as exc:  # an int past 64 bits, an object msgpack has no type for
        raise ProtocolError(ErrorCode.BAD_FIELD, f"a {op.name.lower()} request cannot be encoded: "
                            f"{type(exc).__name__}: {exc}") from None
    if len(frame) > MAX_REQUEST_BYTES:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"a {op.name.lower()} request of "
                            f"{len(frame)} bytes: a request may have {MAX_REQUEST_BYTES}")
    return frame


def ok_reply(rid: int, **fields) -> dict:
    reply = {"rid": rid, "ok": True}
    reply.update(fields)
    return reply


def error_reply(rid: int, code: ErrorCode, message: str) -> dict:
    return {
        "rid": rid,
        "ok": False,
        "error": {"code": int(code), "name": ErrorCode(code).name, "message": message},
    }


def reply_for(rid: int, exc: BaseException) -> dict:
    """The error reply for an exception: its own code for a CodedError, INTERNAL (with the
    exception's type) for anything else. Both daemon sockets answer through this."""
    if isinstance(exc, CodedError):
        return error_reply(rid, exc.code, exc.message)
    return error_reply(rid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class TaskStatus(str, enum.Enum):
    """How a task ended (a task event's `status`); SKIPPED is the client's own, for a prefetch
    the daemon did not start (task id 0). Members compare equal to their strings."""

    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"

    def __str__(self) -> str:
        return self.value


def task_event(task_id: int, status: TaskStatus, result: dict) -> dict:
    return {"event": "task", "task": task_id, "status": TaskStatus(status).value, "result": result}

