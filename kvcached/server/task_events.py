"""Hand-off of task events from worker threads to the thread that owns the ROUTER socket.

Workers append to a thread-safe deque and poke an eventfd; the server polls that fd next to
its ROUTER socket, so events are forwarded without any worker touching a zmq socket.
"""
from __future__ import annotations

import collections
import os

from kvcached_proto import encode


class EventSink:
    def __init__(self):
        self._queue: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    @property
    def pull(self) -> int:
        """The fd to poll for readability."""
        return self._fd

    def emit(self, routing_id: bytes, event: dict) -> None:
        self._queue.append((routing_id, encode(event)))
        os.eventfd_write(self._fd, 1)

    def wake(self) -> None:
        """Make the poll return with no event (a stop asked by a signal ends the loop now,
        not at the poll's timeout)."""
        if self._fd >= 0:
            os.eventfd_write(self._fd, 1)

    def drain(self) -> list[tuple[bytes, bytes]]:
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass  # counter already consumed by an earlier drain; the queue is still read
        out = []
        while self._queue:
            out.append(self._queue.popleft())
        return out

    def close(self) -> None:
        fd, self._fd = self._fd, -1  # first: a wake() from a signal handler never sees a closed fd
        if fd >= 0:
            os.close(fd)
