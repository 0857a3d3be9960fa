"""Freed device blocks held back while a daemon may still write them.

A load or offload that timed out, or whose daemon hung, may still touch its device blocks
until the daemon confirms the task's end; its client then *holds* them (`Client.hold`). An
engine that frees such blocks hands them to a HoldKeeper instead of its free list: the keeper
gives back at once what no client holds, parks the rest, and gives parked blocks back once
their hold lifts. Holds of a connection the engine has replaced (a daemon restarted, a
reattach) keep holding: `retire` keeps that client until its holds lift, then closes it.
("Fence" names the order words only: cuda_order.py.)

Shared by PrefixCacheManager (device blocks) and the vLLM connector (staging blocks); a
GroupClient is one more source of holds (its ranks' clients and its own retired ones).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from kvcached_proto.errors import KvcachedError

log = logging.getLogger("kvcached.client")


class HoldKeeper:
    def __init__(self, give: Callable[[list[int]], None], current: Callable[[], object]):
        """give(blocks): back to the engine's free list; current(): the live client (or None)."""
        self._give = give
        self._current = current
        self.parked: set[int] = set()
        self.retired: list = []

    def _sources(self) -> list:
        client = self._current()
        return self.retired + ([client] if client is not None else [])

    def held(self) -> set[int]:
        """Every block some client holds now (reads pending task events; a daemon that does
        not answer keeps its holds as last known)."""
        out: set[int] = set()
        for client in self._sources():
            try:
                out |= client.held_blocks()
            except KvcachedError as exc:
                log.debug("[hold] check: %s", str(exc))
                out |= client.held_without_check
        return out

    def holding(self) -> bool:
        return bool(self.parked or self.retired or any(c.has_holds for c in self._sources()))

    def free(self, blocks: Iterable[int]) -> None:
        """Give back the blocks no client holds; park the others."""
        blocks = list(blocks)
        held = self.held() if self.holding() else set()
        self.parked.update(b for b in blocks if b in held)
        back = [b for b in blocks if b not in held]
        if back:
            self._give(back)

    def release(self) -> None:
        """Give back the parked blocks whose holds lifted; close retired clients that hold
        nothing any more (here, and a GroupClient's own: its lost ranks' clients, which keep
        their KV registered - a rank's successor cannot register while one is open)."""
        if not (self.parked or self.retired or getattr(self._current(), "retiring", False)):
            return
        free = self.parked - self.held()
        self.parked -= free
        if free:
            self._give(sorted(free))
        for client in [c for c in self.retired if not c.has_holds]:
            self.retired.remove(client)
            client.close()

    def retire(self, client) -> None:
        """A replaced connection: kept while it holds blocks, closed once it does not."""
        if client.has_holds:
            self.retired.append(client)
        else:
            client.close()

    def blocks(self) -> set[int]:
        """Parked blocks (for invariant checks)."""
        return set(self.parked)
