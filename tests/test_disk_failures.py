"""A disk tier on a disk that fails under it (kvcached/storage/disk_errors.py): an ext4 filesystem
shut down (every read and write EIO, as a dead disk), one gone read-only at an error (ext4's
default errors=remount-ro), a read-only mount made writable again, one record whose reads fail
(a bad sector, on a FUSE shard), and errors of the system (EMFILE) that say nothing of a record."""
import errno
import os
import subprocess
import threading
import time

import pytest

from conftest import blocks_equal, disk_uri, keys_for, scramble, small_kv, snapshot, wait_until
from kvcached.storage import disk_errors, disk_read
from kvcached.storage.disk import IO_THREADS, DiskBackend
from kvcached.storage.disk_health import PROBE_EVERY_S
from storage_util import (PAGE_SHAPE, bind_read_only, ext4_error, ext4_filesystem, ext4_shut_down, files,
                          offload_and_flush, small_filesystem, start, stored_with_one_record_hung,
                          writable)


def _disk(c) -> dict:
    return c.status()["storage"][0]


def _disk_lines(h) -> list[str]:
    with open(h.log_path) as f:
        return [line for line in f if "[disk]" in line]


@pytest.mark.faults
def test_a_disk_that_fails_every_read_and_write_is_unhealthy_and_says_so_in_a_few_lines(
        run_dir, instance):
    """16 blocks stored, then the filesystem shut down (EIO on every read and write; stat and
    access answer as before). The first load's failed reads wake the probe, whose trial record
    fails: the tier is unhealthy with the reason, its lookups find nothing, 32 more blocks'
    puts are dropped, and the log has a few lines, not three a block. The host tier serves on.
    Before, the tier stayed healthy, its lookups found the 16 blocks every load then failed, and
    each block logged two lines per read and one per put."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    keys = keys_for(64, 11)
    with ext4_filesystem() as fs:
        h = start(run_dir, instance, disk_uri(os.path.join(fs, "tier")), host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys[:16], list(range(16)))
                c.clear(tier="host")
                assert c.lookup(keys[:16]) == (0, 16)
                ext4_shut_down(fs)
                assert c.load(keys[:16], list(range(64, 80))).wait(10) == 0
                wait_until(lambda: not _disk(c)["healthy"], 5, "the tier unhealthy")
                disk = _disk(c)
                assert "a record cannot be written there" in disk["last_error"], disk
                assert c.lookup(keys[:16]) == (0, 0)
                host_kept = snapshot(kv, list(range(16, 20)))
                for i in range(16, 48, 8):  # backups dropped, the host tier keeps them
                    offload_and_flush(c, kv, keys[i:i + 8], list(range(i, i + 8)))
                disk = _disk(c)
                assert disk["dropped_puts"] >= 32 and disk["puts"] == 16, disk
                scramble(kv, 3)
                assert c.load(keys[16:20], list(range(80, 84))).wait(10) == 4
                assert blocks_equal(kv, list(range(80, 84)), host_kept)
                time.sleep(2.5 * PROBE_EVERY_S)  # the probe tries again: still failing, still quiet
                assert not _disk(c)["healthy"]
            lines = _disk_lines(h)
            assert len([x for x in lines if "ERROR" in x]) == 1, lines
            assert len(lines) <= 12, lines
        finally:
            h.stop()


@pytest.mark.faults
def test_a_filesystem_gone_read_only_at_an_error_serves_what_it_holds_and_stores_nothing(
        run_dir, instance):
    """A tier at its capacity (16 blocks) whose ext4 filesystem takes an error and goes
    read-only (errors=remount-ro; access(2) still says writable): the tier says read_only, its
    16 blocks less at most the one each I/O thread's put in flight evicted are still served
    byte-exact, new blocks are dropped without a write or an eviction, and what status counts is what the index holds.
    Before, every put evicted blocks it could not unlink (their files stayed), leaked its
    reservation and failed the whole backup: the tier held 16 readable records and served
    none, reported 0 blocks of 525,056 bytes used, and status said nothing of why. A restart on
    the read-only filesystem serves the same blocks, a crashed write's temp file it cannot
    remove left (its start was refused: "Read-only file system", the host tier lost with it)."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    keys = keys_for(48, 12)
    with ext4_filesystem() as fs:
        root = os.path.join(fs, "tier")
        h = start(run_dir, instance, disk_uri(root), host_gb=0.01)
        with h.connect() as c:  # a record's size, for a capacity of 16.5 records
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys[:1], [0])
            record = _disk(c)["used_bytes"]
        h.stop()
        uri = disk_uri(root, capacity_gb=16.5 * record / 2**30)
        h = start(run_dir, instance, uri, host_gb=0.001)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys[:16], list(range(16)))
                expected = snapshot(kv, list(range(16)))
                assert _disk(c)["blocks"] == 16
                stray = files(root)[0] + ".1.2.tmp"  # a crashed write's, which a start removes
                with open(stray, "wb") as f:
                    f.write(b"x")
                ext4_error(fs)
                for i in (16, 32):  # a put in flight on each I/O thread evicts before it finds out
                    offload_and_flush(c, kv, keys[i:i + 16], list(range(i, i + 16)))
                disk = _disk(c)
                assert disk["read_only"] and disk["healthy"], disk
                assert "read-only" in disk["last_error"], disk
                assert disk["evicted"] <= IO_THREADS and disk["blocks"] >= 16 - IO_THREADS, disk
                assert disk["put_errors"] <= IO_THREADS, disk  # the others not tried: dropped
                assert disk["dropped_puts"] + disk["put_errors"] == 32, disk
                assert disk["used_bytes"] == disk["blocks"] * record, disk
                assert len(files(root)) == 16  # nothing could be removed
                c.clear(tier="host")
                held = c.lookup(keys[:16])[1]  # (a chain loses its tail first: a prefix stays)
                assert held == disk["blocks"]
                scramble(kv, 4)
                assert c.load(keys[:held], list(range(64, 64 + held))).wait(10) == held
                assert blocks_equal(kv, list(range(64, 64 + held)), expected, upto=held)
                assert c.lookup(keys[16:]) == (0, 0)
                assert any("read-only" in why for why in c.status()["degraded"])
            lines = _disk_lines(h)
            assert sum("the filesystem is read-only" in x for x in lines) == 1, lines
            assert len(lines) <= 12, lines
            h.stop()
            h = start(run_dir, instance, uri, host_gb=0.001)  # a restart on it: served still
            with h.connect() as c:
                c.register_kv_cache(kv)
                disk = _disk(c)
                # (the records evicted but not unlinked are there: indexed again)
                assert disk["read_only"] and disk["healthy"] and disk["blocks"] == 16, disk
                assert "until a restart" in disk["last_error"], disk
                scramble(kv, 6)
                assert c.load(keys[:16], list(range(64, 80))).wait(10) == 16
                assert blocks_equal(kv, list(range(64, 80)), expected)
                assert os.path.exists(stray)  # left (its shard listed all the same)
                offload_and_flush(c, kv, keys[16:24], list(range(16, 24)))
                assert _disk(c)["dropped_puts"] == 8 and len(files(root)) == 16
        finally:
            h.stop()


@pytest.mark.faults
def test_a_read_only_mount_made_writable_again_stores_again(run_dir, instance):
    """The tier's directory remounted read-only under it (a bind mount of itself; then back):
    read_only while it is, its blocks served, puts dropped; writable again, the probe's trial
    record finds it within a few rounds and new blocks are stored again."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    keys = keys_for(24, 13)
    with small_filesystem("16m") as fs:
        root = os.path.join(fs, "tier")
        h = start(run_dir, instance, disk_uri(root), host_gb=0.001)
        mounted = False
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys[:8], list(range(8)))
                bind_read_only(root)
                mounted = True
                offload_and_flush(c, kv, keys[8:16], list(range(8, 16)))
                wait_until(lambda: _disk(c)["read_only"], 5, "the tier read-only")
                time.sleep(2.5 * PROBE_EVERY_S)  # the probe sees the mount read-only: not down
                disk = _disk(c)
                assert disk["healthy"] and disk["blocks"] == 8 and disk["evicted"] == 0, disk
                c.clear(tier="host")
                assert c.lookup(keys[:16]) == (0, 8)
                writable(root)
                wait_until(lambda: not _disk(c)["read_only"], 5 * PROBE_EVERY_S, "writable again")
                offload_and_flush(c, kv, keys[16:], list(range(16, 24)))
                c.clear(tier="host")
                assert c.lookup(keys[16:]) == (0, 8)
                assert _disk(c)["blocks"] == 16
            assert any("writable again" in x for x in _disk_lines(h))
        finally:
            h.stop()
            if mounted:
                subprocess.run(["umount", root], check=True)


@pytest.mark.faults
def test_a_record_whose_reads_fail_costs_that_record_alone(run_dir, instance, disk_dir):
    """One record of 8 on a FUSE shard whose reads fail with EIO (a bad sector): the load gets
    the blocks before it, the record is forgotten (counted as an I/O error, not as damage), and
    the tier, whose trial record writes and reads back, stays healthy and serves the others."""
    kv, keys, expected, uri, fs = stored_with_one_record_hung(run_dir, instance, disk_dir, 5)
    fs.release_reads()  # every read of it fails at once
    h = None
    try:
        h = start(run_dir, instance, uri)
        with h.connect() as c:
            c.register_kv_cache(kv)
            assert c.lookup(keys) == (0, 8)
            scramble(kv, 5)
            assert c.load(keys, list(range(20, 28))).wait(10) == 5
            assert blocks_equal(kv, list(range(20, 25)), expected, upto=5)
            time.sleep(2 * PROBE_EVERY_S)  # (the probe's trial)
            disk = _disk(c)
            assert disk["healthy"] and not disk["read_only"], disk
            assert disk["io_errors"] == 1 and disk["corrupt"] == 0 and disk["blocks"] == 7, disk
            c.clear(tier="host")  # (the load's fetch brought 5 there)
            assert c.lookup(keys) == (0, 5)
            assert c.lookup(keys[6:]) == (0, 2)
    finally:
        fs.close()
        if h is not None:
            h.stop()


def test_a_link_in_place_of_a_record_is_damage_not_an_error_of_the_filesystem(tmp_path):
    """A link planted where a record goes (opened without following links: ELOOP) is a damaged
    record - counted `corrupt`, removed - not an I/O error that wakes the probe's trial."""
    tier = _tier(tmp_path / "t")
    try:
        key = b"\x06" * 16
        assert tier.put([key], [[bytearray(os.urandom(4096))]], GEOMETRY) == [True]
        target = tmp_path / "elsewhere"
        target.write_bytes(open(tier._path(key), "rb").read())
        os.unlink(tier._path(key))
        os.symlink(target, tier._path(key))
        assert tier.get_into([key], [[bytearray(4096)]], GEOMETRY) == [False]
        usage = tier.usage()
        assert usage["corrupt"] == 1 and usage["io_errors"] == 0 and not tier._suspect, usage
        assert not os.path.lexists(tier._path(key)) and target.exists()
    finally:
        tier.close()


def _tier(path, **kw) -> DiskBackend:
    tier = DiskBackend(str(path), 1 << 30, **kw)
    assert tier.indexed.wait(5)
    return tier


GEOMETRY = b"\x07" * 16


def test_an_error_of_the_system_on_a_read_keeps_the_record(tmp_path, monkeypatch):
    """EMFILE (the daemon's open files all taken, for a moment) on a record's read: a miss, the
    record kept indexed and served at the next read, the tier untouched. Before, any OSError
    was damage: the record was counted corrupt and removed."""
    tier = _tier(tmp_path / "t")
    try:
        page = bytearray(os.urandom(4096))
        assert tier.put([b"\x01" * 16], [[page]], GEOMETRY) == [True]
        real = disk_read.read_record
        calls = []

        def emfile_once(*args, **kw):
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.EMFILE, "Too many open files")
            return real(*args, **kw)

        monkeypatch.setattr("kvcached.storage.disk.read_record", emfile_once)
        back = bytearray(4096)
        assert tier.get_into([b"\x01" * 16], [[back]], GEOMETRY) == [False]
        assert tier.exists_prefix([b"\x01" * 16]) == 1
        assert tier.get_into([b"\x01" * 16], [[back]], GEOMETRY) == [True] and back == page
        usage = tier.usage()
        assert usage["io_errors"] == 1 and usage["corrupt"] == 0 and tier.health()
    finally:
        tier.close()


def test_a_trial_that_fails_then_passes_takes_the_tier_down_then_up(tmp_path, monkeypatch):
    """A write's EIO wakes the probe: its trial record fails (here, the trial's write), so the
    tier is unhealthy and drops its puts; once a trial passes the tier stores again."""
    tier = _tier(tmp_path / "t")
    failing = [True]
    real_trial = disk_errors.trial

    def trial(root, **kw):
        if failing[0]:
            raise OSError(errno.EIO, "a record cannot be written there (Input/output error)")
        return real_trial(root, **kw)

    monkeypatch.setattr(disk_errors, "trial", trial)
    real_write = tier._write
    monkeypatch.setattr(tier, "_write", lambda *a: OSError(errno.EIO, "Input/output error"))
    try:
        page = [bytearray(4096)]
        assert tier.put([b"\x02" * 16], [page], GEOMETRY) == [False]
        wait_until(lambda: not tier.health(), 2 * PROBE_EVERY_S, "the tier down")
        assert "cannot be written" in tier.usage()["last_error"]
        monkeypatch.setattr(tier, "_write", real_write)
        assert tier.put([b"\x03" * 16], [page], GEOMETRY) == [False]  # dropped while down
        assert tier.usage()["dropped_puts"] == 1
        failing[0] = False
        wait_until(tier.health, 3 * PROBE_EVERY_S, "the tier up again")
        assert tier.put([b"\x03" * 16], [page], GEOMETRY) == [True]
    finally:
        tier.close()


def test_a_shard_that_cannot_be_mended_at_start_is_left_alone(tmp_path, monkeypatch):
    """A shard the start must mend (its mode, a link in its place) on a filesystem that refuses
    (read-only: EROFS): that shard is left unused and the others' records are indexed. Before,
    its error ended the index rebuild: no record was served."""
    from kvcached.storage import owned

    tier = _tier(tmp_path / "t")
    page = [bytearray(os.urandom(4096))]
    keys = [bytes([b]) * 16 for b in (0x10, 0x20, 0x30)]
    assert tier.put(keys, [page] * 3, GEOMETRY) == [True] * 3
    tier.close()
    real = owned.usable_shard

    def usable(path):
        if path.endswith("/20"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path)

    monkeypatch.setattr(owned, "usable_shard", usable)
    tier = _tier(tmp_path / "t")
    try:
        assert [tier.exists_prefix([k]) for k in keys] == [1, 0, 1]
    finally:
        tier.close()


def test_a_disk_whose_fsync_fails_is_unhealthy_with_fsync_on(tmp_path, monkeypatch):
    """With ?fsync=1, a disk whose fsync fails (EIO: its write-back failed) fails every put; the
    probe's trial record is synced as the puts are, so it fails too and the tier is down until
    fsync works again. (Its trial never synced: it passed, and the tier called itself healthy
    while every put failed.)"""
    tier = _tier(tmp_path / "t", fsync=True)
    real = os.fsync

    def eio(_fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)
    try:
        page = [bytearray(4096)]
        assert tier.put([b"\x04" * 16], [page], GEOMETRY) == [False]
        wait_until(lambda: not tier.health(), 2 * PROBE_EVERY_S, "the tier down")
        monkeypatch.setattr(os, "fsync", real)
        wait_until(tier.health, 3 * PROBE_EVERY_S, "the tier up again")
        assert tier.put([b"\x04" * 16], [page], GEOMETRY) == [True]
    finally:
        tier.close()


def test_the_probe_goes_on_after_a_defect_in_a_round(tmp_path, monkeypatch, caplog):
    """An exception no round expects (a defect: here the trial's check raising RuntimeError
    once) is logged and the probe goes on. Before, it ended the probe thread for good: a tier
    down was never seen again, and one that came back was never let serve."""
    tier = _tier(tmp_path / "t")
    real, rounds = tier._try_records, []

    def flaky():
        rounds.append(1)
        if len(rounds) == 1:
            raise RuntimeError("a defect")
        return real()

    monkeypatch.setattr(tier, "_try_records", flaky)
    try:
        wait_until(lambda: len(rounds) >= 3, 5 * PROBE_EVERY_S, "the probe's rounds after it")
        assert "the probe failed: RuntimeError('a defect')" in caplog.text
    finally:
        tier.close()


def test_records_whose_reads_failed_with_the_filesystem_stay_and_are_served_when_it_answers(
        tmp_path, monkeypatch):
    """A read that fails with an error of the filesystem (ENOTCONN: a FUSE or network mount
    gone) while the trial record fails too: the record is not served meanwhile, and once the
    filesystem answers (the trial passes) it is served again. Before, it was forgotten at its
    failed read, its file left unindexed until a restart. (A record whose reads fail while the
    trial passes is forgotten: test_a_record_whose_reads_fail_costs_that_record_alone.)"""
    tier = _tier(tmp_path / "t")
    keys = [b"\x0a" * 16, b"\x0b" * 16]
    pages = [bytearray(os.urandom(4096)) for _ in keys]
    try:
        assert tier.put(keys, [[p] for p in pages], GEOMETRY) == [True, True]
        down, checked = [True], threading.Event()
        real_read, real_trial = disk_read.read_record, disk_errors.trial

        def read(*args, **kw):
            if down[0]:
                raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
            return real_read(*args, **kw)

        def trial(root, **kw):
            checked.wait(5)  # (the verdict waits until the lookup below is made)
            if down[0]:
                raise OSError(errno.ENOTCONN, "a record cannot be written there")
            return real_trial(root, **kw)

        monkeypatch.setattr("kvcached.storage.disk.read_record", read)
        monkeypatch.setattr(disk_errors, "trial", trial)
        back = bytearray(4096)
        assert tier.get_into(keys[:1], [[back]], GEOMETRY) == [False]
        assert tier.health() and tier.exists_prefix(keys) == 0  # not while the trial has not said
        checked.set()
        wait_until(lambda: not tier.health(), 2 * PROBE_EVERY_S, "the tier down")
        down[0] = False
        wait_until(tier.health, 3 * PROBE_EVERY_S, "the tier up again")
        assert tier.exists_prefix(keys) == 2
        assert tier.get_into(keys[:1], [[back]], GEOMETRY) == [True] and back == pages[0]
        assert tier.usage()["blocks"] == 2 and tier.usage()["io_errors"] == 1
    finally:
        tier.close()
