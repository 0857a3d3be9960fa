"""The stored form of one block, shared by every backend: a header, then the page bytes.

    off size field
      0    4 magic b"KVCB"
      4    2 format version (2)
      6    2 flags (0)
      8   16 stored key: the block's key salted with its KV geometry (`stored_key`)
     24    8 payload length
     32    8 xxh3_64 of the payload (~25 GB/s; crc32 ran at ~2 GB/s and bounded the disk tier)
     40    8 geometry tag: the first 8 bytes of the geometry digest the page was written from
     48    - payload (one host page: every layer and part of the block)

A record whose magic, version, key, length, geometry or checksum does not match is a miss,
never data. Version 1 records (no geometry) are misses too.

Blocks of different KV geometries (LayoutSpec.geometry_digest: dtype, block shape, axis order,
layers, parts) live in different key spaces: a store is asked for `stored_key(key, geometry)`,
the key XORed with the digest, so one engine's lookups never count another geometry's blocks
and its loads never read them.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

MAGIC = b"KVCB"
VERSION = 2
HEADER = struct.Struct("<4sHH16sQQ8s")
HEADER_BYTES = HEADER.size  # 48
GEOMETRY_BYTES = 16
TAG_BYTES = 8


class BadRecord(ValueError):
    pass


def checksum(pieces) -> int:
    """xxh3_64 of the concatenation of pieces (a page may sit in several host slices)."""
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


def nbytes(pieces) -> int:
    return sum(memoryview(p).nbytes for p in pieces)


def stored_key(key: bytes, geometry: bytes) -> bytes:
    """The name a block of this geometry has in a store: its key XOR the geometry digest."""
    return (int.from_bytes(key, "little") ^ int.from_bytes(geometry, "little")).to_bytes(
        GEOMETRY_BYTES, "little")


class StoredKeys(Sequence):
    """keys as a store names them under one geometry, salted as they are read (a lookup that
    stops at its first miss salts no more)."""

    __slots__ = ("keys", "geometry")

    def __init__(self, keys: Sequence[bytes], geometry: bytes):
        self.keys, self.geometry = keys, geometry

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return StoredKeys(self.keys[i], self.geometry)
        return stored_key(self.keys[i], self.geometry)


_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def hex_names(keys: Sequence[bytes], prefix: bytes) -> list[bytes]:
    """prefix + the hex of each stored key (a StoredKeys' salted here), in a few numpy calls:
    one by one, the names of a lookup's Redis calls took the request thread more than the
    calls (py-spy of 65,536-key walks: 251 samples in the names, 145 in redis-py's send and
    receive); 1,024 names 768 -> 100 us (timeit)."""
    salt = None
    if isinstance(keys, StoredKeys):
        keys, salt = keys.keys, np.frombuffer(keys.geometry, np.uint8)
    blob = getattr(keys, "blob", None)  # (kvcached_proto's PackedKeys: still packed)
    raw = np.frombuffer(b"".join(keys) if blob is None else blob, np.uint8).reshape(-1, GEOMETRY_BYTES)
    if salt is not None:
        raw = raw ^ salt
    p = len(prefix)
    out = np.empty((len(raw), p + 2 * GEOMETRY_BYTES), np.uint8)
    out[:, :p] = np.frombuffer(prefix, np.uint8)
    out[:, p::2], out[:, p + 1::2] = _HEX[raw >> 4], _HEX[raw & 15]
    return out.view(f"S{out.shape[1]}").ravel().tolist()


def pack_header(key: bytes, pieces, geometry: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, key, nbytes(pieces), checksum(pieces),
                       geometry[:TAG_BYTES])


def verify(record, key: bytes, payload_bytes: int, geometry: bytes) -> None:
    """Raise BadRecord unless `record` (bytes) is a whole, intact record of `key` written
    from this geometry."""
    if len(record) != HEADER_BYTES + payload_bytes:
        raise BadRecord(f"record of {len(record)} bytes, expected {HEADER_BYTES + payload_bytes}")
    crc = check_header(record[:HEADER_BYTES], key, payload_bytes, geometry)
    check_payload([memoryview(record)[HEADER_BYTES:]], crc)


def check_header(raw: bytes, key: bytes, expected_len: int, geometry: bytes) -> int:
    """Validate a header for this key, payload size and geometry; returns the payload's
    checksum."""
    if len(raw) < HEADER_BYTES:
        raise BadRecord("short header")
    magic, version, _flags, rkey, length, crc, tag = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise BadRecord("not a kvcached block record (or one of an older format)")
    if rkey != key:
        raise BadRecord("record holds another key")
    if tag != geometry[:TAG_BYTES]:
        raise BadRecord("record written from another KV geometry")
    if length != expected_len:
        raise BadRecord(f"payload of {length} bytes, expected {expected_len}")
    return crc


def check_payload(pieces, crc: int) -> None:
    if checksum(pieces) != crc:
        raise BadRecord("checksum mismatch")


def gather(pieces, out: memoryview) -> None:
    """A page's pieces, back to back into `out` (a staged record's payload)."""
    off = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        out[off:off + view.nbytes] = view
        off += view.nbytes


def scatter(payload: memoryview, pieces) -> None:
    """A record's payload into the page's pieces."""
    off = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        view[:] = payload[off:off + view.nbytes]
        off += view.nbytes
