"""A hybrid model's side pools through kvcached, with SGLang's own pieces: its Mamba host pool
(float32 and bfloat16 recurrent states, one slot per page) and a sliding-window KV pool, each
made by its shm allocator and paged by a daemon of its own beside the KV pool's, through the v2
calls SGLang's hybrid cache controller makes. Runs in .venv-sglang."""
from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="SGLang is installed in .venv-sglang: ./scripts/test.sh --with-sglang")
pytestmark = pytest.mark.timeout(300)

import sglang_pools as sp  # noqa: E402
from conftest import sweep_crashed, wait_until  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402

from kvcached_client import launch  # noqa: E402
from kvcached_client.sglang.side_pools import trailing_restorable  # noqa: E402

TRAILING = PoolHitPolicy.TRAILING_PAGES


def _side_daemon(daemon, name: str):
    return launch(instance=f"{daemon.instance}-{name}", run_dir=daemon.run_dir, host_cache_gb=0.05)


@pytest.fixture
def attached():
    """Backends to close at the end however the test ends (their engine-side segments go)."""
    backends = []
    yield backends
    for b in backends:
        b.close()


def _attach(attached, *args, **kw):
    backend = sp.attach_hybrid(*args, **kw)
    attached.append(backend)
    return backend


def _stop(*handles):
    for h in handles:
        h.stop()
        sweep_crashed(h.instance)


def _pools(seed: int):
    kv, mamba, swa = sp.make_pool("mha", "page_first"), sp.mamba_pool(), sp.make_pool("mha", "page_first")
    sp.fill_random(kv, seed)
    sp.fill_mamba(mamba, seed + 1)
    sp.fill_random(swa, seed + 2)
    return kv, mamba, swa


def _query(keys):
    """The side transfers of SGLang's storage hit query, as its Mamba and SWA components build
    them: placeholder keys whose count is the window (the Mamba state of the last page, the
    sliding window's last two pages); the hashes are the query's own."""
    return [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING),
            PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * 2, hit_policy=TRAILING)]


def test_trailing_windows_are_where_a_prefix_may_stop():
    assert trailing_restorable([False, False, True, False, False, True], 1) == [3, 6]
    assert trailing_restorable([True, False, True, True, True], 2) == [1, 4, 5]
    assert trailing_restorable([False, True, True], 3) == []
    assert trailing_restorable([True, True], 0) == [1, 2]


def test_which_side_pools_every_rank_shares():
    """Keys without the rank only for what SGLang stores from the writer rank and every rank
    holds alike: an MLA model's side pools, but never its Mamba states nor an MHA draft."""
    from types import SimpleNamespace

    from kvcached_client.sglang.side_pools import replicated

    mla, mha = SimpleNamespace(is_mla_model=True), SimpleNamespace(is_mla_model=False)
    mla_pool, mha_pool = SimpleNamespace(kv_lora_rank=32), SimpleNamespace()
    assert [replicated(n, mla_pool, mla) for n in ("swa", "indexer", "draft")] == [True] * 3
    assert not replicated("mamba", mla_pool, mla) and not replicated("draft", mha_pool, mla)
    assert not any(replicated(n, mla_pool, mha) for n in ("mamba", "swa", "indexer", "draft"))


def test_a_hybrid_models_pages_and_states_round_trip_into_another_instance(daemon, attached):
    """SGLang A backs up 6 KV pages, the Mamba states after pages 3 and 6 and the window's last
    two pages; B asks: the prefix may stop at 6 only (page 3 has a state but not its window), and
    B loads the states and window pages byte for byte into its own slots. A chain whose KV pages
    are stored but whose state is not is no hit at all."""
    mamba_d, swa_d = _side_daemon(daemon, "mamba"), _side_daemon(daemon, "swa")
    try:
        a_kv, a_mamba, a_swa = _pools(1)
        b_kv, b_mamba, b_swa = _pools(11)
        extra = sp.extra_config(daemon.instance, daemon.run_dir)
        a = _attach(attached, a_kv, {"mamba": a_mamba, "swa": a_swa}, extra)
        keys = sp.page_hashes(6, seed=3)
        assert a.batch_set_v1(keys, sp.pages_of(a_kv, range(1, 7))) == [True] * 6
        stored = a.batch_set_v2([
            PoolTransfer(name=PoolName.MAMBA, keys=[keys[2], keys[5]], host_indices=sp.pages_of(a_mamba, [4, 7])),
            PoolTransfer(name=PoolName.SWA, keys=keys[4:6], host_indices=sp.pages_of(a_swa, [8, 9]))])
        assert stored == {PoolName.MAMBA: [True, True], PoolName.SWA: [True, True]}
        assert "sglang_host_pool" in open(f"/proc/{mamba_d.pid}/maps").read()  # its own daemon maps it
        with mamba_d.connect(role="operator") as op:  # what `kvcached status` names it by
            assert op.status()["kv"]["kv_layout"].startswith("sglang-mamba:page_first:MambaPoolHost:")
        kv_only = sp.page_hashes(4, seed=4)
        assert a.batch_set_v1(kv_only, sp.pages_of(a_kv, range(10, 14))) == [True] * 4
        a.close()

        b = _attach(attached, b_kv, {"mamba": b_mamba, "swa": b_swa}, extra)
        hit = b.batch_exists_v2(keys, _query(keys))
        assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (6, [6])
        assert hit.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.MAMBA: 6, PoolName.SWA: 6}
        # the control: KV pages held, no state after them - no hit (a KV hit alone would be 4)
        assert b.batch_exists(kv_only) == 4
        assert b.batch_exists_v2(kv_only, _query(kv_only)).kv_hit_pages == 0
        assert b.batch_exists_v2(keys[:3], _query(keys[:3])).kv_hit_pages == 0  # no window at 3

        want = [sp.page_bytes(a_mamba, 7), sp.page_bytes(a_swa, 8), sp.page_bytes(a_swa, 9)]
        before = [sp.page_bytes(b_mamba, 2), sp.page_bytes(b_swa, 3), sp.page_bytes(b_swa, 4)]
        assert all(b != w for b, w in zip(before, want))  # the control: each target slot of B holds other bytes
        got = b.batch_get_v2([
            PoolTransfer(name=PoolName.MAMBA, keys=keys[5:6], host_indices=sp.pages_of(b_mamba, [2])),
            PoolTransfer(name=PoolName.SWA, keys=keys[4:6] + ["nobody"], host_indices=sp.pages_of(b_swa, [3, 4, 5]))])
        assert got == {PoolName.MAMBA: [True], PoolName.SWA: [True, True, False]}
        assert [sp.page_bytes(b_mamba, 2), sp.page_bytes(b_swa, 3), sp.page_bytes(b_swa, 4)] == want
        assert b.stats["side_pages_got"] == 3
        b.close()
    finally:
        _stop(mamba_d, swa_d)


def test_a_side_pool_without_its_daemon_holds_nothing_until_it_comes(daemon, attached):
    """The Mamba pool's daemon is not running: the attach goes on (KV is paged), every prefix
    that needs a state is no hit and its loads miss, nothing raises; once the daemon starts the
    pool is attached in the background and its states are stored and found."""
    kv, mamba, swa = _pools(21)
    swa_d = _side_daemon(daemon, "swa")
    mamba_d = None
    try:
        backend = _attach(attached, kv, {"mamba": mamba, "swa": swa}, sp.extra_config(daemon.instance, daemon.run_dir))
        keys = sp.page_hashes(2, seed=22)
        assert backend.batch_set_v1(keys, sp.pages_of(kv, [1, 2])) == [True, True]
        side = [PoolTransfer(name=PoolName.MAMBA, keys=keys[1:], host_indices=sp.pages_of(mamba, [3])),
                PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=sp.pages_of(swa, [1, 2]))]
        assert backend.batch_set_v2(side) == {PoolName.MAMBA: [False], PoolName.SWA: [True, True]}
        assert backend.batch_exists_v2(keys, _query(keys)).kv_hit_pages == 0
        assert backend.batch_get_v2(side[:1]) == {PoolName.MAMBA: [False]}
        mamba_d = _side_daemon(daemon, "mamba")
        wait_until(lambda: backend.batch_set_v2(side[:1]) == {PoolName.MAMBA: [True]},
                   what="the Mamba pool attached to its daemon in the background")
        assert backend.batch_exists_v2(keys, _query(keys)).kv_hit_pages == 2
        backend.close()
    finally:
        _stop(swa_d, *([mamba_d] if mamba_d else []))


def test_deepseek_index_keys_ride_on_the_kv_pages_and_every_mla_rank_reads_the_writers(daemon, attached):
    """DeepSeek V3.2: the indexer pool shares the MLA pool's pages and host indices, and every
    page of a prefix needs its index keys (ALL_PAGES). Rank 0 stores 5 KV pages and the index
    keys of the first 3; rank 1 of another instance finds a 3-page prefix and loads KV and
    index keys byte for byte into its own pages."""
    indexer_d = _side_daemon(daemon, "indexer")
    try:
        extra = sp.extra_config(daemon.instance, daemon.run_dir)
        pools = []
        for r in range(2):
            kv = sp.make_pool("mla", "page_first")
            indexer = sp.indexer_pool(kv)
            sp.fill_random(kv, 60 + r)
            sp.fill_bytes(indexer.index_k_with_scale_buffer, 70 + r)
            pools.append((kv, indexer))
        (kv0, ix0), (kv1, ix1) = pools
        w = _attach(attached, kv0, {"indexer": ix0}, extra, mla=True, tp_rank=0, tp_size=2)
        keys = sp.page_hashes(5, seed=61)
        assert w.batch_set_v1(keys, sp.pages_of(kv0, range(1, 6))) == [True] * 5
        assert w.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys[:3],
                                            host_indices=sp.pages_of(kv0, range(1, 4)))]) == {PoolName.INDEXER: [True] * 3}
        w.close()
        r1 = _attach(attached, kv1, {"indexer": ix1}, extra, mla=True, tp_rank=1, tp_size=2)
        query = [PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
        hit = r1.batch_exists_v2(keys, query)
        assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (3, [1, 2, 3])
        assert hit.extra_pool_hit_pages == {PoolName.KV: 5, PoolName.INDEXER: 3}
        target = sp.pages_of(kv1, [20, 21, 22])
        want = [sp.page_bytes(ix0, p) for p in (1, 2, 3)]
        assert [sp.page_bytes(ix1, p) for p in (20, 21, 22)] != want
        assert r1.batch_get_v1(keys[:3], target) == [True] * 3
        assert r1.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys[:3], host_indices=target)]) \
            == {PoolName.INDEXER: [True] * 3}
        assert [sp.page_bytes(ix1, p) for p in (20, 21, 22)] == want
        assert [sp.page_bytes(kv1, p) for p in (20, 21, 22)] == [sp.page_bytes(kv0, p) for p in (1, 2, 3)]
    finally:
        _stop(indexer_d)


def test_a_draft_pool_added_after_the_attach_is_paged_on_the_kv_pages(daemon, attached, caplog):
    """An EAGLE-style draft: SGLang adds its KV pool after the attach (a dynamic sidecar), on the
    KV pool's host indices, needed for every page. It is attached then; a prefix is cut where
    the draft's pages end, and another instance loads them byte for byte. A pool kvcached does
    not page, added so, is logged and its pages miss."""
    draft_d = _side_daemon(daemon, "draft")
    try:
        extra = sp.extra_config(daemon.instance, daemon.run_dir)
        pools = [(sp.make_pool("mha", "page_first"), sp.make_pool("mha", "layer_first")) for _ in range(2)]
        for i, (kv, draft) in enumerate(pools):
            sp.fill_random(kv, 80 + i)
            sp.fill_random(draft, 90 + i)
        backends = []
        for kv, draft in pools:
            b = _attach(attached, kv, {}, extra)
            b.register_mem_host_pool_v2(draft, PoolName.DRAFT)
            backends.append(b)
        (a, (a_kv, a_draft)), (b, (b_kv, b_draft)) = zip(backends, pools)
        keys = sp.page_hashes(4, seed=81)
        assert a.batch_set_v1(keys, sp.pages_of(a_kv, range(1, 5))) == [True] * 4
        assert a.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, keys=keys[:2],
                                            host_indices=sp.pages_of(a_kv, [1, 2]))]) == {PoolName.DRAFT: [True] * 2}
        query = [PoolTransfer(name=PoolName.DRAFT, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
        assert b.batch_exists_v2(keys, query).restorable_prefix_pages == [1, 2]
        target = sp.pages_of(b_kv, [30, 31])
        want = [sp.page_bytes(a_draft, p) for p in (1, 2)]
        assert [sp.page_bytes(b_draft, p) for p in (30, 31)] != want
        assert b.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, keys=keys[:2], host_indices=target)]) \
            == {PoolName.DRAFT: [True, True]}
        assert [sp.page_bytes(b_draft, p) for p in (30, 31)] == want
        b.register_mem_host_pool_v2(sp.make_pool("mha", "page_first"), PoolName.DRAFT_SWA)
        assert "draft_swa" in caplog.text
        assert b.batch_get_v2([PoolTransfer(name=PoolName.DRAFT_SWA, keys=keys[:1], host_indices=target[:16])]) \
            == {PoolName.DRAFT_SWA: [False]}
        b.register_mem_host_pool_v2(sp.mamba_pool(side_state=True), PoolName.MAMBA)  # no raise
        assert "mamba" not in b.sides and "mamba host pool cannot be paged" in caplog.text
        b.close()  # SGLang's detach: a pool added after it is not attached (nothing to leak)
        b.register_mem_host_pool_v2(sp.make_pool("mha", "page_first"), PoolName.SWA)
        assert "swa" not in b.sides
    finally:
        _stop(draft_d)


def test_side_pools_kvcached_cannot_page_fail_the_attach(run_dir):
    """A DeepSeek V4 pool is not served, and a side pool on the KV pool's own daemon would void
    its pages: both fail SGLang's attach saying why; before an attach the v2 calls miss."""
    from kvcached_client.sglang.config import ConfigError

    kv, mamba, _ = _pools(31)
    extra = sp.extra_config("x", run_dir)
    with pytest.raises(ConfigError, match="deepseek_v4_c4 host pools"):
        sp.attach_hybrid(kv, {"deepseek_v4_c4": sp.make_pool("mha", "page_first")}, extra)
    with pytest.raises(ConfigError, match="daemon of its own"):
        sp.attach_hybrid(kv, {"mamba": mamba}, sp.extra_config("x", run_dir, pool_instances={"mamba": "x"}))
    with pytest.raises(ConfigError, match="pool_instances"):
        sp.attach_hybrid(kv, {"mamba": mamba}, sp.extra_config("x", run_dir, pool_instances=["m"]))
    with pytest.raises(ConfigError, match="mamba host pool cannot be paged by kvcached: NotImplementedError"):
        sp.attach_hybrid(kv, {"mamba": sp.mamba_pool(side_state=True)}, extra)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", sp.storage_config(extra), kv)
    transfer = PoolTransfer(name=PoolName.MAMBA, keys=["a", "b"])
    assert backend.batch_get_v2([transfer]) == {PoolName.MAMBA: [False, False]}
    assert backend.batch_exists_v2(["a"], [transfer]).kv_hit_pages == 0


def test_mamba_states_are_keyed_by_rank_even_where_mla_kv_is_shared(daemon, attached):
    """MLA KV is the same on every rank, so its keys name none; SGLang shards Mamba states across
    ranks and backs them up on each: rank 1 never loads rank 0's state, and reads its own."""
    mamba_d = _side_daemon(daemon, "mamba")
    try:
        extra = sp.extra_config(daemon.instance, daemon.run_dir)
        ranks = []
        for r in range(2):
            kv, mamba = sp.make_pool("mla", "page_first"), sp.mamba_pool()
            sp.fill_random(kv, 40 + r)
            sp.fill_mamba(mamba, 50 + r)
            ranks.append((_attach(attached, kv, {"mamba": mamba}, extra, mla=True, tp_rank=r, tp_size=2), kv, mamba))
        keys = sp.page_hashes(2, seed=41)
        (r0, kv0, m0), (r1, kv1, m1) = ranks
        assert r0.batch_set_v1(keys, sp.pages_of(kv0, [1, 2])) == [True, True]
        state = [PoolTransfer(name=PoolName.MAMBA, keys=keys[1:], host_indices=sp.pages_of(m0, [5]))]
        assert r0.batch_set_v2(state) == {PoolName.MAMBA: [True]}
        query = [PoolTransfer(name=PoolName.MAMBA, keys=keys[1:], hit_policy=TRAILING)]
        assert r0.batch_exists_v2(keys, query).kv_hit_pages == 2
        assert r1.batch_exists(keys) == 2  # the shared MLA pages
        assert r1.batch_exists_v2(keys, query).kv_hit_pages == 0  # not rank 0's state
        own = [PoolTransfer(name=PoolName.MAMBA, keys=keys[1:], host_indices=sp.pages_of(m1, [6]))]
        assert r1.batch_set_v2(own) == {PoolName.MAMBA: [True]}
        want = sp.page_bytes(m1, 6)
        assert r1.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[1:], host_indices=sp.pages_of(m1, [9]))]) \
            == {PoolName.MAMBA: [True]}
        assert sp.page_bytes(m1, 9) == want != sp.page_bytes(m0, 5)
    finally:
        _stop(mamba_d)
