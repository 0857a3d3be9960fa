"""The CUDA path on a real GPU (skipped without one; run by scripts/gpu_check.sh).

CUDA IPC registration of the engine's tensors by the daemon (another process), byte-exact
round trips through every copy strategy, ordering through the order words (a kernel's writes
are what the offload reads, a load lands after the engine's queued writes to its blocks, with
no host synchronize), wait_layer's stream wait under concurrent compute, the refusal of
expandable-segment memory, a dead engine's mappings released, and neither side's death
leaving the other's stream waiting forever.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from conftest import unique_instance
from engine_child import run_engine

from kvcached.copy.cuda_copier import CudaCopier
from kvcached.copy.transfer import TaskKind
from kvcached.host.pool import HostPool
from kvcached_client import BlockHasher, allocate_kv_cache, launch
from kvcached_client.kv_alloc import describe_kv_cache
from kvcached_proto.layout import parse_layout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

DEV = "cuda:0"
HASHER = BlockHasher("gpu-test|bfloat16")
SHAPE = (16, 8, 128)  # 32 KiB per block per part in bf16


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return HASHER.hash_blocks([seed * 1_000_003 + i for i in range(16 * n)], 16)


def randomize(kv, gen_seed: int = 0) -> None:
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    for layer in kv:
        for t in layer:
            t.copy_(torch.randn(t.shape, device=DEV, generator=g).to(t.dtype))


def busy_stream(ms: float = 200.0) -> None:
    """Queue about `ms` of matmuls on the current stream (the CPU does not wait for them). One
    matmul is timed after a warm-up (the first one pays cuBLAS's start-up, which would make the
    estimate far too long and the queue far too short)."""
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    a @ a  # warm-up
    torch.cuda.current_stream().synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    end.record()
    end.synchronize()
    for _ in range(max(1, int(ms / max(start.elapsed_time(end), 0.01)))):
        a = (a @ a).clamp_(-1, 1)


@pytest.fixture
def cuda_daemon(run_dir):
    h = launch(instance=unique_instance("g"), run_dir=run_dir, host_cache_gb=1.0, device=DEV)
    yield h
    h.stop()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("strategy", ["runs", "gather", "zero_copy", "dma", "auto", "dma4"])
def test_copier_strategies_are_byte_exact(strategy, layout, monkeypatch):
    """dma4: --dma-threads 4, each layer's 80 copies in 4 shares (helper threads and streams)."""
    import kvcached.copy.strategy_copier as sc

    monkeypatch.setattr(sc, "DMA_SPLIT_MIN", 8)
    kv = allocate_kv_cache(4, 96, SHAPE, torch.bfloat16, device=DEV)
    randomize(kv, 1)
    spec = parse_layout(describe_kv_cache(kv))
    pool = HostPool(spec.page_bytes * 64, DEV, layout)
    pool.configure(spec)
    dev_views = [[t.view(torch.uint8).view(96, -1) for t in layer] for layer in kv]
    threads = 4 if strategy == "dma4" else 1
    copier = CudaCopier(dev_views, pool, strategy.rstrip("4"), DEV, 4, threads)
    rng = np.random.default_rng(2)
    perm = rng.permutation(96).astype(np.int64)
    src, dst = perm[:40], perm[40:80]
    host = rng.permutation(64)[:40].astype(np.int64)
    expected = [[a[torch.from_numpy(src).to(DEV)].clone() for a in row] for row in dev_views]
    plan = copier.plan(TaskKind.OFFLOAD, src, host)
    for layer in range(4):
        copier.offload_layer(layer, plan)
    copier.sync(TaskKind.OFFLOAD)
    for row, exp in zip(pool.views, expected):
        for h, e in zip(row, exp):
            assert torch.equal(h[torch.from_numpy(host)], e.cpu())
    plan = copier.plan(TaskKind.LOAD, dst, host)
    for layer in range(4):
        copier.load_layer(layer, plan)
    copier.sync(TaskKind.LOAD)
    for row, exp in zip(dev_views, expected):
        for a, e in zip(row, exp):
            assert torch.equal(a[torch.from_numpy(dst).to(DEV)], e)
    copier.close()
    pool.close()


def test_round_trip_through_the_daemon_is_byte_exact(cuda_daemon):
    kv = allocate_kv_cache(8, 128, SHAPE, torch.bfloat16, device=DEV)
    randomize(kv, 3)
    with cuda_daemon.connect(timeout=60) as c:
        reply = c.register_kv_cache(kv)
        assert reply["copy_strategy"] and c.order is not None and c.order.cuda
        src, dst, keys = list(range(10, 60)), list(range(70, 120)), keys_for(50)
        expected = [[t[src].clone() for t in layer] for layer in kv]
        assert c.offload(src, keys).wait(60)["stored"] == 50
        for layer in kv:
            for t in layer:
                t.zero_()
        task = c.load(keys, dst)
        for i in range(8):
            task.wait_layer(i, timeout=60)
        assert task.wait(60) == 50
        torch.cuda.synchronize()
        for layer, exp in zip(kv, expected):
            for t, e in zip(layer, exp):
                assert torch.equal(t[dst], e)
        assert c.check() == "ok"


def test_offload_reads_what_a_queued_kernel_writes_without_host_sync(cuda_daemon):
    kv = allocate_kv_cache(2, 64, SHAPE, torch.bfloat16, device=DEV)
    with cuda_daemon.connect(timeout=60) as c:
        c.register_kv_cache(kv)
        torch.cuda.synchronize()
        busy_stream(300)  # the writes below run only after this, long after offload() returns
        for layer in kv:
            for t in layer:
                t[:8] = 3.0
        keys = keys_for(8, 7)
        task = c.offload(list(range(8)), keys)  # no synchronize before it
        assert task.wait(60)["stored"] == 8
        for layer in kv:
            for t in layer:
                t[:] = 0
        load = c.load(keys, list(range(20, 28)))
        assert load.wait(60) == 8
        torch.cuda.synchronize()
        for layer in kv:
            for t in layer:
                assert bool((t[20:28] == 3.0).all()), "the offload read the KV before the kernel wrote it"


def test_wait_layer_orders_the_engine_stream_under_concurrent_compute(cuda_daemon):
    layers = 16
    kv = allocate_kv_cache(layers, 256, SHAPE, torch.bfloat16, device=DEV)
    randomize(kv, 4)
    with cuda_daemon.connect(timeout=60) as c:
        c.register_kv_cache(kv)
        src, dst, keys = list(range(0, 120)), list(range(130, 250)), keys_for(120, 9)
        want = [float(t[src].float().sum()) for layer in kv for t in layer]
        c.offload(src, keys).wait(60)
        for layer in kv:
            for t in layer:
                t[dst] = 0
        # indexing with a Python list copies the list to the GPU from pageable memory, which
        # makes the CPU wait for the current stream: build the index on the device first
        dst_idx = torch.tensor(dst, device=DEV)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            busy_stream(200)  # competes for the GPU while the load runs
        task = c.load(keys, dst)
        sums = []
        for i in range(layers):
            task.wait_layer(i, timeout=60)  # the CPU sees the counter; the stream waits on the event
            sums += [t.index_select(0, dst_idx).float().sum() for t in kv[i]]  # no CPU wait
        got = [float(s) for s in sums]  # synchronizes the current stream only now
        assert task.wait(60) == 120
        assert got == pytest.approx(want, rel=1e-6), "a layer was read before its copies landed"


def test_expandable_segments_memory_is_refused():
    code = textwrap.dedent(f"""
        import torch
        from kvcached_client import KvcachedError, allocate_kv_cache
        from kvcached_client.kv_alloc import describe_kv_cache
        try:
            allocate_kv_cache(2, 16, (16, 8, 128), torch.bfloat16, device="{DEV}")
        except KvcachedError as exc:
            print("ALLOC_REFUSED", "expandable" in str(exc))
        t = torch.zeros(16, 16, 8, 128, dtype=torch.bfloat16, device="{DEV}")
        try:
            describe_kv_cache([(t, t.clone())])
        except KvcachedError as exc:
            print("EXPORT_REFUSED", "expandable" in str(exc))
    """)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "ALLOC_REFUSED True" in out.stdout, out.stdout + out.stderr
    assert "EXPORT_REFUSED True" in out.stdout, out.stdout + out.stderr


def test_a_dead_engines_mappings_are_released(cuda_daemon):
    with cuda_daemon.connect(timeout=60) as c:
        c.status()  # the daemon's own CUDA context exists before the baseline is read
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        code = textwrap.dedent(f"""
            import sys, time, torch
            from kvcached_client import Client, allocate_kv_cache
            kv = allocate_kv_cache(16, 1024, (16, 8, 128), torch.bfloat16, device="{DEV}")  # 1 GiB
            c = Client.connect(instance={cuda_daemon.instance!r}, run_dir={cuda_daemon.run_dir!r}, timeout=60)
            c.register_kv_cache(kv)
            print("REGISTERED", flush=True)
            time.sleep(600)
        """)
        engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert engine.stdout.readline().strip() == "REGISTERED"
            assert c.status()["kv"]["registered"]
            engine.send_signal(signal.SIGKILL)
            engine.wait(30)
            deadline = time.monotonic() + 30
            while c.status()["kv"]["registered"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not c.status()["kv"]["registered"], "the daemon kept a dead engine's KV mapped"
            while time.monotonic() < deadline and torch.cuda.mem_get_info()[0] < free_before - (256 << 20):
                time.sleep(0.2)
            assert torch.cuda.mem_get_info()[0] >= free_before - (256 << 20), \
                "the dead engine's GPU memory is still held"
        finally:
            if engine.poll() is None:
                engine.kill()
                engine.wait(30)


def test_a_bad_fence_is_refused_and_changes_nothing(cuda_daemon):
    from kvcached_client import RequestError
    from kvcached_proto import ErrorCode, Op, pack_block_ids, pack_keys
    from kvcached_proto.order_words import FENCE_WORDS

    kv = allocate_kv_cache(2, 32, SHAPE, torch.bfloat16, device=DEV)
    with cuda_daemon.connect(timeout=60) as c:
        c.register_kv_cache(kv)
        keys = keys_for(4, 11)
        for op in (Op.OFFLOAD, Op.LOAD):
            with pytest.raises(RequestError) as err:
                c._request(op, None, keys=pack_keys(keys), blocks=pack_block_ids([0, 1, 2, 3]),
                           fence_word=FENCE_WORDS, fence=1)
            assert err.value.code == ErrorCode.BAD_FIELD
        assert c.lookup(keys) == (0, 0)
        assert c.check() == "ok"


def test_a_load_lands_after_the_engines_queued_writes_to_its_blocks(cuda_daemon):
    """The engine zeroes the target blocks on its stream behind 300 ms of matmuls and calls
    load() with no synchronize: the daemon's copies wait for the fence, so the zeroing cannot
    land after (and wipe) the loaded bytes."""
    kv = allocate_kv_cache(4, 64, SHAPE, torch.bfloat16, device=DEV)
    randomize(kv, 5)
    with cuda_daemon.connect(timeout=60) as c:
        c.register_kv_cache(kv)
        src, dst, keys = list(range(0, 16)), list(range(32, 48)), keys_for(16, 13)
        want = [[t[src].clone() for t in layer] for layer in kv]
        assert c.offload(src, keys).wait(60)["stored"] == 16
        torch.cuda.synchronize()
        idx = torch.tensor(dst, device=DEV)
        busy_stream(300)
        for layer in kv:
            for t in layer:
                t.index_fill_(0, idx, 0)  # queued behind the matmuls
        task = c.load(keys, dst)  # no synchronize before it
        for i in range(4):
            task.wait_layer(i, timeout=60)
        assert task.wait(60) == 16
        torch.cuda.synchronize()
        for layer, exp in zip(kv, want):
            for t, e in zip(layer, exp):
                assert torch.equal(t[dst], e), "the engine's earlier zeroing landed after the load"


def test_an_engine_killed_before_its_fence_does_not_stall_the_daemon(cuda_daemon):
    """The engine queues a long kernel, then an offload whose fence comes after it, and is
    killed: its fence is never written. The daemon's offload stream waits for it until the
    daemon sees the engine gone and releases the fence words; the offload is cancelled
    (nothing of it is kept) and the next engine's offloads and loads run."""
    code = textwrap.dedent(f"""
        import sys, time, torch
        from kvcached_client import BlockHasher, Client, allocate_kv_cache
        kv = allocate_kv_cache(2, 64, (16, 8, 128), torch.bfloat16, device="{DEV}")
        c = Client.connect(instance={cuda_daemon.instance!r}, run_dir={cuda_daemon.run_dir!r}, timeout=60)
        c.register_kv_cache(kv)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(60e9))  # about half a minute of GPU time before the fence
        keys = BlockHasher("gdead").hash_blocks(list(range(16 * 8)), 16)
        c.offload(range(8), keys)
        print("OFFLOADED", flush=True)
        time.sleep(600)
    """)
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "OFFLOADED"
        time.sleep(0.5)
        engine.send_signal(signal.SIGKILL)
        engine.wait(30)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(30)
    kv = allocate_kv_cache(2, 64, SHAPE, torch.bfloat16, device=DEV)
    randomize(kv, 6)
    with cuda_daemon.connect(timeout=60) as c:
        deadline = time.monotonic() + 30
        while c.status()["kv"]["registered"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not c.status()["kv"]["registered"], "the dead engine's registration was kept"
        dead_keys = BlockHasher("gdead").hash_blocks(list(range(16 * 8)), 16)
        assert c.lookup(dead_keys) == (0, 0), "a cancelled offload of a dead engine was kept"
        c.register_kv_cache(kv)
        keys = keys_for(8, 17)
        want = [[t[:8].clone() for t in layer] for layer in kv]
        assert c.offload(list(range(8)), keys).wait(30)["stored"] == 8
        assert c.load(keys, list(range(16, 24))).wait(30) == 8
        torch.cuda.synchronize()
        for layer, exp in zip(kv, want):
            for t, e in zip(layer, exp):
                assert torch.equal(t[16:24], e)
        assert c.check() == "ok"


def test_a_daemon_killed_under_the_engines_stream_wait_does_not_hang_the_engine(run_dir):
    """The engine's stream waits on the daemon's layer-0 progress word while the daemon's copies
    are still running (8 layers of 512 MiB to load), and the daemon is killed then. Seen on an
    H100 with IPC events (protocol 1.2): the stream never drained. With the order words the
    client's guard sees the daemon gone and releases the wait: the stream drains, and the load
    is reported failed, never as loaded (bounded: the engine runs in a child with a timeout)."""
    instance = unique_instance("gkill")
    code = textwrap.dedent(f"""
        import os, signal, sys, time, torch
        from kvcached_client import BlockHasher, DaemonUnavailable, TaskFailed, allocate_kv_cache, launch
        d = launch(instance={instance!r}, run_dir={str(run_dir)!r}, host_cache_gb=5.0,
                   device="{DEV}")
        kv = allocate_kv_cache(8, 16384, (16, 8, 128), torch.bfloat16, device="{DEV}")  # 8 GiB
        c = d.connect(timeout=120)
        c.register_kv_cache(kv)
        keys = BlockHasher("gkill").hash_blocks(list(range(16 * 8192)), 16)
        c.offload(range(8192), keys).wait(120)
        task = c.load(keys, range(8192, 16384))
        task.wait_layer(0)              # the stream wait is queued; the copies may still run
        os.kill(d.pid, signal.SIGKILL)
        print("KILLED", flush=True)
        start = time.monotonic()
        torch.cuda.current_stream().synchronize()
        print("DRAINED %.2f" % (time.monotonic() - start), flush=True)
        try:
            print("LOADED", task.wait(30), flush=True)
        except (DaemonUnavailable, TaskFailed) as exc:
            print("FAILED", type(exc).__name__, flush=True)
    """)
    out = run_engine(code, instance, 100, "the engine hung after its daemon died under a stream wait")
    assert "KILLED" in out and "DRAINED" in out, out[-3000:]
    assert "FAILED" in out, "a load whose daemon died mid-copy was reported loaded:\n" + out[-3000:]


@pytest.mark.parametrize("blocked_in", ["synchronize", "tolist", "item"])
def test_the_guard_releases_a_wait_while_the_engine_thread_blocks_in_a_sync(blocked_in):
    """The engine's thread blocks in a CUDA sync (what vLLM does at the end of a step) on a
    stream that waits for a progress word the daemon will never write; the client's guard,
    told the daemon is lost, releases the wait from its own thread. The kernels are loaded
    first: one launched for the first time behind a blocked wait (CUDA lazy loading) blocks
    its thread with the GIL held, and then no Python thread can run (seen on an H100)."""
    code = textwrap.dedent(f"""
        import time, torch
        from kvcached_client.cuda_order import EngineOrder
        x = torch.ones(1000, device="{DEV}")
        (x * 2).tolist(); (x * 2).sum().item()  # load the kernels used below
        at = [float("inf")]
        order = EngineOrder("{DEV}", 1, lambda: time.monotonic() > at[0])
        order.wait_loaded(0, 0, 5)
        y = x * 2
        at[0] = time.monotonic() + 0.5
        start = time.monotonic()
        if "{blocked_in}" == "synchronize":
            torch.cuda.current_stream().synchronize()
        elif "{blocked_in}" == "tolist":
            y.tolist()
        else:
            y.sum().item()
        print("RETURNED %.2f %s" % (time.monotonic() - start, order.released), flush=True)
        order.close()
    """)
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = engine.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        engine.kill()
        out, _ = engine.communicate()
        pytest.fail("the engine thread stayed blocked: the guard did not release its wait\n" + out[-2000:])
    line = [ln for ln in out.splitlines() if ln.startswith("RETURNED")]
    assert line and line[0].endswith("True"), out[-2000:]
    assert 0.4 < float(line[0].split()[1]) < 10, line[0]
