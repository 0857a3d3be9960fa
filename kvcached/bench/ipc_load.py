"""`kvcached bench ipc`'s loaded case, on a daemon with a disk and a redis tier: 64-key lookups
timed idle, then while an engine in another process offloads without pause (write_through:
every block is backed up to both tiers). Two kinds: sent ones (host misses, so each asks the
storage tiers) and ones answered from the key table (a 64-block chain the engine offloaded
first: host hits, or disk hits once evicted - either way answered in shared memory).

Run as a module, it is that engine: `python -m kvcached.bench.ipc_load INSTANCE RUN_DIR SECONDS`
(it offloads the chain, says "chain", waits for a line on stdin, says "offloading" and offloads
until SIGTERM).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from kvcached_client import BlockHasher, launch

from . import expect_line, free_port
from .stats import percentiles_us, ratio


def _redis(tmp: str):
    exe = shutil.which("redis-server")
    if exe is None:
        return None, None
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def _lookups(client, n: int) -> dict:
    samples = []
    for _ in range(n):
        keys = [os.urandom(16) for _ in range(64)]
        t0 = time.perf_counter()
        client.lookup(keys)
        samples.append(time.perf_counter() - t0)
    return percentiles_us(samples)


def _chain() -> list[bytes]:
    """The 64 keys the loading engine offloads first (both processes make the same ones)."""
    return BlockHasher("bench-ipc-chain").hash_blocks(list(range(64 * 16)), 16)


def _table_lookups(client, n: int) -> dict:
    keys, samples, found = _chain(), [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        host, storage = client.lookup(keys)
        samples.append(time.perf_counter() - t0)
        found += host + storage
    table = client.key_table
    return {**percentiles_us(samples), "found": round(found / (64 * n), 3),
            "answered": table.answered if table else 0, "asked": table.asked if table else n}


def run_loaded(quick: bool) -> dict:
    n = 300 if quick else 3000
    tmp = tempfile.mkdtemp(prefix="kvbl-", dir="/tmp")
    redis, redis_uri = _redis(tmp)
    tiers = [f"disk://{tmp}/disk?capacity_gb=1"] + ([redis_uri] if redis_uri else [])
    args = [x for uri in tiers for x in ("--storage", uri)]
    instance = f"bench-ipcl-{os.getpid()}"
    daemon = launch(instance=instance, run_dir=tmp, host_cache_gb=0.25, extra_args=args,
                    wait_storage=True)
    engine = None
    try:
        with daemon.connect(name="bench-ipc-lookups", key_table=False) as client, \
                daemon.connect(name="bench-ipc-table") as table_client:
            idle = _lookups(client, n)
            engine = subprocess.Popen([sys.executable, "-m", "kvcached.bench.ipc_load", instance,
                                       tmp, "600"], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                                      text=True)
            expect_line(engine, "chain", "the loading engine")
            table_idle = _table_lookups(table_client, n)
            engine.stdin.write("go\n")
            engine.stdin.flush()
            expect_line(engine, "offloading", "the loading engine (offloading)")
            time.sleep(0.5)
            loaded = _lookups(client, n)
            table_client.key_table.answered = table_client.key_table.asked = 0
            table_loaded = _table_lookups(table_client, n)
            status = client.status()
    finally:
        if engine is not None:
            _stop_engine(engine)
        daemon.stop()
        if redis is not None:
            redis.terminate()
            redis.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"tiers": [t.split(":")[0] for t in tiers], "idle": idle, "loaded": loaded,
            "p99_ratio": ratio(loaded["p99_us"], idle["p99_us"]),
            "key_table": {"idle": table_idle, "loaded": table_loaded,
                          "p99_ratio": ratio(table_loaded["p99_us"], table_idle["p99_us"])},
            "backups": status.get("storage_io", {}).get("backups", 0),
            "target": {"p99_ratio_max": 2.0}}


def _stop_engine(engine: subprocess.Popen) -> None:
    """SIGTERM: the engine ends its loop and exits, unlinking its KV segments. One that does
    not is killed, and its segments are swept here (the daemon stops too soon to)."""
    engine.terminate()
    try:
        engine.wait(30)
    except subprocess.TimeoutExpired:
        engine.kill()
        engine.wait(10)
    if engine.returncode != 0:
        from kvcached.server.kv_sweep import sweep_kv_segments

        sweep_kv_segments(engine.pid)


def format_loaded(r: dict) -> str:
    i, lo = r["idle"], r["loaded"]
    lines = [f"lookup64 sent, with storage ({'+'.join(r['tiers'])}): idle p50 {i['p50_us']:.1f}us "
             f"p99 {i['p99_us']:.1f}us; under backups ({r['backups']} blocks written) p50 "
             f"{lo['p50_us']:.1f}us p99 {lo['p99_us']:.1f}us; p99 ratio {r['p99_ratio']:.2f} "
             f"(target <= {r['target']['p99_ratio_max']})"]
    if "key_table" in r:
        t = r["key_table"]
        ti, tl = t["idle"], t["loaded"]
        lines.append(f"lookup64 from the key table: idle p50 {ti['p50_us']:.1f}us p99 {ti['p99_us']:.1f}us; "
                     f"under backups p50 {tl['p50_us']:.1f}us p99 {tl['p99_us']:.1f}us (found "
                     f"{tl['found']:.0%}, {tl['answered']} answered, {tl['asked']} sent); p99 ratio "
                     f"{t['p99_ratio']:.2f} (target <= {r['target']['p99_ratio_max']})")
    return "\n".join(lines)


def _engine(instance: str, run_dir: str, seconds: float) -> None:
    """Offload 16 fresh blocks at a time, as fast as the daemon takes them, until SIGTERM (or
    `seconds`); then exit cleanly, which unlinks the KV segments."""
    import signal

    import torch

    from kvcached_client import Client, allocate_kv_cache

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    kv = allocate_kv_cache(4, 64, (16, 2, 64), torch.float16)
    with Client.connect(instance=instance, run_dir=run_dir, name="bench-ipc-loader") as c:
        c.register_kv_cache(kv)
        c.offload(range(64), _chain()).wait(30)
        print("chain", flush=True)
        sys.stdin.readline()
        print("offloading", flush=True)
        end, base = time.monotonic() + seconds, 0
        while time.monotonic() < end and not stop:
            keys = [os.urandom(16) for _ in range(16)]
            c.offload(range(base, base + 16), keys).wait(30)
            base = (base + 16) % 48


if __name__ == "__main__":
    _engine(sys.argv[1], sys.argv[2], float(sys.argv[3]))
