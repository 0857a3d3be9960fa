"""A clear leaves nothing readable of what was stored before it (after a weight update, the old
weights' KV), whatever was under way: backups queued behind a slow write, a store that is down
when the clear comes, a stop before the disk tier's files are gone, a disk write begun before
the clear that lands after it. Against real daemons and redis-servers; the disk tier's own
logic in process, on a real directory."""
import errno
import os
import subprocess
import sys

from conftest import disk_uri, keys_for, small_kv, wait_until
from kvcached.storage.disk import DiskBackend
from kvcached.storage.disk_clear import MARK
from kvcached.storage.owed_clear import OwedRecord
from storage_util import (PAGE_SHAPE, backups_behind_a_paused_server, files, nothing_owed, offload_and_flush,
                          redis_stopped, start, writes_held)

GEOMETRY = bytes(range(16))


def test_backups_queued_at_a_clear_never_put_back_what_it_cleared(run_dir, instance, redis_server):
    """The server holds writes for 0.7 s: the first offload's backup waits on it, the second's
    is queued behind when the clear comes. The queued one is dropped (it was written after the
    clear, and its blocks were storage hits from then on)."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    first, second = keys_for(8, 40), keys_for(8, 41)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            backups_behind_a_paused_server(c, redis_server, first, second)
            c.clear(weights_update=True)
            c.flush().wait(10)
            assert c.lookup(first) == (0, 0) and c.lookup(second) == (0, 0)
            assert redis_server.client().dbsize() == 0
            s = c.status()
            assert s["storage"][0]["healthy"] and s["storage_io"]["backup_dropped"] >= 8
            offload_and_flush(c, kv, second, list(range(8, 16)))  # stored again once offloaded
            c.clear(tier="host")
            assert c.lookup(second) == (0, 8)
    finally:
        h.stop()


def test_a_clear_the_redis_server_missed_is_done_before_the_tier_serves_again(
        run_dir, instance, redis_server):
    """SIGSTOP on the server, then a clear: it is owed. Once the server answers again the probe
    clears it before the tier serves: the old blocks are no hits (they were, after SIGCONT)."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(8, 42)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(8)))
            with redis_stopped(c, redis_server):
                c.clear(weights_update=True)
                stopped = c.status()["storage"][0]
            wait_until(lambda: c.status()["storage"][0]["healthy"], 5, "the tier back, cleared")
            assert c.lookup(keys) == (0, 0) and redis_server.client().dbsize() == 0
            assert stopped.get("clear_owed") and "clear is owed" in stopped["last_error"]
            assert not c.status()["storage"][0]["clear_owed"]
    finally:
        h.stop()


def test_a_clear_owed_when_the_daemon_stops_is_owed_by_the_next_one(run_dir, instance, redis_server):
    """The server is stopped when the clear comes, and the daemon is stopped before the server
    answers again: the next daemon on the instance owes the clear (a file in the run dir) and
    does it before its tier serves."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(8, 44)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(8)))
            with redis_stopped(c, redis_server):
                c.clear(weights_update=True)
                h.stop()  # before the server answers again
        h = start(run_dir, instance, redis_server.uri)
        with h.connect() as c:
            c.register_kv_cache(kv)
            wait_until(lambda: c.status()["storage"][0]["healthy"], 5, "the tier back, cleared")
            assert c.lookup(keys) == (0, 0) and redis_server.client().dbsize() == 0
        assert nothing_owed(os.path.join(run_dir, f"{instance}.clears-owed"))
    finally:
        h.stop()


def test_an_operator_clears_a_tier_or_all_from_the_cli(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(8, 43)
    h = start(run_dir, instance, disk_uri(disk_dir))

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "kvcached", "clear", "--instance", instance,
                              "--run-dir", run_dir, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(8)))
            assert "cleared 8 blocks" in cli("--tier", "host")
            assert c.lookup(keys) == (0, 8)
            c.load(keys, list(range(20, 28))).wait(10)  # back in the host tier too
            assert c.lookup(keys) == (8, 0)
            # a weight update clears every tier, whatever the tier asked
            assert "cleared 16 blocks" in cli("--tier", "storage", "--weights-update")
            assert c.lookup(keys) == (0, 0) and c.status()["state"] == "cleared"
            wait_until(lambda: not files(disk_dir), 5, "the records removed")
    finally:
        h.stop()


def _page(seed: int) -> list:
    return [memoryview(bytes([seed]) * 4096)]


def test_a_disk_clear_cut_short_by_a_stop_is_finished_at_the_next_start(tmp_path):
    """The files of a clear go after its answer; a stop before they are gone (here: they never
    go) leaves its mark, and the next start removes every record it finds instead of indexing
    it."""
    root = str(tmp_path / "disk")
    keys = [bytes([i]) * 16 for i in range(1, 9)]
    disk = DiskBackend(root, 1 << 30)
    try:
        assert disk.indexed.wait(10)
        assert disk.put(keys, [_page(i) for i in range(8)], GEOMETRY) == [True] * 8
        disk._unlink_unless_indexed = lambda keys, then=(): None  # stopped before they ran
        assert disk.clear() == 8 and disk.exists_prefix(keys) == 0
    finally:
        disk.close()
    left, marked = len(files(root)), os.path.exists(os.path.join(root, MARK))
    disk = DiskBackend(root, 1 << 30)
    try:
        assert disk.indexed.wait(10)
        assert disk.exists_prefix(keys) == 0 and disk.usage()["blocks"] == 0
        assert left == 8 and marked
        wait_until(lambda: not files(root) and not os.path.exists(os.path.join(root, MARK)), 5,
                   "the records and the mark removed")
        assert disk.put(keys[:2], [_page(1), _page(2)], GEOMETRY) == [True, True]
        assert disk.clear() == 2  # a clear that runs to its end takes its mark away
        wait_until(lambda: not files(root) and not os.path.exists(os.path.join(root, MARK)), 5,
                   "a whole clear's files and mark gone")
    finally:
        disk.close()


def test_a_void_write_whose_file_cannot_be_removed_is_owed_and_not_indexed_at_the_next_start(
        tmp_path, monkeypatch):
    """A write held across a clear lands void, and its file cannot be removed (EIO; its volume
    away): the key is owed as a delete in the run dir, so the next start removes the file rather
    than index it. Before, the clear's mark went with the write's end and the next start served
    the cleared block (the old weights' KV)."""
    root, record = str(tmp_path / "disk"), OwedRecord(str(tmp_path / "owed"))
    key = b"\x08" * 16
    disk = DiskBackend(root, 1 << 30, io_timeout_s=0.2)
    disk.owe_clear(record)
    real_unlink = os.unlink

    def unlink(path, *args, **kw):
        if path == disk._path(key):
            raise OSError(errno.EIO, "Input/output error")
        return real_unlink(path, *args, **kw)

    try:
        assert disk.indexed.wait(10)
        monkeypatch.setattr(os, "unlink", unlink)
        with writes_held(disk) as held:
            assert disk.put([key], [_page(1)], GEOMETRY) == [None]  # late
            disk.clear()
            held.set()
            wait_until(lambda: not disk._late, 5, "the late write returned")
        assert os.path.exists(disk._path(key)) and disk.usage()["deletes_owed"] == 1
    finally:
        disk.close()
        monkeypatch.setattr(os, "unlink", real_unlink)
    again = DiskBackend(root, 1 << 30)
    again.owe_clear(OwedRecord(str(tmp_path / "owed")))
    try:
        assert again.indexed.wait(10)
        assert again.exists_prefix([key]) == 0
        wait_until(lambda: not os.path.exists(again._path(key)), 5, "the file removed")
    finally:
        again.close()


def test_a_disk_write_begun_before_a_clear_and_landing_after_it_is_void(tmp_path):
    """A write held in the filesystem past the tier's deadline (the tier is stuck meanwhile),
    a clear, then the write returns: its record is removed, never indexed; the tier serves
    again and stores the key anew."""
    root = str(tmp_path / "disk")
    key = b"\x07" * 16
    disk = DiskBackend(root, 1 << 30, io_timeout_s=0.2)
    try:
        assert disk.indexed.wait(10)
        with writes_held(disk) as held:
            assert disk.put([key], [_page(1)], GEOMETRY) == [None]  # late: the tier is stuck
            assert not disk.health()
            disk.clear()
            held.set()
            wait_until(disk.health, 5, "the late write returned")
        assert disk.exists_prefix([key]) == 0 and not files(root)
        assert disk.usage()["used_bytes"] == 0
        assert disk.put([key], [_page(2)], GEOMETRY) == [True] and disk.exists_prefix([key]) == 1
    finally:
        disk.close()

