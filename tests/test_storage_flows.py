"""What the daemon does with its storage tiers, through real daemons: the write policies, a
non-writer rank, prefetch, and loads that share one fetch."""
import os
import time

import pytest

from conftest import (blocks_equal, disk_uri, keys_for, scramble, small_kv, snapshot, unique_instance,
                      wait_until)
from storage_util import (PAGE_SHAPE, files, load_state, offload_and_flush, on_disk_only, record_path, start,
                          stored_on_disk_only)


def test_write_through_selective_waits_for_hits(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    h = start(run_dir, instance, disk_uri(disk_dir),
              extra=["--storage-write-policy", "write_through_selective", "--selective-hits", "2"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            keys = keys_for(4, 5)
            offload_and_flush(c, kv, keys, [0, 1, 2, 3])
            assert files(disk_dir) == []
            c.lookup(keys[:2])
            c.lookup(keys[:2])
            c.flush().wait(10)
            assert len(files(disk_dir)) == 2
    finally:
        h.stop()


def test_a_flush_covers_the_offloads_accepted_before_it(run_dir, instance, disk_dir):
    """What a flush promises a proxy that flushes right after an engine offloaded (disaggregated
    prefill): the offloads the daemon accepted before the flush are in storage once its event
    came, even those still copying then. Held by a pause so both are queued, then resumed."""
    n, parts = 384, 4
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=n)
    h = start(run_dir, instance, disk_uri(disk_dir), host_gb=0.03)
    try:
        with h.connect() as engine, h.connect(role="operator") as proxy, h.connect() as another:
            engine.register_kv_cache(kv)
            keys, per = keys_for(n, 31), n // parts
            engine.pause()
            tasks = [engine.offload(list(range(i, i + per)), keys[i:i + per])  # held by the pause
                     for i in range(0, n, per)]
            flush = proxy.flush()
            engine.resume()
            flush.wait(30)
            assert len(files(disk_dir)) == n  # without the wait the flush ended first: 0 of them
            assert [t.wait(10)["stored"] for t in tasks] == [per] * parts
    finally:
        h.stop()


def test_flushes_waiting_count_against_the_queue_cap(run_dir, instance, disk_dir):
    """A flush waits (behind a held offload here; behind backups a hung tier holds, in a
    deployment) in the table: a careless proxy flushing in a loop gets BUSY past half of
    --max-queued-tasks (clients with no KV registered, together: another connection gets no
    more room), and the engine past the whole, instead of growing the daemon without bound; the
    refused ones change nothing and the others end once the offload did."""
    from kvcached_client import RequestError

    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=16)
    h = start(run_dir, instance, disk_uri(disk_dir), extra=["--max-queued-tasks", "4"])
    try:
        with h.connect() as engine, h.connect(role="operator") as proxy, h.connect() as another:
            engine.register_kv_cache(kv)
            keys = keys_for(4, 33)
            engine.pause()
            offload = engine.offload([0, 1, 2, 3], keys)  # queued: 1
            flushes = [proxy.flush() for _ in range(2)]  # waiting on it: 2, 3 - the proxy's half
            for c in (proxy, another, proxy):
                with pytest.raises(RequestError, match="BUSY.*half of --max-queued-tasks"):
                    c.flush()
            later = engine.offload([4], keys_for(1, 34))  # the engine's room: 4
            with pytest.raises(RequestError, match="BUSY.*[(]--max-queued-tasks[)]"):
                engine.offload([5], keys_for(1, 35))
            engine.resume()
            assert offload.wait(10)["stored"] == 4 and later.wait(10)["stored"] == 1
            for f in flushes:
                f.wait(10)
            assert len(files(disk_dir)) >= 4
            # the cap counts waiting flushes only; this one also covers `later`'s backup, whose
            # block stays pinned until it is written (the flushes above came before `later`)
            proxy.flush().wait(10)
            assert len(files(disk_dir)) == 5
            assert load_state(engine) == (0, 0, 0, 0, "ok")
    finally:
        h.stop()


def test_write_back_writes_only_what_the_host_tier_evicts(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    h = start(run_dir, instance, disk_uri(disk_dir), host_gb=0.0005,  # 16 host blocks
              extra=["--storage-write-policy", "write_back"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            first, second = keys_for(10, 6), keys_for(10, 7)
            expected = snapshot(kv, list(range(10)))
            offload_and_flush(c, kv, first, list(range(10)))
            assert files(disk_dir) == []
            offload_and_flush(c, kv, second, list(range(10, 20)))  # evicts 4 of `first`
            assert len(files(disk_dir)) == 4
            scramble(kv, 3)
            assert c.lookup(first) == (6, 4)
            assert c.load(first, list(range(50, 60))).wait(10) == 10
            assert blocks_equal(kv, list(range(50, 60)), expected)
    finally:
        h.stop()


def test_a_non_writer_rank_reads_but_never_writes(run_dir, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(4, 8)
    writer = start(run_dir, unique_instance("w"), disk_uri(disk_dir))
    try:
        with writer.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, [0, 1, 2, 3])
    finally:
        writer.stop()
    other = start(run_dir, unique_instance("r"), disk_uri(disk_dir), extra=["--no-storage-writer"])
    try:
        with other.connect() as c:
            c.register_kv_cache(kv)
            more = keys_for(4, 9)
            offload_and_flush(c, kv, more, [4, 5, 6, 7])
            assert len(files(disk_dir)) == 4  # nothing new written
            wait_until(lambda: c.lookup(keys) == (0, 4), 10, "the stored blocks found")
            assert c.load(keys, [10, 11, 12, 13]).wait(10) == 4
    finally:
        other.stop()


def test_keys_already_stored_are_not_rewritten(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            keys = keys_for(3, 10)
            offload_and_flush(c, kv, keys, [0, 1, 2])
            mtimes = [os.stat(f).st_mtime_ns for f in files(disk_dir)]
            c.clear(tier="host")
            offload_and_flush(c, kv, keys, [0, 1, 2])
            assert [os.stat(f).st_mtime_ns for f in files(disk_dir)] == mtimes
            assert c.status()["storage"][0]["puts"] == 3
    finally:
        h.stop()


def test_prefetch_warms_the_host_tier(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(20, 11)
    expected = snapshot(kv, list(range(20)))
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(20)))
            c.clear(tier="host")
            small = c.prefetch(keys[:1], block_tokens=16)  # 16 tokens < threshold 256
            assert small.status == "skipped" and small.wait()["prefetched"] == 0
            task = c.prefetch(keys, block_tokens=16, policy="wait_complete")
            assert task.reply["blocks"] == 20
            assert task.wait(10)["prefetched"] == 20
            assert c.lookup(keys) == (20, 0)
            scramble(kv, 3)
            assert c.load(keys, list(range(30, 50))).wait(10) == 20
            assert blocks_equal(kv, list(range(30, 50)), expected)
    finally:
        h.stop()


def test_prefetch_uses_at_most_its_share_of_the_host_pool(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    keys = keys_for(30, 12)
    h = start(run_dir, instance, disk_uri(disk_dir), host_gb=0.001,  # 32 host blocks
              extra=["--prefetch-max-share", "0.25", "--prefetch-threshold-tokens", "0"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(30)))
            c.clear(tier="host")
            task = c.prefetch(keys)
            assert task.reply["blocks"] == 8
            assert task.wait(10)["prefetched"] == 8
            assert c.lookup(keys) == (8, 22)
    finally:
        h.stop()


def test_cancel_stops_a_prefetch(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(20, 13)
    h = start(run_dir, instance, disk_uri(disk_dir), extra=["--prefetch-threshold-tokens", "0"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(20)))
            c.clear(tier="host")
            c.pause()
            task = c.prefetch(keys)
            assert task.cancel() == "cancelled"
            c.resume()
            result = task.wait(10)
            assert task.status == "cancelled" and result["prefetched"] == 0
            assert c.lookup(keys) == (0, 20)
            assert c.status()["host"]["used_bytes"] == 0
    finally:
        h.stop()


def test_two_loads_of_a_prefix_being_fetched_share_the_fetch(run_dir, instance, disk_dir):
    with on_disk_only(run_dir, instance, disk_dir, 7) as (c, kv, keys, expected):
        c.pause()  # every load is planned before the first fetch runs
        first = c.load(keys, list(range(20, 28)))
        second = c.load(keys, list(range(40, 48)))  # INTERNAL: KeyError before the fix
        third = c.load(keys[:5], list(range(50, 55)))
        assert first.reply["storage_blocks"] == 8 and second.reply["blocks"] == 8
        c.resume()
        assert (first.wait(10), second.wait(10), third.wait(10)) == (8, 8, 5)
        assert blocks_equal(kv, list(range(20, 28)), expected)
        assert blocks_equal(kv, list(range(40, 48)), expected)
        assert blocks_equal(kv, list(range(50, 55)), expected, upto=5)
        assert c.status()["storage_io"]["fetched"] == 8  # one fetch, not three
        assert load_state(c) == (0, 0, 0, 0, "ok")


def test_a_load_sharing_a_fetch_that_fails_gets_the_leading_blocks_that_arrived(
        run_dir, instance, disk_dir):
    with on_disk_only(run_dir, instance, disk_dir, 8) as (c, kv, keys, expected):
        os.unlink(record_path(disk_dir, keys[3], kv))
        c.pause()
        first, second = c.load(keys, list(range(20, 28))), c.load(keys, list(range(40, 48)))
        c.resume()
        assert (first.wait(10), second.wait(10)) == (3, 3)
        assert blocks_equal(kv, list(range(40, 48)), expected, upto=3)
        assert load_state(c) == (0, 0, 0, 0, "ok")


def test_cancelling_the_load_that_owns_a_fetch_leaves_the_sharer_whole(run_dir, instance, disk_dir):
    with on_disk_only(run_dir, instance, disk_dir, 9) as (c, kv, keys, expected):
        c.pause()
        owner, sharer = c.load(keys, list(range(20, 28))), c.load(keys, list(range(40, 48)))
        assert owner.cancel() == "cancelled" and owner.wait(10) == 0
        c.resume()
        assert sharer.wait(10) == 8  # the owner's entries went unfetched: it fetched them itself
        assert blocks_equal(kv, list(range(40, 48)), expected)
        assert load_state(c) == (0, 0, 0, 0, "ok")


def test_a_prefetch_of_keys_on_their_way_ends_once_they_arrived(run_dir, instance, disk_dir):
    """A second prefetch of keys another task is fetching does not fetch them twice, and does
    not end before they are in the host tier: its requester looks them up after its end (it
    ended at once, and the lookup that followed missed blocks still on their way)."""
    with on_disk_only(run_dir, instance, disk_dir, 10) as (c, kv, keys, expected):
        c.pause()
        first = c.prefetch(keys, block_tokens=64)
        second = c.prefetch(keys, block_tokens=64)
        assert first.reply["blocks"] == 8 and second.reply["blocks"] == 0
        time.sleep(0.2)
        assert not second.done()  # waits for the first's fetch
        c.resume()
        assert first.wait(10)["prefetched"] == 8 and second.wait(10)["prefetched"] == 0
        assert c.lookup(keys) == (8, 0)
        assert c.status()["storage_io"]["fetched"] == 8  # one fetch
        assert load_state(c) == (0, 0, 0, 0, "ok")


def test_a_prefetch_whose_shared_fetch_ends_empty_fetches_the_keys_itself(run_dir, instance, disk_dir):
    """The first prefetch's own timeout passes before its fetch runs (it ends with nothing) and
    another is cancelled: a prefetch that waited on their fetches brings the blocks itself."""
    with on_disk_only(run_dir, instance, disk_dir, 11) as (c, kv, keys, expected):
        for end_first in ("timeout", "cancel"):
            c.clear(tier="host")
            c.pause()
            if end_first == "timeout":
                first = c.prefetch(keys, policy="timeout", timeout_ms=1, block_tokens=64)
            else:
                first = c.prefetch(keys, block_tokens=64)
            second = c.prefetch(keys, block_tokens=64)
            assert first.reply["blocks"] == 8 and second.reply["blocks"] == 0
            if end_first == "cancel":
                assert first.cancel() == "cancelled"
            time.sleep(0.05)
            c.resume()
            assert first.wait(10)["prefetched"] == 0, end_first
            assert second.wait(10)["prefetched"] == 8, end_first  # 0 before: it got nothing
            assert c.lookup(keys) == (8, 0)
            assert c.load(keys, list(range(20, 28))).wait(10) == 8
            assert blocks_equal(kv, list(range(20, 28)), expected)
            scramble(kv, 5)
            assert load_state(c) == (0, 0, 0, 0, "ok")


def test_prefetches_parked_on_keys_on_their_way_count_against_the_queue_cap(run_dir, instance, disk_dir):
    """A flood of prefetches of keys another task is fetching: each parks (no load slot bounds
    them), so they count with the queued tasks and past --max-queued-tasks get BUSY, changing
    nothing; once the fetch ran, every parked one ends."""
    from kvcached_client import RequestError

    h, kv, keys, _ = stored_on_disk_only(run_dir, instance, disk_dir, seed=12,
                                         extra=["--max-queued-tasks", "4"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            c.pause()
            tasks = [c.prefetch(keys, block_tokens=64)]  # queued on the fetcher: 1
            for _ in range(3):  # parked on its entries: 2, 3, 4
                tasks.append(c.prefetch(keys, block_tokens=64))
            for _ in range(5):
                with pytest.raises(RequestError, match="BUSY"):
                    c.prefetch(keys, block_tokens=64)
            tasks_status = c.status()["tasks"]
            assert tasks_status["parked"] == 3 and tasks_status["queued"] == 1
            c.resume()
            assert [t.wait(10)["prefetched"] for t in tasks] == [8, 0, 0, 0]
            assert c.lookup(keys) == (8, 0)
            assert load_state(c) == (0, 0, 0, 0, "ok")
    finally:
        h.stop()


def test_a_parked_prefetch_ends_at_its_own_timeout(run_dir, instance, disk_dir):
    """A prefetch with the timeout policy parked on another task's fetch that does not run (the
    workers paused here; an offload behind an engine's fence, a hung tier) ends at its
    timeout_ms with nothing fetched, not when that fetch ends; the other fetch goes on."""
    with on_disk_only(run_dir, instance, disk_dir, 13) as (c, kv, keys, expected):
        c.pause()
        first = c.prefetch(keys, block_tokens=64)
        second = c.prefetch(keys, policy="timeout", timeout_ms=200, block_tokens=64)
        assert second.reply["blocks"] == 0
        t0 = time.monotonic()
        assert second.wait(5)["prefetched"] == 0 and second.status == "done"
        assert time.monotonic() - t0 < 2.0 and not first.done()  # the workers are still paused
        assert c.status()["tasks"]["parked"] == 0
        c.resume()
        assert first.wait(10)["prefetched"] == 8 and c.lookup(keys) == (8, 0)
        assert load_state(c) == (0, 0, 0, 0, "ok")
