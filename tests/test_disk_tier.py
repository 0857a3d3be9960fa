"""The disk tier through real daemons: blocks across a restart, damaged, planted and hung
records, storage readiness, a full disk and its capacity (drains waiting on a hung read:
test_control_worker.py)."""
import glob
import os
import signal
import threading

import pytest

from conftest import blocks_equal, disk_uri, keys_for, scramble, small_kv, snapshot, stored, wait_until
from kvcached_client import KvcachedTimeout
from kvcached_proto import MAX_KEYS_PER_REQUEST, Busy, Op, pack_keys
from storage_util import (PAGE_SHAPE, files, listing_held, offload_and_flush, on_disk_only, record_path,
                          small_filesystem, start, stored_with_one_record_hung)


def test_blocks_survive_a_daemon_restart_on_disk(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys, src, dst = keys_for(12), list(range(12)), list(range(30, 42))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, disk_uri(disk_dir))
    with h.connect() as c:
        c.register_kv_cache(kv)
        offload_and_flush(c, kv, keys, src)
    h.stop()
    assert len(files(disk_dir)) == 12
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            wait_until(lambda: c.lookup(keys) == (0, 12), 10,  # the index is rebuilt in the background
                       "the rebuilt index answering")
            scramble(kv, 3)
            task = c.load(keys, dst)
            assert (task.reply["host_blocks"], task.reply["storage_blocks"]) == (0, 12)
            task.wait_layer(0, timeout=10)
            assert task.valid_blocks == 12
            assert task.wait(10) == 12
            assert blocks_equal(kv, dst, expected)
            assert c.lookup(keys) == (12, 0)  # pulled through the host tier
            s = c.status()  # the fetch is storage I/O; h2d counts the device copies once
            assert s["bytes"]["h2d"] == 12 * s["kv"]["page_bytes"]
            assert s["storage_io"]["fetched_bytes"] == 12 * s["kv"]["page_bytes"]
    finally:
        h.stop()


@pytest.mark.faults
@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign_key", "empty"])
def test_a_damaged_block_file_is_a_miss_never_wrong_bytes(run_dir, instance, disk_dir, damage):
    dst = list(range(40, 48))
    with on_disk_only(run_dir, instance, disk_dir, 1) as (c, kv, keys, expected):
        bad = record_path(disk_dir, keys[5], kv)
        data = bytearray(open(bad, "rb").read())
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
        elif damage == "truncate":
            data = data[: len(data) - 100]
        elif damage == "foreign_key":  # a valid record of another key under this name
            data = bytearray(open(record_path(disk_dir, keys[4], kv), "rb").read())
        else:
            data = bytearray()
        open(bad, "wb").write(data)
        assert c.lookup(keys) == (0, 8)  # the index does not know yet
        task = c.load(keys, dst)
        assert task.wait(10) == 5  # the leading blocks before the damaged one
        assert blocks_equal(kv, dst, expected, upto=5)
        assert not os.path.exists(bad)  # removed, never served
        assert c.lookup(keys) == (5, 0)


def test_stray_and_temp_files_are_removed_at_start(run_dir, instance, disk_dir):
    os.makedirs(os.path.join(disk_dir, "ab"))
    stray = [os.path.join(disk_dir, "ab", "not-a-block.txt"),
             os.path.join(disk_dir, "ab", "ab" + "0" * 30 + ".kvb.123.tmp")]
    for p in stray:
        open(p, "wb").write(b"junk")
    fifo, link = (os.path.join(disk_dir, "ab", "ab" + c * 30 + ".kvb") for c in "12")
    os.mkfifo(fifo, 0o600)  # record names, but not regular files: not ours to serve
    os.symlink(stray[0], link)
    stray += [fifo, link]
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            wait_until(lambda: not any(os.path.exists(p) for p in stray), 10, "stray files removed")
            assert c.status()["storage"][0]["healthy"]
    finally:
        h.stop()


@pytest.mark.faults
def test_a_fifo_in_place_of_a_record_is_damage_not_a_hang(run_dir, instance, disk_dir):
    """Before, the fetch's open() waited for a writer forever: the load never ended."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys, src = keys_for(8, 40), list(range(8))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect(timeout=5) as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
            fifo = record_path(disk_dir, keys[3], kv)
            os.unlink(fifo)
            os.mkfifo(fifo, 0o600)
            scramble(kv, 3)
            assert c.load(keys, list(range(20, 28))).wait(5) == 3
            assert blocks_equal(kv, list(range(20, 28)), expected, upto=3)
            assert not os.path.exists(fifo)  # damage: removed
            assert c.status()["storage"][0]["healthy"]
        assert h.stop(timeout=10) == 0
    finally:
        h.stop()


@pytest.mark.faults
@pytest.mark.slow
def test_a_record_on_a_hung_filesystem_costs_its_load_a_deadline_not_the_daemon(
        run_dir, instance, disk_dir):
    """A read that never returns (a hung NFS, here a FUSE shard whose reads hang): the load
    gets the leading blocks within the I/O deadline, the tier is stuck (unhealthy, no hits)
    while everything else answers, and a stop still runs to its end: sockets, shared memory
    and the instance are released (a new daemon could start). The process itself exits once
    the kernel lets the blocked thread go - a FUSE request already handed to the server is
    waited for uninterruptibly, SIGKILL included. Before, that load, then every load, hello and
    stop hung."""
    kv, keys, expected, uri, fs = stored_with_one_record_hung(run_dir, instance, disk_dir, 3)
    h = None
    try:
        h = start(run_dir, instance, uri)  # the index rebuild lists the FUSE shard: it answers that
        with h.connect(timeout=5) as c, h.connect(timeout=5) as other:
            c.register_kv_cache(kv)
            assert c.lookup(keys) == (0, 8)
            scramble(kv, 3)
            assert c.load(keys, list(range(20, 28))).wait(5) == 3  # after the 1 s deadline
            assert fs.held, "the read did not reach the hung filesystem"
            assert blocks_equal(kv, list(range(20, 28)), expected, upto=3)
            tier = c.status()["storage"][0]
            assert (tier["healthy"], tier["stuck"], tier["late_io"]) == (False, True, 1)
            assert c.lookup(keys) == (3, 0)  # a stuck tier gives no hits
            assert other.ping() < 5 and other.status()["instance"] == instance
            assert c.check() == "ok"
        h.proc.send_signal(signal.SIGTERM)
        released = [os.path.join(run_dir, f"{instance}.sock"), f"/dev/shm/kvcached.{os.getuid()}.{instance}"]
        wait_until(lambda: not any(os.path.exists(p) for p in released)
                   and "stopped" in open(h.log_path).read(), 15, "the stop running to its end")
    finally:
        fs.close()  # the blocked read ends (EIO): the process can exit now
        if h is not None:
            h.proc.wait(20)
            assert h.stop() == 0


@pytest.mark.faults
def test_a_hung_read_that_returns_gives_its_block_back_and_the_tier_recovers(
        run_dir, instance, disk_dir):
    kv, keys, expected, uri, fs = stored_with_one_record_hung(run_dir, instance, disk_dir, 5)
    try:
        h = start(run_dir, instance, uri)
        with h.connect(timeout=5) as c:
            c.register_kv_cache(kv)
            blocks_before = c.status()["host"]["capacity_blocks"]
            assert c.load(keys, list(range(20, 28))).wait(5) == 5
            fs.release_reads()  # the read ends (EIO): its host block comes back, the tier serves
            wait_until(lambda: c.status()["storage"][0]["healthy"], 5, "the tier healthy again")
            assert c.check() == "ok"
            c.clear(tier="host")
            assert c.status()["host"]["used_bytes"] == 0  # the lent block went back to the pool
            assert c.status()["host"]["capacity_blocks"] == blocks_before
            scramble(kv, 3)
            assert c.load(keys, list(range(20, 28))).wait(5) == 5  # the damaged record is gone
            assert blocks_equal(kv, list(range(20, 28)), expected, upto=5)
    finally:
        h.stop()
        fs.close()


def test_storage_readiness_is_shown_and_waited_for_and_what_changed_meanwhile_wins(
        run_dir, instance, disk_dir):
    """While the disk index is rebuilt (held here: one shard's listing hangs until released),
    status and the shm flag say storage is not ready, lookups see no storage hits, and
    wait_storage_ready waits. Puts made meanwhile are counted once, a delete made meanwhile
    stays deleted. Before, nothing said so, puts counted twice and deleted blocks came back."""
    import hangfs

    why = hangfs.available()
    if why:
        pytest.skip(why)
    kv = small_kv(block_shape=PAGE_SHAPE)
    old, new = keys_for(8, 60), keys_for(4, 61)
    h = start(run_dir, instance, disk_uri(disk_dir))
    with h.connect() as c:
        c.register_kv_cache(kv)
        offload_and_flush(c, kv, old, list(range(8)))
    h.stop()
    shard = next(f"{b:02x}" for b in range(256) if b not in {stored(k, kv)[0] for k in old + new})
    os.makedirs(os.path.join(disk_dir, shard), mode=0o700, exist_ok=True)  # (a put makes it)
    fs = hangfs.HangFS(os.path.join(disk_dir, shard), f"{shard}{'0' * 30}.kvb", 4096, hang="readdir")
    h = start(run_dir, instance, disk_uri(disk_dir), wait_storage=False)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            s = c.status()
            assert (s["storage_ready"], s["storage"][0]["ready"]) == (False, False)
            assert not c.status_block.storage_ready()
            assert c.lookup(old) == (0, 0)  # not indexed yet: no storage hits
            with pytest.raises(KvcachedTimeout):
                c.wait_storage_ready(0.3)
            offload_and_flush(c, kv, new, [0, 1, 2, 3])  # puts while indexing
            c.delete([old[7]])  # a delete while indexing
            fs.release_listing()
            c.wait_storage_ready(10)
            assert c.status()["storage_ready"] is True
            c.clear(tier="host")
            assert c.lookup(new) == (0, 4)
            assert c.lookup(old) == (0, 7)  # the deleted block stays deleted
            gone = record_path(disk_dir, old[7], kv)
            wait_until(lambda: not os.path.exists(gone), 5, "the deleted record's file gone")  # I/O thread
            on_disk = sum(os.path.getsize(f) for f in files(disk_dir))  # the FUSE shard's file too
            assert c.status()["storage"][0]["used_bytes"] == on_disk
    finally:
        fs.close()
        h.stop()


def test_deletes_while_the_index_is_rebuilt_keep_a_bounded_set_then_wait(run_dir, instance, disk_dir):
    """The keys deleted while the listing runs are kept for its merge, for ever where it hangs:
    60 deletes of 65,536 keys grew the daemon by 380 MB in 8 s. Past MAX_DELETED_WHILE_INDEXING
    a delete is BUSY and changes nothing; once the index is whole it goes through."""
    from kvcached.storage.disk_listing import MAX_DELETED_WHILE_INDEXING

    kv = small_kv(block_shape=PAGE_SHAPE)
    old = keys_for(4, 62)
    fs = listing_held(run_dir, instance, disk_dir, kv, old)
    h = start(run_dir, instance, disk_uri(disk_dir), wait_storage=False)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            per = MAX_KEYS_PER_REQUEST
            for i in range(MAX_DELETED_WHILE_INDEXING // per):
                c._request(Op.DELETE, None, keys=pack_keys(keys_for(per, 1000 + i)))
            with pytest.raises(Busy, match="rebuilding its index"):
                c._request(Op.DELETE, None, keys=pack_keys(old[:1]))
            fs.release_listing()
            c.wait_storage_ready(10)
            assert c.lookup(old) == (0, 4)  # the refused delete changed nothing
            assert c._request(Op.DELETE, None, keys=pack_keys(old[:1]))["storage_deleted"] == 1
            assert c.lookup(old) == (0, 0)
            # the deletes kept while indexing are not on record: no clear owed for their number
            assert not c.status()["storage"][0]["clear_owed"]
        h.stop()
        h = start(run_dir, instance, disk_uri(disk_dir))
        with h.connect() as c:
            c.register_kv_cache(kv)
            assert c.lookup(old[1:]) == (0, 3)  # (the next start cleared nothing)
    finally:
        fs.close()
        h.stop()


@pytest.fixture
def tiny_fs():
    """A 1 MiB filesystem (tmpfs) that fills up."""
    with small_filesystem("1m") as path:
        yield path


@pytest.mark.faults
def test_a_full_disk_evicts_its_oldest_blocks_and_keeps_storing_new_ones(run_dir, instance, tiny_fs):
    """A 1 MiB filesystem under a 1 GiB tier: ENOSPC lowers the tier's limit (said once, in
    status and the log) and the tier evicts to stay under it. Before, it kept its oldest blocks
    and refused every new one."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    old, new = keys_for(48, 2), keys_for(16, 3)  # 48 x 32 KiB = 1.5 MiB > 1 MiB
    expected = snapshot(kv, list(range(48, 64)))
    h = start(run_dir, instance, disk_uri(tiny_fs, capacity_gb=1.0), host_gb=0.01)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, old, list(range(48)))
            disk = c.status()["storage"][0]
            assert disk["full"] and disk["enospc"] > 0 and disk["healthy"]
            assert disk["limit_bytes"] < 1 << 20 < disk["capacity_bytes"]
            offload_and_flush(c, kv, new, list(range(48, 64)))
            c.clear(tier="host")
            found = c.lookup(new)
            if found != (0, 16):  # the newest blocks made it to disk; else say why (a rare flake)
                with open(h.log_path) as f:
                    log = f.read()[-4000:]
                pytest.fail(f"lookup {found}; disk tier {c.status()['storage'][0]}; log:\n{log}")
            scramble(kv, 3)
            assert c.load(new, list(range(64, 80))).wait(10) == 16
            assert blocks_equal(kv, list(range(64, 80)), expected)
            assert all(os.path.getsize(f) > 0 for f in files(tiny_fs))  # no torn files left
            assert not glob.glob(os.path.join(tiny_fs, "??", "*.tmp"))
        with open(h.log_path) as f:
            assert f.read().count("the filesystem is full") == 1
    finally:
        h.stop()


def test_puts_that_hit_a_full_filesystem_together_lower_the_limit_once(tmp_path, monkeypatch):
    """Each put that met ENOSPC lowered the limit a few blocks under the last value: the
    tier's I/O threads hitting a full 1 MiB filesystem together took its limit to 0, and it
    stored nothing more (seen once in CI). The limit comes from the filesystem's state: the
    tier's bytes and what is free, less a few blocks, however many puts ask."""
    import types

    from kvcached.storage import disk, disk_room

    tier = disk.DiskBackend(str(tmp_path), capacity_bytes=1 << 30)
    try:
        assert tier.indexed.wait(10)
        size, free = 33 << 10, 40 << 10  # less free than two blocks: the filesystem is full
        monkeypatch.setattr(disk.os, "statvfs", lambda _p: types.SimpleNamespace(
            f_blocks=256, f_frsize=4096, f_bavail=free // 4096, f_files=0, f_favail=0))
        tier.used_bytes = 28 * size  # what the tier holds (a test's stand-in for 28 records)
        expected = 28 * size + free // 4096 * 4096 - disk_room.ENOSPC_EVICT_BLOCKS * size
        threads = [threading.Thread(target=tier._on_full, args=(size,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        tier._on_full(size)
        assert tier.limit_bytes == expected and tier.counters["enospc"] == 9
    finally:
        tier.used_bytes = 0
        tier.close()


def test_a_put_whose_retry_meets_enospc_again_tries_again(tmp_path, monkeypatch):
    """A put that met ENOSPC found room (another put's victims were unlinked meanwhile) and
    wrote again, but a write on the other I/O thread had taken that room: the second ENOSPC
    failed the put (a flake of the full-disk test above). A put goes on making room and
    writing while the filesystem says ENOSPC, a few times; then it fails."""
    import errno
    import types

    from kvcached.storage import disk, disk_room

    monkeypatch.setattr(disk.os, "statvfs", lambda _p: types.SimpleNamespace(
        f_blocks=1 << 20, f_frsize=4096, f_bavail=1 << 19, f_files=0, f_favail=0, f_flag=0))
    tier = disk.DiskBackend(str(tmp_path), capacity_bytes=1 << 30)
    try:
        assert tier.indexed.wait(10)
        real, calls = tier._write, []

        def write(key, *rest):  # ENOSPC for the first tries of each key, then the real write
            calls.append(key)
            if calls.count(key) < disk_room.ENOSPC_TRIES:
                return OSError(errno.ENOSPC, "No space left on device")
            return real(key, *rest)

        tier._write = write
        page = [memoryview(bytes([7]) * 4096)]
        assert tier.put([b"\x01" * 16], [page], bytes(16)) == [True]
        assert tier.exists_prefix([b"\x01" * 16]) == 1 and tier.counters["enospc"] >= 2
        calls.clear()
        tier._write = lambda key, *rest: (calls.append(key),
                                          OSError(errno.ENOSPC, "No space left on device"))[1]
        assert tier.put([b"\x02" * 16], [page], bytes(16)) == [False]  # never room: it ends
        assert len(calls) == disk_room.ENOSPC_TRIES and tier.counters["put_errors"] == 1
        assert tier.used_bytes == len(files(str(tmp_path))) * (4096 + disk.HEADER_BYTES)
    finally:
        tier.close()


def test_disk_capacity_is_enforced_with_lru(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    cap_gb = 10 * (32768 + 48) / 2**30  # room for 10 block files
    h = start(run_dir, instance, disk_uri(disk_dir, cap_gb))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            first, second = keys_for(8, 3), keys_for(8, 4)
            offload_and_flush(c, kv, first, list(range(8)))
            offload_and_flush(c, kv, second, list(range(8, 16)))
            assert len(files(disk_dir)) == 10
            c.clear(tier="host")
            assert c.lookup(second) == (0, 8)  # the newest survive
            # six of the older chain went, its tail first: its head is still a prefix
            assert c.lookup(first) == (0, 2)
    finally:
        h.stop()


def test_the_index_rebuild_leaves_this_processs_writes_in_progress_alone(tmp_path):
    """A put beside the start's index rebuild had its temp file removed as a crashed write's,
    and failed (ENOENT at its rename): seen as a flaky restart test. A crashed process's temp
    file still goes."""
    from kvcached.storage.disk_listing import list_records

    shard = tmp_path / "ab"
    shard.mkdir()
    name = "ab" + "0" * 30 + ".kvb"
    ours = shard / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    crashed = shard / f"{name}.{os.getpid() + 1}.7.tmp"
    ours.write_bytes(b"x")
    crashed.write_bytes(b"x")
    found, removed = list_records(str(tmp_path), set())
    assert found == [] and removed == 1
    assert ours.exists() and not crashed.exists()


@pytest.mark.faults
def test_a_second_daemon_on_a_disk_tiers_directory_is_refused_by_name(run_dir, instance, disk_dir):
    """One config file for every GPU of a node gives every daemon the same directory: each
    indexed only its own writes, evicted for a capacity it took for its own, and a start of one
    removed the others' writes in progress (temp files of another pid) - now the second is
    refused at start, naming the first; the first works on, and a successor of a killed one
    (the kernel drops the lock) finds its blocks. A lock file planted as a link is replaced,
    the link's target untouched. A tier that does not write may share a writer's directory."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys, src, dst = keys_for(8, 40), list(range(8)), list(range(20, 28))
    expected = snapshot(kv, src)
    target = os.path.join(run_dir, "not-the-lock")
    open(target, "w").write("keep")
    os.symlink(target, os.path.join(disk_dir, ".kvcached.lock"))
    first = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with first.connect() as c:
            c.register_kv_cache(kv)
            with pytest.raises(Exception, match=rf"in use by the daemon of pid {first.proc.pid}; give each "
                                                r"daemon a directory of its own"):
                start(run_dir, instance + "b", disk_uri(disk_dir))
            with pytest.raises(Exception, match="names the directory twice"):
                start(run_dir, instance + "c", disk_uri(os.path.join(run_dir, "d2")),
                      disk_uri(os.path.join(run_dir, "d2") + "/"))
            # an MLA model's other ranks (--no-storage-writer) read the writer's directory, and
            # remove nothing there at start (a temp file of another pid: a write in progress)
            os.makedirs(os.path.join(disk_dir, "ab"), mode=0o700, exist_ok=True)
            temp = os.path.join(disk_dir, "ab", "ab" + "0" * 30 + ".kvb.99999.1.tmp")
            open(temp, "wb").write(b"half")
            start(run_dir, instance + "r", disk_uri(disk_dir), extra=["--no-storage-writer"]).stop()
            assert os.path.exists(temp)
            offload_and_flush(c, kv, keys, src)
        first.proc.kill()
        first.proc.wait(10)
    finally:
        first.stop()
    assert open(target).read() == "keep"
    successor = start(run_dir, instance, disk_uri(disk_dir))  # (it sweeps what the kill left)
    try:
        with successor.connect() as c:
            c.register_kv_cache(kv)
            wait_until(lambda: c.lookup(keys) == (0, 8), 10, "the first daemon's blocks indexed")
            scramble(kv, 5)
            assert c.load(keys, dst).wait(10) == 8 and blocks_equal(kv, dst, expected)
    finally:
        successor.stop()


def test_a_filesystem_that_takes_no_locks_keeps_the_tier_with_a_warning(tmp_path, monkeypatch, caplog):
    """NFS mounted `nolock`, some FUSE filesystems: flock fails with ENOLCK. The tier is used,
    and the log says nothing keeps a second daemon off it (refusing it would refuse the start)."""
    import errno
    from kvcached.storage import disk, disk_lock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(disk_lock.fcntl, "flock", no_locks)
    tier = disk.DiskBackend(str(tmp_path), capacity_bytes=1 << 30)
    try:
        assert tier.indexed.wait(10) and tier.health()
        assert "the filesystem takes no locks (No locks available)" in caplog.text
    finally:
        tier.close()
