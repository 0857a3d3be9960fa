"""A delete leaves nothing of the keys readable, whatever was under way: backups queued or
writing when it came, a disk write begun before it that lands after it. Against a real daemon
and redis-server; the disk tier's own logic in process, on a real directory (the storage
flow's ordering with a held write: tests/test_load_flow.py)."""
import threading

from conftest import keys_for, small_kv, wait_until
from kvcached.storage.disk import DiskBackend
from storage_util import PAGE_SHAPE, files, offload_and_flush, start

GEOMETRY = bytes(range(16))


def test_backups_queued_at_a_delete_never_put_back_what_it_deleted(run_dir, instance, redis_server):
    """The server holds writes for 0.7 s: the first offload's backup waits on it, the second's
    is queued behind when the delete comes. Before, the queued backup stored the deleted keys
    after the delete, and they were storage hits."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    first, second = keys_for(8, 50), keys_for(8, 51)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            redis_server.client().execute_command("CLIENT", "PAUSE", 700, "WRITE")
            c.offload(list(range(8)), first).wait(10)  # its backup waits on the server
            c.offload(list(range(8, 16)), second).wait(10)  # its backup is queued behind
            c.delete(second)
            c.flush().wait(10)
            assert c.lookup(second) == (0, 0) and c.lookup(first) == (8, 0)
            assert redis_server.client().dbsize() == 8  # first's, and no more
            assert c.status()["storage_io"]["backup_dropped"] == 8
            c.clear(tier="host")
            assert c.lookup(first) == (0, 8) and c.lookup(second) == (0, 0)
            offload_and_flush(c, kv, second, list(range(8, 16)))  # stored again once offloaded
            c.clear(tier="host")
            assert c.lookup(second) == (0, 8)
    finally:
        h.stop()


def _page(seed: int) -> list:
    return [memoryview(bytes([seed]) * 4096)]


def test_a_disk_write_begun_before_a_delete_of_its_key_and_landing_after_it_is_void(tmp_path):
    """A write held in the filesystem past the tier's deadline, a delete of its key, then the
    write returns: its record is removed, never indexed (before, the key was back). A write of
    another key held beside it is not touched."""
    root = str(tmp_path / "disk")
    key, other = b"\x07" * 16, b"\x08" * 16
    disk = DiskBackend(root, 1 << 30, io_timeout_s=0.2)
    held, write = threading.Event(), disk._write

    def slow_write(*args):
        assert held.wait(10)
        return write(*args)

    try:
        assert disk.indexed.wait(10)
        disk._write = slow_write
        assert disk.put([key, other], [_page(1), _page(2)], GEOMETRY) == [None, None]  # late
        assert disk.delete([key]) == 0  # not indexed yet
        held.set()
        wait_until(disk.health, 5, "the late writes returned")
        assert disk.exists_prefix([key]) == 0 and disk.exists_prefix([other]) == 1
        assert len(files(root)) == 1 and disk.usage()["blocks"] == 1
        assert disk.put([key], [_page(3)], GEOMETRY) == [True] and disk.exists_prefix([key]) == 1
    finally:
        held.set()
        disk.close()


def test_a_delete_a_stopped_redis_server_missed_says_so(run_dir, instance, redis_server):
    """SIGSTOP on the server: the delete cannot reach it, and its reply names the tier (before,
    it said 0 stored blocks deleted, as for keys never stored)."""
    import os
    import signal

    from kvcached_proto import Op, pack_keys

    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(4, 52)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(4)))
            uri = c.status()["storage"][0]["uri"]
            def delete(ks):
                r = c._request(Op.DELETE, None, keys=pack_keys(ks))
                return r["deleted"], r["storage_deleted"], r["storage_missed"]

            assert delete(keys[:2]) == (2, 2, [])
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: not c.status()["storage"][0]["healthy"], 5, "the tier down")
                reply = delete(keys[2:])
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
            assert reply == (2, 0, [uri])
    finally:
        h.stop()
