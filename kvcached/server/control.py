"""The control worker: runs the ops that may block (a drain of the copies in flight, a
storage clear or delete, mapping a KV registration) off the request thread, which keeps
answering every other client meanwhile. Their replies go out through the task-event path
(EventSink), as the socket thread sends them; the client matches a reply by its `rid`
whichever path it came by. Ops run one at a time, in the order they came, and so does the
daemon's own work that may block (`run_later`: the KV mapping of a client that went away)."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from kvcached_proto import ErrorCode, ok_reply, reply_for

from ..errors import OpError

log = logging.getLogger(__name__)

MAX_QUEUED = 64  # control ops waiting: more is a client looping on them; BUSY


class ControlWorker(threading.Thread):
    def __init__(self, events):
        super().__init__(name="kvcached-control", daemon=True)
        self._events = events
        self._queue: queue.Queue = queue.Queue()
        self._stopping = False

    def submit(self, routing_id: bytes, rid: int, op: Callable[[], dict]) -> None:
        if self._stopping:
            raise OpError(ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
        if self._queue.qsize() >= MAX_QUEUED:
            raise OpError(ErrorCode.BUSY, f"{MAX_QUEUED} control ops queued; retry later")
        self._queue.put((routing_id, rid, op))

    def run_later(self, op: Callable[[], object]) -> None:
        """The daemon's own work that may block (a gone client's KV mapping dropped after a
        drain): in order with the clients' ops, never refused, no reply; skipped at a stop."""
        self._queue.put((None, 0, op))

    def run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            routing_id, rid, op = item
            if routing_id is None:
                self._run_own(op)
                continue
            if self._stopping:
                reply = reply_for(rid, OpError(ErrorCode.SHUTTING_DOWN, "the daemon is stopping"))
            else:
                try:
                    reply = ok_reply(rid, **op())
                except Exception as exc:  # noqa: BLE001 - becomes the caller's error reply
                    if not isinstance(exc, OpError):
                        log.exception("[control] internal error")
                    reply = reply_for(rid, exc)
            self._events.emit(routing_id, reply)

    def _run_own(self, op: Callable[[], object]) -> None:
        if self._stopping:
            return
        try:
            op()
        except Exception:  # noqa: BLE001 - the daemon's own work: logged, the worker goes on
            log.exception("[control] internal work failed")

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def stop(self, timeout: float) -> None:
        """Ops still queued are answered SHUTTING_DOWN; the one running finishes first."""
        self._stopping = True
        self._queue.put(None)
        self.join(timeout)
