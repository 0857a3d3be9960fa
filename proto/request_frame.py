"""Decoding a request frame at a bounded cost, before anything of it is trusted.

`codec.decode` builds the whole map, whatever it holds: msgpack's limits are per container, so
a 2 MiB frame of small nested arrays (`{"junk": [[0] * 2000] * 1024}`) is 2 M objects and
~30 ms of the daemon's request thread. A frame of up to WHOLE_BYTES is decoded whole all the
same (it holds at most that many objects: ~1.5 ms at worst, and most requests are such frames,
~2 us each); a larger one is read field by field:

- a name that is no field of any op (nor of the header) is refused before its value is read;
- each value's msgpack type byte is checked against its field's kind before the value is
  decoded (an int field holding an array is refused unread);
- the only containers a request holds - `proto` ([major, minor]) and a `register_kv` layout -
  are decoded under an object budget (PROTO_OBJECTS, LAYOUT_OBJECTS); a layout in a frame whose
  op is already known to be another is refused unread.

The frame is read in READ_BYTES pieces as the fields need them, so a frame refused at its
first field costs one piece, whatever its size, and any frame at most a copy of its bytes plus
LAYOUT_OBJECTS objects (~10 ms at worst on one core here). It may be a zmq frame's buffer
(a memoryview): nothing is copied before the unpacker reads it. The fields read before a refusal stay in
`into` (the daemon answers with their `rid`: clients send the header first).
"""
from __future__ import annotations

import msgpack

from .codec import MAX_CONTAINER_ITEMS, MAX_REQUEST_BYTES, MAX_STR_BYTES, decode
from .errors import ProtocolError
from .messages import HEADER_FIELDS, OP_SPECS
from .ops import ErrorCode, Op

WHOLE_BYTES = 64 << 10
READ_BYTES = 256 << 10
PROTO_OBJECTS = 16
LAYOUT_OBJECTS = 32768  # a 256-layer model with 4 parts per layer needs ~23,000

_INT = frozenset(range(0x00, 0x80)) | frozenset(range(0xe0, 0x100)) | frozenset(range(0xcc, 0xd4))
_TYPES = {  # the msgpack type bytes a field of each kind may start with
    "int": _INT, "uint": _INT,
    "bool": frozenset((0xc2, 0xc3)),
    "str": frozenset(range(0xa0, 0xc0)) | frozenset((0xd9, 0xda, 0xdb)),
    "bin": frozenset((0xc4, 0xc5, 0xc6)),
    "map": frozenset(range(0x80, 0x90)) | frozenset((0xde, 0xdf)),
    "array": frozenset(range(0x90, 0xa0)) | frozenset((0xdc, 0xdd)),
}
_WIRE = {"int": "int", "uint": "uint", "bool": "bool", "str": "str", "choice": "str",
         "bytes": "bin", "keys": "bin", "blocks": "bin", "map": "map"}


def _field_types() -> dict[str, str]:
    kinds = {"proto": "array", "op": "int", "rid": "uint", "client": "str"}
    assert set(kinds) == set(HEADER_FIELDS)
    for spec in OP_SPECS.values():
        for f in spec.fields:
            wire = _WIRE[f.kind]
            assert kinds.setdefault(f.name, wire) == wire, f"field {f.name}: two wire kinds"
    return kinds


FIELD_TYPES = _field_types()


class _Reader:
    """A file over a buffer: only what the unpacker asks for is copied out."""

    __slots__ = ("view", "pos")

    def __init__(self, frame):
        self.view, self.pos = memoryview(frame).cast("B"), 0

    def read(self, n: int):
        chunk = self.view[self.pos : self.pos + n]
        self.pos += len(chunk)
        return bytes(chunk)


class _Budget:
    """Counts the objects of the containers being decoded; raises once they pass `left`."""

    def __init__(self):
        self.left = 0
        self.field = ""
        self.limit = 0

    def take(self, obj):
        self.left -= len(obj) + 1
        if self.left < 0:
            raise ProtocolError(ErrorCode.TOO_MANY_ITEMS,
                                f"{self.field}: more than {self.limit} msgpack objects")
        return obj

    def allow(self, field: str, limit: int) -> None:
        self.field, self.limit, self.left = field, limit, limit


def _refused(name, kind: str, into: dict) -> ProtocolError:
    code = ErrorCode.BAD_HEADER if name in HEADER_FIELDS else ErrorCode.BAD_FIELD
    if kind == "unknown":
        return ProtocolError(ErrorCode.BAD_FIELD, f"{name!r}: not a field of any op")
    if kind == "misplaced":
        op = Op(into["op"]).name.lower() if into["op"] in Op._value2member_map_ else "this op"
        return ProtocolError(ErrorCode.BAD_FIELD, f"{name}: not a field of {op}")
    return ProtocolError(code, f"{name}: expected {kind}")


def decode_request(frame, into: dict) -> dict:
    """Decode a request frame (bytes or a buffer) into `into` (returned), or raise
    ProtocolError; what was read before a refusal stays in `into`."""
    frame = memoryview(frame).cast("B")
    if len(frame) <= WHOLE_BYTES:
        into.update(decode(frame))
        return into
    if len(frame) > MAX_REQUEST_BYTES:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE,
                            f"request frame of {len(frame)} bytes exceeds {MAX_REQUEST_BYTES}")
    budget = _Budget()
    unpacker = msgpack.Unpacker(
        _Reader(frame), read_size=READ_BYTES, raw=False, strict_map_key=True,
        max_buffer_size=max(len(frame), READ_BYTES), max_bin_len=MAX_REQUEST_BYTES,
        max_str_len=MAX_STR_BYTES, max_array_len=MAX_CONTAINER_ITEMS,
        max_map_len=MAX_CONTAINER_ITEMS, max_ext_len=0, list_hook=budget.take,
        object_hook=budget.take)
    try:
        _read_fields(frame, unpacker, budget, into)
    except ProtocolError:
        raise
    except msgpack.OutOfData:
        raise ProtocolError(ErrorCode.BAD_FRAME, "not a msgpack frame: truncated") from None
    except Exception as exc:  # msgpack's errors on garbage (ValueError, FormatError, StackError,
        #                       UnicodeDecodeError, ...): the frame is not one msgpack map
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not a msgpack frame: {type(exc).__name__}: "
                            f"{exc}"[:200]) from None
    return into


def _type_at(frame: memoryview, unpacker) -> int:
    """The msgpack type byte of the next object."""
    at = unpacker.tell()
    if at >= len(frame):
        raise ProtocolError(ErrorCode.BAD_FRAME, "not a msgpack frame: truncated")
    return frame[at]


def _read_fields(frame: memoryview, unpacker, budget: _Budget, into: dict) -> None:
    if _type_at(frame, unpacker) not in _TYPES["map"]:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame is not a map")
    count = unpacker.read_map_header()
    if count > len(FIELD_TYPES):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"a map of {count} fields: more than any request has")
    for _ in range(count):
        if _type_at(frame, unpacker) not in _TYPES["str"]:
            raise ProtocolError(ErrorCode.BAD_FRAME, "field names are strings")
        name = unpacker.unpack()
        wire = FIELD_TYPES.get(name)
        if wire is None:
            raise _refused(name, "unknown", into)
        if name == "layout" and isinstance(into.get("op"), int) and into["op"] != Op.REGISTER_KV:
            raise _refused(name, "misplaced", into)
        if _type_at(frame, unpacker) not in _TYPES[wire]:
            raise _refused(name, wire, into)
        budget.allow(name, LAYOUT_OBJECTS if name == "layout" else PROTO_OBJECTS)
        into[name] = unpacker.unpack()
    if unpacker.tell() != len(frame):
        raise ProtocolError(ErrorCode.BAD_FRAME, "extra data after the request's map")
