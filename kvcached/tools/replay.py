"""Trace replay: how many prefill tokens a host tier of a given capacity would have served.

Mooncake-format traces (one JSON object per line: `timestamp`, `input_length`,
`output_length`, `hash_ids`, each hash id naming one block *including its whole prefix*). For
each request: hit = leading blocks present x block tokens, capped at input_length; then the
blocks past the hit are offloaded (evicting per the policy when the capacity, in tokens, is
full): in one offload, or in parts as an engine saves them (`part_blocks`), each naming the
block before it (`linked`, protocol 1.15) or not (an engine before it: the comparison). In
process, the daemon's real BlockIndex does the work; `--through-daemon` sends the
same lookups and offloads to a real daemon over the real client.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ..host.index import BlockIndex
from ..host.policies import POLICIES, make_policy
from .offline_policies import OFFLINE_POLICIES
from .trace_keys import block_key

log = logging.getLogger(__name__)


@dataclass
class Request:
    input_length: int
    hash_ids: list[int]
    output_length: int = 0


def load_trace(path: str) -> list[Request]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
                out.append(Request(int(obj["input_length"]), [int(h) for h in obj["hash_ids"]],
                                   int(obj.get("output_length", 0))))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace record ({exc})") from None
    return out


@dataclass
class ReplayResult:
    capacity_tokens: int
    policy: str
    hit_rate: float
    hit_tokens: int
    input_tokens: int
    requests: int
    block_ops: int
    ops_per_s: float
    evictions: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def make_replay_policy(name: str, trace: list[Request]):
    """An online policy (the daemon's), or an offline reference prepared with the trace."""
    if name in OFFLINE_POLICIES:
        policy = OFFLINE_POLICIES[name]()
        policy.prepare(trace)
        return policy
    return make_policy(name)


def save_parts(keys: list, start: int, part_blocks: int) -> list[tuple[int, list]]:
    """The offloads an engine makes of keys[start:], past its hit: (first index, keys) of one
    offload, or of parts of part_blocks (vLLM saves each step's blocks: a long prompt's chunked
    prefill is several)."""
    step = part_blocks if part_blocks > 0 else max(1, len(keys) - start)
    return [(s, keys[s:s + step]) for s in range(start, len(keys), step)]


def replay_in_process(trace: list[Request], capacity_tokens: int, policy: str,
                      block_tokens: int = 512,
                      progress: Callable[[int, int], None] | None = None,
                      part_blocks: int = 0, linked: bool = True) -> ReplayResult:
    """`part_blocks`: the engine saves what follows a hit in offloads of at most this many
    blocks (0: one); `linked`: each names the block before it (protocol 1.15 `parent`: the
    hit's last, the earlier part's), else none (an engine before it)."""
    capacity_blocks = max(1, capacity_tokens // block_tokens)
    index = BlockIndex(make_replay_policy(policy, trace))
    used = 0
    hit_tokens = input_tokens = ops = 0
    started = time.perf_counter()
    block = 0  # host block ids are irrelevant here; a counter keeps them distinct
    for n, req in enumerate(trace):
        keys = [block_key(h) for h in req.hash_ids]
        index.note_request(keys)
        hits = index.prefix(keys)
        ops += len(keys)
        hit_tokens += min(len(hits) * block_tokens, req.input_length)
        input_tokens += req.input_length
        for first, part in save_parts(keys, len(hits), part_blocks):
            parent = keys[first - 1] if first and linked else None
            # as the daemon's offload does: the block it names, and the chain it extends, stay put
            up = index.get(parent) if parent else None
            held = [up] if up is not None else []
            index.pin(held)
            written = []
            for key in part:
                present = index.get(key)
                if present is not None:  # (only past a hole: a part that named no parent was
                    index.touch(present)  # left where its parent went) touched and held, as
                    index.pin([present])  # the daemon's offload does
                    held.append(present)
                    parent = key
                    continue
                if used >= capacity_blocks:
                    if not index.evict(1):
                        break  # the rest of the pool is this request's own chain: keep its head
                    used -= 1
                written.append(index.insert(key, block, parent))  # WRITING until the copy is done
                block += 1
                used += 1
                parent = key
                ops += 1
            for e in written:
                index.mark_ready(e)
            index.unpin(held)
        if progress is not None and n % 500 == 0:
            progress(n, len(trace))
    elapsed = time.perf_counter() - started
    return ReplayResult(capacity_tokens, policy, hit_tokens / max(1, input_tokens), hit_tokens,
                        input_tokens, len(trace), ops, ops / elapsed if elapsed else 0.0,
                        index.evictions)


def replay_through_daemon(trace: list[Request], capacity_tokens: int, policy: str,
                          block_tokens: int = 512,
                          progress: Callable[[int, int], None] | None = None,
                          part_blocks: int = 0, linked: bool = True) -> ReplayResult:
    """The same replay against a real daemon: a 1-layer KV whose block is 512 bytes, a host
    pool of exactly capacity_blocks pages, lookups and offloads through the real client.
    Online policies only: the daemon cannot see the trace's future."""
    if policy not in POLICIES:
        raise ValueError(f"{policy!r} is an offline reference policy: replay it in process")
    import shutil
    import tempfile

    import torch

    from kvcached_client import allocate_kv_cache, launch

    capacity_blocks = max(1, capacity_tokens // block_tokens)
    page = 512  # 1 layer x 1 part x 512 bytes: a block per token-block, small enough to be fast
    run_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    max_blocks = max(len(r.hash_ids) for r in trace)
    daemon = launch(instance=f"replay-{os.getpid()}", run_dir=run_dir,
                    host_cache_gb=capacity_blocks * page / 2**30 + 1e-9,
                    extra_args=["--eviction", policy, "--host-layout", "page_first"])
    hit_tokens = input_tokens = ops = 0
    try:
        with daemon.connect(name="replay", timeout=60) as c:
            kv = allocate_kv_cache(1, max_blocks, (page,), torch.uint8, kv_pair=False)
            c.register_kv_cache(kv)
            started = time.perf_counter()
            for n, req in enumerate(trace):
                keys = [block_key(h) for h in req.hash_ids]
                host, _ = c.lookup(keys)
                hit_tokens += min(host * block_tokens, req.input_length)
                input_tokens += req.input_length
                ops += len(keys)
                for first, part in save_parts(keys, host, part_blocks):
                    parent = keys[first - 1] if first and linked else None
                    c.offload(list(range(len(part))), part, parent=parent).wait(60)
                    ops += len(part)
                if progress is not None and n % 500 == 0:
                    progress(n, len(trace))
            elapsed = time.perf_counter() - started
            evictions = c.status()["host"]["evictions"]
            del kv
    finally:
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return ReplayResult(capacity_tokens, policy, hit_tokens / max(1, input_tokens), hit_tokens,
                        input_tokens, len(trace), ops, ops / elapsed if elapsed else 0.0, evictions)


def run(trace_path: str, capacities: Iterable[int], policies: Iterable[str],
        block_tokens: int = 512, through_daemon: bool = False,
        progress: Callable[[str], None] | None = None,
        part_blocks: int = 0, linked: bool = True) -> list[ReplayResult]:
    trace = load_trace(trace_path)
    fn = replay_through_daemon if through_daemon else replay_in_process
    results = []
    for policy in policies:
        for cap in capacities:
            def tick(n, total, _p=policy, _c=cap):
                if progress:
                    progress(f"[replay] {_p} @ {_c:,} tokens: {n}/{total} requests")
            results.append(fn(trace, cap, policy, block_tokens, tick, part_blocks, linked))
    return results
