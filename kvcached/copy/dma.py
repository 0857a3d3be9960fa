"""The copy-engine strategy (`--copy-strategy dma`): a layer's scattered blocks move by DMA
alone, with no index kernel, so a load or offload beside the engine's forward does not share
its SMs (kernels of two processes time-slice the GPU; the copy engines do not).

Per layer and direction, the copies of every part are one list of (dst, src, bytes): a run of
blocks consecutive on both sides is one copy when both sides' rows are back to back, else one
copy per block (a block's bytes are always one run). The list goes to the runtime in one call:
`cudaMemcpyBatchAsync` (CUDA 12.8+, copies preferring overlap with compute) where the runtime
has it, else one `cudaMemcpyAsync` per copy. On CPU the same lists run through `HostMemcpy`
(memmove, in order), which is how CI checks them byte for byte, through a real daemon too.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np


class Rows(NamedTuple):
    """A `[blocks, bytes]` view as addresses: row i at base + i * stride, `width` bytes."""
    base: int
    stride: int
    width: int


def rows_of(t) -> Rows:
    size = t.element_size()
    return Rows(t.data_ptr(), t.stride(0) * size, t.shape[1] * size)


def offsets(pairs, dev: Rows, host: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(device offsets, host offsets, sizes) as uint64 arrays for runs `(dev id, host id,
    length)`: the same for every layer whose rows have these strides and width, so a plan
    computes them once and each layer adds its bases (`at`)."""
    p = np.asarray(pairs, dtype=np.int64).reshape(-1, 3)
    d, h, n = p[:, 0], p[:, 1], p[:, 2]
    if dev.stride == dev.width and host.stride == host.width:
        sizes = n * dev.width
    else:  # one copy per block
        starts = np.repeat(np.cumsum(n) - n, n)
        step = np.arange(int(n.sum())) - starts
        d, h = np.repeat(d, n) + step, np.repeat(h, n) + step
        sizes = np.full(len(d), dev.width, dtype=np.int64)
    return ((d * dev.stride).astype(np.uint64), (h * host.stride).astype(np.uint64),
            sizes.astype(np.uint64))


def at(offs, dev: Rows, host: Rows, to_host: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dsts, srcs, sizes): `offsets` placed at the rows' base addresses."""
    dev_off, host_off, sizes = offs
    dev_addr, host_addr = dev_off + np.uint64(dev.base), host_off + np.uint64(host.base)
    return (host_addr, dev_addr, sizes) if to_host else (dev_addr, host_addr, sizes)


def concat(lists: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One (dsts, srcs, sizes) of several."""
    if not lists:
        return (np.zeros(0, np.uint64),) * 3
    return tuple(np.concatenate(c) for c in zip(*lists))


class HostMemcpy:
    """CPU: each copy done at once, in order."""

    batched = False

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        for dst, src, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(dst, src, n)


class CudaMemcpy:
    """CUDA: the list queued on `stream` in one batched call where the runtime has one, else one
    cudaMemcpyAsync per copy (kvcached/host/cudart.py)."""

    def __init__(self, rt):
        self.rt = rt
        self.batched = rt.has_memcpy_batch()

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        if not len(sizes):
            return
        if self.batched:
            self.rt.memcpy_batch_async(dsts, srcs, sizes, stream)
            return
        for dst, src, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            self.rt.memcpy_async(dst, src, n, stream)
