"""The host tier end to end through a real daemon: register, offload, lookup, layer-wise load."""
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import (blocks_equal, keys_for, kv_parts, no_tasks, scramble, small_kv, snapshot, unique_instance,
                      wait_until)
from kvcached_client import (
    BlockHasher,
    DaemonUnavailable,
    KvcachedError,
    KvcachedTimeout,
    ProtocolError,
    RequestError,
    TaskFailed,
    allocate_kv_cache,
    launch,
)
from kvcached_proto import ErrorCode
from kvcached_proto.shm_layout import State
from kvcached.bench import process_stop



def assert_blocks_equal(kv, blocks, expected):
    for i, layer in enumerate(kv):
        for j, t in enumerate(kv_parts(layer)):
            assert torch.equal(t[blocks], expected[i][j]), f"layer {i} part {j} differs"


@pytest.fixture(params=["layer_first", "page_first"])
def layout_daemon(request, run_dir):
    h = launch(instance=unique_instance("h"), run_dir=run_dir, host_cache_gb=0.25,
               extra_args=["--host-layout", request.param])
    yield h
    h.stop()


def test_offload_then_load_elsewhere_is_byte_exact(layout_daemon):
    kv = small_kv()
    with layout_daemon.connect() as c:
        c.register_kv_cache(kv)
        keys = keys_for(20)
        src = list(range(3, 23))
        expected = snapshot(kv, src)
        reply = c.offload(src, keys)
        assert reply.reply["stored"] == 20
        assert reply.wait(10)["stored"] == 20
        scramble(kv)
        assert c.lookup(keys) == (20, 0)
        dst = list(range(40, 60))
        task = c.load(keys, dst)
        assert task.wait(10) == 20
        assert_blocks_equal(kv, dst, expected)


def test_mla_single_latent_tensor(daemon):
    kv = small_kv(num_layers=3, block_shape=(16, 64), kv_pair=False)
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        keys, src, dst = keys_for(8, 1), list(range(8)), list(range(30, 38))
        expected = snapshot(kv, src)
        c.offload(src, keys).wait(10)
        scramble(kv)
        assert c.load(keys, dst).wait(10) == 8
        assert_blocks_equal(kv, dst, expected)


def test_extra_per_block_tensors_with_their_own_shape_and_dtype(daemon):
    kv = small_kv(num_layers=2)
    scales = allocate_kv_cache(2, 64, (4,), torch.float32, kv_pair=False)
    for s in scales:
        s.copy_(torch.rand(s.shape))
    layers = [(k, v, s) for (k, v), s in zip(kv, scales)]
    with daemon.connect() as c:
        c.register_kv_cache(layers)
        keys, src, dst = keys_for(5, 2), [1, 2, 3, 4, 5], [50, 51, 52, 53, 54]
        expected = snapshot(layers, src)
        c.offload(src, keys).wait(10)
        scramble(layers)
        assert c.load(keys, dst).wait(10) == 5
        assert_blocks_equal(layers, dst, expected)


def test_wait_layer_returns_only_when_that_layers_bytes_are_in_place(daemon):
    kv = small_kv(num_layers=16, num_blocks=256, block_shape=(16, 8, 64))
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        keys, src, dst = keys_for(100, 3), list(range(100)), list(range(120, 220))
        expected = snapshot(kv, src)
        c.offload(src, keys).wait(10)
        scramble(kv)
        task = c.load(keys, dst)
        for layer in range(16):
            task.wait_layer(layer, timeout=10)
            assert torch.equal(kv[layer][0][dst], expected[layer][0]), f"layer {layer} K early"
            assert torch.equal(kv[layer][1][dst], expected[layer][1]), f"layer {layer} V early"
        assert task.wait(10) == 100


def test_load_of_partly_absent_keys_loads_the_present_leading_prefix(daemon):
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        keys = keys_for(10, 4)
        expected = snapshot(kv, list(range(6)))
        c.offload(list(range(6)), keys[:6]).wait(10)
        scramble(kv)
        task = c.load(keys, list(range(20, 30)))
        assert task.num_blocks == 6
        assert task.wait(10) == 6
        assert_blocks_equal(kv, list(range(20, 26)), expected)
        assert c.load(keys_for(3, 99), [1, 2, 3]).wait(10) == 0


def test_offload_of_keys_already_present_is_skipped(daemon):
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        keys = keys_for(6, 5)
        c.offload(list(range(4)), keys[:4]).wait(10)
        again = c.offload(list(range(6)), keys)
        assert (again.reply["stored"], again.reply["skipped"], again.reply["accepted"]) == (2, 4, 6)
        again.wait(10)
        assert c.status()["host"]["blocks"] == 6


def test_a_full_pool_keeps_the_leading_keys_and_says_how_many(run_dir):
    kv = small_kv(num_layers=4, num_blocks=64, block_shape=(16, 2, 64))  # 32 KiB per page
    h = launch(instance=unique_instance("p"), run_dir=run_dir, host_cache_gb=0.0005)  # 16 pages
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            pinned = keys_for(10, 6)
            c.offload(list(range(10)), pinned).wait(10)
            c.pause()  # a load queued while paused keeps its 10 blocks pinned
            load = c.load(pinned, list(range(40, 50)))
            task = c.offload(list(range(10, 20)), keys_for(10, 7))
            assert task.reply["accepted"] == 6 and task.reply["stored"] == 6
            c.resume()
            assert load.wait(10) == 10
            task.wait(10)
    finally:
        h.stop()


def test_prefixes_stay_whole_and_loads_stay_exact_under_pool_pressure(run_dir):
    kv = small_kv(num_layers=4, num_blocks=256, block_shape=(16, 2, 64))  # 32 KiB per page
    h = launch(instance=unique_instance("p"), run_dir=run_dir, host_cache_gb=0.001)  # 32 pages
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            chains = [keys_for(8, 10 + i) for i in range(12)]
            expected = {}
            for i, keys in enumerate(chains):
                src = list(range(8 * (i % 4), 8 * (i % 4) + 8))
                for layer in kv:  # fresh content for this chain
                    for t in layer:
                        t[src] = torch.randn(t[src].shape).to(t.dtype)
                expected[i] = snapshot(kv, src)
                c.offload(src, keys).wait(10)
                # load an older chain back while later offloads evict around it
                j = max(0, i - 2)
                hit = c.lookup(chains[j])[0]
                dst = list(range(100, 100 + hit))
                task = c.load(chains[j][:hit], dst)
                assert task.wait(10) == hit
                for layer, exp in zip(kv, expected[j]):
                    for t, e in zip(layer, exp):
                        assert torch.equal(t[dst], e[:hit])
            for keys in chains:  # every chain is a prefix: nothing cached past a hole
                hit = c.lookup(keys)[0]
                for j in range(hit + 1, len(keys)):
                    assert c.lookup([keys[j]])[0] == 0
            assert c.status()["host"]["evictions"] > 0
    finally:
        h.stop()


def test_pause_holds_new_work_until_resume(daemon):
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        c.pause()
        assert c.status()["state"] == "paused"
        task = c.offload([1, 2], keys_for(2, 20))
        assert c.status()["tasks"]["queued"] == 1  # the daemon holds it, and runs none of it
        assert not task.done()
        c.resume()
        assert task.wait(10)["stored"] == 2
        assert c.status()["state"] == "normal"


@pytest.mark.parametrize("op", ["clear", "weights clear", "register"])
def test_a_paused_daemon_stays_paused_through_a_clear_or_a_registration(daemon, op):
    """A clear or a registration drains the copy workers and lets them go again; on a daemon an
    operator had paused, they let them go too, and queued work ran while status said paused."""
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        c.pause()
        if op == "register":
            c.register_kv_cache(kv)  # the engine registering again (after a reattach, say)
        else:
            c.clear(tier="host", weights_update=op == "weights clear")
        assert c.status()["state"] == "paused"
        task = c.offload([1, 2], keys_for(2, 26))
        wait_until(lambda: c.status()["tasks"]["queued"] == 1, 5, "the offload queued")
        time.sleep(0.2)  # (a worker let go takes it at once)
        assert c.status()["tasks"]["queued"] == 1 and not task.done()
        c.resume()
        assert task.wait(10)["stored"] == 2
        assert c.status()["state"] == "normal"


def test_clear_after_a_weight_update_leaves_nothing_readable(daemon):
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        keys = keys_for(5, 21)
        c.offload(list(range(5)), keys).wait(10)
        assert c.clear(weights_update=True) == 5
        assert c.status_block.view.state == State.CLEARED
        assert c.lookup(keys) == (0, 0)
        assert c.load(keys, list(range(10, 15))).wait(10) == 0


def test_delete_removes_keys(daemon):
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        keys = keys_for(4, 22)
        c.offload(list(range(4)), keys).wait(10)
        assert c.delete(keys[2:]) == 2
        assert c.lookup(keys) == (2, 0)


def test_cancel_of_a_queued_load_reports_nothing_loaded(daemon):
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        keys = keys_for(4, 23)
        c.offload(list(range(4)), keys).wait(10)
        c.pause()
        task = c.load(keys, [20, 21, 22, 23])
        assert task.cancel() == "cancelled"
        c.resume()
        assert task.wait(10) == 0 and task.status == "cancelled"
        with pytest.raises(TaskFailed):
            task.wait_layer(0, timeout=5)


def test_cancel_of_a_task_that_ended_before_its_end_was_read_says_done(daemon):
    """The daemon has ended the task and forgotten it; the client has not read its end event
    yet (an engine cancelling after a timeout, or a scheduler dropping a request, is that late
    now and then). The cancel says "done" and the task ends as it did; before, it raised
    RequestError(UNKNOWN_TASK) from `cancel()`, and from a `wait(timeout)` whose cancel met
    it - an error no engine expects from either. (Found by test_random_ops.py's cancels.)"""
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        keys = keys_for(4, 25)
        expected = snapshot(kv, [0, 1, 2, 3])
        offload = c.offload(list(range(4)), keys)
        wait_until(lambda: no_tasks(c), 10, "the offload's end")
        load = c.load(keys, [20, 21, 22, 23])  # (its blocks stored by then)
        wait_until(lambda: no_tasks(c), 10, "the load's end")
        assert offload.result is None and load.result is None  # ended, not yet read
        assert offload.cancel() == "done" and load.cancel() == "done"
        assert offload.wait(10)["stored"] == 4 and load.wait(10) == 4
        assert blocks_equal(kv, [20, 21, 22, 23], expected)
        with pytest.raises(RequestError) as e:  # a task id this client never had is still refused
            c.cancel(10_000)
        assert e.value.code == ErrorCode.UNKNOWN_TASK


def test_the_end_of_a_task_its_caller_let_go_is_not_kept(daemon):
    """An engine that sends backups and never waits for them (`client.offload(...)`, the Task
    dropped): each end event was kept for good, one per offload, a client that grew for as long
    as the engine served. Now an end is dropped once its Task is let go (before or after the end
    came); a Task still held gets its end however many were dropped around it."""
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        c.pause()
        kept = c.offload([0], keys_for(1, 91))  # (held: its end is kept until it is taken)
        for i in range(300):  # ended before their Tasks were let go, or after: both
            c.offload([i % 64], keys_for(1, 1000 + i))
            if i % 50 == 0:
                c.resume() if i % 100 == 0 else c.pause()
        c.resume()
        flush = c.flush()
        flush.wait(30)
        wait_until(lambda: no_tasks(c), 10, "the offloads' ends")
        c.poll_events()
        assert len(c._events) <= 1, len(c._events)  # at most the kept Task's end, unread
        assert kept.wait(10)["stored"] == 1
        assert not c._events
        late = c.offload([1], keys_for(1, 92))
        wait_until(lambda: no_tasks(c), 10, "the offload's end")
        c.poll_events()
        del late  # its end read (not taken): taken now
        assert not c._events


def test_a_load_whose_client_closed_says_daemon_unavailable_not_attribute_error(daemon):
    """A step's second load, on a client its first load's failure closed (the vLLM worker
    drops a client whose daemon failed, and one that holds nothing is closed at once): its
    layer wait raised AttributeError (the status block gone) out of the engine's forward, where
    the worker takes DaemonUnavailable as a load error (found by test_kv_worker_random's kill
    soak, staging mode). It says DaemonUnavailable now, and no block of it counts as valid."""
    kv = small_kv()
    c = daemon.connect()
    try:
        c.register_kv_cache(kv)
        keys = keys_for(4, 67)
        c.offload(list(range(4)), keys).wait(10)
        c.pause()  # (both queued, so neither is read as ended by the load calls)
        load = c.load(keys, [20, 21, 22, 23])  # its end not taken before the client closes
        done = c.load(keys[:1], [24])  # ...and one whose end was
    finally:
        c.resume()
    done.wait(10)
    wait_until(lambda: no_tasks(c), 10, "the loads' ends")
    c.close()
    with pytest.raises(DaemonUnavailable, match="client is closed"):
        load.wait_layer(0)
    assert load.valid_blocks == 0
    done.wait_layer(0)  # an end already read still answers
    assert done.valid_blocks == 1


def _error_code(excinfo) -> int:
    return excinfo.value.code


def test_bad_data_requests_get_clear_errors_and_change_nothing(daemon):
    kv = small_kv()
    with daemon.connect() as c:
        keys = keys_for(4, 24)
        with pytest.raises(RequestError) as e:
            c.offload([0, 1, 2, 3], keys)
        assert _error_code(e) == ErrorCode.NOT_REGISTERED
        c.register_kv_cache(kv)
        c.offload([0, 1], keys[:2]).wait(10)
        before = c.status()["host"]
        cases = [
            (lambda: c.offload([0, 1, 2], keys), ErrorCode.BAD_FIELD),  # lengths differ
            (lambda: c.offload([0, 1, 64, 3], keys), ErrorCode.BAD_FIELD),  # out of range
            (lambda: c.load(keys, [5, 5, 6, 7]), ErrorCode.BAD_FIELD),  # repeated
            (lambda: c.load(keys, [0, 1, 2, 1000]), ErrorCode.BAD_FIELD),
        ]
        for call, code in cases:
            with pytest.raises(RequestError) as e:
                call()
            assert _error_code(e) == code
        with pytest.raises(ProtocolError):
            c.lookup([b"short"])  # refused before it is sent
        assert c.status()["host"] == before
        assert c.lookup(keys) == (2, 0)


def test_registration_is_validated(daemon):
    with daemon.connect() as c:
        a = allocate_kv_cache(1, 16, (16, 2, 8))
        b = allocate_kv_cache(1, 16, (16, 2, 4))
        with pytest.raises(RequestError) as e:
            c.register_kv_cache([a[0], b[0]])  # layer shapes differ
        assert _error_code(e) == ErrorCode.KV_MISMATCH
        with pytest.raises(KvcachedError, match="not one contiguous run"):
            c.register_kv_cache([(a[0][0].transpose(0, 1), a[0][1])])  # blocks interleaved
        with pytest.raises(KvcachedError, match="allocate_kv_cache"):
            c.register_kv_cache([(torch.zeros(16, 16, 2, 8), torch.zeros(16, 16, 2, 8))])
        assert c.status()["kv"]["registered"] is False


def test_a_restarted_engine_reregisters_and_finds_its_blocks(daemon):
    kv = small_kv()
    keys = keys_for(6, 25)
    expected = snapshot(kv, list(range(6)))
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        c.offload(list(range(6)), keys).wait(10)
    kv2 = small_kv(seed=9)  # the new engine's fresh KV of the same geometry
    with daemon.connect() as c2:
        reply = c2.register_kv_cache(kv2)
        assert reply["kept_blocks"] == 6
        assert c2.load(keys, list(range(10, 16))).wait(10) == 6
        assert_blocks_equal(kv2, list(range(10, 16)), expected)


def test_block_hashes_are_identical_across_processes():
    code = ("from kvcached_client import BlockHasher; "
            "print(BlockHasher('ns').hash_blocks(list(range(64)), 16, "
            "extra_keys=[None, [b'img'], None, None])[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip()
            for seed in (1, 2)}
    here = BlockHasher("ns").hash_blocks(list(range(64)), 16, extra_keys=[None, [b"img"], None, None])
    assert outs == {here[-1].hex()}


def test_keys_depend_on_namespace_tokens_and_extra_keys():
    toks = list(range(32))
    base = BlockHasher("a").hash_blocks(toks, 16)
    assert BlockHasher("b").hash_blocks(toks, 16) != base
    assert BlockHasher("a").hash_blocks([1] + toks[1:], 16)[1] != base[1]  # chained
    assert BlockHasher("a").hash_blocks(toks, 16, extra_keys=[None, b"x"])[0] == base[0]
    assert BlockHasher("a").hash_blocks(toks, 16, extra_keys=[None, b"x"])[1] != base[1]
    assert len(BlockHasher("a").hash_blocks(toks + [1, 2], 16)) == 2  # partial block: no key


def test_a_load_that_times_out_is_cancelled_and_never_writes_after_the_ack(daemon):
    kv = small_kv(num_layers=16, num_blocks=512, block_shape=(16, 8, 128))
    with daemon.connect(timeout=10) as c:
        c.register_kv_cache(kv)
        keys, src, dst = keys_for(200, 30), list(range(200)), list(range(250, 450))
        c.offload(src, keys).wait(30)
        for _ in range(20):  # a test process descheduled past the 200 MB load has its end already
            task = c.load(keys, dst)
            try:
                task.wait(timeout=0.0001)
            except KvcachedTimeout as timed_out:
                e = timed_out
                break
        else:
            pytest.fail("20 loads of 200 blocks all ended within their 0.1 ms wait")
        assert e.held_blocks == [] == e.fenced_blocks  # the daemon confirmed the end
        assert "confirmed" in str(e)
        assert task.status in ("cancelled", "done") and c.held_blocks() == set()
        for k, v in kv:  # the engine reuses the blocks: nothing may overwrite them now
            k[dst] = 5
            v[dst] = 5
        tasks = c.status()["tasks"]  # the daemon runs nothing more that could write them
        assert tasks["queued"] == 0 and tasks["inflight"] == 0
        assert all(bool((k[dst] == 5).all()) and bool((v[dst] == 5).all()) for k, v in kv)


def test_blocks_stay_held_until_a_hung_daemon_confirms_the_cancel(daemon):
    kv = small_kv()
    with daemon.connect(timeout=2) as c:
        c.register_kv_cache(kv)
        keys = keys_for(4, 31)
        c.offload([0, 1, 2, 3], keys).wait(10)
        c.pause()  # the load stays queued
        task = c.load(keys, [20, 21, 22, 23])
        process_stop.stop(daemon.pid)
        try:
            with pytest.raises(KvcachedTimeout) as e:  # the cancel itself is not answered
                task.wait(timeout=0.05)
            # said on the error as well (a caller that frees by it, SGLang's backend, must wait;
            # the unanswered cancel raised without it)
            assert e.value.held_blocks == [20, 21, 22, 23] and "stay held" in str(e.value)
            assert c.held_blocks() == {20, 21, 22, 23}
            with pytest.warns(DeprecationWarning, match="held_blocks"):
                assert c.fenced_blocks() == {20, 21, 22, 23}  # the earlier name
        finally:
            process_stop.go_on(daemon.pid)
        # the cancel reaches the daemon, its ack lifts the hold
        wait_until(lambda: not c.held_blocks(), 10, "the hold lifting")
        c.resume()


def test_a_client_that_closes_takes_its_kv_mapping_with_it(daemon):
    kv = small_kv()
    with daemon.connect() as owner:
        owner.register_kv_cache(kv)
        with daemon.connect() as other:
            assert other.status()["kv"]["registered"] is True
    with daemon.connect() as later:
        # the bye is sent without waiting for its reply
        wait_until(lambda: later.status()["kv"]["registered"] is False, 10, "the mapping dropped")
