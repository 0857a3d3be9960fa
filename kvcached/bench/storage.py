"""`kvcached bench storage`: the daemon's storage tiers vs the raw store, in the same run.

Through the real daemon (7B-like pages: 32 layers x (K, V) x 32 KiB = 2 MiB per block):
- put: blocks offloaded under write_through, timed from the end of the offload to the end of
  a flush (the backups host -> storage);
- get: the host tier cleared, then a wait_complete prefetch of every block (storage -> host).
Baselines on the same bytes: disk = one sequential file written with os.write in page-sized
chunks and read back with readinto (fsync off on both sides, so both run against the page
cache); redis = bare redis-py pipelined SET / GET of values of the same size, in batches of
the daemon's I/O chunk. A redis-server is started on a free loopback port when one is installed.
mooncake (when the extra is installed) = a mooncake_master and a memory-only mooncake_client
on loopback; the baseline is a bare Mooncake client putting and getting the same number of
objects of the same size from one registered buffer (batch_put_from / batch_get_into, in
batches of the daemon's I/O chunk); the daemon's side moves each page from the host pool's
pieces with its record header (batch_put_from_multi_buffers).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import torch

from kvcached_client import allocate_kv_cache, launch

from ..service.storage_flow import IO_CHUNK_BLOCKS
from ..storage.record import HEADER_BYTES
from . import free_port
from .stats import ratio

LAYERS, BLOCK_SHAPE = 32, (16, 8, 128)
PAGE = LAYERS * 2 * 16 * 8 * 128 * 2


def _through_daemon(run_dir: str, storage_uri: str, n: int, repeats: int, extra=()) -> dict:
    daemon = launch(instance=f"bench-st-{os.getpid()}", run_dir=run_dir,
                    host_cache_gb=(n + 8) * PAGE / 2**30,
                    extra_args=["--storage", storage_uri, "--prefetch-threshold-tokens", "0",
                                "--prefetch-max-share", "1.0", *extra], wait_storage=True)
    put_s, get_s = [], []
    try:
        with daemon.connect(name="bench-storage", timeout=300) as c:
            kv = allocate_kv_cache(LAYERS, n, BLOCK_SHAPE, torch.bfloat16)
            for k, v in kv:
                k.fill_(1.5)
                v.fill_(2.5)
            c.register_kv_cache(kv)
            for _ in range(repeats):
                keys = [os.urandom(16) for _ in range(n)]
                c.offload(list(range(n)), keys).wait(300)
                t0 = time.perf_counter()
                c.flush().wait(300)
                put_s.append(time.perf_counter() - t0)
                c.clear(tier="host")
                t0 = time.perf_counter()
                got = c.prefetch(keys, policy="wait_complete").wait(300)["prefetched"]
                get_s.append(time.perf_counter() - t0)
                if got != n:  # (what the tier counted: a put dropped, late, or refused)
                    raise RuntimeError(f"prefetch brought {got} of {n} blocks back; the storage "
                                       f"tier's status: {c.status()['storage']}")
                c.clear(tier="all")
            del kv
    finally:
        daemon.stop()
    nbytes = n * PAGE
    return {"put_gbps": nbytes / min(put_s) / 1e9, "get_gbps": nbytes / min(get_s) / 1e9}


def _raw_disk(path: str, n: int, repeats: int) -> dict:
    """n pages written into one file in sequence and read back, from and into n distinct
    pages of memory (as the daemon's host pool moves them; one page used n times stays in the
    CPU's cache and measured 15 GB/s reading where n distinct ones measured 5.5)."""
    size = PAGE + HEADER_BYTES
    src = np.ones(n * size, dtype=np.uint8)
    dst = np.zeros_like(src)  # (touched: no first-touch page faults in the timing)
    fname = os.path.join(path, "raw.bin")
    put_s, get_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for i in range(n):
            os.write(fd, src[i * size:(i + 1) * size])
        os.close(fd)
        put_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(fname, "rb", buffering=0) as f:
            for i in range(n):
                f.readinto(dst[i * size:(i + 1) * size])
        get_s.append(time.perf_counter() - t0)
        os.unlink(fname)
    if not np.array_equal(src, dst):
        raise RuntimeError("the raw file read back other bytes")
    nbytes = n * PAGE
    return {"put_gbps": nbytes / min(put_s) / 1e9, "get_gbps": nbytes / min(get_s) / 1e9}


def _raw_redis(port: int, n: int, repeats: int) -> dict:
    import redis

    r = redis.Redis(port=port)
    value = bytes(PAGE + HEADER_BYTES)
    put_s, get_s = [], []
    for rep in range(repeats):
        names = [f"raw:{rep}:{i}".encode() for i in range(n)]
        t0 = time.perf_counter()
        for start in range(0, n, IO_CHUNK_BLOCKS):
            pipe = r.pipeline(transaction=False)
            for name in names[start : start + IO_CHUNK_BLOCKS]:
                pipe.set(name, value)
            pipe.execute()
        put_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for start in range(0, n, IO_CHUNK_BLOCKS):
            pipe = r.pipeline(transaction=False)
            for name in names[start : start + IO_CHUNK_BLOCKS]:
                pipe.get(name)
            pipe.execute()
        get_s.append(time.perf_counter() - t0)
        r.delete(*names)
    r.close()
    nbytes = n * PAGE
    return {"put_gbps": nbytes / min(put_s) / 1e9, "get_gbps": nbytes / min(get_s) / 1e9}


def _raw_mooncake(port: int, n: int, repeats: int) -> dict:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", f"127.0.0.1:{port}") != 0:
        raise RuntimeError("a bare Mooncake client could not reach the master")
    size = PAGE + HEADER_BYTES
    src = np.ones(n * size, dtype=np.uint8)
    dst = np.empty_like(src)
    for buf in (src, dst):
        if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            raise RuntimeError("a bare Mooncake client could not register its buffer")
    put_s, get_s = [], []
    try:
        for rep in range(repeats):
            names = [f"raw/{rep}/{i}" for i in range(n)]
            ptrs = [src.ctypes.data + i * size for i in range(n)]
            t0 = time.perf_counter()
            for start in range(0, n, IO_CHUNK_BLOCKS):
                got = store.batch_put_from(names[start:start + IO_CHUNK_BLOCKS], ptrs[start:start + IO_CHUNK_BLOCKS],
                                           [size] * len(names[start:start + IO_CHUNK_BLOCKS]))
                if any(r != 0 for r in got):
                    raise RuntimeError(f"a bare Mooncake put failed: {got}")
            put_s.append(time.perf_counter() - t0)
            ptrs = [dst.ctypes.data + i * size for i in range(n)]
            t0 = time.perf_counter()
            for start in range(0, n, IO_CHUNK_BLOCKS):
                got = store.batch_get_into(names[start:start + IO_CHUNK_BLOCKS], ptrs[start:start + IO_CHUNK_BLOCKS],
                                           [size] * len(names[start:start + IO_CHUNK_BLOCKS]))
                if any(r != size for r in got):
                    raise RuntimeError(f"a bare Mooncake get failed: {got}")
            get_s.append(time.perf_counter() - t0)
            store.batch_remove(names, True)
        if not np.array_equal(src, dst):
            raise RuntimeError("the bare Mooncake client read back other bytes")
    finally:
        store.close()
    nbytes = n * PAGE
    return {"put_gbps": nbytes / min(put_s) / 1e9, "get_gbps": nbytes / min(get_s) / 1e9}


def _pair(name: str, daemon: dict, raw: dict, note: str, host_layout: str = "layer_first") -> dict:
    return {"tier": name, "note": note, "host_layout": host_layout,
            **{f"{k}": round(v, 3) for k, v in daemon.items()},
            **{f"raw_{k}": round(v, 3) for k, v in raw.items()},
            "put_ratio": ratio(daemon["put_gbps"], raw["put_gbps"]),
            "get_ratio": ratio(daemon["get_gbps"], raw["get_gbps"])}


def run(quick: bool = False, **_) -> dict:
    n = 64 if quick else 256
    repeats = 2 if quick else 3
    work = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    results = []
    try:
        disk = os.path.join(work, "disk")
        os.makedirs(disk)
        raw = _raw_disk(work, n, repeats)
        got = _through_daemon(work, f"disk://{disk}?capacity_gb={2 * n * PAGE / 2**30:.3f}", n, repeats)
        results.append(_pair("disk", got, raw, "fsync off on both sides (page cache)"))
        exe = shutil.which("redis-server")
        if exe:
            port = free_port()
            server = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", work],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                _wait_redis(port)
                raw = _raw_redis(port, n, repeats)
                got = _through_daemon(work, f"redis://127.0.0.1:{port}/0", n, repeats)
                results.append(_pair("redis", got, raw, "loopback, persistence off"))
            finally:
                server.terminate()
                server.wait(10)
        skipped = [] if exe else ["redis (no redis-server on PATH)"]
        from .mooncake_servers import MooncakeStore, available

        if available():
            store = MooncakeStore(provider_mb=int(2.5 * n * (PAGE + HEADER_BYTES) / 2**20) + 64)
            try:
                raw = _raw_mooncake(store.port, n, repeats)
                uri = f"{store.uri}?segment_gb=0&host=127.0.0.1"
                # page_first: a page is one buffer (a layer_first page of 64 pieces is staged first)
                got = _through_daemon(work, uri, n, repeats, ["--host-layout", "page_first"])
                results.append(_pair("mooncake", got, raw, "loopback TCP, one memory-only client, "
                                                           "--host-layout page_first", "page_first"))
                got = _through_daemon(work, uri, n, repeats)
                results.append(_pair("mooncake", got, raw, "the same, layer_first: 64 pieces a page, staged"))
            finally:
                store.close()
        else:
            skipped.append("mooncake (the mooncake extra is not installed)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"bench": "storage", "blocks": n, "page_bytes": PAGE, "repeats": repeats,
            "results": results, "target": {"ratio_min": 0.7, "mooncake_ratio_min": 0.8},
            "skipped": skipped}


def _wait_redis(port: int) -> None:
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, socket_timeout=0.5).ping()
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start within 10 s")
            time.sleep(0.05)


def format_result(r: dict) -> str:
    lines = [f"{r['blocks']} blocks of {r['page_bytes'] / 2**20:.0f} MiB, best of {r['repeats']}",
             f"{'tier':<8} {'put GB/s':>9} {'raw':>7} {'ratio':>6}   {'get GB/s':>9} {'raw':>7} {'ratio':>6}"]
    for x in r["results"]:
        lines.append(f"{x['tier']:<8} {x['put_gbps']:>9.2f} {x['raw_put_gbps']:>7.2f} {x['put_ratio']:>6.2f}   "
                     f"{x['get_gbps']:>9.2f} {x['raw_get_gbps']:>7.2f} {x['get_ratio']:>6.2f}   ({x['note']})")
    for s in r["skipped"]:
        lines.append(f"skipped: {s}")
    lines.append(f"target: ratio >= {r['target']['ratio_min']} (mooncake >= "
                 f"{r['target'].get('mooncake_ratio_min', r['target']['ratio_min'])})")
    return "\n".join(lines)
