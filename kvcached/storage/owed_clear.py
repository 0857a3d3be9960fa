"""A remote store's clear that cannot be done when it is asked for (Redis, Mooncake).

A clear must leave nothing stored before it readable after it (a weight update's old KV). A
store that is down, stuck or failing then owes the clear: the backend serves nothing while
`_clear_owed` is set (its `_usable()` says so), and its probe calls `_clear_now()` once the
store answers, marking the tier healthy only after the clear is done. Clears run one at a time,
so a request's clear is never lost to the probe's. The owed state is logged once.

An owed clear outlives the daemon (OwedRecord, a file in its run dir): a daemon stopped or
killed while it is owed owes it again at its next start.

A backend using it sets `_clear_lock` (a Lock) and has `uri`, `last_error`, `_LOG_TAG` and
`_clear_store()`: how many blocks the store removed, or None when it could not (its failure
already recorded, e.g. the tier marked down).
"""
from __future__ import annotations

import logging
import os
import stat
import threading

log = logging.getLogger(__name__)


class OwesClears:
    _clear_owed = False
    _owed_said = False
    _owed_record: "OwedRecord | None" = None  # set by the tiers: the owed clears on disk
    _LOG_TAG = "storage"

    def owe_clear(self, record: "OwedRecord") -> None:
        """(At start, before any request.) Keep owed clears in record; one it holds for this
        tier (a clear a stopped daemon owed) is owed again, and done by the probe."""
        self._owed_record = record
        if record.owed(self.uri):
            self._clear_owed = True
            log.warning("[%s] %s: a clear owed before the restart is owed still", self._LOG_TAG,
                        self.uri)

    def clear(self) -> int:
        """Every block under the prefix goes now, or once the store answers again (owed)."""
        with self._clear_lock:
            self._clear_owed = True  # from here nothing stored before is read
            return self._clear_locked(self._healthy) or 0

    def _clear_now(self) -> bool:
        """(The probe, the store answering.) The owed clear; False while it stays owed."""
        with self._clear_lock:
            return not self._clear_owed or self._clear_locked(True) is not None

    def _clear_locked(self, reachable: bool) -> int | None:
        got = self._clear_store() if reachable else None
        if got is not None:
            self._clear_owed = self._owed_said = False
            if self._owed_record is not None:
                self._owed_record.note(self.uri, False)
            return got
        if self._owed_record is not None:
            self._owed_record.note(self.uri, True)
        if not self.last_error.startswith("a clear is owed"):
            self.last_error = (f"a clear is owed ({self.last_error or 'the store is down'}); "
                               "the tier serves nothing until the store has done it")
        if not self._owed_said:
            self._owed_said = True
            log.warning("[%s] %s: %s", self._LOG_TAG, self.uri, self.last_error)
        return None


class OwedRecord:
    """Which storage tiers owe a clear, kept in `{run_dir}/{instance}.clears-owed` (one URI per
    line, as status shows it: no password) for as long as they do, so a daemon stopped or killed
    meanwhile owes them too when it starts again: a store that comes back after the restart never
    serves what a clear removed. The run dir is the daemon's own (0700, checked at start); a file
    there that is no regular file of this user is not read."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._owed = set(self._read())

    def _read(self) -> list[str]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        except OSError as exc:  # a link (ELOOP), or unreadable: not ours to trust
            log.warning("[storage] %s not read: %s", self.path, exc.strerror or exc)
            return []
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                log.warning("[storage] %s is no file of this user: not read", self.path)
                return []
            return [line for line in f.read(1 << 20).decode(errors="replace").splitlines() if line]

    def owed(self, uri: str) -> bool:
        return uri in self._owed

    def note(self, uri: str, owed: bool) -> None:
        """Record (or drop) a tier's owed clear, on disk before this returns."""
        with self._lock:
            if (uri in self._owed) == owed:
                return
            (self._owed.add if owed else self._owed.discard)(uri)
            try:
                if not self._owed:
                    os.unlink(self.path)
                    return
                tmp = f"{self.path}.tmp"
                with open(tmp, "w") as f:
                    f.write("".join(f"{u}\n" for u in sorted(self._owed)))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except FileNotFoundError:
                pass  # nothing owed and no file
            except OSError as exc:  # the clear is still owed in this run; a restart may forget it
                log.warning("[storage] cannot record the owed clears in %s: %s", self.path,
                            exc.strerror or exc)
