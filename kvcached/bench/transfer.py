"""`kvcached bench transfer`: offload and layer-by-layer load through the real daemon vs memcpy.

A 7B-like layout (32 layers; K and V each [16, 8, 128] bf16 = 32 KiB per layer per tensor);
1,000 random device blocks are offloaded to the host tier and loaded back into other random
device blocks, timed from the request to the completion event (best of the repeats). The
baseline is one single-threaded libc memcpy of the same number of bytes between the same kinds
of memory, measured between the repeats (best of them). Also reported: the layer signal latency, from the daemon's counter write to the
moment a waiting client sees it.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from kvcached_client import allocate_kv_cache, launch

from .stats import percentiles_us, ratio

from .transfer_blocks import (
    BLOCK_SHAPE,
    LAYERS,
    _check,
    _fill,
    bench_kv,
)


class MemcpyBaseline:
    """Single-threaded libc memcpy of the same bytes between the same kinds of memory as the
    data path: a POSIX shared-memory buffer (where CPU-mode KV lives) and an anonymous mmap
    with MADV_HUGEPAGE (what the host pool is), both pre-touched."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._shm = allocate_kv_cache(1, 1, (nbytes,), torch.uint8, kv_pair=False)[0][0]
        self._shm.fill_(1)
        self._anon = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._anon.madvise(mmap.MADV_HUGEPAGE)
        self._anon_t = torch.frombuffer(self._anon, dtype=torch.uint8)
        self._anon_t.fill_(2)
        self.d2h, self.h2d = [], []

    def measure(self) -> None:
        shm, anon = self._shm.data_ptr(), self._anon_t.data_ptr()
        for dst, src, out in ((anon, shm, self.d2h), (shm, anon, self.h2d)):
            t0 = time.perf_counter()
            ctypes.memmove(dst, src, self.nbytes)
            out.append(self.nbytes / (time.perf_counter() - t0) / 1e9)


def run(quick: bool = False, device: str = "cpu", copy_strategy: str = "auto",
        kv_layout: str = "kvcached", **kwargs) -> dict:
    if device != "cpu":
        from .transfer_cuda import run as run_cuda

        return run_cuda(quick=quick, device=device, **kwargs)
    n = 200 if quick else 1000
    repeats = 2 if quick else 5
    num_blocks = n + n // 10
    page = LAYERS * 2 * int(np.prod(BLOCK_SHAPE)) * 2
    nbytes = n * page
    rng = np.random.default_rng(0)
    run_dir = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    daemon = launch(instance=f"bench-xfer-{os.getpid()}", run_dir=run_dir,
                    host_cache_gb=(n + 8) * page / 2**30,
                    extra_args=["--copy-strategy", copy_strategy])
    try:
        with daemon.connect(name="bench-transfer", timeout=120) as client:
            kv = bench_kv(kv_layout, num_blocks)
            strategy = client.register_kv_cache(kv)["copy_strategy"]
            offload_s, load_s, wakes, exact = [], [], [], True
            baseline = MemcpyBaseline(nbytes)
            for rep in range(repeats):
                baseline.measure()  # interleaved with the transfers: same machine conditions
                src = rng.permutation(num_blocks)[:n]
                dst = rng.permutation(num_blocks)[:n]
                keys = [os.urandom(16) for _ in range(n)]
                _fill(kv, src)
                t0 = time.perf_counter()
                client.offload(src, keys).wait(120)
                offload_s.append(time.perf_counter() - t0)
                _fill(kv, dst, salt=1)  # the targets hold other marks before the load
                t0 = time.perf_counter()
                task = client.load(keys, dst)
                for layer in range(LAYERS):
                    task.wait_layer(layer, timeout=120)
                loaded = task.wait(120)
                load_s.append(time.perf_counter() - t0)
                wakes += task.layer_wake_ns
                exact &= loaded == n and _check(kv, dst, src)
                client.clear()
            del kv
    finally:
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    memcpy_d2h, memcpy_h2d = max(baseline.d2h), max(baseline.h2d)
    off_gbps = nbytes / min(offload_s) / 1e9
    load_gbps = nbytes / min(load_s) / 1e9
    return {
        "bench": "transfer", "device": device, "copy_strategy": strategy, "blocks": n, "bytes": nbytes,
        "layout": f"{LAYERS} layers x (K, V) {list(BLOCK_SHAPE)} bf16", "kv_layout": kv_layout,
        "repeats": repeats,
        "memcpy_d2h_gbps": round(memcpy_d2h, 2), "memcpy_h2d_gbps": round(memcpy_h2d, 2),
        "offload_gbps": round(off_gbps, 2), "offload_ratio": ratio(off_gbps, memcpy_d2h),
        "load_gbps": round(load_gbps, 2), "load_ratio": ratio(load_gbps, memcpy_h2d),
        "layer_signal": percentiles_us(np.array(wakes) / 1e9) if wakes else None,
        "bytes_exact": bool(exact), "torch_threads": torch.get_num_threads(),
        "target": {"ratio_min": 0.6, "layer_signal_p50_us_max": 50},
    }


def format_result(r: dict) -> str:
    sig = r["layer_signal"] or {"p50_us": float("nan"), "p99_us": float("nan"), "n": 0}
    return "\n".join([
        f"{r['blocks']} random blocks, {r['layout']} (KV layout {r.get('kv_layout', 'kvcached')}), "
        f"{r['bytes'] / 2**30:.2f} GiB per direction, copy strategy {r.get('copy_strategy', 'numpy')}",
        f"{'':<10} {'GB/s':>8} {'memcpy GB/s':>12} {'ratio':>6}",
        f"{'offload':<10} {r['offload_gbps']:>8.2f} {r['memcpy_d2h_gbps']:>12.2f} "
        f"{r['offload_ratio']:>6.2f}   (device -> host)",
        f"{'load':<10} {r['load_gbps']:>8.2f} {r['memcpy_h2d_gbps']:>12.2f} "
        f"{r['load_ratio']:>6.2f}   (host -> device, layer by layer)",
        "memcpy: one single-threaded libc memcpy of the same bytes, same memory kinds, same run",
        f"layer signal latency: p50 {sig['p50_us']:.1f} us, p99 {sig['p99_us']:.1f} us over "
        f"{sig['n']} layer waits; bytes exact: {r['bytes_exact']}",
        f"targets: ratio >= {r['target']['ratio_min']}, layer signal p50 <= "
        f"{r['target']['layer_signal_p50_us_max']} us",
    ])
