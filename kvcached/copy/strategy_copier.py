"""The copy strategies (strategies.py, dma.py) as a copier, on any device: `--copy-strategy`
runs, gather, zero_copy, dma, or auto (runs when the ids come in long runs, else gather). On CPU it
is how CI drives the CUDA copier's code through a real daemon; transfer_cuda.CudaCopier adds
the streams and the order words."""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvcached_proto.block_runs import fragmented, paired_runs

from . import dma
from . import strategies as cs
from .transfer import CopierHooks, CopyPlan, TaskKind

STAGING_BYTES = 64 << 20  # per direction: bounds the device memory taken from the engine
DMA_SPLIT_MIN = 64  # dma: copies per thread under which a layer is queued by one thread


class StrategyCopier(CopierHooks):
    """The torch strategies over [blocks, bytes] views; see strategies.py."""

    non_blocking = False

    def __init__(self, dev_views, host_views, strategy: str, cuts=None, dma_threads: int = 1):
        """cuts: per layer and part, the host block ids at which a later host-pool
        registration starts (a pool registered in several calls); runs are split there.
        dma_threads: threads that queue a dma layer's copies, each its share (`_queue`)."""
        self.strategy = strategy
        self.dma_threads = max(1, int(dma_threads))
        self._dma_pools: dict[str, ThreadPoolExecutor] = {}
        self.cuts = cuts or None
        self.dev = [[cs.widen(t) for t in row] for row in dev_views]
        self.host = [[cs.widen(t) for t in row] for row in host_views]
        self.host_view = self.host  # zero_copy's device-addressable host rows (CPU: the same)
        self.device = self.dev[0][0].device
        self.host_contiguous = all(cs.rows_contiguous(t) for t in host_views[0])
        self._staging: dict[str, torch.Tensor] = {}
        self.memcpy = dma.HostMemcpy()  # the dma strategy's copies (CudaCopier: the runtime's)

    def _stream(self, kind: str):
        return contextlib.nullcontext()

    def _stream_handle(self, kind: str) -> int:
        return 0

    def _pick(self, plan: CopyPlan) -> str:
        if self.strategy != "auto":
            return self.strategy
        return "gather" if fragmented(len(plan.extra["pairs"]), len(plan.dev_ids)) else "runs"

    def plan(self, kind: str, dev_ids: np.ndarray, host_ids: np.ndarray) -> CopyPlan:
        plan = CopyPlan.make(dev_ids, host_ids)
        if self.host_contiguous:
            plan.extra["pairs"] = paired_runs(dev_ids, host_ids)
        else:
            plan.extra["pairs"] = [(int(d), int(h), 1) for d, h in zip(dev_ids, host_ids)]
        plan.extra["strategy"] = strategy = self._pick(plan)
        if strategy in ("gather", "zero_copy"):
            with self._stream(kind):  # small index copies, ordered before the copies that use them
                plan.extra["dev_index"] = self._index(dev_ids)
                plan.extra["host_index"] = self._index(host_ids)
            plan.extra["host_runs"] = cs.host_runs_for(plan.runs, self.host_contiguous)
        return plan

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        """Block ids on the copier's device. On CUDA from pinned memory, non-blocking: a copy
        from pageable memory would make the CPU wait for the stream (and so serialise an
        offload behind the engine work its event waits for); the caching host allocator keeps
        the pinned buffer until the copy has run."""
        ids = torch.from_numpy(np.ascontiguousarray(ids))
        if self.device.type != "cuda":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def staging(self, kind: str, like: torch.Tensor) -> torch.Tensor:
        """One staging buffer per direction, viewed as rows like `like`'s. Every part and
        layer of a direction reuses it: its copies are ordered on the direction's stream."""
        flat = self._staging.get(kind)
        if flat is None:
            flat = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=self.device)
            self._staging[kind] = flat
        row_bytes = like.shape[1] * like.element_size()
        rows = max(1, STAGING_BYTES // row_bytes)
        if rows * row_bytes > flat.numel():  # one row larger than the buffer
            flat = self._staging[kind] = torch.empty(row_bytes, dtype=torch.uint8, device=self.device)
        return flat[: rows * row_bytes].view(like.dtype).view(rows, like.shape[1])

    def warm_up(self) -> None:
        """Launch every kernel the copies will launch once now, on two blocks of scratch memory
        shaped like each distinct (dtype, row, block stride) of the engine's views, before any
        fence wait is queued: under CUDA's lazy module loading a kernel's first launch loads its
        module, and behind a queued fence wait that load blocks the launching thread (the GIL
        held) until the engine's forward ends. Touches neither the engine's KV nor the pool."""
        done = set()
        for dev in (t for row in self.dev for t in row):
            shape = (dev.dtype, dev.shape[1], dev.stride(0))
            if shape not in done:
                done.add(shape)
                for kind in (TaskKind.OFFLOAD, TaskKind.LOAD):
                    with self._stream(kind):
                        self._warm(kind, dev)
        for kind in (TaskKind.OFFLOAD, TaskKind.LOAD):
            self.sync(kind)

    def _warm(self, kind: str, like: torch.Tensor) -> None:
        width, stride = like.shape[1], max(like.stride(0), like.shape[1])
        flat = torch.zeros(stride + width, dtype=like.dtype, device=self.device)
        dev = flat.as_strided((2, width), (stride, 1))
        host = torch.zeros((2, width), dtype=like.dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()
        stand_in = torch.zeros((2, width), dtype=like.dtype, device=self.device)  # zero_copy's host rows
        ids = self._index(np.array([1, 0]))
        pairs, runs = [(0, 1, 1), (1, 0, 1)], [(0, 1, 1), (1, 2, 0)]
        out = kind == TaskKind.OFFLOAD
        for strategy in (("runs", "gather") if self.strategy == "auto" else (self.strategy,)):
            if strategy == "runs":
                (cs.offload_runs if out else cs.load_runs)(dev, host, pairs, self.non_blocking)
            elif strategy == "gather":
                (cs.offload_gather if out else cs.load_gather)(
                    dev, host, ids, runs, self.staging(kind, like), self.non_blocking)
            elif strategy == "zero_copy":
                (cs.offload_zero_copy if out else cs.load_zero_copy)(
                    dev, stand_in, ids, ids, self.staging(kind, like))  # dma: no kernel to warm

    def offload_layer(self, layer: int, plan: CopyPlan) -> int:
        return self._layer(TaskKind.OFFLOAD, layer, plan)

    def load_layer(self, layer: int, plan: CopyPlan) -> int:
        return self._layer(TaskKind.LOAD, layer, plan)

    def _layer(self, kind: str, layer: int, plan: CopyPlan) -> int:
        x, moved = plan.extra, 0
        if x["strategy"] == "dma":
            return self._dma(kind, layer, plan)
        with self._stream(kind):
            for part, (dev, host) in enumerate(zip(self.dev[layer], self.host[layer])):
                cuts = self.cuts[layer][part] if self.cuts else ()
                if x["strategy"] == "runs":
                    fn = cs.offload_runs if kind == TaskKind.OFFLOAD else cs.load_runs
                    fn(dev, host, cs.split_pairs(x["pairs"], cuts), self.non_blocking)
                elif x["strategy"] == "gather":
                    fn = cs.offload_gather if kind == TaskKind.OFFLOAD else cs.load_gather
                    fn(dev, host, x["dev_index"], cs.split_host_runs(x["host_runs"], cuts),
                       self.staging(kind, dev), self.non_blocking)
                else:
                    fn = cs.offload_zero_copy if kind == TaskKind.OFFLOAD else cs.load_zero_copy
                    fn(dev, self.host_view[layer][part], x["dev_index"], x["host_index"],
                       self.staging(kind, dev))
                moved += len(plan.dev_ids) * dev.shape[1] * dev.element_size()
        return moved

    def _dma(self, kind: str, layer: int, plan: CopyPlan) -> int:
        """Every part's copies of the layer in one call to the runtime (dma.py). The offsets
        are the plan's, computed once for rows of the same shape (every layer, usually): a
        layer adds its bases (computing them per layer cost 0.3-0.7 ms of CPU a layer for
        1,000 scattered blocks)."""
        lists, known = [], plan.extra.setdefault("dma_offsets", {})
        for part, (dev, host) in enumerate(zip(self.dev[layer], self.host[layer])):
            cuts = self.cuts[layer][part] if self.cuts else ()
            d, h = dma.rows_of(dev), dma.rows_of(host)
            shape = (tuple(cuts), d.stride, d.width, h.stride, h.width)
            offs = known.get(shape)
            if offs is None:
                offs = known[shape] = dma.offsets(cs.split_pairs(plan.extra["pairs"], cuts), d, h)
            lists.append(dma.at(offs, d, h, kind == TaskKind.OFFLOAD))
        dsts, srcs, sizes = dma.concat(lists)
        self._queue(kind, dsts, srcs, sizes)
        return int(sizes.sum())

    def _queue(self, kind: str, dsts, srcs, sizes) -> None:
        """A layer's copies on the direction's stream; with dma_threads > 1 (and at least
        DMA_SPLIT_MIN copies a thread) cut in shares, the first queued by this thread, each
        other by a helper thread on a stream of its own that starts after the direction's
        stream's work so far (its fence wait), and the direction's stream waits for them all
        before what comes next (the layer's word): the runtime's per-copy CPU cost is paid in
        parallel where the runtime takes calls from several threads at once."""
        n = min(self.dma_threads, len(sizes) // DMA_SPLIT_MIN)
        if n <= 1:
            with self._stream(kind):
                self.memcpy.copy(dsts, srcs, sizes, self._stream_handle(kind))
            return
        cuts = np.linspace(0, len(sizes), n + 1).astype(np.int64).tolist()
        shares = [(dsts[a:b], srcs[a:b], sizes[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        pool = self._dma_pools.get(kind)
        if pool is None:
            pool = self._dma_pools[kind] = ThreadPoolExecutor(
                self.dma_threads - 1, thread_name_prefix=f"kvcached-dma-{kind}")
        self._fork(kind, n - 1)
        futures = [pool.submit(self._helper_copy, kind, i, *share) for i, share in enumerate(shares[1:])]
        try:
            with self._stream(kind):
                self.memcpy.copy(*shares[0], self._stream_handle(kind))
        finally:  # whatever the helpers queued is waited for before the task's end
            errors = [f.exception() for f in futures]
            self._join(kind, n - 1)
        if any(errors):
            raise next(e for e in errors if e is not None)

    def _helper_copy(self, kind: str, i: int, dsts, srcs, sizes) -> None:
        with self._helper_device():
            self.memcpy.copy(dsts, srcs, sizes, self._helper_handle(kind, i))

    # the helper threads' streams: none on CPU (CudaCopier: one a helper and direction)
    def _fork(self, kind: str, n: int) -> None:
        pass

    def _join(self, kind: str, n: int) -> None:
        pass

    def _helper_handle(self, kind: str, i: int) -> int:
        return 0

    def _helper_device(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        for pool in self._dma_pools.values():
            pool.shutdown(wait=True)
        self._dma_pools.clear()
        self._staging.clear()
        self.dev = self.host = self.host_view = []  # the registration can be unmapped now
