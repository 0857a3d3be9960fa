"""The torch copy strategies (the CUDA copier's code) on CPU tensors, byte for byte, and through
a real daemon started with --copy-strategy."""
import threading

import numpy as np
import pytest
import torch
from conftest import small_kv, unique_instance

from kvcached.copy import strategies as cs
from kvcached.copy.strategy_copier import STAGING_BYTES, StrategyCopier
from kvcached.copy.transfer import TaskKind
from kvcached_client import BlockHasher, launch

HASHER = BlockHasher("strategy-test|bfloat16")


def host_views(layout: str, num_layers: int, parts: int, n: int, row: int):
    """Host rows as HostPool carves them: layer_first regions or page_first strided pages."""
    page = num_layers * parts * row
    buf = torch.zeros(n * page, dtype=torch.uint8)
    views, offset = [], 0
    for _ in range(num_layers):
        out = []
        for _ in range(parts):
            if layout == "layer_first":
                out.append(buf[offset:offset + n * row].view(n, row))
                offset += n * row
            else:
                out.append(buf[offset:offset + (n - 1) * page + row].as_strided((n, row), (page, 1)))
                offset += row
        views.append(out)
    return views


def check_round_trip(copier, dev, host, rng, ids: str, num_host: int) -> None:
    """17 blocks offloaded (scattered ids, or runs) land in their host rows byte for byte; loaded
    back into other device blocks of zeroed KV, they come back and nothing else is written."""
    layers, parts, (num_dev, row) = len(dev), len(dev[0]), dev[0][0].shape
    original = [[t.clone() for t in r] for r in dev]
    n = 17
    if ids == "scattered":
        src, hid = rng.permutation(num_dev)[:n], rng.permutation(num_host)[:n]
    else:
        src, hid = np.arange(5, 5 + n), np.concatenate([np.arange(20, 30), np.arange(2, 9)])
    plan = copier.plan(TaskKind.OFFLOAD, src.astype(np.int64), hid.astype(np.int64))
    moved = sum(copier.offload_layer(layer, plan) for layer in range(layers))
    assert moved == n * row * layers * parts
    for layer in range(layers):
        for p in range(parts):
            assert torch.equal(host[layer][p][torch.from_numpy(hid)],
                               original[layer][p][torch.from_numpy(src)])
    for r in dev:
        for t in r:
            t.fill_(0)
    dst = rng.permutation(num_dev)[:n].astype(np.int64)
    plan = copier.plan(TaskKind.LOAD, dst, hid.astype(np.int64))
    for layer in range(layers):
        copier.load_layer(layer, plan)
    untouched = np.setdiff1d(np.arange(num_dev), dst)
    for layer in range(layers):
        for p in range(parts):
            assert torch.equal(dev[layer][p][torch.from_numpy(dst)],
                               original[layer][p][torch.from_numpy(src)])
            assert not dev[layer][p][torch.from_numpy(untouched)].any(), "a block not asked for was written"


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("strategy", ["runs", "gather", "zero_copy", "dma", "auto"])
@pytest.mark.parametrize("ids", ["scattered", "runs"])
def test_strategy_round_trip_is_byte_exact(layout, strategy, ids, monkeypatch):
    # chunks of 3 rows (the name the copier reads: patched where cuda_copier re-exported it, the
    # test copied in one chunk)
    monkeypatch.setattr("kvcached.copy.strategy_copier.STAGING_BYTES", 3 * 96)
    rng = np.random.default_rng(sum(map(ord, layout + strategy + ids)))
    layers, parts, num_dev, num_host, row = 3, 2, 40, 50, 96
    dev = [[torch.from_numpy(rng.integers(0, 256, (num_dev, row), dtype=np.uint8))
            for _ in range(parts)] for _ in range(layers)]
    host = host_views(layout, layers, parts, num_host, row)
    check_round_trip(StrategyCopier(dev, host, strategy), dev, host, rng, ids, num_host)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("ids", ["scattered", "runs"])
def test_dma_split_between_threads_is_byte_exact(layout, ids, monkeypatch):
    """--dma-threads 4: each layer's copy list is cut in shares queued by 4 threads (here at 2
    copies a thread and more); the bytes are those of one thread, and the shares cover the list."""
    monkeypatch.setattr("kvcached.copy.strategy_copier.DMA_SPLIT_MIN", 2)
    rng = np.random.default_rng(sum(map(ord, layout + ids)))
    layers, parts, num_dev, num_host, row = 3, 2, 40, 50, 96
    dev = [[torch.from_numpy(rng.integers(0, 256, (num_dev, row), dtype=np.uint8))
            for _ in range(parts)] for _ in range(layers)]
    host = host_views(layout, layers, parts, num_host, row)
    copier = StrategyCopier(dev, host, "dma", dma_threads=4)
    calls = []
    copy = copier.memcpy.copy
    copier.memcpy.copy = lambda d, s, n, stream: (calls.append((threading.current_thread().name, len(n))),
                                                  copy(d, s, n, stream))
    check_round_trip(copier, dev, host, rng, ids, num_host)
    threads = {name for name, _ in calls}
    per_layer = len(calls) / (2 * layers)
    if ids == "scattered" or layout == "page_first":  # 34 copies a layer: 4 shares
        assert per_layer == 4 and "MainThread" in threads and len(threads) > 1, calls
    copier.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvcached-dma")]


def test_auto_picks_runs_for_long_runs_and_gather_for_scattered_ids():
    dev = [[torch.zeros(64, 16, dtype=torch.uint8)]]
    copier = StrategyCopier(dev, host_views("layer_first", 1, 1, 64, 16), "auto")
    assert copier.plan(TaskKind.OFFLOAD, np.arange(10, 42), np.arange(0, 32)).extra["strategy"] == "runs"
    scattered = np.random.default_rng(1).permutation(64)[:32]
    assert copier.plan(TaskKind.OFFLOAD, scattered, np.arange(32)).extra["strategy"] == "gather"
    paged = StrategyCopier(dev, host_views("page_first", 2, 1, 64, 8)[:1], "auto")
    assert paged.plan(TaskKind.OFFLOAD, np.arange(32), np.arange(32)).extra["strategy"] == "gather", \
        "page_first host rows take one copy per block: gather is the one DMA per block there"


def test_widen_picks_the_widest_element_the_rows_allow():
    assert cs.widen(torch.zeros(4, 64, dtype=torch.uint8)).dtype == torch.int64
    assert cs.widen(torch.zeros(4, 6, dtype=torch.uint8)).dtype == torch.int16
    assert cs.widen(torch.zeros(4, 7, dtype=torch.uint8)).dtype == torch.uint8
    assert STAGING_BYTES >= 1 << 20


def test_host_runs_split_for_strided_rows():
    runs = [(0, 3, 10), (3, 4, 2)]
    assert cs.host_runs_for(runs, True) == runs
    assert cs.host_runs_for(runs, False) == [(0, 1, 10), (1, 2, 11), (2, 3, 12), (3, 4, 2)]


def test_a_daemon_with_dma_threads_round_trips_a_large_scattered_task(run_dir):
    """--dma-threads 4 through a real daemon: 500 scattered blocks, 1,000 copies a layer, queued
    by 4 threads; offload and layer-wise load are byte-exact and nothing else is written."""
    h = launch(instance=unique_instance("cs"), run_dir=run_dir, host_cache_gb=0.1,
               extra_args=["--copy-strategy", "dma", "--dma-threads", "4"])
    try:
        kv = small_kv(num_layers=3, num_blocks=1100)
        for layer in kv:
            for t in layer:
                t.copy_(torch.randn(t.shape).to(t.dtype))
        rng = np.random.default_rng(3)
        src, dst = rng.permutation(550)[:500].tolist(), (550 + rng.permutation(550)[:500]).tolist()
        with h.connect() as c:
            assert c.register_kv_cache(kv)["copy_strategy"] == "dma"
            assert c.status()["kv"]["dma_threads"] == 4
            keys = HASHER.hash_blocks(list(range(16 * 500)), 16)
            expected = [[t[src].clone() for t in layer] for layer in kv]
            assert c.offload(src, keys).wait(30)["stored"] == 500
            for layer in kv:
                for t in layer:
                    t.fill_(0)
            task = c.load(keys, dst)
            for layer in range(3):
                task.wait_layer(layer, timeout=30)
            assert task.wait(30) == 500
            rest = sorted(set(range(1100)) - set(dst))
            for i, layer in enumerate(kv):
                for j, t in enumerate(layer):
                    assert torch.equal(t[dst], expected[i][j]), f"layer {i} part {j}"
                    assert not t[rest].any(), "a block not asked for was written"
            assert c.check() == "ok"
    finally:
        h.stop()


@pytest.mark.parametrize("strategy,layout", [("runs", "page_first"), ("gather", "layer_first"),
                                             ("zero_copy", "page_first"), ("dma", "layer_first"),
                                             ("dma", "page_first"), ("native", "page_first"),
                                             ("numpy", "layer_first")])
def test_daemon_with_copy_strategy_round_trips(strategy, layout, run_dir):
    h = launch(instance=unique_instance("cs"), run_dir=run_dir, host_cache_gb=0.1,
               extra_args=["--copy-strategy", strategy, "--host-layout", layout])
    try:
        kv = small_kv(num_layers=3, num_blocks=48)
        for layer in kv:
            for t in layer:
                t.copy_(torch.randn(t.shape).to(t.dtype))
        with h.connect() as c:
            reply = c.register_kv_cache(kv)
            assert reply["copy_strategy"] == strategy
            assert "load_events" not in reply  # events are for CUDA daemons
            keys = HASHER.hash_blocks(list(range(16 * 12)), 16)
            src = [3, 4, 5, 6, 20, 11, 30, 31, 32, 40, 1, 2]
            expected = [[t[src].clone() for t in layer] for layer in kv]
            assert c.offload(src, keys).wait(10)["stored"] == 12
            for layer in kv:
                for t in layer:
                    t.fill_(0)
            dst = [7, 8, 9, 10, 44, 45, 12, 13, 0, 47, 33, 34]
            task = c.load(keys, dst)
            for layer in range(3):
                task.wait_layer(layer, timeout=10)
            assert task.wait(10) == 12
            for i, layer in enumerate(kv):
                for j, t in enumerate(layer):
                    assert torch.equal(t[dst], expected[i][j]), f"layer {i} part {j}"
            assert c.check() == "ok"
    finally:
        h.stop()


def test_numpy_strategy_is_refused_for_cuda_daemons_and_dma_threads_need_dma(run_dir):
    from kvcached.config import DaemonConfig
    from kvcached.errors import StartupError

    for strategy in ("numpy", "native"):
        with pytest.raises(StartupError, match=strategy):
            DaemonConfig(device="cuda:0", copy_strategy=strategy, run_dir=run_dir).validate()
    with pytest.raises(StartupError, match="copy-strategy"):
        DaemonConfig(copy_strategy="fast", run_dir=run_dir).validate()
    for threads in (0, 9):
        with pytest.raises(StartupError, match="expected 1..8"):
            DaemonConfig(copy_strategy="dma", dma_threads=threads, run_dir=run_dir).validate()
    with pytest.raises(StartupError, match="dma only .this daemon's is auto"):
        DaemonConfig(dma_threads=4, run_dir=run_dir).validate()  # a flag that would do nothing
    assert DaemonConfig(copy_strategy="dma", dma_threads=4, run_dir=run_dir).validate().dma_threads == 4


def test_a_protocol_1_2_offload_event_is_refused_and_changes_nothing(daemon):
    """1.3 replaced CUDA IPC events by the order words: an offload with 1.2's `event` field is
    BAD_FIELD (silently ignoring it would drop the ordering it asked for)."""
    import os

    from kvcached_client import RequestError
    from kvcached_proto import ErrorCode, Op, pack_block_ids, pack_keys

    kv = small_kv(num_layers=2, num_blocks=16)
    with daemon.connect() as c:
        assert c.register_kv_cache(kv)["copy_strategy"] == "native"
        assert c.order is not None and c.order.ops is None  # CPU: the words, no CUDA
        keys = HASHER.hash_blocks(list(range(16 * 3)), 16)
        with pytest.raises(RequestError) as err:
            c._request(Op.OFFLOAD, None, keys=pack_keys(keys), blocks=pack_block_ids([0, 1, 2]),
                       event=os.urandom(64))
        assert err.value.code == ErrorCode.BAD_FIELD and "event" in err.value.message
        assert c.lookup(keys) == (0, 0)


def test_chunks_reuse_the_staging_buffer_when_it_holds_fewer_rows(monkeypatch):
    """The patch above reaches the copier: 17 scattered blocks through 3-row staging are 6
    gathers a part (#33: patched under cuda_copier's name, they were 1)."""
    monkeypatch.setattr("kvcached.copy.strategy_copier.STAGING_BYTES", 3 * 96)
    seen = []
    real = torch.index_select
    monkeypatch.setattr(torch, "index_select", lambda *a, **k: (seen.append(1), real(*a, **k))[1])
    dev = [[torch.zeros(40, 96, dtype=torch.uint8)]]
    copier = StrategyCopier(dev, host_views("layer_first", 1, 1, 50, 96), "gather")
    plan = copier.plan(TaskKind.OFFLOAD, np.random.default_rng(0).permutation(40)[:17], np.arange(17))
    copier.offload_layer(0, plan)
    assert len(seen) == 6
