"""SGLang's own pieces, as SGLang builds them for HiCache on a host: its host pools (MHA and MLA,
with the shm allocator), its storage config, and the backend made by its backend factory and
attached the way its cache controller attaches one (create, register_mem_pool_host,
on_host_pools_registered)."""
from __future__ import annotations

import json

import torch
import torchvision_standin

torchvision_standin.install()

from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 16, 16
DEVICE_TOKENS = 512


def _ptrs(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(layout: str, allocator: str = "shm", device_tokens: int = DEVICE_TOKENS, ratio: float = 2.0):
    """SGLang's MHA host pool over a (stand-in) device pool of CPU tensors."""
    k = tuple(torch.zeros(device_tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.zeros(device_tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
        dtype=torch.bfloat16, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, ratio, 0, PAGE, layout, pin_memory=False, device="cpu",
                                allocator_type=allocator, device_capacity_tokens=device_tokens,
                                start_layer=0, end_layer=LAYERS)


def mla_pool(layout: str, allocator: str = "shm", device_tokens: int = DEVICE_TOKENS, ratio: float = 2.0):
    """SGLang's MLA host pool: one latent row (kv_lora_rank + rope) per token and layer."""
    lora, rope = 32, 16
    rows = tuple(torch.zeros(device_tokens, 1, lora + rope, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(buffers=rows, data_ptrs=_ptrs(rows), layer_indices=tuple(range(LAYERS)),
                         device_layer_num=LAYERS, page_size=PAGE, kv_lora_rank=lora,
                         qk_rope_head_dim=rope, kv_cache_dim=lora + rope, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, ratio, 0, PAGE, layout, pin_memory=False, device="cpu",
                                allocator_type=allocator, device_capacity_tokens=device_tokens,
                                start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)


def mamba_pool(layout: str = "page_first", slots: int = 16, layers: int = LAYERS,
               temporal=(2, 16), conv=((6, 3), (2, 3)), side_state: bool = False):
    """SGLang's Mamba host pool (a hybrid model's recurrent states, one slot per page): a float32
    temporal state of shape `temporal` and bfloat16 conv states of shapes `conv` per layer
    (`side_state`: and a per-slot side state, which SGLang's zero-copy metadata does not carry)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, *temporal, dtype=torch.float32),
        conv=tuple(torch.zeros(layers, slots, *shape, dtype=torch.bfloat16) for shape in conv),
        extra_checkpoint_buffers=(torch.zeros(slots, 4),) if side_state else ())
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                         allocator_type="shm", layout=layout)


def indexer_pool(anchor, index_head_dim: int = 64):
    """SGLang's DSA indexer host pool (DeepSeek V3.2's index keys and their scales, bytes per
    page and layer) beside the MLA host pool `anchor`, whose pages and host indices it shares;
    its device pool is a stand-in of CPU tensors, as the other pools' are."""
    import types

    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.dsa import (DSAIndexerHostPoolBuilder, DSAIndexerPoolHost,
                                                    dsa_indexer_bytes_per_token_per_layer)
    from sglang.srt.mem_cache.pool_host.host_pool_decl import HostPoolDecl, HostPoolStorageInfo

    per_token = dsa_indexer_bytes_per_token_per_layer(index_head_dim=index_head_dim, quant_block_size=64)
    device = types.SimpleNamespace(
        store_dtype=torch.bfloat16, start_layer=0, end_layer=LAYERS, layer_num=LAYERS, device="cpu",
        layer_shard_enabled=False,
        index_k_with_scale_buffer=[torch.zeros(DEVICE_TOKENS // PAGE, PAGE * per_token, dtype=torch.uint8)
                                   for _ in range(LAYERS)])
    decl = HostPoolDecl(pool_name=PoolName.INDEXER, device_pool=device, indices_from_pool=PoolName.KV,
                        layout_source=PoolName.KV, host_pool_builder=DSAIndexerHostPoolBuilder(),
                        storage_info=HostPoolStorageInfo(bytes_per_token_per_layer=per_token, dtype=torch.uint8))
    return DSAIndexerPoolHost(decl, anchor, pin_memory=False, device="cpu", allocator_type="shm")


def fill_bytes(tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensor.copy_(torch.randint(0, 256, tensor.shape, generator=gen, dtype=torch.uint8))


def fill_mamba(pool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in (pool.temporal_buffer, *pool.conv_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))


def attach_hybrid(pool, sides: dict, extra: dict, mla: bool = False, **cfg_kw):
    """The backend attached as SGLang's hybrid cache controller attaches one: the KV pool, then
    every pool of the group by name (the KV pool among them), then on_host_pools_registered."""
    cfg = storage_config(extra, mla=mla, layout=pool.layout, **cfg_kw)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    from sglang.srt.mem_cache.hicache_storage import PoolName

    for name, side in {"kv": pool, **sides}.items():
        backend.register_mem_host_pool_v2(side, PoolName(name))
    backend.on_host_pools_registered()
    return backend


def make_pool(kind: str, layout: str, **kw):
    return (mha_pool if kind == "mha" else mla_pool)(layout, **kw)


def extra_config(instance: str, run_dir: str, **more) -> dict:
    """The extra-config a user passes, as SGLang parses it (JSON on the command line)."""
    cfg = {"backend_name": "kvcached", "module_path": "kvcached_client.sglang",
           "class_name": "KvcachedHiCacheStorage", "interface_v1": 1, "allocator": "shm",
           "instance": instance, "run_dir": run_dir, "timeout_s": 5.0, **more}
    return json.loads(json.dumps(cfg))


def storage_config(extra: dict, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   layout: str = "page_first", model: str = "test-org/test-model"):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=layout != "layer_first",
        model_name=model, extra_config=extra)


def attach(pool, extra: dict, mla: bool = False, **cfg_kw):
    """The backend SGLang's factory builds from the extra-config, attached to `pool` in the order
    SGLang's cache controller attaches one (what raises here fails SGLang's attach)."""
    cfg = storage_config(extra, mla=mla, layout=pool.layout, **cfg_kw)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def fill_random(pool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    buf = pool.kv_buffer
    buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))


def pages_of(pool, pages) -> torch.Tensor:
    """SGLang's host indices of whole pages (what its page allocator hands out)."""
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages])


def page_bytes(pool, page: int) -> bytes:
    """Every byte of one page, read through SGLang's own zero-copy metadata."""
    import ctypes

    ptrs, sizes = pool.get_page_buffer_meta(pages_of(pool, [page]))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def page_hashes(n: int, seed: int = 0) -> list[str]:
    """SGLang's page hash strings of n chained pages."""
    from sglang.srt.mem_cache.utils import get_hash_str

    out, prior = [], None
    for i in range(n):
        prior = get_hash_str([seed * 100_000 + i * PAGE + t for t in range(PAGE)], prior)
        out.append(prior)
    return out
