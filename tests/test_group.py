"""GroupClient: tensor-parallel ranks, one real daemon each, answers agreed on the minimum."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import disk_uri, keys_for, no_tasks, ranks, small_kv, sweep_crashed, unique_instance, wait_until

from kvcached_client import Client, GroupClient, PrefixCacheManager, launch
from kvcached_client import rank_keys
from kvcached_client.lookup_gate import LookupGate
from kvcached_proto import KvcachedError, TaskFailed

BS = 16
NBLK = 8


def shards(n, seed=0):
    return [small_kv(num_layers=2, num_blocks=32, block_shape=(BS, 2, 8), seed=seed + r) for r in range(n)]


def same(kv, a, b) -> bool:
    tensors = [t for layer in kv for t in (layer if isinstance(layer, (tuple, list)) else (layer,))]
    return all(torch.equal(t[a], t[b]) for t in tensors)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_lookup_and_load_agree_on_the_shortest_prefix(run_dir, n):
    keys = keys_for(NBLK)
    kv = shards(n)
    with ranks(run_dir, n) as (names, handles), GroupClient.connect(names, run_dir=run_dir) as g:
        g.register_kv_cache(kv)
        assert not g.missing
        g.offload(range(NBLK), keys).wait(10)
        assert g.lookup(keys) == (NBLK, 0)
        with handles[n - 1].connect() as c:  # one rank loses its copy of block 5
            assert c.delete(rank_keys(keys[5:6], n - 1, n)) == 1
        assert g.lookup(keys) == (5, 0)
        task = g.load(keys, range(16, 16 + NBLK))
        assert task.num_blocks == 5
        task.wait_layer(0)
        assert task.valid_blocks == 5
        assert task.wait(10) == 5
        for shard in kv:
            for i in range(5):
                assert same(shard, i, 16 + i), "a rank's bytes differ after the load"


def test_ranks_store_their_shard_under_their_own_keys(run_dir):
    keys = keys_for(2)
    with ranks(run_dir, 2) as (names, handles), GroupClient.connect(names, run_dir=run_dir) as g:
        g.register_kv_cache(shards(2))
        g.offload([0, 1], keys).wait(10)
        with handles[0].connect() as c0:
            assert c0.lookup(rank_keys(keys, 0, 2)) == (2, 0)
            assert c0.lookup(rank_keys(keys, 1, 2)) == (0, 0)
            assert c0.lookup(keys) == (0, 0)


def _mla_kv(seed):
    """An MLA model's KV: the same latent on every rank (one tensor, registered by both)."""
    return [small_kv(num_layers=2, num_blocks=32, block_shape=(BS, 8), kv_pair=False, seed=seed)] * 2


def _mla_ranks(tmp_path):
    """The ranks' daemon flags: one disk directory, rank 0 its writer."""
    storage = disk_uri(str(tmp_path / "shared"), 0.1)
    return lambda rank: ["--storage", storage] + ([] if rank == 0 else ["--no-storage-writer"])


def _offload_flushed(g, kv, keys):
    g.register_kv_cache(kv)
    g.offload(range(len(keys)), keys).wait(10)
    g.flush().wait(10)


@pytest.mark.slow
def test_mla_only_the_writer_rank_puts_to_shared_storage_and_every_rank_reads(run_dir, tmp_path):
    keys, kv, extra = keys_for(NBLK, 1), _mla_kv(3), _mla_ranks(tmp_path)
    with ranks(run_dir, 2, extra) as (names, _), \
            GroupClient.connect(names, run_dir=run_dir, mla=True) as g:
        _offload_flushed(g, kv, keys)
        puts = [s["storage"][0]["puts"] for s in g.status()]
        files = list((tmp_path / "shared").rglob("*.kvb"))
        assert len(files) == NBLK
    assert puts[1] == 0 and puts[0] == NBLK, puts
    with ranks(run_dir, 2, extra) as (names, _), \
            GroupClient.connect(names, run_dir=run_dir, mla=True) as g:  # host tiers empty
        g.register_kv_cache(kv)
        assert g.lookup(keys) == (0, NBLK)
        # 8 blocks x 1 token is under every rank's threshold: each skips, so the group's
        # prefetch has ended at once and the scheduler's gate recomputes without a deferral
        gate = LookupGate(1)
        assert gate.match("r", g, keys) == 0 and gate.pending == 0
        assert gate.counters["storage_blocks_recomputed"] == NBLK
        warm = g.prefetch(keys, block_tokens=64, policy="wait_complete")  # 512 tokens >= 256
        assert warm.wait(10)["prefetched"] == NBLK
        assert g.lookup(keys) == (NBLK, 0)  # every rank's host tier has them now
        assert g.load(keys, range(16, 16 + NBLK)).wait(10) == NBLK
        for i in range(NBLK):
            assert same(kv[0], i, 16 + i)


@pytest.mark.faults
def test_mla_readers_find_what_the_writer_stored_since_they_started_and_remove_nothing(run_dir, tmp_path):
    """An MLA group running: the writer rank stores blocks after every rank started; with the
    host tiers cleared the group finds them on storage and every rank loads them byte-exact,
    the reader from the writer's files. Blocks the writer deletes are not reported by the
    reader; a damaged record is a miss for the reader, which leaves the file to the writer. After
    a weight update's clear the reader serves no file written before it, even one the writer's
    unlinks have not removed yet, and finds what the writer stores after it. Before, a reader's index was what its start listed: the group (the least of its ranks)
    found none of the blocks stored since (0 storage hits)."""
    from kvcached.storage.record import stored_key
    from conftest import geometry_of

    keys, kv = keys_for(NBLK, 2), _mla_kv(5)
    with ranks(run_dir, 2, _mla_ranks(tmp_path)) as (names, _), \
            GroupClient.connect(names, run_dir=run_dir, mla=True) as g:
        _offload_flushed(g, kv, keys)
        g.clear(tier="host")
        assert g.lookup(keys) == (0, NBLK)
        assert g.load(keys, range(16, 16 + NBLK)).wait(10) == NBLK
        assert all(same(kv[0], i, 16 + i) for i in range(NBLK))
        g.clear(tier="host")
        g.clients[0].delete(keys[6:])  # (the writer's own: storage too)
        reader = g.clients[1]
        assert reader.lookup(keys) == (0, 6)
        path = next((tmp_path / "shared").rglob(stored_key(keys[2], geometry_of(kv[0])).hex() + ".kvb"))
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 1)
        assert reader.load(keys[:6], range(16, 22)).wait(10) == 2
        assert path.exists()
        # a weight update's clear; the writer's unlinks lag (a file of before put back): the
        # reader serves nothing written before it, and what the writer stores after it
        first = next((tmp_path / "shared").rglob(stored_key(keys[0], geometry_of(kv[0])).hex() + ".kvb"))
        kept = first.read_bytes()
        mtime = first.stat().st_mtime_ns
        g.clear(weights_update=True)
        assert reader.lookup(keys) == (0, 0)
        wait_until(lambda: not first.exists(), 10, "the writer's unlinks")
        first.write_bytes(kept)
        os.utime(first, ns=(mtime, mtime))
        assert reader.lookup(keys) == (0, 0)
        assert reader.load(keys[:1], [16]).wait(10) == 0
        after = keys_for(2, 3)
        _offload_flushed(g, kv, after)
        g.clear(tier="host")
        assert reader.lookup(after) == (0, 2) and g.load(after, [20, 21]).wait(10) == 2


def test_a_batch_of_loads_agrees_on_each_loads_shortest_prefix(run_dir):
    """GroupClient.load_batch: each load of the batch is the load() of it - the prefix every
    rank holds, bytes exact on every rank - or the error a rank gave it, while the others go;
    what a rank would write past a load's common prefix stays held until its load ends; with
    a rank's daemon gone, every load is of 0 blocks."""
    sets = [keys_for(4, 80 + i) for i in range(3)]
    kv = shards(2, seed=7)
    with ranks(run_dir, 2) as (names, handles), \
            GroupClient.connect(names, run_dir=run_dir, timeout=2.0) as g:
        g.register_kv_cache(kv)
        for i, keys in enumerate(sets):
            g.offload(range(4 * i, 4 * i + 4), keys).wait(10)
        with handles[1].connect() as c:  # rank 1 loses block 2 of the second prefix
            assert c.delete(rank_keys(sets[1][2:3], 1, 2)) == 1
        got = g.load_batch([(sets[0], [16, 17, 18, 19]), (sets[1], [20, 21, 22, 23]),
                            (sets[2], [24, 25, 26, 99])])  # block 99 is past the 32: refused
        assert isinstance(got[2], KvcachedError) and "99" in str(got[2])
        assert [t.num_blocks for t in got[:2]] == [4, 2]
        assert got[0].wait(10) == 4 and got[1].wait(10) == 2
        for shard in kv:
            assert all(same(shard, i, 16 + i) for i in range(4))
            assert all(same(shard, 4 + i, 20 + i) for i in range(2))
        assert not any(same(kv[0], 8 + i, 24 + i) for i in range(3)), "the refused load wrote"
        wait_until(lambda: not g.held_blocks(), 5, "rank 0's blocks past the common prefix freed")
        os.kill(handles[1].proc.pid, signal.SIGKILL)
        handles[1].proc.wait(10)
        got = g.load_batch([(sets[0], [16, 17, 18, 19]), (sets[2], [24, 25, 26, 27])])
        assert [t.num_blocks for t in got] == [0, 0] and [t.wait(2) for t in got] == [0, 0]
        assert list(g.missing) == [1]


def test_a_killed_rank_means_zero_hits_and_is_named_within_the_timeout(run_dir):
    keys = keys_for(4)
    with ranks(run_dir, 2) as (names, handles), \
            GroupClient.connect(names, run_dir=run_dir, timeout=2.0) as g:
        g.register_kv_cache(shards(2))
        g.offload(range(4), keys).wait(10)
        os.kill(handles[1].proc.pid, signal.SIGKILL)
        handles[1].proc.wait(10)
        start = time.monotonic()
        assert g.lookup(keys) == (0, 0)
        task = g.load(keys, range(16, 20))
        assert task.num_blocks == 0 and task.wait(2) == 0
        assert g.prefetch(keys).wait(2)["prefetched"] == 0
        assert time.monotonic() - start < 2.0
        assert list(g.missing) == [1] and "exited" in g.missing[1]
        statuses = g.status()
        assert statuses[0]["instance"] == names[0] and statuses[1]["missing"]


def test_an_offload_whose_rank_died_under_it_is_done_and_its_wait_says_which_rank_failed(run_dir):
    """done() of a group offload (or prefetch) whose rank died with it queued says True, as a
    Client task's does for a failed one; wait() raises TaskFailed naming the rank. Before,
    done() raised TaskFailed too: PrefixCacheManager polls its offloads with done() when it
    takes blocks, and an engine's allocate raised it (found by test_prefix_random's two-rank
    run with a rank killed)."""
    keys = keys_for(4, 61)
    with ranks(run_dir, 2) as (names, handles), \
            GroupClient.connect(names, run_dir=run_dir, timeout=2.0) as g, \
            Client.connect(names[1], run_dir, role="operator") as op:
        g.register_kv_cache(shards(2))
        op.pause()  # rank 1's copy of the offload stays queued
        task = g.offload(range(4), keys)
        os.kill(handles[1].proc.pid, signal.SIGKILL)
        handles[1].proc.wait(10)
        wait_until(lambda: task.done(), 10, "the offload's end on both ranks")
        with pytest.raises(TaskFailed, match=r"failed on ranks \[1\]"):
            task.wait(1)
        assert task.result["failed_ranks"] == [1] and task.result["ranks"][0]["stored"] == 4


def test_a_hung_ranks_offload_is_revoked_when_the_rank_is_dropped(run_dir):
    """Rank 1's daemon hangs (SIGSTOP past the hang threshold) with a group offload queued on
    it; the group drops the rank, the offload fails, and the engine reuses the blocks. When the
    daemon goes on, its copy reads the reused blocks: it must store nothing (the group revoked
    the rank's offload when it dropped the rank). Before, it stored them under the keys: a later
    load on rank 1 got another request's KV."""
    from kvcached.bench import process_stop

    keys = keys_for(4, 62)
    kv = shards(2)
    with ranks(run_dir, 2) as (names, handles), \
            GroupClient.connect(names, run_dir=run_dir, timeout=2.0, hang_s=0.3) as g, \
            Client.connect(names[1], run_dir, role="operator") as op:
        g.register_kv_cache(kv)
        op.pause()  # rank 1's copy of the offload stays queued
        task = g.offload(range(4), keys)
        process_stop.stop(handles[1].pid, "rank 1's daemon")
        try:
            with pytest.raises(TaskFailed, match=r"failed on ranks \[1\]"):
                task.wait(5)
            for layer in kv[1]:  # the engine reuses the blocks: another request's KV
                for t in layer:
                    t[:4] = 7
        finally:
            process_stop.go_on(handles[1].pid, "rank 1's daemon")
        op.resume()
        with Client.connect(names[1], run_dir) as later:
            wait_until(lambda: no_tasks(later), 10, "rank 1's offload ended")
            assert later.lookup(rank_keys(keys, 1, 2)) == (0, 0)  # nothing of it stored


def test_a_hung_ranks_load_keeps_its_blocks_held_from_the_drop_until_its_end(run_dir):
    """A group load queued on rank 1 when its daemon hangs; the rank is dropped by another call
    (a lookup) before anyone waits for the load. Its blocks are held from the drop on - the
    lost client is not closed, whoever asks for held blocks - until the daemon, going on,
    ends the load. Before, held_blocks() closed the lost client at once (it held nothing yet)
    and the load's wait could hold nothing: the engine could reuse blocks the daemon wrote."""
    from kvcached.bench import process_stop

    keys = keys_for(4, 63)
    with ranks(run_dir, 2) as (names, handles), \
            GroupClient.connect(names, run_dir=run_dir, timeout=2.0, hang_s=0.3) as g, \
            Client.connect(names[1], run_dir, role="operator") as op:
        g.register_kv_cache(shards(2))
        g.offload(range(4), keys).wait(10)
        op.pause()  # rank 1's copy of the load stays queued
        task = g.load(keys, range(16, 20))
        process_stop.stop(handles[1].pid, "rank 1's daemon")
        try:
            time.sleep(0.4)
            assert g.lookup(keys) == (0, 0) and list(g.missing) == [1]  # dropped here
            assert g.held_blocks() >= {16, 17, 18, 19}
            assert task.wait(1) == 0
            assert g.held_blocks() >= {16, 17, 18, 19}
        finally:
            process_stop.go_on(handles[1].pid, "rank 1's daemon")
        op.resume()
        wait_until(lambda: not g.held_blocks(), 10, "the hold lifting at the load's end")
        assert not g.retiring  # the lost client closed once it held nothing


def test_an_offload_one_rank_refuses_is_revoked_on_the_others(run_dir):
    """Rank 1 refuses an offload (BUSY: its queue is full) that rank 0 took: the group raises
    the error, so the engine takes the blocks back - and rank 0's copy, still queued, must
    store nothing (revoked). Before, rank 0 stored the blocks the engine had reused since under
    the offload's keys: another request's KV on rank 0's next load (a load refused by a rank
    already had its other ranks' blocks held)."""
    keys_a, keys_b = keys_for(4, 64), keys_for(4, 65)
    kv = shards(2)
    extra = lambda r: ["--max-queued-tasks", "1"] if r == 1 else []  # noqa: E731
    with ranks(run_dir, 2, extra) as (names, _), \
            GroupClient.connect(names, run_dir=run_dir, timeout=2.0) as g, \
            Client.connect(names[0], run_dir, role="operator") as op0, \
            Client.connect(names[1], run_dir, role="operator") as op1:
        g.register_kv_cache(kv)
        op0.pause()
        op1.pause()
        first = g.offload(range(4), keys_a)  # queued on both ranks: rank 1's queue is full
        with pytest.raises(KvcachedError, match="BUSY"):
            g.offload(range(4, 8), keys_b)
        for layer in kv[0]:  # the engine reuses the blocks: another request's KV
            for t in layer:
                t[4:8] = 7
        op0.resume()
        op1.resume()
        first.wait(10)
        g.flush().wait(10)  # (each rank's queue worked through)
        assert g.clients[0].lookup(rank_keys(keys_b, 0, 2)) == (0, 0)  # nothing of it stored
        # (a revoke also drops that rank's earlier offloads not yet done: rank 0's first, a lost
        # hit; rank 1's stays)
        assert g.clients[1].lookup(rank_keys(keys_a, 1, 2)) == (4, 0)


def test_a_rank_that_hung_is_attached_again_by_the_groups_own_calls(run_dir):
    """An engine that drives a GroupClient itself (no PrefixCacheManager, no held_blocks()
    calls): rank 1's daemon hangs past the threshold and goes on; the group's lookups attach it
    again. Before, its lost client stayed open with its KV registered and every reattach was
    refused (KV_IN_USE): lookups said (0, 0) for good."""
    from kvcached.bench import process_stop

    keys = keys_for(4, 66)
    with ranks(run_dir, 2) as (names, handles), \
            GroupClient.connect(names, run_dir=run_dir, timeout=2.0, hang_s=0.3) as g:
        g.register_kv_cache(shards(2))
        g.offload(range(4), keys).wait(10)
        process_stop.stop(handles[1].pid, "rank 1's daemon")
        try:
            time.sleep(0.4)
            assert g.lookup(keys) == (0, 0) and list(g.missing) == [1]
        finally:
            process_stop.go_on(handles[1].pid, "rank 1's daemon")
        wait_until(lambda: g.lookup(keys) == (4, 0), 10, "rank 1 attached again")
        assert not g.missing


def test_a_missing_rank_at_start_is_reconnected_when_its_daemon_comes(run_dir):
    names = [unique_instance("r0-"), unique_instance("r1-")]
    with launch(instance=names[0], run_dir=run_dir, host_cache_gb=0.05) as h0:
        g = GroupClient.connect(names, run_dir=run_dir)
        try:
            assert list(g.missing) == [1] and g.lookup(keys_for(2)) == (0, 0)
            g.register_kv_cache(shards(2))
            with pytest.raises(KvcachedError, match=r"ranks \[1\]"):  # its tiers kept theirs
                g.clear(weights_update=True)
            with launch(instance=names[1], run_dir=run_dir, host_cache_gb=0.05):
                # the rank is reattached in the background; a lookup takes it once it is ready
                wait_until(lambda: g.lookup(keys_for(2)) is not None and not g.missing, 10,
                           "the missing rank attached")
                g.offload([0, 1], keys_for(2)).wait(10)
                assert not g.missing and g.lookup(keys_for(2)) == (2, 0)
        finally:
            g.close()
        assert h0.alive()
    for name in names:
        sweep_crashed(name)


def test_the_prefix_cache_manager_drives_a_group(run_dir):
    kv = shards(2, seed=7)
    prompt = list(range(1000, 1000 + 4 * BS))
    with ranks(run_dir, 2) as (names, _):
        g = GroupClient.connect(names, run_dir=run_dir)
        mgr = PrefixCacheManager(32, BS, client=g, namespace="grp", kv_caches=kv)
        mgr.match("a", prompt + [1])
        table = mgr.allocate("a", len(prompt) + 1)
        mgr.commit("a", len(prompt) + 1)   # write-through to both ranks
        mgr.release("a")
        mgr.settle(10)
        mgr.drop_gpu_cache()
        hit = mgr.match("b", prompt + [2])
        assert hit.host_tokens == 4 * BS
        assert mgr.wait_loaded("b") == 4 * BS
        for shard in kv:
            for src, dst in zip(table[:4], hit.block_ids):
                assert same(shard, src, dst)
        mgr.release("b")
        mgr.check()
        mgr.close()


def test_one_key_scheme_for_the_scheduler_each_rank_and_the_group():
    """The keys a rank's daemon holds a block under come from one rule: kernel keys (a split
    block is its own), then rank keys (a rank's shard of the heads), except for MLA."""
    from kvcached_client.key_scheme import KeyScheme
    from kvcached_client.kv_worker import KVWorker

    keys = keys_for(4, seed=21)
    plain, tp2, mla = KeyScheme(), KeyScheme(tp_size=2), KeyScheme(tp_size=2, mla=True)
    assert plain.daemon_keys(keys) == keys and mla.daemon_keys(keys, 1) == keys
    assert tp2.rank_keys(keys, 0) == rank_keys(keys, 0, 2) != tp2.rank_keys(keys, 1)
    split = KeyScheme(tp_size=2, kernel_factor=2)
    assert split.kernel_keys(keys) != keys
    assert split.daemon_keys(keys, 1) == rank_keys(split.kernel_keys(keys), 1, 2)
    worker = KVWorker(None, key_scheme=split, rank=1)
    assert worker.keys_for_daemon(keys) == split.daemon_keys(keys, 1) and worker.kernel_factor == 2
    with pytest.raises(ValueError, match="not known"):
        KeyScheme(kernel_factor=None).kernel_keys(keys)
