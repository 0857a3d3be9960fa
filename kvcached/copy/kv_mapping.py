"""The engine's registered KV cache, mapped into the daemon.

Each backing allocation is mapped once - CPU KV from the engine's POSIX shared-memory
segment, CUDA KV from its CUDA IPC handle - and every (layer, part) region of it
(kvcached_proto.geometry) is seen here as a uint8 view `[num_blocks, block_bytes]` whose row
stride is the region's block stride, so copies are layout-agnostic byte moves. A CUDA
allocation names its GPU by UUID: the engine and the daemon may number GPUs differently.

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

from kvcached_proto import ErrorCode, shm_room
from kvcached_proto.geometry import Region, check_disjoint, gpu_uuid
from kvcached_proto.layout import LayoutSpec
from kvcached_proto.order_words import segment_bytes
from kvcached_proto.paths import KV_SEGMENT_RE
from kvcached_proto.shm_layout import NUM_SLOTS

from ..errors import OpError
from . import sigbus
from .order import DaemonOrder

log = logging.getLogger(__name__)

_SHM_NAME_RE = KV_SEGMENT_RE


def _int_field(handle: dict, name: str) -> int:
    v = handle.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise OpError(ErrorCode.KV_MISMATCH, f"handle.{name}: expected a non-negative int")
    return v


def _bytes_field(handle: dict, name: str, required: bool = True) -> bytes:
    """A short bytes field (an IPC handle). Never `bytes(x)` of what a client sent: an int
    there would allocate that many zero bytes."""
    v = handle.get(name)
    if v is None and not required:
        return b""
    if not isinstance(v, (bytes, bytearray)) or len(v) > 4096:
        raise OpError(ErrorCode.KV_MISMATCH, f"handle.{name}: expected bytes (an IPC handle)")
    return bytes(v)


class KVRegistration:
    def __init__(self, spec: LayoutSpec, owner: str, daemon_device: str = "cpu",
                 fds: list[int] | None = None):
        """fds: what the layout's fd allocations index (fd_pass.py); the caller closes them."""
        self.spec = spec
        self._fds = fds or []
        self.owner = owner
        self.retired: str | None = None  # why no copy may use it any more (its engine is gone)
        self._maps: dict[str, mmap.mmap] = {}
        self._guards: dict[str, sigbus.GuardedMap] = {}
        self.views: list[list[torch.Tensor]] = []
        self.order: DaemonOrder | None = None
        self.local_device = "cpu"  # this process's name of the KV's device (cuda:N by its UUID)
        try:
            flats = self._map_allocations(spec, daemon_device)
            for layer in range(spec.num_layers):
                row = []
                for part_idx in range(len(spec.parts)):
                    t = spec.tensors[layer * len(spec.parts) + part_idx]
                    row.append(_region_view(flats[t.region.alloc], t.region, spec.num_blocks,
                                            f"layer {layer} part {part_idx}"))
                self.views.append(row)
            _check_no_alias(self.views, spec.num_blocks)
            if spec.order_segment is not None:
                # on the GPU as this process numbers it: the engine's cuda:N may be another
                self.order = DaemonOrder(self._map_order(spec.order_segment), spec.num_layers,
                                         self.local_device, spec.revoke_word,
                                         load_revoke_word=spec.load_revoke_word)
        except BaseException:
            self.close()
            raise

    def _map_allocations(self, spec: LayoutSpec, daemon_device: str) -> list[torch.Tensor]:
        """One flat uint8 tensor per allocation (a segment or an IPC handle named twice is
        mapped once)."""
        device = None
        if spec.device != "cpu":
            device = cuda_ordinal(spec)
            self.local_device = f"cuda:{device}"
            served = int(daemon_device.partition(":")[2] or 0)
            if device != served:
                raise OpError(ErrorCode.KV_MISMATCH,
                              f"the engine's KV is on this daemon's cuda:{device} "
                              f"({spec.gpu_uuid or spec.device}) but the daemon serves "
                              f"{daemon_device}: run one daemon per GPU, on the engine's GPU")
        flats, seen = [], {}
        for handle in spec.allocations:
            if handle["kind"] == "shm":
                key, mapper = ("shm", handle.get("name")), self._map_shm
            elif handle["kind"] == "fd":
                key, mapper = ("fd", handle["index"]), self._map_fd
            else:
                key = ("cuda", _bytes_field(handle, "handle"), _int_field(handle, "storage_offset"))
                mapper = lambda h: _map_cuda(h, device)  # noqa: E731
            if key not in seen:
                seen[key] = mapper(handle)
            flats.append(seen[key])
        return flats

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def lost(self) -> str | None:
        """Why this registration can no longer be copied from or to (None while it can)."""
        if self.retired:
            return self.retired
        shrunk = [name for name, g in self._guards.items() if g.faulted]
        if shrunk:
            return (f"KV segment {shrunk[0]} shrank under the daemon's mapping (truncated by "
                    "its owner); register the KV cache again")
        return None

    def _map_shm(self, handle: dict) -> torch.Tensor:
        name = handle.get("name")
        m = _SHM_NAME_RE.match(name) if isinstance(name, str) else None
        if m is None or int(m.group(1)) != os.getuid():
            raise OpError(ErrorCode.KV_MISMATCH, f"handle.name {name!r} is not a kvcached KV segment of this user")
        mm = self._maps.get(name)
        if mm is None:
            mm = self._open_segment(name)
        return torch.frombuffer(mm, dtype=torch.uint8)

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

    def _map_fd(self, handle: dict) -> torch.Tensor:
        """Host memory the engine handed over as an fd (a memfd, or an unlinked /dev/shm file):
        no name anyone else could open, so only its owner and kind are checked."""
        index = handle["index"]
        if index >= len(self._fds):
            raise OpError(ErrorCode.KV_MISMATCH, f"handle.index {index}: {len(self._fds)} fds came")
        return torch.frombuffer(self._map_file(self._fds[index], f"fd {index}", private=False),
                                dtype=torch.uint8)

    def _open_segment(self, name: str) -> mmap.mmap:
        try:
            shm = posix_ipc.SharedMemory(name, flags=0)
        except posix_ipc.ExistentialError:
            raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} does not exist (unlinked while "
                          "the engine held it? systemd-logind removes a user's shared memory at the "
                          "user's last logout where RemoveIPC=yes: the engine must allocate its KV "
                          "cache again)") from None
        except posix_ipc.PermissionsError:
            raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} is not readable by the daemon") from None
        try:
            return self._map_file(shm.fd, name, private=True)
        finally:
            shm.close_fd()

    def _map_file(self, fd: int, name: str, private: bool) -> mmap.mmap:
        """Map a file of the daemon's uid whole, SIGBUS-guarded and prefaulted. private: it has
        a name others could reach, so group or others may not write it."""
        if not sigbus.available():
            raise OpError(ErrorCode.KV_MISMATCH, "the engine's shared memory (CPU KV, order words) "
                          "cannot be mapped safely: kvcached.copy._sigbus is not built (reinstall kvcached "
                          "with a C compiler present)")
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            raise OpError(ErrorCode.KV_MISMATCH,
                          f"KV segment {name} belongs to uid {st.st_uid}, not to the daemon's "
                          f"uid {os.getuid()}, or is no regular file: refused")
        if private and st.st_mode & 0o022:
            raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} is writable by group or "
                          f"others (mode {st.st_mode & 0o777:o}): refused")
        if st.st_size == 0:
            raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} is empty")
        try:
            mm = mmap.mmap(fd, st.st_size)
        except OSError as exc:  # e.g. an fd opened read-only
            raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} cannot be mapped: {exc}") from None
        guard = sigbus.GuardedMap(mm, len(mm))
        self._maps[name], self._guards[name] = mm, guard
        _prefault(mm)  # guarded: a segment shrunk meanwhile shows up as `lost`, not SIGBUS
        if guard.faulted:
            raise OpError(ErrorCode.KV_MISMATCH, f"KV segment {name} faulted when touched: it "
                          f"shrank while it was mapped, or it is sparse and /dev/shm has no room "
                          f"for it ({len(mm) / 2**20:.1f} MiB; {shm_room.free_bytes() / 2**20:.1f} "
                          f"MiB free): {shm_room.ADVICE}")
        return mm

    def close(self) -> None:
        self.views = []
        if self.order is not None:
            self.order.close()
            self.order = None
        _close_guarded([(mm, self._guards.pop(name, None)) for name, mm in self._maps.items()])
        self._maps.clear()


_unclosed: list[tuple[mmap.mmap, "sigbus.GuardedMap | None"]] = []


def _close_guarded(maps: list) -> None:
    """Unmap each (mapping, guard), then drop its guard (never the other way round: an
    unguarded live mapping could still fault). A mapping a stray view still holds stays guarded
    and is retried at the next close. One collection for them all: one per mapping took ~60 ms
    each with torch loaded, 10 s for an engine of 160 allocations, while the daemon was drained
    (and, on a new registration, under the host tier's lock)."""
    _unclosed.extend(maps)
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


def _region_view(flat: torch.Tensor, region: Region, num_blocks: int, what: str) -> torch.Tensor:
    """Blocks `[num_blocks, block_bytes]` of one region, rows `block_stride` bytes apart."""
    end = region.end(num_blocks)
    if end > flat.numel():
        raise OpError(ErrorCode.KV_MISMATCH,
                      f"{what}: its blocks span [{region.offset}, {end}) but the allocation holds "
                      f"{flat.numel()} bytes")
    return flat.as_strided((num_blocks, region.block_bytes), (region.block_stride, 1),
                           flat.storage_offset() + region.offset)


def _check_no_alias(views: list[list[torch.Tensor]], num_blocks: int) -> None:
    """No two regions share a byte, by address: parse_layout checks within each allocation as
    sent, this also catches one segment or storage named as two allocations."""
    regions = [Region(0, v.data_ptr(), v.stride(0), v.shape[1]) for row in views for v in row]
    clash = check_disjoint(regions, num_blocks)
    if clash is not None:
        raise OpError(ErrorCode.KV_MISMATCH, f"tensors[{clash[0]}] and tensors[{clash[1]}] "
                      "share bytes (one memory named as two allocations)")


def cuda_ordinal(spec: LayoutSpec) -> int:
    """This process's ordinal of the GPU the KV is on: found by UUID when the engine sent one
    (its `cuda:N` is its own numbering), else the engine's ordinal."""
    if not torch.cuda.is_available():
        raise OpError(ErrorCode.KV_MISMATCH, "CUDA KV registered but this daemon sees no CUDA device")
    return ordinal_of(spec, [gpu_uuid(i) for i in range(torch.cuda.device_count())])


def ordinal_of(spec: LayoutSpec, uuids: list[str]) -> int:
    """The ordinal among `uuids` (this process's GPUs, by ordinal) of the GPU the engine named;
    the engine's own ordinal only when it named none."""
    if spec.gpu_uuid is None:
        return int(spec.device.partition(":")[2] or 0)
    if spec.gpu_uuid in uuids:
        return uuids.index(spec.gpu_uuid)
    raise OpError(ErrorCode.KV_MISMATCH,
                  f"the engine's KV is on GPU {spec.gpu_uuid}, which this daemon does not see "
                  "(CUDA_VISIBLE_DEVICES differs: the daemon must see the engine's GPU)")


def shared_cuda_args(handle: dict, device: int) -> tuple:
    """The arguments of `UntypedStorage._new_shared_cuda` for an engine's handle. No IPC event:
    the order words (or the engine's synchronize before a request) already order every copy
    after the engine's writes, and opening the engine's event would leak one per mapping and
    could hang the daemon in the storage's deleter once the engine died before it fired."""
    return (device, _bytes_field(handle, "handle"), _int_field(handle, "storage_size"),
            _int_field(handle, "storage_offset"), _bytes_field(handle, "ref_counter_handle"),
            _int_field(handle, "ref_counter_offset"), b"", False)


def _map_cuda(handle: dict, device: int) -> torch.Tensor:
    """Rebuild the engine's CUDA storage from the fields of `storage._share_cuda_()`, as a flat
    uint8 tensor on this process's ordinal of its GPU."""
    try:
        storage = torch.UntypedStorage._new_shared_cuda(*shared_cuda_args(handle, device))
    except (KeyError, TypeError, RuntimeError) as exc:
        raise OpError(ErrorCode.KV_MISMATCH, f"CUDA IPC handle could not be opened: {exc}") from None
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat
