"""A remote store's clear that cannot be done when it is asked for (Redis, Mooncake).

A clear must leave nothing stored before it readable after it (a weight update's old KV). A
store that is down, stuck or failing then owes the clear: the backend serves nothing while
`_clear_owed` is set (its `_usable()` says so), and its probe calls `_clear_now()` once the
store answers, marking the tier healthy only after the clear is done. Clears run one at a time,
so a request's clear is never lost to the probe's. The owed state is logged once.

A backend using it sets `_clear_lock` (a Lock) and has `uri`, `last_error`, `_LOG_TAG` and
`_clear_store()`: how many blocks the store removed, or None when it could not (its failure
already recorded, e.g. the tier marked down).
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class OwesClears:
    _clear_owed = False
    _owed_said = False
    _LOG_TAG = "storage"

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
            return got
        if not self.last_error.startswith("a clear is owed"):
            self.last_error = (f"a clear is owed ({self.last_error or 'the store is down'}); "
                               "the tier serves nothing until the store has done it")
        if not self._owed_said:
            self._owed_said = True
            log.warning("[%s] %s: %s", self._LOG_TAG, self.uri, self.last_error)
        return None
