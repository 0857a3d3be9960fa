"""The CUDA path's logic behind its seams, on CPU (#32): what is exported and opened over CUDA
IPC, CUDA KV the daemon cannot map, and the copy kernels warmed before any fence. The CUDA
calls themselves run in tests/gpu."""
import gc

import numpy as np
import pytest
import torch

from kvcached.copy import cuda_copier
from kvcached.copy import strategies as cs
from kvcached.copy.kv_mapping import shared_cuda_args
from kvcached.copy.strategy_copier import StrategyCopier
from kvcached_client import kv_worker
from kvcached_client.kv_alloc import CudaExports
from kvcached_proto.errors import KvcachedError


class FakeShare:
    """What `storage._share_cuda_()` returns, counting the exports (each makes an IPC event)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, storage):
        self.calls += 1
        return (0, b"h%d" % storage.data_ptr(), storage.nbytes(), 0, b"ref", 8, b"event", True)


def test_a_storage_is_exported_once_however_often_it_is_described():
    share = FakeShare()
    exports = CudaExports(share)
    kv = torch.zeros(8, 64)
    first = exports.handle(kv)
    for _ in range(1000):  # describe, registration and every reattach ask again
        assert exports.handle(kv) is first
    assert exports.handle(kv[2:]) is first  # a view of the same storage
    assert share.calls == 1
    assert first["event_handle"] == b"" and first["event_sync_required"] is False
    other = torch.zeros(8, 64)
    assert exports.handle(other)["handle"] != first["handle"] and share.calls == 2


def test_a_freed_storage_is_exported_anew_not_served_from_the_cache():
    share = FakeShare()
    exports = CudaExports(share)
    kv = torch.zeros(1024, 64)
    exports.handle(kv)
    kv.set_(torch.zeros(1024, 64).untyped_storage())  # the tensor moved to other memory
    exports.handle(kv)
    del kv
    gc.collect()
    exports.handle(torch.zeros(1024, 64))  # perhaps at the freed address: a new export
    assert share.calls == 3


def test_the_daemon_opens_no_ipc_event():
    handle = {"handle": b"h", "storage_size": 4096, "storage_offset": 0,
              "ref_counter_handle": b"r", "ref_counter_offset": 8,
              "event_handle": b"e" * 64, "event_sync_required": True}
    args = shared_cuda_args(handle, 3)
    assert args == (3, b"h", 4096, 0, b"r", 8, b"", False)


def _cpu_kv(blocks=4):
    return [(torch.zeros(blocks, 16), torch.zeros(blocks, 16))]  # private memory: unmappable


def test_cuda_kv_the_daemon_cannot_map_is_refused_at_register_not_staged(monkeypatch):
    """#32 MEDIUM: it was staged through CPU shared memory, which a CUDA daemon always refuses:
    the engine ran uncached after one warning. The device is faked: a CPU tensor the daemon
    cannot map stands for CUDA KV in an expandable segment."""
    monkeypatch.setattr(kv_worker, "kv_device", lambda entry: "cuda")
    worker = kv_worker.KVWorker(link=None)
    with pytest.raises(KvcachedError, match="expandable_segments.*--device cpu"):
        worker.register({"layer.0": _cpu_kv()[0]})
    assert worker.mode is None

    class Link:
        def attach_now(self):
            pass

    # staging asked for by name stays possible (a daemon started with --device cpu takes it)
    staged = kv_worker.KVWorker(link=Link(), direct=False)
    assert staged.register({"layer.0": _cpu_kv()[0]}) == "staging"
    staged._staging = None  # (its segment is unlinked once collected)


def test_cpu_kv_the_daemon_cannot_map_is_still_staged():
    class Link:
        attached = False

        def attach_now(self):
            self.attached = True

    worker = kv_worker.KVWorker(link=Link())
    assert worker.register({"layer.0": _cpu_kv()[0]}) == "staging"
    worker._staging = None  # (its segment is unlinked with the process's others)


def _views(blocks=8, width=32, stride=48):
    flat = torch.arange(blocks * stride, dtype=torch.int64)
    return flat.as_strided((blocks, width), (stride, 1))


@pytest.mark.parametrize("strategy", ["runs", "gather", "zero_copy", "auto"])
def test_warm_up_runs_each_kernel_once_on_scratch_memory_only(strategy, monkeypatch):
    """#32 MEDIUM: a kernel's first launch (lazy module loading) behind a queued fence wait
    blocked the daemon's thread until the engine's forward ended. make_copier warms them up:
    every strategy function the copies use runs once, in both directions, on memory that is
    neither the engine's KV nor the host pool."""
    dev = [[_views(), _views(stride=32)]]
    host = [[torch.zeros(16, 32, dtype=torch.int64), torch.zeros(16, 32, dtype=torch.int64)]]
    before = [t.clone() for t in (dev[0] + host[0])]
    calls = []
    for name in ("offload_runs", "load_runs", "offload_gather", "load_gather",
                 "offload_zero_copy", "load_zero_copy"):
        real = getattr(cs, name)
        monkeypatch.setattr(cs, name, lambda *a, _n=name, _f=real: (calls.append((_n, a)), _f(*a)))

    class Pool:
        views, block_cuts = host, None

    if strategy == "auto":  # what a CUDA daemon picks (on CPU auto is the numpy copier)
        copier = StrategyCopier(dev, host, "auto")
        copier.warm_up()
    else:
        copier = cuda_copier.make_copier("cpu", strategy, dev, Pool, 1)
    names = {n for n, _ in calls}
    want = {"runs": {"offload_runs", "load_runs"},
            "gather": {"offload_gather", "load_gather"},
            "zero_copy": {"offload_zero_copy", "load_zero_copy"}}
    expect = want["runs"] | want["gather"] if strategy == "auto" else want[strategy]
    assert names == expect
    assert len(calls) == len(expect) * 2  # each direction once per view shape (strides 48, 32)
    ours = {t.untyped_storage().data_ptr() for t in dev[0] + host[0]}
    for _, args in calls:
        for a in args:
            if isinstance(a, torch.Tensor):
                assert a.untyped_storage().data_ptr() not in ours
    for t, b in zip(dev[0] + host[0], before):
        assert torch.equal(t, b)
    assert isinstance(copier, StrategyCopier)


def test_a_warmed_copier_still_copies_byte_for_byte():
    dev = [[_views()]]
    host = [[torch.zeros(16, 32, dtype=torch.int64)]]

    class Pool:
        views, block_cuts = host, None

    copier = cuda_copier.make_copier("cpu", "gather", dev, Pool, 1)
    plan = copier.plan("offload", np.array([5, 1, 3]), np.array([0, 9, 4]))
    copier.offload_layer(0, plan)
    for d, h in ((5, 0), (1, 9), (3, 4)):
        assert torch.equal(host[0][0][h], dev[0][0][d])
    assert not host[0][0][1].any()


# --- the copy-engine strategy (dma): copy lists and the runtime seam -------------------------

from kvcached.copy import dma  # noqa: E402
from kvcached.copy.transfer import TaskKind  # noqa: E402


def test_runs_are_one_copy_where_both_sides_rows_are_back_to_back():
    dev, host = dma.Rows(1000, 64, 64), dma.Rows(50_000, 64, 64)
    dsts, srcs, sizes = dma.at(dma.offsets([(2, 7, 3), (9, 0, 1)], dev, host), dev, host, to_host=True)
    assert dsts.tolist() == [50_000 + 7 * 64, 50_000] and srcs.tolist() == [1000 + 128, 1000 + 576]
    assert sizes.tolist() == [192, 64]
    dsts, srcs, _ = dma.at(dma.offsets([(2, 7, 3)], dev, host), dev, host, to_host=False)
    assert dsts.tolist() == [1128] and srcs.tolist() == [50_448]


def test_strided_rows_take_one_copy_per_block():
    dev, host = dma.Rows(0, 256, 64), dma.Rows(10_000, 64, 64)  # vLLM's strided per-layer view
    dsts, srcs, sizes = dma.at(dma.offsets([(2, 7, 3)], dev, host), dev, host, to_host=False)
    assert dsts.tolist() == [512, 768, 1024]
    assert srcs.tolist() == [10_000 + 7 * 64, 10_000 + 8 * 64, 10_000 + 9 * 64]
    assert sizes.tolist() == [64, 64, 64]


class RecordingRuntime:
    """The CUDA runtime's copy calls, done as host memmoves (the fake of tests/test_cudart.py's
    kind): counts calls, so a layer's copies are seen to go in one batched call."""

    def __init__(self, batched):
        self.batched, self.calls = batched, []

    def has_memcpy_batch(self):
        return self.batched

    def memcpy_batch_async(self, dsts, srcs, sizes, stream):
        self.calls.append(("batch", len(sizes), stream))
        dma.HostMemcpy().copy(dsts, srcs, sizes, stream)

    def memcpy_async(self, dst, src, n, stream):
        self.calls.append(("one", 1, stream))
        dma.HostMemcpy().copy(np.array([dst], np.uint64), np.array([src], np.uint64),
                              np.array([n], np.uint64), stream)


@pytest.mark.parametrize("batched", [True, False])
def test_dma_moves_each_layer_in_one_runtime_call_and_launches_no_kernel(batched, monkeypatch):
    rng = np.random.default_rng(7)
    layers, parts, blocks, row = 3, 2, 32, 64
    dev = [[torch.from_numpy(rng.integers(0, 1 << 62, (blocks, row // 8))) for _ in range(parts)]
           for _ in range(layers)]
    host = [[torch.zeros(40, row // 8, dtype=torch.int64) for _ in range(parts)] for _ in range(layers)]
    copier = StrategyCopier(dev, host, "dma")
    rt = RecordingRuntime(batched)
    copier.memcpy = dma.CudaMemcpy(rt)
    for name in ("index_select", "index_copy"):  # no index kernel on the path
        monkeypatch.setattr(torch, name, lambda *a, **k: pytest.fail("an index kernel"))
    src, hid = rng.permutation(blocks)[:11], rng.permutation(40)[:11]
    plan = copier.plan(TaskKind.OFFLOAD, src, hid)
    assert "dev_index" not in plan.extra  # no index tensors sent to the device either
    for layer in range(layers):
        copier.offload_layer(layer, plan)
    for layer in range(layers):
        for p in range(parts):
            assert torch.equal(host[layer][p][torch.from_numpy(hid)], dev[layer][p][torch.from_numpy(src)])
    if batched:
        assert rt.calls == [("batch", 2 * 11, 0)] * layers  # both parts, 11 scattered blocks
    else:
        assert len(rt.calls) == layers * 2 * 11
    back = rng.permutation(blocks)[:11]
    for t in (t for r in dev for t in r):
        t.zero_()
    plan = copier.plan(TaskKind.LOAD, back, hid)
    for layer in range(layers):
        copier.load_layer(layer, plan)
    assert all(torch.equal(dev[i][p][torch.from_numpy(back)], host[i][p][torch.from_numpy(hid)])
               for i in range(layers) for p in range(parts))


# --- the CUDA copier's own code: fence wait -> copies on its stream -> word write ----------

import contextlib  # noqa: E402

from kvcached.copy.cuda_copier import CudaCopier  # noqa: E402
from kvcached.copy.order import DaemonOrder  # noqa: E402
from kvcached.copy.transfer import CopyTask  # noqa: E402
from kvcached_proto.order_words import load_word  # noqa: E402


class FakeCuda:
    """torch.cuda as the CUDA copier uses it: streams with handles, a current stream, and a log
    of what ran on which stream."""

    def __init__(self, log):
        self.log, self.current, self.made = log, None, 0

    def is_available(self):
        return True

    def device(self, _device):
        return contextlib.nullcontext()

    def empty_cache(self):
        self.log.append(("empty_cache",))

    def Stream(self):  # noqa: N802 (torch's name)
        self.made += 1
        cuda, handle = self, 0x1000 * self.made

        class Stream:
            cuda_stream = handle

            def synchronize(self):
                cuda.log.append(("sync", self.cuda_stream))

            def wait_event(self, event):
                cuda.log.append(("wait_event", self.cuda_stream, event.number))
        return Stream()

    def Event(self):  # noqa: N802 (torch's name)
        self.events = getattr(self, "events", 0) + 1
        cuda, number = self, self.events

        class Event:
            def record(self, stream):
                cuda.log.append(("record", stream.cuda_stream, number))
        event = Event()
        event.number = number
        return event

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before


class RecordingOps:
    def __init__(self, log):
        self.log = log

    def wait_geq(self, stream, word, value):
        self.log.append(("wait", stream, word, value))

    def write(self, stream, word, value):
        self.log.append(("write", stream, word, value))

    def unregister(self):
        pass


@pytest.mark.parametrize("strategy", ["runs", "dma"])
def test_a_cuda_load_waits_for_the_fence_copies_on_its_stream_then_writes_each_layer(strategy, monkeypatch):
    log = []
    cuda = FakeCuda(log)
    monkeypatch.setattr(CudaCopier, "cuda", cuda)
    monkeypatch.setattr(CudaCopier, "runtime", staticmethod(lambda: RecordingRuntime(batched=True)))
    for name in ("load_runs", "offload_runs"):
        real = getattr(cs, name)
        monkeypatch.setattr(cs, name, lambda *a, _f=real, _n=name: (
            log.append(("copy", cuda.current.cuda_stream)), _f(*a)))
    layers = 2
    dev = [[torch.arange(8 * 4, dtype=torch.int64).view(8, 4) + 100 * i] for i in range(layers)]
    host = [[torch.zeros(8, 4, dtype=torch.int64)] for _ in range(layers)]

    class Pool:
        views, block_cuts = host, None

    words = np.zeros(4096, dtype=np.int64)
    order = DaemonOrder(words, layers, "cuda:0", ops_factory=lambda d, a, n: RecordingOps(log))
    copier = cuda_copier.make_copier("cuda:0", strategy, dev, Pool, layers, order)
    offload_stream, load_stream = (copier.streams[k].cuda_stream for k in (TaskKind.OFFLOAD, TaskKind.LOAD))
    if strategy == "dma":
        copier.memcpy.rt.calls = log  # the runtime's batched calls go into the same log
    log.clear()
    task = CopyTask(task_id=77, kind=TaskKind.LOAD, client_id="c", routing_id=b"c", priority=0,
                    dev_blocks=np.array([3, 5]), host_blocks=np.array([1, 6]), entries=[], slot=2,
                    fence=(9, 41))
    copier.begin_load(task)
    plan = copier.plan(TaskKind.LOAD, task.dev_blocks, task.host_blocks)
    for layer in range(layers):
        copier.load_layer(layer, plan)
        copier.layer_loaded(task, layer)
    copier.sync(TaskKind.LOAD)
    copy = (("batch", 2, load_stream) if strategy == "dma" else ("copy", load_stream))
    expect = [("wait", load_stream, 9, 41)]
    for layer in range(layers):
        expect += [copy, ("write", load_stream, load_word(2, layer, layers), 77)]
    expect.append(("sync", load_stream))
    assert log == expect
    assert offload_stream != load_stream
    copier.close()


def test_a_dma_layer_split_between_threads_is_fenced_then_joined_before_its_word(monkeypatch):
    """--dma-threads 3: each layer's copies go in 3 shares, the first on the load stream, the
    others from helper threads on helper streams; the helpers start after the load stream's
    fence wait (an event) and the load stream waits for each helper (events) before the layer's
    word is written. The bytes land as with one thread."""
    import kvcached.copy.strategy_copier as sc

    monkeypatch.setattr(sc, "DMA_SPLIT_MIN", 1)
    log = []
    cuda = FakeCuda(log)
    monkeypatch.setattr(CudaCopier, "cuda", cuda)
    monkeypatch.setattr(CudaCopier, "runtime", staticmethod(lambda: RecordingRuntime(batched=True)))
    layers = 2
    dev = [[torch.arange(16 * 4, dtype=torch.int64).view(16, 4) + 1000 * i] for i in range(layers)]
    host = [[torch.arange(16 * 4, dtype=torch.int64).view(16, 4) * -1 - 1 - 1000 * i] for i in range(layers)]

    class Pool:
        views, block_cuts = host, None

    words = np.zeros(4096, dtype=np.int64)
    order = DaemonOrder(words, layers, "cuda:0", ops_factory=lambda d, a, n: RecordingOps(log))
    copier = cuda_copier.make_copier("cuda:0", "dma", dev, Pool, layers, order, dma_threads=3)
    load = copier.streams[TaskKind.LOAD].cuda_stream
    copier.memcpy.rt.calls = log
    log.clear()
    dst, hid = np.array([9, 2, 14, 5, 11, 7]), np.array([3, 12, 0, 8, 1, 15])
    task = CopyTask(task_id=5, kind=TaskKind.LOAD, client_id="c", routing_id=b"c", priority=0,
                    dev_blocks=dst, host_blocks=hid, entries=[], slot=1, fence=(4, 19))
    copier.begin_load(task)
    plan = copier.plan(TaskKind.LOAD, dst, hid)
    for layer in range(layers):
        copier.load_layer(layer, plan)
        copier.layer_loaded(task, layer)
    assert log[0] == ("wait", load, 4, 19)
    helpers = [s.cuda_stream for s in copier.helper_streams[TaskKind.LOAD]]
    assert len(helpers) == 2 and load not in helpers
    writes = [i for i, e in enumerate(log) if e[0] == "write"]
    start = 1
    for layer, end in enumerate(writes):
        seg = log[start:end]
        fork = seg[0]
        assert fork[:2] == ("record", load)
        assert [e for e in seg if e[0] == "wait_event" and e[1] in helpers] == \
            [("wait_event", h, fork[2]) for h in helpers], "a helper not started after the fence"
        copies = [e for e in seg if e[0] == "batch"]
        assert sorted(e[2] for e in copies) == sorted([load, *helpers]) and sum(e[1] for e in copies) == 6
        joins = [e for e in seg if e[0] == "wait_event" and e[1] == load]
        recorded = {e[2]: e[1] for e in seg if e[0] == "record" and e[1] in helpers}
        assert sorted(recorded.get(e[2]) for e in joins) == sorted(helpers), "a helper not joined"
        last_copy = max(i for i, e in enumerate(seg) if e[0] == "batch")
        assert all(seg.index(e) > last_copy for e in joins)
        assert log[end] == ("write", load, load_word(1, layer, layers), 5)
        start = end + 1
    for i in range(layers):
        assert torch.equal(dev[i][0][torch.from_numpy(dst)], host[i][0][torch.from_numpy(hid)])
    copier.close()
    assert {("sync", h) for h in helpers} <= set(log)


def test_the_dma_probe_builds_the_copy_lists_dma_would():
    """scripts/gpu_dma_probe.py (run on a GPU by gpu_check.sh): its per-layer lists, cut into
    calls of N copies, run as host memmoves over CPU tensors, move each block's K and V rows of
    every layer; the whole task in one call is the same copies."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "gpu_dma_probe.py"
    spec = importlib.util.spec_from_file_location("gpu_dma_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    row, layers = 64, probe.LAYERS
    probe.ROW = row  # small rows (this copy of the module only): the same arithmetic
    rng = np.random.default_rng(5)
    dev = torch.from_numpy(rng.integers(0, 256, (2 * layers, 12, row), dtype=np.uint8))
    host = torch.zeros((2 * layers, 5, row), dtype=torch.uint8)
    src, hid = np.array([7, 0, 11, 3, 9]), np.arange(5)
    lists = probe._lists(dev, host, src, hid, to_host=True)
    assert len(lists) == layers and all(len(sizes) == 2 * 5 for _, _, sizes in lists)
    task, fours = probe._calls(lists, "task"), probe._calls(lists, "4")
    assert probe._calls(lists, "layer") is lists and [len(c[2]) for c in task] == [2 * 5 * layers]
    assert [len(c[2]) for c in fours] == [4, 4, 2] * layers
    assert all((np.concatenate([c[i] for c in fours]) == task[0][i]).all() for i in range(3))
    for dsts, srcs, sizes in fours:
        dma.HostMemcpy().copy(dsts, srcs, sizes, 0)
    assert torch.equal(host, dev[:, torch.from_numpy(src)])
    dev[:, torch.from_numpy(src)] = 0
    for dsts, srcs, sizes in probe._lists(dev, host, src, hid, to_host=False):
        dma.HostMemcpy().copy(dsts, srcs, sizes, 0)
    assert torch.equal(dev[:, torch.from_numpy(src)], host)
