"""Sweeping the POSIX KV segments of engines that died without unlinking them.

An engine's allocate_kv_cache unlinks its segments when their tensors are collected or the
process exits; a killed engine leaves them in /dev/shm (GBs each). The daemon sweeps a client's
segments once its process is gone - while running, and once more as it stops, so that stopping
the daemon right after an engine died does not leave that engine's memory behind.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

import posix_ipc

from kvcached_proto.liveness import pid_alive
from kvcached_proto.paths import kv_segment_prefix

log = logging.getLogger(__name__)


def sweep_kv_segments(pid: int) -> None:
    """Unlink the POSIX KV segments a dead engine left (its allocate_kv_cache would have)."""
    prefix = kv_segment_prefix(os.getuid(), pid)
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except OSError as exc:
        log.warning("[clients] cannot list /dev/shm to sweep pid %d's segments: %s", pid, exc)
        return
    for name in names:
        try:
            posix_ipc.unlink_shared_memory("/" + name)
            log.info("[clients] swept KV segment /%s of dead pid %d", name, pid)
        except posix_ipc.ExistentialError:
            log.debug("[clients] segment /%s already gone", name)
        except posix_ipc.PermissionsError:  # another uid's file under the engine's names
            log.warning("[clients] cannot remove /dev/shm/%s (not this user's): left", name)


def sweep_when_gone(dying: Iterable[int], connected: Iterable[int], grace_s: float) -> set[int]:
    """At shutdown: sweep the segments of every engine whose process is gone. `dying` closed
    their connections (a process being killed closes its sockets a moment before it is reaped):
    each gets up to grace_s, all together, to finish dying. `connected` are still connected:
    swept only if already dead. A live process keeps its segments. Returns the pids swept."""
    dying, connected = set(dying), set(connected)
    deadline = time.monotonic() + grace_s
    while any(pid_alive(p) for p in dying) and time.monotonic() < deadline:
        time.sleep(0.01)
    gone = {p for p in dying | connected if not pid_alive(p)}
    for pid in sorted(gone):
        sweep_kv_segments(pid)
    for pid in sorted(dying - gone):
        log.info("[shutdown] pid %d closed its connection but is still running: its KV "
                 "segments stay (it unlinks them itself)", pid)
    return gone
