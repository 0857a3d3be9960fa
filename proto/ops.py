"""The op table and the error-code table: the one place where wire numbers are declared.

Values are explicit and never reused. A retired op or code keeps its number reserved here.
"""
from __future__ import annotations

import enum


class Op(enum.IntEnum):
    # lifecycle
    HELLO = 1
    PING = 2
    STATUS = 3
    SHUTDOWN = 4
    BYE = 5  # the client is leaving: cancel its queued tasks
    # KV registration
    REGISTER_KV = 10
    UNREGISTER_KV = 11
    # data path
    OFFLOAD = 20
    LOOKUP = 21
    LOAD = 22
    PREFETCH = 23
    CANCEL = 24
    FLUSH = 25
    LOOKUP_NOTES = 26  # 1.8: lookups a client answered from the key table, told in a batch
    KEY_EVENTS = 27  # 1.9: the host tier's changes of what it can load, in order (1.10: disk's)
    # maintenance
    DELETE = 30
    CLEAR = 31
    PAUSE = 40
    RESUME = 41


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1  # not decodable as a msgpack map
    FRAME_TOO_LARGE = 2  # a request over MAX_REQUEST_BYTES
    BAD_HEADER = 3  # header field missing or of the wrong type
    UNSUPPORTED_VERSION = 4  # protocol major version differs
    UNKNOWN_OP = 5
    BAD_FIELD = 6  # a body field is missing, of the wrong type or out of range
    TOO_MANY_ITEMS = 7  # more keys / blocks than the limits allow
    NOT_REGISTERED = 8  # data op before register_kv
    BUSY = 9  # queues full; retry later
    SHUTTING_DOWN = 10
    INTERNAL = 11  # a bug in the daemon; the request changed nothing it reports
    UNKNOWN_TASK = 12
    KV_MISMATCH = 13  # KV layout invalid or cannot be mapped
    NOT_HELLO = 14  # a data op from a client that has not said hello
    KV_IN_USE = 15  # register_kv while another live client's KV is registered
    FORBIDDEN = 16  # an op that changes the daemon for everyone, from neither the registered
    #                 engine nor an operator
    CLIENT_ID_IN_USE = 17  # hello with a client id another live connection already uses
