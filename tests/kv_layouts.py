"""KV caches laid out the way engines lay them out, in one allocation from
`kvcached_client.allocate_kv_buffer` (shared memory on CPU, device memory on CUDA).

vLLM 0.32: kvcached_client.kv_views. Older vLLM (<= 0.13) gives each
layer its own tensor: FlashAttention (2, B, N, H, D) in HND memory order, FlashInfer
(B, 2, N, H, D), MLA (B, N, D). Every builder returns (the allocation, the per-layer entries
`register_kv_cache` takes).
"""
from __future__ import annotations

import torch

from kvcached_client import allocate_kv_buffer
from kvcached_client.kv_views import VLLM_LAYOUTS, vllm_layer_views

REGISTERABLE = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "flash_attn", "flashinfer", "mla",
                "kvcached"]
DTYPE = torch.bfloat16


def _buffer(elems: int, device: str, offset: int):
    """An allocation of `elems` bf16 elements after `offset` leading ones (a view at a non-zero
    offset, as an allocation inside a larger one is)."""
    raw = allocate_kv_buffer((offset + elems) * 2, device)
    return raw, raw.view(DTYPE)[offset:]


def vllm_kv(layout: str, layers=3, blocks=24, heads=2, tokens=16, c=16, device="cpu", offset=0):
    shape = (layers, blocks, heads, tokens, c)
    raw, flat = _buffer(layers * blocks * heads * tokens * c, device, offset)
    return raw, vllm_layer_views(flat, layout, shape)


def flash_attn_kv(layers=3, blocks=24, heads=2, tokens=16, d=8, device="cpu", offset=0):
    """Per layer (2, B, N, H, D) stored as (2, B, H, N, D): the K and V halves are two parts."""
    per = 2 * blocks * heads * tokens * d
    raw, flat = _buffer(layers * per, device, offset)
    out = []
    for i in range(layers):
        t = flat[i * per:(i + 1) * per].view(2, blocks, heads, tokens, d).permute(0, 1, 3, 2, 4)
        out.append((t[0], t[1]))
    return raw, out


def flashinfer_kv(layers=3, blocks=24, heads=2, tokens=16, d=8, device="cpu", offset=0):
    """Per layer (B, 2, N, H, D): K and V of a block side by side, two parts a block apart."""
    per = blocks * 2 * tokens * heads * d
    raw, flat = _buffer(layers * per, device, offset)
    out = []
    for i in range(layers):
        t = flat[i * per:(i + 1) * per].view(blocks, 2, tokens, heads, d)
        out.append((t[:, 0], t[:, 1]))
    return raw, out


def mla_kv(layers=3, blocks=24, tokens=16, d=36, device="cpu", offset=0):
    per = blocks * tokens * d
    raw, flat = _buffer(layers * per, device, offset)
    return raw, [flat[i * per:(i + 1) * per].view(blocks, tokens, d) for i in range(layers)]


def kvcached_kv(layers=3, blocks=24, device="cpu", offset=0):
    from kvcached_client import allocate_kv_cache

    kv = allocate_kv_cache(layers, blocks, (16, 2, 8), DTYPE, device=device)
    return kv[0][0], kv


def make_kv(name: str, device: str = "cpu", offset: int = 0):
    if name in VLLM_LAYOUTS:
        return vllm_kv(name, device=device, offset=offset)
    return {"flash_attn": flash_attn_kv, "flashinfer": flashinfer_kv, "mla": mla_kv,
            "kvcached": kvcached_kv}[name](device=device, offset=offset)


def parts_of(kv) -> list[list[torch.Tensor]]:
    return [list(e) if isinstance(e, (list, tuple)) else [e] for e in kv]


def fill(kv, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for row in parts_of(kv):
        for t in row:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """Every byte of the allocation behind `t`."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def round_trip(daemon, raw, kv, keys) -> None:
    """Offload six blocks, load them into six others; the allocation must then hold exactly
    what it held with those blocks copied over (gaps, other layers and blocks untouched)."""
    from kvcached_client.kv_alloc import describe_kv_cache

    whole = _whole(raw)
    whole.copy_(torch.randint(0, 256, whole.shape, dtype=torch.uint8))  # gaps too
    fill(kv, seed=1)
    assert len(describe_kv_cache(kv)["allocations"]) == 1
    src, dst = [3, 4, 5, 9, 17, 0], [20, 2, 11, 12, 13, 7]
    with daemon.connect(timeout=10) as c:
        c.register_kv_cache(kv)
        assert c.offload(src, keys).wait(10)["stored"] == len(src)
        before = whole.clone()
        for row in parts_of(kv):
            for t in row:
                t[dst] = 0
        assert c.load(keys, dst).wait(10) == len(dst)
        c.unregister_kv_cache()
    expected = before.clone()
    for row in parts_of(kv):  # the same views over the clone, with dst set to src
        for t in row:
            e = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                expected.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            e[dst] = t[src]
    assert torch.equal(_whole(raw), expected)
