"""Random concurrent work of two daemons over one shared storage tier (a Redis server; a
Mooncake Store), as two machines of a fleet share it, their host tiers laid out apart
(layer_first, page_first): each daemon's engine offloads and loads layer-wise (a third of the
documents each offloads alone, a third both) while an operator on each deletes, prefetches,
looks up and clears its host tier. With one KV geometry the daemons serve each other's blocks,
and every block is compared with its key's content; with two (another dtype, the same page
size) neither may ever serve a block of a key only the other stored, under any interleaving of
puts, gets, prefetches and evictions. Also with the tier's server frozen (Redis, Mooncake's
master), Redis restarted empty, or Redis's records tampered with (another writer, bit rot),
five times in the run: no wrong byte, no stalled engine, and the tier serving both daemons
again after. Seeded; KVCACHED_SOAK_OPS scales the run,
KVCACHED_SOAK_SEED moves its seeds."""
from __future__ import annotations

import os
import random
import re
import threading
import time

import pytest
import torch
from conftest import settled_status, small_kv, unique_instance, wait_until
from test_random_ops import BLOCKS, LAYERS, PAGE, SHAPE, Contents, Engine, _docs, _operator

from kvcached.bench import process_stop
from kvcached.bench.mooncake_servers import MooncakeStore, available
from kvcached_client import launch
from kvcached_proto import RequestError

HOST_PAGES = 24  # of the 96 blocks in play: most loads of the other daemon's keys come from storage


def _engine(client, dtype, seed) -> Engine:
    """One daemon's engine, on KV of its own (a dtype of its own when the geometries differ)."""
    kv = small_kv(num_layers=LAYERS, num_blocks=BLOCKS, block_shape=SHAPE, dtype=dtype, seed=seed)
    client.register_kv_cache(kv)
    return Engine(client, Contents(kv), random.Random(seed))


def _tier(request, kind: str, tmp_path):
    """(the tier's URI, its server: RedisServer or MooncakeStore)."""
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        return server.uri, server
    if not available():
        pytest.skip("the mooncake extra is not installed")
    store = MooncakeStore(provider_mb=128, log_dir=str(tmp_path))
    request.addfinalizer(store.close)
    return f"{store.uri}?segment_gb=0&host=127.0.0.1", store


RECORD_NAME = re.compile(rb"^kvcached:[0-9a-f]{32}$")  # a block's record (redis_store.py)
TAMPER = ("flip", "truncate", "extend", "remove", "foreign", "junk", "retype")


class TierFaults(threading.Thread):
    """What befalls the tier's server (redis-server; Mooncake's master) while the daemons work,
    each time the run says (`due`): freezes (SIGSTOP for 0.3-1.2 s, past the tier's lookup and
    I/O timeouts), restarts (Redis: stopped, and started again 0.1-0.4 s later empty, as a
    server without persistence comes back) or tampers (Redis: another writer on the same keys,
    or bit rot - 8 records, each a bit flipped, cut short, extended, removed, overwritten by
    another key's record or by junk of its size, or replaced by a list)."""

    def __init__(self, kind, server, seed):
        super().__init__(name=f"tier-{kind}")
        self.kind, self.server, self.rng = kind, server, random.Random(seed)
        self.due, self.stop = threading.Semaphore(0), threading.Event()
        self.asked = self.came = 0
        self.error = None
        self.tampered: dict[str, int] = {}

    def next(self) -> None:
        """The next fault, once the one before is over (a restart takes a while)."""
        deadline = time.monotonic() + 20
        while self.came < self.asked and self.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self.asked += 1
        self.due.release()

    def tick(self, n: int, ops: int, clients) -> None:
        """Step n of the run: a fault at five points of its first `ops` steps (tampering: at
        25, a few records each time, so that some are read before they are stored again), their
        end at `ops` (the `ops` steps after show the tier serving again)."""
        points = 25 if self.kind == "tampers" else 5
        if n < ops and n % (ops // points) == ops // (2 * points):
            self.next()
        elif n == ops:
            self.end()
            assert self.error is None and self.came == self.asked >= 3, (self.error, self.came)
            wait_until(lambda: all(c.status()["storage"][0]["healthy"] for c in clients), 10,
                       "the tier healthy again after the faults")
            self.from_storage = [c.status()["lookups"]["loaded_from_storage"] for c in clients]

    def end(self) -> None:
        self.stop.set()
        self.join(30)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if not self.due.acquire(timeout=0.05):
                    continue
                if self.kind == "freezes":
                    pid = self.server.proc.pid if hasattr(self.server, "proc") else self.server.master.pid
                    with process_stop.stopped(pid, "the tier's server"):
                        time.sleep(self.rng.uniform(0.3, 1.2))
                elif self.kind == "tampers":
                    self.tamper(self.server.client())
                else:
                    self.server.stop()
                    time.sleep(self.rng.uniform(0.1, 0.4))
                    self.server.start()
                self.came += 1
        except Exception as exc:  # reported by the test
            self.error = exc


    def tamper(self, r) -> None:
        names = sorted(n for n in r.scan_iter(count=1000) if RECORD_NAME.match(n))
        for _ in range(8 if len(names) > 1 else 0):
            name, how = self.rng.choice(names), self.rng.choice(TAMPER)
            value = r.get(name) if r.type(name) == b"string" else None
            if not value:
                continue
            if how == "flip":
                off = self.rng.randrange(len(value))
                r.setrange(name, off, bytes([value[off] ^ (1 << self.rng.randrange(8))]))
            elif how == "truncate":
                r.set(name, value[:self.rng.randrange(len(value))])
            elif how == "extend":
                r.append(name, self.rng.randbytes(self.rng.randint(1, 64)))
            elif how == "remove":
                r.delete(name)
            elif how == "foreign":  # a whole record, of another key, under this name
                other = self.rng.choice(names)
                r.set(name, (r.get(other) if r.type(other) == b"string" else None) or b"")
            elif how == "junk":
                r.set(name, self.rng.randbytes(len(value)))
            else:
                r.delete(name)
                r.rpush(name, value)
            self.tampered[how] = self.tampered.get(how, 0) + 1


@pytest.mark.parametrize("tier,fault", [("redis", None), ("mooncake", None), ("redis", "freezes"),
                                        ("redis", "restarts"), ("mooncake", "freezes"),
                                        ("redis", "tampers")])
@pytest.mark.parametrize("geometry", ["same", "other"])
def test_two_daemons_on_one_tier_share_only_their_geometrys_blocks_and_every_byte_is_right(
        run_dir, tier, fault, geometry, request, tmp_path):
    """Also with the tier's server frozen, or Redis restarted empty, now and then (TierFaults)."""
    ops = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 4
    seed = ({"redis": 11, "mooncake": 13}[tier] + (geometry == "other") + 2 * (fault == "freezes")
            + 4 * (fault == "restarts") + 8 * (fault == "tampers")
            + int(os.environ.get("KVCACHED_SOAK_SEED", "0")))
    rng, docs = random.Random(seed), _docs()
    uri, server = _tier(request, tier, tmp_path)
    faults = TierFaults(fault, server, seed) if fault else None
    dtypes = [torch.bfloat16, torch.bfloat16 if geometry == "same" else torch.float16]
    args = dict(run_dir=run_dir, host_cache_gb=HOST_PAGES * PAGE / 2**30, wait_storage=True)
    # the host layouts differ: a record's bytes are the block's whatever layout wrote it (a
    # layer_first page is 4 pieces, through Mooncake's staging buffer; page_first one, zero-copy)
    layouts = [["--storage", uri, "--host-layout", layout] for layout in ("layer_first", "page_first")]
    stop, errors, done = threading.Event(), [], [{}, {}]
    with launch(instance=unique_instance("sha"), extra_args=layouts[0], **args) as da, \
            launch(instance=unique_instance("shb"), extra_args=layouts[1], **args) as db, \
            da.connect(timeout=30) as ca, db.connect(timeout=30) as cb:
        engines = [_engine(ca, dtypes[0], seed), _engine(cb, dtypes[1], seed + 100)]
        for i, e in enumerate(engines):  # a third of the documents each offloads alone, a third both
            e.stores = {d[0] for n, d in enumerate(docs) if n % 3 in (i, 2)}
        if geometry == "other":  # the check itself: one key's content differs between the two
            key = docs[0][0]
            assert not torch.equal(engines[0].contents.of(key)[0].float(), engines[1].contents.of(key)[0].float())
        permits = [threading.Semaphore(0), threading.Semaphore(0)]
        operators = [threading.Thread(target=_operator,
                                      args=(d, docs, seed + i, permits[i], stop, errors, done[i]))
                     for i, d in enumerate((da, db))]
        for t in operators + ([faults] if faults else []):
            t.start()
        try:
            for n in range(ops + (ops if faults else 0)):
                if faults:
                    faults.tick(n, ops, (ca, cb))
                i = rng.randrange(2)
                if rng.random() < 0.3:
                    permits[i].release()
                engines[i].step(rng, docs)
            for e in engines:
                while e.inflight:
                    e.finish_one()
        except RequestError as exc:
            errors.append(f"engine: {exc!r}")
        finally:
            stop.set()
            if faults:
                faults.end()
            for t in operators:
                t.join(60)
        assert not any(t.is_alive() for t in operators)
        statuses = [settled_status(c) for c in (ca, cb)]
        assert ca.check() == "ok" and cb.check() == "ok"
    assert not errors, (seed, errors)
    for e, s in zip(engines, statuses):
        assert e.wrong == 0, f"seed {seed}: {e.wrong} of {e.loaded} loaded blocks wrong"
        assert e.loaded > ops // 10 and s["lookups"]["loaded_from_storage"] > 0, (e.loaded, s["lookups"])
        assert s["tasks"]["inflight"] == 0 and s["host"]["pinned_blocks"] == 0, s["tasks"]
    if fault == "tampers":  # every kind of tampering
        assert set(faults.tampered) == set(TAMPER), faults.tampered
    if faults:  # the tier served each daemon again after the faults
        assert all(s["lookups"]["loaded_from_storage"] > was for s, was in zip(statuses, faults.from_storage)), \
            (faults.from_storage, [s["lookups"] for s in statuses])
    theirs = [e.theirs for e in engines]
    if geometry == "same":  # each served blocks only the other daemon had stored
        assert min(theirs) > 0, theirs
    else:  # never a block of the other geometry
        assert theirs == [0, 0], theirs
