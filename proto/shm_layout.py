"""Byte layout of the per-instance shared-memory status block `/kvcached.{uid}.{instance}`.

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


class Header(enum.IntEnum):
    """Byte offsets of the header's fields (the table above)."""
    MAGIC = 0
    LAYOUT_VERSION = 8
    HEADER_BYTES = 12
    PID = 16
    NUM_SLOTS = 20
    EPOCH = 24
    HEARTBEAT_NS = 32
    FLAGS = 40
    STATE = 44
    SLOT_BYTES = 48
    PID_START = 56
    PID_NS = 64


class Slot(enum.IntEnum):
    """Byte offsets of a load-progress slot's fields, from the slot's start."""
    TASK_ID = 0
    LAYERS_DONE = 8
    NUM_LAYERS = 12
    STATUS = 16
    BLOCKS_VALID = 20
    LAYER_NS = 24


# the fields' sizes: everything not named here is a u32
U64_FIELDS = frozenset({Header.EPOCH, Header.HEARTBEAT_NS, Header.PID_START, Header.PID_NS})
U64_SLOT_FIELDS = frozenset({Slot.TASK_ID, Slot.LAYER_NS})


class StatusView:
    """Typed access to a mapped status block. Writable only when the buffer is. Each field is
    read and written as one naturally aligned machine word at its named offset."""

    def __init__(self, buf):
        mv = memoryview(buf)
        if len(mv) < SEGMENT_BYTES:
            raise ValueError(f"status block is {len(mv)} bytes, expected {SEGMENT_BYTES}")
        self._raw = mv
        self._u64 = mv[:SEGMENT_BYTES].cast("Q")
        self._u32 = mv[:SEGMENT_BYTES].cast("I")

    def release(self) -> None:
        self._u64.release()
        self._u32.release()
        self._raw.release()

    def _get(self, off: int) -> int:
        return self._u64[off >> 3] if off in U64_FIELDS else self._u32[off >> 2]

    def _put(self, off: int, value: int) -> None:
        if off in U64_FIELDS:
            self._u64[off >> 3] = value
        else:
            self._u32[off >> 2] = value

    # header ---------------------------------------------------------------
    @property
    def magic(self) -> bytes:
        return bytes(self._raw[Header.MAGIC : Header.MAGIC + 8])

    @property
    def layout_version(self) -> int:
        return self._get(Header.LAYOUT_VERSION)

    @property
    def pid(self) -> int:
        return self._get(Header.PID)

    @property
    def num_slots(self) -> int:
        return self._get(Header.NUM_SLOTS)

    @property
    def epoch(self) -> int:
        return self._get(Header.EPOCH)

    @property
    def heartbeat_ns(self) -> int:
        return self._get(Header.HEARTBEAT_NS)

    @property
    def flags(self) -> Flag:
        return Flag(self._get(Header.FLAGS))

    @property
    def state(self) -> State:
        return State(self._get(Header.STATE))

    @property
    def pid_start(self) -> int:
        return self._get(Header.PID_START)

    @property
    def pid_ns(self) -> int:
        return self._get(Header.PID_NS)

    def init_header(self, pid: int, epoch: int, pid_start: int = 0, pid_ns: int = 0) -> None:
        self._raw[0:HEADER_BYTES] = bytes(HEADER_BYTES)
        for off, value in ((Header.LAYOUT_VERSION, LAYOUT_VERSION), (Header.HEADER_BYTES, HEADER_BYTES),
                           (Header.PID, pid), (Header.PID_START, pid_start), (Header.PID_NS, pid_ns),
                           (Header.NUM_SLOTS, NUM_SLOTS), (Header.EPOCH, epoch),
                           (Header.SLOT_BYTES, SLOT_BYTES)):
            self._put(off, value)
        self._raw[Header.MAGIC : Header.MAGIC + 8] = MAGIC  # last: a reader that sees it sees a whole header

    def set_heartbeat(self, ns: int) -> None:
        self._put(Header.HEARTBEAT_NS, ns)

    def set_flag(self, flag: Flag, on: bool = True) -> None:
        cur = self._get(Header.FLAGS)
        self._put(Header.FLAGS, (cur | int(flag)) if on else (cur & ~int(flag)))

    def set_state(self, state: State) -> None:
        self._put(Header.STATE, int(state))

    # slots ----------------------------------------------------------------
    @staticmethod
    def _slot(i: int) -> int:
        """Slot i's byte offset."""
        if not 0 <= i < NUM_SLOTS:
            raise IndexError(f"slot {i} outside [0, {NUM_SLOTS})")
        return HEADER_BYTES + i * SLOT_BYTES

    def _slot_get(self, i: int, field: Slot) -> int:
        off = self._slot(i) + field
        return self._u64[off >> 3] if field in U64_SLOT_FIELDS else self._u32[off >> 2]

    def _slot_put(self, i: int, field: Slot, value: int) -> None:
        off = self._slot(i) + field
        if field in U64_SLOT_FIELDS:
            self._u64[off >> 3] = value
        else:
            self._u32[off >> 2] = value

    def slot_task(self, i: int) -> int:
        return self._slot_get(i, Slot.TASK_ID)

    def slot_layers_done(self, i: int) -> int:
        return self._slot_get(i, Slot.LAYERS_DONE)

    def slot_num_layers(self, i: int) -> int:
        return self._slot_get(i, Slot.NUM_LAYERS)

    def slot_status(self, i: int) -> SlotStatus:
        return SlotStatus(self._slot_get(i, Slot.STATUS))

    def slot_blocks_valid(self, i: int) -> int:
        return self._slot_get(i, Slot.BLOCKS_VALID)

    def slot_layer_ns(self, i: int) -> int:
        return self._slot_get(i, Slot.LAYER_NS)

    def slot_begin(self, i: int, task_id: int, num_layers: int) -> None:
        """Payload before the task id, the task id before RUNNING (the header's order)."""
        for field, value in ((Slot.STATUS, SlotStatus.FREE), (Slot.LAYERS_DONE, 0), (Slot.BLOCKS_VALID, 0),
                             (Slot.NUM_LAYERS, num_layers), (Slot.LAYER_NS, 0), (Slot.TASK_ID, task_id),
                             (Slot.STATUS, SlotStatus.RUNNING)):
            self._slot_put(i, field, int(value))

    def slot_layer_done(self, i: int, layers_done: int, now_ns: int) -> None:
        self._slot_put(i, Slot.LAYER_NS, now_ns)
        self._slot_put(i, Slot.LAYERS_DONE, layers_done)

    def slot_set_valid(self, i: int, blocks_valid: int) -> None:
        """Blocks the layers will cover; written before the first layers_done bump."""
        self._slot_put(i, Slot.BLOCKS_VALID, blocks_valid)

    def slot_finish(self, i: int, status: SlotStatus, blocks_valid: int) -> None:
        self._slot_put(i, Slot.BLOCKS_VALID, blocks_valid)
        self._slot_put(i, Slot.STATUS, int(status))


def __getattr__(name: str):
    if name == "SignalView":  # the name before the status block was called so
        import warnings

        warnings.warn("kvcached_proto.shm_layout.SignalView is StatusView now", DeprecationWarning,
                      stacklevel=2)
        return StatusView
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
