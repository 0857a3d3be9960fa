"""A disk tier on the filesystems deployments give it: one that runs out of inodes (one a
record, one a shard directory) before it runs out of bytes - many small files of other programs
on a node's shared disk - one full at start, one that cannot keep a record, a volume unmounted
under the running tier, and shards its index rebuild cannot list."""
import contextlib
import errno
import glob
import os
import shutil
import signal
import stat
import subprocess
import time

import pytest

from conftest import blocks_equal, disk_uri, keys_for, scramble, small_kv, snapshot, stored, unique_instance, wait_until
from kvcached.storage import disk_listing, owned
from kvcached.storage.disk import DiskBackend
from kvcached.storage.disk_health import PROBE_EVERY_S
from kvcached.storage.disk_owed import OwedUnlinks
from kvcached.storage.owed_clear import OwedRecord
from storage_util import PAGE_SHAPE, offload_and_flush, small_filesystem, start


def _fill_inodes(path: str) -> int:
    """Empty files under path until the filesystem has no inode left (another program's)."""
    os.mkdir(path)
    n = 0
    while True:
        try:
            os.close(os.open(os.path.join(path, f"f{n}"), os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            return n
        n += 1


@pytest.mark.faults
def test_a_filesystem_out_of_inodes_at_restart_serves_what_the_tier_holds_and_keeps_storing(
        run_dir, instance):
    """24 records stored, then the filesystem's last inodes taken by another program, then the
    daemon restarted: its index rebuild lists the 24 records and serves them byte-exact, and new
    blocks take the inodes of the oldest records it evicts (said once; the probe, which finds
    bytes free, does not raise the limit again to meet ENOSPC at the next put). Before, the
    rebuild made all 256 shard directories: the 64-inode filesystem had none left for a record
    (every put failed), and at the restart the mkdir that failed ended the rebuild - the tier
    indexed nothing, served none of its records and, as bytes were free, never evicted one."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    old = keys_for(24, 2)
    shards = {stored(k, kv)[0] for k in old}
    new = [k for k in keys_for(600, 3) if stored(k, kv)[0] in shards][:16]  # (no new directory)
    assert len(new) == 16
    kept_old = snapshot(kv, list(range(24)))
    with small_filesystem("16m", inodes=64) as fs:
        uri = disk_uri(os.path.join(fs, "tier"), capacity_gb=1.0)
        h = start(run_dir, instance, uri, host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, old, list(range(24)))
                assert c.status()["storage"][0]["blocks"] == 24
        finally:
            h.stop()
        assert _fill_inodes(os.path.join(fs, "other")) > 0
        h = start(run_dir, instance, uri, host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                assert c.lookup(old) == (0, 24), c.status()["storage"][0]
                scramble(kv, 1)
                assert c.load(old, list(range(24, 48))).wait(10) == 24
                assert blocks_equal(kv, list(range(24, 48)), kept_old)
                kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128, seed=5)  # other bytes
                c.register_kv_cache(kv)
                kept_new = snapshot(kv, list(range(48, 64)))
                offload_and_flush(c, kv, new[:4], list(range(48, 52)))
                time.sleep(2.5 * PROBE_EVERY_S)  # (the probe looks at the filesystem meanwhile)
                disk = c.status()["storage"][0]  # not raised again for the bytes free
                assert disk["full"] and disk["limit_bytes"] <= disk["used_bytes"], disk
                offload_and_flush(c, kv, new[4:], list(range(52, 64)))
                disk = c.status()["storage"][0]
                assert disk["full"] and disk["evicted"] >= 16 and disk["put_errors"] == 0, disk
                c.clear(tier="host")
                assert c.lookup(new) == (0, 16), c.status()["storage"][0]
                scramble(kv, 2)
                assert c.load(new, list(range(64, 80))).wait(10) == 16
                assert blocks_equal(kv, list(range(64, 80)), kept_new)
            with open(h.log_path) as f:
                log = f.read()
            assert log.count("the filesystem is out of inodes") == 1, log[-3000:]
            assert "index rebuild failed" not in log
        finally:
            h.stop()


def test_a_shard_that_cannot_be_listed_is_left_unused_and_the_others_are_indexed(tmp_path, monkeypatch):
    """One shard's listing fails (EIO): its records are neither indexed nor written again, the
    other shards' are indexed. Before, the whole rebuild failed and the tier indexed nothing."""
    for shard, name in (("0a", "0a" + "1" * 30), ("0b", "0b" + "2" * 30), ("0c", "0c" + "3" * 30)):
        os.mkdir(tmp_path / shard, 0o700)
        (tmp_path / shard / f"{name}.kvb").write_bytes(b"x" * 64)
    listed = disk_listing._list_shard

    def failing(shard, *args):
        if shard.name == "0b":
            raise OSError(errno.EIO, "Input/output error")
        return listed(shard, *args)

    monkeypatch.setattr(disk_listing, "_list_shard", failing)
    unusable: set[int] = set()
    found, removed = disk_listing.list_records(str(tmp_path), unusable)
    assert sorted(key[0] for _t, key, _n in found) == [0x0a, 0x0c] and removed == 0
    assert unusable == {0x0b}


def test_a_shard_is_made_by_its_first_put_and_one_of_another_mode_is_made_0700(tmp_path):
    """The rebuild makes no shard directory (a missing one is usable: its first put makes it),
    and one of mode 000 or 0500 (the listing needs rwx) is made 0700."""
    assert owned.usable_shard(str(tmp_path / "00")) and not (tmp_path / "00").exists()
    for mode in (0o000, 0o500, 0o755):
        path = tmp_path / f"{mode:02x}"
        os.mkdir(path)
        os.chmod(path, mode)
        assert owned.usable_shard(str(path))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


@pytest.mark.faults
def test_a_filesystem_that_cannot_keep_a_record_is_refused_at_start_by_name(run_dir, instance, tmp_path):
    """The disk tier's start writes a trial record as its puts do (a temp file, then a rename)
    and reads it back: where the rename is refused (here the trial's name is a mount point:
    EBUSY, as a bucket mount without rename refuses it) the daemon's start fails saying so.
    Before, it started, and every put of its life failed, each with a line in the log. A full
    filesystem starts (the trial finds no room: the tier evicts for it), out of bytes or of
    inodes (the lock file not made: a warning). Before, a restart on a full filesystem was
    refused: the lock file's pid could not be written."""
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    target = root / ".kvcached.trial"
    target.write_bytes(b"")
    (tmp_path / "other").write_bytes(b"")
    if subprocess.run(["mount", "--bind", str(tmp_path / "other"), str(target)]).returncode:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        with pytest.raises(Exception, match=r"cannot use .*tier as the disk tier: a record cannot "
                                            r"be written there \(Device or resource busy\)"):
            start(run_dir, instance, disk_uri(str(root)))
    finally:
        subprocess.run(["umount", str(target)], check=True)
    with small_filesystem("64k") as fs:
        with open(os.path.join(fs, "filler"), "wb") as f:
            with pytest.raises(OSError):
                f.write(b"\0" * (1 << 20))
        h = start(run_dir, instance, disk_uri(fs))
        try:
            with h.connect() as c:
                assert c.status()["storage"][0]["healthy"]
            assert not [n for n in os.listdir(fs) if n.startswith(".kvcached.trial")]
        finally:
            h.stop()
        with open(h.log_path) as f:
            assert "no room for a trial record" in f.read()
    with small_filesystem("1m", inodes=8) as fs:
        assert _fill_inodes(os.path.join(fs, "other")) > 0
        h = start(run_dir, instance, disk_uri(fs))
        try:
            with h.connect() as c:
                assert c.status()["storage"][0]["healthy"]
        finally:
            h.stop()
        with open(h.log_path) as f:
            log = f.read()
        assert "no room for the lock file" in log and "no room for a trial record" in log, log


def _offload_many(c, n: int, seed: int) -> list[bytes]:
    keys = []
    for i in range(0, n, 256):
        part = keys_for(256, seed + i)
        c.offload(list(range(256)), part).wait(30)
        keys += part
    c.flush().wait(60)
    return keys


@pytest.mark.faults
def test_a_clear_that_cannot_be_marked_is_owed_in_the_run_dir_until_its_files_are_gone(run_dir, instance):
    """A weight update's clear on a filesystem with no inode left for the clear's mark: owed in
    the run dir's record instead. The daemon killed before its unlinks were done clears the tier
    at its next start (before, it indexed the 2,000 old blocks again and would serve them after
    the weight update); a clear whose unlinks are done is owed no more (blocks stored after it
    survive a restart)."""
    kv = small_kv(num_blocks=256, block_shape=(16, 2, 8))
    with small_filesystem("256m", inodes=2400) as fs:
        uri = disk_uri(os.path.join(fs, "tier"))
        h = start(run_dir, instance, uri, host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                _offload_many(c, 512, 1000)
                _fill_inodes(os.path.join(fs, "other"))
                c.clear(weights_update=True)
                wait_until(lambda: not c.status()["storage"][0]["clear_owed"], 10, "the clear done")
                kept = _offload_many(c, 256, 5000)  # (the inodes the clear freed)
        finally:
            h.stop()
        shutil.rmtree(os.path.join(fs, "other"))
        h = start(run_dir, instance, uri, host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                assert c.lookup(kept) == (0, 256), c.status()["storage"][0]
        finally:
            h.stop()
        for attempt in range(6):  # (the kill must land before the unlinks are done: under
            # the full suite's load, 3 tries all came after them once)
            h = start(run_dir, instance, uri, host_gb=0.01)
            try:
                with h.connect() as c:
                    c.register_kv_cache(kv)
                    old = _offload_many(c, 1536, 9000 + 10_000 * attempt)
                    assert c.status()["storage"][0]["blocks"] > 1000, c.status()["storage"][0]
                    _fill_inodes(os.path.join(fs, f"more{attempt}"))
                    c.clear(weights_update=True)
                    os.kill(h.pid, signal.SIGKILL)
                    h.proc.wait(10)
            finally:
                h.stop()
            if len(glob.glob(os.path.join(fs, "tier", "??", "*.kvb"))) > 100:
                break
            shutil.rmtree(os.path.join(fs, f"more{attempt}"))
        else:
            pytest.fail("each kill came after the clear's unlinks were done")
        h = start(run_dir, instance, uri, host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                assert c.status()["storage"][0]["blocks"] == 0, c.status()["storage"][0]
                assert c.lookup(old) == (0, 0) and c.lookup(kept) == (0, 0)
        finally:
            h.stop()


def test_an_unmarked_clear_stays_owed_while_another_is_or_a_delete_went_unkept(tmp_path):
    """OwedUnlinks with the run dir's real record: a clear whose mark failed is on record until
    its unlinks are done; not released while a second such clear is not done, nor after a
    delete that was not kept (the owed clear was to remove its files); and the release of one
    from before the tier was cleared whole (its unlinks tried again long after) does not
    release a clear owed since."""
    record = OwedRecord(str(tmp_path / "i.clears-owed"))
    owed = OwedUnlinks("disk:///x")
    owed.attach(record)
    first, second = owed.clear_unmarked(), owed.clear_unmarked()
    assert OwedRecord(record.path).owed("disk:///x")
    first()
    assert owed.clear_owed and OwedRecord(record.path).owed("disk:///x")
    second()
    assert not owed.clear_owed and not OwedRecord(record.path).owed("disk:///x")
    third = owed.clear_unmarked()
    owed.unconfirmed(owed.begin([b"k" * 16]))  # its unlink failed: the clear owes it
    third()
    assert owed.clear_owed and OwedRecord(record.path).owed("disk:///x")
    owed.cleared()
    assert not owed.clear_owed and not OwedRecord(record.path).owed("disk:///x")
    before = owed.clear_unmarked()
    owed.cleared()  # (a remount's listing cleared the tier whole)
    since = owed.clear_unmarked()
    before()  # late: moot
    assert owed.clear_owed and OwedRecord(record.path).owed("disk:///x")
    since()
    assert not owed.clear_owed and not OwedRecord(record.path).owed("disk:///x")


@pytest.mark.faults
def test_a_volume_unmounted_under_the_tier_makes_it_unhealthy_and_nothing_is_written_beneath(
        run_dir, instance, tmp_path):
    """The tier's root a volume (a tmpfs) unmounted while the daemon runs (umount -l: the lock
    file is open): the path is then the mount point's own directory, on the filesystem beneath.
    The tier says so (unhealthy, the reason in status), reports no hits, and writes nothing
    there, the puts in the probe's second before it saw included. Before, it stayed healthy,
    kept reporting the blocks of the volume gone, and wrote every new block onto the filesystem
    beneath (a node's root disk)."""
    root = tmp_path / "vol"
    root.mkdir(mode=0o700)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(root)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    kv = small_kv(num_blocks=64, block_shape=PAGE_SHAPE)
    old = keys_for(8)
    h = start(run_dir, instance, disk_uri(str(root)), host_gb=0.01)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, old, list(range(8)))
            subprocess.run(["umount", "-l", str(root)], check=True)
            offload_and_flush(c, kv, keys_for(8, 5), list(range(8, 16)))  # (before the probe)
            wait_until(lambda: not c.status()["storage"][0]["healthy"], 5, "the tier unhealthy")
            offload_and_flush(c, kv, keys_for(8, 6), list(range(16, 24)))
            disk = c.status()["storage"][0]
            assert "no longer the directory the tier started on" in disk["last_error"], disk
            assert disk["dropped_puts"] == 8 and disk["puts"] == 8, disk
            c.clear(tier="host")
            assert c.lookup(old) == (0, 0)
    finally:
        h.stop()
        subprocess.run(["umount", str(root)], capture_output=True)  # (if the test failed first)
    assert os.listdir(root) == []
    with open(h.log_path) as f:  # said once, by the probe, for an operator reading the log
        assert f.read().count("the tier serves nothing and drops its puts") == 1


def test_a_quota_met_evicts_for_room_and_the_limit_stays_lowered(tmp_path, monkeypatch, caplog):
    """EDQUOT (a user's quota, or a directory's: an emptyDir's on XFS) where statvfs shows the
    filesystem's free bytes, not the quota's: the tier lowers its limit under what it holds,
    evicts and stores the new block; the probe does not raise the limit again from the free
    bytes it sees. Before, EDQUOT was a plain write error: every put failed from the quota on.
    (The quota is the write's answer here; a real one needs another uid and quota tools.)"""
    from kvcached.storage import disk

    tier = disk.DiskBackend(str(tmp_path), capacity_bytes=1 << 30)
    try:
        assert tier.indexed.wait(10)
        page = [memoryview(bytes([7]) * 4096)]
        keys = [bytes([i]) * 16 for i in range(1, 41)]
        assert tier.put(keys[:32], [page] * 32, bytes(16)) == [True] * 32
        real, quota = tier._write, 32 * (4096 + disk.HEADER_BYTES)

        def held() -> int:
            total = 0
            for f in glob.glob(os.path.join(str(tmp_path), "??", "*.kvb")):
                with contextlib.suppress(FileNotFoundError):  # (evicted meanwhile)
                    total += os.path.getsize(f)
            return total

        def write(key, pieces, size, geometry):  # the quota: what the files hold
            if held() + size > quota:
                return OSError(errno.EDQUOT, "Disk quota exceeded")
            return real(key, pieces, size, geometry)

        tier._write = write
        assert tier.put(keys[32:], [page] * 8, bytes(16)) == [True] * 8
        assert tier.exists_prefix(keys[32:]) == 8 and tier.counters["put_errors"] == 0
        assert tier.limit_bytes < quota and tier.counters["evicted"] >= 8
        lowered = tier.limit_bytes
        time.sleep(2.5 * PROBE_EVERY_S)  # the probe sees the filesystem's free bytes
        assert tier.limit_bytes == lowered and tier.usage()["full"]
        assert "the filesystem is over its quota" in caplog.text
    finally:
        tier.close()


def test_puts_racing_into_a_shard_not_made_yet_are_all_stored(tmp_path):
    """Shards are made by their first put: the I/O threads' puts into one new shard at once
    each find it missing and make it; the ones that lose that race store their record all the
    same. (In the first run of the suite after shards became lazy, `kvcached bench storage`'s
    prefetch through the daemon brought 16 of 64 blocks back: the losers' puts had failed.)"""
    from kvcached.storage import disk

    for attempt in range(5):
        tier = disk.DiskBackend(str(tmp_path / f"t{attempt}"), capacity_bytes=1 << 30)
        try:
            assert tier.indexed.wait(10)
            keys = [bytes([0xab]) + os.urandom(15) for _ in range(64)]  # one shard, 64 records
            page = [memoryview(bytes([attempt]) * 4096)]
            assert tier.put(keys, [page] * 64, bytes(16)) == [True] * 64
            assert tier.counters["put_errors"] == 0 and tier.exists_prefix(keys) == 64
        finally:
            tier.close()


def test_a_reader_started_during_the_writers_clear_serves_nothing_written_before_it(tmp_path):
    """A reader (--no-storage-writer) that starts while the writer's clear is under way (its
    mark in the directory, its unlinks not done): the records written before the mark are not
    served, a record written after it is, and the reader finishes no clear; its own deletes and
    clears remove no file either (the writer removes them)."""
    from kvcached.storage import disk
    from kvcached.storage.disk_clear import MARK
    from kvcached.storage.record import GEOMETRY_BYTES

    geometry = bytes(GEOMETRY_BYTES)
    page = [memoryview(bytes([9]) * 4096)]
    old, new = [bytes([1]) * 16, bytes([2]) * 16], bytes([3]) * 16
    writer = disk.DiskBackend(str(tmp_path), capacity_bytes=1 << 30)
    try:
        assert writer.indexed.wait(10) and writer.put(old, [page] * 2, geometry) == [True, True]
    finally:
        writer.close()
    mark = tmp_path / MARK
    mark.write_bytes(b"")
    later = time.time_ns() + 10**9
    os.utime(mark, ns=(later - 10**8, later - 10**8))  # (the clock's tick: a second between)
    writer_file = None
    reader = disk.DiskBackend(str(tmp_path), capacity_bytes=1 << 30, writer=False)
    try:
        assert reader.indexed.wait(10)
        assert reader.exists_prefix(old) == 0
        got = [memoryview(bytearray(4096))]
        assert reader.get_into(old[:1], [got], geometry) == [False]
        records = glob.glob(os.path.join(str(tmp_path), "??", "*.kvb"))
        assert len(records) == 2 and mark.exists()
        writer_file = disk.DiskBackend(str(tmp_path / "elsewhere"), capacity_bytes=1 << 30)  # (a put)
        assert writer_file.indexed.wait(10) and writer_file.put([new], [page], geometry) == [True]
        path = reader._path(new)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copy(writer_file._path(new), path)
        os.utime(path, ns=(later, later))  # written after the mark
        assert reader.exists_prefix([new]) == 1 and reader.get_into([new], [got], geometry) == [True]
        assert bytes(got[0]) == bytes(page[0])
        reader.delete(old + [new])  # (fanned out to every rank: the writer removes the files)
        reader.clear()
        time.sleep(0.2)
        assert len(glob.glob(os.path.join(str(tmp_path), "??", "*.kvb"))) == 3 and mark.exists()
    finally:
        reader.close()
        if writer_file is not None:
            writer_file.close()


@pytest.mark.faults
def test_a_reader_on_a_read_only_view_of_the_writers_directory_reads_it(run_dir, tmp_path):
    """An MLA reader rank given the writer's directory read-only (a volume mounted read-only
    into the reader's container; here a read-only bind mount) starts, stays healthy, and finds
    and loads what the writer stores. Before, its start was refused ("not writable")."""
    shared, view = tmp_path / "shared", tmp_path / "view"
    shared.mkdir(mode=0o700)
    view.mkdir(mode=0o700)
    if subprocess.run(["mount", "--bind", str(shared), str(view)]).returncode:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        kv, keys = small_kv(block_shape=PAGE_SHAPE), keys_for(4, 8)
        expected = snapshot(kv, [0, 1, 2, 3])
        writer, reader = start(run_dir, unique_instance("w"), disk_uri(str(shared))), None
        try:
            reader = start(run_dir, unique_instance("r"), disk_uri(str(view)), extra=["--no-storage-writer"])
            with writer.connect() as cw, reader.connect() as cr:
                cw.register_kv_cache(kv)
                cr.register_kv_cache(kv)
                offload_and_flush(cw, kv, keys, [0, 1, 2, 3])
                time.sleep(2 * PROBE_EVERY_S)  # (its probe has looked at the directory)
                assert cr.status()["storage"][0]["healthy"], cr.status()["storage"][0]
                assert cr.lookup(keys) == (0, 4)
                scramble(kv, 1)
                assert cr.load(keys, [10, 11, 12, 13]).wait(10) == 4
                assert blocks_equal(kv, [10, 11, 12, 13], expected)
        finally:
            writer.stop()
            if reader is not None:
                reader.stop()
    finally:
        subprocess.run(["umount", str(view)], check=True)


def test_a_readers_lookups_do_not_wait_behind_its_reads(tmp_path, caplog):
    """A reader's lookups stat the writer's files on a thread of their own: with its I/O
    threads busy (here each held by a read that has not returned: loads of many blocks from a
    slow disk) a lookup still answers, and the tier is not called stuck. Before, the stat
    queued behind the reads, was cancelled at its 0.25 s deadline (0 hits) and the tier logged
    itself stuck for that while."""
    import threading

    from kvcached.storage import disk

    writer = disk.DiskBackend(str(tmp_path), capacity_bytes=1 << 30)
    keys = [os.urandom(16) for _ in range(4)]
    try:
        assert writer.indexed.wait(10)
        assert writer.put(keys, [[memoryview(bytes(4096))]] * 4, bytes(16)) == [True] * 4
    finally:
        writer.close()
    reader = disk.DiskBackend(str(tmp_path), capacity_bytes=1 << 30, writer=False)
    busy = threading.Event()
    try:
        assert reader.indexed.wait(10)
        for _ in range(disk.IO_THREADS):
            reader._io.submit(busy.wait, 10)
        assert reader.exists_prefix(keys) == 4 and reader.health()
        assert "has not returned" not in caplog.text
    finally:
        busy.set()
        reader.close()


def test_a_capacity_under_one_block_says_why_nothing_is_stored(run_dir, instance, tmp_path):
    """capacity_gb under one block's record: every put is dropped, counted, and the reason is in
    status and, once, in the log. Before, the tier stored nothing and nothing said why (puts 0,
    put_errors 0, dropped_puts 0, no last_error)."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    h = start(run_dir, instance, disk_uri(str(tmp_path / "tier"), capacity_gb=0.00001))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys_for(4), [0, 1, 2, 3])
            offload_and_flush(c, kv, keys_for(4, 1), [4, 5, 6, 7])
            disk = c.status()["storage"][0]
            assert disk["dropped_puts"] == 8 and disk["blocks"] == 0, disk
            assert "larger than the tier's capacity" in disk["last_error"], disk
    finally:
        h.stop()
    with open(h.log_path) as f:
        assert f.read().count("larger than the tier's capacity") == 1


def test_a_reader_does_not_do_the_deletes_its_instance_owed_as_a_writer(tmp_path):
    """An instance that wrote to a directory (and owed a delete in its run dir's record) started
    later as a reader of it (--no-storage-writer): it removes nothing there - the file, which the
    writer may have stored again since, stays. Before, the reader unlinked it at its start."""
    root, key = tmp_path / "t", b"\x05" * 16
    writer = DiskBackend(str(root), 1 << 30)
    assert writer.indexed.wait(5)
    assert writer.put([key], [[bytearray(4096)]], bytes(16)) == [True]
    path = writer._path(key)
    writer.close()
    record = OwedRecord(str(tmp_path / "i.clears-owed"))
    record.note_deletes(f"disk://{root}", [key])
    reader = DiskBackend(str(root), 1 << 30, writer=False)
    try:
        assert reader.indexed.wait(5)
        reader.owe_clear(record)
        time.sleep(2 * PROBE_EVERY_S)  # (the owed unlinks run once the index is whole)
        assert os.path.exists(path)
    finally:
        reader.close()
