"""`kvcached bench disk-index`: how long the disk tier takes to rebuild its index at start.

Creates N block files (small payloads: the rebuild reads names and sizes, never contents) in a
temporary tier, then times a fresh DiskBackend until its index is ready. Target: 1 M files in
under 60 s.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from ..storage.disk import DiskBackend


def run(quick: bool = False, files: int = 0, **_) -> dict:
    n = files or (20_000 if quick else 200_000)
    root = tempfile.mkdtemp(prefix="kvb-idx-", dir="/tmp")
    try:
        t0 = time.perf_counter()
        for shard in range(256):
            os.mkdir(os.path.join(root, f"{shard:02x}"))
        for i in range(n):
            key = os.urandom(16).hex()
            with open(os.path.join(root, key[:2], key + ".kvb"), "wb") as f:
                f.write(b"x" * 64)
        created = time.perf_counter() - t0
        t0 = time.perf_counter()
        backend = DiskBackend(root, 1 << 40)
        backend.indexed.wait(3600)
        rebuild = time.perf_counter() - t0
        indexed = backend.usage()["blocks"]
        backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"bench": "disk_index", "files": n, "indexed": indexed, "create_s": round(created, 2),
            "rebuild_s": round(rebuild, 2), "files_per_s": round(n / rebuild),
            "projected_1m_s": round(1_000_000 * rebuild / n, 1), "target": {"1m_files_s_max": 60}}


def format_result(r: dict) -> str:
    return (f"indexed {r['indexed']} of {r['files']} block files in {r['rebuild_s']:.2f} s "
            f"({r['files_per_s']:,} files/s; 1 M files: ~{r['projected_1m_s']:.0f} s, "
            f"target < {r['target']['1m_files_s_max']} s)")
