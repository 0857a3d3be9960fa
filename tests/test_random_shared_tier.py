"""Random concurrent work of two daemons over one shared storage tier (a Redis server; a
Mooncake Store), as two machines of a fleet share it, their host tiers laid out apart
(layer_first, page_first): each daemon's engine offloads and loads layer-wise while an operator
on each deletes, prefetches, looks up and clears its host tier. With one KV geometry the daemons
serve each other's blocks, and every block is compared with its key's content; with two
(another dtype, the same page size) neither may ever serve a block of a key only the other
stored, under any interleaving of puts, gets, prefetches and evictions. Seeded; KVCACHED_SOAK_OPS
scales the run, KVCACHED_SOAK_SEED moves its seeds."""
from __future__ import annotations

import os
import random
import threading

import pytest
import torch
from conftest import small_kv, unique_instance
from test_random_ops import BLOCKS, LAYERS, PAGE, SHAPE, Contents, Engine, _docs, _operator

from kvcached.bench.mooncake_servers import MooncakeStore, available
from kvcached_client import launch
from kvcached_proto import RequestError

HOST_PAGES = 24  # of the 96 blocks in play: most loads of the other daemon's keys come from storage


def _engine(client, dtype, seed) -> Engine:
    """One daemon's engine, on KV of its own (a dtype of its own when the geometries differ)."""
    kv = small_kv(num_layers=LAYERS, num_blocks=BLOCKS, block_shape=SHAPE, dtype=dtype, seed=seed)
    client.register_kv_cache(kv)
    return Engine(client, Contents(kv), random.Random(seed))


def _tier(request, kind: str, tmp_path) -> str:
    if kind == "redis":
        return request.getfixturevalue("redis_server").uri
    if not available():
        pytest.skip("the mooncake extra is not installed")
    store = MooncakeStore(provider_mb=128, log_dir=str(tmp_path))
    request.addfinalizer(store.close)
    return f"{store.uri}?segment_gb=0&host=127.0.0.1"


@pytest.mark.parametrize("tier", ["redis", "mooncake"])
@pytest.mark.parametrize("geometry", ["same", "other"])
def test_two_daemons_on_one_tier_share_only_their_geometrys_blocks_and_every_byte_is_right(
        run_dir, tier, geometry, request, tmp_path):
    ops = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 4
    seed = ({"redis": 11, "mooncake": 13}[tier] + (geometry == "other")
            + int(os.environ.get("KVCACHED_SOAK_SEED", "0")))
    rng, docs = random.Random(seed), _docs()
    uri = _tier(request, tier, tmp_path)
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
        if geometry == "other":  # the check itself: one key's content differs between the two
            key = docs[0][0]
            assert not torch.equal(engines[0].contents.of(key)[0].float(), engines[1].contents.of(key)[0].float())
        permits = [threading.Semaphore(0), threading.Semaphore(0)]
        operators = [threading.Thread(target=_operator,
                                      args=(d, docs, seed + i, permits[i], stop, errors, done[i]))
                     for i, d in enumerate((da, db))]
        for t in operators:
            t.start()
        try:
            for _ in range(ops):
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
            for t in operators:
                t.join(60)
        assert not any(t.is_alive() for t in operators)
        statuses = [c.status() for c in (ca, cb)]
        assert ca.check() == "ok" and cb.check() == "ok"
    assert not errors, (seed, errors)
    for e, s in zip(engines, statuses):
        assert e.wrong == 0, f"seed {seed}: {e.wrong} of {e.loaded} loaded blocks wrong"
        assert e.loaded > ops // 10 and s["lookups"]["loaded_from_storage"] > 0, (e.loaded, s["lookups"])
        assert s["tasks"]["inflight"] == 0 and s["host"]["pinned_blocks"] == 0, s["tasks"]
    theirs = [e.theirs for e in engines]
    if geometry == "same":  # each served blocks only the other daemon had stored
        assert min(theirs) > 0, theirs
    else:  # never a block of the other geometry
        assert theirs == [0, 0], theirs
