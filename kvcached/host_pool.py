"""The host tier's memory: one flat buffer carved into host blocks, and their allocator.

A host block holds one device block's bytes for every layer and part. Two layouts:
- layer_first: for each (layer, part) a contiguous region `[num_host_blocks, part_bytes]`,
  mirroring the device (one gather/scatter per layer).
- page_first: one contiguous page per block, (layer, part) slices inside it (one object per
  block: the shape storage I/O wants).
Either way each (layer, part) is a 2-D uint8 view `[num_host_blocks, part_bytes]`, only the
strides differ, so the copy code is the same for both.

CPU mode: plain RAM. CUDA mode: the buffer is registered with cudaHostRegister in one call
(pinned and mapped), so no copy can span two registrations; a failed registration leaves
nothing registered and no sticky CUDA error (kvcached.cudart).
"""
from __future__ import annotations

import logging
import mmap
import time

import numpy as np
import torch

from kvcached_proto.layout import LayoutSpec

from . import cudart, numa

log = logging.getLogger(__name__)

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
        if device.startswith("cuda"):
            self._pin()
        log.info("[host] %.2f GiB host pool ready in %.2f s (%s, %s)",
                 capacity_bytes / 2**30, time.monotonic() - started, device, layout)
        self.spec: LayoutSpec | None = None
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
        cudart.register_all(self._rt, ptr, self.capacity_bytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
        log.info("[host] pinned %.1f GiB in %.2f s", self.capacity_bytes / 2**30,
                 time.monotonic() - started)
        self._pinned_ptr = ptr

    def device_views(self, device, widen=lambda t: t) -> list[list[torch.Tensor]]:
        """The host views as the GPU addresses them, for zero-copy kernels: at the device
        address cudaHostGetDevicePointer gives for the registered pool (the host address only
        where the device can use host pointers for registered memory)."""
        if self._pinned_ptr is None:
            raise RuntimeError("the host pool is not pinned (CUDA daemons only)")
        dev_ptr = cudart.device_address(self._rt, self._pinned_ptr)
        flat = torch.as_tensor(_CudaArray(dev_ptr, self.capacity_bytes), device=device)
        return [[widen(flat.as_strided(v.shape, v.stride(), v.data_ptr() - self._pinned_ptr))
                 for v in row] for row in self.views]

    def configure(self, spec: LayoutSpec) -> bool:
        """Carve the buffer for this layout. Returns False when the old content stays valid."""
        if self.spec is not None and self.spec.geometry() == spec.geometry():
            self.spec = spec
            return False
        self.spec = spec
        self.page_bytes = spec.page_bytes
        n = self.capacity_bytes // self.page_bytes
        self.allocator = BlockAllocator(n)
        self.views = []
        part_bytes = [p.block_bytes for p in spec.parts]
        offset = 0
        for _layer in range(spec.num_layers):
            row = []
            for pb in part_bytes:
                if self.layout == "layer_first":
                    view = self.buffer[offset : offset + n * pb].view(n, pb)
                    offset += n * pb
                else:
                    base = self.buffer[offset : offset + max(n - 1, 0) * self.page_bytes + pb]
                    view = base.as_strided((n, pb), (self.page_bytes, 1))
                    offset += pb
                row.append(view)
            self.views.append(row)
        self._rows = [v.numpy() for row in self.views for v in row]  # page order, made once
        log.info("[host] %d host blocks of %d bytes (%s)", n, self.page_bytes, self.layout)
        return True

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
            err = self._rt.host_unregister(self._pinned_ptr)
            if err:
                self._rt.get_last_error()
                log.warning("[host] cudaHostUnregister: %s", self._rt.error_string(err))
            self._pinned_ptr = None
        self.views = []
        self.buffer = self._flat = None  # the mmap goes with the last view that references it
