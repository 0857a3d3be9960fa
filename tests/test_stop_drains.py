"""A graceful stop (SIGTERM, `kvcached stop`) runs the copies already queued before it exits,
and their engines read them as done: the load's blocks in place, its hit kept, nothing held.
Before, the end events of the tasks it drained were never sent: a client waiting for one saw
the daemon exit, and every load in flight at a stop failed (a lost hit; SGLang's prefetch
waited for the process to end)."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time

import pytest
from conftest import blocks_equal, keys_for, ranks, scramble, small_kv, snapshot, wait_until
from kvcached_client import DaemonUnavailable, GroupClient, PrefixCacheManager, launch
from kvcached.bench import process_stop
from kvcached_proto.shm_layout import State

SRC, DST, SRC2 = [0, 1, 2, 3], [8, 9, 10, 11], [4, 5]
FROZEN_S = 0.3  # the stop held up this long (well under the hang threshold)


def _kv():
    return small_kv(num_layers=2, num_blocks=16)


@contextlib.contextmanager
def _frozen_stopping(h, c):
    """SIGTERM; the daemon frozen as soon as it says it is stopping (before its drain can end),
    for the block: a drain that takes as long (many copies, backups to a slow tier)."""
    _term_until_stopping(h, c)
    with process_stop.stopped(h.pid):
        yield


def _term_until_stopping(h, c) -> None:
    """SIGTERM; returns as soon as the status block says stopping (spun: the stop of a daemon
    with little queued is short, and the client reads nothing of its socket meanwhile)."""
    os.kill(h.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while c.status_block.view.state != State.STOPPING:
        assert time.monotonic() < deadline, "the daemon did not begin its stop"


def _stop_slowly(h, c) -> threading.Thread:
    """The stop frozen for FROZEN_S on a thread: the client's waits go on through a stopping
    daemon's silence (seen: the load still running when the freeze began)."""
    def freeze() -> None:
        with _frozen_stopping(h, c):
            time.sleep(FROZEN_S)

    thread = threading.Thread(target=freeze, daemon=True)
    thread.start()
    return thread


def _queued(c, kv, seed):
    """A load and an offload queued behind an operator's pause; returns (load, offload,
    the load's expected bytes)."""
    keys = keys_for(len(SRC), seed)
    expected = snapshot(kv, SRC)
    c.offload(SRC, keys).wait(30)
    assert not blocks_equal(kv, DST, expected)  # (random: what the load must overwrite)
    c.pause()
    load = c.load(keys, DST)
    offload = c.offload(SRC2, keys_for(len(SRC2), seed + 1))
    assert load.num_blocks == len(DST)
    return load, offload, expected


@contextlib.contextmanager
def _queued_at_a_daemon(run_dir, instance, hang_s: float, seed: int):
    """A daemon, an engine's client with a load and an offload queued behind a pause (_queued):
    yields (daemon, client, kv, load, offload, the load's expected bytes); the daemon must have
    exited cleanly by the end (the test stops it)."""
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    try:
        kv = _kv()
        with h.connect(timeout=30, hang_s=hang_s) as c:
            c.register_kv_cache(kv)
            yield (h, c, kv, *_queued(c, kv, seed))
        assert h.proc.wait(30) == 0
    finally:
        h.stop()


@pytest.mark.parametrize("wait", ["wait", "wait_layer", "done"])
def test_a_load_queued_at_a_graceful_stop_ends_done_with_its_blocks_in_place(run_dir, instance, wait):
    with _queued_at_a_daemon(run_dir, instance, 2, 61) as (h, c, kv, load, offload, expected):
        freezer = _stop_slowly(h, c)
        if wait == "wait":
            assert load.wait(30) == len(DST)
        elif wait == "wait_layer":
            load.wait_layer(1, timeout=30)
        else:
            wait_until(load.done, 30, "the load's end")
        assert blocks_equal(kv, DST, expected), "the load's blocks are not its bytes"
        assert load.wait(30) == len(DST) and load.status.name == "DONE"
        assert offload.wait(30)["stored"] == len(SRC2)
        assert not c.held_blocks()
        freezer.join(10)


def test_a_stopping_daemon_that_hangs_still_fails_the_wait_and_holds_the_blocks_until_it_ends(
        run_dir, instance):
    """A daemon frozen as its stop is asked (SIGTERM pending) is hung as any other: the wait
    fails at the hang threshold, the load's blocks stay held, and the hold lifts when the
    stop, going on, drains the load and sends its end."""
    with _queued_at_a_daemon(run_dir, instance, 0.5, 71) as (h, c, kv, load, _, expected):
        process_stop.stop(h.pid)
        try:
            os.kill(h.pid, signal.SIGTERM)  # (taken when it goes on)
            with pytest.raises(DaemonUnavailable, match="hung") as e:
                load.wait(30)
            assert e.value.held_blocks == DST and c.held_blocks() == set(DST)
        finally:
            process_stop.go_on(h.pid)
        wait_until(lambda: not c.held_blocks(), 30, "the hold to lift")
        assert blocks_equal(kv, DST, expected)


def test_a_request_to_a_stopping_daemon_is_refused_at_once_while_its_drain_goes_on(run_dir, instance):
    """A stopping daemon reads no more requests; its drain may take long (backups written to a
    slow tier, up to the drain timeout). A request sent meanwhile waited for the client's whole
    timeout (every engine step stalled that long); it is DaemonUnavailable at once now, so the
    engine goes on without the daemon, while the load queued before the stop still ends done.
    A lookup is no hit either: the key table closes as the stop begins (a hit found there
    planned a load the stopping daemon would never read)."""
    with _queued_at_a_daemon(run_dir, instance, 30, 81) as (h, c, kv, load, _, expected):
        assert c.lookup(keys_for(len(SRC), 81)) == (len(SRC), 0)  # (from the key table)
        with _frozen_stopping(h, c):  # its drain goes on for as long as this takes
            with pytest.raises(DaemonUnavailable, match="is stopping"):
                c.lookup(keys_for(len(SRC), 81))  # not from a table the daemon closed
            with pytest.raises(DaemonUnavailable, match="is stopping"):
                c.offload(SRC2, keys_for(len(SRC2), 83))  # (timeout 30 s: not a timeout)
            with pytest.raises(DaemonUnavailable, match="is stopping"):
                c.load(keys_for(len(SRC), 81), SRC)
        assert load.wait(30) == len(DST) and blocks_equal(kv, DST, expected)
        wait_until(lambda: not c.held_blocks(), 30, "the refused load's hold to lift")


def _cached_then_dropped(mgr, shards, prompt, bs) -> list:
    """The prompt's blocks computed (random KV), backed up to the host tier (write_through) and
    dropped from the GPU cache, every shard scrambled: a match finds them in the host tier.
    Returns each shard's snapshot of them."""
    n = len(prompt) // bs
    mgr.match("a", prompt + [1])
    table = mgr.allocate("a", n * bs + 1)
    expected = [snapshot(kv, table[:n]) for kv in shards]
    mgr.commit("a", n * bs + 1)
    mgr.settle(30)
    mgr.release("a")
    mgr.drop_gpu_cache()
    for kv in shards:
        scramble(kv)
    return expected


def test_a_prefix_managers_load_in_flight_at_a_stop_keeps_its_hit(run_dir, instance):
    """A PrefixCacheManager whose next call a stopping daemon refuses drops its client (the
    engine goes on GPU-only). Its loads sent before the stop still end, their blocks in place:
    they stay in flight and keep their hit. They counted as failed before (the request
    recomputed a prefix whose KV had landed)."""
    bs, n = 16, 4
    rng = random.Random(91)
    prompt = [rng.randrange(1000) for _ in range(n * bs)]
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    try:
        kv = small_kv(num_layers=2, num_blocks=12)
        c = h.connect(timeout=30, hang_s=30)
        mgr = PrefixCacheManager(12, bs, client=c, namespace="stop-test", kv_caches=kv)
        [expected] = _cached_then_dropped(mgr, [kv], prompt, bs)
        c.pause()
        hit = mgr.match("b", prompt + [2])  # a host hit: its load queued behind the pause
        assert hit.host_tokens == n * bs
        with _frozen_stopping(h, c):
            mgr.match("c", prompt[::-1] + [3])  # its lookup refused: the manager detaches
            assert not mgr.attached and mgr.stats()["detaches"] == 1
        assert mgr.wait_loaded("b", timeout=30) == n * bs, "the load drained at the stop was lost"
        assert blocks_equal(kv, hit.block_ids, expected)
        assert mgr.stats()["loaded_blocks"] == n and mgr.stats()["load_short_blocks"] == 0
        mgr.release("b")
        mgr.release("c")
        mgr.check()
        assert h.proc.wait(30) == 0
        mgr.close()
    finally:
        h.stop()


def test_a_group_loads_in_flight_on_a_stopping_rank_keep_their_hit(run_dir):
    """Two tensor-parallel ranks, rank 1 stopped gracefully while a load is queued on both: the
    group marks rank 1 missing at its next call (lookups find nothing while it is), holds the
    rank's blocks and keeps its client until the load's end, so the load ends whole on both
    ranks, each rank's blocks its own bytes."""
    bs, n = 16, 4
    rng = random.Random(93)
    prompt = [rng.randrange(1000) for _ in range(n * bs)]
    with ranks(run_dir, 2) as (names, handles):
        shards = [small_kv(num_layers=2, num_blocks=12, seed=r) for r in range(2)]
        g = GroupClient.connect(names, run_dir=run_dir, timeout=30, hang_s=30)
        mgr = PrefixCacheManager(12, bs, client=g, namespace="stop-test", kv_caches=shards)
        expected = _cached_then_dropped(mgr, shards, prompt, bs)
        for c in g.clients:
            c.pause()
        hit = mgr.match("b", prompt + [2])  # its loads queued behind the pauses
        assert hit.host_tokens == n * bs
        with _frozen_stopping(handles[1], g.clients[1]):
            assert mgr.match("c", prompt[::-1] + [3]).cached_tokens == 0  # rank 1 refused
            assert 1 in g.missing
            mgr.match("d", prompt[1:] + [4])  # (the group closes a lost rank's idle client)
            g.clients[0].resume()
        assert mgr.wait_loaded("b", timeout=30) == n * bs, "the load drained at the stop was lost"
        for kv, exp in zip(shards, expected):
            assert blocks_equal(kv, hit.block_ids, exp)
        for rid in "bcd":
            mgr.release(rid)
        mgr.check()
        assert handles[1].proc.wait(30) == 0
        mgr.close()
        g.close()


def test_a_load_drained_at_a_stop_ends_done_though_its_end_was_not_read_before_the_exit(
        run_dir, instance):
    """The engine reads nothing until the stopped daemon has exited: the end events it sent are
    lost with the connection (the socket drops what it holds of a closed one). A load's slot in
    the status block still says how it ended: `done()` and `wait()` read it there (both said
    "has exited", and a load whose blocks had landed counted failed). An offload has no slot:
    its wait still says the daemon exited, and it holds nothing (the daemon is gone)."""
    with _queued_at_a_daemon(run_dir, instance, 30, 97) as (h, c, kv, load, offload, expected):
        os.kill(h.pid, signal.SIGTERM)
        assert h.proc.wait(30) == 0
        assert load.done(), "the load's end, in its slot, was not read"
        assert load.wait(5) == len(DST) and load.status.name == "DONE"
        assert blocks_equal(kv, DST, expected)
        with pytest.raises(DaemonUnavailable, match="has exited"):
            offload.wait(5)
        assert not c.held_blocks()


def test_the_ends_a_stop_sent_reach_an_engine_that_reads_a_step_later(run_dir, instance):
    """The engine reads its socket 0.15 s after the stop began (a step later): by then the
    drain of its queued load and offload has ended. The daemon keeps its connections open 0.5 s
    after the last end it sent, so both ends are read, the offload's too, which has no slot to
    fall back on (before: the daemon exited at once and the socket dropped the unread ends -
    "has exited")."""
    with _queued_at_a_daemon(run_dir, instance, 30, 99) as (h, c, kv, load, offload, expected):
        _term_until_stopping(h, c)
        time.sleep(0.15)
        assert offload.wait(5)["stored"] == len(SRC2)
        assert load.wait(5) == len(DST) and blocks_equal(kv, DST, expected)
        assert not c.held_blocks()
