"""The daemon's side of the shared-memory status block (layout: kvcached_proto.shm_layout).

The daemon is the only writer and the only one that unlinks. A segment left by a daemon that
died is swept at start, after checking that its recorded pid is gone.

A segment whose name is removed while the daemon runs (systemd-logind removes a user's shared
memory at the user's last logout where RemoveIPC=yes, its default; an operator's rm) is made
anew within a second (heal): a copy, filled and written before its name appears (it is linked
into place), and from then on every write goes to both, so engines attached keep reading theirs
and new ones attach to the new one. A segment another process put under the name is left alone.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
import time
from typing import Callable

import posix_ipc

from kvcached_proto import shm_room
from kvcached_proto.liveness import pid_alive, pid_namespace, process_alive, start_ticks
from kvcached_proto.paths import SHM_DIR, segment_inode, segment_owner
from kvcached_proto.shm_layout import (
    MAGIC,
    SEGMENT_BYTES,
    Flag,
    StatusView,
    SlotStatus,
    State,
    segment_name,
)

from ..errors import StartupError
from .stack_dump import StackDumps

log = logging.getLogger(__name__)

HEARTBEAT_PERIOD_S = 0.05
LATE_BEAT_S = 0.25
# No timed dump of a beat that is late (faulthandler.dump_traceback_later): its thread reads the
# others' frames without the GIL, and a daemon SIGSTOPped past its timeout died of SIGSEGV when
# the dump raced the threads that woke with it (tests/test_host_tier.py's hung-daemon cancel).
# The dumps there are (stack_dump.py) are written by the heartbeat, holding the GIL.
HEAL_EVERY_BEATS = 20  # the segment's name checked about once a second
MAX_HEALS = 16  # segments made anew in a daemon's life (each one's mapping is kept to the end)
REMOVED_HOW = ("systemd-logind removes a user's shared memory at the user's last logout where "
               "RemoveIPC=yes: run the daemon as a system user, set RemoveIPC=no in "
               "/etc/systemd/logind.conf, or `loginctl enable-linger USER`")


def _create(name: str) -> tuple[mmap.mmap, int]:
    """A new segment (O_EXCL, 0600) mapped: (mapping, inode)."""
    shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=SEGMENT_BYTES)
    try:
        shm_room.reserve(shm.fd, SEGMENT_BYTES, "status segment")  # (sparse: a SIGBUS at a write)
        return mmap.mmap(shm.fd, SEGMENT_BYTES), os.fstat(shm.fd).st_ino
    except BaseException:
        posix_ipc.unlink_shared_memory(name)
        raise
    finally:
        shm.close_fd()


def _owner_of_existing(name: str) -> tuple[int, int, int] | None:
    """(pid, start ticks, pid namespace) recorded in an existing segment, pid 0 when it has
    no valid header, None when absent."""
    try:
        shm = posix_ipc.SharedMemory(name, flags=0)
    except posix_ipc.ExistentialError:
        return None
    try:
        if shm.size < SEGMENT_BYTES:
            return 0, 0, 0
        with mmap.mmap(shm.fd, SEGMENT_BYTES, prot=mmap.PROT_READ) as mm:
            view = StatusView(mm)
            try:
                if view.magic != MAGIC:
                    return 0, 0, 0
                return view.pid, view.pid_start, view.pid_ns
            finally:
                view.release()
    finally:
        shm.close_fd()


class StatusSegment:
    """Creates the segment (O_EXCL, 0600), keeps the heartbeat, and unlinks it on close."""

    def __init__(self, instance: str, dumps: StackDumps | None = None):
        self.name = segment_name(os.getuid(), instance)
        self.epoch = secrets.randbits(63) | 1
        self._sweep_stale()
        try:
            self._mm, self._ino = _create(self.name)
        except posix_ipc.ExistentialError:
            raise StartupError(f"shared-memory segment {self.name} appeared while starting") from None
        except shm_room.NoShmRoom as exc:
            raise StartupError(f"{exc.strerror}; {shm_room.ADVICE}") from None
        self.view = StatusView(self._mm)
        self.view.init_header(os.getpid(), self.epoch, start_ticks(os.getpid()) or 0, pid_namespace())
        self.view.set_heartbeat(time.monotonic_ns())
        self._views = (self.view,)  # every write goes to each (heal: the newest is self.view)
        self._made = [(self._mm, self.view)]  # (kept until close: a writer may hold an older _views)
        self.heals = 0
        self._said_foreign = False
        self._stop = threading.Event()
        self._flags_lock = threading.Lock()  # flags are set from several threads (read-modify-write)
        self.max_gap_s = 0.0
        self.late_beats = 0  # beats later than LATE_BEAT_S (status, /metrics)
        self.dumps = dumps or StackDumps()  # every thread's stack, on USR1 and a stalled loop
        self._thread = threading.Thread(target=self._beat, name="kvcached-heartbeat", daemon=True)
        self._thread.start()
        self._closed = False

    def _sweep_stale(self) -> None:
        uid = segment_owner(self.name)
        if uid is not None and uid != os.getuid():
            self._remove_foreign(uid)
            return
        found = _owner_of_existing(self.name)
        if found is None:
            return
        owner, started, ns = found
        if ns and started and ns == pid_namespace():
            alive = process_alive(owner, started)  # a reused pid is not the owner
        else:
            alive = pid_alive(owner)
        if owner and owner != os.getpid() and alive:
            raise StartupError(
                f"instance already running: segment {self.name} belongs to live pid {owner}"
            )
        log.warning("[startup] sweeping stale segment %s (owner pid %s is gone)", self.name, owner)
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass  # another starter swept it first; O_CREX below settles who wins

    def _remove_foreign(self, uid: int) -> None:
        """Another uid made a segment under this instance's name (its header is not read: the
        pid it names could be any live process, which would keep this daemon from starting)."""
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            return
        except posix_ipc.PermissionsError:
            raise StartupError(
                f"segment {self.name} (/dev/shm{self.name}) was made by uid {uid}, not by this "
                f"daemon's user ({os.getuid()}), and this user cannot remove it: remove it as "
                "that user or root, or use another --instance") from None
        log.warning("[startup] removed segment %s: made by uid %d, not this daemon's user (%d); "
                    "its contents were not read", self.name, uid, os.getuid())

    def _beat(self) -> None:
        last, beats = time.monotonic_ns(), 0
        while not self._stop.wait(HEARTBEAT_PERIOD_S):
            now = time.monotonic_ns()
            for view in self._views:
                view.set_heartbeat(now)
            beats += 1
            if beats % HEAL_EVERY_BEATS == 0 and self.heals < MAX_HEALS:
                try:
                    self._heal()
                except Exception:  # noqa: BLE001 - the beat goes on, whatever a heal met
                    log.exception("[heartbeat] making segment %s anew failed; not tried again", self.name)
                    self.heals = MAX_HEALS
            gap = (now - last) / 1e9
            last = now
            if gap > self.max_gap_s:
                self.max_gap_s = gap
            if gap > LATE_BEAT_S:  # the process was starved (GIL held, CPU taken): say so
                self.late_beats += 1
                log.warning("[heartbeat] beat %.2f s apart (expected %.2f s)", gap, HEARTBEAT_PERIOD_S)
            try:
                self.dumps.on_beat(self.view.state == State.STOPPING)
            except Exception:  # noqa: BLE001 - (a bug in a dump must not stop the beat)
                log.exception("[heartbeat] a stack dump failed")

    def watch_loop(self, lag: Callable[[], float], stall_s: float) -> None:
        """From now on the heartbeat watches the request loop too: once lag() (how long since it
        last turned) reaches stall_s while the daemon is not stopping, every thread's stack is
        written to the log, once a stall (a loop stuck in a call that let the GIL go beats on:
        engines do not call it hung; status and /health call it stalled)."""
        self.dumps.watch_loop(lag, stall_s)

    def _heal(self) -> None:
        """(The heartbeat thread.) The segment's name gone: a copy made, written from now on,
        and linked under the name once whole (a client never opens it half made)."""
        ino = segment_inode(self.name)
        if ino == self._ino:
            return
        if ino is not None:  # not this daemon's: another process's to answer for
            if not self._said_foreign:
                self._said_foreign = True
                log.error("[heartbeat] segment %s is no longer this daemon's (another process "
                          "made one under its name): engines that attach now read that one", self.name)
            return
        spare = f"{self.name}.heal.{secrets.token_hex(4)}"
        try:
            mm, ino = _create(spare)
        except (posix_ipc.Error, OSError) as exc:
            log.error("[heartbeat] segment %s was removed and cannot be made anew: %s", self.name, exc)
            self.heals = MAX_HEALS
            return
        with self._flags_lock:  # (no flag or state set between the copy and the fan-out)
            mm[:] = self._mm[:]  # the header (pid, epoch) as it is; the heartbeat is this thread's
            view = StatusView(mm)
            self._made.append((mm, view))
            self._views = (*self._views, view)
        try:
            os.link(os.path.join(SHM_DIR, spare.lstrip("/")), os.path.join(SHM_DIR, self.name.lstrip("/")))
        except OSError:  # made meanwhile: the next check sees whose
            self._views = self._views[:-1]
            return
        finally:
            try:
                posix_ipc.unlink_shared_memory(spare)
            except posix_ipc.ExistentialError:
                pass
        self.view, self._mm, self._ino = view, mm, ino
        self.heals += 1
        log.warning("[heartbeat] segment %s was removed from /dev/shm while the daemon ran; made "
                    "it anew (engines attached go on with theirs, new ones attach to it). Likely "
                    "cause: %s", self.name, REMOVED_HOW)

    def set_flag(self, flag: Flag, on: bool = True) -> None:
        with self._flags_lock:
            for view in self._views:
                view.set_flag(flag, on)

    def set_state(self, state: State) -> None:
        with self._flags_lock:
            for view in self._views:
                view.set_state(state)

    @property
    def state(self) -> State:
        return self.view.state

    def slot_begin(self, slot: int, task_id: int, num_layers: int) -> None:
        for view in self._views:
            view.slot_begin(slot, task_id, num_layers)

    def slot_layer_done(self, slot: int, layers_done: int) -> None:
        now = time.monotonic_ns()
        for view in self._views:
            view.slot_layer_done(slot, layers_done, now)

    def slot_set_valid(self, slot: int, blocks_valid: int) -> None:
        for view in self._views:
            view.slot_set_valid(slot, blocks_valid)

    def slot_finish(self, slot: int, status: SlotStatus, blocks_valid: int) -> None:
        for view in self._views:
            view.slot_finish(slot, status, blocks_valid)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=1.0)
        self.dumps.close()
        # what clients' hang threshold must leave room for (docs/performance.md, "A daemon fault")
        log.info("[heartbeat] largest gap between beats: %.3f s", self.max_gap_s)
        self.set_flag(Flag.UP, False)
        for mm, view in self._made:
            view.release()
            mm.close()
        ino = segment_inode(self.name)
        if ino is None:
            log.warning("[shutdown] segment %s was already gone", self.name)
        elif ino == self._ino:  # (one another process put under the name is theirs)
            try:
                posix_ipc.unlink_shared_memory(self.name)
            except posix_ipc.ExistentialError:
                pass
