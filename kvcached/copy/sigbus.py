"""Client memory the daemon maps, guarded against SIGBUS (the handler is in _sigbus.c).

A client may shrink its KV segment under the daemon's mapping; without the guard the next copy
kills the daemon with SIGBUS. Guarded, the faulting mapping is replaced by zero pages and
counted: the copy that ran into it fails its task, and the registration is dead from then on.
"""
from __future__ import annotations

import faulthandler
import logging
import mmap
import sys

log = logging.getLogger(__name__)

try:
    from . import _sigbus
except ImportError:  # not built (an install without a C compiler): CPU KV is refused then
    _sigbus = None


def available() -> bool:
    return _sigbus is not None


def install() -> None:
    """Once per daemon: faulthandler first (a genuine crash leaves a traceback in the log), then
    the guard, which hands faults outside guarded mappings on to it. (`kill -USR1` is not
    faulthandler's: server/stack_dump.py.)"""
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    if _sigbus is not None:
        _sigbus.install()
    else:
        log.warning("[startup] kvcached.copy._sigbus is not built: KV registration is refused (CPU KV "
                    "and CUDA KV's order words are engine shared memory); reinstall with a C "
                    "compiler present")


class GuardedMap:
    """One guarded mapping: `faulted` turns True once an access ran past the segment's end."""

    def __init__(self, mm: mmap.mmap, length: int):
        if _sigbus is None:
            raise RuntimeError("kvcached.copy._sigbus is not built; reinstall with a C compiler")
        import numpy as np

        base = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data  # page-aligned mmap base
        self._slot = _sigbus.guard(base, length)

    @property
    def faulted(self) -> bool:
        return self._slot is not None and _sigbus.faults(self._slot) > 0

    def release(self) -> None:
        """Before the mapping is unmapped: the address range may be reused afterwards."""
        if self._slot is not None:
            _sigbus.unguard(self._slot)
            self._slot = None
