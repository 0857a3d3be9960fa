"""Per-layer views of one KV allocation laid out the way vLLM 0.32 lays it out.

vLLM 0.32 (`vllm/v1/kv_cache_layout.py`, `create_kv_cache_views`) backs the whole KV cache with
one allocation: a logical shape [L, B, H, N, C] (layers, blocks, KV heads, tokens per block,
C = one token's K and V of one head), a stride permutation per layout, and one `as_strided`
view [B, H, N, C] per layer. `register_kv_cache` takes such views as they are (each block's
bytes are contiguous in every layout below but LHBNC and BHLNC); these builders make them
over a kvcached allocation, for benchmarks and tests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the logical axes [L, B, H, N, C] in memory order, outermost first
VLLM_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4), "BHLNC": (1, 2, 0, 3, 4),
}

BLOCK_CONTIGUOUS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")  # the ones that register


def dense_strides(shape, order) -> list[int]:
    """Element strides of `shape` stored densely with its axes in `order` (outermost first)."""
    strides, acc = [0] * len(shape), 1
    for axis in reversed(order):
        strides[axis] = acc
        acc *= shape[axis]
    return strides


def vllm_layer_views(flat: torch.Tensor, layout: str, shape) -> list[torch.Tensor]:
    """The per-layer [B, H, N, C] views of `flat` (a 1-D tensor of the KV dtype holding at
    least L*B*H*N*C elements) for `shape` = (L, B, H, N, C) in vLLM layout `layout`."""
    import torch

    if layout not in VLLM_LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {sorted(VLLM_LAYOUTS)}")
    view = torch.as_strided(flat, tuple(shape), dense_strides(shape, VLLM_LAYOUTS[layout]),
                            flat.storage_offset())
    return [view[i] for i in range(shape[0])]
