"""The engine's half of the ordering between its CUDA streams and the daemon's copy streams.

- Before an offload: an interprocess event is recorded on the engine's stream after its KV
  writes; its handle goes with the request and the daemon's offload stream waits on it. The
  engine's CPU does not synchronize. Events come from a small ring: when the daemon waits on an
  event that was recorded again since, it waits on a later point of the same stream, so it
  can only wait longer, never read unwritten bytes.
- Loads: the daemon records event (slot % event_groups, layer) on its load stream after the
  layer's copies, then bumps the slot's counter; `LoadTask.wait_layer` sees the counter and
  makes the engine's stream wait on that event (no CPU block on the copies themselves).

Not yet run on a GPU in this project: see README ("CUDA path").
"""
from __future__ import annotations

import threading

import torch

from kvcached_proto import ErrorCode, ProtocolError
from kvcached_proto.codec import unpack_event_handles

OFFLOAD_EVENT_RING = 16


class CudaOrder:
    def __init__(self, device: str, load_handles: list, event_groups: int, num_layers: int):
        self.device = torch.device(device)
        self._load_handles = unpack_event_handles(load_handles)
        if len(self._load_handles) != event_groups * num_layers:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"load_events: {len(self._load_handles)} "
                                f"handles for {event_groups} groups x {num_layers} layers")
        self._event_groups = event_groups
        self._num_layers = num_layers
        self._load_events: dict[int, torch.cuda.Event] = {}
        self._ring: list[tuple[torch.cuda.Event, bytes]] = []
        self._next = 0
        self._lock = threading.Lock()

    def record_kv_written(self, stream: torch.cuda.Stream | None = None) -> bytes:
        """Record an interprocess event after the work queued so far on `stream` (the current
        stream by default); returns its handle for the offload request."""
        stream = stream or torch.cuda.current_stream(self.device)
        with self._lock:
            if len(self._ring) < OFFLOAD_EVENT_RING:
                with torch.cuda.device(self.device):
                    ev = torch.cuda.Event(interprocess=True)
                    ev.record(stream)
                    self._ring.append((ev, bytes(ev.ipc_handle())))
                return self._ring[-1][1]
            ev, handle = self._ring[self._next]
            self._next = (self._next + 1) % OFFLOAD_EVENT_RING
            ev.record(stream)
            return handle

    def wait_layer_loaded(self, slot: int, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (the current stream by default) wait for the daemon's copies of
        `layer` of the load in `slot`."""
        idx = (slot % self._event_groups) * self._num_layers + layer
        with self._lock:
            ev = self._load_events.get(idx)
            if ev is None:
                ev = torch.cuda.Event.from_ipc_handle(self.device, self._load_handles[idx])
                self._load_events[idx] = ev
        (stream or torch.cuda.current_stream(self.device)).wait_event(ev)
