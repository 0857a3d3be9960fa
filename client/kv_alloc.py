"""Allocating the engine's KV cache where the daemon can map it, and describing it.

CPU: one POSIX shared-memory segment `/kvcached.{uid}.kv.{pid}.{n}` per allocation, owned by
this process and unlinked when the tensors are garbage collected or the process exits (a
daemon sweeps the segments of engines that were killed). n is random: /dev/shm is everyone's,
and a name another user could guess (a count from 0) they could take first, failing the
engine's allocation. CUDA: ordinary device memory, exported to the daemon as CUDA IPC handles.
"""
from __future__ import annotations

import math
import mmap
import os
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import posix_ipc

if TYPE_CHECKING:  # imported lazily at run time: the CLI uses this package without torch
    import torch

from kvcached_proto.errors import KvcachedError
from kvcached_proto.geometry import gpu_uuid
from kvcached_proto.layout import DTYPE_BYTES
from kvcached_proto import shm_room
from kvcached_proto.paths import kv_segment_name

from .forks import current_pid

_lock = threading.Lock()
NAME_TRIES = 8  # random names taken already (by chance, or planted) before an allocation fails


@dataclass
class _Segment:
    name: str
    base: int
    size: int
    mm_ref: weakref.ref


_segments: dict[str, _Segment] = {}  # entries whose mapping is gone are pruned under _lock


def _unlink(name: str) -> None:
    """The segment's finalizer. It runs wherever a garbage collection happens - possibly on a
    thread that holds _lock, in the middle of a walk over _segments - so it takes no lock and
    touches nothing shared (taking _lock here deadlocked register_kv_cache)."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass  # already swept (e.g. by the daemon after a restart); nothing left to free


def _unlink_mine(name: str, owner: int) -> None:
    """The finalizer of a segment `owner` made: in a child it forked (which drops the tensors it
    inherited, or exits through the interpreter) the parent's segment stays (forks.py)."""
    if current_pid() == owner:
        _unlink(name)


def unlink_kv_cache(tensors) -> int:
    """Unlink the shared-memory segments under these CPU tensors now (their mappings stay valid
    until dropped): an engine that may be killed right after its shutdown hook leaves nothing in
    /dev/shm. Returns how many segments it named."""
    ptrs = [t.data_ptr() for item in tensors for t in (item if isinstance(item, (list, tuple)) else [item])]
    with _lock:
        names = {s.name for s in _live_segments() for p in ptrs if s.base <= p < s.base + s.size}
    for name in names:
        _unlink(name)
    return len(names)


def _live_segments() -> list[_Segment]:
    """(With _lock held.) The segments whose mapping is alive; prunes the others."""
    live = []
    for name, seg in list(_segments.items()):
        if seg.mm_ref() is None:
            del _segments[name]
        else:
            live.append(seg)
    return live


def dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise KvcachedError(f"KV dtype {dtype} is not supported; use one of {sorted(DTYPE_BYTES)}")
    return name


def _reserve(fd: int, nbytes: int) -> None:
    """Take the segment's memory now: a sparse one on a /dev/shm without room would kill the
    engine with SIGBUS at its first KV write (Docker's default /dev/shm is 64 MiB)."""
    try:
        shm_room.reserve(fd, nbytes, "KV cache")
    except shm_room.NoShmRoom as exc:
        raise KvcachedError(f"{exc.strerror}; {shm_room.ADVICE}") from None


def _shared_cpu_buffer(nbytes: int) -> tuple[mmap.mmap, str]:
    for _ in range(NAME_TRIES):
        name = kv_segment_name(os.getuid(), os.getpid(), secrets.randbits(62))
        try:
            shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=nbytes)
            break
        except posix_ipc.ExistentialError:
            continue
    else:
        raise KvcachedError(f"{NAME_TRIES} random shared-memory names were all taken already; "
                            "see who fills /dev/shm with kvcached.* segments")
    try:
        _reserve(shm.fd, nbytes)
        mm = mmap.mmap(shm.fd, nbytes)
    except BaseException:
        posix_ipc.unlink_shared_memory(name)
        raise
    finally:
        shm.close_fd()
    weakref.finalize(mm, _unlink_mine, name, current_pid())
    return mm, name


def allocate_kv_buffer(nbytes: int, device: str = "cpu"):
    """One flat uint8 allocation the daemon can map, for engines that lay their KV cache out
    themselves (as strided views of one allocation, the way vLLM 0.32 does): on CPU a kvcached
    shared-memory segment, on CUDA ordinary device memory. Zero-filled."""
    import torch

    if str(device).startswith("cuda"):
        _check_cuda_allocator()
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if device != "cpu":
        raise KvcachedError(f"device {device!r}: expected 'cpu' or 'cuda:N'")
    mm, name = _shared_cpu_buffer(nbytes)
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    with _lock:
        _live_segments()  # prune: a dead segment's address range may be this one's now
        _segments[name] = _Segment(name, flat.data_ptr(), nbytes, weakref.ref(mm))
    return flat


def allocate_kv_cache(num_layers: int, num_blocks: int, block_shape, dtype=None,
                      device: str = "cpu", kv_pair: bool = True) -> list:
    """One entry per layer: a (K, V) tuple of `[num_blocks, *block_shape]` tensors, or one
    tensor when kv_pair=False (MLA). `t[block_ids]` selects blocks. dtype defaults to bfloat16."""
    import torch  # imported here: the CLI uses this package without paying torch's import

    dtype = torch.bfloat16 if dtype is None else dtype
    block_shape = tuple(int(s) for s in block_shape)
    shape = (num_blocks, *block_shape)
    per_layer = 2 if kv_pair else 1
    # one allocation carved per layer and part, on CUDA as on CPU: one export, and a model of
    # any depth registers (one allocation per K and per V took 2 x layers of them)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    tensor_bytes = math.prod(shape) * itemsize
    flat = allocate_kv_buffer(tensor_bytes * per_layer * num_layers, device)
    out = []
    for layer in range(num_layers):
        views = []
        for p in range(per_layer):
            start = (layer * per_layer + p) * tensor_bytes
            views.append(flat[start : start + tensor_bytes].view(dtype).view(shape))
        out.append(tuple(views) if kv_pair else views[0])
    return out


def _check_cuda_allocator() -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise KvcachedError(
            "PyTorch expandable segments are on (PYTORCH_CUDA_ALLOC_CONF): their memory cannot be "
            "exported over CUDA IPC; allocate the KV cache with expandable_segments:False")


def _shm_allocation(t: torch.Tensor, span: tuple[int, int]) -> tuple[tuple, dict, int]:
    lo, hi = span
    with _lock:
        for seg in _live_segments():
            if seg.base <= lo and hi <= seg.base + seg.size:
                return ("shm", seg.name), {"kind": "shm", "name": seg.name, "size": seg.size}, seg.base
    raise KvcachedError(
        "CPU KV tensors must come from kvcached_client.allocate_kv_cache or allocate_kv_buffer "
        "(POSIX shared memory the daemon can map)")


def _expandable_ranges() -> list[tuple[int, int]]:
    """Address ranges of the caching allocator's expandable segments (its memory snapshot
    marks them); empty where this torch does not say."""
    import torch

    try:
        return [(s["address"], s["address"] + s["total_size"])
                for s in torch.cuda.memory_snapshot() if s.get("is_expandable")]
    except (RuntimeError, KeyError, TypeError):
        return []


class CudaExports:
    """The CUDA IPC handle of each storage, exported once per process: every `_share_cuda_()`
    makes a new IPC event and ref-counter entry the caching allocator keeps (past ~1,000 the
    engine synchronizes on every share), and a registration, a describe and every reattach ask
    again. An entry holds a weak reference to a tensor of its storage: while that tensor lives
    on the same storage, the address cannot name another allocation."""

    def __init__(self, share=lambda storage: storage._share_cuda_()):
        self._share = share
        self._done: dict[tuple, tuple] = {}  # (device, ptr, nbytes) -> (weakref, handle)

    def handle(self, t: torch.Tensor) -> dict:
        storage = t.untyped_storage()
        key = (t.device.index, storage.data_ptr(), storage.nbytes())
        hit = self._done.get(key)
        if hit is not None:
            owner = hit[0]()
            if owner is not None and owner.untyped_storage().data_ptr() == key[1]:
                return hit[1]
        (device, handle, storage_size, storage_offset, ref_handle, ref_offset, _event,
         _sync) = self._share(storage)
        exported = {
            "kind": "cuda_ipc", "device": device, "handle": handle, "storage_size": storage_size,
            "storage_offset": storage_offset, "ref_counter_handle": ref_handle,
            "ref_counter_offset": ref_offset, "event_handle": b"", "event_sync_required": False}
        self._done = {k: v for k, v in self._done.items() if v[0]() is not None}
        self._done[key] = (weakref.ref(t), exported)
        return exported


EXPORTS = CudaExports()


def _cuda_allocation(t: torch.Tensor, expandable: list[tuple[int, int]],
                     exported: dict) -> tuple[tuple, dict, int]:
    """(key, IPC handle, base address) of the storage behind `t` (`exported` keeps this
    describe's: vLLM's views of one allocation share one)."""
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    if ptr in exported:
        return ("cuda", ptr), exported[ptr], ptr
    if any(lo <= ptr < hi for lo, hi in expandable):
        raise KvcachedError(
            "this CUDA tensor lives in a PyTorch expandable segment, which the daemon cannot map "
            "over CUDA IPC; allocate the KV cache with expandable_segments:False "
            "(kvcached_client.allocate_kv_cache does)")
    try:
        exported[ptr] = EXPORTS.handle(t)
    except RuntimeError as exc:
        raise KvcachedError(
            f"this CUDA tensor cannot be exported over CUDA IPC ({exc}); memory from PyTorch "
            "expandable segments cannot be shared: set expandable_segments:False") from None
    return ("cuda", ptr), exported[ptr], ptr


def block_order(t: torch.Tensor, where: str) -> tuple[int, ...]:
    """The axes of one block (all but axis 0) from outermost to innermost in memory, checking
    that a block's elements are one contiguous run: what a region needs."""
    dims = sorted(((t.stride(i), i) for i in range(1, t.dim()) if t.shape[i] > 1), reverse=True)
    expect = 1
    for stride, i in reversed(dims):
        if stride != expect:
            raise KvcachedError(
                f"{where}: a block's bytes are not one contiguous run (shape {tuple(t.shape)}, "
                f"strides {t.stride()}): this layout cannot be registered (vLLM's LHBNC and "
                "BHLNC interleave blocks within a head)")
        expect *= t.shape[i]
    if t.shape[0] > 1 and t.stride(0) < expect:
        raise KvcachedError(f"{where}: block stride {t.stride(0)} < {expect} elements of a "
                            "block: blocks overlap")
    return tuple(i for _, i in dims)


def _span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _region(t: torch.Tensor, where: str, allocation) -> tuple[tuple, dict, dict, tuple]:
    """(allocation key, its handle, the entry's region fields, the block's axis order) of one
    (layer, part) tensor."""
    if t.dim() < 2 or t.shape[0] < 1:
        raise KvcachedError(f"{where}: expected [num_blocks, ...] with at least one block")
    order = block_order(t, where)
    key, handle, base = allocation(t)
    block_bytes = math.prod(t.shape[1:]) * t.element_size()
    stride = t.stride(0) * t.element_size() if t.shape[0] > 1 else block_bytes
    return key, handle, {"offset": t.data_ptr() - base, "block_stride": stride}, order


def describe_kv_cache(tensors) -> dict:
    """The `register_kv` layout (kvcached_proto.layout) of a list per layer of (K, V) pairs or
    single tensors, each `[num_blocks, ...]` and any view whose blocks are a constant stride
    apart with each block's bytes contiguous (vLLM's strided per-layer views included)."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise KvcachedError("KV cache: expected a non-empty list with one entry per layer")
    import torch

    entries, allocs, index, orders, exported = [], [], {}, [], {}
    device = num_blocks = expandable = None
    for layer, item in enumerate(tensors):
        parts = list(item) if isinstance(item, (list, tuple)) else [item]
        for part, t in enumerate(parts):
            where = f"layer {layer} part {part}"
            if not isinstance(t, torch.Tensor):
                raise KvcachedError(f"{where}: not a tensor")
            dev = "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index}"
            if device is None:
                device, num_blocks = dev, t.shape[0]
            if dev != device:
                raise KvcachedError(f"{where}: on {dev}, layer 0 is on {device}")
            if dev != "cpu" and expandable is None:
                expandable = _expandable_ranges()
            allocation = ((lambda x: _shm_allocation(x, _span(x))) if dev == "cpu"
                          else (lambda x: _cuda_allocation(x, expandable, exported)))
            key, handle, region, order = _region(t, where, allocation)
            if key not in index:
                index[key] = len(allocs)
                allocs.append(handle)
            if layer == 0:
                orders.append(order)
            elif order != orders[part]:
                raise KvcachedError(f"{where}: its block's axes are ordered {order} in memory, "
                                    f"layer 0's {orders[part]}")
            entry = {"layer": layer, "part": part, "name": _part_name(len(parts), part),
                     "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                     "alloc": index[key], **region}
            entries.append(entry)
    layout = {"device": device, "num_layers": len(tensors), "num_blocks": num_blocks,
              "kv_layout": "|".join(",".join(map(str, o)) for o in orders),
              "allocations": allocs, "tensors": entries}
    if device != "cpu":
        layout["gpu_uuid"] = gpu_uuid(int(device.partition(":")[2]))
    return layout


def _part_name(num_parts: int, part: int) -> str:
    if num_parts == 1:
        return "latent"
    if num_parts == 2:
        return "kv"[part]
    return f"part{part}"
