"""The host tier's memory: one flat buffer carved into host blocks, and their allocator.

A host block holds one device block's bytes for every layer and part. Two layouts:
- layer_first: for each (layer, part) a contiguous region `[num_host_blocks, part_bytes]`,
  mirroring the device (one gather/scatter per layer).
- page_first: one contiguous page per block, (layer, part) slices inside it (one object per
  block: the shape storage I/O wants).
Either way each (layer, part) is a 2-D uint8 view `[num_host_blocks, part_bytes]`, only the
strides differ, so the copy code is the same for both.

CPU mode: plain RAM. CUDA mode: the buffer is registered with cudaHostRegister in one call
(pinned and mapped), so no copy can span two registrations. When one call cannot take it, the
pool is registered in parts once the KV layout is known, cut only at block boundaries
(pin_plan), and the copy plans split runs at the cuts (`block_cuts`). A failed registration
leaves nothing registered and no sticky CUDA error (kvcached.cudart).
"""
from __future__ import annotations

import logging
import mmap
import time

import numpy as np
import torch

from kvcached_proto.layout import LayoutSpec

from . import cudart, numa, pin_plan

log = logging.getLogger(__name__)

MIN_PIN_PART_BYTES = 1 << 30  # halving the part size stops here
# pinned for every context, mapped for the device
CUDA_HOST_REGISTER_PORTABLE_MAPPED = cudart.CUDA_HOST_REGISTER_PORTABLE | cudart.CUDA_HOST_REGISTER_MAPPED


class _CudaArray:
    """`__cuda_array_interface__` over a device-addressable range (torch.as_tensor reads it)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


class DoubleFree(RuntimeError):
    pass


class BlockAllocator:
    """O(1) alloc and free of block ids, with double-free detection.

    Freed ids are pushed so that the next pops come out ascending: blocks allocated together
    tend to be contiguous, which lets copies run as one slice instead of a gather.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        n = min(n, len(self._free))
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._used[b] = 1
        return out

    def free(self, blocks) -> None:
        blocks = sorted(blocks, reverse=True)
        for b in blocks:
            if not self._used[b]:
                raise DoubleFree(f"host block {b} freed twice")
        for b in blocks:
            self._used[b] = 0
            self._free.append(b)

    def is_used(self, block: int) -> bool:
        return bool(self._used[block])


class HostPool:
    def __init__(self, capacity_bytes: int, device: str, layout: str = "layer_first",
                 numa_node: int | None = None):
        self.capacity_bytes = capacity_bytes
        self.device = device
        self.layout = layout
        started = time.monotonic()
        # Anonymous mmap rather than the allocator: page-aligned, huge pages where the kernel
        # allows them (fewer TLB misses on scattered block copies), and the same memory that
        # cudaHostRegister pins in CUDA mode.
        self._mm = mmap.mmap(-1, capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        self.buffer = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.numa_node = numa_node
        if numa_node is not None:
            numa.bind(self.buffer.data_ptr(), capacity_bytes, numa_node)
        self._flat = self.buffer.numpy()
        self._prefault()
        self._pinned_ptr = None
        self._rt: cudart.Runtime | None = None
        self._parts: list[tuple[int, int]] = []  # registered (offset, size)
        self._pin_deferred = False
        self.block_cuts: list[list[list[int]]] | None = None  # per layer, part: see pin_plan
        self._regions: list[list[pin_plan.Region]] = []  # the current layout's, per layer, part
        if device.startswith("cuda"):
            self._pin()
        log.info("[host] %.2f GiB host pool ready in %.2f s (%s, %s)",
                 capacity_bytes / 2**30, time.monotonic() - started, device, layout)
        self.spec: LayoutSpec | None = None
        self.geometry: bytes | None = None  # spec.geometry_digest(): what its pages' bytes mean
        self.views: list[list[torch.Tensor]] = []
        self.allocator = BlockAllocator(0)
        self.page_bytes = 0

    def _prefault(self) -> None:
        """Touch every page once now, so copies never pay page faults (and the memory the
        operator configured is really there from the start)."""
        flat = np.frombuffer(self._mm, dtype=np.uint8)
        step = 1 << 30
        for start in range(0, self.capacity_bytes, step):
            flat[start : start + step : 4096] = 0
            if self.capacity_bytes > 4 * step:
                log.info("[host] touched %.0f / %.0f GiB", min(start + step, self.capacity_bytes) / 2**30,
                         self.capacity_bytes / 2**30)
        del flat

    def _pin(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {self.device}: this torch sees no CUDA device")
        if torch.device(self.device).index is not None:
            torch.cuda.set_device(torch.device(self.device))  # the daemon's context on its GPU
        torch.cuda.init()
        self._rt = cudart.LibCudart()
        ptr = self.buffer.data_ptr()
        started = time.monotonic()
        self._pinned_ptr = ptr
        try:
            cudart.register_all(self._rt, ptr, self.capacity_bytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
        except RuntimeError as exc:
            log.warning("[host] %s; registering it in parts cut at block boundaries once the KV "
                        "layout is known", exc)
            self._pin_deferred = True
            return
        self._parts = [(0, self.capacity_bytes)]
        log.info("[host] pinned %.1f GiB in %.2f s", self.capacity_bytes / 2**30,
                 time.monotonic() - started)

    def _pin_in_parts(self, regions: list[pin_plan.Region]) -> None:
        """Register the pool in parts no block straddles, halving the part size from half the
        pool down to MIN_PIN_PART_BYTES until every part registers."""
        self._unpin()
        ceiling = self.capacity_bytes // 2
        failed = "no part size tried"
        while ceiling >= MIN_PIN_PART_BYTES:
            try:
                parts = pin_plan.chunks(regions, self.capacity_bytes, ceiling)
            except ValueError as exc:
                failed = str(exc)
            else:
                failed = cudart.register_parts(self._rt, self._pinned_ptr, parts,
                                               CUDA_HOST_REGISTER_PORTABLE_MAPPED)
                if not failed:
                    self._parts = parts
                    log.info("[host] pinned %.1f GiB in %d parts of at most %.1f GiB",
                             self.capacity_bytes / 2**30, len(parts), ceiling / 2**30)
                    return
            ceiling //= 2
        raise RuntimeError(f"the {self.capacity_bytes / 2**30:.1f} GiB host pool could not be "
                           f"registered with CUDA, whole or in parts ({failed}); nothing is left "
                           "registered. Lower --host-cache-gb, or raise the locked-memory limit")

    def _unpin(self) -> None:
        for offset, _ in reversed(self._parts):
            err = self._rt.host_unregister(self._pinned_ptr + offset)
            if err:
                self._rt.get_last_error()
                log.warning("[host] cudaHostUnregister: %s", self._rt.error_string(err))
        self._parts = []

    def device_views(self, device, widen=lambda t: t) -> list[list[torch.Tensor]]:
        """The host views as the GPU addresses them, for zero-copy kernels: at the device
        address cudaHostGetDevicePointer gives for the registered pool (the host address only
        where the device can use host pointers for registered memory)."""
        if self._pinned_ptr is None:
            raise RuntimeError("the host pool is not pinned (CUDA daemons only)")
        if not self._parts:
            raise RuntimeError("the host pool is not registered with CUDA")
        dev_ptr = cudart.device_address(self._rt, self._pinned_ptr)
        for offset, _ in self._parts[1:]:  # one flat view needs one run of device addresses
            if cudart.device_address(self._rt, self._pinned_ptr + offset) != dev_ptr + offset:
                raise RuntimeError("zero_copy: the host pool is registered in parts whose device "
                                   "addresses are not contiguous; use --copy-strategy gather")
        flat = torch.as_tensor(_CudaArray(dev_ptr, self.capacity_bytes), device=device)
        return [[widen(flat.as_strided(v.shape, v.stride(), v.data_ptr() - self._pinned_ptr))
                 for v in row] for row in self.views]

    def configure(self, spec: LayoutSpec) -> bool:
        """Carve the buffer for this layout. Returns False when the old content stays valid.
        A pool registered with CUDA in parts is registered anew for the new layout's blocks; if
        that fails, the old layout's registration is made again and the pool is left as it was
        (RuntimeError)."""
        if self.spec is not None and self.spec.geometry() == spec.geometry():
            self.spec = spec
            return False
        n = self.capacity_bytes // spec.page_bytes
        views, regions = self._carve(spec, n)
        if self._pin_deferred:
            try:
                self._pin_in_parts(list(set(r for row in regions for r in row)))
            except RuntimeError:
                if self._regions:  # the registration the current layout's copies rely on
                    self._pin_in_parts(list(set(r for row in self._regions for r in row)))
                raise
            cuts = [offset for offset, _ in self._parts[1:]]
            self.block_cuts = [[pin_plan.block_cuts(r, cuts) for r in row] for row in regions]
        self.spec, self.geometry, self.page_bytes = spec, spec.geometry_digest(), spec.page_bytes
        self.allocator = BlockAllocator(n)
        self.views, self._regions = views, regions
        self._rows = [v.numpy() for row in self.views for v in row]  # page order, made once
        log.info("[host] %d host blocks of %d bytes (%s)", n, self.page_bytes, self.layout)
        return True

    def _carve(self, spec: LayoutSpec, n: int) -> tuple[list, list]:
        """(views per layer and part, their pin_plan regions) of n blocks of this layout."""
        views, regions = [], []
        offset = 0
        for _layer in range(spec.num_layers):
            row, region_row = [], []
            for pb in (p.block_bytes for p in spec.parts):
                if self.layout == "layer_first":
                    view = self.buffer[offset : offset + n * pb].view(n, pb)
                    region_row.append(pin_plan.Region(offset, pb, n))
                    offset += n * pb
                else:
                    base = self.buffer[offset : offset + max(n - 1, 0) * spec.page_bytes + pb]
                    view = base.as_strided((n, pb), (spec.page_bytes, 1))
                    region_row.append(pin_plan.Region(0, spec.page_bytes, n))
                    offset += pb
                row.append(view)
            views.append(row)
            regions.append(region_row)
        return views, regions

    def _np_rows(self) -> list[np.ndarray]:
        return self._rows

    def page_pieces(self, block: int) -> list[memoryview]:
        """One host block's bytes in page order, as writable views (no copy): the whole page
        for page_first, one slice per (layer, part) for layer_first."""
        if self.layout == "page_first":
            start = block * self.page_bytes
            return [memoryview(self._flat[start : start + self.page_bytes])]
        return [memoryview(rows[block]) for rows in self._np_rows()]

    def read_page(self, block: int, out: np.ndarray) -> None:
        """Copy one host block (every layer and part, in page order) into `out` (write_back
        saves evicted blocks this way before their memory is reused)."""
        if self.layout == "page_first":
            start = block * self.page_bytes
            out[:] = self._flat[start : start + self.page_bytes]
            return
        off = 0
        for rows in self._np_rows():
            pb = rows.shape[1]
            out[off : off + pb] = rows[block]
            off += pb

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def used_bytes(self) -> int:
        return (self.allocator.num_blocks - self.allocator.num_free) * self.page_bytes

    def close(self) -> None:
        if self._pinned_ptr is not None:
            self._unpin()
            self._pinned_ptr = None
        self.views = []
        self.buffer = self._flat = None  # the mmap goes with the last view that references it
