"""Random concurrent work against one daemon, its host tier too small for the blocks in play:
offloads and layer-wise loads kept in flight by the engine while an operator deletes, prefetches,
looks up and clears the host tier. Every block's content is a function of its key, so a loaded
block that differs from its key's content is a wrong byte served, whatever the interleaving
(a pin released early, a host page reused under a load, a record read back into the wrong
block). Seeded: a failure names the seed; KVCACHED_SOAK_OPS scales the run."""
from __future__ import annotations

import contextlib
import os
import random
import threading
import time

import pytest
import torch
from conftest import disk_uri, kv_parts, settled_status, small_kv
from test_prefix import content

from kvcached_client import BlockHasher, launch
from kvcached_proto import RequestError, TaskFailed

LAYERS, BLOCKS, SHAPE = 2, 96, (16, 4, 64)  # 8 KiB a part: a host page of 32 KiB
PAGE = 32 * 1024
DOCS, DOC_BLOCKS = 12, 8
MAX_INFLIGHT = 6
CANCEL = 0.1  # of the ops waited for, cancelled first


class Contents:
    """Each key's bytes, per layer and part, under the weights of an epoch (a weights update
    starts the next one): made once per key and epoch from the key itself."""

    def __init__(self, kv):
        self.kv, self._made, self.epoch = kv, {}, 0

    def of(self, key: bytes, epoch: int | None = None) -> list[torch.Tensor]:
        epoch = self.epoch if epoch is None else epoch
        if (epoch, key) not in self._made:
            self._made[epoch, key] = [content(bytes([i, epoch]) + key, t.shape[1:], t.dtype)
                                      for i, t in enumerate(t for layer in self.kv for t in kv_parts(layer))]
        return self._made[epoch, key]

    def write(self, block: int, key: bytes) -> None:
        parts = [t for layer in self.kv for t in kv_parts(layer)]
        for t, value in zip(parts, self.of(key)):
            t[block].copy_(value)

    def holds(self, block: int, key: bytes, epoch: int | None = None) -> bool:
        parts = [t for layer in self.kv for t in kv_parts(layer)]
        return all(torch.equal(t[block], value) for t, value in zip(parts, self.of(key, epoch)))


def _docs() -> list[list[bytes]]:
    hasher = BlockHasher("random-ops")
    return [hasher.hash_blocks([d * 100_000 + i for i in range(16 * DOC_BLOCKS)], 16)
            for d in range(DOCS)]


def _paused_deletes(op, docs, rng) -> str:
    """The engine's loads queue up holding their pins while the daemon is paused; deletes meet
    them, and the invariant walk runs before the loads do."""
    op.pause()
    try:
        time.sleep(0.003)
        for _ in range(3):
            op.delete(rng.choice(docs)[rng.randrange(DOC_BLOCKS):])
        return op.check()
    finally:
        op.resume()


def _operator(d, docs, seed: int, permits: threading.Semaphore, stop: threading.Event,
              errors: list, done: dict) -> None:
    """One op per permit the engine's loop gives (so the mix of the two does not depend on how
    the machine schedules them), until the engine stops and the permits are spent."""
    rng = random.Random(seed + 1)
    try:
        with d.connect(role="operator", timeout=30) as op:
            while True:
                if not permits.acquire(timeout=0.05):
                    if stop.is_set():
                        return
                    continue
                keys, what = rng.choice(docs), rng.random()
                if what < 0.25:
                    name = "delete"
                    op.delete(keys[rng.randrange(DOC_BLOCKS):])
                elif what < 0.4:
                    name = "prefetch"
                    op.prefetch(keys)
                elif what < 0.6:
                    name = "lookup"
                    op.lookup(keys)
                elif what < 0.72:  # the invariant walk, while the engine's tasks run
                    name, walked = "check", op.check()
                    if walked != "ok":
                        errors.append(f"check: {walked}")
                elif what < 0.77:
                    name = "clear"
                    op.clear(tier="host")
                else:
                    name, walked = "paused deletes", _paused_deletes(op, docs, rng)
                    if walked != "ok":
                        errors.append(f"check while paused: {walked}")
                done[name] = done.get(name, 0) + 1
    except Exception as exc:  # reported by the test
        errors.append(f"operator: {exc!r}")


@contextlib.contextmanager
def operated(d, docs, seed: int, errors: list, done: dict):
    """The operator's thread (`_operator`) beside the engine's loop in the with-block, which gets
    its permits; a RequestError out of the loop is an error of the run; at the end the operator
    stops and is joined."""
    stop, permits = threading.Event(), threading.Semaphore(0)
    operator = threading.Thread(target=_operator, args=(d, docs, seed, permits, stop, errors, done))
    operator.start()
    try:
        yield permits
    except RequestError as exc:
        errors.append(f"engine: {exc!r}")
    finally:
        stop.set()
        operator.join(60)
    assert not operator.is_alive()


class Engine:
    """The engine's side: device blocks held by the op in flight that uses them, waited for in
    any order; every load's leading blocks compared with their keys' contents. It keeps the
    keys it offloaded itself, to count the blocks it loaded of keys only another stored."""

    def __init__(self, client, contents, rng):
        self.c, self.contents, self.rng = client, contents, rng
        self.free, self.inflight = set(range(BLOCKS)), []
        self.loaded = self.wrong = self.missed = self.updates = 0
        self.cancels: dict[str, int] = {}  # the daemon's answer to each cancel: how many
        self.own: set[bytes] = set()
        self.theirs = 0  # blocks loaded whose key this engine never offloaded
        self.stores = None  # the documents (first keys) it may offload; None: all; others it loads

    def step(self, rng, docs) -> None:
        """One engine step: wait for an op in flight (always when its blocks or its ops run
        short), or offload or load a leading part of a document."""
        keys = rng.choice(docs)[:rng.randint(1, DOC_BLOCKS)]
        if self.inflight and (len(self.inflight) >= MAX_INFLIGHT or len(self.free) < DOC_BLOCKS
                              or rng.random() < 0.25):
            self.finish_one()
        elif rng.random() < 0.45 and (self.stores is None or keys[0] in self.stores):
            self.offload(keys)
        else:
            self.load(keys)

    def drain(self) -> None:
        """Wait for every op in flight."""
        while self.inflight:
            self.finish_one()

    def offload(self, keys) -> None:
        blocks = self.rng.sample(sorted(self.free), len(keys))
        for b, k in zip(blocks, keys):
            self.contents.write(b, k)
        self._start("offload", self.c.offload(blocks, keys), blocks, keys)
        self.own.update(keys)

    def load(self, keys) -> None:
        blocks = self.rng.sample(sorted(self.free), len(keys))
        for layer in self.contents.kv:
            for t in kv_parts(layer):
                t[blocks] = 0  # nothing of an earlier use can pass for the load's bytes
        self._start("load", self.c.load(keys, blocks), blocks, keys)

    def weights_update(self) -> None:
        """The weights change under the same keys (a careless engine's namespace): every tier
        is cleared, as the connectors do, and the KV is the next epoch's from now on. No load
        sent after it may bring a block of before it."""
        self.c.clear(weights_update=True)
        self.contents.epoch += 1
        self.updates += 1

    def _start(self, kind, task, blocks, keys) -> None:
        self.free -= set(blocks)
        self.inflight.append((kind, task, blocks, keys, self.contents.epoch))

    def finish_one(self) -> tuple[str, list, int]:
        """Wait for one op in flight, picked at random, now and then cancelled first (as a
        timeout does): (its kind, its keys, blocks loaded)."""
        kind, task, blocks, keys, epoch = self.inflight.pop(self.rng.randrange(len(self.inflight)))
        n = 0
        if self.rng.random() < CANCEL:
            state = task.cancel()
            self.cancels[state] = self.cancels.get(state, 0) + 1
        if kind == "offload":
            task.wait(30)
        else:
            if self.rng.random() < 0.5:
                try:  # a load that ends with no block (a miss; queued at a clear) raises here
                    task.wait_layer(self.rng.randrange(LAYERS), timeout=30)
                except TaskFailed:
                    pass
            n = task.wait(30)
            self.loaded += n
            self.missed += len(keys) - n
            self.wrong += sum(not self.contents.holds(b, k, epoch) for b, k in zip(blocks[:n], keys[:n]))
            self.theirs += sum(k not in self.own for k in keys[:n])
        self.free |= set(blocks)
        return kind, keys, n


SETUPS = {  # seed: host pages (96 blocks in play), the daemon's settings beyond the disk tier
    1: (48, []),
    # write_back stores only what the host tier evicts: a smaller tier, so that loads from
    # storage are many (with 48 pages 3 to 16 in a run, none in one full-suite run)
    2: (24, ["--host-layout", "page_first", "--storage-write-policy", "write_back", "--redis"]),
}


@pytest.mark.parametrize("seed", sorted(SETUPS))
def test_random_concurrent_ops_under_eviction_never_serve_a_wrong_byte(run_dir, instance, disk_dir, seed,
                                                                        request):
    ops = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 4
    rng, docs = random.Random(seed), _docs()
    kv = small_kv(num_layers=LAYERS, num_blocks=BLOCKS, block_shape=SHAPE, seed=seed)
    contents = Contents(kv)
    # the check itself: a block written from one key is not taken for another's, nor for its own
    # under other weights
    contents.write(0, docs[0][0])
    assert contents.holds(0, docs[0][0]) and not contents.holds(0, docs[0][1])
    assert not contents.holds(0, docs[0][0], epoch=1)
    errors, done = [], {}
    pages, settings = SETUPS[seed]
    extra = ["--storage", disk_uri(disk_dir), *settings]
    if "--redis" in extra:  # a second storage tier, a real server
        extra[extra.index("--redis"):] = ["--storage", request.getfixturevalue("redis_server").uri]
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=pages * PAGE / 2**30, extra_args=extra,
                wait_storage=True) as d:
        with d.connect(timeout=30) as c:
            c.register_kv_cache(kv)
            engine = Engine(c, contents, rng)
            with operated(d, docs, seed, errors, done) as permits:
                for step in range(ops):
                    if rng.random() < 0.3:
                        permits.release()  # the operator's next op, beside this one
                    if step in (ops // 3, 2 * ops // 3):  # twice a run, with ops in flight
                        engine.weights_update()
                    engine.step(rng, docs)
                engine.drain()
            assert c.check() == "ok"
            books = {name: len(getattr(c, name)) for name in  # nothing kept of work that ended
                     ("_events", "_replies", "_holds", "_unanswered", "_late_loads")}
            assert not any(books.values()), books
            s = settled_status(c)
    assert not errors, (seed, errors)
    assert engine.wrong == 0, f"seed {seed}: {engine.wrong} of {engine.loaded} loaded blocks wrong"
    # not a run that loaded nothing: hits from both tiers, evictions, and the operator's work
    assert engine.loaded > ops // 4 and engine.missed > 0, (engine.loaded, engine.missed)
    assert s["host"]["evictions"] > 0 and s["lookups"]["loaded_from_storage"] > 0, s
    assert len(done) == 6 and engine.updates == 2, (done, engine.updates)  # every kind of work ran
    assert s["tasks"]["inflight"] == 0 and s["host"]["pinned_blocks"] == 0, s["tasks"]
