"""The native CPU copier: a layer's block copies, every part of it, as one call into C
(_blockcopy.c) with the GIL released - one memcpy per run of blocks consecutive on both sides
where both sides' rows are packed, else per block. Offloads stream their stores past the cache
for runs of 32 KiB or more (the host pool is not read back soon). Loads use ordinary stores (the
engine reads those blocks next), except a layer's copy larger than half the last-level cache,
which could not stay cached anyway: measured here (2-core VM, 32 MiB L3, 1,000 blocks of 64 KiB
a layer), ordinary stores load at 0.85-0.91 of one memcpy of the same bytes, streaming ones at
1.26-1.30.

What `auto` picks for CPU KV when the extension is built; the numpy copier (transfer.CpuCopier)
is the fallback where it is not (`kvcached status` says which runs: `kv.copy_strategy`).
"""
from __future__ import annotations

import glob

import numpy as np

from .transfer import CopierHooks, CopyPlan

try:
    from . import _blockcopy
except ImportError:  # built at install with a C compiler; numpy copies otherwise
    _blockcopy = None


def available() -> bool:
    return _blockcopy is not None


def _last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache of cpu0 (sysfs), e.g. the L3."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(index).read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=default)


LOAD_STREAM_BYTES = _last_level_cache_bytes() // 2  # a load layer past this cannot stay cached


class _Side:
    """One (layer, part) view's rows: where block 0 is, the stride, the bytes of a row."""

    def __init__(self, view):
        self.base, self.stride, self.row = view.data_ptr(), view.stride(0), view.shape[1]
        self.packed = self.stride == self.row


class NativeCopier(CopierHooks):
    strategy = "native"

    def __init__(self, dev_views, host_views):
        if _blockcopy is None:
            raise RuntimeError("kvcached.copy._blockcopy is not built")
        self.views = (dev_views, host_views)  # the mappings stay referenced while it copies
        self.parts = [[(_Side(d), _Side(h)) for d, h in zip(dr, hr)]
                      for dr, hr in zip(dev_views, host_views)]

    def close(self) -> None:
        self.views, self.parts = ((), ()), []  # the registration can be unmapped now

    def plan(self, kind: str, dev_ids: np.ndarray, host_ids: np.ndarray) -> CopyPlan:
        plan = CopyPlan.make(dev_ids, host_ids)
        dev_ids, host_ids = np.asarray(dev_ids, dtype=np.int64), np.asarray(host_ids, dtype=np.int64)
        n = len(dev_ids)
        cut = np.flatnonzero((np.diff(dev_ids) != 1) | (np.diff(host_ids) != 1)) + 1
        starts = np.concatenate([[0], cut]).astype(np.int64) if n else np.zeros(0, np.int64)
        lengths = np.diff(np.append(starts, n)).astype(np.int64)
        plan.extra["native"] = (dev_ids, host_ids, starts, lengths)
        return plan

    def _runs(self, layer: int, plan: CopyPlan, to_host: bool):
        dev_ids, host_ids, starts, lengths = plan.extra["native"]
        src, dst, sizes = [], [], []
        for dev, host in self.parts[layer]:
            if dev.packed and host.packed:  # a run of blocks is one stretch on both sides
                d, h, z = dev_ids[starts], host_ids[starts], lengths * dev.row
            else:
                d, h, z = dev_ids, host_ids, np.full(len(dev_ids), dev.row, dtype=np.int64)
            d_addr, h_addr = dev.base + d * dev.stride, host.base + h * host.stride
            src.append(d_addr if to_host else h_addr)
            dst.append(h_addr if to_host else d_addr)
            sizes.append(z)
        return np.concatenate(src), np.concatenate(dst), np.concatenate(sizes)

    def offload_layer(self, layer: int, plan: CopyPlan) -> int:
        src, dst, sizes = self._runs(layer, plan, to_host=True)
        return _blockcopy.copy(src, dst, sizes, True)

    def load_layer(self, layer: int, plan: CopyPlan) -> int:
        src, dst, sizes = self._runs(layer, plan, to_host=False)
        # the engine reads a load next: ordinary stores keep it in the cache - unless the layer's
        # copy is larger than the cache can keep anyway, where streaming stores skip the reads
        return _blockcopy.copy(src, dst, sizes, int(sizes.sum()) > LOAD_STREAM_BYTES)
