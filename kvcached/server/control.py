"""The control worker: runs the ops that may block (a drain of the copies in flight, a
storage clear or delete, mapping a KV registration) off the request thread, which keeps
answering every other client meanwhile. Their replies go out through the task-event path
(EventSink), as the socket thread sends them; the client matches a reply by its `rid`
whichever path it came by. Ops run one at a time; so does the daemon's own work that may block
(`run_later`: the KV mapping of a client that went away).

Two lanes, the first always served first: the engines' (ops of a client whose KV is
registered, of an operator, and the daemon's own work) and the others' (any other client: a
router's deletes, an engine registering). A client pipelining 65,536-key deletes filled the one
queue there was: the engine's own delete waited 1.9 s, then 9 of 10 were BUSY (so would its
unregister or a pause have been). Now another client's ops cost an engine's at most the one
running; in the others' lane a client may have PER_CLIENT queued, so one connection cannot
fill it. Each lane runs its ops in the order they came."""
from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

from kvcached_proto import ErrorCode, ok_reply, reply_for

from ..errors import OpError

log = logging.getLogger(__name__)

MAX_QUEUED = 64  # control ops waiting in a lane: more is a client looping on them; BUSY
PER_CLIENT = 4  # of them, one client's in the others' lane
ENGINES, OTHERS = 0, 1


class ControlWorker(threading.Thread):
    def __init__(self, events):
        super().__init__(name="kvcached-control", daemon=True)
        self._events = events
        self._cv = threading.Condition()
        self._lanes = (collections.deque(), collections.deque())  # ENGINES, OTHERS
        self._of_client: collections.Counter = collections.Counter()  # queued in OTHERS
        self._stopping = self._stop_queued = False

    def submit(self, routing_id: bytes, rid: int, op: Callable[[], dict], lane: int = ENGINES) -> None:
        if self._stopping:
            raise OpError(ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
        with self._cv:
            if len(self._lanes[lane]) >= MAX_QUEUED:
                raise OpError(ErrorCode.BUSY, f"{MAX_QUEUED} control ops queued; retry later")
            if lane == OTHERS and self._of_client[routing_id] >= PER_CLIENT:
                raise OpError(ErrorCode.BUSY, f"{PER_CLIENT} control ops of this client queued "
                              "(a client with no KV registered); retry once they are answered")
            if lane == OTHERS:
                self._of_client[routing_id] += 1
            self._lanes[lane].append((routing_id, rid, op))
            self._cv.notify()

    def run_later(self, op: Callable[[], object]) -> None:
        """The daemon's own work that may block (a gone client's KV mapping dropped after a
        drain): in order with the engines' ops, never refused, no reply; skipped at a stop."""
        with self._cv:
            self._lanes[ENGINES].append((None, 0, op))
            self._cv.notify()

    def _next(self) -> tuple | None:
        with self._cv:
            while not (self._lanes[ENGINES] or self._lanes[OTHERS] or self._stop_queued):
                self._cv.wait()
            lane = ENGINES if self._lanes[ENGINES] else OTHERS
            if not self._lanes[lane]:
                return None  # stopping, nothing left
            item = self._lanes[lane].popleft()
            if lane == OTHERS:
                self._of_client[item[0]] -= 1
                if not self._of_client[item[0]]:
                    del self._of_client[item[0]]
            return item

    def run(self) -> None:
        while True:
            item = self._next()
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
        return len(self._lanes[ENGINES]) + len(self._lanes[OTHERS])

    def stop(self, timeout: float) -> None:
        """Ops still queued are answered SHUTTING_DOWN; the one running finishes first."""
        self._stopping = True
        with self._cv:
            self._stop_queued = True
            self._cv.notify()
        self.join(timeout)
