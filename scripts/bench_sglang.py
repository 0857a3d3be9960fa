#!/usr/bin/env python3
"""SGLang's batch_set_v1 / batch_get_v1 through kvcached against a raw memcpy of the same pages,
measured in the same run. Runs in .venv-sglang (./scripts/setup_sglang_env.sh):

    .venv-sglang/bin/python scripts/bench_sglang.py [--layout page_first] [--pages 64] [--json]

An SGLang MHA host pool (its own class, shm allocator) of a Llama-3-8B rank by default (32 layers,
8 KV heads of 128, bf16, 16-token pages: 2 MiB a page) is attached to a fresh daemon through
SGLang's backend factory. Each repetition backs up 64 pages under new keys (batch_set_v1: the
daemon copies them out of SGLang's pool into its host tier) and loads 64 stored pages into other
pages (batch_get_v1: back into the pool). Two baselines in the same run, each on one thread:
the same pages' chunks (the pointers and sizes of SGLang's get_page_buffer_meta) copied to a
buffer with one memmove each, and one memmove of as many contiguous bytes; ratios are against
the faster of the two, from medians over the repetitions. Every loaded page is checked.
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
    ap.add_argument("--layout", default="page_first", choices=["layer_first", "page_first", "page_first_direct"])
    ap.add_argument("--pages", type=int, default=64, help="pages per batch (SGLang's batches are <= 128)")
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


def run(args) -> dict:
    import sglang_pools as sp
    import torch

    from kvcached_client import launch

    sp.LAYERS, sp.HEADS, sp.HEAD_DIM, sp.PAGE = args.layers, args.heads, args.head_dim, args.page_size
    n = args.pages
    pool = sp.mha_pool(args.layout, device_tokens=(3 * n + 2) * args.page_size, ratio=1.0)
    sp.fill_random(pool, 1)
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.head_dim * 2
    batch = n * page_bytes
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    run_dir, instance = tempfile.mkdtemp(prefix="kvb-", dir="/tmp"), f"sgbench{os.getpid()}"
    chunks, whole = _memcpy_baselines(pool, src, batch)
    times = {"chunks": [], "whole": [], "set": [], "get": []}
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=(args.reps + 3) * batch / 2**30 * 1.2):
        backend = sp.attach(pool, sp.extra_config(instance, run_dir, timeout_s=60.0))
        stored = sp.page_hashes(n, seed=0)
        assert backend.batch_set_v1(stored, sp.pages_of(pool, src)) == [True] * n
        for rep in range(args.reps):
            times["chunks"].append(_timed(chunks))
            times["whole"].append(_timed(whole))
            keys = sp.page_hashes(n, seed=1000 + rep)
            ok = []
            times["set"].append(_timed(lambda: ok.append(backend.batch_set_v1(keys, sp.pages_of(pool, src)))))
            times["get"].append(_timed(lambda: ok.append(backend.batch_get_v1(stored, sp.pages_of(pool, dst)))))
            assert ok == [[True] * n] * 2, "a batch failed: raise the daemon's host tier"
        assert all(sp.page_bytes(pool, a) == sp.page_bytes(pool, b) for a, b in zip(src, dst))
        backend.close()
    gbps = {k: round(batch / statistics.median(v) / 1e9, 2) for k, v in times.items()}
    memcpy = max(gbps["chunks"], gbps["whole"])
    return {"layout": args.layout, "pages": n, "page_bytes": page_bytes, "batch_bytes": batch,
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
    print(f"SGLang host pool {out['layout']}, {out['pages']} pages of {out['page_bytes'] / 2**20:.2f} MiB "
          f"({out['batch_bytes'] / 2**20:.0f} MiB a batch), medians of {args.reps}; ratios against "
          "the faster memcpy")
    print(f"  memcpy, the pages' chunks one memmove each   {out['memcpy_chunks_gbps']:7.2f} GB/s")
    print(f"  memcpy, one memmove of as many bytes         {out['memcpy_whole_gbps']:7.2f} GB/s")
    print(f"  batch_set_v1 (pool -> daemon)  {out['set_gbps']:7.2f} GB/s  {out['set_ms']:8.2f} ms  "
          f"ratio {out['set_ratio']:.2f}")
    print(f"  batch_get_v1 (daemon -> pool)  {out['get_gbps']:7.2f} GB/s  {out['get_ms']:8.2f} ms  "
          f"ratio {out['get_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
