"""What a `register_kv` must pass before anything of it is mapped: the instance is free (or
already this client's), the layout is valid, on the daemon's kind of device, and one block
fits the host pool."""
from __future__ import annotations

from kvcached_proto import ErrorCode
from kvcached_proto.layout import LayoutSpec, parse_layout, require_order_segment

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
