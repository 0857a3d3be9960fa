"""The copier for a registration (`make_copier`), and the CUDA one: strategy_copier's
StrategyCopier with streams and the order words it shares with the engine. `CudaCopier` adds:
- one offload and one load stream on the KV's device (the engine's streams never wait for
  the daemon's copies unless the engine asks);
- the order words (kvcached_proto.order_words, kvcached/copy/order.py): each task's copies wait on
  its stream for the engine's fence (the engine's writes to those blocks are done) with no
  host synchronize; after layer i of a load, the task id is written into the slot's progress
  word on the load stream, then the slot's counter is bumped, and the engine's stream waits
  for that word before it reads the layer;
- the end of a batch synchronizes its stream before host blocks are marked ready (offload)
  or unpinned (load), and before the task's end event is sent.

Ran on an H100 (docs/cuda.md: figures, and what is not met yet).
"""
from __future__ import annotations

import contextlib

import torch

from kvcached_proto import ErrorCode

from ..errors import OpError
from ..host import cudart
from . import dma, native
from . import strategies as cs
from .native import NativeCopier
from .strategy_copier import StrategyCopier
from .transfer import CopyTask, CpuCopier, TaskKind


def make_copier(device: str, strategy: str, dev_views, host_pool, num_layers: int, order=None,
                dma_threads: int = 1):
    if device == "cpu" and strategy in ("auto", "native") and native.available():
        copier = NativeCopier(dev_views, host_pool.views)
    elif device == "cpu" and strategy in ("auto", "numpy", "native"):  # native: not built here
        copier = CpuCopier(dev_views, host_pool.views)
    elif strategy in ("numpy", "native"):
        raise OpError(ErrorCode.KV_MISMATCH, f"--copy-strategy {strategy} is for CPU KV only")
    elif device == "cpu":
        copier = StrategyCopier(dev_views, host_pool.views, strategy, dma_threads=dma_threads)
    else:
        copier = CudaCopier(dev_views, host_pool, strategy, device, num_layers, dma_threads)
    if isinstance(copier, StrategyCopier):
        copier.warm_up()  # every kernel loaded before a copy waits behind a fence
    copier.order = order
    return copier


class CudaCopier(StrategyCopier):
    """Its CUDA calls go through two seams a CPU test replaces (tests/test_cuda_seams.py): `cuda`
    (torch.cuda: device contexts, streams) and `runtime` (the dma strategy's libcudart)."""

    non_blocking = True
    cuda = torch.cuda
    runtime = cudart.LibCudart

    def __init__(self, dev_views, host_pool, strategy: str, device: str, num_layers: int,
                 dma_threads: int = 1):
        if not self.cuda.is_available():
            raise OpError(ErrorCode.KV_MISMATCH, "CUDA KV registered but this daemon sees no CUDA device")
        super().__init__(dev_views, host_pool.views, strategy, host_pool.block_cuts, dma_threads)
        self.num_layers = num_layers
        with self.cuda.device(self.device):
            self.streams = {TaskKind.OFFLOAD: self.cuda.Stream(), TaskKind.LOAD: self.cuda.Stream()}
        self.helper_streams: dict[str, list] = {TaskKind.OFFLOAD: [], TaskKind.LOAD: []}
        if strategy == "zero_copy":
            self.host_view = host_pool.device_views(self.device, widen=cs.widen)
        if strategy == "dma":
            self.memcpy = dma.CudaMemcpy(self.runtime())

    def _stream(self, kind: str):
        stack = contextlib.ExitStack()
        stack.enter_context(self.cuda.device(self.device))
        stack.enter_context(self.cuda.stream(self.streams[kind]))
        return stack

    def _stream_handle(self, kind: str) -> int:
        return self.streams[kind].cuda_stream

    def begin_offload(self, task: CopyTask) -> None:
        self._wait_fence(TaskKind.OFFLOAD, task)

    def begin_load(self, task: CopyTask) -> None:
        self._wait_fence(TaskKind.LOAD, task)

    def _wait_fence(self, kind: str, task: CopyTask) -> None:
        if self.order is not None:
            with self.cuda.device(self.device):
                self.order.wait(self.streams[kind], task.fence)

    # dma split between threads (StrategyCopier._queue): a helper's stream starts after the
    # direction's stream's work so far, which waits for each helper's copies (events)
    def _helpers(self, kind: str, n: int) -> list:
        streams = self.helper_streams[kind]
        while len(streams) < n:
            with self.cuda.device(self.device):
                streams.append(self.cuda.Stream())
        return streams[:n]

    def _fork(self, kind: str, n: int) -> None:
        with self.cuda.device(self.device):
            event = self.cuda.Event()
            event.record(self.streams[kind])
            for stream in self._helpers(kind, n):
                stream.wait_event(event)

    def _join(self, kind: str, n: int) -> None:
        with self.cuda.device(self.device):
            for stream in self._helpers(kind, n):
                event = self.cuda.Event()
                event.record(stream)
                self.streams[kind].wait_event(event)

    def _helper_handle(self, kind: str, i: int) -> int:
        return self.helper_streams[kind][i].cuda_stream

    def _helper_device(self):
        return self.cuda.device(self.device)

    def layer_loaded(self, task: CopyTask, layer: int) -> None:
        with self.cuda.device(self.device):
            self.order.loaded(self.streams[TaskKind.LOAD], task.slot, layer, task.task_id)

    def sync(self, kind: str) -> None:
        self.streams[kind].synchronize()

    def close(self) -> None:
        for stream in [*self.streams.values(), *(s for h in self.helper_streams.values() for s in h)]:
            stream.synchronize()
        super().close()
        with self.cuda.device(self.device):
            # the staging buffers (64 MiB a direction) back to the GPU rather than kept in torch's
            # cache: an engine that restarts sizes its KV by the free memory it finds
            self.cuda.empty_cache()
