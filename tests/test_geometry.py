"""KV registered as regions of allocations (kvcached_proto.geometry): every layout whose blocks
are a constant stride apart registers and round-trips byte for byte; what cannot be registered
is refused with its reason and changes nothing."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import keys_for, sweep_crashed, unique_instance
from kv_layouts import REGISTERABLE, make_kv, parts_of, round_trip, vllm_kv

from kvcached_client import allocate_kv_buffer, launch
from kvcached_client.kv_alloc import describe_kv_cache
from kvcached_proto import ErrorCode, KvcachedError, Op, ProtocolError, RequestError
from kvcached_proto.geometry import Region, check_disjoint, overlap
from kvcached_proto.layout import parse_layout

# the pure logic --------------------------------------------------------------------------------


def _bytes_of(r: Region, n: int) -> set[int]:
    return {r.offset + k * r.block_stride + i for k in range(n) for i in range(r.block_bytes)}


def test_overlap_is_exact_for_equal_strides_and_never_misses():
    rng = random.Random(7)
    for _ in range(4000):
        n = rng.randint(1, 5)
        a, b = (Region(0, rng.randint(0, 40), bb + rng.randint(0, 8), bb)
                for bb in (rng.randint(1, 6), rng.randint(1, 6)))
        truth = bool(_bytes_of(a, n) & _bytes_of(b, n))
        if a.block_stride == b.block_stride:
            assert overlap(a, b, n) == truth, (a, b, n)
        elif truth:
            assert overlap(a, b, n), (a, b, n)


def test_check_disjoint_finds_a_shared_byte_among_many_regions():
    # vLLM's block-outermost packing: 40 layers' pages interleaved, one stride
    page, layers, n = 96, 40, 50
    regions = [Region(0, 16 + i * page, layers * page, page) for i in range(layers)]
    assert check_disjoint(regions, n) is None
    # layer-outermost: one contiguous region per layer
    assert check_disjoint([Region(0, i * page * n, page, page) for i in range(layers)], n) is None
    bad = regions + [Region(0, 16 + 7 * page + 5, layers * page, 8)]  # inside layer 7's page
    assert set(check_disjoint(bad, n)) == {7, layers}
    assert check_disjoint(bad[:-1] + [Region(1, 16, layers * page, page)], n) is None  # other alloc


def _layout(**tensor):
    t = {"layer": 0, "part": 0, "dtype": "uint8", "shape": [4, 64], "alloc": 0, "offset": 0,
         "block_stride": 64, **tensor}
    return {"device": "cpu", "num_layers": 1, "num_blocks": 4,
            "allocations": [{"kind": "shm", "name": "/kvcached.0.kv.1.1", "size": 4096}],
            "tensors": [t]}


@pytest.mark.parametrize("fields,reason", [
    ({"block_stride": 32}, "blocks would overlap"),
    ({"alloc": 1}, "alloc"),
    ({"offset": -1}, "offset"),
    ({"block_stride": 2**49}, "ends past"),
])
def test_a_bad_region_is_refused_with_its_reason(fields, reason):
    with pytest.raises(ProtocolError, match=reason) as e:
        parse_layout(_layout(**fields))
    assert e.value.code == ErrorCode.KV_MISMATCH


def test_regions_sharing_bytes_are_refused():
    layout = _layout()
    layout["num_layers"] = 2
    layout["tensors"].append({**layout["tensors"][0], "layer": 1, "offset": 128})
    with pytest.raises(ProtocolError, match="share bytes"):
        parse_layout(layout)
    layout["tensors"][1]["offset"] = 256
    assert parse_layout(layout).tensors[1].region == Region(0, 256, 64, 64)


def test_the_byte_order_of_a_block_is_part_of_the_geometry():
    _, lbnhc = vllm_kv("LBNHC", heads=4, tokens=4)
    _, lbhnc = vllm_kv("LBHNC", heads=4, tokens=4)
    a, b = parse_layout(describe_kv_cache(lbnhc)), parse_layout(describe_kv_cache(lbhnc))
    assert a.parts == b.parts and a.page_bytes == b.page_bytes
    assert a.geometry() != b.geometry()  # same shapes, other bytes: the host tier starts over


# against a real daemon -------------------------------------------------------------------------


@pytest.mark.parametrize("name", REGISTERABLE)
def test_every_layout_round_trips_byte_exact_and_touches_nothing_else(shared_daemon, name):
    _round_trip(shared_daemon, name, offset=24 if name in ("BLNHC", "LBHNC") else 0)


def _round_trip(daemon, name: str, offset: int = 0) -> None:
    round_trip(daemon, *make_kv(name, offset=offset), keys_for(6, seed=sum(map(ord, name))))


@pytest.fixture(scope="module", params=[("numpy", "page_first"), ("runs", "layer_first"),
                                        ("gather", "page_first"), ("zero_copy", "layer_first"),
                                        ("native", "layer_first"), ("native", "page_first")])
def strategy_daemon(request, module_run_dir):
    strategy, host_layout = request.param
    name = unique_instance("g")
    h = launch(instance=name, run_dir=module_run_dir, host_cache_gb=0.1,
               extra_args=["--copy-strategy", strategy, "--host-layout", host_layout])
    yield h
    h.stop()
    sweep_crashed(name)


@pytest.mark.parametrize("name", ["BLNHC", "flashinfer"])
def test_strided_blocks_round_trip_in_every_copy_strategy(strategy_daemon, name):
    """Device rows a stride apart through the torch strategies (the CUDA copier's code), the
    numpy copier and the native one, into both host layouts."""
    round_trip(strategy_daemon, *make_kv(name), keys_for(6, seed=sum(map(ord, name))))


@pytest.mark.parametrize("name", ["LHBNC", "BHLNC"])
def test_a_layout_whose_blocks_are_not_contiguous_names_the_reason(name):
    _, kv = vllm_kv(name)
    with pytest.raises(KvcachedError, match="not one contiguous run"):
        describe_kv_cache(kv)


def test_layers_sharing_one_tensor_are_refused_and_change_nothing(shared_daemon):
    _, kv = vllm_kv("LBNHC")
    with shared_daemon.connect(timeout=10) as c:
        with pytest.raises(RequestError, match="share bytes") as e:
            c.register_kv_cache([kv[0], kv[1], kv[1]])  # KV sharing between layers
        assert e.value.code == ErrorCode.KV_MISMATCH
        assert c.status()["kv"]["registered"] is False


def test_memory_the_daemon_cannot_map_is_refused_with_the_way_out():
    with pytest.raises(KvcachedError, match="allocate_kv_buffer"):
        describe_kv_cache([torch.zeros(4, 16)])


def test_a_region_past_its_allocation_is_refused(shared_daemon):
    raw = allocate_kv_buffer(4096)
    kv = [raw[:1024].view(4, 256)]
    layout = describe_kv_cache(kv)
    layout["tensors"][0]["offset"] = 4096 - 3 * 256  # the last block would end 256 bytes past
    with shared_daemon.connect(timeout=10) as c:
        with pytest.raises(RequestError, match="allocation holds 4096 bytes"):
            c._request(Op.REGISTER_KV, layout=layout)
        assert c.status()["kv"]["registered"] is False


def test_block_order_must_agree_across_layers():
    _, a = vllm_kv("LBNHC", layers=2)
    _, b = vllm_kv("LBHNC", layers=2)
    with pytest.raises(KvcachedError, match="ordered"):
        describe_kv_cache([a[0], b[1]])


def test_every_entry_names_a_region_of_an_allocation_and_no_1_3_handle():
    for name in REGISTERABLE:
        _, kv = make_kv(name)
        layout = describe_kv_cache(kv)
        for entry, t in zip(layout["tensors"], itertools.chain(*parts_of(kv))):
            assert "handle" not in entry and entry["alloc"] < len(layout["allocations"]), (name, entry)
            assert entry["block_stride"] >= t[0].numel() * t.element_size()


def test_a_1_3_layout_is_refused_saying_what_to_upgrade(shared_daemon):
    """Protocol 1.3's form - a handle per tensor, no allocations - is below the floor: refused
    with a reason, nothing registered (it was mapped before the floor was raised)."""
    _, kv = make_kv("kvcached")
    layout = describe_kv_cache(kv)
    del layout["allocations"], layout["kv_layout"]
    for entry in layout["tensors"]:
        entry["handle"] = {"kind": "shm", "name": "/kvcached.0.kv.1.1", "offset": entry.pop("offset")}
        del entry["alloc"], entry["block_stride"]
    with shared_daemon.connect(timeout=10) as c:
        with pytest.raises(RequestError, match="1.3's form") as e:
            c._request(Op.REGISTER_KV, layout=layout)
        assert e.value.code == ErrorCode.KV_MISMATCH
        assert c.status()["kv"]["registered"] is False


def test_an_ipc_handle_that_is_not_bytes_is_refused_without_allocating_it():
    """`bytes(10**12)` would allocate a terabyte of zeros in the daemon."""
    from kvcached.copy.kv_mapping import _bytes_field
    from kvcached.errors import OpError

    with pytest.raises(OpError, match="expected bytes"):
        _bytes_field({"handle": 10**12}, "handle")
    assert _bytes_field({"handle": b"\x01" * 64}, "handle") == b"\x01" * 64
    assert _bytes_field({}, "event_handle", required=False) == b""


def test_one_segment_named_twice_cannot_hide_shared_bytes(shared_daemon):
    """Two allocations naming one segment, regions overlapping in it."""
    raw = allocate_kv_buffer(8192)
    kv = [raw[:2048].view(4, 512), raw[4096:6144].view(4, 512)]
    layout = describe_kv_cache(kv)
    layout["allocations"].append(dict(layout["allocations"][0]))
    layout["tensors"][1].update(alloc=1, offset=1024)  # inside layer 0's blocks 2 and 3
    with shared_daemon.connect(timeout=10) as c:
        with pytest.raises(RequestError, match="share bytes") as e:
            c._request(Op.REGISTER_KV, layout=layout)
        assert e.value.code == ErrorCode.KV_MISMATCH
        assert c.status()["kv"]["registered"] is False


def test_a_layout_of_a_deep_model_with_one_allocation_per_tensor_registers(run_dir, instance):
    """vLLM <= 0.13 gives each layer a tensor of its own; an 80-layer model with K and V apart
    is 160 allocations, which registration refused past 64. Unmapping them took the daemon a
    garbage collection each, 10 s in all, drained: it did not stop within 10 s of SIGTERM."""
    from kvcached_client import allocate_kv_buffer, launch

    layers, blocks, shape = 80, 4, (4, 2, 8)
    kv = []
    for _ in range(layers):
        pair = []
        for _part in range(2):
            flat = allocate_kv_buffer(blocks * 64 * 2)
            pair.append(flat.view(torch.bfloat16).view(blocks, *shape))
        kv.append(tuple(pair))
    assert len(describe_kv_cache(kv)["allocations"]) == 2 * layers
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    try:
        with daemon.connect() as c:
            c.register_kv_cache(kv)
            assert c.status()["kv"]["num_layers"] == layers
    finally:
        assert daemon.stop() == 0  # a clean exit, not SIGKILL after 10 s


def test_the_kv_gpu_is_this_processs_ordinal_of_its_uuid():
    """The daemon's CUDA_VISIBLE_DEVICES may number the GPUs otherwise than the engine's: the
    order words (and the mapping) go on the ordinal found by UUID, not on the engine's cuda:N."""
    from kvcached.copy.kv_mapping import ordinal_of
    from kvcached.errors import OpError
    from kvcached_proto.layout import LayoutSpec

    def spec(device, uuid):
        return LayoutSpec(device, 1, 1, (), (), gpu_uuid=uuid)

    assert ordinal_of(spec("cuda:0", "GPU-b"), ["GPU-a", "GPU-b"]) == 1
    assert ordinal_of(spec("cuda:2", None), ["GPU-a"]) == 2  # no UUID sent: its ordinal
    with pytest.raises(OpError, match="does not see"):
        ordinal_of(spec("cuda:0", "GPU-z"), ["GPU-a", "GPU-b"])


def test_order_words_cuda_refuses_are_a_kv_mismatch_on_the_named_device():
    import numpy as np

    from kvcached.copy.order import DaemonOrder
    from kvcached.errors import OpError

    asked = []

    def refusing(device, address, nbytes):
        asked.append(device)
        raise RuntimeError("CUDA error: invalid device ordinal")

    with pytest.raises(OpError) as e:  # was a RuntimeError: INTERNAL, a daemon bug as reported
        DaemonOrder(np.zeros(64, np.uint64), 2, "cuda:1", ops_factory=refusing)
    assert e.value.code == ErrorCode.KV_MISMATCH and "cuda:1" in e.value.message
    assert asked == ["cuda:1"]
