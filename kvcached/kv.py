"""The engine's registered KV cache, mapped into the daemon.

Every registered tensor is seen here as a uint8 view `[num_blocks, block_bytes]`, so copies
are layout-agnostic byte moves. CPU tensors are mapped from the engine's POSIX shared-memory
segment; CUDA tensors are rebuilt from their CUDA IPC handles.

A CPU segment is the client's: it must belong to the daemon's uid (checked on the open file,
not its name), and it may shrink under the mapping. Every mapping is SIGBUS-guarded
(sigbus.py): a copy that runs past a shrunken segment reads and writes zero pages instead of
killing the daemon, and `lost` then names the segment, so the task fails and the registration
takes no more work.
"""
from __future__ import annotations

import gc
import logging
import mmap
import os
import stat

import numpy as np
import posix_ipc
import torch

from kvcached_proto import ErrorCode
from kvcached_proto.layout import LayoutSpec
from kvcached_proto.order_words import segment_bytes
from kvcached_proto.paths import KV_SEGMENT_RE
from kvcached_proto.shm_layout import NUM_SLOTS

from . import sigbus
from .errors import OpError
from .order import DaemonOrder

log = logging.getLogger(__name__)

_SHM_NAME_RE = KV_SEGMENT_RE


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
        self._guards: dict[str, sigbus.GuardedMap] = {}
        self.views: list[list[torch.Tensor]] = []
        self.order: DaemonOrder | None = None
        try:
            for layer in range(spec.num_layers):
                row = []
                for part_idx, part in enumerate(spec.parts):
                    t = spec.tensors[layer * len(spec.parts) + part_idx]
                    row.append(self._map(t.handle, part.block_bytes))
                self.views.append(row)
            if spec.order_segment is not None:
                self.order = DaemonOrder(self._map_order(spec.order_segment), spec.num_layers,
                                         spec.device)
        except BaseException:
            self.close()
            raise

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def lost(self) -> str | None:
        """Why this registration can no longer be copied from or to (None while it can)."""
        shrunk = [name for name, g in self._guards.items() if g.faulted]
        if shrunk:
            return (f"KV segment {shrunk[0]} shrank under the daemon's mapping (truncated by "
                    "its owner); register the KV cache again")
        return None

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
            mm = self._open_segment(name)
        if offset + nbytes > len(mm):
            raise OpError(
                ErrorCode.KV_MISMATCH,
                f"KV segment {name} holds {len(mm)} bytes; tensor needs [{offset}, {offset + nbytes})",
            )
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)

    def _map_order(self, name: str) -> np.ndarray:
        """The engine's order words (kvcached_proto.order_words): a segment of its own, checked
        like its KV segments."""
        m = _SHM_NAME_RE.match(name)
        if m is None or int(m.group(1)) != os.getuid():
            raise OpError(ErrorCode.KV_MISMATCH, f"order_segment {name!r} is not a kvcached segment of this user")
        if name in self._maps:
            raise OpError(ErrorCode.KV_MISMATCH, f"order_segment {name!r} is also a KV segment")
        mm = self._open_segment(name)
        need = segment_bytes(NUM_SLOTS, self.spec.num_layers)
        if len(mm) < need:
            raise OpError(ErrorCode.KV_MISMATCH, f"order_segment {name} holds {len(mm)} bytes, "
                          f"{need} needed for {self.spec.num_layers} layers")
        return np.frombuffer(mm, dtype=np.uint64, count=need // 8)

    def _open_segment(self, name: str) -> mmap.mmap:
        if not sigbus.available():
            raise OpError(ErrorCode.KV_MISMATCH, "the engine's shared memory (CPU KV, order words) "
                          "cannot be mapped safely: kvcached._sigbus is not built (reinstall kvcached "
                          "with a C compiler present)")
        try:
            shm = posix_ipc.SharedMemory(name, flags=0)
        except posix_ipc.ExistentialError:
            raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} does not exist") from None
        except posix_ipc.PermissionsError:
            raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} is not readable by the daemon") from None
        try:
            st = os.fstat(shm.fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                raise OpError(ErrorCode.KV_MISMATCH,
                              f"KV segment {name} belongs to uid {st.st_uid}, not to the daemon's "
                              f"uid {os.getuid()}: refused")
            if st.st_mode & 0o022:
                raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} is writable by group or "
                              f"others (mode {st.st_mode & 0o777:o}): refused")
            if st.st_size == 0:
                raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} is empty")
            mm = mmap.mmap(shm.fd, st.st_size)
        finally:
            shm.close_fd()
        guard = sigbus.GuardedMap(mm, len(mm))
        self._maps[name], self._guards[name] = mm, guard
        _prefault(mm)  # guarded: a segment shrunk meanwhile shows up as `lost`, not SIGBUS
        if guard.faulted:
            raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} shrank while it was mapped")
        return mm

    def close(self) -> None:
        self.views = []
        if self.order is not None:
            self.order.close()
            self.order = None
        for name, mm in list(self._maps.items()):
            _close_guarded(mm, self._guards.pop(name, None))
        self._maps.clear()


_unclosed: list[tuple[mmap.mmap, "sigbus.GuardedMap | None"]] = []


def _close_guarded(mm: mmap.mmap, guard) -> None:
    """Unmap, then drop the guard (never the other way round: an unguarded live mapping could
    still fault). A mapping a stray view still holds stays guarded and is retried later."""
    _unclosed.append((mm, guard))
    gc.collect()  # views of a replaced copier may sit in reference cycles
    for item in list(_unclosed):
        try:
            item[0].close()
        except BufferError:
            log.debug("[kv] a mapping is still referenced; kept guarded, closed later")
            continue
        _unclosed.remove(item)
        if item[1] is not None:
            item[1].release()


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
