"""Host pages lent to storage I/O that missed its deadline (the storage flow's): a fetched block
is not freed, a backed-up block stays pinned, until the I/O returns, however late."""
from __future__ import annotations

import itertools
import threading


class IOLoans:
    """Host pages lent to storage I/O that missed its deadline. `lend(token, then)` after the
    call returned; `returned(token)` from the I/O thread once the I/O ends: `then()` runs
    exactly once, when both happened (lend returns False when the I/O was back already: the
    caller does then's work itself)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._out: dict = {}
        self._back: set = set()
        self._calls = itertools.count()

    def tokens(self):
        """A release callback for one storage call, and its tokens: (call, position)."""
        call = next(self._calls)
        return (lambda i: self.returned((call, i))), (lambda i: (call, i))

    def lend(self, token, then) -> bool:
        with self._lock:
            if token in self._back:
                self._back.discard(token)
                return False
            self._out[token] = then
            return True

    def returned(self, token) -> None:
        with self._lock:
            then = self._out.pop(token, None)
            if then is None:
                self._back.add(token)
                return
        then()

    def __len__(self) -> int:
        return len(self._out)
