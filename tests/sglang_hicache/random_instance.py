"""One SGLang instance doing random work through kvcached as its storage backend (what
test_sglang_random.py runs two of): a backup thread (batch_set_v1) and a prefetch thread
(batch_get_v1, batch_exists) over chained pages of shared documents, every page's bytes a
function of its key, every page a get says it loaded compared with its key's, and no page of a
get changing after the get returned. Also a process of its own (`python random_instance.py
JSON`), which an engine-kill test kills -9 in the middle of its calls: it prints "ready" once
attached, then each error it finds, one per line."""
from __future__ import annotations

import ctypes
import hashlib
import json
import random
import sys
import threading

import numpy as np
import sglang_pools as sp

DOCS, DOC_PAGES = 10, 8
HOST_PAGES = 40        # of the daemon's host tier: half the pages in play
PAGE_BYTES = sp.LAYERS * 2 * sp.PAGE * sp.HEADS * sp.HEAD_DIM * 2  # an MHA page, K and V


def page_content(key: str, size: int) -> bytes:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _write_page(pool, page: int, key: str) -> None:
    ptrs, sizes = pool.get_page_buffer_meta(sp.pages_of(pool, [page]))
    data, at = page_content(key, sum(sizes)), 0
    for p, s in zip(ptrs, sizes):
        ctypes.memmove(p, data[at:at + s], s)
        at += s


class Instance:
    """One SGLang instance: its pool split between its backup and its prefetch thread."""

    def __init__(self, layout: str, extra: dict, docs, seed: int, ops: int, backed_up=None):
        """backed_up: the documents its backups take (default: every one)."""
        self.pool = sp.make_pool("mha", layout, device_tokens=2048)
        self.backend = sp.attach(self.pool, extra)
        self.docs, self.seed, self.ops = docs, seed, ops
        self.backed_up = docs if backed_up is None else backed_up
        own = {key for doc in self.backed_up for key in doc}
        self.errors: list[str] = []
        self.counts = {"set": 0, "got": 0, "exists": 0, "theirs": 0}  # theirs: pages got
        self.theirs = lambda key: key not in own  # of keys only another instance backs up
        self.settled: dict[int, bytes] = {}  # a prefetch page: its bytes when its get returned
        self.done = 0  # calls made, both threads (the faults' clock)
        self.stop = threading.Event()  # the run's end, before `ops` calls a thread

    def served(self) -> int:
        return self.counts["set"] + self.counts["got"]

    def _chain(self, rng, docs=None):
        keys = rng.choice(self.docs if docs is None else docs)
        return keys[: rng.randint(1, DOC_PAGES)]

    def backups(self) -> None:
        rng = random.Random(self.seed)
        for _ in range(self.ops):
            if self.stop.is_set():
                return
            keys = self._chain(rng, self.backed_up)
            pages = rng.sample(range(1, 25), len(keys))  # soon reused
            for page, key in zip(pages, keys):
                _write_page(self.pool, page, key)
            stored = self.backend.batch_set_v1(keys, sp.pages_of(self.pool, pages))
            self.counts["set"] += sum(stored)
            self.done += 1

    def prefetches(self) -> None:
        rng = random.Random(self.seed + 1)
        for _ in range(self.ops):
            if self.stop.is_set():
                return
            self.check_settled()
            self.done += 1
            keys = self._chain(rng)
            if rng.random() < 0.3:
                self.counts["exists"] += self.backend.batch_exists(keys)
                continue
            pages = rng.sample(range(100, 250), len(keys))
            for page in pages:  # nothing earlier can pass for a page's bytes
                self.settled.pop(page, None)
                _write_page(self.pool, page, "scribble")
            got = self.backend.batch_get_v1(keys, sp.pages_of(self.pool, pages))
            for page, key, ok in zip(pages, keys, got):
                self.settled[page] = now = sp.page_bytes(self.pool, page)
                if ok and now != page_content(key, PAGE_BYTES):
                    self.errors.append(f"page of key {key[:12]} (host page {page}) wrong")
                self.counts["theirs"] += bool(ok) and self.theirs(key)
            self.counts["got"] += sum(got)

    def check_settled(self) -> None:
        """No page of a get that returned has changed since (a copy landing in a page SGLang
        may have reused)."""
        for page, was in list(self.settled.items()):
            if sp.page_bytes(self.pool, page) != was:
                self.errors.append(f"host page {page} written after its get returned")
                self.settled.pop(page)

    def run(self) -> list[threading.Thread]:
        def guarded(fn):
            try:
                fn()
            except Exception as exc:  # reported by the test
                self.errors.append(f"{fn.__name__}: {exc!r}")
        threads = [threading.Thread(target=guarded, args=(f,), name=f"{f.__name__}-{self.seed}")
                   for f in (self.backups, self.prefetches)]
        for t in threads:
            t.start()
        return threads


def docs_of(seed: int) -> list[list[str]]:
    return [sp.page_hashes(DOC_PAGES, seed=1000 * seed + d) for d in range(DOCS)]


def main(args: dict) -> None:
    docs = docs_of(args["docs_seed"])
    inst = Instance(args["layout"], args["extra"], docs, args["seed"], 10**9,
                    [docs[d] for d in args["backed_up"]])
    said = 0
    print("ready", flush=True)
    threads = inst.run()
    while any(t.is_alive() for t in threads):
        threads[0].join(0.05)
        for error in inst.errors[said:]:
            print(error, flush=True)
        said = len(inst.errors)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
