"""Offline reference policies for trace replay: they read the whole trace before it is played,
so they are not eviction policies a daemon can run; they bound what an online policy can reach.

- `belady`: evict the leaf whose key is requested farthest in the future (the offline optimum
  the traces README lists).
- `oracle-reuse`: knows exactly which blocks are requested again within the next
  REUSE_HORIZON requests; those stay under LRU, every other block goes first. A perfect
  "will it be reused soon" predictor put in front of LRU.
- `oracle-features`: what an online policy could learn at best from the history it can see.
  For every request of every block it takes the features an online policy has (requests of the
  block so far, in the last 128 / 512 / 2,048 requests, the request's output length class) and
  fits, *on the whole trace*, the share of those occurrences requested again within
  REUSE_HORIZON requests; a block then ranks FEATURE_TURNOVERS x that share cache turnovers
  ahead of its last use. A predictor fitted on the very trace it is scored on is an upper bound
  for any predictor learned online from the same features.

Each is prepared with `prepare(trace)` (the replay's Request list) and counts requests through
`on_request`, which the replay calls once per request, before its lookup.
"""
from __future__ import annotations

import bisect
import collections
import math

from ..host.policies import EvictionPolicy
from .trace_keys import block_key

REUSE_HORIZON = 400  # requests
FEATURE_TURNOVERS = 30
WINDOWS = (128, 512, 2048)


class FutureKnowledge(EvictionPolicy):
    """Base: a key's request indices in the whole trace, and the index of the current one."""

    def __init__(self):
        self.uses: dict[bytes, list[int]] = {}
        self.now_req = -1

    def prepare(self, trace) -> None:
        uses = collections.defaultdict(list)
        for n, req in enumerate(trace):
            for h in req.hash_ids:
                uses[block_key(h)].append(n)
        self.uses = dict(uses)
        self.now_req = -1

    def on_request(self, keys) -> None:
        self.now_req += 1

    def next_use(self, key: bytes) -> int | None:
        u = self.uses.get(key, ())
        j = bisect.bisect_right(u, self.now_req)
        return u[j] if j < len(u) else None


class Belady(FutureKnowledge):
    name = "belady"

    def priority(self, e) -> float:
        nxt = self.next_use(e.key)
        return -(nxt if nxt is not None else math.inf)


class OracleReuse(FutureKnowledge):
    name = "oracle-reuse"

    def priority(self, e) -> float:
        nxt = self.next_use(e.key)
        soon = nxt is not None and nxt - self.now_req <= REUSE_HORIZON
        return e.last if soon else e.last - 1e15


def _features(uses: list[int], j: int, at: int, output_length: int) -> tuple:
    """Features of a block requested at request `at`, its j-th request (0-based)."""
    windows = tuple(min(j + 1 - bisect.bisect_left(uses, at - w), cap)
                    for w, cap in zip(WINDOWS, (4, 6, 8)))
    out_class = min(int(math.log2(max(1, output_length))), 9) // 3
    return (*windows, out_class, min(j + 1, 8))


class OracleFeatures(FutureKnowledge):
    name = "oracle-features"

    def prepare(self, trace) -> None:
        super().prepare(trace)
        self.outputs = [req.output_length for req in trace]
        counts: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
        for u in self.uses.values():
            for j, at in enumerate(u):
                c = counts[_features(u, j, at, self.outputs[at])]
                c[0] += 1
                c[1] += j + 1 < len(u) and u[j + 1] - at <= REUSE_HORIZON
        self.share = {f: soon / n for f, (n, soon) in counts.items()}

    def priority(self, e) -> float:
        u = self.uses.get(e.key)
        if not u:
            return e.last
        j = bisect.bisect_right(u, self.now_req) - 1
        if j < 0:
            return e.last
        p = self.share[_features(u, j, u[j], self.outputs[u[j]])]
        return e.last + FEATURE_TURNOVERS * max(len(self.index), 1) * p


OFFLINE_POLICIES: dict[str, type[FutureKnowledge]] = {
    "belady": Belady, "oracle-reuse": OracleReuse, "oracle-features": OracleFeatures}
