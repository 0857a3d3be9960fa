#!/usr/bin/env python3
"""SGLang's batch_set_v1 / batch_get_v1 through kvcached against a raw memcpy of the same pages,
measured in the same run. Runs in .venv-sglang (./scripts/setup_sglang_env.sh):

    .venv-sglang/bin/python scripts/bench_sglang.py [--layout page_first] [--pages 64] [--json]
    .venv-sglang/bin/python scripts/bench_sglang.py --pool mamba [--pages 8]

An SGLang MHA host pool (its own class, shm allocator) of a Llama-3-8B rank by default (32 layers,
8 KV heads of 128, bf16, 16-token pages: 2 MiB a page) is attached to a fresh daemon through
SGLang's backend factory. Each repetition backs up 64 pages under new keys (batch_set_v1: the
daemon copies them out of SGLang's pool into its host tier) and loads 64 stored pages into other
pages (batch_get_v1: back into the pool). Two baselines in the same run, each on one thread:
the same pages' chunks (the pointers and sizes of SGLang's get_page_buffer_meta) copied to a
buffer with one memmove each, and one memmove of as many contiguous bytes; ratios are against
the faster of the two, from medians over the repetitions. Every loaded page is checked.

--pool mamba: the same with SGLang's Mamba host pool of a Qwen3-Next-80B rank at TP 4 by default
(36 gated-delta-net layers, a float32 state of 8 heads of 128 x 128 and a bfloat16 conv state of
2048 x 3 per layer: 18 MiB a slot), paged by batch_set_v2 / batch_get_v2 through a daemon of its
own beside the KV pool's.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "sglang_hicache"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", default="kv", choices=["kv", "mamba"],
                    help="the KV pool (v1 calls) or a hybrid model's Mamba pool (v2 calls)")
    ap.add_argument("--layout", default="page_first", choices=["layer_first", "page_first", "page_first_direct"])
    ap.add_argument("--pages", type=int, default=None,
                    help="pages per batch (default 64; SGLang's batches are <= 128), Mamba slots (default 8)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


def _memcpy_baselines(pool, pages, batch_bytes):
    """Two raw copies of the batch's bytes: the pages' chunks one memmove each (what SGLang's
    get_page_buffer_meta names), and one memmove of as many contiguous bytes."""
    import numpy as np
    import sglang_pools as sp

    ptrs, sizes = pool.get_page_buffer_meta(sp.pages_of(pool, pages))
    sink, flat = np.empty(batch_bytes, dtype=np.uint8), np.empty(batch_bytes, dtype=np.uint8)
    flat[:] = 1
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()

    def chunks():
        for p, s, o in zip(ptrs, sizes, offsets):
            ctypes.memmove(sink.ctypes.data + o, p, s)

    def whole():
        ctypes.memmove(sink.ctypes.data, flat.ctypes.data, batch_bytes)
    return chunks, whole


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _pools(args, n: int):
    """(the pool benchmarked, the KV pool to attach with, page bytes)."""
    import sglang_pools as sp

    if args.pool == "mamba":
        kv = sp.mha_pool("page_first", device_tokens=64, ratio=1.0)
        pool = sp.mamba_pool(slots=2 * n + 2, layers=36, temporal=(8, 128, 128), conv=((2048, 3),))
        sp.fill_mamba(pool, 1)
    else:
        kv = pool = sp.mha_pool(args.layout, device_tokens=(3 * n + 2) * args.page_size, ratio=1.0)
        sp.fill_random(pool, 1)
    return pool, kv, len(sp.page_bytes(pool, 0))


def _calls(backend, pool, name: str):
    """set(keys, pages) and get(keys, pages): the v1 calls for the KV pool, the v2 ones else,
    each a list of per-page results."""
    import sglang_pools as sp

    if name == "kv":
        return (lambda keys, pages: backend.batch_set_v1(keys, sp.pages_of(pool, pages)),
                lambda keys, pages: backend.batch_get_v1(keys, sp.pages_of(pool, pages)))
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    def v2(call):
        return lambda keys, pages: call([PoolTransfer(name=PoolName(name), keys=keys,
                                                      host_indices=sp.pages_of(pool, pages))])[PoolName(name)]
    return v2(backend.batch_set_v2), v2(backend.batch_get_v2)


def run(args) -> dict:
    import sglang_pools as sp
    import torch

    from kvcached_client import launch

    sp.LAYERS, sp.HEADS, sp.HEAD_DIM, sp.PAGE = args.layers, args.heads, args.head_dim, args.page_size
    n = args.pages or (8 if args.pool == "mamba" else 64)
    pool, kv, page_bytes = _pools(args, n)
    batch = n * page_bytes
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    run_dir, instance = tempfile.mkdtemp(prefix="kvb-", dir="/tmp"), f"sgbench{os.getpid()}"
    chunks, whole = _memcpy_baselines(pool, src, batch)
    times = {"chunks": [], "whole": [], "set": [], "get": []}
    gb = (args.reps + 3) * batch / 2**30 * 1.2
    side = [launch(instance=f"{instance}-mamba", run_dir=run_dir, host_cache_gb=gb)] if args.pool == "mamba" else []
    try:
        with launch(instance=instance, run_dir=run_dir, host_cache_gb=gb if not side else 0.05):
            extra = sp.extra_config(instance, run_dir, timeout_s=60.0)
            backend = sp.attach_hybrid(kv, {"mamba": pool} if side else {}, extra)
            set_pages, get_pages = _calls(backend, pool, args.pool)
            stored = sp.page_hashes(n, seed=0)
            assert set_pages(stored, src) == [True] * n
            for rep in range(args.reps):
                times["chunks"].append(_timed(chunks))
                times["whole"].append(_timed(whole))
                keys = sp.page_hashes(n, seed=1000 + rep)
                ok = []
                times["set"].append(_timed(lambda: ok.append(set_pages(keys, src))))
                times["get"].append(_timed(lambda: ok.append(get_pages(stored, dst))))
                assert ok == [[True] * n] * 2, "a batch failed: raise the daemon's host tier"
            assert all(sp.page_bytes(pool, a) == sp.page_bytes(pool, b) for a, b in zip(src, dst))
            backend.close()
    finally:
        for handle in side:
            handle.stop()
    gbps = {k: round(batch / statistics.median(v) / 1e9, 2) for k, v in times.items()}
    memcpy = max(gbps["chunks"], gbps["whole"])
    return {"pool": args.pool, "layout": pool.layout, "pages": n, "page_bytes": page_bytes, "batch_bytes": batch,
            "torch_threads": torch.get_num_threads(), "memcpy_chunks_gbps": gbps["chunks"],
            "memcpy_whole_gbps": gbps["whole"], "set_gbps": gbps["set"], "get_gbps": gbps["get"],
            "set_ms": round(statistics.median(times["set"]) * 1e3, 2),
            "get_ms": round(statistics.median(times["get"]) * 1e3, 2),
            "set_ratio": round(gbps["set"] / memcpy, 2), "get_ratio": round(gbps["get"] / memcpy, 2)}


def main() -> int:
    args = _args()
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"SGLang {out['pool']} host pool {out['layout']}, {out['pages']} pages of {out['page_bytes'] / 2**20:.2f} MiB "
          f"({out['batch_bytes'] / 2**20:.0f} MiB a batch), medians of {args.reps}; ratios against "
          "the faster memcpy")
    print(f"  memcpy, the pages' chunks one memmove each   {out['memcpy_chunks_gbps']:7.2f} GB/s")
    print(f"  memcpy, one memmove of as many bytes         {out['memcpy_whole_gbps']:7.2f} GB/s")
    v = "v1" if out["pool"] == "kv" else "v2"
    print(f"  batch_set_{v} (pool -> daemon)  {out['set_gbps']:7.2f} GB/s  {out['set_ms']:8.2f} ms  "
          f"ratio {out['set_ratio']:.2f}")
    print(f"  batch_get_{v} (daemon -> pool)  {out['get_gbps']:7.2f} GB/s  {out['get_ms']:8.2f} ms  "
          f"ratio {out['get_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
