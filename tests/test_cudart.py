"""The host pool's CUDA registration logic (kvcached.host.cudart) against a fake runtime: pure logic,
the calls themselves run only on a GPU (tests/gpu)."""
import pytest

from kvcached.host import cudart


class FakeRuntime:
    """Registers what it is asked to unless the size is over `ceiling`; like the real runtime,
    a failure leaves a sticky error until get_last_error() reads it."""

    def __init__(self, ceiling):
        self.ceiling = ceiling
        self.registered = {}
        self.sticky = 0

    def host_register(self, ptr, nbytes, flags):
        if nbytes > self.ceiling:
            self.sticky = 1
            return 1
        self.registered[ptr] = (nbytes, flags)
        return 0

    def host_unregister(self, ptr):
        return 0 if self.registered.pop(ptr, None) else 1

    def host_get_device_pointer(self, ptr):
        assert ptr in self.registered
        return ptr + (1 << 40)  # a device address that is not the host address

    def get_last_error(self):
        err, self.sticky = self.sticky, 0
        return err

    def error_string(self, err):
        return f"cudaErrorInvalidValue ({err})"


def test_the_pool_is_registered_in_one_call():
    rt = FakeRuntime(ceiling=1 << 40)
    cudart.register_all(rt, 4096, 3 << 30, cudart.CUDA_HOST_REGISTER_PORTABLE | cudart.CUDA_HOST_REGISTER_MAPPED)
    assert rt.registered == {4096: (3 << 30, 3)}  # one registration: no copy can span two


def test_a_failed_registration_leaves_nothing_registered_and_no_sticky_error():
    rt = FakeRuntime(ceiling=1 << 30)
    with pytest.raises(RuntimeError, match=r"2\.0 GiB host pool failed: cudaErrorInvalidValue .*--host-cache-gb"):
        cudart.register_all(rt, 4096, 2 << 30, 3)
    assert rt.registered == {} and rt.sticky == 0


def test_zero_copy_takes_the_device_address_the_runtime_gives():
    rt = FakeRuntime(ceiling=1 << 40)
    cudart.register_all(rt, 4096, 1 << 20, 3)
    assert cudart.device_address(rt, 4096) == 4096 + (1 << 40)


def test_without_a_loaded_cuda_runtime_the_binding_says_so():
    if cudart._loaded_cudart_path() is not None:
        pytest.skip("this process has a CUDA runtime loaded")
    with pytest.raises(RuntimeError, match="libcudart is not loaded"):
        cudart.LibCudart()


# --- a pool registered in parts: the cuts, the rollback, and copies split at the cuts -------

import numpy as np  # noqa: E402
import torch  # noqa: E402
from conftest import small_kv  # noqa: E402

from kvcached.copy import strategies as cs  # noqa: E402
from kvcached.copy.strategy_copier import StrategyCopier  # noqa: E402
from kvcached.copy.transfer import TaskKind  # noqa: E402
from kvcached.host import pin_plan  # noqa: E402
from kvcached.host import pool as host_pool  # noqa: E402
from kvcached_client.kv_alloc import describe_kv_cache  # noqa: E402
from kvcached_proto.layout import parse_layout  # noqa: E402


def test_cuts_fall_on_host_pages_at_block_boundaries():
    rng = np.random.default_rng(3)
    for _ in range(200):
        stride = int(rng.choice([4096, 6144, 12288, 32768, 1000 * 8]))
        count, ceiling = int(rng.integers(50, 400)), int(rng.integers(16, 64)) * 4096
        regions = [pin_plan.Region(i * stride * count, stride, count) for i in range(3)]
        capacity = 3 * stride * count + int(rng.integers(0, 4)) * 4096
        try:
            parts = pin_plan.chunks(regions, capacity, ceiling)
        except ValueError:
            continue  # no allowed cut within the ceiling: the pool halves on to a larger error
        assert parts[0][0] == 0 and sum(size for _, size in parts) == capacity
        for (off, size), (nxt, _) in zip(parts, parts[1:]):
            assert off + size == nxt and size <= ceiling and nxt % 4096 == 0
            for r in regions:
                assert not r.start < nxt < r.end or (nxt - r.start) % r.stride == 0


def _deferred_pool(layout, fake, monkeypatch):
    monkeypatch.setattr(host_pool, "MIN_PIN_PART_BYTES", 64 << 10)
    kv = small_kv(num_layers=3, num_blocks=16, block_shape=(16, 2, 8))  # 512-byte parts
    spec = parse_layout(describe_kv_cache(kv))
    pool = host_pool.HostPool(8 << 20, "cpu", layout=layout)
    pool._rt, pool._pinned_ptr, pool._pin_deferred = fake, pool.buffer.data_ptr(), True
    return kv, spec, pool


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_pool_one_call_cannot_take_is_registered_in_parts_no_copy_spans(layout, monkeypatch):
    fake = FakeRuntime(ceiling=1_500_000)
    kv, spec, pool = _deferred_pool(layout, fake, monkeypatch)
    pool.configure(spec)
    parts = pool._parts
    assert len(parts) > 1 and all(size <= fake.ceiling for _, size in parts)
    assert sorted(fake.registered) == [pool._pinned_ptr + off for off, _ in parts] and fake.sticky == 0
    assert any(any(c for c in row) for row in pool.block_cuts)
    # the runs a copy takes never cross a registration: record them
    seen = []
    monkeypatch.setattr(cs, "offload_runs", lambda dev, host, pairs, nb: seen.append(pairs))
    dev_views = [[t.view(t.shape[0], -1).view(torch.uint8) for t in layer] for layer in kv]
    copier = StrategyCopier(dev_views, pool.views, "runs", pool.block_cuts)
    n = pool.num_blocks
    plan = copier.plan(TaskKind.OFFLOAD, np.zeros(n, dtype=np.int64) + np.arange(n) % 16, np.arange(n))
    for layer in range(spec.num_layers):
        copier.offload_layer(layer, plan)
    flat_cuts = {layer * 10 + p: set(c) for layer, row in enumerate(pool.block_cuts) for p, c in enumerate(row)}
    for i, pairs in enumerate(seen):
        cuts = flat_cuts[(i // len(spec.parts)) * 10 + i % len(spec.parts)]
        for _, h, k in pairs:
            assert not any(h < c < h + k for c in cuts), (h, k, sorted(cuts))
    pool.close()
    assert fake.registered == {}


def test_registering_in_parts_rolls_back_and_says_so_when_nothing_fits(monkeypatch):
    fake = FakeRuntime(ceiling=10_000)  # below the smallest part size tried
    kv, spec, pool = _deferred_pool("layer_first", fake, monkeypatch)
    with pytest.raises(RuntimeError, match="could not be registered with CUDA, whole or in parts"):
        pool.configure(spec)
    assert fake.registered == {} and fake.sticky == 0


def test_a_layout_the_pool_cannot_pin_leaves_the_pool_as_it_was(monkeypatch):
    """#32 LOW: a new geometry whose blocks no part size can cut (8000-byte parts: a cut every
    512,000 bytes at best, over the runtime's 300,000) is refused with the old layout's views,
    allocator and registration in place, not a pool half carved and unregistered."""
    fake = FakeRuntime(ceiling=300_000)
    _, spec_a, pool = _deferred_pool("layer_first", fake, monkeypatch)
    pool.configure(spec_a)
    parts_a, views_a, alloc_a = list(pool._parts), pool.views, pool.allocator
    assert len(parts_a) > 1
    spec_b = parse_layout(describe_kv_cache(small_kv(num_layers=3, num_blocks=16, block_shape=(1000, 2, 2))))
    with pytest.raises(RuntimeError, match="could not be registered"):
        pool.configure(spec_b)
    assert pool.spec is spec_a and pool.views is views_a and pool.allocator is alloc_a
    assert pool._parts == parts_a and fake.sticky == 0
    assert sorted(fake.registered) == [pool._pinned_ptr + off for off, _ in parts_a]
    pool.close()
    assert fake.registered == {}


def test_split_runs_cover_the_same_blocks_and_cross_no_cut():
    rng = np.random.default_rng(5)
    for _ in range(300):
        cuts = sorted(set(int(c) for c in rng.integers(1, 100, int(rng.integers(0, 6)))))
        pairs = [(int(d), int(h), int(n)) for d, h, n in rng.integers(0, 60, (5, 3)) if n > 0]
        split = cs.split_pairs(pairs, cuts)
        assert [(d + i, h + i) for d, h, n in split for i in range(n)] == \
            [(d + i, h + i) for d, h, n in pairs for i in range(n)]
        assert not any(h < c < h + n for _, h, n in split for c in cuts)
        runs = [(a, a + n, h) for a, h, n in pairs]
        assert sum(b - a for a, b, _ in cs.split_host_runs(runs, cuts)) == sum(n for *_, n in pairs)
