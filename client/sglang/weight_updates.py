"""SGLang weight updates that name no version.

SGLang updates its weights in place through its scheduler's weight updater
(`update_weights_from_disk`, `_tensor`, `_distributed`, `_ipc`: what RL trainers call every
step). One that names a version changes SGLang's weight version, which is part of the page keys
(config.PageKeys), so nothing stored before is matched after it. One that names none, or names
the version already served, leaves the version as it was: the pages stored under the old weights
would be matched under the new ones, which is wrong KV. So those calls are watched: the updater
class's `update_weights_from_*` methods are wrapped once, when the first backend attaches. When
one returns (or raises), every backend in the process keys its pages anew: under the new
version, or under a new salt where the version was kept. Until SGLang's flush clears its host
pool (the flush the update makes unless told not to), backups are refused: the pool may hold
pages of the old weights.

The ranks of one server must agree on the salt: MLA ranks load what the writer rank stored. The
first rank of the updater's TP group draws it and broadcasts it over that group. That is the CPU
group SGLang's updater uses for its own barriers; every rank runs the same update call. Without
a group (one rank) the salt is drawn locally, and a broadcast that fails leaves each rank its
own (then MLA's other ranks miss; nothing is served wrong). A salt is random, never repeated: a
server restarted on its checkpoint matches what was stored under the checkpoint's keys, never
what an earlier run stored after an update. A backend that cannot re-key is closed (it
serves nothing more) rather than let the error into SGLang's update call.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
import weakref

from .config import sglang_weight_version

log = logging.getLogger("kvcached.sglang")
UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"

_backends: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()
_watching: bool | None = None  # None: not tried yet in this process
_salt = ""  # since the last update that kept the version (a backend attached later takes it)


def watch(backend) -> bool:
    """Tell `backend` (its `pool_clears`, `weights_replaced`) of the weight updates from now on.
    False where this SGLang has no weight updater to watch."""
    global _watching
    with _lock:
        _backends.add(backend)
        if _watching is None:
            _watching = _install()
        return _watching


def salt() -> str:
    """The salt of the weights served now: "" until an update keeps the version, and again
    after one names a new version."""
    return _salt


def _install() -> bool:
    try:
        cls = importlib.import_module(UPDATER).SchedulerWeightUpdaterManager
    except Exception as exc:  # another SGLang: its updater is elsewhere, or missing
        log.info("[sglang] weight updater not found (%s: %s)", type(exc).__name__, str(exc))
        return False
    names = [n for n, fn in vars(cls).items() if n.startswith("update_weights_from_") and callable(fn)]
    for name in names:
        fn = getattr(cls, name)
        if not getattr(fn, "_kvcached_watched", False):
            setattr(cls, name, _watched(fn))
    return bool(names)


def _watched(fn):
    @functools.wraps(fn)
    def update(self, *args, **kwargs):
        before = sglang_weight_version()
        backends = list(_backends)
        clears = [b.pool_clears for b in backends]
        try:
            return fn(self, *args, **kwargs)
        finally:  # a failed update may have loaded part of the weights
            global _salt
            after = sglang_weight_version()
            _salt = shared_salt(getattr(self, "tp_cpu_group", None)) if after == before else ""
            for backend, n in zip(backends, clears):
                _tell(backend, after, _salt, backend.pool_clears != n)

    update._kvcached_watched = True
    return update


def _tell(backend, version, salt, cleared: bool) -> None:
    """Re-key one backend. One that fails to is closed (every page a miss, no backups from
    then on) rather than left keying new weights' pages as the old ones', and SGLang's update
    call never sees the error."""
    try:
        backend.weights_replaced(version, salt, pool_cleared=cleared)
    except Exception as exc:
        log.error("[sglang] re-keying after a weight update failed (%s: %s): this backend is "
                  "closed, so it serves no page of the old weights", type(exc).__name__, str(exc))
        try:
            backend.close()  # drops its link first: from then on every call is a miss
        except Exception as err:
            log.error("[sglang] closing the backend: %s: %s", type(err).__name__, err)


def shared_salt(group) -> str:
    """A fresh salt, the same on every rank of `group` (its first rank's)."""
    salt = os.urandom(8).hex()
    try:
        import torch.distributed as dist

        if group is None or not dist.is_available() or not dist.is_initialized() \
                or dist.get_world_size(group) < 2:
            return salt
        box = [salt]
        dist.broadcast_object_list(box, group=group, group_src=0)
        return str(box[0])
    except Exception as exc:
        log.warning("[sglang] the salt after a weight update was not shared with the other "
                    "ranks (%s: %s): this rank keys its pages with its own", type(exc).__name__, str(exc))
        return salt
