"""A short engine-like session against a freshly launched daemon (run by scripts/run.sh).

Launches the sidecar, registers a small 7B-shaped KV cache, offloads a prompt's blocks under
content keys, wipes the device blocks, looks the prefix up and loads it back layer by layer,
checks every byte, prints the daemon's status table and stops it.
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
    args = ap.parse_args()

    print(f"[demo] launching kvcached (instance {args.instance}, run dir {args.run_dir})")
    daemon = launch(instance=args.instance, run_dir=args.run_dir, host_cache_gb=args.host_cache_gb)
    try:
        with daemon.connect(name="demo-engine") as client:
            run_session(client)
        print()
        subprocess.run([sys.executable, "-m", "kvcached", "status", "--instance", args.instance,
                        "--run-dir", args.run_dir], check=True)
    finally:
        code = daemon.stop()
        print(f"\n[demo] daemon stopped (exit code {code})")
    return 0


def run_session(client) -> None:
    kv = allocate_kv_cache(LAYERS, BLOCKS, BLOCK_SHAPE, torch.bfloat16)
    print(f"[demo] registering KV: {LAYERS} layers x (K, V) [{BLOCKS}, {', '.join(map(str, BLOCK_SHAPE))}] bf16")
    client.register_kv_cache(kv)

    hasher = BlockHasher(make_namespace("demo-7b", "bfloat16", "kv16"))
    prompt = torch.randint(0, 32000, (64 * BLOCK_TOKENS,)).tolist()
    keys = hasher.hash_blocks(prompt, BLOCK_TOKENS)
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
    for k, v in kv:
        k.zero_()
        v.zero_()
    host, storage = client.lookup(keys)
    print(f"[demo] lookup of {len(keys)} keys: {host} in host, {storage} in storage")

    dst = list(range(100, 100 + len(keys)))
    t0 = time.perf_counter()
    task = client.load(keys, dst)
    task.wait_layer(0)
    t_first = time.perf_counter()
    loaded = task.wait(timeout=30)
    t1 = time.perf_counter()
    ok = all(torch.equal(kv[i][0][dst], expected[i][0]) and torch.equal(kv[i][1][dst], expected[i][1])
             for i in range(LAYERS))
    print(f"[demo] loaded {loaded} blocks: layer 0 ready after {1000 * (t_first - t0):.1f} ms, "
          f"all {LAYERS} layers after {1000 * (t1 - t0):.1f} ms; bytes exact: {ok}")
    if not ok or loaded != len(keys):
        raise SystemExit("[demo] FAILED: loaded KV differs from what was offloaded")


if __name__ == "__main__":
    sys.exit(main())
