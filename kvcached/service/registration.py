"""What a `register_kv` must pass before anything of it is mapped: the instance is free (or
already this client's), the layout is valid, on the daemon's kind of device, and one block
fits the host pool; and what it left (Registered)."""
from __future__ import annotations

from kvcached_proto import ErrorCode
from kvcached_proto.layout import LayoutSpec, fd_token, parse_layout, require_order_segment

from ..copy.kv_mapping import KVRegistration
from ..copy.transfer import TaskAbort
from ..errors import OpError


def checked_layout(layout: dict, client_id: str, kv, device: str, pool_bytes: int) -> LayoutSpec:
    """The layout's spec, or OpError (KV_IN_USE, KV_MISMATCH) changing nothing."""
    if kv is not None and kv.owner != client_id and not kv.retired:
        raise OpError(ErrorCode.KV_IN_USE,
                      f"this instance already serves the KV cache of client {kv.owner}: "
                      "one engine per instance (start another with `kvcached serve "
                      "--instance NAME`), or that engine unregisters or exits first")
    spec = parse_layout(layout)
    require_order_segment(spec)
    fd_token(spec)
    if spec.device.split(":")[0] != device.split(":")[0]:
        why = (" (a CPU staging copy of the engine's KV: a CUDA daemon copies into the engine's own "
               "CUDA KV and stages nothing; run this daemon with --device cpu to stage)"
               if spec.device == "cpu" else "")
        raise OpError(ErrorCode.KV_MISMATCH, f"KV on {spec.device} but the daemon serves {device}{why}")
    if spec.page_bytes > pool_bytes:
        raise OpError(ErrorCode.KV_MISMATCH,
                      f"one block across layers is {spec.page_bytes} bytes, more than the "
                      f"host pool ({pool_bytes}); raise --host-cache-gb")
    return spec


def claim_fds(spec: LayoutSpec, inbox) -> list[int]:
    """The fds a layout's fd allocations index, taken from the fd socket's inbox (the caller
    closes them); [] for a layout without any. KV_MISMATCH when none wait under its token."""
    token = fd_token(spec)
    if token is None:
        return []
    fds = inbox.claim(token) if inbox is not None else None
    if fds is None:
        raise OpError(ErrorCode.KV_MISMATCH, "allocations: no fds wait under this token (they are "
                      "claimed by one register_kv, and closed if none comes within 60 s)")
    return fds


class KVLost(TaskAbort):
    """The registered KV memory went away under a copy (a CPU segment truncated by its owner)."""


class Registered:
    """The engine's KV mapping and the copier over it, as the last register_kv left them (both
    None when no KV is registered). Replaced under the host tier's lock, with the workers
    drained; the flows read them on their worker threads."""

    def __init__(self):
        self.kv: KVRegistration | None = None
        self.copier = None  # CpuCopier, StrategyCopier or CudaCopier (cuda_copier.make_copier)

    @property
    def num_layers(self) -> int:
        return self.kv.spec.num_layers

    def check_intact(self) -> None:
        """After a batch's copies: a segment that shrank under them means what was copied is
        zero pages, not the engine's KV. Raising fails the whole batch (it is all this
        registration's: one engine per instance)."""
        lost = self.kv.lost
        if lost:
            raise KVLost(lost)
