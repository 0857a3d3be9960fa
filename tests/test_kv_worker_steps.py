"""The worker core's step protocol through real daemons: the finished protocol of asynchronous
saves, preemption, daemons killed mid-load and mid-save, host-only loads, no daemon at all,
revoked offloads, a direct load counted only once its copies ended, the staging segment at
close."""
from __future__ import annotations

import logging

import os
import signal

import pytest
import torch

from kvcached.bench import process_stop
from conftest import disk_uri, keys_for, no_tasks, sweep_crashed, wait_until
from kv_layouts import fill, make_kv, parts_of
from kvcached_client import DaemonUnavailable, launch
from kvcached_client.kv_alloc import describe_kv_cache
from kvcached_client.kv_worker import BlockTransfer, KVWorker, _Load
from worker_util import (DST, SRC, blocks_of, finish, load_misses, make_worker, saved, step,
                         worker_with_saved)


def test_a_finished_request_is_held_while_its_save_runs(daemon):
    raw, kv = make_kv("LBNHC")
    fill(kv, seed=9)
    worker, _ = make_worker(daemon, kv)
    keys = keys_for(len(SRC), seed=11)
    control = daemon.connect(timeout=10, role="operator")
    try:
        control.pause()  # new tasks are held: the save cannot run yet
        step(worker, saves=[BlockTransfer("r", keys, SRC)])
        for _ in range(3):
            assert worker.finished({"r", "no-transfer"}) == set(), \
                "reported while the daemon may still read its blocks (or one that had none)"
        control.resume()
        finish(worker, "r")
        assert control.lookup(keys) == (len(keys), 0)
    finally:
        control.close()
        worker.close()


def test_preemption_waits_for_the_save_then_revokes_it(daemon):
    """The engine reuses a preempted request's blocks right after preempt(): a save the daemon
    has not run by then is revoked, so what it reads after the reuse is never stored."""
    raw, kv = make_kv("LBHNC")
    fill(kv, seed=13)
    worker, _ = make_worker(daemon, kv, timeout=1.0)
    keys = keys_for(len(SRC), seed=15)
    control = daemon.connect(timeout=10, role="operator")
    try:
        control.pause()
        step(worker, saves=[BlockTransfer("p", keys, SRC)])
        worker.preempt(["p"])  # waits 1 s (the client's timeout), then revokes
        for row in parts_of(kv):  # the engine writes another request's KV there
            for t in row:
                t[SRC] = 1
        assert worker.finished({"p"}) == set(), "the daemon has not ended the save yet"
        control.resume()  # the save runs now, over the reused blocks
        finish(worker, "p")
        assert control.lookup(keys) == (0, 0), "a revoked save was stored"
        step(worker, saves=[BlockTransfer("q", keys, SRC)])  # later saves are not revoked
        finish(worker, "q")
        assert control.lookup(keys) == (len(keys), 0)
    finally:
        control.close()
        worker.close()


def _kill(handle) -> None:
    os.kill(handle.pid, signal.SIGKILL)
    handle.proc.wait(10)


@pytest.mark.faults
def test_daemon_killed_mid_load_reports_errors_and_serves_nothing_after_restart(run_dir, instance):
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    raw, kv = make_kv("BLHNC")
    fill(kv, seed=17)
    worker, _ = make_worker(h, kv, timeout=2.0)
    keys = keys_for(len(SRC), seed=19)
    try:
        step(worker, saves=[BlockTransfer("s", keys, SRC)])
        finish(worker, "s")
        with h.connect(timeout=10, role="operator") as control:
            control.pause()
            worker.start_loads([BlockTransfer("l", keys, DST)])  # held by the pause
            _kill(h)
        for layer in range(len(kv)):
            worker.layer_ready(layer)
        worker.end_forward()
        assert worker.load_errors() == set(DST)
        assert worker.finished({"l"}) == {"l"}, "a dead daemon touches nothing: released"
        sweep_crashed(instance)
        h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
        wait_until(lambda: worker.link.get() is not None, 20, "the worker reattached")
        load_misses(worker, kv, keys, "the restarted daemon has none of it: all recomputed")
    finally:
        worker.close()
        h.stop()
        sweep_crashed(instance)


@pytest.mark.faults
def test_daemon_killed_mid_save_releases_the_request(run_dir, instance, tmp_path):
    uri = disk_uri(str(tmp_path / "disk"))
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25,
               extra_args=["--storage", uri], wait_storage=True)
    raw, kv = make_kv("LBNHC")
    fill(kv, seed=21)
    worker, _ = make_worker(h, kv, timeout=2.0)
    keys = keys_for(len(SRC), seed=23)
    try:
        with h.connect(timeout=10, role="operator") as control:
            control.pause()
            step(worker, saves=[BlockTransfer("s", keys, SRC)])
            assert worker.finished({"s"}) == set()
            _kill(h)
        wait_until(lambda: "s" in worker.finished(set()), 20, "released once the daemon died")
        sweep_crashed(instance)
        h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25,
                   extra_args=["--storage", uri], wait_storage=True)
        with h.connect(timeout=10) as c:
            assert c.lookup(keys) == (0, 0), "nothing of the killed save is served"
    finally:
        worker.close()
        h.stop()
        sweep_crashed(instance)


@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_host_only_loads_recompute_what_left_the_host_tier_instead_of_reading_storage(
        run_dir, instance, tmp_path, mode):
    """The scheduler saw 6 blocks in the host tier (its gate prefetched them); 3 were evicted
    before the step (here: the host tier cleared, 3 brought back). The load takes the 3 in host
    memory, byte-exact, and reports the rest as load errors: no storage read in the step."""
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25, wait_storage=True,
               extra_args=["--storage", disk_uri(str(tmp_path / "disk")),
                           "--prefetch-threshold-tokens", "0"])
    raw, kv = make_kv("LBNHC")
    fill(kv, seed=27)
    worker, _ = make_worker(h, kv, direct=(mode == "direct"), host_only_loads=True)
    keys = keys_for(len(SRC), seed=29)
    try:
        step(worker, saves=[BlockTransfer("s", keys, SRC)])
        saved(worker, "s", keys)
        want = blocks_of(kv, SRC[:3])
        with h.connect(timeout=10, role="operator") as control:
            control.flush().wait(30)
            control.clear(tier="host")
            assert control.prefetch(keys[:3], policy="wait_complete").wait(10)["prefetched"] == 3
            assert control.lookup(keys) == (3, 3)
            _, errors = step(worker, loads=[BlockTransfer("l", keys, DST)])
            assert errors == set(DST[3:])
            for got, exp in zip(blocks_of(kv, DST[:3]), want):
                assert torch.equal(got, exp)
            assert control.status()["storage_io"]["fetched"] == 3, "the load read storage"
        finish(worker, "l")
    finally:
        worker.close()
        h.stop()


def test_without_a_daemon_loads_fail_saves_are_skipped_and_requests_still_finish(daemon):
    raw, kv = make_kv("LBNHC")
    worker, _ = make_worker(daemon, kv)
    daemon.stop()
    keys = keys_for(len(SRC), seed=25)
    try:
        done, errors = step(worker, loads=[BlockTransfer("l", keys, DST)],
                            saves=[BlockTransfer("s", keys, SRC)])
        assert errors == set(DST)
        assert worker.finished({"l", "s"}) == {"l", "s"}
        assert worker.counters["save_skipped_blocks"] == len(SRC)
    finally:
        worker.close()


@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_a_steps_loads_go_out_together_and_each_lands_as_the_daemon_answered_it(daemon, mode):
    """Three requests load in one step (one round trip, Client.load_batch): one whole, one whose
    last two blocks the daemon does not hold (load errors), one it refuses (every block a load
    error, its blocks untouched)."""
    with worker_with_saved(daemon, 35, mode) as (kv, worker, keys):
        want = blocks_of(kv, SRC)
        refused = [21, 22]
        before = blocks_of(kv, refused)
        sent = []
        batch = worker.link.get().load_batch
        worker.link.get().load_batch = lambda loads, **kw: sent.append(len(loads)) or batch(
            [(k, b if i != 2 else [21, 10 ** 6]) for i, (k, b) in enumerate(loads)], **kw)
        _, errors = step(worker, loads=[BlockTransfer("a", keys, DST),
                                        BlockTransfer("b", keys[:4] + keys_for(2, 39), [14, 15, 16, 18, 19, 23]),
                                        BlockTransfer("c", keys[:2], refused)])
        assert sent == [3], "the step's loads were not sent together"
        assert errors == {19, 23} | set(refused)
        for got, exp in zip(blocks_of(kv, DST), want):
            assert torch.equal(got, exp)
        for got, exp in zip(blocks_of(kv, [14, 15, 16, 18]), blocks_of(kv, DST[:4])):
            assert torch.equal(got, exp)
        for got, exp in zip(blocks_of(kv, refused), before):
            assert torch.equal(got, exp)
        for req in "abc":
            finish(worker, req)


@pytest.mark.parametrize("mode", ["direct", "staging"])
@pytest.mark.parametrize("hung", ["before its reply", "after its reply"])
def test_a_load_whose_layer_wait_finds_the_daemon_hung_keeps_its_blocks_until_it_ends(
        daemon, monkeypatch, mode, hung):
    """The daemon hangs (SIGSTOP, 0.5 s threshold) with the load request on its socket, or after
    it answered and queued the load (paused): the step fails the load, but a daemon that wakes
    still runs it. The blocks it copies into (the request's own in direct mode, staging blocks in
    staging mode) are not handed back until it ended. (After the reply, staging: the client
    dropped at the failure held nothing then and was closed at once, and the staging blocks went
    back to the free list.)"""
    monkeypatch.setenv("KVCACHED_HANG_S", "0.5")
    with worker_with_saved(daemon, 31, mode) as (kv, worker, keys), \
            daemon.connect(role="operator", timeout=30) as control:
        if hung == "after its reply":
            control.pause()
            worker.start_loads([BlockTransfer("l", keys, DST)])  # answered, queued
        process_stop.stop(daemon.pid)
        try:
            if hung == "before its reply":
                worker.start_loads([BlockTransfer("l", keys, DST)])
            for layer in range(len(worker._layers)):
                worker.layer_ready(layer)
            worker.end_forward()
            assert worker.load_errors() == set(DST)
            if mode == "direct":
                assert worker.finished({"l"}) == set(), "its blocks reported free to reuse"
            else:
                assert len(worker._holds.parked) == len(DST), "staging blocks handed back"
        finally:
            process_stop.go_on(daemon.pid)
        control.resume()
        finish(worker, "l")
        wait_until(lambda: not worker._holds.holding() or worker._holds.release(), 20,
                   "the staging blocks given back")
        if mode == "direct":  # the daemon did run it once awake: the test is not vacuous
            for got, exp in zip(blocks_of(kv, DST), blocks_of(kv, SRC)):
                assert torch.equal(got, exp)


@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_a_load_the_daemon_cancelled_before_its_first_layer_holds_nothing(daemon, mode, caplog):
    """A queued load the daemon cancels (an operator's clear) fails its first layer wait, which
    read its end: the request is reported finished and its blocks are free. The worker held the
    request after that failure under the task's id, and with its end already read, the hold
    lasted until the daemon's process was gone: the request was never reported, its blocks never
    freed (a leak of each load that failed before a layer: a clear, a storage read that failed).
    It is a load that ended short, not a call that failed: the daemon stays in use, and the
    worker said "kvcached call failed" and counted a daemon error."""
    caplog.set_level(logging.INFO, logger="kvcached_client")
    with worker_with_saved(daemon, 47, mode) as (kv, worker, keys), \
            daemon.connect(role="operator", timeout=30) as control:
        control.pause()
        worker.start_loads([BlockTransfer("l", keys, DST)])
        control.clear(tier="host")  # cancels the queued load
        control.resume()
        for layer in range(len(worker._layers)):
            worker.layer_ready(layer)
        worker.end_forward()
        assert worker.load_errors() == set(DST)
        finish(worker, "l")
        assert not worker.link.client.held_blocks() and not worker._holds.parked
        assert worker.counters["daemon_errors"] == 0 and worker.counters["load_errors"] == len(DST)
        assert "call failed" not in caplog.text and "ended (cancelled)" in caplog.text


def test_preempting_a_request_whose_load_went_unanswered_revokes_it_then_goes_on(
        daemon, monkeypatch, caplog):
    """preempt() waits for a held load's end: for one whose reply never came it has no task to
    wait on (it raised AttributeError), so it waits for the hold to lift, up to the timeout.
    Then the engine reuses the blocks: the daemon that wakes takes the load late, and copied it
    into them over the next request's KV; the load is revoked now and ends with nothing copied."""
    monkeypatch.setenv("KVCACHED_HANG_S", "0.5")
    with worker_with_saved(daemon, 41, "direct", timeout=1.0) as (kv, worker, keys):
        loaded = blocks_of(kv, SRC)
        process_stop.stop(daemon.pid)
        try:
            step(worker, loads=[BlockTransfer("l", keys, DST)])
            worker.preempt(["l"])
            assert "not confirmed ended: revoked" in caplog.text
            gen = torch.Generator().manual_seed(43)
            for row in parts_of(kv):  # the next request's KV in the blocks
                for t in row:
                    t[DST] = torch.randn(t[DST].shape, generator=gen).to(t.dtype)
            reused = blocks_of(kv, DST)
        finally:
            process_stop.go_on(daemon.pid)
        finish(worker, "l")  # the late load ended
        for got, theirs, late in zip(blocks_of(kv, DST), reused, loaded):
            assert not torch.equal(got, late), "the revoked load was copied into the reused blocks"
            assert torch.equal(got, theirs)


def test_preempting_a_request_whose_load_a_slow_daemon_has_queued_cancels_it_first(daemon, caplog):
    """The daemon is slow (paused: a request's load still queued past the client's timeout)
    when the engine preempts the request: preempt() cancels the load and the daemon confirms,
    so nothing lands in the blocks the engine reuses (before, it logged "not confirmed ended"
    and the queued load, run later, wrote its key's KV over the next request's)."""
    with worker_with_saved(daemon, 43, "direct", timeout=0.3) as (kv, worker, keys), \
            daemon.connect(role="operator") as control:
        control.pause()
        try:
            step(worker, loads=[BlockTransfer("l", keys, DST)])  # queued: its layer waits time out
            worker.preempt(["l"])  # in the next step
            for row in parts_of(kv):  # the engine writes another request's KV there
                for t in row:
                    t[DST] = 7
        finally:
            control.resume()
        wait_until(lambda: no_tasks(control), 10, "the daemon idle")
        assert all(bool((b == 7).all()) for b in blocks_of(kv, DST)), "the load landed after the reuse"
        assert "not confirmed ended" not in caplog.text
        finish(worker, "l")


def test_a_revoke_word_other_than_the_last_fence_word_is_refused():
    from kvcached_proto.errors import ProtocolError
    from kvcached_proto.layout import parse_layout
    from kvcached_proto.order_words import LOAD_REVOKE_WORD, REVOKE_WORD

    raw, kv = make_kv("LBNHC")
    layout = describe_kv_cache(kv)
    assert parse_layout(dict(layout, revoke_word=REVOKE_WORD)).revoke_word == REVOKE_WORD
    assert parse_layout(layout).revoke_word is None  # a 1.4 engine: every fence word is a fence
    for bad in (0, REVOKE_WORD + 1, "255", True):
        with pytest.raises(ProtocolError, match="revoke_word"):
            parse_layout(dict(layout, revoke_word=bad))
    assert parse_layout(dict(layout, load_revoke_word=LOAD_REVOKE_WORD)).load_revoke_word == 254
    assert parse_layout(layout).load_revoke_word is None  # a 1.13 engine: loads are not revoked
    for bad in (REVOKE_WORD, 0, "254"):
        with pytest.raises(ProtocolError, match="load_revoke_word"):
            parse_layout(dict(layout, load_revoke_word=bad))


def test_an_offload_whose_reply_never_came_is_revoked(daemon):
    """A hung daemon: the offload request gets no reply and the engine takes its blocks back.
    When the daemon resumes it still reads the request and copies the (reused) blocks: the
    revoke sent with the error makes it discard them instead of storing them."""
    from kvcached_proto.errors import DaemonUnavailable

    raw, kv = make_kv("LBNHC")
    fill(kv, seed=27)
    keys = keys_for(len(SRC), seed=29)
    with daemon.connect(timeout=10, hang_s=0.5) as c, daemon.connect(timeout=10) as probe:
        c.register_kv_cache(kv)
        process_stop.stop(daemon.pid)
        try:
            with pytest.raises(DaemonUnavailable):
                c.offload(SRC, keys)
            for row in parts_of(kv):  # the engine reuses the blocks
                for t in row:
                    t[SRC] = 1
        finally:
            process_stop.go_on(daemon.pid)

        def ended() -> list:
            try:
                c.poll_events()
            except DaemonUnavailable:  # its heartbeat is stale until it beats again
                return []
            return [e for e in c._events.values() if e.get("status") is not None]

        wait_until(lambda: ended(), 20, "the daemon ran the offload it took late")
        assert [e["status"] for e in ended()] == ["cancelled"]
        assert probe.lookup(keys) == (0, 0)


class _FakeLink:
    client = None  # (no daemon attached)

    def __init__(self):
        self.failures = []

    def failed(self, exc):
        self.failures.append(exc)


class _FakeClient:
    timeout = 0.5

    def __init__(self):
        self.holds = {}

    def hold(self, task_id, blocks):
        self.holds[task_id] = list(blocks)

    def held_tasks(self):
        return set(self.holds)


class _QueuedLoad:
    """A CUDA load as the worker core sees it: each layer wait returns once the copies are
    queued (the engine's stream waits, not the CPU); `end` is how it ends (None: its daemon
    is gone and the end never comes)."""
    id, num_blocks, valid_blocks, status = 7, len(DST), len(DST), None

    def __init__(self, end):
        self.end, self.result = end, None

    def wait_layer(self, layer):
        pass

    def wait_end(self, timeout):
        if self.end is None:
            raise DaemonUnavailable("the daemon is gone")
        self.result = self.end


@pytest.mark.parametrize("end, loaded", [(None, 0), ({"loaded": 4}, 4),
                                         ({"loaded": len(DST)}, len(DST))])
def test_a_direct_load_counts_as_loaded_only_once_its_copies_ended(end, loaded):
    """Pure logic (fakes): every layer wait of a direct-mode load returned, yet its daemon died
    mid-copy (or ended it short): the step's load_errors report what it did not complete, so
    the engine recomputes them instead of keeping what its forward read."""
    worker = KVWorker(_FakeLink())
    worker.mode, worker._layers = "direct", ["layer.0", "layer.1"]
    client = _FakeClient()
    worker._loads.append(_Load("r", _QueuedLoad(end), client, list(DST), [], len(DST)))
    worker.layer_ready(1)
    worker.end_forward()
    worker.start_saves([])
    assert worker.finished(set()) == set()
    assert worker.load_errors() == set(DST[loaded:])
    assert worker.counters["loaded_blocks"] == loaded
    assert len(worker.link.failures) == (end is None)
    assert worker.load_errors() == set(), "reported once"


def test_close_unlinks_the_staging_segment_at_once(daemon):
    """vLLM runs the connector's shutdown() and then kills its worker: the staging segment's
    finalizer never ran and every stop of `vllm serve` left it in /dev/shm."""
    def mine():
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"kvcached.{os.getuid()}.kv.{os.getpid()}.")}

    raw, kv = make_kv("LBNHC")
    engine = {a["name"].lstrip("/") for a in describe_kv_cache(kv)["allocations"]}
    before = mine()  # (other tests' segments not collected yet are among them, and may go)
    worker, mode = make_worker(daemon, kv, direct=False)
    assert mode == "staging"
    staging = mine() - before
    assert staging and not staging & engine
    worker.close()
    assert worker._staging is not None  # still mapped (a step could be running): the names go
    assert not staging & mine() and engine <= mine()  # the engine's own KV keeps its name
