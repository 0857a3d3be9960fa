"""The daemon's stop (a part of Daemon, daemon.py): refuse new work, drain the tasks, sweep what
dead engines left, close the sockets and threads, remove the instance's files. Every step runs
even if an earlier one fails."""
from __future__ import annotations

import logging
import select
import threading
import time

from kvcached_proto.liveness import pid_alive
from kvcached_proto.shm_layout import State

from .kv_sweep import sweep_kv_segments, sweep_when_gone
from .run_dir import remove_instance_files

log = logging.getLogger("kvcached.server.daemon")  # the daemon's logger, as before the split

DYING_GRACE_S = 0.5  # at shutdown, for engines whose connection closed to finish dying
ROUTER_LINGER_MS = 1000  # at shutdown, for the last end events to reach their clients
# After the last end event a stop sent, its connections stay open this long: an engine's socket
# drops what it had not read of a connection that closed, so an engine reading at least this
# often (every step does) gets every end of a drain; a load's end is in its slot besides.
END_GRACE_S = 0.5


class StopsDaemon:
    """Daemon's close; it uses the daemon's parts as attributes (service, control, sockets,
    status block, the instance lock)."""

    def _close(self) -> None:
        """Graceful stop: refuse new work, drain tasks, remove sockets, unlink shm.

        Every step runs even if an earlier one fails; the first failure is re-raised at the end.
        """
        errors: list[BaseException] = []
        owned = self._lock_fd is not None  # a start refused for a running instance stops nothing
        for step in (self._close_service, self._sweep_dead_engines, self._close_sockets,
                     self._close_files):
            try:
                step()
            except BaseException as exc:
                log.exception("[shutdown] %s failed", step.__name__)
                errors.append(exc)
        self.dumps.close()  # (after the status block's heartbeat, which reads its pipe, stopped)
        if owned:
            log.info("[shutdown] instance %s stopped", self.cfg.instance)
        if errors:
            raise errors[0]

    def _close_service(self) -> None:
        """The drain runs on a thread of its own while this one (the sockets' owner) sends the
        end events of the tasks it runs as they end: a load queued before the stop ends DONE for
        its engine (the status block says UP, and beats, until the sockets are closed), not as a
        failed load of a daemon that exited."""
        if self.status_block is not None:
            self.status_block.set_state(State.STOPPING)
        if self.service is not None:  # lookups go to the daemon, which reads them no more: the
            try:  # client says at once it is stopping (no hit to plan on)
                self.service.keys.close()
            except Exception:  # the drain runs all the same (the service closes the table again)
                log.exception("[shutdown] closing the key table failed")
        failed: list[BaseException] = []

        def drain() -> None:
            try:
                self._drain_service()
            except BaseException as exc:
                failed.append(exc)
            finally:
                if self.events is not None:
                    self.events.wake()

        worker = threading.Thread(target=drain, name="kvcached-stop", daemon=True)
        worker.start()
        last_sent = None
        while worker.is_alive():
            if self._forward_drained(0.05):
                last_sent = time.monotonic()
        worker.join()
        if self._forward_drained(0):
            last_sent = time.monotonic()
        while last_sent is not None and time.monotonic() < last_sent + END_GRACE_S:
            self._forward_drained(min(0.05, last_sent + END_GRACE_S - time.monotonic()))
        if failed:
            raise failed[0]

    def _drain_service(self) -> None:
        if self.control is not None:  # (made after the service: its module is imported)
            from ..service.cache_service import DRAIN_TIMEOUT_S

            self.control.stop(timeout=DRAIN_TIMEOUT_S + 5)
        if self.service is not None:
            service, self.service = self.service, None
            service.close()

    def _forward_drained(self, wait_s: float) -> int:
        """The end events queued (waiting up to wait_s for one), sent as the loop sends them;
        none without the sockets (a start that failed part way). Returns how many went."""
        if self.events is None or self._router is None:
            time.sleep(max(0.0, wait_s))
            return 0
        select.select([self.events.pull], [], [], max(0.0, wait_s))
        return self._forward_events()

    def _sweep_dead_engines(self) -> None:
        """The reaper sweeps a dead engine's segments on its next turn; a stop that comes
        first (an operator stopping the daemon right after an engine was killed) sweeps here."""
        connected = [c.pid for c in self.clients.values() if c.pid_visible]
        sweep_when_gone(self._gone_pids, connected, DYING_GRACE_S)
        self._gone_pids.clear()
        for pid in self._said_bye - set(connected):
            if not pid_alive(pid):
                sweep_kv_segments(pid)

    def _close_sockets(self) -> None:
        for name in ("metrics", "_status_thread", "fd_inbox"):  # each on a thread of its own
            part = getattr(self, name)
            if part is not None:
                part.stop() if name == "_status_thread" else part.close()
                setattr(self, name, None)
        if self.events is not None:
            self.events.close()
        for mon in self._monitors:
            mon.close(linger=0)
        self._monitors = []
        if self._router is not None:  # the drained tasks' end events go out first (bounded)
            self._router.close(linger=ROUTER_LINGER_MS)
            self._router = None
        if self._curve_router is not None:
            self._curve_router.close(linger=ROUTER_LINGER_MS)
            self._curve_router = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _close_files(self) -> None:
        if self._lock_fd is None:
            return  # we never owned this instance's files: leave them to their owner
        if self.status_block is not None:
            self.status_block.close()
            self.status_block = None
        remove_instance_files(self.cfg.run_dir, self.cfg.instance, self._lock_fd)
        self._lock_fd = None
