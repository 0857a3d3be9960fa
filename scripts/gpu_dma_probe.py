"""What limits the `dma` copy strategy on a GPU (docs/cuda.md, third run: its speed was the host
CPU's, 0.6-1.3 us of it a copy). A 1,000-block task of 32 KiB per-layer blocks is 64,000 copies
(32 layers x (K, V), scattered device ids), queued as `dma` queues them: one
cudaMemcpyBatchAsync a layer through kvcached.host.cudart. Each variant prints the time the
submitting threads took to queue them, the time until they landed, GB/s and its ratio to one
contiguous pinned copy of the same bytes measured in the same run (best of --repeats), and
whether the bytes are right:
- threads 1, 2, 4: each layer's list split between that many submitting threads, each on its own
  stream (does the runtime take copies from several threads at once?);
- srcAccessOrder stream (what `dma` uses) against any; the prefer-overlap-with-compute flag
  (what `dma` uses) against none;
- 500 copies a call, and the whole task in one call, against a layer's 2,000 a call;
- host memory mapped and registered with cudaHostRegister (as the daemon's pool is) against
  torch's pinned allocation;
both directions. Run on a GPU machine with the checkout on PYTHONPATH:
`python3 scripts/gpu_dma_probe.py [--device cuda:N] [--blocks N] [--repeats R] [--json FILE]`;
scripts/gpu_check.sh runs it as its `probe` stage. Measures; changes nothing."""
from __future__ import annotations

import argparse
import json
import mmap
import sys
import threading
import time

import numpy as np
import torch

from kvcached.host import cudart

LAYERS, ROW = 32, 32 * 1024
ORDER = {"stream": 1, "any": 3}  # cudaMemcpySrcAccessOrderStream, ...Any
FLAGS = {"overlap": cudart.PREFER_OVERLAP_WITH_COMPUTE, "none": 0}


def _lists(dev, host, dev_ids, host_ids, to_host: bool) -> list[tuple[np.ndarray, ...]]:
    """Per layer, (dsts, srcs, sizes) of its K and V rows: one copy per block and part."""
    out = []
    for layer in range(LAYERS):
        rows = (2 * layer, 2 * layer + 1)
        d = np.concatenate([dev[r].data_ptr() + dev_ids * ROW for r in rows]).astype(np.uint64)
        h = np.concatenate([host[r].data_ptr() + host_ids * ROW for r in rows]).astype(np.uint64)
        sizes = np.full(len(d), ROW, dtype=np.uint64)
        out.append((h, d, sizes) if to_host else (d, h, sizes))
    return out


def _calls(lists, per_call: str) -> list[tuple[np.ndarray, ...]]:
    """The copies as the runtime calls take them: a layer a call, N copies a call, or the whole
    task in one."""
    if per_call == "layer":
        return lists
    if per_call == "task":
        return [tuple(np.concatenate(c) for c in zip(*lists))]
    k = int(per_call)
    return [tuple(a[i:i + k] for a in lst) for lst in lists for i in range(0, len(lst[2]), k)]


def _registered_host(rt, shape) -> tuple[torch.Tensor, mmap.mmap]:
    """Host rows in anonymous memory registered with cudaHostRegister, as the daemon's pool."""
    nbytes = int(np.prod(shape))
    buf = mmap.mmap(-1, nbytes)
    arr = np.frombuffer(buf, dtype=np.uint8)
    err = rt.host_register(arr.ctypes.data, nbytes, cudart.CUDA_HOST_REGISTER_PORTABLE
                           | cudart.CUDA_HOST_REGISTER_MAPPED)
    if err:
        rt.get_last_error()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {rt.error_string(err)}")
    return torch.from_numpy(arr).view(shape), buf


def _queue(rt, lists, threads: int) -> tuple[float, float]:
    """(seconds to queue every list, seconds until the copies landed): each list split between
    `threads` submitting threads, each on its own stream."""
    device = torch.cuda.current_device()
    streams = [torch.cuda.Stream() for _ in range(threads)]
    errors: list[BaseException] = []
    gate = threading.Barrier(threads + 1, timeout=60)  # a thread that never starts ends the wait

    def submit(t: int) -> None:
        torch.cuda.set_device(device)  # the runtime's device is per thread
        gate.wait()
        try:
            for dsts, srcs, sizes in lists:
                n = len(sizes)
                a, b = n * t // threads, n * (t + 1) // threads
                rt.memcpy_batch_async(dsts[a:b], srcs[a:b], sizes[a:b], streams[t].cuda_stream)
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    torch.cuda.synchronize()
    workers = [threading.Thread(target=submit, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    start = time.perf_counter()
    gate.wait()
    for w in workers:
        w.join()
    queued = time.perf_counter() - start
    for s in streams:
        s.synchronize()
    if errors:
        raise errors[0]
    return queued, time.perf_counter() - start


def _contiguous_gbps(nbytes: int, device, repeats: int) -> dict:
    """The baseline: GB/s of one contiguous pinned copy of `nbytes`, each direction."""
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    base = {}
    for name, dst, src in (("d2h", flat_host, flat_dev), ("h2d", flat_dev, flat_host)):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        base[name] = nbytes / best / 1e9
    return base


def _row(direction: str, threads: int, order: str, flags: str, per_call: str, host: str,
         queued: float, total: float, nbytes: int, base_gbps: float, exact: bool) -> dict:
    """One variant's figures, printed as a line."""
    gbps = nbytes / total / 1e9
    row = {"direction": direction, "threads": threads, "src_order": order, "flags": flags,
           "per_call": per_call, "host": host,
           "queue_ms": round(queued * 1e3, 2), "total_ms": round(total * 1e3, 2),
           "us_per_copy": round(queued / (nbytes // ROW) * 1e6, 3),
           "gbps": round(gbps, 2), "ratio": round(gbps / base_gbps, 3), "bytes_exact": bool(exact)}
    print(f"{direction} threads {threads} order {order:<6} flags {flags:<7} calls {per_call:<5} "
          f"host {host:<10} queued in "
          f"{row['queue_ms']:7.2f} ms ({row['us_per_copy']:.3f} us a copy), landed after "
          f"{row['total_ms']:7.2f} ms: {gbps:5.1f} GB/s, {row['ratio']:.2f} of the contiguous "
          f"copy, exact {exact}", flush=True)
    return row


def _variants(rt, dev, hosts: dict, src, back, base: dict, repeats: int) -> list[dict]:
    """Every variant, both directions: D2H from device blocks `src` into the host rows, then H2D
    from them into device blocks `back`; bytes checked after each."""
    dev_name, n = dev.device, len(src)
    host_ids, nbytes = np.arange(n, dtype=np.int64), 2 * LAYERS * n * ROW
    src_idx, back_idx = torch.from_numpy(src).to(dev_name), torch.from_numpy(back).to(dev_name)
    # (threads, srcAccessOrder, flags, copies a call, host memory); the first is dma's way
    variants = [(t, "stream", "overlap", "layer", "alloc") for t in (1, 2, 4)] + [
        (1, "any", "overlap", "layer", "alloc"), (1, "stream", "none", "layer", "alloc"),
        (1, "stream", "overlap", "500", "alloc"), (1, "stream", "overlap", "task", "alloc"),
        (1, "stream", "overlap", "layer", "registered")]
    results = []
    for direction in ("d2h", "h2d"):
        to_host = direction == "d2h"
        for threads, order, flags, per_call, kind in variants:
            host = hosts[kind]
            lists = _calls(_lists(dev, host, src if to_host else back, host_ids, to_host), per_call)
            rt._attrs = cudart.MemcpyAttributes(ORDER[order], cudart.MemLocation(),
                                                cudart.MemLocation(), FLAGS[flags])
            if to_host:
                host.zero_()  # what an earlier variant copied must not count
            else:
                dev[:, back_idx] = 0
            queued, total = min((_queue(rt, lists, threads) for _ in range(repeats)),
                                 key=lambda r: r[1])
            if to_host:
                exact = torch.equal(host.to(dev_name), dev[:, src_idx])
            else:
                exact = torch.equal(dev[:, back_idx], dev[:, src_idx])
            results.append(_row(direction, threads, order, flags, per_call, kind, queued, total,
                                nbytes, base[direction], exact))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_dma_probe: this torch sees no CUDA device", file=sys.stderr)
        return 1
    dev_name = torch.device(args.device)
    torch.cuda.set_device(dev_name)
    n, num_dev = args.blocks, 2 * args.blocks + 8
    dev = torch.empty((2 * LAYERS, num_dev, ROW), dtype=torch.uint8, device=dev_name)
    dev.random_(0, 256)
    rt = cudart.LibCudart()
    if not rt.has_memcpy_batch():
        print(f"gpu_dma_probe: runtime {rt.version} has no cudaMemcpyBatchAsync", file=sys.stderr)
        return 1
    hosts = {"alloc": torch.empty((2 * LAYERS, n, ROW), dtype=torch.uint8).pin_memory()}
    hosts["registered"], buf = _registered_host(rt, (2 * LAYERS, n, ROW))
    rng = np.random.default_rng(0)
    perm = rng.permutation(num_dev).astype(np.int64)
    src, back = perm[:n], perm[n:2 * n]
    base = _contiguous_gbps(2 * LAYERS * n * ROW, dev_name, args.repeats)
    print(f"{torch.cuda.get_device_name(dev_name)}, runtime {rt.version}: {n} blocks, "
          f"{2 * LAYERS * n} copies of {ROW} bytes a direction; contiguous pinned copy "
          f"D2H {base['d2h']:.1f} GB/s, H2D {base['h2d']:.1f} GB/s")
    results = _variants(rt, dev, hosts, src, back, base, args.repeats)
    rt.host_unregister(hosts["registered"].data_ptr())
    del hosts, buf  # the mapping goes with the process
    out = {"gpu": torch.cuda.get_device_name(dev_name), "runtime": rt.version, "blocks": n,
           "memcpy_gbps": base, "results": results}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(r["bytes_exact"] for r in results) else 2


if __name__ == "__main__":
    sys.exit(main())
