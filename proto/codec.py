"""Frame encoding: msgpack maps with size limits, packed keys and block ids.

No pickle anywhere: msgpack with `raw=False, strict_map_key=True` and explicit length limits.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Iterable

import msgpack
import numpy as np

from .errors import ProtocolError
from .ops import ErrorCode

KEY_BYTES = 16
_KEY_DTYPE = np.dtype(f"V{KEY_BYTES}")  # raw bytes: tolist() gives them whole (S16 strips NULs)
EAGER_KEYS = 256  # PackedKeys of up to this many keys are cut whole when iterated
MAX_FRAME_BYTES = 8 << 20  # any frame (a reply too: a key_events reply of 64 Ki events ~ 1.3 MiB)
# a request: the largest valid one is a lookup_notes of 64 Ki keys (1 MiB), their counts and
# repeats (256 KiB each); every connection may hold a few in the daemon, so no more than that
MAX_REQUEST_BYTES = 2 << 20
MAX_KEYS_PER_REQUEST = 65536
MAX_BLOCKS_PER_REQUEST = 65536
MAX_STR_BYTES = 4096
MAX_CONTAINER_ITEMS = 4096  # arrays and maps inside a frame (layouts, status tables)

_BLOCK_DTYPE = np.dtype("<i4")


def encode(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def encode_with(message: dict, name: str, encoded: bytes) -> bytes:
    """encode({**message, name: value}) where `encoded` is encode(value), done once for many
    messages (a status served to every request for a while). `message` has under 15 fields."""
    if len(message) >= 15 or name in message:
        raise ValueError("encode_with: a map of under 15 fields without the added one")
    parts = [bytes([0x80 | (len(message) + 1)])]  # a fixmap header
    for key, value in message.items():
        parts.append(encode(key))
        parts.append(encode(value))
    parts.append(encode(name))
    parts.append(encoded)
    return b"".join(parts)


def decode(frame: bytes) -> dict:
    """Decode one frame into a map, or raise ProtocolError (BAD_FRAME / FRAME_TOO_LARGE)."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}"
        )
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_FRAME_BYTES,
            max_str_len=MAX_STR_BYTES,
            max_array_len=MAX_CONTAINER_ITEMS,
            max_map_len=MAX_CONTAINER_ITEMS,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not a msgpack frame: {exc}") from None
    except Exception as exc:  # msgpack raises a few other types on garbage (e.g. UnicodeDecodeError)
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not a msgpack frame: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame is a {type(obj).__name__}, not a map")
    return obj


def pack_keys(keys: Iterable[bytes]) -> bytes:
    """Every key a KEY_BYTES digest, each one checked (an 8-byte key beside a 24-byte one joined
    to two keys' length, and were sent as two other keys)."""
    keys = keys if isinstance(keys, (list, tuple)) else list(keys)
    try:
        blob = b"".join(keys)
    except TypeError:
        blob = None
    if blob is None or len(blob) != KEY_BYTES * len(keys) or (keys and set(map(len, keys)) != {KEY_BYTES}):
        for i, k in enumerate(keys):
            if not isinstance(k, (bytes, bytearray, memoryview)) or len(k) != KEY_BYTES:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"keys[{i}] is not a {KEY_BYTES}-byte digest")
    return blob


class PackedKeys(Sequence):
    """Keys still packed in their frame; each is sliced out only when used, so a lookup
    that stops at its first miss does not pay for the rest."""

    __slots__ = ("blob", "n")

    def __init__(self, blob: bytes):
        self.blob = blob if type(blob) is bytes else bytes(blob)  # keys are bytes, whatever came
        self.n = len(blob) // KEY_BYTES

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            if step == 1:  # stays packed
                return PackedKeys(self.blob[start * KEY_BYTES : max(start, stop) * KEY_BYTES])
            return [self[j] for j in range(start, stop, step)]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.blob[i * KEY_BYTES : (i + 1) * KEY_BYTES]

    def __iter__(self):
        if self.n <= EAGER_KEYS:  # cut all at once in C: a 64-key lookup's walk took twice
            return iter(np.frombuffer(self.blob, _KEY_DTYPE).tolist())  # the time as a generator
        return self._lazy()

    def _lazy(self):
        blob = self.blob
        for start in range(0, self.n * KEY_BYTES, KEY_BYTES):
            yield blob[start : start + KEY_BYTES]


def unpack_keys(blob: bytes, field: str = "keys") -> PackedKeys:
    if len(blob) % KEY_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"{field}: {len(blob)} bytes is not a multiple of {KEY_BYTES}"
        )
    n = len(blob) // KEY_BYTES
    if n > MAX_KEYS_PER_REQUEST:
        raise ProtocolError(ErrorCode.TOO_MANY_ITEMS, f"{field}: {n} keys > {MAX_KEYS_PER_REQUEST}")
    return PackedKeys(blob)


def check_block_ids(block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The block ids as a one-dimensional integer array, or ProtocolError: floats are refused,
    not truncated (1.5 was sent as block 1: another request's), and so are booleans (a mask
    passed for ids was sent as blocks 0 and 1) and anything else that is not integers."""
    try:
        arr = np.asarray(block_ids)
    except Exception as exc:  # noqa: BLE001 - a CUDA tensor, ragged lists: said as what it is
        raise ProtocolError(ErrorCode.BAD_FIELD, f"block ids: {type(exc).__name__}: {exc}") from None
    if arr.ndim != 1:
        raise ProtocolError(ErrorCode.BAD_FIELD, "block ids must be one-dimensional")
    if arr.size and arr.dtype.kind not in "iu":
        raise ProtocolError(ErrorCode.BAD_FIELD, f"block ids must be integers, not {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ProtocolError(ErrorCode.BAD_FIELD, "block ids must fit in int32 and be >= 0")
    return arr


def pack_block_ids(block_ids: Sequence[int] | np.ndarray) -> bytes:
    return check_block_ids(block_ids).astype(_BLOCK_DTYPE, copy=False).tobytes()


def unpack_block_ids(blob: bytes, field: str = "blocks") -> np.ndarray:
    if len(blob) % 4:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{field}: {len(blob)} bytes is not a multiple of 4")
    n = len(blob) // 4
    if n > MAX_BLOCKS_PER_REQUEST:
        raise ProtocolError(ErrorCode.TOO_MANY_ITEMS, f"{field}: {n} blocks > {MAX_BLOCKS_PER_REQUEST}")
    arr = np.frombuffer(blob, dtype=_BLOCK_DTYPE).astype(np.int64)
    if n and arr.min() < 0:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{field}: negative block id")
    return arr
