"""The key table: the daemon's index of the keys its host tier (and its local storage tiers)
hold, published in shared memory `/kvcached.{uid}.{instance}.keys` (0600), so a client answers a
lookup without a message. The daemon is its only writer; the probe loop and the writer's
updates are C (_keytable.c); clients fall back to the lookup op where it is not built.

Layout (little-endian; the header is 128 bytes, slot i at 128 + 32 * i)::

    off  size  field
      0     8  magic        b"KVCKEYT1" (written last by init)
      8     4  layout_version  1
     12     4  slot_bytes   32
     16     8  nslots       a power of two
     24     8  epoch        the daemon's epoch (the status block's): another daemon's table is
                            never read as this one's
     32     8  seed         mixes the keys' home slots (a new value per table)
     40     8  count        keys held
     48     8  max_count    at most this many (3/4 of nslots); an insert past it is refused and
                            the table says it is not complete
     56     8  flags        Flags below

    slot: u64 seq (a seqlock: odd while the daemon writes the slot), u64 k0, u64 k1 (the key),
          u32 bits (bit 0: the host tier holds it READY; bit 1 + i: local storage tier i holds
          it; 0: an empty slot), u32 zero

A table is made when the daemon's host pool takes a block geometry (the first register_kv, or
one that changes it: the old table is closed and unlinked, a new one made), so its keys always
mean blocks of the registered geometry.
"""
from __future__ import annotations

import enum

MAGIC = b"KVCKEYT1"
LAYOUT_VERSION = 1
HEADER_BYTES = 128
SLOT_BYTES = 32
HOST_BIT = 1
MAX_STORAGE_TIERS = 7  # bits 1..7; more local tiers than this count as remote
LOAD_FACTOR = 0.75
MIN_SLOTS = 1024
# lookup_notes: distinct lookups, and their keys, in one message at most (a client keeps no more
# while its socket is busy); the daemon refuses more (TOO_MANY_ITEMS): a message's work stays a
# few milliseconds (4,096 lookups of 16 keys took 15 ms, these 5.5 ms under lru, 12 under s2lru)
MAX_NOTED_LOOKUPS = 1024
MAX_NOTED_KEYS = 32768
MAX_SLOTS = 1 << 24  # 512 MiB of slots at most; a tier with more keys makes the table incomplete


class Flags(enum.IntFlag):
    OPEN = 1  # the daemon keeps this table: cleared before it is unlinked or replaced
    HOST_COMPLETE = 2  # every READY host block's key is in the table (a miss is a miss)
    NO_STORAGE = 4  # the daemon has no storage tier: a lookup's storage answer is 0
    STORAGE_COMPLETE = 8  # the local storage tiers' keys are all in the table and they answer now
    STORAGE_REMOTE = 16  # a storage tier the table does not cover (redis, more than 7 local tiers):
    #                      a storage run that stops short of the request needs the lookup op


def segment_name(uid: int, instance: str) -> str:
    return f"/kvcached.{uid}.{instance}.keys"


def table_slots(entries: int) -> int:
    """Slots for a table that must hold `entries` keys under the load factor (a power of two,
    MIN_SLOTS..MAX_SLOTS)."""
    need = max(MIN_SLOTS, int(entries / LOAD_FACTOR) + 1)
    return min(MAX_SLOTS, 1 << (need - 1).bit_length())


def table_bytes(nslots: int) -> int:
    return HEADER_BYTES + nslots * SLOT_BYTES


def max_count(nslots: int) -> int:
    return int(nslots * LOAD_FACTOR)


def native():
    """The C module, or None where it was not built, or was built from an older source that
    lacks a call this code makes (then clients send the lookup op, and the daemon publishes
    no table)."""
    try:
        from . import _keytable
    except ImportError:
        return None
    return _keytable if hasattr(_keytable, "update_many") else None
