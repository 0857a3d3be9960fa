"""LoadTask.wait_layer against a load that ends while the engine reads its slot (pure logic: a
real signal layout over a bytearray, with the daemon's writes put between the engine's reads;
the real daemon's side is in test_kv_worker and test_group)."""
from types import SimpleNamespace

import pytest

from kvcached_client.tasks import LoadTask
from kvcached_proto import TaskFailed, TaskStatus
from kvcached_proto.shm_layout import SEGMENT_BYTES, Slot, SlotStatus, StatusView

SLOT, TASK, LAYERS, BLOCKS = 3, 41, 2, 6


class DaemonBetweenReads(StatusView):
    """A load on its last layer. `steps` are (field, write): right after the engine's next read of
    field ("task", "layers_done" or "status"), the daemon runs write(view), before the engine's
    next read; then the next step waits for its field."""

    def __init__(self, *steps):
        super().__init__(bytearray(SEGMENT_BYTES))
        self.steps = list(steps)
        self.slot_begin(SLOT, TASK, LAYERS)
        self.slot_set_valid(SLOT, BLOCKS)
        self.slot_layer_done(SLOT, LAYERS - 1, 1)

    def _then(self, field: str, value):
        if self.steps and self.steps[0][0] == field:
            self.steps.pop(0)[1](self)
        return value

    def slot_task(self, i: int) -> int:
        return self._then("task", super().slot_task(i))

    def slot_layers_done(self, i: int) -> int:
        return self._then("layers_done", super().slot_layers_done(i))

    def slot_status(self, i: int) -> SlotStatus:
        return self._then("status", super().slot_status(i))


def ends(status: SlotStatus):
    """The daemon's end of the load: its last layer counted only when it is done."""
    def step(view):
        if status == SlotStatus.DONE:
            view.slot_layer_done(SLOT, LAYERS, 2)
        view.slot_finish(SLOT, status, BLOCKS if status == SlotStatus.DONE else 0)
    return step


def next_load_resets(view):
    """The next load's slot_begin, up to (not including) its own task id."""
    view._slot_put(SLOT, Slot.STATUS, SlotStatus.FREE)
    view._slot_put(SLOT, Slot.LAYERS_DONE, 0)


def done_and_next_load_resets(view):
    ends(SlotStatus.DONE)(view)
    next_load_resets(view)


def next_load_begins(view):
    view.slot_begin(SLOT, TASK + 1, LAYERS)


def load_task(view: StatusView, status: TaskStatus, loaded: int) -> LoadTask:
    event = {"status": status.value, "result": {"loaded": loaded}}
    client = SimpleNamespace(status_block=SimpleNamespace(view=view), timeout=1.0, order=None,
                             poll_events=lambda drains=False: None, take_event=lambda task_id: event,
                             wait_event=lambda task_id, timeout: event)
    return LoadTask(client, TASK, {"slot": SLOT, "blocks": BLOCKS, "num_layers": LAYERS})


@pytest.mark.parametrize("steps", [
    [("layers_done", ends(SlotStatus.DONE))],
    [("status", ends(SlotStatus.DONE))],
    [("task", ends(SlotStatus.DONE)), ("status", next_load_resets), ("status", next_load_begins)],
    [("layers_done", done_and_next_load_resets), ("status", next_load_begins)],
], ids=["ends-after-count-read", "ends-after-status-read", "taken-over", "reset-seen"])
def test_a_load_ending_between_two_reads_is_not_taken_for_one_ended_short(steps):
    """The daemon counts the last layer, then ends the slot; the next load may then take the slot
    over (reset it, then write its own id). The engine read the count, then the status: a load
    that ended in between looked ended short of the last layer, so a load with every block in
    place raised TaskFailed (seen in CI as 'ended (done) before layer 1: 6 of 6 blocks valid'),
    and so did a slot seen reset (status free) before the next load's id was in. Reading the
    status first, a slot seen ended and then reset before the count read still looks short:
    the load's end event decides it. Every interleaving returns."""
    task = load_task(DaemonBetweenReads(*steps), TaskStatus.DONE, BLOCKS)
    task.wait_layer(LAYERS - 1, spin_s=1.0)
    assert task.valid_blocks == BLOCKS


@pytest.mark.parametrize("ending", [SlotStatus.FAILED, SlotStatus.CANCELLED])
@pytest.mark.parametrize("field", ["layers_done", "status"])
def test_a_load_that_did_end_short_of_the_layer_still_raises(field, ending):
    status = TaskStatus.FAILED if ending == SlotStatus.FAILED else TaskStatus.CANCELLED
    task = load_task(DaemonBetweenReads((field, ends(ending))), status, 0)
    with pytest.raises(TaskFailed, match=f"before layer {LAYERS - 1}"):
        task.wait_layer(LAYERS - 1, spin_s=1.0)


def _doc_table(title: str) -> dict[str, tuple[int, int]]:
    """The 'off size field' rows under `title` in shm_layout's docstring."""
    from kvcached_proto import shm_layout

    doc = shm_layout.__doc__.split(title, 1)[1]
    rows = {}
    for line in doc.split("::", 1)[1].strip("\n").split("\n\n", 1)[0].splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit() and parts[2] not in ("reserved",):
            rows[parts[2]] = (int(parts[0]), int(parts[1]))
    return rows


def test_the_named_offsets_are_the_documented_layout_and_land_where_it_says():
    import struct

    from kvcached_proto.shm_layout import HEADER_BYTES, SLOT_BYTES, U64_FIELDS, U64_SLOT_FIELDS, Header

    for enum_cls, title, wide in ((Header, "Header (128 bytes)", U64_FIELDS),
                                  (Slot, "Load-progress slot i", U64_SLOT_FIELDS)):
        table = _doc_table(title)
        assert {f.name.lower(): f.value for f in enum_cls} == {k: v[0] for k, v in table.items()}
        for f in enum_cls:
            if f.name != "MAGIC":
                assert (table[f.name.lower()][1] == 8) == (f in wide), f
    buf = bytearray(SEGMENT_BYTES)
    view = StatusView(buf)
    view.init_header(pid=4242, epoch=(1 << 40) + 7, pid_start=99, pid_ns=(1 << 33) + 5)
    view.slot_begin(3, task_id=(1 << 35) + 1, num_layers=32)
    view.slot_layer_done(3, 5, now_ns=123456789)
    view.slot_finish(3, SlotStatus.DONE, 17)
    assert struct.unpack_from("<I", buf, 16)[0] == 4242 and struct.unpack_from("<Q", buf, 24)[0] == (1 << 40) + 7
    assert struct.unpack_from("<Q", buf, 64)[0] == (1 << 33) + 5 and bytes(buf[:8]) == b"KVCACHED"
    at = HEADER_BYTES + 3 * SLOT_BYTES
    assert struct.unpack_from("<QIIIIQ", buf, at) == ((1 << 35) + 1, 5, 32, SlotStatus.DONE, 17, 123456789)
    assert (view.slot_task(3), view.slot_layers_done(3), view.slot_blocks_valid(3)) == ((1 << 35) + 1, 5, 17)
    view.release()


def test_the_earlier_names_still_import_and_warn():
    import importlib
    import sys

    import kvcached_client.status_block as status_block
    from kvcached_proto import shm_layout

    with pytest.warns(DeprecationWarning):
        assert shm_layout.SignalView is StatusView
    with pytest.warns(DeprecationWarning):
        assert status_block.SignalReader is status_block.StatusReader
    sys.modules.pop("kvcached_client.signals", None)
    with pytest.warns(DeprecationWarning):
        signals = importlib.import_module("kvcached_client.signals")
    assert signals.SignalReader is status_block.StatusReader
