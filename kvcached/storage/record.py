"""The stored form of one block, shared by every backend: a header, then the page bytes.

    off size field
      0    4 magic b"KVCB"
      4    2 format version (1)
      6    2 flags (0)
      8   16 key
     24    8 payload length
     32    4 crc32 of the payload
     36   12 reserved (zero)
     48    - payload (one host page: every layer and part of the block)

A record whose magic, version, key, length or checksum does not match is a miss, never data.
"""
from __future__ import annotations

import struct
import zlib

MAGIC = b"KVCB"
VERSION = 1
HEADER = struct.Struct("<4sHH16sQI12x")
HEADER_BYTES = HEADER.size  # 48


class BadRecord(ValueError):
    pass


def pack_header(key: bytes, payload) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, key, len(payload), zlib.crc32(payload))


def check_header(raw: bytes, key: bytes, expected_len: int) -> int:
    """Validate a header for this key and payload size; returns the payload's crc32."""
    if len(raw) < HEADER_BYTES:
        raise BadRecord("short header")
    magic, version, _flags, rkey, length, crc = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise BadRecord("not a kvcached block record")
    if rkey != key:
        raise BadRecord("record holds another key")
    if length != expected_len:
        raise BadRecord(f"payload of {length} bytes, expected {expected_len}")
    return crc


def check_payload(payload, crc: int) -> None:
    if zlib.crc32(payload) != crc:
        raise BadRecord("checksum mismatch")
