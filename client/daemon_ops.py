"""The ops about the daemon itself: ping, status, the invariant check, shutdown, the storage
tiers' readiness. A part of Client (client.py): it uses the client's `_request`, `timeout` and
`status_block`."""
from __future__ import annotations

import time

from kvcached_proto import Busy, DaemonUnavailable, Op


class AsksDaemon:
    def ping(self, timeout: float | None = None) -> float:
        """Round trip in seconds."""
        start = time.perf_counter()
        self._request(Op.PING, timeout)
        return time.perf_counter() - start

    def status(self, timeout: float | None = None) -> dict:
        return self._request(Op.STATUS, timeout)["status"]

    def check(self, timeout: float | None = None) -> str:
        """Ask the daemon to walk its index and host-pool invariants: "ok" or what is wrong
        (asked again while the daemon says BUSY: it walks at most 10 % of the time)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            try:
                return self._request(Op.STATUS, timeout, check=True)["check"]
            except Busy:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def shutdown(self, timeout: float | None = None) -> None:
        """Ask the daemon to stop. Its reply may never arrive: the daemon exits right after
        sending it, and libzmq drops what a connection like this one (IMMEDIATE: nothing queued
        for a daemon that is not there) had not read when the daemon closes it. A daemon found
        gone or stopping after the request left did what was asked."""
        try:
            self._request(Op.SHUTDOWN, timeout)
        except DaemonUnavailable:
            sig = self.status_block
            if sig is None or not (sig.gone() or not sig.ready()):
                raise

    def wait_storage_ready(self, timeout: float | None = None) -> None:
        """Until every storage tier of the daemon is ready (the disk tier indexes what it holds
        in the background after a start; lookups see no storage hits until then)."""
        if self.status_block is None:
            raise DaemonUnavailable("client is closed")
        self.status_block.wait_storage_ready(self.timeout if timeout is None else timeout)
