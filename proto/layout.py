"""The KV layout description that `register_kv` carries, and its validation.

    layout = {
      "device": "cpu" | "cuda:N",
      "gpu_uuid": "GPU-...",    # CUDA: the device by UUID (ordinals differ between processes)
      "num_layers": L,          # layers, each with the same parts
      "num_blocks": N,          # device blocks
      "kv_layout": str,         # how a block's bytes are ordered (e.g. "1,2,3|1,2,3"); part
                                # of the geometry: a different one voids the host tier's blocks
      "order_segment": name,    # the engine's order words (order_words.py); required on CUDA
      "revoke_word": 255,       # optional (1.5): the order word of revoked offloads
      "load_revoke_word": 254,  # optional (1.14): the order word of revoked loads
      "allocations": [handle],  # the backing allocations (1.4)
      "tensors": [              # L * P entries, layer-major
        {"layer": i, "part": j, "name": "k" | "v" | "kv" | "latent" | "scale" | ...,
         "dtype": "bfloat16", "shape": [N, ...],
         "alloc": a, "offset": bytes, "block_stride": bytes},   # the region (geometry.py)
      ],
    }

A handle is {"kind": "shm", "name": "/kvcached.{uid}.kv.{pid}.{n}", "size": segment bytes}
for CPU KV in POSIX shared memory, {"kind": "fd", "token": T, "index": i, "size": bytes} for host
memory the engine handed over as fds (fd_pass.py: SGLang's memfd host pool; protocol 1.7), or
{"kind": "cuda_ipc", ...} (the fields of `storage._share_cuda_()`) for CUDA KV. Block b of a tensor is `prod(shape[1:]) * dtype bytes`
contiguous bytes at `offset + b * block_stride` in allocation `alloc`; regions never share a
byte. Part j has the same block shape and dtype on every layer; parts may differ from each
other (e.g. FP8 scale tensors).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from .errors import ProtocolError
from .fd_pass import MAX_FDS, TOKEN_RE
from .geometry import Region, check_disjoint
from .ops import ErrorCode
from .order_words import LOAD_REVOKE_WORD, REVOKE_WORD

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}
MAX_LAYERS = 1024
MAX_PARTS = 8
MAX_DEVICE_BLOCKS = 2**31 - 1
MAX_ALLOCATIONS = MAX_LAYERS * MAX_PARTS  # one per tensor at most (vLLM <= 0.13's per-layer ones)
MAX_ALLOCATION_BYTES = 2**50


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
    region: Region


@dataclass(frozen=True)
class LayoutSpec:
    device: str
    num_layers: int
    num_blocks: int
    parts: tuple[PartSpec, ...]
    tensors: tuple[TensorSpec, ...]  # layer-major, len = num_layers * len(parts)
    allocations: tuple[dict, ...] = ()  # one handle per backing allocation
    order_segment: str | None = None  # the engine's order words (order_words.py); CUDA needs it
    kv_layout: str = ""  # how a block's bytes are ordered (the engine's word for it)
    gpu_uuid: str | None = None
    revoke_word: int | None = None  # order word of revoked offloads (1.5; order_words.py)
    load_revoke_word: int | None = None  # order word of revoked loads (1.14)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block across every layer and part (one host block)."""
        return self.num_layers * sum(p.block_bytes for p in self.parts)

    def geometry(self) -> tuple:
        """What host blocks depend on; equal geometry means host content stays usable."""
        return (self.num_layers, self.parts, self.kv_layout)

    def geometry_digest(self) -> bytes:
        """16 bytes naming geometry(): what a stored block's bytes mean. The daemon's storage
        tiers keep each geometry's blocks apart under it (and every record carries it), so an
        engine never loads bytes written from another dtype, block shape, axis order or
        layer count."""
        parts = ";".join(f"{p.name}:{p.dtype}:{','.join(map(str, p.block_shape))}"
                         for p in self.parts)
        text = f"kvcached-geometry-1|{self.num_layers}|{parts}|{self.kv_layout}"
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


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
    allocations = _allocations(layout)
    parts: list[PartSpec] = []
    specs: list[TensorSpec] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, dict):
            raise _bad(f"tensors[{i}]: expected a map")
        layer, part = divmod(i, num_parts)
        spec = _part(t, i, layer, part, num_blocks)
        if layer == 0:
            parts.append(spec)
        elif spec != parts[part]:
            raise _bad(
                f"tensors[{i}]: layer {layer} part {part} is {spec.dtype}{list(spec.block_shape)}, "
                f"layer 0 has {parts[part].dtype}{list(parts[part].block_shape)}; every layer "
                "must have the same shapes and dtypes"
            )
        region = _region(t, f"tensors[{i}].", spec.block_bytes, num_blocks, allocations)
        specs.append(TensorSpec(layer, part, region))
    clash = check_disjoint([s.region for s in specs], num_blocks)
    if clash is not None:
        raise _bad(f"tensors[{clash[0]}] and tensors[{clash[1]}] share bytes: a load into one "
                   "would overwrite the other (KV shared between layers cannot be registered)")
    return LayoutSpec(device, num_layers, num_blocks, tuple(parts), tuple(specs),
                      tuple(allocations), _short_str(layout, "order_segment", 2, 255),
                      _short_str(layout, "kv_layout", 0, 256) or "",
                      _short_str(layout, "gpu_uuid", 1, 64), _revoke_word(layout, "revoke_word", REVOKE_WORD),
                      _revoke_word(layout, "load_revoke_word", LOAD_REVOKE_WORD))


def _revoke_word(layout: dict, name: str, word: int) -> int | None:
    if layout.get(name) is None:
        return None
    return _int(layout, name, word, word, "")


def _short_str(layout: dict, name: str, lo: int, hi: int) -> str | None:
    v = layout.get(name)
    if v is not None and (not isinstance(v, str) or not lo <= len(v) <= hi):
        raise _bad(f"{name}: expected a str of {lo}..{hi} characters, got {v!r}")
    return v


def _part(t: dict, i: int, layer: int, part: int, num_blocks: int) -> PartSpec:
    where = f"tensors[{i}]."
    if t.get("layer") != layer or t.get("part") != part:
        raise _bad(f"{where}layer/part: expected layer {layer} part {part} (layer-major order)")
    dtype = t.get("dtype")
    if dtype not in DTYPE_BYTES:
        raise _bad(f"{where}dtype: {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    shape = t.get("shape")
    if (
        not isinstance(shape, list)
        or not 2 <= len(shape) <= 8
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 < s < 2**40 for s in shape)
    ):
        raise _bad(f"{where}shape: expected 2..8 positive ints, got {shape!r}")
    if shape[0] != num_blocks:
        raise _bad(f"{where}shape: block axis 0 has {shape[0]} blocks, layout says {num_blocks}")
    name = t.get("name", f"part{part}")
    if not isinstance(name, str) or len(name) > 64:
        raise _bad(f"{where}name: expected a short str")
    spec = PartSpec(name, dtype, tuple(shape[1:]))
    if spec.block_bytes > MAX_ALLOCATION_BYTES:
        raise _bad(f"{where}shape: a block of {spec.block_bytes} bytes")
    return spec


def _handle(h, where: str) -> dict:
    if not isinstance(h, dict) or h.get("kind") not in ("shm", "cuda_ipc", "fd"):
        raise _bad(f"{where}: expected a map with kind 'shm', 'cuda_ipc' or 'fd'")
    if h["kind"] == "fd":
        if not isinstance(h.get("token"), str) or not TOKEN_RE.match(h["token"]):
            raise _bad(f"{where}.token: expected the 32 hex characters the fd socket answered")
        _int(h, "index", 0, MAX_FDS - 1, f"{where}.")
    return h


def fd_token(spec: "LayoutSpec") -> str | None:
    """The one token a layout's fd allocations were sent under (fd_pass.py), None for a layout
    without any; KV_MISMATCH for a layout naming several, or fds beside other kinds."""
    kinds = {h["kind"] for h in spec.allocations}
    if "fd" not in kinds:
        return None
    tokens = {h["token"] for h in spec.allocations if h["kind"] == "fd"}
    if len(tokens) > 1 or kinds != {"fd"}:
        raise _bad("allocations: fd allocations come from one set of fds, and alone")
    if spec.device != "cpu":
        raise _bad("allocations: fd allocations are host memory: the layout's device is 'cpu'")
    return tokens.pop()


def _allocations(layout: dict) -> list[dict]:
    allocs = layout.get("allocations", [])
    if not isinstance(allocs, list) or len(allocs) > MAX_ALLOCATIONS:
        raise _bad(f"allocations: expected a list of at most {MAX_ALLOCATIONS} handles")
    return [_handle(h, f"allocations[{k}]") for k, h in enumerate(allocs)]


def _region(t: dict, where: str, block_bytes: int, num_blocks: int,
            allocations: list[dict]) -> Region:
    """The tensor's region in one of the layout's allocations."""
    if not allocations:
        raise _bad("allocations: a layout names its allocations (a per-tensor handle was protocol "
                   "1.3's form: upgrade kvcached on the engine's side)")
    alloc = _int(t, "alloc", 0, len(allocations) - 1, where)
    offset = _int(t, "offset", 0, MAX_ALLOCATION_BYTES, where)
    stride = _int(t, "block_stride", 0, MAX_ALLOCATION_BYTES, where)
    if num_blocks > 1 and stride < block_bytes:
        raise _bad(f"{where}block_stride: {stride} bytes is less than a block's {block_bytes} "
                   "bytes (blocks would overlap)")
    region = Region(alloc, offset, stride if num_blocks > 1 else block_bytes, block_bytes)
    if region.end(num_blocks) > MAX_ALLOCATION_BYTES:
        raise _bad(f"{where}: the region ends past {MAX_ALLOCATION_BYTES} bytes")
    return region


def require_order_segment(spec: LayoutSpec) -> None:
    """A registration of CUDA KV must bring the engine's order words (order_words.py): without
    them nothing orders the daemon's copies against the engine's kernels."""
    if spec.order_segment is None and spec.device != "cpu":
        raise _bad("order_segment: CUDA KV needs the engine's order-words segment")
