"""Byte layout of the per-instance shared-memory signal segment `/kvcached.{uid}.{instance}`.

All integers little-endian, naturally aligned (so each store is one machine store).

Header (128 bytes)::

    off  size  field
      0     8  magic            b"KVCACHED"
      8     4  layout_version   1
     12     4  header_bytes     128
     16     4  pid              daemon pid
     20     4  num_slots        load-progress slots that follow the header
     24     8  epoch            new random value on every daemon start
     32     8  heartbeat_ns     CLOCK_MONOTONIC ns, rewritten at least every 100 ms
     40     4  flags            bit 0 up, 1 host_pool_ready, 2 kv_registered, 3 storage_ready
     44     4  state            State below
     48     4  slot_bytes       32
     52     4  reserved (zero)
     56     8  pid_start        the daemon's start time, clock ticks after boot (/proc/PID/stat
                                field 22); 0 when unknown
     64     8  pid_ns           inode of the daemon's pid namespace; 0 when unknown
     72    56  reserved (zero)

Load-progress slot i at 128 + 32 * i::

    off  size  field
      0     8  task_id          0 = free
      8     4  layers_done      layers whose copies are complete (monotonic within a task)
     12     4  num_layers
     16     4  status           SlotStatus below
     20     4  blocks_valid     leading blocks the layers cover: set before the first layers_done
                                bump, final at the end (0 when failed or cancelled)
     24     8  layer_ns         CLOCK_MONOTONIC ns of the last layers_done bump (latency probes)

Single writer per field (the daemon). Payload before counter: the daemon writes task_id and
num_layers, then status RUNNING, then bumps layers_done after each layer's copies are in place;
at the end it writes blocks_valid, then status. A reader checks task_id before and after reading
a counter, so a slot reused by a later task is never mistaken for its own.
"""
from __future__ import annotations

import enum

MAGIC = b"KVCACHED"
LAYOUT_VERSION = 1
HEADER_BYTES = 128
SLOT_BYTES = 32
NUM_SLOTS = 1024
SEGMENT_BYTES = HEADER_BYTES + NUM_SLOTS * SLOT_BYTES


class Flag(enum.IntFlag):
    UP = 1
    HOST_POOL_READY = 2
    KV_REGISTERED = 4
    STORAGE_READY = 8


class State(enum.IntEnum):
    STARTING = 0
    NORMAL = 1
    PAUSED = 2
    CLEARING = 3
    CLEARED = 4
    STOPPING = 5


class SlotStatus(enum.IntEnum):
    FREE = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4


def segment_name(uid: int, instance: str) -> str:
    return f"/kvcached.{uid}.{instance}"


class SignalView:
    """Typed access to a mapped segment. Writable only when the buffer is."""

    def __init__(self, buf):
        mv = memoryview(buf)
        if len(mv) < SEGMENT_BYTES:
            raise ValueError(f"signal segment is {len(mv)} bytes, expected {SEGMENT_BYTES}")
        self._raw = mv
        self._u64 = mv[:SEGMENT_BYTES].cast("Q")
        self._u32 = mv[:SEGMENT_BYTES].cast("I")

    def release(self) -> None:
        self._u64.release()
        self._u32.release()
        self._raw.release()

    # header ---------------------------------------------------------------
    @property
    def magic(self) -> bytes:
        return bytes(self._raw[0:8])

    @property
    def layout_version(self) -> int:
        return self._u32[2]

    @property
    def pid(self) -> int:
        return self._u32[4]

    @property
    def num_slots(self) -> int:
        return self._u32[5]

    @property
    def epoch(self) -> int:
        return self._u64[3]

    @property
    def heartbeat_ns(self) -> int:
        return self._u64[4]

    @property
    def flags(self) -> Flag:
        return Flag(self._u32[10])

    @property
    def state(self) -> State:
        return State(self._u32[11])

    @property
    def pid_start(self) -> int:
        return self._u64[7]

    @property
    def pid_ns(self) -> int:
        return self._u64[8]

    def init_header(self, pid: int, epoch: int, pid_start: int = 0, pid_ns: int = 0) -> None:
        self._raw[0:HEADER_BYTES] = bytes(HEADER_BYTES)
        self._u32[2] = LAYOUT_VERSION
        self._u32[3] = HEADER_BYTES
        self._u32[4] = pid
        self._u64[7] = pid_start
        self._u64[8] = pid_ns
        self._u32[5] = NUM_SLOTS
        self._u64[3] = epoch
        self._u32[12] = SLOT_BYTES
        self._raw[0:8] = MAGIC  # magic last: a reader that sees it sees a whole header

    def set_heartbeat(self, ns: int) -> None:
        self._u64[4] = ns

    def set_flag(self, flag: Flag, on: bool = True) -> None:
        cur = self._u32[10]
        self._u32[10] = (cur | int(flag)) if on else (cur & ~int(flag))

    def set_state(self, state: State) -> None:
        self._u32[11] = int(state)

    # slots ----------------------------------------------------------------
    @staticmethod
    def _slot(i: int) -> int:
        if not 0 <= i < NUM_SLOTS:
            raise IndexError(f"slot {i} outside [0, {NUM_SLOTS})")
        return (HEADER_BYTES + i * SLOT_BYTES) // 4  # index in u32 words

    def slot_task(self, i: int) -> int:
        return self._u64[self._slot(i) // 2]

    def slot_layers_done(self, i: int) -> int:
        return self._u32[self._slot(i) + 2]

    def slot_num_layers(self, i: int) -> int:
        return self._u32[self._slot(i) + 3]

    def slot_status(self, i: int) -> SlotStatus:
        return SlotStatus(self._u32[self._slot(i) + 4])

    def slot_blocks_valid(self, i: int) -> int:
        return self._u32[self._slot(i) + 5]

    def slot_begin(self, i: int, task_id: int, num_layers: int) -> None:
        w = self._slot(i)
        self._u32[w + 4] = SlotStatus.FREE
        self._u32[w + 2] = 0
        self._u32[w + 5] = 0
        self._u32[w + 3] = num_layers
        self._u64[w // 2 + 3] = 0
        self._u64[w // 2] = task_id
        self._u32[w + 4] = SlotStatus.RUNNING

    def slot_layer_ns(self, i: int) -> int:
        return self._u64[self._slot(i) // 2 + 3]

    def slot_layer_done(self, i: int, layers_done: int, now_ns: int) -> None:
        w = self._slot(i)
        self._u64[w // 2 + 3] = now_ns
        self._u32[w + 2] = layers_done

    def slot_set_valid(self, i: int, blocks_valid: int) -> None:
        """Blocks the layers will cover; written before the first layers_done bump."""
        self._u32[self._slot(i) + 5] = blocks_valid

    def slot_finish(self, i: int, status: SlotStatus, blocks_valid: int) -> None:
        w = self._slot(i)
        self._u32[w + 5] = blocks_valid
        self._u32[w + 4] = int(status)
