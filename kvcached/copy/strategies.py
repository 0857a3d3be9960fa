"""Copy strategies between the engine's KV and the host pool, as torch ops on any device.

Each function moves the blocks of one (layer, part): `dev` and `host` are 2-D views
`[blocks, bytes]` (widened to the widest integer type the rows allow, see `widen`). The CUDA
copier (cuda_copier.py) runs them on its copy streams with `non_blocking=True`; the same
functions run on CPU tensors, which is how CI checks their indexing byte for byte.

- runs: one copy per run of ids that go up by one on both sides (on CUDA one cudaMemcpyAsync
  per run: per block when the ids are scattered).
- gather: offload gathers the device blocks into a device staging buffer (one kernel) and
  moves each run of host ids with one DMA; load does the reverse (DMAs into staging, one
  scatter kernel).
- zero_copy: index kernels between the device view and a device-addressable view of the
  pinned host pool (unified addressing): the SMs move the bytes over the bus, the copy engines
  stay idle. The staging buffer only bounds the device-side temporary.

Host rows that are not contiguous with each other (the page_first layout) cannot take a run in
one copy: `host_runs_for` splits runs into single blocks there.
"""
from __future__ import annotations

import bisect

import torch

from ..config import COPY_STRATEGIES

STRATEGIES = COPY_STRATEGIES[3:]  # runs, gather, zero_copy (torch ops here) and dma (dma.py)


def widen(t: torch.Tensor) -> torch.Tensor:
    """A `[blocks, bytes]` uint8 view as the widest integer type its row size, stride and
    address allow: index kernels move one element per thread, so wide elements move more."""
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.shape[1] % width == 0 and t.stride(0) % width == 0 and t.data_ptr() % width == 0:
            return t.view(dtype)
    return t


def rows_contiguous(t: torch.Tensor) -> bool:
    return t.stride(0) == t.shape[1] * t.stride(1)


def host_runs_for(runs: list, contiguous: bool) -> list:
    """Host runs `(start, end, first_host)` as one copy can take them."""
    if contiguous:
        return runs
    return [(i, i + 1, h + i - a) for a, b, h in runs for i in range(a, b)]


def split_pairs(pairs: list, cuts: list[int]) -> list:
    """Runs `(dev, host, n)` split where the host side reaches a block in `cuts` (sorted: the
    first block of each later host-pool registration), so that no copy spans two."""
    if not cuts:
        return pairs
    out = []
    for d, h, n in pairs:
        i = bisect.bisect_right(cuts, h)
        while i < len(cuts) and cuts[i] < h + n:
            k = cuts[i] - h
            out.append((d, h, k))
            d, h, n = d + k, h + k, n - k
            i += 1
        out.append((d, h, n))
    return out


def split_host_runs(runs: list, cuts: list[int]) -> list:
    """Host runs `(start, end, first_host)` split the same way."""
    if not cuts:
        return runs
    return [(a, a + n, h) for a, h, n in split_pairs([(a, h, b - a) for a, b, h in runs], cuts)]


def _clip(runs: list, c0: int, c1: int):
    """The parts of `runs` inside positions [c0, c1), positions made relative to c0."""
    for a, b, h in runs:
        if b <= c0 or a >= c1:
            continue
        a2, b2 = max(a, c0), min(b, c1)
        yield a2 - c0, b2 - c0, h + (a2 - a)


def offload_runs(dev, host, pairs, non_blocking: bool) -> None:
    """pairs: (first device id, first host id, length) of runs consecutive on both sides."""
    for d, h, n in pairs:
        host[h:h + n].copy_(dev[d:d + n], non_blocking=non_blocking)


def load_runs(dev, host, pairs, non_blocking: bool) -> None:
    for d, h, n in pairs:
        dev[d:d + n].copy_(host[h:h + n], non_blocking=non_blocking)


def _chunks(n: int, staging: torch.Tensor):
    """(c0, c1, staging rows for positions [c0, c1)) over n positions: the staging buffer is
    reused chunk after chunk (the copies of one stream run in order)."""
    cap = staging.shape[0]
    for c0 in range(0, n, cap):
        c1 = min(c0 + cap, n)
        yield c0, c1, staging[: c1 - c0]


def offload_gather(dev, host, dev_index, runs, staging, non_blocking: bool) -> None:
    """dev_index: device ids on dev's device; runs: host runs; staging: [cap, row] on dev's
    device."""
    for c0, c1, out in _chunks(len(dev_index), staging):
        torch.index_select(dev, 0, dev_index[c0:c1], out=out)
        for a, b, h in _clip(runs, c0, c1):
            host[h:h + (b - a)].copy_(out[a:b], non_blocking=non_blocking)


def load_gather(dev, host, dev_index, runs, staging, non_blocking: bool) -> None:
    for c0, c1, out in _chunks(len(dev_index), staging):
        for a, b, h in _clip(runs, c0, c1):
            out[a:b].copy_(host[h:h + (b - a)], non_blocking=non_blocking)
        dev.index_copy_(0, dev_index[c0:c1], out)


def offload_zero_copy(dev, host_view, dev_index, host_index, staging) -> None:
    """host_view: the host rows as the device addresses them (the host view itself on CPU)."""
    for c0, c1, out in _chunks(len(dev_index), staging):
        torch.index_select(dev, 0, dev_index[c0:c1], out=out)
        host_view.index_copy_(0, host_index[c0:c1], out)


def load_zero_copy(dev, host_view, dev_index, host_index, staging) -> None:
    for c0, c1, out in _chunks(len(dev_index), staging):
        torch.index_select(host_view, 0, host_index[c0:c1], out=out)
        dev.index_copy_(0, dev_index[c0:c1], out)
