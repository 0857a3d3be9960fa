"""kvcached as SGLang HiCache's storage backend, with SGLang's own pieces: its host pools (MHA and
MLA in layer_first, page_first and page_first_direct, made by its shm allocator), its backend
factory building the backend from the extra-config, its failure injector, and real daemons.
Pages come back byte for byte into another SGLang instance's pool (through one daemon, and
through the disk tier across a daemon restart); a killed daemon costs misses, never an exception
or a wrong page. Runs in .venv-sglang (./scripts/test.sh --with-sglang)."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

pytest.importorskip("sglang", reason="SGLang is installed in .venv-sglang: ./scripts/test.sh --with-sglang")
pytestmark = pytest.mark.timeout(300)

import sglang_pools as sp  # noqa: E402
from conftest import disk_uri, sweep_crashed, unique_instance, wait_until  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402

from kvcached_client import launch  # noqa: E402
from kvcached.bench import process_stop  # noqa: E402

KINDS = ("mha", "mla")


def _snapshot(pool, pages) -> list[bytes]:
    return [sp.page_bytes(pool, p) for p in pages]


@pytest.mark.parametrize("kind,layout", [(k, lay) for k in KINDS for lay in sp.LAYOUTS]
                         + [("mha", "page_head")])  # SGLang's MLA pool has no page_head
def test_pages_round_trip_into_another_instances_pool(daemon, kind, layout):
    """SGLang A backs pages up and detaches; SGLang B (its own pool, its own memfds) attaches to
    the same daemon and loads them into other pages, byte for byte; B's other pages and the page
    of a key nobody stored are untouched."""
    mla = kind == "mla"
    a, b = sp.make_pool(kind, layout), sp.make_pool(kind, layout)
    sp.fill_random(a, 1)
    sp.fill_random(b, 2)
    keys = sp.page_hashes(5, seed=3)
    extra = sp.extra_config(daemon.instance, daemon.run_dir)
    backend = sp.attach(a, extra, mla=mla)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, sp.pages_of(a, [3, 4, 5, 6, 7])) == [True] * 5
    assert backend.batch_exists(keys) == 5
    want = _snapshot(a, [3, 4, 5, 6, 7])
    assert "sglang_host_pool" in open(f"/proc/{daemon.pid}/maps").read()  # the daemon maps the pool
    metrics = backend.get_stats()  # SGLang's storage metrics (enable_storage_metrics)
    assert metrics.backup_pgs == [5] and metrics.backup_bandwidth[0] > 0
    backend.close()
    assert not daemon.connect().status()["kv"]["registered"]  # detached: the pool is let go
    wait_until(lambda: "sglang_host_pool" not in open(f"/proc/{daemon.pid}/maps").read(),
               what="the daemon's mapping of SGLang's memfd gone")

    reader = sp.attach(b, extra, mla=mla)
    before = _snapshot(b, [1, 2, 20])
    assert want[0] != sp.page_bytes(b, 10)  # the control: the target page holds other bytes
    missing = sp.page_hashes(1, seed=99)
    got = reader.batch_get_v1(keys + missing, sp.pages_of(b, [10, 11, 12, 13, 14, 20]))
    assert got == [True] * 5 + [False]
    assert _snapshot(b, [10, 11, 12, 13, 14]) == want
    assert _snapshot(b, [1, 2, 20]) == before
    assert reader.stats["got_pages"] == 5
    reader.close()


def test_two_instances_attached_at_once_share_pages_through_one_daemon(daemon):
    """Two SGLang servers of one model on one host, both attached: what each backs up the other
    loads byte for byte into its own pool; one detaching costs the other nothing."""
    a, b = sp.make_pool("mha", "page_first"), sp.make_pool("mha", "page_first")
    sp.fill_random(a, 21)
    sp.fill_random(b, 22)
    extra = sp.extra_config(daemon.instance, daemon.run_dir)
    ba, bb = sp.attach(a, extra), sp.attach(b, extra)
    assert daemon.connect().status()["kv"]["engines"] == 2
    ka, kb = sp.page_hashes(3, seed=23), sp.page_hashes(3, seed=24)
    assert ba.batch_set_v1(ka, sp.pages_of(a, [1, 2, 3])) == [True] * 3
    assert bb.batch_set_v1(kb, sp.pages_of(b, [4, 5, 6])) == [True] * 3
    a_pages, b_pages = _snapshot(a, [1, 2, 3]), _snapshot(b, [4, 5, 6])
    assert bb.batch_get_v1(ka, sp.pages_of(b, [10, 11, 12])) == [True] * 3
    assert ba.batch_get_v1(kb, sp.pages_of(a, [10, 11, 12])) == [True] * 3
    assert _snapshot(b, [10, 11, 12]) == a_pages and _snapshot(a, [10, 11, 12]) == b_pages
    ba.close()
    assert bb.batch_get_v1(ka, sp.pages_of(b, [20, 21, 22])) == [True] * 3
    assert _snapshot(b, [20, 21, 22]) == a_pages
    bb.close()


def test_mla_ranks_share_one_daemon_and_one_writer(daemon):
    """MLA: every rank holds the same latent, SGLang backs up from the writer rank only (the
    others skip backups): the other rank, on the same daemon, loads what rank 0 stored."""
    pools = [sp.make_pool("mla", "page_first") for _ in range(2)]
    sp.fill_random(pools[0], 25)
    sp.fill_random(pools[1], 26)
    extra = sp.extra_config(daemon.instance, daemon.run_dir)
    ranks = [sp.attach(p, extra, mla=True, tp_rank=r, tp_size=2) for r, p in enumerate(pools)]
    assert [b.config.is_storage_writer for b in ranks] == [True, False]
    keys = sp.page_hashes(4, seed=27)
    assert ranks[0].batch_set_v1(keys, sp.pages_of(pools[0], [1, 2, 3, 4])) == [True] * 4
    assert ranks[1].batch_exists(keys) == 4
    assert ranks[1].batch_get_v1(keys, sp.pages_of(pools[1], [9, 10, 11, 12])) == [True] * 4
    assert _snapshot(pools[1], [9, 10, 11, 12]) == _snapshot(pools[0], [1, 2, 3, 4])
    for b in ranks:
        b.close()


def test_sglangs_storage_flush_clears_the_daemons_tiers(daemon):
    pool = sp.make_pool("mha", "page_first")
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    keys = sp.page_hashes(3, seed=41)
    assert backend.batch_set_v1(keys, sp.pages_of(pool, [1, 2, 3])) == [True] * 3
    assert backend.batch_exists(keys) == 3
    backend.clear()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, sp.pages_of(pool, [5, 6, 7])) == [False] * 3
    backend.close()


def test_config_values_that_are_no_numbers_fail_the_attach(run_dir, caplog):
    extra = sp.extra_config("x", run_dir, timeout_s="soon")
    with pytest.raises(ValueError, match="timeout_s"):
        sp.attach(sp.make_pool("mha", "page_first"), extra)
    # a misspelt key is named (SGLang's own keys of its extra-config are not)
    extra = sp.extra_config("x", run_dir, namespce="tenant-a", prefetch_threshold=256, timeout_s="soon")
    with pytest.raises(ValueError):
        sp.attach(sp.make_pool("mha", "page_first"), extra)
    said = [r.getMessage() for r in caplog.records if "not read by kvcached" in r.getMessage()]
    assert said == ["[sglang] extra-config key 'namespce' is not read by kvcached; did you mean "
                    "'namespace'?"]


def test_batch_exists_counts_leading_pages_with_prefix_keys(daemon):
    pool = sp.make_pool("mha", "page_first")
    sp.fill_random(pool, 4)
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    keys = sp.page_hashes(6, seed=5)
    assert backend.batch_set_v1(keys[:4], sp.pages_of(pool, [1, 2, 3, 4])) == [True] * 4
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:2])
    assert backend.batch_exists(keys[2:], info) == 2  # keys 2, 3 present; 4, 5 not
    assert backend.batch_set_v1([keys[5]], sp.pages_of(pool, [6])) == [True]
    assert backend.batch_exists(keys) == 4  # a gap at key 4 ends the run
    assert backend.exists(keys[5]) and not backend.exists(keys[4])
    backend.close()


def test_a_backup_with_prefix_keys_names_the_page_before_it(daemon, monkeypatch):
    """SGLang passes prefix_keys (hicache_storage_pass_prefix_keys): the backend tells the daemon
    the page before the batch as its parent, under the daemon's key of it, so the daemon's tiers
    keep the sequence's head before its tail (test_offload_parent.py); with none, no parent."""
    from kvcached_client.client import Client

    told = []
    offload = Client.offload

    def spy(self, blocks, keys, *args, parent=None, **kw):  # the real offload, its parent noted
        told.append(parent)
        return offload(self, blocks, keys, *args, parent=parent, **kw)

    monkeypatch.setattr(Client, "offload", spy)
    pool = sp.make_pool("mha", "page_first")
    sp.fill_random(pool, 6)
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    keys = sp.page_hashes(4, seed=9)
    assert backend.batch_set_v1(keys[:2], sp.pages_of(pool, [1, 2])) == [True] * 2
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:2])
    assert backend.batch_set_v1(keys[2:], sp.pages_of(pool, [3, 4]), info) == [True] * 2
    assert told == [None, backend.kv.keys([keys[1]])[0]]
    assert backend.batch_exists(keys) == 4
    backend.close()


@pytest.mark.slow
def test_pages_survive_a_daemon_restart_through_the_disk_tier(run_dir, tmp_path):
    instance = unique_instance("sg")
    storage = disk_uri(str(tmp_path / "disk"))
    keys = sp.page_hashes(8, seed=6)
    a = sp.make_pool("mha", "layer_first")
    sp.fill_random(a, 7)
    extra = sp.extra_config(instance, run_dir)
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=["--storage", storage]):
        backend = sp.attach(a, extra)
        assert backend.batch_set_v1(keys, sp.pages_of(a, range(2, 10))) == [True] * 8
        backend.close()
    want = _snapshot(a, range(2, 10))
    b = sp.make_pool("mha", "layer_first")
    sp.fill_random(b, 8)
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=["--storage", storage],
                wait_storage=True):
        reader = sp.attach(b, extra)
        assert reader.batch_exists(keys) == 8  # from the disk tier: the host tier is new
        assert reader.batch_get_v1(keys, sp.pages_of(b, range(20, 28))) == [True] * 8
        assert _snapshot(b, range(20, 28)) == want
        reader.close()
    sweep_crashed(instance)


def test_a_storage_flush_with_no_daemon_keys_pages_anew(run_dir, tmp_path):
    """SGLang flushes its storage while the daemon is gone: nothing can be cleared, so the
    backend keys pages anew, and the pages the restarted daemon finds on disk (still there: the
    control) are no hit."""
    instance = unique_instance("sg")
    args = dict(instance=instance, run_dir=run_dir, host_cache_gb=0.05, wait_storage=True,
                extra_args=["--storage", disk_uri(str(tmp_path / "disk"))])
    keys = sp.page_hashes(4, seed=9)
    pool = sp.make_pool("mha", "page_first")
    sp.fill_random(pool, 9)
    extra = sp.extra_config(instance, run_dir)
    with launch(**args):
        backend = sp.attach(pool, extra)
        assert backend.batch_set_v1(keys, sp.pages_of(pool, [1, 2, 3, 4])) == [True] * 4
    sweep_crashed(instance)
    backend.clear()
    control = sp.attach(sp.make_pool("mha", "page_first"), extra)  # keys as they were
    try:
        with launch(**args):
            wait_until(lambda: control.batch_exists(keys) == 4, 10, "the pages found on disk")
            fresh = sp.page_hashes(1, seed=10)
            wait_until(lambda: backend.batch_set_v1(fresh, sp.pages_of(pool, [5])) == [True], 10,
                       "the backend attached again")
            assert backend.batch_exists(fresh) == 1 and backend.batch_exists(keys) == 0
    finally:
        backend.close()
        control.close()
    sweep_crashed(instance)


@pytest.mark.faults
def test_sglangs_failure_injector_costs_misses_never_wrong_pages(daemon, monkeypatch):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    pool = sp.make_pool("mha", "page_first")
    sp.fill_random(pool, 9)
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    assert isinstance(backend, HiCacheStorageFailureInjector)
    stored: dict[str, bytes] = {}
    misses = 0
    for r in range(30):
        keys = sp.page_hashes(4, seed=100 + r)
        src = [1 + (r % 8) * 4 + i for i in range(4)]
        for key, ok, page in zip(keys, backend.batch_set_v1(keys, sp.pages_of(pool, src)), src):
            if ok:
                stored[key] = sp.page_bytes(pool, page)
        dst = [40 + i for i in range(4)]
        for key, ok, page in zip(keys, backend.batch_get_v1(keys, sp.pages_of(pool, dst)), dst):
            misses += not ok
            if ok:
                assert key in stored and sp.page_bytes(pool, page) == stored[key]
    assert stored and misses  # both happened: the injector ran, and pages came through
    backend.close()


@pytest.mark.faults
def test_a_daemon_killed_mid_batch_costs_misses_then_a_new_one_is_attached(run_dir):
    """Loads run back to back while the daemon is SIGKILLed: every call returns (no exception,
    no hang), every page reported loaded is exact, pages never named are untouched; a daemon
    started again under the instance is attached in the background and serves again."""
    instance = unique_instance("sg")
    pool = sp.make_pool("mha", "page_first", device_tokens=2048)
    sp.fill_random(pool, 10)
    keys = sp.page_hashes(64, seed=11)
    src = list(range(1, 65))
    dst = list(range(100, 164))
    bystanders = [70, 71, 99, 200]
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.1)
    backend = sp.attach(pool, sp.extra_config(instance, run_dir, timeout_s=2.0))
    assert backend.batch_set_v1(keys, sp.pages_of(pool, src)) == [True] * 64
    want, untouched = _snapshot(pool, src), _snapshot(pool, bystanders)
    killer = threading.Timer(0.3, lambda: os.kill(d.pid, signal.SIGKILL))
    killer.start()
    results, deadline = [], time.monotonic() + 3.0
    while time.monotonic() < deadline:
        start = time.monotonic()
        got = backend.batch_get_v1(keys, sp.pages_of(pool, dst))
        assert time.monotonic() - start < 4.0
        results.append(got)
        for ok, page, w in zip(got, dst, want):
            assert not ok or sp.page_bytes(pool, page) == w
    killer.join()
    d.proc.wait(5)
    assert any(all(r) for r in results) and not any(results[-1])  # served, then misses
    assert _snapshot(pool, bystanders) == untouched
    sweep_crashed(instance)
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.1):
        wait_until(lambda: backend.batch_set_v1(keys[:2], sp.pages_of(pool, src[:2])) == [True] * 2,
                   what="the backend attached to the new daemon")
        assert backend.batch_get_v1(keys[:2], sp.pages_of(pool, dst[:2])) == [True] * 2
        assert _snapshot(pool, dst[:2]) == want[:2]
        backend.close()
    sweep_crashed(instance)


def test_no_daemon_at_attach_is_misses_until_one_comes(run_dir):
    instance = unique_instance("sg")
    pool = sp.make_pool("mla", "page_first")
    sp.fill_random(pool, 12)
    backend = sp.attach(pool, sp.extra_config(instance, run_dir), mla=True)
    keys = sp.page_hashes(2, seed=13)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, sp.pages_of(pool, [1, 2])) == [False, False]
    assert backend.stats["no_daemon"] >= 2
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05):
        wait_until(lambda: backend.batch_set_v1(keys, sp.pages_of(pool, [1, 2])) == [True] * 2,
                   what="the backend attached in the background")
        assert backend.batch_exists(keys) == 2
        backend.close()
    sweep_crashed(instance)


@pytest.mark.parametrize("drop, key", [("interface_v1", "interface_v1"), ("allocator", "allocator")])
def test_an_extra_config_that_cannot_work_fails_the_attach_naming_the_key(run_dir, drop, key):
    extra = sp.extra_config("x", run_dir)
    del extra[drop]
    with pytest.raises(ValueError, match=key):
        sp.attach(sp.make_pool("mha", "page_first"), extra)


def test_a_pool_not_made_by_the_shm_allocator_fails_the_attach(run_dir):
    pool = sp.make_pool("mha", "page_first", allocator="default")
    with pytest.raises(ValueError, match='"allocator": "shm"'):
        sp.attach(pool, sp.extra_config("x", run_dir))


def test_tensor_parallel_ranks_name_their_daemons_and_keys(run_dir):
    from kvcached_client.sglang.config import ConfigError, PageKeys, Settings

    extra = sp.extra_config("sglang{rank}", run_dir)
    cfgs = [sp.storage_config(extra, tp_rank=r, tp_size=2) for r in range(2)]
    assert [Settings.of(c).instance for c in cfgs] == ["sglang0", "sglang1"]
    keys = [PageKeys(c, Settings.of(c), "L")(["abc"]) for c in cfgs]
    assert keys[0] != keys[1]  # MHA: each rank holds its shard of the heads
    mla = [sp.storage_config(extra, mla=True, tp_rank=r, tp_size=2) for r in range(2)]
    assert PageKeys(mla[0], Settings.of(mla[0]), "L")(["abc"]) == PageKeys(mla[1], Settings.of(mla[1]), "L")(["abc"])
    with pytest.raises(ConfigError, match="instances"):
        Settings.of(sp.storage_config(dict(extra, instances=["a"]), tp_rank=0, tp_size=2))
    other_tenant = sp.storage_config(dict(extra, namespace="tenant-b"), tp_rank=0, tp_size=2)
    assert PageKeys(other_tenant, Settings.of(other_tenant), "L")(["abc"]) != keys[0]


def test_backup_and_prefetch_threads_at_once_stay_exact(daemon):
    """SGLang calls batch_set_v1 (its backup thread) and batch_get_v1 (its prefetch thread) at
    the same time on one backend."""
    pool = sp.make_pool("mha", "layer_first", device_tokens=2048)
    sp.fill_random(pool, 14)
    backend = sp.attach(pool, sp.extra_config(daemon.instance, daemon.run_dir))
    base = sp.page_hashes(16, seed=15)
    assert backend.batch_set_v1(base, sp.pages_of(pool, range(1, 17))) == [True] * 16
    want = _snapshot(pool, range(1, 17))
    errors = []

    def backups():
        for r in range(20):
            keys = sp.page_hashes(8, seed=200 + r)
            if backend.batch_set_v1(keys, sp.pages_of(pool, range(30, 38))) != [True] * 8:
                errors.append("a backup failed")

    def prefetches(first):
        for _ in range(20):
            dst = range(first, first + 16)
            if backend.batch_get_v1(base, sp.pages_of(pool, dst)) != [True] * 16:
                errors.append("a prefetch missed")
            elif _snapshot(pool, dst) != want:
                errors.append("a prefetch brought other bytes")

    threads = [threading.Thread(target=backups), threading.Thread(target=prefetches, args=(50,)),
               threading.Thread(target=prefetches, args=(70,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    backend.close()


def test_a_non_writer_mla_rank_stores_nothing_and_says_done(daemon):
    pool = sp.make_pool("mla", "page_first")
    extra = sp.extra_config(daemon.instance, daemon.run_dir)
    rank1 = sp.attach(pool, extra, mla=True, tp_rank=1, tp_size=2)
    keys = sp.page_hashes(2, seed=31)
    assert rank1.batch_set_v1(keys, sp.pages_of(pool, [1, 2])) == [True, True]
    assert rank1.batch_exists(keys) == 0 and rank1.stats["set_pages"] == 0
    metrics = rank1.get_stats()
    assert metrics is not None and metrics.backup_pgs == []
    rank1.close()


@contextlib.contextmanager
def _stored_pages(run_dir, n: int, seed: int, timeout_s: float):
    """A daemon and an attached backend that stored n pages (1..n) of a random pool; yields
    (daemon, pool, backend, keys, target pages 100.., the stored pages' bytes). The daemon is
    sent SIGCONT at the end whatever the test left it in."""
    instance = unique_instance("sg")
    pool = sp.make_pool("mha", "page_first", device_tokens=2048)
    sp.fill_random(pool, seed)
    keys = sp.page_hashes(n, seed=seed + 1)
    src, dst = list(range(1, n + 1)), list(range(100, 100 + n))
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.1)
    backend = None
    try:
        backend = sp.attach(pool, sp.extra_config(instance, run_dir, timeout_s=timeout_s))
        assert backend.batch_set_v1(keys, sp.pages_of(pool, src)) == [True] * n
        yield d, pool, backend, keys, dst, _snapshot(pool, src)
    finally:
        process_stop.go_on(d.pid)  # (harmless on a running one)
        if backend is not None:
            backend.close()
        d.stop()
        sweep_crashed(instance)


def _get_in_thread(backend, pool, keys, dst):
    """batch_get_v1 on a thread of its own (as SGLang's prefetch thread calls it): (thread, result)."""
    result = {}
    caller = threading.Thread(target=lambda: result.update(
        got=backend.batch_get_v1(keys, sp.pages_of(pool, dst))))
    caller.start()
    return caller, result


def test_a_load_the_daemon_froze_under_is_waited_for_until_it_ends(run_dir, monkeypatch):
    """The daemon is SIGSTOPped with a load queued: the load's wait runs out and its cancel is
    not answered, so the daemon may still write the pages when it wakes. batch_get_v1 returns
    only once the daemon ended the load, well past RELEASE_SAY_S (it returned after a 30 s cap
    before, and SGLang could reuse pages a late copy then landed in); the pages it reports
    loaded are exact."""
    from kvcached_client.sglang import pool_channel as sglang_storage

    monkeypatch.setattr(sglang_storage, "RELEASE_SAY_S", 0.3)
    with _stored_pages(run_dir, 16, 12, timeout_s=0.5) as (d, pool, backend, keys, dst, want):
        with d.connect(role="operator") as owner:
            owner.pause()  # the load stays queued
            caller, result = _get_in_thread(backend, pool, keys, dst)
            wait_until(lambda: owner.status()["tasks"]["queued"] >= 1, 5, "the load queued")
            process_stop.stop(d.pid)
            caller.join(2.0)
            assert caller.is_alive(), "batch_get_v1 returned while the daemon could still copy"
            process_stop.go_on(d.pid)
            owner.resume()
            caller.join(10)
            assert not caller.is_alive()
        for ok, page, w in zip(result["got"], dst, want):
            assert not ok or sp.page_bytes(pool, page) == w


def test_a_load_whose_wait_finds_the_daemon_hung_is_waited_for_until_it_ends(run_dir, monkeypatch):
    """The daemon is SIGSTOPped with a load queued, its hang threshold (0.5 s) shorter than the
    calls' timeout: the load's wait sees the daemon hung (DaemonUnavailable, not a timeout), and
    a daemon that wakes still runs the load. batch_get_v1 returns only once it ended (it
    returned a miss at the hang threshold, and SGLang could reuse pages the late copy then
    landed in: found by test_sglang_random's freezes case)."""
    monkeypatch.setenv("KVCACHED_HANG_S", "0.5")
    with _stored_pages(run_dir, 16, 15, timeout_s=5) as (d, pool, backend, keys, dst, want):
        with d.connect(role="operator", timeout=10) as owner:
            owner.pause()  # the load stays queued
            caller, result = _get_in_thread(backend, pool, keys, dst)
            wait_until(lambda: owner.status()["tasks"]["queued"] >= 1, 5, "the load queued")
            process_stop.stop(d.pid)
            caller.join(2.0)  # four hang thresholds
            assert caller.is_alive(), "batch_get_v1 returned while the daemon could still copy"
            process_stop.go_on(d.pid)
            owner.resume()
            caller.join(10)
            assert not caller.is_alive()
        assert result["got"] == [False] * 16  # a miss as far as SGLang knows
        assert [sp.page_bytes(pool, p) for p in dst] == want  # the late copy landed before return


def test_a_load_sent_to_a_frozen_daemon_is_waited_for_until_the_daemon_ends_it(run_dir, monkeypatch):
    """The daemon is SIGSTOPped before the load request reaches it: the request gets no reply,
    yet the daemon reads it when it wakes and copies into the pages. batch_get_v1 returns only
    once that late load ended (it returned at the hang threshold, and SGLang could reuse pages
    the late copy then landed in)."""
    monkeypatch.setenv("KVCACHED_HANG_S", "0.5")
    with _stored_pages(run_dir, 8, 14, timeout_s=5) as (d, pool, backend, keys, dst, want):
        process_stop.stop(d.pid)
        caller, result = _get_in_thread(backend, pool, keys, dst)
        caller.join(2.0)  # four hang thresholds
        assert caller.is_alive(), "batch_get_v1 returned while the daemon could still take the load"
        process_stop.go_on(d.pid)
        caller.join(10)
        assert not caller.is_alive()
        assert result["got"] == [False] * 8  # not loaded as far as SGLang knows
        # the daemon did take it late (the test is not vacuous): the copy landed before return
        assert [sp.page_bytes(pool, p) for p in dst] == want


def test_a_load_waiting_on_a_frozen_daemon_ends_once_it_wakes_though_another_call_dropped_it(
        run_dir, monkeypatch):
    """SGLang's prefetch thread waits for a load the frozen daemon never answered while its
    backup thread's call finds the daemon hung and drops the connection. Once the daemon wakes
    and ends the load, the prefetch returns: the dropped client stays open while a call uses it
    (closed under the wait, the late end could not be read, and the prefetch thread waited
    until the daemon's process ended)."""
    monkeypatch.setenv("KVCACHED_HANG_S", "0.5")
    with _stored_pages(run_dir, 8, 16, timeout_s=5) as (d, pool, backend, keys, dst, want):
        process_stop.stop(d.pid)
        caller, result = _get_in_thread(backend, pool, keys, dst)
        time.sleep(1.0)  # the load sent, unanswered past the hang threshold
        assert backend.batch_set_v1(keys[:2], sp.pages_of(pool, [1, 2])) == [False] * 2
        assert backend.kv.link.client is None  # dropped
        assert caller.is_alive(), "batch_get_v1 returned while the daemon could still take the load"
        process_stop.go_on(d.pid)
        caller.join(10)
        assert not caller.is_alive(), "the prefetch still waits for a load the daemon ended"
        assert result["got"] == [False] * 8
        assert [sp.page_bytes(pool, p) for p in dst] == want  # the late load did land: not vacuous
