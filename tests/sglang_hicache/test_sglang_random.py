"""kvcached as SGLang HiCache's storage backend under random work: two SGLang instances of one
model attached to one daemon, each with a backup thread (batch_set_v1) and a prefetch thread
(batch_get_v1, batch_exists) over chained pages of shared documents, a daemon host tier too small
for them (evictions, the disk tier behind it), and an operator clearing the host tier now and
then. A page's bytes are a function of its key, so every page a get says it loaded is compared
with its key's, and no page of a get may change after the get returned (SGLang reuses them):
a late copy. Also with the daemon killed (-9) and restarted on its disk tier, or frozen past
the hang threshold, often with its copies queued. Seeded; KVCACHED_SOAK_OPS scales it. Runs in
.venv-sglang."""
from __future__ import annotations

import ctypes
import hashlib
import os
import random
import signal
import threading
import time

import numpy as np
import pytest

pytest.importorskip("sglang", reason="SGLang is installed in .venv-sglang: ./scripts/test.sh --with-sglang")
pytestmark = pytest.mark.timeout(300)

import sglang_pools as sp  # noqa: E402
from conftest import disk_uri, no_tasks, sweep_crashed, wait_until  # noqa: E402

from kvcached.bench import process_stop  # noqa: E402
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
        self.settled: dict[int, bytes] = {}  # a prefetch page: its bytes when its get returned
        self.done = 0  # calls made, both threads (the faults' clock)
        self.stop = threading.Event()  # the run's end, before `ops` calls a thread

    def served(self) -> int:
        return self.counts["set"] + self.counts["got"]

    def _chain(self, rng):
        keys = rng.choice(self.docs)
        return keys[: rng.randint(1, DOC_PAGES)]

    def backups(self) -> None:
        rng = random.Random(self.seed)
        for _ in range(self.ops):
            if self.stop.is_set():
                return
            keys = self._chain(rng)
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
            self._check_settled()
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
                if ok and now != _content(key, PAGE_BYTES):
                    self.errors.append(f"page of key {key[:12]} (host page {page}) wrong")
            self.counts["got"] += sum(got)

    def _check_settled(self) -> None:
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


class Faults:
    """The daemon under the instances and what befalls it as their calls go on. kills: killed
    (-9) three times, a successor started on the same disk tier 0.1-0.4 s later. freezes: stopped
    (SIGSTOP) eight times for 0.4-0.8 s against the backends' hang threshold of 0.3 s. 3 times in 4
    the daemon is paused (its operator's pause) 10-60 ms first, so the calls' copies are queued
    when the fault comes (CPU copies of a few pages end within microseconds of their reply).
    pauses: paused eight times for 0.6-1.0 s against the calls' timeout of 0.5 s."""

    def __init__(self, kind, start, rng):
        self.kind, self.start, self.rng = kind, start, rng
        self.daemon = start()
        self.op = self.daemon.connect(role="operator")
        self.came = 0

    def run(self, instances, calls_between: int) -> None:
        """Each fault, and the run's end, once `calls_between` calls were made since the last
        fault and each instance was served since (a page stored or loaded: attached again)."""
        for fault in [self._kill] * 3 if self.kind == "kills" else [getattr(self, "_" + self.kind[:-1])] * 8:
            self._wait(instances, calls_between)
            fault()
            self.came += 1
        self._wait(instances, calls_between)
        for inst in instances:
            inst.stop.set()

    def _wait(self, instances, calls: int) -> None:
        mark = sum(inst.done for inst in instances) + calls
        served = [inst.served() for inst in instances]
        deadline = time.monotonic() + 60
        while sum(inst.done for inst in instances) < mark or any(
                inst.served() == was for inst, was in zip(instances, served)):
            assert time.monotonic() < deadline, f"no call served within 60 s of fault {self.came}"
            assert not any(inst.errors for inst in instances), [i.errors[:3] for i in instances]
            self.op.clear(tier="host")
            time.sleep(0.05)

    def _paused(self) -> bool:
        if self.rng.random() < 0.75:
            self.op.pause()
            time.sleep(self.rng.uniform(0.01, 0.06))
            return True
        return False

    def _kill(self) -> None:
        self._paused()
        os.kill(self.daemon.pid, signal.SIGKILL)
        self.daemon.proc.wait(10)
        self.op.close()
        sweep_crashed(self.daemon.instance)
        time.sleep(self.rng.uniform(0.1, 0.4))  # misses meanwhile
        self.daemon = self.start()
        self.op = self.daemon.connect(role="operator")

    def _freeze(self) -> None:
        paused = self._paused()
        with process_stop.stopped(self.daemon.pid, "the daemon"):
            time.sleep(self.rng.uniform(0.4, 0.8))
        if paused:
            self.op.resume()

    def _pause(self) -> None:
        """Paused past the calls' timeout: slow, not hung (no drop): what a timed-out offload
        read from pages SGLang reuses is discarded (revoked), a timed-out load is cancelled."""
        self.op.pause()
        time.sleep(self.rng.uniform(0.6, 1.0))
        self.op.resume()

    def close(self) -> None:
        process_stop.go_on(self.daemon.pid, "the daemon")
        self.op.close()
        self.daemon.stop()
        sweep_crashed(self.daemon.instance)


@pytest.mark.faults
@pytest.mark.parametrize("kind,layout,seed", [("kills", "page_first", 3), ("freezes", "layer_first", 4),
                                              ("pauses", "page_first", 5)])
def test_random_calls_with_the_daemon_killed_frozen_or_paused_load_only_their_keys_bytes(
        run_dir, tmp_path, kind, layout, seed):
    """Every call returns (a miss, never an exception), a page a get says it loaded is its key's,
    no page changes after its get returned, and the backends attach to each successor."""
    calls = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 10
    docs = [sp.page_hashes(DOC_PAGES, seed=1000 * seed + d) for d in range(DOCS)]
    start = lambda: launch(  # noqa: E731
        instance=f"sgf{os.getpid()}-{seed}", run_dir=run_dir, host_cache_gb=HOST_PAGES * PAGE_BYTES / 2**30,
        extra_args=["--storage", disk_uri(str(tmp_path / "disk")), "--host-layout", layout],
        wait_storage=True)
    fx, instances = Faults(kind, start, random.Random(seed)), []
    try:
        extra = sp.extra_config(fx.daemon.instance, run_dir, timeout_s=0.5, hang_s=0.3)
        instances += [Instance(layout, extra, docs, seed * 10 + i, ops=100 * calls) for i in range(2)]
        threads = [t for inst in instances for t in inst.run()]
        try:
            fx.run(instances, calls)
        finally:
            for inst in instances:
                inst.stop.set()
            for t in threads:
                t.join(20)
        stuck = [t.name for t in threads if t.is_alive()]
        assert not stuck, f"{stuck} still in a call 20 s after the run's end (the daemon running)"
        wait_until(lambda: no_tasks(fx.op), 10, "the daemon idle")
        for inst in instances:
            inst._check_settled()
        status, check = fx.op.status(), fx.op.check()
    finally:
        for inst in instances:
            inst.backend.close()
        fx.close()
    errors = [e for inst in instances for e in inst.errors]
    assert not errors, errors[:5]
    assert check == "ok"
    stats = [inst.backend.stats for inst in instances]
    assert all(s["errors"] + s["no_daemon"] > 0 for s in stats), stats  # the faults cost misses
    if kind == "kills":
        assert status["lookups"]["loaded_from_storage"] > 0, status["lookups"]
