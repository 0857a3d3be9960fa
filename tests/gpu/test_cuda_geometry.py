"""KV geometry on a real GPU (skipped without one): vLLM 0.32's one-allocation layouts and the
older per-layer ones registered over CUDA IPC as regions and round-tripped byte for byte
(gaps and other layers untouched), one inside a caching-allocator segment at a non-zero
offset; the GPU found by UUID whatever ordinal the engine gives it."""
import pytest
import torch
from conftest import sweep_crashed, unique_instance
from kv_layouts import make_kv, round_trip

from kvcached_client import BlockHasher, launch
from kvcached_client.cuda_order import EngineOrder
from kvcached_client.kv_alloc import describe_kv_cache
from kvcached_proto import ErrorCode, Op, RequestError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

DEV = "cuda:0"


def keys_for(name: str) -> list[bytes]:
    return BlockHasher("gpu-geometry").hash_blocks([sum(map(ord, name)) * 1000 + i
                                                    for i in range(6 * 16)], 16)


@pytest.fixture(scope="module", params=["gather", "runs", "zero_copy", "dma"])
def cuda_daemon(request, module_run_dir):
    name = unique_instance("gg")
    h = launch(instance=name, run_dir=module_run_dir, host_cache_gb=0.25, device=DEV,
               extra_args=["--copy-strategy", request.param])
    yield h
    h.stop()
    sweep_crashed(name)


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "flash_attn",
                                  "flashinfer", "mla"])
def test_every_layout_round_trips_on_cuda(cuda_daemon, name):
    round_trip(cuda_daemon, *make_kv(name, device=DEV, offset=40), keys_for(name))
    torch.cuda.synchronize()


def test_an_allocation_inside_a_caching_allocator_segment(cuda_daemon):
    # the KV (72 KiB) comes from the allocator's small pool (2 MiB segments): so must what takes
    # the segment's start (3 MiB came from the large pool, and the case always skipped)
    keep = torch.empty(256 << 10, dtype=torch.uint8, device=DEV)
    raw, kv = make_kv("BLNHC", device=DEV)
    storage_offset = raw.untyped_storage()._share_cuda_()[3]
    assert storage_offset > 0 or pytest.skip("the allocator put the KV at a segment's start")
    round_trip(cuda_daemon, raw, kv, keys_for("segment"))
    del keep


def test_the_gpu_is_found_by_uuid_not_by_the_engines_ordinal(cuda_daemon):
    _, kv = make_kv("LBNHC", device=DEV)
    layout = describe_kv_cache(kv)
    assert layout["gpu_uuid"].startswith("GPU-")
    layout["device"] = "cuda:3"  # the engine's numbering under another CUDA_VISIBLE_DEVICES
    for handle in layout["allocations"]:
        handle["device"] = 3
    for entry in layout["tensors"]:
        entry.pop("handle", None)  # the 1.3 form carries the ordinal; the region form not
    order = EngineOrder(DEV, layout["num_layers"], lambda: False)
    layout["order_segment"] = order.name
    try:
        with cuda_daemon.connect(timeout=20) as c:
            c._request(Op.REGISTER_KV, layout=layout)
            c._request(Op.UNREGISTER_KV)
            layout["gpu_uuid"] = "GPU-00000000-0000-0000-0000-000000000000"
            with pytest.raises(RequestError, match="does not see") as e:
                c._request(Op.REGISTER_KV, layout=layout)
            assert e.value.code == ErrorCode.KV_MISMATCH
    finally:
        order.close()
