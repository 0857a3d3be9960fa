"""Where each block's bytes are: the regions of a registered KV cache.

A region is one (layer, part) of the engine's KV cache inside one backing allocation: block
`b`'s bytes are `block_bytes` contiguous bytes at `offset + b * block_stride`. Every layout
whose blocks are a constant stride apart is a set of regions: vLLM 0.32's one-allocation
layouts (LBNHC, LBHNC: a region per layer, `block_stride == block_bytes`; BLNHC, BLHNC:
`block_stride` = the packed block of all layers), the per-layer tensors of older vLLM
(FlashAttention's K and V halves, FlashInfer's `(N, 2, ...)`, MLA) and kvcached's own
`allocate_kv_cache`.

Regions must not share a byte: a load into one would overwrite another. `check_disjoint`
proves it exactly for regions of equal stride and refuses regions of different strides whose
spans interleave (nothing registers that but a misdescribed cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Region:
    alloc: int         # index of the backing allocation
    offset: int        # bytes from the allocation's start to block 0
    block_stride: int  # bytes from one block to the next
    block_bytes: int   # contiguous bytes of one block

    def end(self, num_blocks: int) -> int:
        """One past the last byte of the region's last block."""
        return self.offset + (num_blocks - 1) * self.block_stride + self.block_bytes


def overlap(a: Region, b: Region, num_blocks: int) -> bool:
    """Whether two regions of one allocation share a byte (exact for equal strides, True for
    different strides whose spans meet)."""
    return bool(_overlaps(a, np.array([b.offset]), np.array([b.block_stride]),
                          np.array([b.block_bytes]), num_blocks)[0])


def _overlaps(a: Region, offs: np.ndarray, strides: np.ndarray, sizes: np.ndarray,
              num_blocks: int) -> np.ndarray:
    """For each region j (offset, stride, bytes), does it share a byte with `a`? Blocks k of
    `a` and m of j meet iff `t = m - k` (|t| < num_blocks) puts `t * s` strictly between
    `-d - bytes_j` and `a.block_bytes - d`, d = offset_j - a.offset."""
    s = a.block_stride
    d = offs - a.offset
    t = np.maximum((-d - sizes) // s + 1, -(num_blocks - 1))
    same = (t <= num_blocks - 1) & (t * s < a.block_bytes - d)
    ends = offs + (num_blocks - 1) * strides + sizes
    spans_meet = (offs < a.end(num_blocks)) & (ends > a.offset)
    return np.where(strides == s, same, spans_meet)


def check_disjoint(regions: list[Region], num_blocks: int) -> tuple[int, int] | None:
    """The first pair of region indices that share a byte, or None. Sorted by where each
    region starts, a region is compared only with those starting inside its span (one
    vectorized test each), so layer-outermost layouts cost O(n log n)."""
    for alloc in sorted({r.alloc for r in regions}):
        idx = [i for i, r in enumerate(regions) if r.alloc == alloc]
        idx.sort(key=lambda i: regions[i].offset)
        offs = np.array([regions[i].offset for i in idx], dtype=np.int64)
        strides = np.array([regions[i].block_stride for i in idx], dtype=np.int64)
        sizes = np.array([regions[i].block_bytes for i in idx], dtype=np.int64)
        for k, i in enumerate(idx):
            a = regions[i]
            hi = int(np.searchsorted(offs, a.end(num_blocks), side="left"))
            if hi <= k + 1:
                continue
            hit = _overlaps(a, offs[k + 1:hi], strides[k + 1:hi], sizes[k + 1:hi], num_blocks)
            if hit.any():
                return i, idx[k + 1 + int(np.argmax(hit))]
    return None


def gpu_uuid(ordinal: int) -> str:
    """A GPU's UUID as the engine and the daemon both write it: their ordinals for it may
    differ (each process's CUDA_VISIBLE_DEVICES), its UUID does not."""
    import torch  # only CUDA registrations ask; the wire package does not need torch

    return "GPU-" + str(torch.cuda.get_device_properties(ordinal).uuid)
