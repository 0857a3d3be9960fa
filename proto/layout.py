"""The KV layout description that `register_kv` carries, and its validation.

    layout = {
      "device": "cpu" | "cuda:N",
      "num_layers": L,          # layers, each with the same parts
      "num_blocks": N,          # device blocks; block axis is 0 of every tensor
      "order_segment": name,    # the engine's order words (order_words.py); required on CUDA
      "tensors": [              # L * P entries, layer-major
        {"layer": i, "part": j, "name": "k" | "v" | "latent" | "scale" | ...,
         "dtype": "bfloat16", "shape": [N, ...], "handle": {...}},
      ],
    }

A handle is {"kind": "shm", "name": "/kvcached.{uid}.kv.{pid}.{n}", "offset": bytes,
"size": segment bytes} for CPU tensors in POSIX shared memory, or {"kind": "cuda_ipc", ...}
(the fields of `storage._share_cuda_()`) for CUDA tensors. Part j has the same shape and
dtype on every layer; parts may differ from each other (e.g. FP8 scale tensors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ProtocolError
from .ops import ErrorCode

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}
MAX_LAYERS = 1024
MAX_PARTS = 8
MAX_DEVICE_BLOCKS = 2**31 - 1


@dataclass(frozen=True)
class PartSpec:
    """One per-layer tensor kind (K, V, latent, scale...): its block's shape and dtype."""

    name: str
    dtype: str
    block_shape: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class TensorSpec:
    layer: int
    part: int
    handle: dict


@dataclass(frozen=True)
class LayoutSpec:
    device: str
    num_layers: int
    num_blocks: int
    parts: tuple[PartSpec, ...]
    tensors: tuple[TensorSpec, ...]  # layer-major, len = num_layers * len(parts)
    order_segment: str | None = None  # the engine's order words (order_words.py); CUDA needs it

    @property
    def page_bytes(self) -> int:
        """Bytes of one block across every layer and part (one host block)."""
        return self.num_layers * sum(p.block_bytes for p in self.parts)

    def geometry(self) -> tuple:
        """What host blocks depend on; equal geometry means host content stays usable."""
        return (self.num_layers, self.parts)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.KV_MISMATCH, message)


def _int(d: dict, name: str, lo: int, hi: int, where: str) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"{where}{name}: expected an int in [{lo}, {hi}], got {v!r}")
    return v


def parse_layout(layout: dict) -> LayoutSpec:
    device = layout.get("device")
    if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
        raise _bad(f"device: expected 'cpu' or 'cuda:N', got {device!r}")
    num_layers = _int(layout, "num_layers", 1, MAX_LAYERS, "")
    num_blocks = _int(layout, "num_blocks", 1, MAX_DEVICE_BLOCKS, "")
    tensors = layout.get("tensors")
    if not isinstance(tensors, list) or not tensors or len(tensors) % num_layers:
        raise _bad("tensors: expected a non-empty list with the same parts on every layer")
    num_parts = len(tensors) // num_layers
    if num_parts > MAX_PARTS:
        raise _bad(f"tensors: {num_parts} parts per layer > {MAX_PARTS}")
    parts: list[PartSpec] = []
    specs: list[TensorSpec] = []
    for i, t in enumerate(tensors):
        where = f"tensors[{i}]."
        if not isinstance(t, dict):
            raise _bad(f"tensors[{i}]: expected a map")
        layer, part = divmod(i, num_parts)
        if t.get("layer") != layer or t.get("part") != part:
            raise _bad(f"{where}layer/part: expected layer {layer} part {part} (layer-major order)")
        dtype = t.get("dtype")
        if dtype not in DTYPE_BYTES:
            raise _bad(f"{where}dtype: {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        shape = t.get("shape")
        if (
            not isinstance(shape, list)
            or not 2 <= len(shape) <= 8
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)
        ):
            raise _bad(f"{where}shape: expected 2..8 positive ints, got {shape!r}")
        if shape[0] != num_blocks:
            raise _bad(f"{where}shape: block axis 0 has {shape[0]} blocks, layout says {num_blocks}")
        name = t.get("name", f"part{part}")
        if not isinstance(name, str) or len(name) > 64:
            raise _bad(f"{where}name: expected a short str")
        spec = PartSpec(name, dtype, tuple(shape[1:]))
        if layer == 0:
            parts.append(spec)
        elif spec != parts[part]:
            raise _bad(
                f"{where}: layer {layer} part {part} is {spec.dtype}{list(spec.block_shape)}, "
                f"layer 0 has {parts[part].dtype}{list(parts[part].block_shape)}; every layer "
                "must have the same shapes and dtypes"
            )
        handle = t.get("handle")
        if not isinstance(handle, dict) or handle.get("kind") not in ("shm", "cuda_ipc"):
            raise _bad(f"{where}handle: expected a map with kind 'shm' or 'cuda_ipc'")
        specs.append(TensorSpec(layer, part, handle))
    order = layout.get("order_segment")
    if order is not None and (not isinstance(order, str) or not 1 < len(order) <= 255):
        raise _bad(f"order_segment: expected a shared-memory name, got {order!r}")
    return LayoutSpec(device, num_layers, num_blocks, tuple(parts), tuple(specs), order)


def require_order_segment(spec: LayoutSpec) -> None:
    """A registration of CUDA KV must bring the engine's order words (order_words.py): without
    them nothing orders the daemon's copies against the engine's kernels."""
    if spec.order_segment is None and spec.device != "cpu":
        raise _bad("order_segment: CUDA KV needs the engine's order-words segment (protocol 1.3: "
                   "a client older than the daemon; upgrade kvcached on the engine's side)")
