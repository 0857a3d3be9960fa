"""Freed device blocks held back while a daemon may still write them.

A load or offload that timed out, or whose daemon hung, may still touch its device blocks
until the daemon confirms the task's end; its client then *fences* them (`Client.fence`). An
engine that frees such blocks hands them to a FenceKeeper instead of its free list: the keeper
gives back at once what no client fences, parks the rest, and gives parked blocks back once
their fence lifts. Fences of a connection the engine has replaced (a daemon restarted, a
reattach) keep holding: `retire` keeps that client until its fences lift, then closes it.

Shared by PrefixCacheManager (device blocks) and the vLLM connector (staging blocks); a
GroupClient is one more source of fences (its ranks' clients and its own retired ones).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from kvcached_proto.errors import KvcachedError

log = logging.getLogger("kvcached.client")


class FenceKeeper:
    def __init__(self, give: Callable[[list[int]], None], current: Callable[[], object]):
        """give(blocks): back to the engine's free list; current(): the live client (or None)."""
        self._give = give
        self._current = current
        self.parked: set[int] = set()
        self.retired: list = []

    def _sources(self) -> list:
        client = self._current()
        return self.retired + ([client] if client is not None else [])

    def fenced(self) -> set[int]:
        """Every block some client fences now (reads pending task events; a daemon that does
        not answer keeps its fences as last known)."""
        out: set[int] = set()
        for client in self._sources():
            try:
                out |= client.fenced_blocks()
            except KvcachedError as exc:
                log.debug("[fence] check: %s", exc)
                out |= client.fenced_without_check
        return out

    def holds(self) -> bool:
        return bool(self.parked or self.retired or any(c.has_fences for c in self._sources()))

    def free(self, blocks: Iterable[int]) -> None:
        """Give back the blocks no client fences; park the others."""
        blocks = list(blocks)
        fenced = self.fenced() if self.holds() else set()
        self.parked.update(b for b in blocks if b in fenced)
        back = [b for b in blocks if b not in fenced]
        if back:
            self._give(back)

    def release(self) -> None:
        """Give back the parked blocks whose fences lifted; close retired clients that fence
        nothing any more."""
        if not (self.parked or self.retired):
            return
        free = self.parked - self.fenced()
        self.parked -= free
        if free:
            self._give(sorted(free))
        for client in [c for c in self.retired if not c.has_fences]:
            self.retired.remove(client)
            client.close()

    def retire(self, client) -> None:
        """A replaced connection: kept while it fences blocks, closed once it does not."""
        if client.has_fences:
            self.retired.append(client)
        else:
            client.close()

    def blocks(self) -> set[int]:
        """Parked blocks (for invariant checks)."""
        return set(self.parked)
