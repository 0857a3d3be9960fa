"""kvcached as SGLang HiCache's storage backend under random work: two SGLang instances of one
model attached to one daemon, each with a backup thread (batch_set_v1) and a prefetch thread
(batch_get_v1, batch_exists) over chained pages of shared documents, a daemon host tier too small
for them (evictions, the disk tier behind it), and an operator clearing the host tier now and
then. A page's bytes are a function of its key, so every page a get says it loaded is compared
with its key's. Seeded; KVCACHED_SOAK_OPS scales it. Runs in .venv-sglang."""
from __future__ import annotations

import ctypes
import hashlib
import os
import random
import threading

import numpy as np
import pytest

pytest.importorskip("sglang", reason="SGLang is installed in .venv-sglang: ./scripts/test.sh --with-sglang")
pytestmark = pytest.mark.timeout(300)

import sglang_pools as sp  # noqa: E402
from conftest import disk_uri  # noqa: E402

from kvcached_client import launch  # noqa: E402

DOCS, DOC_PAGES = 10, 8
HOST_PAGES = 40        # of the daemon's host tier: half the pages in play
PAGE_BYTES = sp.LAYERS * 2 * sp.PAGE * sp.HEADS * sp.HEAD_DIM * 2  # an MHA page, K and V


def _content(key: str, size: int) -> bytes:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _write_page(pool, page: int, key: str) -> None:
    ptrs, sizes = pool.get_page_buffer_meta(sp.pages_of(pool, [page]))
    data, at = _content(key, sum(sizes)), 0
    for p, s in zip(ptrs, sizes):
        ctypes.memmove(p, data[at:at + s], s)
        at += s


class Instance:
    """One SGLang instance: its pool split between its backup and its prefetch thread."""

    def __init__(self, layout: str, extra: dict, docs, seed: int, ops: int):
        self.pool = sp.make_pool("mha", layout, device_tokens=2048)
        self.backend = sp.attach(self.pool, extra)
        self.docs, self.seed, self.ops = docs, seed, ops
        self.errors: list[str] = []
        self.counts = {"set": 0, "got": 0, "exists": 0}

    def _chain(self, rng):
        keys = rng.choice(self.docs)
        return keys[: rng.randint(1, DOC_PAGES)]

    def backups(self) -> None:
        rng = random.Random(self.seed)
        for _ in range(self.ops):
            keys = self._chain(rng)
            pages = rng.sample(range(1, 100), len(keys))
            for page, key in zip(pages, keys):
                _write_page(self.pool, page, key)
            stored = self.backend.batch_set_v1(keys, sp.pages_of(self.pool, pages))
            self.counts["set"] += sum(stored)

    def prefetches(self) -> None:
        rng = random.Random(self.seed + 1)
        for _ in range(self.ops):
            keys = self._chain(rng)
            if rng.random() < 0.3:
                self.counts["exists"] += self.backend.batch_exists(keys)
                continue
            pages = rng.sample(range(100, 250), len(keys))
            for page in pages:  # nothing earlier can pass for a page's bytes
                _write_page(self.pool, page, "scribble")
            got = self.backend.batch_get_v1(keys, sp.pages_of(self.pool, pages))
            for page, key, ok in zip(pages, keys, got):
                if ok and sp.page_bytes(self.pool, page) != _content(key, PAGE_BYTES):
                    self.errors.append(f"page of key {key[:12]} (host page {page}) wrong")
            self.counts["got"] += sum(got)

    def run(self) -> list[threading.Thread]:
        def guarded(fn):
            try:
                fn()
            except Exception as exc:  # reported by the test
                self.errors.append(f"{fn.__name__}: {exc!r}")
        threads = [threading.Thread(target=guarded, args=(f,)) for f in (self.backups, self.prefetches)]
        for t in threads:
            t.start()
        return threads


@pytest.mark.parametrize("layout,seed", [("page_first", 1), ("layer_first", 2)])
def test_random_backups_and_prefetches_of_two_instances_load_only_their_keys_bytes(run_dir, tmp_path,
                                                                                   layout, seed):
    ops = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 8
    docs = [sp.page_hashes(DOC_PAGES, seed=1000 * seed + d) for d in range(DOCS)]
    assert _content(docs[0][0], 64) != _content(docs[0][1], 64)  # the check can tell pages apart
    host_gb = HOST_PAGES * PAGE_BYTES / 2**30
    with launch(instance=f"sgr{os.getpid()}-{seed}", run_dir=run_dir, host_cache_gb=host_gb,
                extra_args=["--storage", disk_uri(str(tmp_path / "disk")), "--host-layout",
                            "layer_first" if layout == "layer_first" else "page_first"],
                wait_storage=True) as d:
        extra = sp.extra_config(d.instance, d.run_dir)
        instances = [Instance(layout, extra, docs, seed * 10 + i, ops) for i in range(2)]
        threads = [t for inst in instances for t in inst.run()]
        with d.connect(role="operator") as op:
            while any(t.is_alive() for t in threads):
                op.clear(tier="host")
                threads[0].join(0.3)
            for t in threads:
                t.join(120)
            status, check = op.status(), op.check()
        for inst in instances:
            inst.backend.close()
    errors = [e for inst in instances for e in inst.errors]
    assert not errors, errors[:5]
    assert check == "ok"
    counts = [inst.counts for inst in instances]
    assert all(c["set"] > 0 and c["got"] > 0 and c["exists"] > 0 for c in counts), counts
    assert status["host"]["evictions"] > 0 and status["lookups"]["loaded_from_storage"] > 0, status
