"""Handles of tasks the daemon runs: completion comes as an event; loads also signal layers."""
from __future__ import annotations

import os
import time

from kvcached_proto import DaemonUnavailable, ErrorCode, KvcachedTimeout, RequestError, TaskFailed, TaskStatus
from kvcached_proto.shm_layout import Flag, SlotStatus, State

SPIN_S = 0.02  # poll (yielding the CPU) this long before sleeping between reads
MIN_BACKOFF_S = 0.00005
MAX_BACKOFF_S = 0.001
LIVENESS_EVERY_S = 0.01


class Task:
    def __init__(self, client, task_id: int, kind: str, reply: dict):
        self.client = client
        self.id = task_id
        self.kind = kind
        self.reply = reply
        self.status: TaskStatus | None = None
        self.result: dict | None = None
        track = getattr(client, "_track_task", None)  # (its end is dropped once this is let go)
        if track is not None:
            track(self)

    def _absorb(self, event: dict) -> None:
        status = event.get("status")
        self.status = TaskStatus(status) if status in TaskStatus._value2member_map_ else status
        self.result = event.get("result") or {}

    def done(self) -> bool:
        if self.collect():  # its end read already (a closed client's too): no I/O
            return True
        self.client.poll_events(drains=True)
        return self.collect()

    def collect(self) -> bool:
        """Take the end event if the client has read it already (no I/O); True once ended."""
        if self.result is None:
            event = self.client.take_event(self.id)
            if event is not None:
                self._absorb(event)
        return self.result is not None

    def wait_end(self, timeout: float | None = None) -> None:
        """Wait for the end event only: no cancel on a timeout (KvcachedTimeout), no error for a
        task that failed (`status` and `result` say how it ended)."""
        if self.result is None:
            self._absorb(self.client.wait_event(self.id, timeout))

    def wait(self, timeout: float | None = None) -> dict:
        """Wait for completion; returns the daemon's result. Raises TaskFailed on failure."""
        self.wait_end(timeout)
        if self.status == TaskStatus.FAILED:
            raise TaskFailed(f"{self.kind} task {self.id} failed: {self.result.get('error')}",
                             self.result)
        return self.result

    def cancel(self) -> str:
        """Ask the daemon to stop the task. Its completion event still follows: wait() for it
        before reusing the device blocks it touches. "cancelled" (it was queued), "finishing"
        (it stops at its next layer or chunk) or "done" (it had ended: the daemon no longer
        knows it, its end event read or on its way)."""
        if self.result is not None:
            return "done"
        try:
            return self.client.cancel(self.id)
        except RequestError as exc:
            if exc.code != ErrorCode.UNKNOWN_TASK:
                raise
            return "done"  # this client's task, not live: it ended before the cancel came


class LoadTask(Task):
    """A host -> device load. `wait_layer(i)` returns once layer i's bytes are in place."""

    def __init__(self, client, task_id: int, reply: dict):
        super().__init__(client, task_id, "load", reply)
        self.slot = reply["slot"]
        self.num_blocks = reply["blocks"]  # leading blocks the daemon is loading
        self.num_layers = reply["num_layers"]
        self.layer_wake_ns: list[int] = []  # latest counter write -> this waiter saw it, per wait

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end of the load; returns the number of leading blocks loaded (every
        layer in place). A failed or cancelled load returns how many are valid (0).

        On timeout the load is cancelled and its device blocks are *held*: the daemon may still
        be writing them, so the engine must not reuse them until the daemon confirms the task
        ended (cancel + ack). Raises KvcachedTimeout with `.held_blocks` (also `.fenced_blocks`,
        its earlier name); the hold lifts by itself when the ack arrives (see
        Client.held_blocks)."""
        try:
            self.wait_end(timeout)
        except KvcachedTimeout as exc:
            raise self._hold(exc) from None
        except DaemonUnavailable as exc:
            if not self._ended_in_slot():
                raise self._hold_hung(exc) from None
        order = self.client.order
        if order is not None and (self.id in order.released_loads or order.released):
            return 0  # a stream wait of it was let go: the engine may have read before it landed
        return int(self.result.get("loaded", 0))

    def done(self) -> bool:
        try:
            return super().done()
        except DaemonUnavailable:
            if self._ended_in_slot():
                return True
            raise

    def _ended_in_slot(self) -> bool:
        """A daemon that stopped gracefully ran this load to its end, but the end event it sent
        is lost when the engine did not read it before the daemon exited (the socket drops what
        it holds of a closed connection): the load's slot in the status block, written before
        the event, still says how it ended. Only for a daemon that completed its stop (stopping,
        no longer up: its copy workers joined, every copy done); a killed one's slot may not be
        final."""
        if self.result is not None:
            return True
        sig = self.client.status_block
        if sig is None or not sig.gone():
            return False
        view, slot = sig.view, self.slot  # (final: its writer is gone)
        if view.state != State.STOPPING or view.flags & Flag.UP or view.slot_task(slot) != self.id:
            return False
        status = view.slot_status(slot)
        if status <= SlotStatus.RUNNING:
            return False
        full = status == SlotStatus.DONE and view.slot_layers_done(slot) >= self.num_layers
        loaded = min(view.slot_blocks_valid(slot), self.num_blocks) if full else 0
        self._absorb({"status": TaskStatus.DONE if full else TaskStatus.FAILED,
                      "result": {"loaded": loaded, "from_slot": True}})
        return True

    def _hold(self, exc: KvcachedTimeout) -> KvcachedTimeout:
        """Cancel after a timeout; wait (client timeout) for the daemon's ack; hold if none."""
        blocks = self.reply.get("device_blocks", ())
        self.client.hold(self.id, blocks)
        try:
            self.cancel()
            self._absorb(self.client.wait_event(self.id, self.client.timeout))
        except (KvcachedTimeout, DaemonUnavailable):  # the cancel or its ack not answered, or
            # the daemon seen hung or gone: it may still write them (a gone one's hold lifts)
            exc.held_blocks = exc.fenced_blocks = list(blocks)
            exc.args = (f"{exc.args[0]}; the daemon has not confirmed the cancel: device blocks "
                        f"{list(blocks)[:8]}{'...' if len(blocks) > 8 else ''} stay held",)
            return exc
        exc.held_blocks = exc.fenced_blocks = []
        exc.args = (f"{exc.args[0]}; cancelled ({self.status}, {self.result.get('loaded', 0)} "
                    "blocks valid), the daemon confirmed: its device blocks are free to reuse",)
        return exc

    def _hold_hung(self, exc: DaemonUnavailable) -> DaemonUnavailable:
        """The daemon was seen hung (or stopping) in the wait: one that wakes (or drains) still
        runs the load, which nothing cancelled, so its device blocks are held until its end event;
        a gone one writes nothing more."""
        if hasattr(exc, "held_blocks"):  # (from this load's wait, within wait_layer)
            return exc
        blocks = [int(b) for b in self.reply.get("device_blocks", ())]
        sig = self.client.status_block
        if sig is None or sig.gone() or not blocks:
            exc.held_blocks = exc.fenced_blocks = []
            return exc
        self.client.hold(self.id, blocks)
        exc.held_blocks = exc.fenced_blocks = blocks
        exc.args = (f"{exc.args[0]}; load {self.id} may still run (a daemon that wakes, or drains "
                    f"at a stop, runs it): device blocks {blocks[:8]}{'...' if len(blocks) > 8 else ''} "
                    "stay held",)
        return exc

    def wait_layer(self, layer: int, timeout: float | None = None, spin_s: float = SPIN_S,
                   stream=None) -> None:
        """Return once layer `layer` of every loaded block is in place.

        Polls the slot's counter in shared memory: yielding the CPU between reads for up to
        `spin_s` (a layer usually lands within that), then sleeping with a growing backoff.
        CUDA KV: the counter moves once the layer's copies are queued, and this makes `stream`
        (default: the current stream) wait for them on the GPU; work queued on that stream
        afterwards sees the layer, the CPU does not wait for the copies. A daemon seen hung
        raises DaemonUnavailable with the load's device blocks held (as `wait`).
        """
        try:
            self._wait_layer(layer, timeout, spin_s, stream)
        except DaemonUnavailable as exc:
            raise self._hold_hung(exc) from None

    def _wait_layer(self, layer: int, timeout: float | None, spin_s: float, stream) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers})")
        if self.num_blocks == 0:
            return
        if self.client.status_block is None:  # its client closed (a daemon dropped meanwhile)
            return self._closed(layer)
        view, slot = self.client.status_block.view, self.slot
        timeout = self.client.timeout if timeout is None else timeout
        start = time.monotonic()
        spin_until, backoff, next_check = start + spin_s, MIN_BACKOFF_S, start + LIVENESS_EVERY_S
        waited = False
        while True:
            if view.slot_task(slot) == self.id:
                # the status before the count: the daemon counts a slot's last layer before it
                # ends the slot, so a slot seen ended shows its final count; one seen ended short
                # of the layer (or taken over by the next load meanwhile) defers to the event
                ended = view.slot_status(slot) > SlotStatus.RUNNING
                done = view.slot_layers_done(slot)
                if view.slot_task(slot) == self.id:
                    if done > layer:
                        if waited:  # the latest count was written after this wait began
                            # (a starved waiter may see several at once: it saw the latest)
                            self.layer_wake_ns.append(
                                max(time.monotonic_ns() - view.slot_layer_ns(slot), 0))
                        order = self.client.order
                        if order is not None:
                            if order.cuda or order.released:  # a wait for a daemon gone would
                                self.client._check_daemon(True)  # only end by release (and a
                                # released connection's words pass every wait: not in place)
                            order.wait_loaded(slot, layer, self.id, stream)
                        return
                    if ended:  # short of it, or the next load is taking the slot over
                        return self._end_by_event(layer)
            elif self.done():  # slot reused: the task ended
                return self._end_by_event(layer)
            waited = True
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            if now >= next_check:
                next_check = now + LIVENESS_EVERY_S
                self.client.poll_events(drains=True)  # also checks that the daemon is alive
                if now - start > timeout:
                    raise KvcachedTimeout(
                        f"layer {layer} of load task {self.id} not in place within {timeout:.3g} s "
                        "(set wait_layer(timeout=...))")

    @property
    def valid_blocks(self) -> int:
        """Leading blocks the layers cover; known once wait_layer(0) has returned (a load whose
        storage part came back short covers fewer than `num_blocks`)."""
        if self.result is not None:
            return int(self.result.get("loaded", 0))
        if self.client.status_block is None:
            return 0  # its client closed before its end was read: nothing of it is known valid
        view = self.client.status_block.view
        valid = view.slot_blocks_valid(self.slot)
        return valid if view.slot_task(self.slot) == self.id else self.wait()

    def _closed(self, layer: int) -> None:
        """wait_layer on a closed client: an end already read answers; else nothing is known."""
        if self.result is not None:
            return self._end_by_event(layer)
        raise DaemonUnavailable(f"load task {self.id}: its client is closed, the load's "
                                "progress is not known")

    def _end_by_event(self, layer: int) -> None:
        """The load has ended: its end event says whether its layers are in place (done, with
        blocks loaded: every layer of those is) or not (TaskFailed)."""
        loaded = self.wait(timeout=self.client.timeout)
        if self.status == TaskStatus.DONE and loaded > 0:
            return
        raise TaskFailed(f"load task {self.id} ended ({self.status}) before layer {layer}: "
                         f"{loaded} of {self.num_blocks} blocks valid", self.result)


class UnansweredLoad:
    """A load sent whose reply did not come (`.unanswered` on the error Client.load raised):
    the client holds its device blocks under `id` (negative: no task id) until the daemon's late
    reply refuses it, the task it made ends, or the daemon is gone. `done()` says the hold
    lifted; it never raises for a daemon that is hung."""

    kind = "load"
    result = None

    def __init__(self, client, key: int, fence: int = 0):
        self.client = client
        self.id = key
        self.reply = {"fence": fence}  # (revoke(): a daemon that takes it late stops it first)

    def done(self) -> bool:
        return self.id not in self.client.held_tasks()

    def collect(self) -> bool:
        """Whether the hold lifted, as last read (no I/O)."""
        return self.id not in self.client._holds

    def wait_end(self, timeout: float | None = None) -> None:
        """Wait until the hold lifts (as Task.wait_end waits for the end event); KvcachedTimeout
        if it has not within `timeout`."""
        timeout = self.client.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        backoff = MIN_BACKOFF_S
        while not self.done():
            if time.monotonic() >= deadline:
                raise KvcachedTimeout(f"a load sent to the daemon (request {-self.id}) is neither "
                                      f"answered nor ended within {timeout:.3g} s")
            time.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
