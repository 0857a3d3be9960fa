"""SGLang weight updates and the pages stored before them: with SGLang's own runtime config,
host pools and scheduler weight updater (sglang_updater.py), and real daemons. Whether or not
an update names a version, nothing stored under the old weights is a hit after it, and no page
of the old weights is stored under the new keys. Runs in .venv-sglang (./scripts/test.sh
--with-sglang)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("sglang", reason="SGLang is installed in .venv-sglang: ./scripts/test.sh --with-sglang")
pytestmark = pytest.mark.timeout(300)

import sglang_pools as sp  # noqa: E402
import sglang_updater as su  # noqa: E402

from kvcached_client.sglang import weight_updates  # noqa: E402
from kvcached_client.sglang.config import sglang_weight_version  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def sglang_serving():
    """SGLang's runtime config published, as its scheduler has it (the weight version lives
    there); reset afterwards, with the salt of the weights this process served."""
    from sglang.srt.runtime_context import get_context, reset_context
    from sglang.srt.server_args import ServerArgs

    get_context().set_server_args(ServerArgs(model_path="test-org/test-model", device="cpu"))
    yield get_context()
    reset_context()
    weight_updates._salt = ""


def _stored(backend, pool, keys, pages) -> None:
    assert backend.batch_set_v1(keys, sp.pages_of(pool, pages)) == [True] * len(keys)
    assert backend.batch_exists(keys) == len(keys)


def test_a_weight_version_set_without_an_update_never_matches_the_old_weights_pages(daemon, sglang_serving):
    """The version changed with no update call seen (SGLang's /update_weight_version): the
    pages stored before are no hit after it. Pages of the old weights still in its host pool
    are not backed up until SGLang's flush clears the pool; then backups are stored, under the
    new version."""
    pool = sp.make_pool("mha", "page_first")
    sp.fill_random(pool, 7)
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    keys = sp.page_hashes(4, seed=42)
    _stored(backend, pool, keys, [1, 2, 3, 4])
    sglang_serving.override("scheduler.weight_version", weight_version="step-1")
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, sp.pages_of(pool, [5, 6, 7, 8])) == [False] * 4
    assert backend.batch_set_v1(keys, sp.pages_of(pool, [1, 2, 3, 4])) == [False] * 4
    assert backend.stats["old_weights_refused"] == 4 and backend.batch_exists(keys) == 0
    pool.clear()  # SGLang's flush_cache after the update (tree_cache.reset)
    sp.fill_random(pool, 8)  # what the new weights compute
    _stored(backend, pool, keys, [1, 2, 3, 4])
    backend.close()


def test_a_new_weight_version_voids_a_hybrid_models_states_too(daemon, sglang_serving):
    """A Mamba state stored under the old weights is no hit after the version changes, nor
    loaded; one of the old weights still in the pool is not backed up until SGLang's flush."""
    from kvcached_client import launch
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    mamba_d = launch(instance=f"{daemon.instance}-mamba", run_dir=daemon.run_dir, host_cache_gb=0.05)
    kv, mamba = sp.make_pool("mha", "page_first"), sp.mamba_pool()
    sp.fill_random(kv, 9)
    sp.fill_mamba(mamba, 10)
    backend = sp.attach_hybrid(kv, {"mamba": mamba}, sp.extra_config(daemon.instance, daemon.run_dir))
    try:
        keys = sp.page_hashes(2, seed=44)
        state = [PoolTransfer(name=PoolName.MAMBA, keys=keys[1:], host_indices=sp.pages_of(mamba, [3]))]
        query = [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        _stored(backend, kv, keys, [1, 2])
        assert backend.batch_set_v2(state) == {PoolName.MAMBA: [True]}
        assert backend.batch_exists_v2(keys, query).kv_hit_pages == 2
        sglang_serving.override("scheduler.weight_version", weight_version="step-2")
        assert backend.batch_exists_v2(keys, query).kv_hit_pages == 0
        assert backend.batch_set_v1(keys, sp.pages_of(kv, [1, 2])) == [False] * 2  # old pages
        assert backend.batch_set_v2(state) == {PoolName.MAMBA: [False]}
        assert backend.batch_get_v2(state) == {PoolName.MAMBA: [False]}
        kv.clear()  # SGLang's flush after the update
        _stored(backend, kv, keys, [1, 2])
        assert backend.batch_set_v2(state) == {PoolName.MAMBA: [True]}
        assert backend.batch_exists_v2(keys, query).kv_hit_pages == 2
    finally:
        backend.close()
        mamba_d.stop()


@pytest.mark.parametrize("version", [None, "default"])
def test_an_update_that_keeps_the_version_never_matches_the_old_weights_pages(daemon, sglang_serving, version):
    """update_weights_from_disk naming no version (or the one served): SGLang's version stays,
    the pages stored before are no hit after it - though the daemon still holds them (a new
    salt, not a clear: another server of the old weights keeps its hits). What the new weights
    compute is stored and loaded byte for byte, also by a backend attached after the update."""
    pool = sp.make_pool("mha", "page_first")
    sp.fill_random(pool, 7)
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    keys = sp.page_hashes(4, seed=43)
    _stored(backend, pool, keys, [1, 2, 3, 4])
    old_keys = backend.keys(keys)
    mgr = su.updater(pool)
    su.update_from_disk(mgr, version)
    assert mgr.scheduler.flushes == 1 and sglang_weight_version() == "default"
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, sp.pages_of(pool, [5, 6, 7, 8])) == [False] * 4
    with daemon.connect() as c:
        assert sum(c.lookup(old_keys)) == 4
    sp.fill_random(pool, 8)  # what the new weights compute
    _stored(backend, pool, keys, [1, 2, 3, 4])
    later = sp.attach(sp.make_pool("mha", "page_first"), sp.extra_config(daemon.instance, daemon.run_dir))
    assert later.batch_exists(keys) == 4
    want = [sp.page_bytes(pool, p) for p in (1, 2, 3, 4)]
    assert sp.page_bytes(later.mem_pool_host, 10) != want[0]  # the control
    assert later.batch_get_v1(keys, sp.pages_of(later.mem_pool_host, [10, 11, 12, 13])) == [True] * 4
    assert [sp.page_bytes(later.mem_pool_host, p) for p in (10, 11, 12, 13)] == want
    later.close()
    backend.close()


def test_an_update_without_its_flush_stores_nothing_until_the_pool_is_cleared(daemon, sglang_serving):
    """flush_cache=False: SGLang's host pool keeps pages of the old weights, so backups are
    refused (misses) until SGLang's flush clears it; then they are stored under the new keys."""
    pool = sp.make_pool("mha", "page_first")
    sp.fill_random(pool, 9)
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    keys = sp.page_hashes(3, seed=44)
    _stored(backend, pool, keys, [1, 2, 3])
    mgr = su.updater(pool)
    su.update_from_disk(mgr, flush=False)
    assert mgr.scheduler.flushes == 0
    assert backend.batch_set_v1(keys, sp.pages_of(pool, [1, 2, 3])) == [False] * 3
    assert backend.stats["old_weights_refused"] == 3 and backend.batch_exists(keys) == 0
    mgr.scheduler.flush_cache()  # POST /flush_cache
    sp.fill_random(pool, 10)
    _stored(backend, pool, keys, [1, 2, 3])
    backend.close()


def test_an_update_naming_a_new_version_keys_pages_by_it_alone(daemon, sglang_serving):
    """A named version is the weights' name: after update_weights_from_disk(weight_version=
    "step-1") nothing stored before is a hit, and what is stored is found by any backend under
    "step-1" (no salt), e.g. one attached after the update."""
    pool = sp.make_pool("mha", "page_first")
    sp.fill_random(pool, 11)
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    keys = sp.page_hashes(3, seed=45)
    _stored(backend, pool, keys, [1, 2, 3])
    su.update_from_disk(su.updater(pool), "step-1")
    assert sglang_weight_version() == "step-1" and weight_updates.salt() == ""
    assert backend.batch_exists(keys) == 0
    sp.fill_random(pool, 12)
    _stored(backend, pool, keys, [1, 2, 3])
    later = sp.attach(sp.make_pool("mha", "page_first"), sp.extra_config(daemon.instance, daemon.run_dir))
    assert later.batch_exists(keys) == 3
    later.close()
    backend.close()


def test_a_backend_that_cannot_re_key_is_closed_and_the_update_goes_on(daemon, sglang_serving, monkeypatch):
    """Re-keying raised inside the wrapped update (here: the page keys cannot be made): the
    error went into SGLang's update call, and the backend kept its old keys - the old weights'
    pages would be hits under the new weights. The update returns as SGLang's own does; the
    backend is closed, so every page is a miss and nothing is stored; another backend re-keys."""
    pool, other_pool = sp.make_pool("mha", "page_first"), sp.make_pool("mha", "page_first")
    sp.fill_random(pool, 13)
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    other = sp.attach(other_pool, sp.extra_config(daemon.instance, daemon.run_dir))
    keys = sp.page_hashes(3, seed=46)
    _stored(backend, pool, keys, [1, 2, 3])
    assert other.batch_exists(keys) == 3  # the control: both serve the old weights' pages

    def cannot(*_args, **_kw):
        raise RuntimeError("no page keys")

    monkeypatch.setattr(backend, "weights_replaced", cannot)
    mgr = su.updater(pool)
    assert su.update_from_disk(mgr, None) is not None and mgr.scheduler.flushes == 1
    assert backend.batch_exists(keys) == 0 and other.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, sp.pages_of(pool, [5, 6, 7])) == [False] * 3
    assert backend.batch_set_v1(keys, sp.pages_of(pool, [1, 2, 3])) == [False] * 3
    other_pool.clear()  # its server's flush after the update
    sp.fill_random(other_pool, 14)
    _stored(other, other_pool, keys, [1, 2, 3])  # the other backend re-keyed and serves
    other.close()
    backend.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mla_ranks_agree_on_the_salt_of_an_update_that_keeps_the_version(daemon):
    """Two TP ranks of an MLA model, each its own process in one gloo group as SGLang's
    scheduler ranks are: after an update naming no version, the non-writer rank finds what the
    writer rank stores, byte for byte (each rank drawing its own salt would make it miss every
    page), and neither finds what was stored before (weight_update_rank.py)."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    ranks = [subprocess.Popen([sys.executable, os.path.join(HERE, "weight_update_rank.py"), str(r),
                               daemon.instance, daemon.run_dir, str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    for p in ranks:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            raise
    said = "\n".join(f"--- rank {r} (exit {p.returncode}):\n{out[-2500:]}"
                     for r, (p, out) in enumerate(zip(ranks, outs)))
    assert all(p.returncode == 0 and f"rank {r} ok" in out
               for r, (p, out) in enumerate(zip(ranks, outs))), said
