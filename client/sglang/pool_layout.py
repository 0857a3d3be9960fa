"""SGLang's HiCache host pool as the daemon sees it: a register_kv layout over the pool's shm
allocations, read off the pool's own `get_page_buffer_meta` (the pointers and sizes SGLang's
zero-copy backends move), and the page ids of a batch's host indices.

A page of the pool is a list of chunks - per layer K and V in `layer_first`, K and V of all
layers in `page_first` / `page_first_direct` / `page_head` (MHA), one latent run per layer or
per page (MLA) - each chunk a constant stride from the same chunk of the next page. Each chunk
is one region of the layout (kvcached_proto.geometry): `layer_first` registers as the pool's
layers with its chunks of one layer as parts, the page-first layouts as one layer whose parts
are the page's chunks. Page p is block p: the host indices [p * page_size, (p+1) * page_size).

The side pools beside the KV pool (a hybrid model's Mamba states and sliding-window KV,
DeepSeek V3.2's index keys, a draft's KV) are described the same way, each for a daemon of its
own (side_pools.py); their chunks are registered as bytes (a Mamba page holds float32 and
bfloat16 states), and what the bytes mean is in the layout's name.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvcached_proto.layout import DTYPE_BYTES

from ..kv_alloc import dtype_name

MAX_PARTS = 8


class PoolNotShared(ValueError):
    """The pool's memory cannot be handed to the daemon (not made by SGLang's shm allocator)."""


def _page(pool, p: int) -> tuple[list[int], list[int]]:
    idx = torch.arange(p * pool.page_size, (p + 1) * pool.page_size, dtype=torch.int64)
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    return [int(x) for x in ptrs], [int(x) for x in sizes]


def _allocations(pool) -> list[tuple[int, int, int]]:
    """(fd, start address, bytes) of each of the pool's shm allocations."""
    allocator = getattr(pool, "allocator", None)
    fds, mms = list(getattr(allocator, "fds", None) or []), list(getattr(allocator, "mms", None) or [])
    if not fds or len(fds) != len(mms):
        raise PoolNotShared(
            "SGLang's host pool was not made by its shm allocator, so the daemon cannot map it: "
            "add \"allocator\": \"shm\" to --hicache-storage-backend-extra-config")
    out = []
    for fd, mm in zip(fds, mms):
        view = ctypes.c_char.from_buffer(mm)  # only for the address; released at once
        out.append((fd, ctypes.addressof(view), len(mm)))
        del view
    return out


def pool_kv_layout(pool) -> str:
    """What a page's bytes mean beyond its chunk sizes: the layout, the pool's class, its page
    size and layers, heads and dtype (part of the daemon's geometry and of the key namespace)."""
    heads = ",".join(str(getattr(pool, a)) for a in ("head_num", "head_dim", "v_head_dim",
                                                     "kv_lora_rank", "qk_rope_head_dim")
                     if getattr(pool, a, None) is not None)
    return (f"sglang:{pool.layout}:{type(pool).__name__}:p{pool.page_size}:L{pool.layer_num}:"
            f"h{heads}:{dtype_name(pool.dtype)}:{getattr(pool, 'storage_format_tag', None) or ''}")


def side_pool_kv_layout(name: str, pool) -> str:
    """A side pool's pool_kv_layout, named for the pool: a Mamba pool's by its states' shapes
    and dtypes (it has no heads), any other's as a KV pool's."""
    if hasattr(pool, "conv_state_shapes"):
        conv = ";".join(",".join(map(str, s)) for s in pool.conv_state_shapes)
        shape = ",".join(map(str, pool.temporal_state_shape))
        return (f"sglang-{name}:{pool.layout}:{type(pool).__name__}:p{pool.page_size}:"
                f"L{pool.num_mamba_layers}:t{shape}:{dtype_name(pool.temporal_dtype)}:"
                f"c{conv}:{dtype_name(pool.conv_dtype)}")
    return f"sglang-{name}:" + pool_kv_layout(pool).partition(":")[2]


def describe_host_pool(pool, name: str = "kv") -> tuple[dict, list[int]]:
    """The register_kv layout of `pool` (allocations by fd index) and the fds it indexes; a
    side pool (`name` other than "kv") with its chunks as bytes."""
    page_num = pool.size // pool.page_size
    if page_num < 2:
        raise ValueError(f"SGLang's host pool has {page_num} page(s): nothing to page")
    allocs = _allocations(pool)
    first, sizes = _page(pool, 0)
    second, sizes2 = _page(pool, 1)
    last, sizes_last = _page(pool, page_num - 1)
    strides = [b - a for a, b in zip(first, second)]
    if (not first or sizes != sizes2 or sizes != sizes_last or len(second) != len(first)
            or any(s <= 0 for s in strides)
            or any(c + (page_num - 1) * s != z for c, s, z in zip(first, strides, last))):
        raise ValueError(f"SGLang's host pool ({pool.layout}) does not place its pages a "
                         "constant stride apart: kvcached cannot page it")
    layers = pool.layer_num if pool.layout == "layer_first" else 1
    side = name != "kv"
    if len(first) % layers or len(first) // layers > MAX_PARTS:
        raise ValueError(f"SGLang's host pool ({pool.layout}): {len(first)} chunks per page "
                         f"over {layers} layers")
    parts = len(first) // layers
    names = {1: ["latent"], 2: ["k", "v"]}.get(parts, [f"part{j}" for j in range(parts)])
    dtype = torch.uint8 if side else pool.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    tensors = []
    for i, (addr, size, stride) in enumerate(zip(first, sizes, strides)):
        alloc = next((k for k, (_, start, n) in enumerate(allocs)
                      if start <= addr and addr + (page_num - 1) * stride + size <= start + n), None)
        if alloc is None or size % itemsize:
            raise ValueError(f"SGLang's host pool: chunk {i} of a page lies outside its shm "
                             "allocations")
        layer, part = divmod(i, parts)
        tensors.append({"layer": layer, "part": part, "name": names[part],
                        "dtype": dtype_name(dtype), "shape": [page_num, size // itemsize],
                        "alloc": alloc, "offset": addr - allocs[alloc][1], "block_stride": stride})
    layout = {"device": "cpu", "num_layers": layers, "num_blocks": page_num,
              "kv_layout": side_pool_kv_layout(name, pool) if side else pool_kv_layout(pool),
              "allocations": [{"kind": "fd", "index": k, "size": n} for k, (_, _, n) in enumerate(allocs)],
              "tensors": tensors}
    return layout, [fd for fd, _, _ in allocs]


def page_bytes(layout: dict) -> int:
    """Bytes of one page across its chunks (what the daemon holds per block)."""
    return sum(t["shape"][1] * DTYPE_BYTES[t["dtype"]] for t in layout["tensors"])


def page_ids(host_indices, page_size: int, pages: int) -> np.ndarray:
    """The pages (blocks) of the first `pages` pages' host indices; ValueError unless each page's
    indices are one whole page of the pool, in order (as SGLang's page allocator hands them out)."""
    idx = np.asarray(host_indices.cpu() if hasattr(host_indices, "cpu") else host_indices,
                     dtype=np.int64)
    need = pages * page_size
    if idx.size < need:
        raise ValueError(f"{idx.size} host indices for {pages} pages of {page_size}")
    rows = idx[:need].reshape(pages, page_size)
    starts = rows[:, 0]
    if (starts % page_size).any() or (rows - starts[:, None] != np.arange(page_size)).any():
        raise ValueError("host indices are not whole pages of the host pool")
    return starts // page_size
