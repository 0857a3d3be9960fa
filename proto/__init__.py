"""kvcached_proto: the wire protocol shared by the kvcached daemon and its clients."""
from .codec import (
    KEY_BYTES,
    MAX_BLOCKS_PER_REQUEST,
    MAX_FRAME_BYTES,
    MAX_KEYS_PER_REQUEST,
    MAX_REQUEST_BYTES,
    decode,
    encode,
    pack_block_ids,
    pack_keys,
    unpack_block_ids,
    unpack_keys,
)
from .errors import (
    Busy,
    CodedError,
    DaemonStopping,
    DaemonUnavailable,
    KvcachedError,
    KvcachedTimeout,
    ProtocolError,
    RequestError,
    TaskFailed,
    request_error,
)
from .messages import (
    OP_SPECS,
    Request,
    encode_request,
    error_reply,
    make_request,
    ok_reply,
    TaskStatus,
    parse_request,
    reply_for,
    task_event,
)
from .ops import ErrorCode, Op
from .request_frame import decode_request
from .version import PROTOCOL_VERSION

__all__ = [
    "KEY_BYTES", "MAX_BLOCKS_PER_REQUEST", "MAX_FRAME_BYTES", "MAX_KEYS_PER_REQUEST",
    "MAX_REQUEST_BYTES", "decode", "decode_request", "encode", "pack_block_ids", "pack_keys", "unpack_block_ids", "unpack_keys",
    "Busy", "CodedError", "DaemonStopping", "DaemonUnavailable", "KvcachedError", "KvcachedTimeout", "ProtocolError",
    "RequestError", "TaskFailed", "request_error", "OP_SPECS", "Request", "error_reply",
    "TaskStatus", "reply_for",
    "encode_request", "make_request", "ok_reply", "parse_request", "task_event", "ErrorCode", "Op",
    "PROTOCOL_VERSION",
]
