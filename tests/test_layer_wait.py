"""LoadTask.wait_layer against a load that ends while the engine reads its slot (pure logic: a
real signal layout over a bytearray, with the daemon's writes put between the engine's reads;
the real daemon's side is in test_kv_worker and test_group)."""
from types import SimpleNamespace

import pytest

from kvcached_client.tasks import LoadTask
from kvcached_proto import TaskFailed, TaskStatus
from kvcached_proto.shm_layout import SEGMENT_BYTES, SignalView, SlotStatus

SLOT, TASK, LAYERS, BLOCKS = 3, 41, 2, 6


class DaemonBetweenReads(SignalView):
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
    view._u32[view._slot(SLOT) + 4] = SlotStatus.FREE
    view._u32[view._slot(SLOT) + 2] = 0


def done_and_next_load_resets(view):
    ends(SlotStatus.DONE)(view)
    next_load_resets(view)


def next_load_begins(view):
    view.slot_begin(SLOT, TASK + 1, LAYERS)


def load_task(view: SignalView, status: TaskStatus, loaded: int) -> LoadTask:
    event = {"status": status.value, "result": {"loaded": loaded}}
    client = SimpleNamespace(signals=SimpleNamespace(view=view), timeout=1.0, order=None,
                             poll_events=lambda: None, take_event=lambda task_id: event,
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
