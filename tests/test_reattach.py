"""A daemon fault costs the engine at most one step: attaching runs in the background (the
engine's calls never wait for a daemon to come), and a hung daemon's loads in flight fail once
the hang threshold passes."""
import threading

import pytest

from kvcached.bench import process_stop
from conftest import small_kv, sweep_crashed, wait_until
from kvcached_client import (
    BlockHasher,
    Client,
    DaemonUnavailable,
    KvcachedError,
    PrefixCacheManager,
    Reattacher,
    launch,
)

BS = 16
NS = "reattach"


class _Conn:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_take_never_waits_for_an_attempt_in_progress():
    """Pure logic: the connect function blocks; take() answers None meanwhile, and hands the
    connection over once the background made it."""
    gate, entered = threading.Event(), threading.Event()

    def connect():
        entered.set()
        gate.wait(30)
        return _Conn()

    r = Reattacher(connect, every_s=0.01)
    try:
        assert r.take() is None
        assert entered.wait(10)
        assert r.take() is None  # the attempt is still blocked: no waiting on it
        gate.set()
        got = []
        wait_until(lambda: got.append(r.take()) or got[-1] is not None)
        assert isinstance(got[-1], _Conn) and not got[-1].closed
    finally:
        gate.set()
        r.close()


def test_failed_attempts_and_preparations_are_tried_again_and_closed():
    outcomes = [DaemonUnavailable("not yet"), OSError("socket trouble"), "prepare fails", "ok"]
    made = []

    def connect():
        what = outcomes.pop(0)
        if isinstance(what, Exception):
            raise what
        made.append(_Conn())
        made[-1].what = what
        return made[-1]

    def prepare(conn):
        if conn.what == "prepare fails":
            raise KvcachedError("registration refused")

    r = Reattacher(connect, prepare, every_s=0.01)
    got = []
    wait_until(lambda: got.append(r.take()) or got[-1] is not None)
    assert got[-1].what == "ok" and made[0].closed and not got[-1].closed
    assert r.attempts == 4 and r.last_error == ""
    r.close()


def test_a_daemon_that_refuses_the_preparation_is_asked_less_and_less_often():
    """The daemon answers but refuses (e.g. KV_IN_USE while the old registration lingers):
    the waits between attempts double up to REFUSED_BACKOFF_MAX_S; no daemon at all keeps the
    short period (a restarting daemon is attached soon after it is up)."""
    import kvcached_client.reattach as ra

    waits, refused = [], threading.Event()

    class Recorder:  # stands in for the thread's stop event: records each wait, waits not
        def wait(self, timeout):
            waits.append(timeout)
            if len(waits) >= 8:
                refused.set()  # enough: the thread's loop ends
            return False

        def is_set(self):
            return refused.is_set()

        def set(self):
            refused.set()

        def clear(self):
            pass

    def prepare(conn):
        raise KvcachedError("KV_IN_USE")

    r = Reattacher(_Conn, prepare, every_s=0.25)
    r._stop = Recorder()
    assert r.take() is None
    wait_until(refused.is_set)
    r.close()
    assert waits[:5] == [0.5, 1.0, 2.0, 2.0, 2.0] and max(waits) == ra.REFUSED_BACKOFF_MAX_S
    gone = Reattacher(lambda: (_ for _ in ()).throw(DaemonUnavailable("no daemon")), every_s=0.25)
    waits.clear()
    refused.clear()
    gone._stop = Recorder()
    assert gone.take() is None
    wait_until(refused.is_set)
    gone.close()
    assert set(waits) == {0.25}


def test_close_closes_a_connection_made_ready_and_never_taken():
    conn = _Conn()
    r = Reattacher(lambda: conn, every_s=0.01)
    assert r.take() is None
    wait_until(lambda: r._ready is not None)
    r.close()
    assert conn.closed and r.take() is None


def test_a_client_reattacher_follows_the_daemon_across_a_kill_and_a_restart(run_dir, instance):
    kv = small_kv(num_layers=2, num_blocks=8, block_shape=(BS, 2, 8))
    r = Client.reattacher(kv_caches=kv, instance=instance, run_dir=run_dir, timeout=5.0)
    try:
        assert r.take() is None  # no daemon: None at once, attempts go on
        first = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
        got = []
        wait_until(lambda: got.append(r.take()) or got[-1] is not None)
        c = got[-1]
        assert c.status()["kv"]["registered"] and c.info["pid"] == first.pid
        first.kill()
        with pytest.raises(DaemonUnavailable, match="has exited"):
            c.ping()
        c.close()
        assert r.take() is None
        second = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
        try:
            got = []
            wait_until(lambda: got.append(r.take()) or got[-1] is not None)
            assert got[-1].info["pid"] == second.pid and got[-1].status()["kv"]["registered"]
            got[-1].close()
        finally:
            second.stop()
    finally:
        r.close()
        sweep_crashed(instance)


def test_a_load_in_flight_on_a_hung_daemon_fails_after_the_hang_threshold(daemon):
    """The load is accepted, then the daemon stops (SIGSTOP): the layer wait raises
    DaemonUnavailable once the heartbeat is older than hang_s, not after the client's timeout."""
    kv = small_kv(num_layers=2, num_blocks=8, block_shape=(BS, 2, 8))
    keys = BlockHasher(NS).hash_blocks(list(range(4 * BS)), BS)
    c = daemon.connect(timeout=60.0, hang_s=0.5)
    try:
        c.register_kv_cache(kv)
        c.offload(range(4), keys).wait(10)
        c.pause()  # the load below is accepted and queued: in flight, deterministically
        task = c.load(keys, range(4, 8))
        assert task.num_blocks == 4
        process_stop.stop(daemon.pid)
        try:
            with pytest.raises(DaemonUnavailable, match="hang threshold is 0.5 s"):
                task.wait_layer(0)
            with pytest.raises(DaemonUnavailable):
                c.lookup(keys)  # every later call says so too, until the daemon beats again
        finally:
            process_stop.go_on(daemon.pid)
        wait_until(lambda: _beating(c))
        c.resume()
        assert task.wait(10) == 4  # resumed, the daemon finishes it: nothing was lost
    finally:
        c.close()


def _beating(client):
    try:
        client.status_block.check_alive()
        return True
    except DaemonUnavailable:
        return False


def test_the_prefix_manager_recomputes_a_load_a_hung_daemon_holds_and_goes_on(daemon):
    kv = small_kv(num_layers=2, num_blocks=12, block_shape=(BS, 2, 8))
    prompt = list(range(100, 100 + 3 * BS))
    client = daemon.connect(timeout=60.0, hang_s=0.5)
    mgr = PrefixCacheManager(12, BS, client=client, namespace=NS, kv_caches=kv)
    operator = daemon.connect(role="operator")
    try:
        mgr.match("a", prompt + [1])
        mgr.allocate("a", len(prompt) + 1)
        mgr.commit("a", len(prompt) + 1)  # write-through
        mgr.release("a")
        mgr.settle(10)
        mgr.drop_gpu_cache()
        operator.pause()
        hit = mgr.match("b", prompt + [2])
        assert hit.host_tokens == 3 * BS  # the load is issued and queued
        process_stop.stop(daemon.pid)
        try:
            assert mgr.wait_loaded("b") == 0  # failed after hang_s: the engine computes it all
            assert not mgr.attached and mgr.stats()["detaches"] == 1
            assert mgr.match("c", list(range(900, 900 + 2 * BS)) + [3]).host_tokens == 0
            # the hung daemon may still write the load's blocks: they are not handed out
            assert set(hit.block_ids) <= mgr.blocks.holds.held()
        finally:
            process_stop.go_on(daemon.pid)
        operator.resume()
        mgr.release("b")
        mgr.release("c")
    finally:
        operator.close()
        mgr.close()


def test_a_daemon_restarted_between_two_calls_is_attached_before_the_next(run_dir, instance):
    """No manager call happens while the daemon is replaced: the watching thread prepares the
    successor (connected, KV registered), and the next call runs on it, not on the dead one."""
    kv = small_kv(num_layers=2, num_blocks=12, block_shape=(BS, 2, 8))
    first = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
    mgr = PrefixCacheManager(12, BS, client=first.connect(timeout=5.0), namespace=NS, kv_caches=kv)
    try:
        first.stop()
        with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05) as second:
            wait_until(mgr.link.has_ready)
            prompt = list(range(500, 500 + 2 * BS))
            mgr.match("a", prompt + [1])
            assert mgr.client.info["pid"] == second.pid and mgr.stats()["attaches"] == 2
            mgr.allocate("a", len(prompt) + 1)
            mgr.commit("a", len(prompt) + 1)  # write-through reaches the successor
            mgr.release("a")
            mgr.settle(10)
            with second.connect() as c:
                assert c.lookup(BlockHasher(NS).hash_blocks(prompt, BS))[0] == 2
            mgr.close()
    finally:
        mgr.close()
        sweep_crashed(instance)
