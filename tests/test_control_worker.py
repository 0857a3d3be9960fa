"""The control worker (kvcached/server/control.py): the ops that may block - a drain of the
copies in flight, a storage clear or delete, mapping or dropping a registration - run off the
request thread, which answers every other client meanwhile, and one at a time in the order they
came. Here the drains wait on a fetch held by a hung read (a FUSE shard) until the disk tier's
3 s I/O deadline."""
import threading
import time

import pytest

from conftest import wait_until
from kvcached_client import Client, KvcachedTimeout
from kvcached_proto import ErrorCode, RequestError
from storage_util import start, stored_with_one_record_hung


@pytest.mark.slow
def test_a_gone_engines_mapping_is_dropped_off_the_request_thread(run_dir, instance, disk_dir):
    """An engine says bye while its load's fetch waits on a hung read (the tier's I/O deadline
    is 3 s): its KV mapping goes only after the copies in flight drained, on the control worker,
    so another client's ping and status are answered while the mapping is still there (before:
    the request thread drained, and they were answered after it was gone). Meanwhile the
    mapping serves no op, not even one from a hello that reuses the gone client's id."""
    kv, keys, expected, uri, fs = stored_with_one_record_hung(run_dir, instance, disk_dir, 2, 3)
    h = None
    try:
        h = start(run_dir, instance, uri)
        with h.connect(timeout=10) as other:
            c = h.connect(timeout=10)
            c.register_kv_cache(kv)
            c.load(keys, list(range(20, 28)))
            wait_until(lambda: fs.held, 5, "the fetch reaching the hung read")
            c.close()  # bye: its tasks are cancelled, its mapping is to go
            wait_until(lambda: other.status()["clients"] == 1, 5, "the bye")
            assert other.ping() >= 0
            s = other.status()
            assert s["kv"]["registered"] is True  # answered while the drain waits
            assert "is gone" in s["kv"]["lost"]
            # meanwhile no one copies through the mapping: not even a hello reusing its id
            impostor = Client(instance, run_dir, timeout=5)
            impostor.client_id = c.client_id
            impostor._open()
            with pytest.raises(RequestError) as e:
                impostor.load(keys, list(range(20, 28)))
            assert e.value.code == ErrorCode.KV_MISMATCH
            with pytest.raises(RequestError) as e:
                impostor.pause()  # nor act as the engine that registered it
            assert e.value.code == ErrorCode.FORBIDDEN
            impostor.close()
            wait_until(lambda: other.status()["kv"]["registered"] is False, 15, "the mapping dropped")
            assert other.check() == "ok"
    finally:
        fs.close()
        if h is not None:
            h.stop()


@pytest.mark.faults
@pytest.mark.slow
def test_a_drain_waiting_on_a_hung_read_does_not_hold_the_request_thread(run_dir, instance, disk_dir):
    """pause drains the copies in flight: here a fetch held by a hung read until the tier's
    3 s I/O deadline. The drain runs on the control worker, so another client's ping, lookup
    and status are answered while the pause is still waiting (before: after it)."""

    kv, keys, expected, uri, fs = stored_with_one_record_hung(run_dir, instance, disk_dir, 2, 3)
    h = None
    try:
        h = start(run_dir, instance, uri)
        with h.connect(timeout=10) as c, h.connect(timeout=10) as other:
            c.register_kv_cache(kv)
            load = c.load(keys, list(range(20, 28)))
            wait_until(lambda: fs.held, 5, "the fetch reaching the hung read")
            paused = threading.Thread(target=c.pause)
            paused.start()
            time.sleep(0.2)  # the pause is at the daemon, waiting for the fetch to drain
            assert other.ping() >= 0 and other.lookup(keys[:1]) is not None
            assert other.status()["instance"] == instance
            assert paused.is_alive(), "the pause ended before the other client was answered"
            paused.join(15)
            assert not paused.is_alive()
            c.resume()
            assert load.wait(10) == 2
            assert c.check() == "ok"
    finally:
        fs.close()  # the late read ends (EIO): the daemon's process can exit
        if h is not None:
            h.stop()


@pytest.mark.faults
@pytest.mark.slow
def test_a_resume_sent_while_a_pause_drains_is_run_after_it(run_dir, instance, disk_dir):
    """An operator's pause waits for the copies in flight; its client gives up (timeout) and
    sends resume. The resume ran at once on the request thread and the pause landed after it:
    the daemon stayed paused, every load after queued for ever. resume is a control op now, run
    after the pause it follows."""
    kv, keys, expected, uri, fs = stored_with_one_record_hung(run_dir, instance, disk_dir, 2, 3)
    h = None
    try:
        h = start(run_dir, instance, uri)
        with h.connect(timeout=10) as c, h.connect(role="operator", timeout=10) as op:
            c.register_kv_cache(kv)
            load = c.load(keys, list(range(20, 28)))
            wait_until(lambda: fs.held, 5, "the fetch reaching the hung read")
            with pytest.raises(KvcachedTimeout):
                op.pause(timeout=0.3)  # (the pause itself goes on at the daemon)
            op.resume()
            assert load.wait(10) == 2
            c.delete([keys[7]])  # a control op of the engines' lane: after the pause and resume
            assert op.status()["state"] == "normal"
            assert c.load(keys[:2], list(range(30, 32))).wait(5) == 2, "a load after is not run"
    finally:
        fs.close()
        if h is not None:
            h.stop()
