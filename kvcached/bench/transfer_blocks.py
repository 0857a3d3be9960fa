"""The blocks both transfer benches move (CPU: transfer.py, CUDA: transfer_cuda.py): a 7B-like
layout and the marks that make every copied block checkable.

KV layouts: `kvcached` (allocate_kv_cache: per layer a K and a V tensor [B, 16, 8, 128]) or a
vLLM 0.32 one-allocation layout (kv_views.py: per layer one [B, 8, 16, 256] view, K and V of a
token side by side; LBNHC/LBHNC one region per layer, BLNHC/BLHNC blocks a whole page of all
layers apart). The bytes per block and layer are the same in every layout."""
from __future__ import annotations

import numpy as np
import torch

from kvcached_client.kv_views import BLOCK_CONTIGUOUS

LAYERS, BLOCK_SHAPE, DTYPE = 32, (16, 8, 128), torch.bfloat16
KV_LAYOUTS = ["kvcached", *BLOCK_CONTIGUOUS]


def bench_kv(layout: str, num_blocks: int, device="cpu") -> list:
    """The bench's KV cache in `layout` (KV_LAYOUTS), zero-filled."""
    from kvcached_client import allocate_kv_buffer, allocate_kv_cache
    from kvcached_client.kv_views import vllm_layer_views

    if layout == "kvcached":
        return allocate_kv_cache(LAYERS, num_blocks, BLOCK_SHAPE, DTYPE, device=device)
    tokens, heads, dim = BLOCK_SHAPE
    shape = (LAYERS, num_blocks, heads, tokens, 2 * dim)
    flat = allocate_kv_buffer(int(np.prod(shape)) * DTYPE.itemsize, device).view(DTYPE)
    return [(t,) for t in vllm_layer_views(flat, layout, shape)]


def _fill(kv, blocks: np.ndarray, salt: int = 0) -> None:
    """Give each block, layer and part a recognisable value (checked by _check); any device."""
    for layer, parts in enumerate(kv):
        for part, t in enumerate(parts):
            marks = torch.from_numpy((blocks * 7 + layer * 3 + part + salt) % 251).to(t.device, DTYPE)
            ones = [1] * (t.dim() - 1)
            t[torch.from_numpy(blocks).to(t.device)] = marks.view(-1, *ones).expand(-1, *t.shape[1:])


def _check(kv, blocks: np.ndarray, source_blocks: np.ndarray) -> bool:
    pick = np.linspace(0, len(blocks) - 1, num=min(16, len(blocks))).astype(int)
    for layer, parts in enumerate(kv):
        for part, t in enumerate(parts):
            want = torch.from_numpy((source_blocks[pick] * 7 + layer * 3 + part) % 251).to(t.device, DTYPE)
            got = t[torch.from_numpy(blocks[pick]).to(t.device)].flatten(1)
            if not torch.equal(got, want.view(-1, 1).expand_as(got)):
                return False
    return True
