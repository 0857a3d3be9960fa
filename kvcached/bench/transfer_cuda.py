"""`kvcached bench transfer --device cuda:N`: the CUDA path against the copy engine's limit.

Every figure is a ratio to a contiguous pinned cudaMemcpy of the same bytes, measured in the
same run (best of the repeats, timed with CUDA events):
1. strategies side by side (runs, gather, zero_copy, dma) in process, through the daemon's own
   copier and pinned host pool, for two cases: 7B-like per-layer blocks (32 layers x (K, V)
   x 32 KiB, scattered device ids) and cross-layer contiguous blocks (one 2 MiB tensor row
   per block); bytes checked after every strategy;
2. the real daemon (`--device cuda:N`), once per daemon strategy (auto, dma, and dma with
   `--dma-threads` 4 unless `kvcached bench --dma-threads 1`), offloading and
   loading layer by layer from this process's CUDA KV, bytes checked;
3. overlap, per daemon strategy: a synthetic 32-layer forward (matmuls sized like a 7B layer)
   that waits for each layer's load (counter + stream wait on the order word) against the same
   forward alone, with the load sized to fit in the compute time; and the same forward while
   an offload of as many other blocks runs beside it;
4. the time to pin the host pool (mmap + cudaHostRegister in chunks).

Written without a GPU at hand: run it with scripts/gpu_check.sh on a CUDA machine.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import torch

from kvcached_client import allocate_kv_cache, launch
from kvcached_client.kv_alloc import describe_kv_cache
from kvcached_proto.layout import parse_layout

from ..copy.cuda_copier import CudaCopier
from ..copy.strategies import STRATEGIES
from ..copy.transfer import TaskKind
from ..host.pool import HostPool
from .stats import ratio
from .transfer_blocks import BLOCK_SHAPE, DTYPE, LAYERS, _check, _fill

CROSS_LAYER_BYTES = LAYERS * 2 * 32 * 1024
HIDDEN, QKV, FFN = 4096, 3 * 4096, 11008


class PinnedMemcpy:
    """The baseline: one contiguous copy of `nbytes` between device memory and pinned host
    memory, each direction timed with CUDA events."""

    def __init__(self, nbytes: int, device: torch.device):
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.d2h, self.h2d = [], []

    def measure(self) -> None:
        for dst, src, out in ((self.host, self.dev, self.d2h), (self.dev, self.host, self.h2d)):
            out.append(self.dev.numel() / _timed(lambda: dst.copy_(src, non_blocking=True)) / 1e9)


def _timed(fn, stream=None) -> float:
    """Seconds between CUDA events around fn's work on `stream` (current by default)."""
    stream = stream or torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _case_kv(case: str, num_blocks: int, device):
    if case == "per_layer":
        return allocate_kv_cache(LAYERS, num_blocks, BLOCK_SHAPE, DTYPE, device=device)
    return allocate_kv_cache(1, num_blocks, (CROSS_LAYER_BYTES,), torch.uint8, device=device,
                             kv_pair=False)


def _strategies(device, n: int, repeats: int, baseline: PinnedMemcpy) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for case in ("per_layer", "cross_layer"):
        num_blocks = 2 * n + 8
        kv = _case_kv(case, num_blocks, device)
        for layer in kv:
            for t in (layer if isinstance(layer, tuple) else (layer,)):
                t.view(torch.uint8).random_(0, 256)
        spec = parse_layout(describe_kv_cache(kv))
        pool = HostPool(int(spec.page_bytes * (n + 8)), str(device))
        pool.configure(spec)
        dev_views = [[t.view(torch.uint8).view(num_blocks, -1)
                      for t in (layer if isinstance(layer, tuple) else (layer,))] for layer in kv]
        perm = rng.permutation(num_blocks).astype(np.int64)
        dev_ids, back_ids = perm[:n], perm[n:2 * n]  # loads go to other blocks than the source
        host_ids = np.arange(n, dtype=np.int64)  # what a fresh allocator hands out
        src_idx, back_idx = torch.from_numpy(dev_ids).to(device), torch.from_numpy(back_ids).to(device)
        nbytes = n * spec.page_bytes
        for strategy in STRATEGIES:
            copier = CudaCopier(dev_views, pool, strategy, str(device), spec.num_layers)
            for row in dev_views:
                for a in row:
                    a[back_idx] = 0  # what an earlier strategy loaded there must not count
            off, load = [], []
            for _ in range(repeats):
                baseline.measure()
                plan = copier.plan(TaskKind.OFFLOAD, dev_ids, host_ids)
                off.append(_timed(lambda: [copier.offload_layer(i, plan) for i in range(spec.num_layers)],
                                  copier.streams[TaskKind.OFFLOAD]))
                plan = copier.plan(TaskKind.LOAD, back_ids, host_ids)
                load.append(_timed(lambda: [copier.load_layer(i, plan) for i in range(spec.num_layers)],
                                   copier.streams[TaskKind.LOAD]))
            exact = all(torch.equal(a[back_idx], a[src_idx]) for row in dev_views for a in row)
            copier.close()
            d2h, h2d = nbytes / min(off) / 1e9, nbytes / min(load) / 1e9
            rows.append({"case": case, "strategy": strategy, "blocks": n, "bytes": nbytes,
                         "d2h_gbps": round(d2h, 2), "d2h_ratio": ratio(d2h, max(baseline.d2h)),
                         "h2d_gbps": round(h2d, 2), "h2d_ratio": ratio(h2d, max(baseline.h2d)),
                         "bytes_exact": bool(exact)})
        pool.close()
        del kv, dev_views
        torch.cuda.empty_cache()
    return rows


class Forward:
    """A 32-layer forward with 7B-sized matmuls over `tokens` rows; each layer also reads its
    loaded KV blocks (what attention would do), so it depends on the load's bytes."""

    def __init__(self, tokens: int, device):
        g = torch.Generator(device=device).manual_seed(0)
        mk = lambda *s: torch.randn(*s, device=device, dtype=DTYPE, generator=g) / 64  # noqa: E731
        self.w = (mk(HIDDEN, QKV), mk(HIDDEN, HIDDEN), mk(HIDDEN, FFN), mk(FFN, HIDDEN))
        self.x = mk(tokens, HIDDEN)
        self.acc = torch.zeros((), device=device, dtype=torch.float32)

    def layer(self, kv_layer, idx) -> None:
        wqkv, wo, wup, wdown = self.w
        h = self.x @ wqkv
        y = h[:, :HIDDEN] @ wo
        u = y @ wup
        self.x = (u @ wdown).clamp_(-4, 4)
        for t in kv_layer:
            self.acc += t[idx].float().mean()


def _daemon_runs(device, n: int, repeats: int, baseline: PinnedMemcpy, run_dir: str,
                 strategy: str, dma_threads: int = 1) -> dict:
    rng = np.random.default_rng(1)
    num_blocks = n + n // 4
    page = LAYERS * 2 * int(np.prod(BLOCK_SHAPE)) * 2
    # room for every block of the KV (the overlap case loads up to num_blocks of them)
    daemon = launch(instance=f"bench-cuda-{os.getpid()}-{strategy}-{dma_threads}", run_dir=run_dir,
                    host_cache_gb=(num_blocks + 8) * page / 2**30, device=str(device),
                    extra_args=["--copy-strategy", strategy, "--dma-threads", str(dma_threads)])
    try:
        with daemon.connect(name="bench-transfer-cuda", timeout=300) as client:
            kv = allocate_kv_cache(LAYERS, num_blocks, BLOCK_SHAPE, DTYPE, device=device)
            reply = client.register_kv_cache(kv)
            off_s, load_s, exact = [], [], True
            for _ in range(repeats):
                baseline.measure()
                src, dst = rng.permutation(num_blocks)[:n], rng.permutation(num_blocks)[:n]
                keys = [os.urandom(16) for _ in range(n)]
                _fill(kv, src)  # queued on the current stream: the offload waits for it on the GPU
                t0 = time.perf_counter()
                client.offload(src, keys).wait(120)
                off_s.append(time.perf_counter() - t0)
                _fill(kv, dst, salt=1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                task = client.load(keys, dst)
                for layer in range(LAYERS):
                    task.wait_layer(layer, timeout=120)
                loaded = task.wait(120)
                torch.cuda.synchronize()
                load_s.append(time.perf_counter() - t0)
                exact &= loaded == n and _check(kv, dst, src)
                client.clear()
            phases = _phases_ms(client.status()["tasks"].get("copy_phases", {}))
            overlap = _overlap(client, kv, num_blocks, device, rng)
    finally:
        daemon.stop()
    nbytes = n * page
    d2h, h2d = nbytes / min(off_s) / 1e9, nbytes / min(load_s) / 1e9
    return {"blocks": n, "bytes": nbytes, "strategy": reply.get("copy_strategy"), "dma_threads": dma_threads,
            "offload_gbps": round(d2h, 2), "offload_ratio": ratio(d2h, max(baseline.d2h)),
            "load_gbps": round(h2d, 2), "load_ratio": ratio(h2d, max(baseline.h2d)),
            "bytes_exact": bool(exact), "phases_ms": phases, "overlap": overlap}


def _since(before: dict, after: dict) -> dict:
    """The copy phases of the tasks that ended between two status readings."""
    return {op: {k: v - before.get(op, {}).get(k, 0) for k, v in p.items()} for op, p in after.items()}


def _phases_ms(copy_phases: dict) -> dict:
    """The daemon's mean time per offload and load task: waiting for its copy worker, queueing
    the copies (the CPU's share: CUDA calls), then until they landed (status tasks.copy_phases)."""
    return {op: {k: round(p[f"{k}_s"] / p["tasks"] * 1e3, 2)
                 for k in ("wait", "queue", "prepare", "land", "first_layer") if f"{k}_s" in p}
            for op, p in copy_phases.items() if p.get("tasks")}


def _overlap(client, kv, num_blocks: int, device, rng) -> dict:
    fwd = Forward(2048, device)
    idx_all = torch.arange(num_blocks, device=device)
    for _ in range(2):  # warm-up: cuBLAS handles and kernels
        for layer in range(LAYERS):
            fwd.layer(kv[layer], idx_all[:8])
    torch.cuda.synchronize()
    per_layer = _timed(lambda: fwd.layer(kv[0], idx_all[:8]))
    bw = 25e9  # a conservative host -> device rate for sizing; the measured one is reported apart
    page_layer = 2 * int(np.prod(BLOCK_SHAPE)) * 2
    n = int(min(num_blocks, max(16, 0.5 * per_layer * bw / page_layer)))
    src, dst = rng.permutation(num_blocks)[:n], rng.permutation(num_blocks)[:n]
    keys = [os.urandom(16) for _ in range(n)]
    _fill(kv, src)
    client.offload(src, keys).wait(120)
    _fill(kv, dst, salt=1)
    idx = torch.from_numpy(dst).to(device)
    torch.cuda.synchronize()
    alone, with_load, first_layer, request, layer0, wake0, exact = [], [], [], [], [], [], True
    phases_before = client.status()["tasks"].get("copy_phases", {})
    for _ in range(3):
        alone.append(_timed(lambda: [fwd.layer(kv[i], idx) for i in range(LAYERS)]))

        tasks = []

        def overlapped():
            t0 = time.perf_counter()
            tasks.append(client.load(keys, dst))
            request.append(time.perf_counter() - t0)
            for i in range(LAYERS):
                t1, woken = time.perf_counter(), len(tasks[-1].layer_wake_ns)
                tasks[-1].wait_layer(i, timeout=120)  # counter, then this stream waits on the event
                if i == 0:
                    first_layer.append(time.perf_counter() - t0)
                    layer0.append(first_layer[-1] - (t1 - t0))
                    # the daemon's count to this process seeing it (when the wait began first)
                    wake0.extend(tasks[-1].layer_wake_ns[woken:])
                fwd.layer(kv[i], idx)
        with_load.append(_timed(overlapped))  # the end event follows the last layer's kernels
        exact &= tasks[-1].wait(120) == n
    in_daemon = _phases_ms(_since(phases_before, client.status()["tasks"].get("copy_phases", {})))
    exact &= _check(kv, dst, src)
    with_offload, stored = _beside_offload(client, fwd, kv, dst, idx)
    return {"tokens": 2048, "layer_ms": round(per_layer * 1e3, 3), "blocks": n,
            "forward_ms": round(min(alone) * 1e3, 2), "with_load_ms": round(min(with_load) * 1e3, 2),
            "first_layer_ms": round(float(np.median(first_layer)) * 1e3, 2),
            "request_ms": round(float(np.median(request)) * 1e3, 2),
            # in wait_layer(0), and of that from the daemon's count to this process seeing it
            "layer0_wait_ms": round(float(np.median(layer0)) * 1e3, 2),
            "layer0_wake_ms": round(float(np.median(wake0)) / 1e6, 3) if wake0 else None,
            "load_in_daemon_ms": in_daemon.get("load", {}),
            "ratio": ratio(min(with_load), min(alone)), "bytes_exact": bool(exact),
            "with_offload_ms": round(min(with_offload) * 1e3, 2),
            "offload_ratio": ratio(min(with_offload), min(alone)), "offload_stored": min(stored)}


def _beside_offload(client, fwd, kv, dst, idx) -> tuple[list, list]:
    """(forward times, blocks stored): the forward while an offload of the loaded blocks under
    new keys runs beside it, three times."""
    with_offload, stored = [], []
    for _ in range(3):
        keys_out = [os.urandom(16) for _ in range(len(dst))]
        tasks = []

        def beside():
            tasks.append(client.offload(dst, keys_out))  # its copies wait for the queued work
            for i in range(LAYERS):
                fwd.layer(kv[i], idx)
        with_offload.append(_timed(beside))
        stored.append(tasks[-1].wait(120).get("stored", 0))
    return with_offload, stored


def _pin_time(device, gib: float) -> dict:
    t0 = time.perf_counter()
    pool = HostPool(int(gib * 2**30), str(device))
    seconds = time.perf_counter() - t0
    pool.close()
    return {"gib": gib, "seconds": round(seconds, 2), "numa_node": pool.numa_node}


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def run(quick: bool = False, device: str = "cuda:0", pin_gb: float | None = None,
        dma_threads: int = 4, **_) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit(f"bench transfer --device {device}: this torch sees no CUDA device")
    device = torch.device(device)
    torch.cuda.set_device(device)
    n = 200 if quick else 1000
    repeats = 2 if quick else 5
    baseline = PinnedMemcpy(n * LAYERS * 2 * 32 * 1024, device)
    run_dir = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    try:
        strategies = _strategies(device, n, repeats, baseline)
        runs = [("auto", 1), ("dma", 1)] + ([("dma", dma_threads)] if dma_threads > 1 else [])
        daemons = [_daemon_runs(device, n, repeats, baseline, run_dir, s, t) for s, t in runs]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    pin = _pin_time(device, pin_gb if pin_gb is not None else (2.0 if quick else 32.0))
    return {
        "bench": "transfer_cuda", "device": str(device), "gpu": torch.cuda.get_device_name(device),
        "driver": _driver(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"), "repeats": repeats,
        "memcpy_d2h_gbps": round(max(baseline.d2h), 2), "memcpy_h2d_gbps": round(max(baseline.h2d), 2),
        "strategies": strategies, "daemon": daemons[0], "daemons": daemons, "pin": pin,
        "target": {"ratio_min": 0.9, "overlap_ratio_max": 1.05},
    }


def format_result(r: dict) -> str:
    lines = [f"{r['gpu']} ({r['device']}), driver {r['driver']}, torch {r['torch']}, "
             f"CUDA {r['cuda']}, {r['date']}",
             f"pinned contiguous memcpy: D2H {r['memcpy_d2h_gbps']:.1f} GB/s, "
             f"H2D {r['memcpy_h2d_gbps']:.1f} GB/s (the ratios' baseline)",
             f"{'case':<12} {'strategy':<10} {'D2H GB/s':>9} {'ratio':>6} {'H2D GB/s':>9} {'ratio':>6} exact"]
    for s in r["strategies"]:
        lines.append(f"{s['case']:<12} {s['strategy']:<10} {s['d2h_gbps']:>9.1f} {s['d2h_ratio']:>6.2f} "
                     f"{s['h2d_gbps']:>9.1f} {s['h2d_ratio']:>6.2f} {s['bytes_exact']}")
    for d in r.get("daemons", [r["daemon"]]):
        lines += _daemon_lines(d, r["target"])
    p = r["pin"]
    lines += [
        f"pin {p['gib']:.0f} GiB: {p['seconds']:.2f} s (NUMA node {p['numa_node']})",
        f"targets: ratio >= {r['target']['ratio_min']} for both cases",
    ]
    return "\n".join(lines)


def _daemon_lines(d: dict, target: dict) -> list[str]:
    """One daemon strategy's lines: end to end, where its tasks' time went, the overlap."""
    o = d["overlap"]
    return [
        f"daemon ({d['strategy']}"
        + (f", {d['dma_threads']} threads" if d.get("dma_threads", 1) > 1 else "")
        + f"): offload {d['offload_gbps']:.1f} GB/s ({d['offload_ratio']:.2f}), "
        f"layer-wise load {d['load_gbps']:.1f} GB/s ({d['load_ratio']:.2f}), exact {d['bytes_exact']}",
        *(f"  {op} in the daemon: worker took it after {p['wait']} ms, queued the copies in "
          f"{p['queue']} ms" + (f" ({p['prepare']} ms of it before the first copy)"
                                if "prepare" in p else "")
          + f", they landed {p['land']} ms later (mean per task)"
          + (f"; its first layer counted {p['first_layer']} ms after the request"
             if "first_layer" in p else "")
          for op, p in d.get("phases_ms", {}).items()),
        f"  overlap: forward {o['forward_ms']:.2f} ms, with a {o['blocks']}-block layer-wise load "
        f"{o['with_load_ms']:.2f} ms, ratio {o['ratio']:.3f}; with an offload beside it "
        f"{o.get('with_offload_ms', '?')} ms, ratio {o.get('offload_ratio', '?')} (target <= "
        f"{target['overlap_ratio_max']}), exact {o['bytes_exact']}; CPU saw layer 0 "
        f"{o.get('first_layer_ms', '?')} ms after the request"
        + (f" (its reply after {o['request_ms']} ms)" if "request_ms" in o else "")
        + (f"; in wait_layer(0) {o['layer0_wait_ms']} ms, {o.get('layer0_wake_ms')} ms of it "
           "from the daemon's count to this process seeing it" if "layer0_wait_ms" in o else ""),
        *([f"  those loads in the daemon: first layer counted "
           f"{o['load_in_daemon_ms'].get('first_layer', '?')} ms after the request (the worker "
           f"took it after {o['load_in_daemon_ms']['wait']} ms), every copy queued "
           f"{o['load_in_daemon_ms']['queue']} ms later"] if o.get("load_in_daemon_ms") else []),
    ]
