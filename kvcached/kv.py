"""The engine's registered KV cache, mapped into the daemon.

Every registered tensor is seen here as a uint8 view `[num_blocks, block_bytes]`, so copies
are layout-agnostic byte moves. CPU tensors are mapped from the engine's POSIX shared-memory
segment; CUDA tensors are rebuilt from their CUDA IPC handles.
"""
from __future__ import annotations

import logging
import mmap
import os
import re

import numpy as np
import posix_ipc
import torch

from kvcached_proto import ErrorCode
from kvcached_proto.layout import LayoutSpec

from .errors import OpError

log = logging.getLogger(__name__)

_SHM_NAME_RE = re.compile(r"^/kvcached\.(\d+)\.kv\.(\d+)\.(\d+)$")


def _int_field(handle: dict, name: str) -> int:
    v = handle.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise OpError(ErrorCode.KV_MISMATCH, f"handle.{name}: expected a non-negative int")
    return v


class KVRegistration:
    def __init__(self, spec: LayoutSpec, owner: str):
        self.spec = spec
        self.owner = owner
        self._maps: dict[str, mmap.mmap] = {}
        self.views: list[list[torch.Tensor]] = []
        try:
            for layer in range(spec.num_layers):
                row = []
                for part_idx, part in enumerate(spec.parts):
                    t = spec.tensors[layer * len(spec.parts) + part_idx]
                    row.append(self._map(t.handle, part.block_bytes))
                self.views.append(row)
        except BaseException:
            self.close()
            raise

    @property
    def device(self) -> str:
        return self.spec.device

    def _map(self, handle: dict, block_bytes: int) -> torch.Tensor:
        nbytes = self.spec.num_blocks * block_bytes
        if handle["kind"] == "shm":
            return self._map_shm(handle, nbytes).view(self.spec.num_blocks, block_bytes)
        return _map_cuda(handle, nbytes).view(self.spec.num_blocks, block_bytes)

    def _map_shm(self, handle: dict, nbytes: int) -> torch.Tensor:
        name = handle.get("name")
        m = _SHM_NAME_RE.match(name) if isinstance(name, str) else None
        if m is None or int(m.group(1)) != os.getuid():
            raise OpError(ErrorCode.KV_MISMATCH, f"handle.name {name!r} is not a kvcached KV segment of this user")
        offset = _int_field(handle, "offset")
        mm = self._maps.get(name)
        if mm is None:
            try:
                shm = posix_ipc.SharedMemory(name, flags=0)
            except posix_ipc.ExistentialError:
                raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} does not exist") from None
            try:
                mm = mmap.mmap(shm.fd, shm.size)
            finally:
                shm.close_fd()
            self._maps[name] = mm
            _prefault(mm)
        if offset + nbytes > len(mm):
            raise OpError(
                ErrorCode.KV_MISMATCH,
                f"KV segment {name} holds {len(mm)} bytes; tensor needs [{offset}, {offset + nbytes})",
            )
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)

    def close(self) -> None:
        self.views = []
        for name, mm in self._maps.items():
            try:
                mm.close()
            except BufferError:
                # a tensor view is still referenced (a copy in flight); the mapping goes when it does
                log.debug("[kv] mapping of %s still referenced; left to the garbage collector", name)
        self._maps.clear()


def _prefault(mm: mmap.mmap) -> None:
    """Read one byte per page so the copies do not pay page-table faults. numpy's strided copy
    runs without the GIL, so the heartbeat keeps beating during a multi-GB registration
    (MAP_POPULATE would hold the GIL for the whole mmap call)."""
    np.frombuffer(mm, dtype=np.uint8)[::4096].copy()


def _map_cuda(handle: dict, nbytes: int) -> torch.Tensor:
    """Rebuild a CUDA tensor from the fields of `storage._share_cuda_()` (the engine's export)."""
    if not torch.cuda.is_available():
        raise OpError(ErrorCode.KV_MISMATCH, "CUDA KV registered but this daemon sees no CUDA device")
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            _int_field(handle, "device"),
            bytes(handle["handle"]),
            _int_field(handle, "storage_size"),
            _int_field(handle, "storage_offset"),
            bytes(handle["ref_counter_handle"]),
            _int_field(handle, "ref_counter_offset"),
            bytes(handle["event_handle"]) if handle.get("event_handle") else b"",
            bool(handle.get("event_sync_required", False)),
        )
    except (KeyError, TypeError, RuntimeError) as exc:
        raise OpError(ErrorCode.KV_MISMATCH, f"CUDA IPC handle could not be opened: {exc}") from None
    offset = _int_field(handle, "offset")
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    if offset + nbytes > flat.numel():
        raise OpError(ErrorCode.KV_MISMATCH, "CUDA tensor extends past its storage")
    return flat[offset : offset + nbytes]
