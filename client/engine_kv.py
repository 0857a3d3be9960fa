"""An engine's KV as the worker core finds it (kv_worker.py): each layer's blocks, their axes'
memory order, whether every layer pages the same blocks, the staging cache that mirrors it in
shared memory, and what to say of KV the daemon cannot map."""
from __future__ import annotations

import torch

from kvcached_proto.errors import KvcachedError

from .kv_alloc import allocate_kv_cache


def block_axes_order(t: torch.Tensor) -> tuple[int, ...]:
    """The axes of one block of `t` (dims 1..) in memory order, outermost first."""
    dims = list(range(1, t.dim()))
    return tuple(sorted(dims, key=lambda d: (-t.stride(d), d)))


def staging_like(entry, num_layers: int, num_blocks: int) -> list:
    """A shared-memory staging cache whose blocks hold the same bytes as the engine's: the
    logical shape of a block of `entry` (layer 0's tensor or (K, V) pair), laid out in its memory
    order. Staging has one such tensor, or two alike, per layer; anything else is refused."""
    pair = isinstance(entry, tuple)
    parts = entry if pair else (entry,)
    first = parts[0]
    if len(parts) > 2 or any((p.dtype, p.shape, block_axes_order(p))
                             != (first.dtype, first.shape, block_axes_order(first)) for p in parts):
        raise KvcachedError(f"KV parts {_blocks_spec(entry)} (dtype, shape) per layer: staging "
                            "holds one tensor, or a K/V pair of the same shape, dtype and memory "
                            "order, per layer")
    order = block_axes_order(first)
    dense = tuple(first.shape[d] for d in order)
    staging = allocate_kv_cache(num_layers, num_blocks, dense, first.dtype, device="cpu",
                                kv_pair=pair)
    back = [0] + [1 + order.index(d) for d in range(1, first.dim())]  # dense -> logical axes
    if pair:
        return [tuple(p.permute(*back) for p in layer) for layer in staging]
    return [layer.permute(*back) for layer in staging]


def kv_identity(t) -> tuple:
    """What makes two layers' KV the same memory viewed the same way."""
    if isinstance(t, (tuple, list)):
        return tuple(kv_identity(part) for part in t)
    return (str(t.device), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _blocks_spec(entry) -> list[tuple]:
    parts = entry if isinstance(entry, tuple) else (entry,)
    return [(str(p.dtype).removeprefix("torch."), tuple(p.shape)) for p in parts]


def check_same_blocks(names: list[str], entries: list) -> None:
    """What a daemon pages: every layer with layer 0's parts, each of the same dtype and shape
    (block count, kernel blocks, block shape). A model whose layers differ (KV heads or head
    size per layer) is refused here, before a mode is chosen: the daemon would refuse its
    registration, and staging, which has one shape, would fail at the first copy."""
    if not entries:
        raise KvcachedError("no KV layers to register: the engine has no KV cache for kvcached")
    first = _blocks_spec(entries[0])
    for name, entry in zip(names, entries):
        spec = _blocks_spec(entry)
        if spec != first:
            raise KvcachedError(
                f"layer {name}: KV {spec} (dtype, shape per part), layer {names[0]} has {first}: "
                "kvcached pages one block shape and dtype on every layer, so a model whose layers "
                "differ in KV heads or head size cannot use it")


def engine_blocks(name: str, t, num_blocks: int | None):
    """One layer's KV as the worker pages it: (a tensor, or a (K, V) pair, each [num_blocks,
    ...]; kernel blocks per block). A [2, num_blocks, ...] tensor is a K/V pair; a dim of
    num_blocks * r is r kernel blocks per block, folded into one [num_blocks, r, ...] view."""
    if isinstance(t, (tuple, list)):
        folded = [engine_blocks(name, part, num_blocks) for part in t]
        if len({f for _, f in folded}) > 1:
            raise KvcachedError(f"layer {name}: its K and V split blocks differently")
        return tuple(part for part, _ in folded), folded[0][1]
    if num_blocks is None:
        pair = t.dim() >= 2 and t.shape[0] == 2
        return ((t[0], t[1]) if pair else t), 1
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return (t[0], t[1]), 1
    if t.shape[0] == num_blocks:
        return t, 1
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] % num_blocks == 0:
        return engine_blocks(name, (t[0], t[1]), num_blocks)
    if t.dim() >= 2 and t.shape[0] % num_blocks == 0:
        return t.unflatten(0, (num_blocks, t.shape[0] // num_blocks)), t.shape[0] // num_blocks
    raise KvcachedError(f"layer {name}: KV shape {tuple(t.shape)} has no block dimension of "
                        f"{num_blocks} (or a multiple: kernel blocks) first; kvcached cannot page it")


def kv_device(entry) -> str:
    """The device type of a layer's KV (a tensor or a (K, V) pair)."""
    return (entry[0] if isinstance(entry, tuple) else entry).device.type


def unmappable_cuda_kv(reason) -> str:
    """Why CUDA KV the daemon cannot map is refused rather than staged: a CUDA daemon maps the
    engine's KV in place and refuses a CPU staging copy, so the engine would run uncached."""
    return (f"the daemon cannot map this CUDA KV cache ({reason}). A CUDA daemon copies into the "
            "engine's own KV over CUDA IPC and never stages through CPU memory, so kvcached "
            "would serve nothing: allocate the KV without expandable segments "
            "(PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True), in a layout whose "
            "blocks are contiguous (not LHBNC/BHLNC), from PyTorch's caching allocator (no "
            "pluggable allocator or sleep mode); or run the daemon with --device cpu and the "
            "connector with mode staging")
