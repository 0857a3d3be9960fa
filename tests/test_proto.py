"""The wire protocol in isolation: codec limits, field validation, and the doc agreeing with the code."""
import pathlib
import re

import msgpack
import numpy as np
import pytest

from kvcached_proto.codec import EAGER_KEYS

from kvcached_proto import (
    MAX_FRAME_BYTES,
    OP_SPECS,
    ErrorCode,
    Op,
    ProtocolError,
    decode,
    encode,
    make_request,
    pack_block_ids,
    pack_keys,
    parse_request,
    unpack_block_ids,
    unpack_keys,
)

DOC = pathlib.Path(__file__).resolve().parents[1] / "proto" / "PROTOCOL.md"


def _doc_table(heading: str) -> dict[str, int]:
    text = DOC.read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| (\w+) \| (\d+) \|", section, re.M)}


def test_doc_lists_exactly_the_ops_of_the_code():
    assert _doc_table("## Ops") == {op.name.lower(): op.value for op in Op}


def _doc_rows() -> dict[str, list[str]]:
    section = DOC.read_text().split("## Ops", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): [c.strip() for c in m.group(0).strip("|").split("|")]
            for m in re.finditer(r"^\| (\w+) \| \d+ \|.*$", section, re.M)}


def _field_names(cell: str) -> set[str]:
    """The field names a cell of the ops table lists: backticked lower_case names outside
    parentheses (which hold types, values and remarks)."""
    previous = None
    while previous != cell:
        previous, cell = cell, re.sub(r"\([^()]*\)", "", cell)
    return {t for t in re.findall(r"`([^`]+)`", cell) if re.fullmatch(r"[a-z_]+", t)}


def test_doc_lists_each_ops_body_reply_and_event_fields_as_the_code_types_them():
    from kvcached_proto.replies import EVENT_RESULTS, reply_fields

    rows = _doc_rows()
    for op in Op:
        _, _, body, reply = rows[op.name.lower()]
        assert _field_names(body) == {f.name for f in OP_SPECS[op].fields}, op
        reply_part, _, event_part = reply.partition("; event result")
        assert _field_names(reply_part) == reply_fields(op), op
        assert _field_names(event_part) == set(EVENT_RESULTS.get(op, ())), op


def test_doc_lists_exactly_the_error_codes_of_the_code():
    assert _doc_table("## Error codes") == {c.name: c.value for c in ErrorCode}


def test_keys_and_block_ids_round_trip():
    keys = [bytes([i]) * 16 for i in range(5)]
    assert list(unpack_keys(pack_keys(keys))) == keys
    ids = [0, 7, 2**31 - 1]
    packed = pack_block_ids(ids)
    assert packed == np.array(ids, dtype="<i4").tobytes()
    assert unpack_block_ids(packed).tolist() == ids


def test_a_value_encoded_once_joins_each_message_as_if_encoded_with_it():
    from kvcached_proto.codec import encode_with

    value = {"host": {"blocks": 3, "layout": "layer_first"}, "key": b"\0" * 16, "clients": [1, None]}
    for message in ({}, {"rid": 2**40, "ok": True}, {f"f{i}": i for i in range(14)}):
        got = encode_with(message, "status", msgpack.packb(value, use_bin_type=True))
        assert msgpack.unpackb(got, raw=False) == {**message, "status": value}
    with pytest.raises(ValueError):
        encode_with({f"f{i}": i for i in range(15)}, "status", b"\xc0")
    with pytest.raises(ValueError):
        encode_with({"status": 1}, "status", b"\xc0")


@pytest.mark.parametrize("n", [0, 1, 64, EAGER_KEYS, EAGER_KEYS + 1, 1000])
def test_packed_keys_iterate_to_the_exact_digests_cut_at_once_or_lazily(n):
    """Up to EAGER_KEYS keys are cut in one numpy call, more one at a time; either way every
    byte of every key comes back - NULs at either end included (a fixed-size bytes dtype
    would strip the trailing ones) - and a frame's buffer serves as well as bytes."""
    rng = np.random.default_rng(n)
    keys = [rng.bytes(16) for _ in range(n)]
    for i in range(0, n, 3):
        keys[i] = keys[i][:12] + b"\0" * 4
    for i in range(1, n, 5):
        keys[i] = b"\0" * 4 + keys[i][4:]
    blob = pack_keys(keys)
    for packed in (unpack_keys(blob), unpack_keys(memoryview(blob))):
        got = list(packed)
        assert got == keys and all(type(k) is bytes and len(k) == 16 for k in got)
        assert list(packed[1:]) == keys[1:]


@pytest.mark.parametrize("blob", [b"\x00" * 15, b"\x00" * 17])
def test_keys_of_the_wrong_size_are_refused(blob):
    with pytest.raises(ProtocolError) as e:
        unpack_keys(blob)
    assert e.value.code == ErrorCode.BAD_FIELD


def test_negative_block_ids_are_refused():
    with pytest.raises(ProtocolError):
        unpack_block_ids(np.array([-1], dtype="<i4").tobytes())


def test_decode_refuses_oversize_and_non_maps():
    with pytest.raises(ProtocolError) as e:
        decode(b"\x00" * (MAX_FRAME_BYTES + 1))
    assert e.value.code == ErrorCode.FRAME_TOO_LARGE
    for frame in (msgpack.packb([1, 2]), b"\xc1", msgpack.packb({"a": 1})[:-1]):
        with pytest.raises(ProtocolError) as e:
            decode(frame)
        assert e.value.code == ErrorCode.BAD_FRAME


def test_decode_refuses_huge_containers():
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"a": list(range(5000))}))


def _req(op, **fields):
    return make_request(op, 1, "c", **fields)


@pytest.mark.parametrize(
    "msg, code",
    [
        ({"op": 2, "rid": 1, "client": "c"}, ErrorCode.BAD_HEADER),  # no version
        ({**_req(Op.PING), "proto": [9, 0]}, ErrorCode.UNSUPPORTED_VERSION),
        ({**_req(Op.PING), "op": 999}, ErrorCode.UNKNOWN_OP),
        ({**_req(Op.PING), "rid": "x"}, ErrorCode.BAD_HEADER),
        ({**_req(Op.PING), "client": ""}, ErrorCode.BAD_HEADER),
        (_req(Op.HELLO), ErrorCode.BAD_FIELD),  # pid missing
        (_req(Op.HELLO, pid="1"), ErrorCode.BAD_FIELD),
        (_req(Op.PING, extra=1), ErrorCode.BAD_FIELD),
        (_req(Op.LOOKUP, keys=[b"x" * 16]), ErrorCode.BAD_FIELD),  # array, not packed bin
        (_req(Op.LOAD, keys=b"k" * 32, blocks=pack_block_ids([1])), ErrorCode.BAD_FIELD),
        (_req(Op.LOAD, keys=b"k" * 32, blocks=pack_block_ids([1, 1])), ErrorCode.BAD_FIELD),
        (_req(Op.CLEAR, tier="gpu"), ErrorCode.BAD_FIELD),
        (_req(Op.LOOKUP, keys=b"k" * 16 * 70000), ErrorCode.TOO_MANY_ITEMS),
    ],
)
def test_parse_request_names_the_bad_field(msg, code):
    with pytest.raises(ProtocolError) as e:
        parse_request(decode(encode(msg)))
    assert e.value.code == code


def test_parse_request_fills_defaults_and_unpacks():
    req = parse_request(decode(encode(_req(Op.LOAD, keys=b"a" * 16, blocks=pack_block_ids([3])))))
    assert req.op == Op.LOAD and req.body["priority"] == 0
    assert list(req.body["keys"]) == [b"a" * 16] and req.body["blocks"].tolist() == [3]


# request frames: bounded cost (kvcached_proto.request_frame) ----------------------------------

def _big(extra: dict) -> bytes:
    """A request frame past WHOLE_BYTES: read field by field."""
    from kvcached_proto.request_frame import WHOLE_BYTES

    frame = encode({**make_request(Op.LOOKUP, 7, "c"), **extra})
    assert len(frame) > WHOLE_BYTES
    return frame


JUNK = [[0] * 2000] * 1024  # 2 M objects (a 2 MiB frame): ~30 ms to decode whole


def _refusal(frame: bytes):
    from kvcached_proto import decode_request

    seen = {}
    with pytest.raises(ProtocolError) as e:
        decode_request(frame, seen)
    return e.value, seen


def test_a_large_request_decodes_as_the_whole_frame_does():
    from kvcached_proto import decode_request

    frame = _big({"keys": pack_keys([bytes([i % 256]) * 16 for i in range(8192)])})
    assert decode_request(frame, {}) == decode(frame)
    assert decode_request(memoryview(frame), {}) == decode(frame)  # a zmq frame's buffer


def test_an_unknown_field_is_refused_before_its_value_is_read():
    """The junk is never decoded: the budget is not what refuses it, the name is; the rid
    read before it is kept for the reply."""
    err, seen = _refusal(_big({"junk": JUNK}))
    assert err.code == ErrorCode.BAD_FIELD and "'junk': not a field of any op" in err.message
    assert seen["rid"] == 7


@pytest.mark.parametrize("field, value, code", [
    ("rid", JUNK, ErrorCode.BAD_HEADER),          # an array where an int goes
    ("keys", JUNK, ErrorCode.BAD_FIELD),          # an array where a bin goes
    ("client", [JUNK], ErrorCode.BAD_HEADER),
    ("proto", JUNK, ErrorCode.TOO_MANY_ITEMS),    # [major, minor]: 16 objects at most
], ids=["rid", "keys", "client", "proto"])
def test_a_value_of_the_wrong_type_or_size_is_refused_unread(field, value, code):
    err, _ = _refusal(_big({field: value}))
    assert err.code == code and field in err.message


def test_a_layout_is_decoded_under_an_object_budget_and_only_for_register_kv():
    from kvcached_proto.request_frame import LAYOUT_OBJECTS

    err, _ = _refusal(_big({"layout": {"tensors": JUNK}}))  # op is lookup: refused unread
    assert err.code == ErrorCode.BAD_FIELD and "layout: not a field of lookup" in err.message
    frame = encode({**make_request(Op.REGISTER_KV, 8, "c"), "layout": {"tensors": JUNK}})
    err, seen = _refusal(frame)
    assert err.code == ErrorCode.TOO_MANY_ITEMS and f"more than {LAYOUT_OBJECTS}" in err.message
    assert seen["rid"] == 8


def test_the_largest_valid_requests_fit_a_request_frame_and_larger_ones_are_refused():
    """What a request may hold at most (64 Ki keys, their blocks, notes' counts and repeats)
    fits MAX_REQUEST_BYTES; a frame past it is FRAME_TOO_LARGE at both ends, unread."""
    from kvcached_proto import MAX_KEYS_PER_REQUEST, MAX_REQUEST_BYTES, decode_request, encode_request

    keys = pack_keys([i.to_bytes(16, "little") for i in range(MAX_KEYS_PER_REQUEST)])
    ints = np.arange(2**31 - MAX_KEYS_PER_REQUEST, 2**31, dtype="<i4").tobytes()  # distinct
    big = 2**62
    largest = {
        Op.LOAD: dict(keys=keys, blocks=ints, priority=-1000, fence_word=2**31 - 1, fence=big,
                      host_only=True),
        Op.OFFLOAD: dict(keys=keys, blocks=ints, priority=-1000, fence_word=2**31 - 1, fence=big,
                         parent=b"\xff" * 16),
        Op.LOOKUP_NOTES: dict(keys=keys, counts=np.ones(MAX_KEYS_PER_REQUEST, "<i4").tobytes(),
                              repeats=ints, storage_hits=big, unnoted=big),
        Op.KEY_EVENTS: dict(after=big, limit=65536, storage=True, ask=keys),
        Op.PREFETCH: dict(keys=keys, priority=-1000, policy="wait_complete", timeout_ms=3_600_000,
                          block_tokens=1 << 20),
    }
    for op, fields in largest.items():
        assert {f.name for f in OP_SPECS[op].fields} == set(fields), op  # every field, at its most
        frame = encode_request(op, 2**64 - 1, "c" * 128, **fields)
        assert len(frame) <= MAX_REQUEST_BYTES, (op, len(frame))
        assert parse_request(decode_request(frame, {})).op == op
    with pytest.raises(ProtocolError) as e:
        encode_request(Op.LOOKUP, 1, "c", keys=keys * 3)
    assert e.value.code == ErrorCode.FRAME_TOO_LARGE
    err, _ = _refusal(encode(make_request(Op.LOOKUP, 1, "c", keys=keys * 3)))
    assert err.code == ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize("cut", ["truncated", "extra"])
def test_a_truncated_or_overlong_large_frame_is_a_bad_frame(cut):
    frame = _big({"keys": pack_keys([b"k" * 16] * 8192)})
    frame = frame[:-10] if cut == "truncated" else frame + b"\x01"
    err, _ = _refusal(frame)
    assert err.code == ErrorCode.BAD_FRAME


def test_the_floor_refuses_older_minors_and_other_majors_on_both_sides():
    from kvcached_proto.messages import parse_header
    from kvcached_proto.version import PROTOCOL_FLOOR, PROTOCOL_VERSION, check_version

    def check_daemon_version(hello):  # what a client does with the daemon's hello
        check_version(hello["protocol_version"], "the daemon")

    def header(version):
        return {"rid": 1, "proto": list(version), "client": "c", "op": int(Op.PING)}

    newer = (PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 3)
    for ok in (PROTOCOL_FLOOR, PROTOCOL_VERSION, newer):
        assert parse_header(header(ok))[0] == Op.PING
        check_daemon_version({"protocol_version": list(ok)})
    for old in ((PROTOCOL_FLOOR[0], PROTOCOL_FLOOR[1] - 1), (PROTOCOL_VERSION[0] + 1, 0), (0, 9)):
        with pytest.raises(ProtocolError, match="upgrade the older side") as e:
            parse_header(header(old))
        assert e.value.code == ErrorCode.UNSUPPORTED_VERSION
        with pytest.raises(ProtocolError, match="upgrade the older side") as e:
            check_daemon_version({"protocol_version": list(old)})
        assert e.value.code == ErrorCode.UNSUPPORTED_VERSION
