"""The copy-engine strategy (`--copy-strategy dma`): a layer's scattered blocks move by DMA
alone, with no index kernel, so a load or offload beside the engine's forward does not share
its SMs (kernels of two processes time-slice the GPU; the copy engines do not).

Per layer and direction, the copies of every part are one list of (dst, src, bytes): a run of
blocks consecutive on both sides is one copy when both sides' rows are back to back, else one
copy per block (a block's bytes are always one run). The list goes to the runtime in one call:
`cudaMemcpyBatchAsync` (CUDA 12.8+, copies preferring overlap with compute) where the runtime
has it, else one `cudaMemcpyAsync` per copy. On CPU the same lists run through `HostMemcpy`
(memmove, in order), which is how CI checks them byte for byte, through a real daemon too.

Spans: where the rows of several (layer, part)s lie a constant pitch apart on both sides (one
device allocation carved layer by layer, as `allocate_kv_cache` and vLLM carve it, against the
host pool registered in one call), a block's rows across those layers are one 2-D copy
(`cudaMemcpy2DAsync`: `height` rows of `width` bytes, each side's rows its pitch apart). The
runtime's cost is per copy (about 1 us each for 32 KiB rows on an H100, measured 2026-11-27: a
1,000-block layer-wise load queued its 64,000 copies in 84 ms, longer than the 38 ms the bytes
take), so an offload over every layer makes one copy per block instead of one per block, layer
and part, and a load one per block and group of layers (`span`, `layer_groups`).
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


def span(dev_rows: list[Rows], host_rows: list[Rows], max_pitch: int) -> tuple[int, int] | None:
    """(device pitch, host pitch) when the rows of consecutive (layer, part)s, in that order,
    lie a constant pitch apart on each side with the same stride and width, so that a block's
    rows over all of them are one 2-D copy; else None. The caller vouches that each side's
    rows are in one allocation (one registration) that a copy may span."""
    if len(dev_rows) < 2 or len(dev_rows) != len(host_rows):
        return None
    pitches = []
    for rows in (dev_rows, host_rows):
        first = rows[0]
        pitch = rows[1].base - first.base
        if not first.width <= pitch <= max_pitch:
            return None
        if any(r.stride != first.stride or r.width != first.width or r.base != first.base + i * pitch
               for i, r in enumerate(rows)):
            return None
        pitches.append(pitch)
    if dev_rows[0].width != host_rows[0].width:
        return None
    return pitches[0], pitches[1]


def concat(lists: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One (dsts, srcs, sizes) of several."""
    if not lists:
        return (np.zeros(0, np.uint64),) * 3
    return tuple(np.concatenate(c) for c in zip(*lists))


class HostMemcpy:
    """CPU: each copy done at once, in order."""

    batched = False
    max_pitch = 1 << 62

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        for dst, src, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(dst, src, n)

    def copy_2d(self, dsts: np.ndarray, dpitch: int, srcs: np.ndarray, spitch: int,
                widths: np.ndarray, height: int, stream: int) -> None:
        """Copy i: `height` rows of widths[i] bytes, row r from srcs[i] + r * spitch to
        dsts[i] + r * dpitch."""
        for dst, src, n in zip(dsts.tolist(), srcs.tolist(), widths.tolist()):
            for r in range(height):
                ctypes.memmove(dst + r * dpitch, src + r * spitch, n)


class CudaMemcpy:
    """CUDA: the list queued on `stream` in one batched call where the runtime has one, else one
    cudaMemcpyAsync per copy (kvcached/host/cudart.py)."""

    def __init__(self, rt, device: int = 0):
        self.rt = rt
        self.batched = rt.has_memcpy_batch()
        self.max_pitch = rt.max_pitch(device)  # a 2-D copy's pitch above it is refused

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        if not len(sizes):
            return
        if self.batched:
            self.rt.memcpy_batch_async(dsts, srcs, sizes, stream)
            return
        for dst, src, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            self.rt.memcpy_async(dst, src, n, stream)

    def copy_2d(self, dsts: np.ndarray, dpitch: int, srcs: np.ndarray, spitch: int,
                widths: np.ndarray, height: int, stream: int) -> None:
        for dst, src, n in zip(dsts.tolist(), srcs.tolist(), widths.tolist()):
            self.rt.memcpy_2d_async(dst, dpitch, src, spitch, n, height, stream)
