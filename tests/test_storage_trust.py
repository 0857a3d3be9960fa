"""What a storage tier may serve: only records written from the same KV geometry (dtype, block
shape, axis order, layers, parts), never one another user could plant, never hits from a tier
that is gone. Real daemons, real files, a real redis-server."""
import pytest
import torch

from conftest import blocks_equal, disk_uri, keys_for, scramble, small_kv, snapshot
from kv_layouts import vllm_kv
from test_storage import offload_and_flush, start


def _random_fill(kv, seed):
    gen = torch.Generator().manual_seed(seed)
    for layer in kv:
        for t in layer if isinstance(layer, (list, tuple)) else (layer,):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def _engine(kind: str, seed: int):
    """An engine's KV cache, 1 KiB per layer and part of a block in every kind: A is fp32
    (4, 2, 8); "dtype" is bf16 (4, 2, 16); "axis_order" is A's geometry with its block's axes
    in another memory order (vLLM's LBHNC against LBNHC, the same logical shape)."""
    if kind == "A":
        kv = small_kv(num_layers=2, num_blocks=32, block_shape=(4, 2, 8), dtype=torch.float32, seed=seed)
    elif kind == "dtype":
        kv = small_kv(num_layers=2, num_blocks=32, block_shape=(4, 2, 16), dtype=torch.bfloat16, seed=seed)
    else:
        _raw, kv = vllm_kv(kind, layers=2, blocks=32, heads=2, tokens=4, c=64)
        _random_fill(kv, seed)
    return kv


@pytest.fixture(params=["disk", "redis"])
def storage_uri(request, disk_dir):
    if request.param == "disk":
        yield disk_uri(disk_dir)
        return
    server = request.getfixturevalue("redis_server")
    yield server.uri


@pytest.mark.parametrize("other", ["dtype", "axis_order"])
def test_a_block_stored_from_another_geometry_is_never_served(run_dir, instance, storage_uri, other):
    """Engine B re-registers the instance with a geometry of its own, the same bytes per
    block: A's stored blocks are no hits for it and a load of A's keys leaves B's blocks as
    they were. An engine with A's geometry still finds them (the control: they are there)."""
    first, second = ("LBNHC", "LBHNC") if other == "axis_order" else ("A", "dtype")
    keys, src, dst = keys_for(8, 70), list(range(8)), list(range(16, 24))
    h = start(run_dir, instance, storage_uri)
    try:
        kv_a = _engine(first, 1)
        stored_bytes = snapshot(kv_a, src)
        with h.connect() as c:
            c.register_kv_cache(kv_a)
            offload_and_flush(c, kv_a, keys, src)
        kv_b = _engine(second, 2)
        before = snapshot(kv_b, dst)
        with h.connect() as c:
            c.register_kv_cache(kv_b)
            assert c.lookup(keys) == (0, 0)
            assert c.load(keys, dst).wait(10) == 0
            assert blocks_equal(kv_b, dst, before)
        kv_a2 = _engine(first, 3)
        scramble(kv_a2, 5)
        with h.connect() as c:
            c.register_kv_cache(kv_a2)
            assert c.lookup(keys) == (0, 8)
            assert c.load(keys, dst).wait(10) == 8
            assert blocks_equal(kv_a2, dst, stored_bytes)
    finally:
        h.stop()
