"""Scheduler-side lookups whose storage hits reach the host tier between steps, not in one.

A block the daemon holds only in a storage tier (disk, redis) would otherwise be read by the
load itself, inside the forward step that waits for its first layer. The gate asks the daemon
to prefetch such a hit into the host tier and defers the request: `match` answers None (vLLM:
get_num_new_matched_tokens' "ask again at a later step") until the prefetch ended, then the
hit is what the host tier holds, and the load that follows reads host memory only. What the
daemon does not bring in (a storage hit under its --prefetch-threshold-tokens, past its
--prefetch-max-share, a record that came back short, a prefetch it refuses because its queues
are full) is recomputed by the engine; the host part of the hit is loaded all the same.

Every call answers at once: a prefetch is polled, never waited for. One that has not ended by
its deadline (the daemon's own `timeout_ms`, plus a grace for its event: a hung daemon) gives
the request no hit. Requests whose storage hits overlap wait for each other's prefetches, so
one fetch serves them all (the daemon too fetches a key on its way only once, and a prefetch
ends only once the keys it waits on arrived or went).

storage_hits: "prefetch" (the above) or "inline" (the load reads storage in the step).

expect_s (a disaggregated deployment's decode instance, vLLM's kv_consumer): the prefill
instance stored the prompt's blocks, but its last ones may still be on their way to the shared
tier when the decode request comes. A hit short of every block asked for is asked for again at
later steps (None) for up to expect_s from the request's first lookup, then taken as it is.
Meanwhile the storage part it has is prefetched (in "prefetch" mode), so a wait that runs out
finds it in the host tier rather than starting its prefetch then.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from kvcached_proto.errors import KvcachedError, RequestError


@dataclass(eq=False)
class _Prefetch:
    task: object
    keys: list[bytes]   # the storage keys it brings (those not on their way already)
    deadline: float     # the daemon's timeout_ms plus a grace for its event


@dataclass(eq=False)
class _Pending:
    waits: list[_Prefetch]  # its own prefetch and those of requests it overlaps
    deadline: float
    host: int = 0  # the leading blocks the host tier had before the prefetch (or the wait)


def _ended(task) -> bool:
    try:
        return task.done()
    except KvcachedError:  # failed, or the daemon is gone: nothing more comes of it
        return True


class LookupGate:
    def __init__(self, block_tokens: int, storage_hits: str = "prefetch", timeout_s: float = 5.0,
                 grace_s: float = 2.0, counters: dict | None = None, expect_s: float = 0.0):
        if storage_hits not in ("prefetch", "inline"):
            raise ValueError(f"storage_hits {storage_hits!r}: expected prefetch or inline")
        if timeout_s <= 0:
            raise ValueError(f"prefetch timeout {timeout_s}: expected > 0 seconds")
        if not 0 <= expect_s < math.inf:  # (NaN or inf: every short hit deferred for ever)
            raise ValueError(f"consumer wait {expect_s}: expected a finite number of seconds >= 0")
        self.block_tokens = block_tokens
        self.storage_hits = storage_hits
        self.timeout_s, self.grace_s, self.expect_s = timeout_s, grace_s, expect_s
        self._expecting: dict[str, tuple[float, int]] = {}  # request -> its first lookup's
        # time and host hit (expect_s: blocks that reached the host tier since came from storage)
        self._warmed: dict[str, int] = {}  # request -> the storage hit prefetched during its wait
        self.counters = counters if counters is not None else {}
        for name in ("prefetches", "prefetch_deferrals", "prefetch_timeouts", "prefetch_refusals",
                     "storage_blocks_recomputed", "expected_deferrals", "expected_prefetches"):
            self.counters.setdefault(name, 0)
        self._pending: dict[str, _Pending] = {}
        self._running: list[_Prefetch] = []  # until it ended or its deadline passed
        self._inflight: dict[bytes, _Prefetch] = {}  # storage key -> the prefetch bringing it
        # of a request's hit, the blocks a storage tier supplied (prefetched while it waited,
        # or read inline), for per-tier hit statistics; kept until forget()
        self.from_storage: dict[str, int] = {}

    def match(self, req_id: str, client, keys: list[bytes]) -> int | None:
        """The number of leading `keys` the request may load from the host tier now, or None
        while a prefetch of its storage hit runs (ask again at the next step). client: a
        Client or GroupClient; its errors (KvcachedError) are the caller's to handle."""
        self._reap()
        pending = self._pending.get(req_id)
        if pending is not None:
            if not all(_ended(p.task) for p in pending.waits):
                if time.monotonic() < pending.deadline:
                    self.counters["prefetch_deferrals"] += 1
                    return None
                self.counters["prefetch_timeouts"] += 1  # the daemon is hung or far behind
                del self._pending[req_id]
                return 0
            del self._pending[req_id]
            host, storage = client.lookup(keys)
            self.counters["storage_blocks_recomputed"] += storage
            self.from_storage[req_id] = max(0, host - pending.host)
            return host
        host, storage = client.lookup(keys)
        if host + storage < len(keys) and self._still_expected(req_id, host):
            if storage > self._warmed.get(req_id, 0) and self.storage_hits == "prefetch":
                self._warmed[req_id] = storage  # what it has comes in meanwhile (asked again only
                if self._prefetch(client, keys, keys[host:host + storage]) is not None:  # for more)
                    self.counters["expected_prefetches"] += 1
            return None
        first = min(host, self._expecting.get(req_id, (0.0, host))[1])  # (prefetched meanwhile)
        self.from_storage[req_id] = host - first + (storage if self.storage_hits == "inline" else 0)
        if storage == 0 or self.storage_hits == "inline":
            return host + storage
        return self._start(req_id, client, keys, host, storage, first)

    def _start(self, req_id: str, client, keys, host: int, storage: int, first: int) -> int | None:
        wanted = keys[host:host + storage]
        waits = list({id(p): p for k in wanted if (p := self._inflight.get(k)) is not None}.values())
        own = self._prefetch(client, keys, wanted)
        if own is not None:
            waits.append(own)
        if not waits:
            self.counters["storage_blocks_recomputed"] += storage
            return host
        self._pending[req_id] = _Pending(waits, time.monotonic() + self.timeout_s + self.grace_s, first)
        self.counters["prefetches"] += 1
        return None

    def _prefetch(self, client, keys, wanted) -> _Prefetch | None:
        """A prefetch of `keys` past the host prefix for those of `wanted` not on their way
        already (in flight: later requests wait for it); None when there are none, or the
        daemon skipped or refused it."""
        new = [k for k in wanted if k not in self._inflight]
        if not new:
            return None
        try:
            task = client.prefetch(keys, policy="timeout", timeout_ms=int(self.timeout_s * 1000),
                                   block_tokens=self.block_tokens)
        except RequestError:  # refused (BUSY: queues full): the host hit stands, the
            self.counters["prefetch_refusals"] += 1  # storage part is recomputed
            return None
        if task is None or task.result is not None:  # skipped (under the threshold), refused
            return None
        own = _Prefetch(task, new, time.monotonic() + self.timeout_s + self.grace_s)
        self._running.append(own)
        self._inflight.update((k, own) for k in new)
        return own

    def _still_expected(self, req_id: str, host: int) -> bool:
        """expect_s: whether a short hit is asked for again (within expect_s of the request's
        first lookup; the first lookup is kept, so it waits once)."""
        if self.expect_s <= 0:
            return False
        now = time.monotonic()
        if now - self._expecting.setdefault(req_id, (now, host))[0] >= self.expect_s:
            return False
        self.counters["expected_deferrals"] += 1
        return True

    def _reap(self) -> None:
        """Prefetches that ended (their events taken) or are past their deadline stop being
        waited for by later requests."""
        now, running = time.monotonic(), []
        for p in self._running:
            if _ended(p.task) or now >= p.deadline:
                for k in p.keys:
                    if self._inflight.get(k) is p:
                        del self._inflight[k]
            else:
                running.append(p)
        self._running = running

    def forget(self, req_id: str) -> None:
        """The request is gone (finished, aborted): its prefetch goes on without a waiter (the
        blocks it brings serve later requests)."""
        self._pending.pop(req_id, None)
        self.from_storage.pop(req_id, None)
        self._expecting.pop(req_id, None)
        self._warmed.pop(req_id, None)

    def forget_all(self) -> None:
        """A cache reset: what was being matched is keyed under the old salt."""
        self._pending.clear()
        self.from_storage.clear()
        self._expecting.clear()
        self._warmed.clear()

    @property
    def pending(self) -> int:
        return len(self._pending)
