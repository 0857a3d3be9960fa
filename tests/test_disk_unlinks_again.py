"""Unlinks of the disk tier that failed are tried again once the filesystem answers
(kvcached/storage/disk_unlinks.py): a clear's mark, a clear or delete owed in the run dir, and a
void write's owed delete are let go once their files are gone, not kept for the life of the
daemon (the next start then cleared the tier again, every block stored since lost). On real
directories: a directory put in a record's place (EISDIR), a bind mount made read-only and
writable again under a real daemon."""
import logging
import os
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import (blocks_equal, disk_uri, free_port, keys_for, scramble, small_kv, snapshot,
                      wait_until)
from kvcached.server.status_report import format_status
from kvcached.storage.disk import DiskBackend
from kvcached.storage.disk_clear import MARK
from kvcached.storage.disk_health import PROBE_EVERY_S
from kvcached.storage.owed_clear import OwedRecord
from storage_util import (PAGE_SHAPE, bind_read_only, files, listing_held, offload_and_flush, owes_work,
                          record_path, small_filesystem, start, writable, writes_held)

GEOMETRY = bytes(range(16))


def _page(seed: int) -> list:
    return [memoryview(bytes([seed]) * 4096)]


def _owed(port: int) -> dict:
    """The daemon's kvcached_storage_owed gauges (/metrics) of its one tier, by `what`."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.labels["what"]: s.value for f in text_string_to_metric_families(body) for s in f.samples
            if s.name == "kvcached_storage_owed"}


def _in_the_way(disk, key) -> None:
    """key's record replaced by a directory: its unlink fails (EISDIR) until it is taken away."""
    os.unlink(disk._path(key))
    os.mkdir(disk._path(key))


def test_a_clear_whose_unlink_failed_takes_its_mark_away_once_the_file_can_be_removed(
        tmp_path, caplog):
    """8 records, one of them a directory now: the clear's unlink of it fails, so its mark
    stays (a start now finishes the clear) and status counts the file left. Tried again by the
    probe - a few times, backing off, while it keeps failing - and once the directory is gone the
    mark goes: a restart keeps the block stored since. Before, the mark stayed for the life of the
    daemon and every restart cleared the tier again."""
    root = str(tmp_path / "disk")
    keys = [bytes([i]) * 16 for i in range(1, 9)]
    disk = DiskBackend(root, 1 << 30, io_timeout_s=1.0)
    try:
        assert disk.indexed.wait(10)
        assert disk.put(keys, [_page(i) for i in range(8)], GEOMETRY) == [True] * 8
        _in_the_way(disk, keys[3])
        with caplog.at_level(logging.INFO, logger="kvcached.storage.disk"):
            assert disk.clear() == 8
            wait_until(lambda: files(root) == [disk._path(keys[3])], 5, "the other files removed")
            wait_until(lambda: disk.usage()["unlinks_left"] == 1, 5, "the file counted left")
            time.sleep(6 * PROBE_EVERY_S)
            assert os.path.isdir(disk._path(keys[3])) and os.path.exists(os.path.join(root, MARK))
            tries = sum("trying again" in r.message for r in caplog.records)
            assert 2 <= tries <= 4, tries  # backing off: 1 s, 2 s, 4 s apart (not every round)
            os.rmdir(disk._path(keys[3]))
            wait_until(lambda: not os.path.exists(os.path.join(root, MARK)), 15, "the mark removed")
        # (a retried batch leaves the count once what waited on it - the mark - was let go)
        wait_until(lambda: disk.usage()["unlinks_left"] == 0, 5, "none left")
        assert disk.put([keys[0]], [_page(9)], GEOMETRY) == [True]
    finally:
        disk.close()
    again = DiskBackend(root, 1 << 30)
    try:
        assert again.indexed.wait(10)
        assert again.exists_prefix(keys) == 1  # stored after the clear: kept
    finally:
        again.close()


def test_a_file_being_tried_again_is_counted_left_until_it_is_gone(tmp_path, monkeypatch):
    """While the probe's retry removes the files left, status still counts them (what a waiter
    for `unlinks_left` 0, or an alert on the owed gauge, reads). Before, they were out of the
    list while the retry ran: 0 files left, for as long as a slow unlink took."""
    root = str(tmp_path / "disk")
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    disk = DiskBackend(root, 1 << 30, io_timeout_s=1.0)
    entered, go = threading.Event(), threading.Event()
    real_unlink = os.unlink

    def held(path, *args, **kw):  # the retry's unlink of the file left waits for `go`
        if path == disk._path(keys[1]):
            entered.set()
            go.wait(10)
        return real_unlink(path, *args, **kw)
    try:
        assert disk.indexed.wait(10)
        assert disk.put(keys, [_page(i) for i in range(4)], GEOMETRY) == [True] * 4
        _in_the_way(disk, keys[1])
        assert disk.clear() == 4
        wait_until(lambda: files(root) == [disk._path(keys[1])], 5, "the other files removed")
        wait_until(lambda: disk.usage()["unlinks_left"] == 1, 5, "the file counted left")
        monkeypatch.setattr(os, "unlink", held)  # (then the directory away: the retry's
        os.rmdir(disk._path(keys[1]))  # unlink is held whichever comes first)
        assert entered.wait(10), "the probe did not try again"
        assert disk.usage()["unlinks_left"] == 1  # being tried: left still
        go.set()
        wait_until(lambda: disk.usage()["unlinks_left"] == 0, 5, "the retry done")
        assert not os.path.exists(os.path.join(root, MARK))
    finally:
        go.set()
        monkeypatch.setattr(os, "unlink", real_unlink)
        disk.close()


def test_a_void_writes_owed_delete_is_let_go_once_its_file_is_removed(tmp_path, monkeypatch):
    """A write held across a clear lands void and its file cannot be removed (a directory is
    in its place when it lands: EISDIR): the key is owed as a delete. Once the directory is
    gone the probe's retry removes it and the delete is owed no more, in this run and in the
    run dir's record. Before, `deletes_owed` stayed 1 until a restart."""
    root, record_path = str(tmp_path / "disk"), str(tmp_path / "owed")
    key = b"\x08" * 16
    disk = DiskBackend(root, 1 << 30, io_timeout_s=0.2)
    disk.owe_clear(OwedRecord(record_path))
    real_replace = os.replace

    def replace_then_block(src, dst, *args, **kw):  # the void write's file, then in its way
        real_replace(src, dst, *args, **kw)
        if dst == disk._path(key):
            os.unlink(dst)
            os.mkdir(dst)
    try:
        assert disk.indexed.wait(10)
        with writes_held(disk) as held:
            assert disk.put([key], [_page(1)], GEOMETRY) == [None]  # late
            disk.clear()
            monkeypatch.setattr(os, "replace", replace_then_block)
            held.set()
            wait_until(lambda: not disk._late, 5, "the late write returned")
        monkeypatch.setattr(os, "replace", real_replace)
        wait_until(lambda: disk.usage()["deletes_owed"] == 1, 5, "the delete owed")
        assert OwedRecord(record_path).deletes(disk.uri) == {key}
        shutil.rmtree(disk._path(key))
        with open(disk._path(key), "wb") as f:  # (a file again, as a failed unlink leaves one)
            f.write(b"x")
        wait_until(lambda: disk.usage()["deletes_owed"] == 0 and disk.usage()["unlinks_left"] == 0, 10,
                   "the delete done")
        assert not os.path.exists(disk._path(key))
        assert not OwedRecord(record_path).deletes(disk.uri)
        assert not os.path.exists(os.path.join(root, MARK))
    finally:
        monkeypatch.setattr(os, "replace", real_replace)
        disk.close()


@pytest.mark.faults
def test_a_tier_made_writable_again_does_the_clear_and_deletes_it_owed(run_dir, instance):
    """A daemon's tier on a bind mount made read-only (a disk error's remount-ro; then the
    operator remounts it writable): a delete of 4 blocks and a clear (a weight update) made
    while it is read-only are owed - `deletes_owed` 4, `clear_owed`: the clear's mark cannot be
    written, no file removed. Writable again, the probe removes the 16 files and lets the
    deletes and the clear go; 8 blocks stored after survive a restart, byte-exact. Before, the
    clear stayed owed for the life of the daemon and the restart cleared the tier (0 of 8)."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    keys = keys_for(24, 14)
    with small_filesystem("16m") as fs:
        root = os.path.join(fs, "tier")
        port = free_port()
        h = start(run_dir, instance, disk_uri(root), host_gb=0.001, extra=["--metrics-port", str(port)])
        mounted = False
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys[:16], list(range(16)))
                assert len(files(root)) == 16
                assert _owed(port) == {"deletes": 0, "clear": 0, "unlinks": 0}
                bind_read_only(root)
                mounted = True
                assert c.delete(keys[12:16]) == 4
                c.clear(weights_update=True)
                wait_until(lambda: c.status()["storage"][0]["read_only"], 5, "read-only")
                wait_until(lambda: c.status()["storage"][0]["unlinks_left"] == 16, 5, "16 left")
                disk = c.status()["storage"][0]
                assert disk["clear_owed"] and disk["deletes_owed"] == 4, disk
                assert len(files(root)) == 16  # nothing could be removed
                line = [x for x in format_status(c.status()).splitlines() if x.startswith("storage ")]
                assert "16 files left to remove" in line[0] and "4 deletes owed" in line[0], line
                time.sleep(0.3)  # (a rendering of /metrics is shared for 0.25 s)
                assert _owed(port) == {"deletes": 4, "clear": 1, "unlinks": 16}
                writable(root)
                wait_until(lambda: not owes_work(c.status()["storage"][0]), 15, "the owed let go")
                assert files(root) == []
                time.sleep(0.3)
                assert _owed(port) == {"deletes": 0, "clear": 0, "unlinks": 0}
                scramble(kv, 7)
                offload_and_flush(c, kv, keys[16:], list(range(16, 24)))
                expected = snapshot(kv, list(range(16, 24)))
            h.stop()
            h = start(run_dir, instance, disk_uri(root), host_gb=0.001)
            with h.connect() as c:
                c.register_kv_cache(kv)
                assert c.lookup(keys[:16]) == (0, 0)
                assert c.lookup(keys[16:]) == (0, 8)
                scramble(kv, 8)
                assert c.load(keys[16:], list(range(64, 72))).wait(10) == 8
                assert blocks_equal(kv, list(range(64, 72)), expected)
            with open(h.log_path) as f:
                assert "owed" not in "".join(line for line in f if "[disk]" in line)
        finally:
            h.stop()
            if mounted:
                subprocess.run(["umount", root], check=True)


@pytest.mark.faults
def test_a_key_deleted_while_the_index_is_rebuilt_whose_file_stays_is_owed(run_dir, instance, disk_dir):
    """4 blocks on disk; a daemon starts and its listing hangs (a FUSE shard); 2 of them are
    deleted meanwhile, and one's file cannot be removed when the listing ends (immutable:
    EPERM, as root). The merge forgets both and owes them as deletes, on record: the
    daemon stopped before the file could go, the next start (the file removable again) deletes
    it rather than index it. Before, only the run that deleted it knew: the restart served it."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(4, 63)
    fs = listing_held(run_dir, instance, disk_dir, kv, keys)
    stuck = record_path(disk_dir, keys[0], kv)
    h = start(run_dir, instance, disk_uri(disk_dir), wait_storage=False)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            assert c.delete(keys[:2]) == 0  # (not indexed yet: kept for the merge)
            subprocess.run(["chattr", "+i", stuck], check=True)
            fs.release_listing()
            c.wait_storage_ready(10)
            assert c.lookup(keys[2:]) == (0, 2) and c.lookup(keys[:1]) == (0, 0)
            # (both keys of the batch are owed, as a delete owes its keys, until the retry)
            wait_until(lambda: c.status()["storage"][0]["deletes_owed"] == 2, 5, "the deletes owed")
            assert os.path.exists(stuck) and not os.path.exists(record_path(disk_dir, keys[1], kv))
        h.stop()
        subprocess.run(["chattr", "-i", stuck], check=True)
        h = start(run_dir, instance, disk_uri(disk_dir))
        with h.connect() as c:
            c.register_kv_cache(kv)
            assert c.lookup(keys[:1]) == (0, 0) and c.lookup(keys[2:]) == (0, 2)
            wait_until(lambda: not os.path.exists(stuck), 5, "the file removed")
            assert c.status()["storage"][0]["deletes_owed"] == 0
    finally:
        subprocess.run(["chattr", "-i", stuck], capture_output=True)
        h.stop()
        fs.close()
