"""What limits the `dma` copy strategy on a GPU (docs/cuda.md, third run: its speed was the host
CPU's, 0.6-1.3 us of it a copy). A 1,000-block task of 32 KiB per-layer blocks is 64,000 copies
(32 layers x (K, V), scattered device ids), queued as `dma` queues them: one
cudaMemcpyBatchAsync a layer through kvcached.host.cudart. Each variant prints the CPU time to
queue them, the time until they landed, GB/s and its ratio to one contiguous pinned copy of the
same bytes measured in the same run (best of --repeats), and whether the bytes are right:
- threads 1, 2, 4: each layer's list split between that many submitting threads, each on its own
  stream (does the runtime take copies from several threads at once?);
- srcAccessOrder stream (what `dma` uses) against any; the prefer-overlap-with-compute flag
  (what `dma` uses) against none;
both directions. Run on a GPU machine with the checkout on PYTHONPATH:
`python3 scripts/gpu_dma_probe.py [--blocks N] [--repeats R] [--json FILE]`; scripts/gpu_check.sh
runs it as its `probe` stage. Measures; changes nothing."""
from __future__ import annotations

import argparse
import json
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


def _queue(rt, lists, threads: int) -> tuple[float, float]:
    """(seconds to queue every list, seconds until the copies landed): each layer's list split
    between `threads` submitting threads, each on its own stream."""
    streams = [torch.cuda.Stream() for _ in range(threads)]
    errors: list[BaseException] = []
    gate = threading.Barrier(threads + 1)

    def submit(t: int) -> None:
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


def _row(direction: str, threads: int, order: str, flags: str, queued: float, total: float,
         nbytes: int, base_gbps: float, exact: bool) -> dict:
    """One variant's figures, printed as a line."""
    gbps = nbytes / total / 1e9
    row = {"direction": direction, "threads": threads, "src_order": order, "flags": flags,
           "queue_ms": round(queued * 1e3, 2), "total_ms": round(total * 1e3, 2),
           "us_per_copy": round(queued / (nbytes // ROW) * 1e6, 3),
           "gbps": round(gbps, 2), "ratio": round(gbps / base_gbps, 3), "bytes_exact": bool(exact)}
    print(f"{direction} threads {threads} order {order:<6} flags {flags:<7} queued in "
          f"{row['queue_ms']:7.2f} ms ({row['us_per_copy']:.3f} us a copy), landed after "
          f"{row['total_ms']:7.2f} ms: {gbps:5.1f} GB/s, {row['ratio']:.2f} of the contiguous "
          f"copy, exact {exact}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_dma_probe: this torch sees no CUDA device", file=sys.stderr)
        return 1
    dev_name = torch.device("cuda:0")
    n, num_dev = args.blocks, 2 * args.blocks + 8
    dev = torch.empty((2 * LAYERS, num_dev, ROW), dtype=torch.uint8, device=dev_name).random_(0, 256)
    host = torch.empty((2 * LAYERS, n, ROW), dtype=torch.uint8).pin_memory()
    rt = cudart.LibCudart()
    if not rt.has_memcpy_batch():
        print(f"gpu_dma_probe: runtime {rt.version} has no cudaMemcpyBatchAsync", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    perm = rng.permutation(num_dev).astype(np.int64)
    src, back = perm[:n], perm[n:2 * n]
    host_ids = np.arange(n, dtype=np.int64)
    nbytes = 2 * LAYERS * n * ROW
    base = _contiguous_gbps(nbytes, dev_name, args.repeats)
    print(f"{torch.cuda.get_device_name(dev_name)}, runtime {rt.version}: {n} blocks, "
          f"{2 * LAYERS * n} copies of {ROW} bytes a direction; contiguous pinned copy "
          f"D2H {base['d2h']:.1f} GB/s, H2D {base['h2d']:.1f} GB/s")
    src_idx, back_idx = torch.from_numpy(src).to(dev_name), torch.from_numpy(back).to(dev_name)
    variants = [(t, "stream", "overlap") for t in (1, 2, 4)] + [(1, "any", "overlap"),
                                                                (1, "stream", "none")]
    results = []
    for direction in ("d2h", "h2d"):
        to_host = direction == "d2h"
        lists = _lists(dev, host, src if to_host else back, host_ids, to_host)
        for threads, order, flags in variants:
            rt._attrs = cudart.MemcpyAttributes(ORDER[order], cudart.MemLocation(),
                                                cudart.MemLocation(), FLAGS[flags])
            if to_host:
                host.zero_()  # what an earlier variant copied must not count
            else:
                dev[:, back_idx] = 0
            queued, total = min((_queue(rt, lists, threads) for _ in range(args.repeats)),
                                 key=lambda r: r[1])
            if to_host:
                exact = torch.equal(host.to(dev_name), dev[:, src_idx])
            else:
                exact = torch.equal(dev[:, back_idx], dev[:, src_idx])
            results.append(_row(direction, threads, order, flags, queued, total, nbytes,
                                base[direction], exact))
    out = {"gpu": torch.cuda.get_device_name(dev_name), "runtime": rt.version, "blocks": n,
           "memcpy_gbps": base, "results": results}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(r["bytes_exact"] for r in results) else 2


if __name__ == "__main__":
    sys.exit(main())
