"""A load sent whose reply never came: the daemon hung after the request left (SIGSTOP), and
the client gave up on it at the hang threshold. A daemon that wakes still reads the request and
copies into the blocks the engine named, so those blocks stay held until the daemon's late reply
refuses the load, the load it made ends, or the daemon is gone. Without the hold, the engine
handed the blocks to another request and the late copy overwrote its KV. The same holds for a
load the daemon answered, when the engine's wait for it finds the daemon hung."""
from __future__ import annotations

import contextlib
import os
import signal

import pytest
import torch

from conftest import keys_for, ranks, small_kv, sweep_crashed, unique_instance, wait_until
from kvcached_client import DaemonUnavailable, GroupClient, PrefixCacheManager, launch
from kvcached_proto import KvcachedError
from kvcached.bench import process_stop

SRC, DST, SRC2 = [0, 1, 2, 3], [8, 9, 10, 11], [4, 5, 6, 7]


def _fill(kv, blocks, value) -> None:
    for k, v in kv:
        k[blocks] = value
        v[blocks] = value


def _all(kv, blocks, value) -> bool:
    return all(bool((k[blocks] == value).all()) and bool((v[blocks] == value).all()) for k, v in kv)


def _stopped_load(daemon, c, keys, blocks):
    """Send a load to the stopped daemon; returns the error it raised (the daemon stays stopped)."""
    process_stop.stop(daemon.pid)
    try:
        with pytest.raises(DaemonUnavailable) as e:
            c.load(keys, blocks)
    except BaseException:
        process_stop.go_on(daemon.pid)
        raise
    return e.value


def test_its_blocks_stay_held_until_the_load_the_daemon_took_late_ends(daemon):
    kv = small_kv(num_layers=2, num_blocks=16)
    keys = keys_for(len(SRC), 41)
    with daemon.connect(timeout=30, hang_s=0.5) as c:
        c.register_kv_cache(kv)
        _fill(kv, SRC, 3)
        c.offload(SRC, keys).wait(10)
        _fill(kv, DST, 5)
        try:
            err = _stopped_load(daemon, c, keys, DST)
            assert err.held_blocks == DST and "stay held" in str(err)
            assert c.held_blocks() == set(DST), "a load that may still be taken is not held"
            assert not err.unanswered.done()
        finally:
            process_stop.go_on(daemon.pid)
        wait_until(lambda: err.unanswered.done(), 20, "the late load's end")
        # the daemon did take it: the copy landed in the blocks while they were held
        assert _all(kv, DST, 3), "the late load did not run (the test proves nothing)"
        assert c.held_blocks() == set() and not c._unanswered and not c._late_loads
        assert not c._events, "the late load's end event is nobody's: not kept"
        _fill(kv, DST, 7)  # now the engine reuses them: nothing overwrites them
        assert c.status()["tasks"]["inflight"] == 0 and _all(kv, DST, 7)


@pytest.mark.parametrize("wait", ["wait", "wait_layer"])
def test_a_load_whose_wait_finds_the_daemon_hung_holds_its_blocks_until_it_ends(daemon, wait):
    """The load was answered and queued (the daemon paused), then the daemon froze: the wait
    (for its end, or a layer) raises DaemonUnavailable at the hang threshold, and nothing
    cancelled the load, so a daemon that wakes runs it. Its blocks stay held until its end (they
    were free at once before: an engine could hand them on, and SGLang's backend did)."""
    kv = small_kv(num_layers=2, num_blocks=16)
    keys = keys_for(len(SRC), 47)
    with daemon.connect(timeout=30, hang_s=0.5) as c, daemon.connect(role="operator", timeout=30) as owner:
        c.register_kv_cache(kv)
        _fill(kv, SRC, 3)
        c.offload(SRC, keys).wait(10)
        _fill(kv, DST, 5)
        owner.pause()  # the load answered, and queued
        task = c.load(keys, DST)
        process_stop.stop(daemon.pid)
        try:
            with pytest.raises(DaemonUnavailable, match="stay held") as e:
                task.wait(10) if wait == "wait" else task.wait_layer(1, timeout=10)
            assert e.value.held_blocks == DST and c.held_blocks() == set(DST)
            assert str(e.value).count("stay held") == 1
            assert _all(kv, DST, 5)
        finally:
            process_stop.go_on(daemon.pid)
        owner.resume()
        wait_until(lambda: c.held_blocks() == set(), 20, "the hold lifted at the load's end")
        # the daemon did run it once awake: the copy landed while the blocks were held
        assert _all(kv, DST, 3), "the load did not run (the test proves nothing)"
        assert task.done() and c.status()["tasks"]["inflight"] == 0


@contextlib.contextmanager
def _paused_with_stored(daemon, seed: int):
    """SRC stored (3s), DST 5s and SRC2 6s in the engine's KV, the daemon paused by an operator
    (what is sent is answered and queued): yields (client, kv, SRC's keys, the operator, who
    resumes it - at the latest when the block ends)."""
    kv = small_kv(num_layers=2, num_blocks=16)
    keys = keys_for(len(SRC), seed)
    with daemon.connect(timeout=30) as c, daemon.connect(role="operator", timeout=30) as owner:
        c.register_kv_cache(kv)
        _fill(kv, SRC, 3)
        c.offload(SRC, keys).wait(10)
        _fill(kv, DST, 5)
        _fill(kv, SRC2, 6)
        owner.pause()
        try:
            yield c, kv, keys, owner
        finally:
            owner.resume()


def test_a_revoked_load_copies_no_layer_not_begun_and_a_later_load_runs(daemon):
    """The engine reuses a load's blocks before its end (a preempted request, with the daemon
    hung: its cancel is read only after it woke, by when its copy thread had copied the next
    layers into them): the revoke, in shared memory, is read before each layer. The load ends
    cancelled with nothing copied; a load sent after the revoke runs as any other."""
    with _paused_with_stored(daemon, 49) as (c, kv, keys, owner):
        revoked = c.load(keys, DST)
        c.revoke(revoked)
        later = c.load(keys, SRC2)
        owner.resume()
        assert revoked.wait(10) == 0 and revoked.status.name == "CANCELLED"
        assert _all(kv, DST, 5), "a revoked load was copied"
        assert later.wait(10) == len(SRC) and _all(kv, SRC2, 3)


def test_an_offload_revoked_stops_no_load_sent_before_it(daemon):
    """Loads have a revoke word of their own: an offload revoked (its reply never came, say)
    discards that offload, not the loads the engine still waits for (with one word, a load sent
    before it ended cancelled: a lost hit - seen at a graceful stop, whose refused offload
    revoked the load the stop was draining)."""
    with _paused_with_stored(daemon, 53) as (c, kv, keys, owner):
        load = c.load(keys, DST)
        offload = c.offload(SRC2, keys_for(len(SRC2), 55))
        c.revoke(offload)
        owner.resume()
        assert offload.wait(10)["stored"] == 0 and offload.status.name == "CANCELLED"
        assert load.wait(10) == len(SRC) and _all(kv, DST, 3)


def test_a_reply_read_by_another_thread_before_the_hold_is_made_is_not_lost(daemon):
    """The reply comes just after the wait gave up, and a pump files it before the client
    registers the hold: the hold must still follow it (it stayed forever: blocks lost)."""
    kv = small_kv(num_layers=2, num_blocks=16)
    keys = keys_for(len(SRC), 51)
    with daemon.connect(timeout=30, hang_s=0.5) as c:
        c.register_kv_cache(kv)
        c.offload(SRC, keys).wait(10)
        hold = c._hold_unanswered

        def reply_meanwhile(rid, blocks, exc, fence=0):
            wait_until(lambda: (c._pump(0.01), rid in c._replies)[1], 10, "the late reply")
            return hold(rid, blocks, exc, fence)

        c._hold_unanswered = reply_meanwhile
        real_reply = c._reply

        def give_up(rid, op, timeout, forget=True):  # the wait ends before the reply is read
            raise DaemonUnavailable("gave up")
        c._reply = give_up
        with pytest.raises(DaemonUnavailable) as e:
            c.load(keys, DST)
        c._reply = real_reply
        wait_until(lambda: e.value.unanswered.done(), 10, "the load's end")
        assert c.held_blocks() == set() and not c._replies


def test_a_late_refusal_lifts_the_hold_at_once(daemon):
    kv = small_kv(num_layers=2, num_blocks=16)
    with daemon.connect(timeout=30, hang_s=0.5) as c:
        c.register_kv_cache(kv)
        try:  # block 99 is past the registered 16: the daemon refuses it when it wakes
            err = _stopped_load(daemon, c, keys_for(2, 43), [8, 99])
            assert c.held_blocks() == {8, 99}
        finally:
            process_stop.go_on(daemon.pid)
        wait_until(lambda: err.unanswered.done(), 20, "the refusal read")
        assert not c._events and not c._replies, "the late refusal is nobody's: not kept"


def test_a_daemon_gone_lifts_the_hold(run_dir):
    instance = unique_instance("ul")
    handle = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
    try:
        kv = small_kv(num_layers=2, num_blocks=16)
        c = handle.connect(timeout=30, hang_s=0.5)
        try:
            c.register_kv_cache(kv)
            _stopped_load(handle, c, keys_for(2, 45), [8, 9])
            assert c.held_blocks() == {8, 9}
            os.kill(handle.pid, signal.SIGKILL)
            handle.proc.wait(10)
            assert c.held_blocks() == set(), "a daemon that is gone writes nothing"
        finally:
            c.close()
    finally:
        handle.stop()
        sweep_crashed(instance)


def test_a_group_holds_what_the_other_ranks_still_write_when_one_refuses(run_dir):
    """Rank 1 refuses the load (its KV has fewer blocks) while rank 0's runs: the error is
    raised with rank 0's blocks held until its load ended (they were handed back at once)."""
    with ranks(run_dir, 2) as (names, handles):
        kv = [small_kv(num_layers=2, num_blocks=32), small_kv(num_layers=2, num_blocks=8)]
        keys = keys_for(4, 47)
        with GroupClient.connect(names, run_dir=run_dir, timeout=10) as g, \
                handles[0].connect(role="operator") as op:
            g.register_kv_cache(kv)
            g.offload(SRC, keys).wait(10)
            op.pause()  # rank 0's load stays queued: still to write its blocks
            with pytest.raises(KvcachedError, match="block"):
                g.load(keys, [20, 21, 22, 23])
            assert g.held_blocks() >= {20, 21, 22, 23}
            op.resume()
            wait_until(lambda: not g.held_blocks(), 20, "rank 0's load ending")


def test_a_group_keeps_holding_a_hung_ranks_unanswered_load(run_dir):
    with ranks(run_dir, 2) as (names, handles):
        kv = [small_kv(num_layers=2, num_blocks=32, seed=r) for r in range(2)]
        keys = keys_for(4, 49)
        with GroupClient.connect(names, run_dir=run_dir, timeout=30, hang_s=0.5) as g:
            g.register_kv_cache(kv)
            g.offload(SRC, keys).wait(10)
            process_stop.stop(handles[1].pid)
            try:
                task = g.load(keys, [20, 21, 22, 23])
                assert task.num_blocks == 0 and list(g.missing) == [1]
                assert g.held_blocks() >= {20, 21, 22, 23}, "the hung rank may still write them"
            finally:
                process_stop.go_on(handles[1].pid)
            wait_until(lambda: not g.held_blocks(), 20, "both ranks' loads ending")
            for r in range(2):
                assert all(torch.equal(kv[r][i][j][SRC], kv[r][i][j][[20, 21, 22, 23]])
                           for i in range(2) for j in range(2)), "the late load did not run"


def test_the_prefix_manager_does_not_hand_out_an_unanswered_loads_blocks(daemon):
    """The daemon hangs between the manager's lookup and its load request."""
    bs = 16
    kv = small_kv(num_layers=2, num_blocks=12, block_shape=(bs, 2, 8))
    prompt = list(range(300, 300 + 3 * bs))
    client = daemon.connect(timeout=30.0, hang_s=0.5)
    mgr = PrefixCacheManager(12, bs, client=client, namespace="ul", kv_caches=kv)
    try:
        mgr.match("a", prompt + [1])
        mgr.allocate("a", len(prompt) + 1)
        mgr.commit("a", len(prompt) + 1)
        mgr.release("a")
        mgr.settle(10)
        mgr.drop_gpu_cache()
        lookup = client.lookup

        def lookup_then_hang(keys, timeout=None):
            found = lookup(keys, timeout)
            process_stop.stop(daemon.pid)
            return found

        client.lookup = lookup_then_hang
        try:
            hit = mgr.match("b", prompt + [2])
            assert hit.host_tokens == 0 and not mgr.attached
            held = mgr.blocks.holds.held()
            assert len(held) == 3, "the blocks the load named are handed out"
        finally:
            process_stop.go_on(daemon.pid)
        wait_until(lambda: not mgr.blocks.holds.held(), 20, "the late load's end")
        mgr.release("b")
    finally:
        mgr.close()
