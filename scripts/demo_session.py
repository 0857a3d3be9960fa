"""A short engine-like session against a freshly launched daemon (run by scripts/run.sh).

Launches the sidecar with a disk tier, registers a small 7B-shaped KV cache, offloads a
prompt's blocks under content keys, wipes the device blocks, looks the prefix up and loads it
back layer by layer (a host hit), checks every byte; then restarts the daemon and does the same
from the disk tier (a disk hit). Prints the daemon's status table and stops it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from kvcached_client import BlockHasher, allocate_kv_cache, launch, make_namespace

LAYERS, BLOCKS, BLOCK_TOKENS = 32, 256, 16
BLOCK_SHAPE = (BLOCK_TOKENS, 8, 128)  # K and V: 32 KiB per layer per block in bf16


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instance", default="demo")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--host-cache-gb", type=float, default=1.0)
    ap.add_argument("--storage", action="append", default=[], help="storage URI (repeatable)")
    args = ap.parse_args()
    extra = [a for uri in args.storage for a in ("--storage", uri)]

    def start():
        print(f"[demo] launching kvcached (instance {args.instance}, run dir {args.run_dir}, "
              f"storage {', '.join(args.storage) or 'none'})")
        return launch(instance=args.instance, run_dir=args.run_dir,
                      host_cache_gb=args.host_cache_gb, extra_args=extra, wait_storage=True)

    kv = allocate_kv_cache(LAYERS, BLOCKS, BLOCK_SHAPE, torch.bfloat16)
    hasher = BlockHasher(make_namespace("demo-7b", "bfloat16", "kv16"))
    prompt = torch.randint(0, 32000, (64 * BLOCK_TOKENS,)).tolist()
    keys = hasher.hash_blocks(prompt, BLOCK_TOKENS)
    daemon = start()
    try:
        with daemon.connect(name="demo-engine") as client:
            expected = run_session(client, kv, keys)
            if args.storage:
                client.flush().wait(timeout=60)  # write_through backups on disk before the stop
        if args.storage:
            print("[demo] restarting the daemon: the host tier is gone, the disk tier stays")
            daemon.stop()
            daemon = start()
            with daemon.connect(name="demo-engine") as client:
                client.register_kv_cache(kv)
                load_back(client, kv, keys, expected, dst_start=170, what="disk hit")
        print()
        subprocess.run([sys.executable, "-m", "kvcached", "status", "--instance", args.instance,
                        "--run-dir", args.run_dir], check=True)
    finally:
        code = daemon.stop()
        print(f"\n[demo] daemon stopped (exit code {code})")
    return 0


def run_session(client, kv, keys):
    print(f"[demo] registering KV: {LAYERS} layers x (K, V) [{BLOCKS}, {', '.join(map(str, BLOCK_SHAPE))}] bf16")
    client.register_kv_cache(kv)
    src = list(range(len(keys)))
    for k, v in kv:  # the "prefill" writes the prompt's KV
        k[src] = torch.randn_like(k[src])
        v[src] = torch.randn_like(v[src])
    expected = [(k[src].clone(), v[src].clone()) for k, v in kv]

    t0 = time.perf_counter()
    stored = client.offload(src, keys).wait(timeout=30)
    t1 = time.perf_counter()
    print(f"[demo] offloaded {stored['stored']} blocks ({stored['bytes'] / 2**20:.0f} MiB) "
          f"in {1000 * (t1 - t0):.1f} ms")
    load_back(client, kv, keys, expected, dst_start=100, what="host hit")
    return expected


def load_back(client, kv, keys, expected, dst_start: int, what: str) -> None:
    for k, v in kv:
        k.zero_()
        v.zero_()
    host, storage = client.lookup(keys)
    print(f"[demo] lookup of {len(keys)} keys: {host} in host, {storage} in storage")
    dst = list(range(dst_start, dst_start + len(keys)))
    t0 = time.perf_counter()
    task = client.load(keys, dst)
    task.wait_layer(0, timeout=60)
    t_first = time.perf_counter()
    loaded = task.wait(timeout=60)
    t1 = time.perf_counter()
    ok = all(torch.equal(kv[i][0][dst], expected[i][0]) and torch.equal(kv[i][1][dst], expected[i][1])
             for i in range(LAYERS))
    print(f"[demo] {what}: loaded {loaded} blocks; layer 0 ready after {1000 * (t_first - t0):.1f} ms, "
          f"all {LAYERS} layers after {1000 * (t1 - t0):.1f} ms; bytes exact: {ok}")
    if not ok or loaded != len(keys):
        raise SystemExit(f"[demo] FAILED: {what} KV differs from what was offloaded")


if __name__ == "__main__":
    sys.exit(main())
