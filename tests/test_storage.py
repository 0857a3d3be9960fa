"""The storage tiers through real daemons: disk (restart, corruption, full disk), Redis (and its
outage), write policies, loads through host, prefetch."""
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from conftest import (RedisServer, blocks_equal, disk_uri, keys_for, scramble, small_kv, snapshot, stored,
                      unique_instance, wait_until)
from kvcached_client import Client, KvcachedTimeout, launch
from kvcached_proto import ErrorCode, RequestError

PAGE_SHAPE = (16, 2, 64)  # 4 layers x (K, V) x 4 KiB = 32 KiB per block


def files(root):
    return sorted(glob.glob(os.path.join(root, "??", "*.kvb")))


def start(run_dir, instance, *storage, host_gb=0.05, extra=(), wait_storage=True):
    args = [a for uri in storage for a in ("--storage", uri)] + list(extra)
    return launch(instance=instance, run_dir=run_dir, host_cache_gb=host_gb, extra_args=args,
                  wait_storage=wait_storage)


def offload_and_flush(c, kv, keys, src):
    c.offload(src, keys).wait(10)
    c.flush().wait(30)


def record_path(disk_dir, key, kv):
    """The disk tier's file of key's block of kv's geometry."""
    name = stored(key, kv).hex()
    return os.path.join(disk_dir, name[:2], name + ".kvb")


def stored_on_disk_only(run_dir, instance, disk_dir, seed=0, n=8, extra=()):
    """A daemon whose disk tier holds n blocks its host tier does not, and a KV cache that
    holds other bytes (no client registered): (daemon, kv, keys, the stored bytes)."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys, src = keys_for(n, seed), list(range(n))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, disk_uri(disk_dir), extra=extra)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
    except BaseException:
        h.stop()
        raise
    scramble(kv, 3)
    return h, kv, keys, expected


@contextlib.contextmanager
def on_disk_only(run_dir, instance, disk_dir, seed):
    """stored_on_disk_only with a client that registered the KV: (client, kv, keys, bytes)."""
    h, kv, keys, expected = stored_on_disk_only(run_dir, instance, disk_dir, seed)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            yield c, kv, keys, expected
    finally:
        h.stop()


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


def _keys_alone_in_a_shard(n, index):
    """n keys of which keys[index] has a shard directory to itself."""
    for seed in range(50, 500):
        keys = keys_for(n, seed)
        if sum(k[0] == keys[index][0] for k in keys) == 1:
            return keys
    raise AssertionError("no such keys")


def _stored_with_one_record_hung(run_dir, instance, disk_dir, index, io_timeout_s=1):
    """8 blocks stored on disk by a daemon since stopped, keys[index]'s record on a FUSE shard
    whose reads hang (skips where FUSE cannot be mounted). The tier's I/O deadline is 1 s."""
    import hangfs

    why = hangfs.available()
    if why:
        pytest.skip(why)
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys, src = _keys_alone_in_a_shard(8, index), list(range(8))
    expected = snapshot(kv, src)
    uri = f"disk://{disk_dir}?capacity_gb=1&io_timeout_s={io_timeout_s}"
    h = start(run_dir, instance, uri)
    with h.connect() as c:
        c.register_kv_cache(kv)
        offload_and_flush(c, kv, keys, src)
    h.stop()
    hung = record_path(disk_dir, keys[index], kv)
    size = os.path.getsize(hung)
    os.unlink(hung)
    return kv, keys, expected, uri, hangfs.HangFS(os.path.dirname(hung), os.path.basename(hung), size)


def test_a_record_on_a_hung_filesystem_costs_its_load_a_deadline_not_the_daemon(
        run_dir, instance, disk_dir):
    """A read that never returns (a hung NFS, here a FUSE shard whose reads hang): the load
    gets the leading blocks within the I/O deadline, the tier is stuck (unhealthy, no hits)
    while everything else answers, and a stop still runs to its end: sockets, shared memory
    and the instance are released (a new daemon could start). The process itself exits once
    the kernel lets the blocked thread go - a FUSE request already handed to the server is
    waited for uninterruptibly, SIGKILL included. Before, that load, then every load, hello and
    stop hung."""
    kv, keys, expected, uri, fs = _stored_with_one_record_hung(run_dir, instance, disk_dir, 3)
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


def test_a_gone_engines_mapping_is_dropped_off_the_request_thread(run_dir, instance, disk_dir):
    """An engine says bye while its load's fetch waits on a hung read (the tier's I/O deadline
    is 3 s): its KV mapping goes only after the copies in flight drained, on the control worker,
    so another client's ping and status are answered while the mapping is still there (before:
    the request thread drained, and they were answered after it was gone). Meanwhile the
    mapping serves no op, not even one from a hello that reuses the gone client's id."""
    kv, keys, expected, uri, fs = _stored_with_one_record_hung(run_dir, instance, disk_dir, 2, 3)
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


def test_a_drain_waiting_on_a_hung_read_does_not_hold_the_request_thread(run_dir, instance, disk_dir):
    """pause drains the copies in flight: here a fetch held by a hung read until the tier's
    3 s I/O deadline. The drain runs on the control worker, so another client's ping, lookup
    and status are answered while the pause is still waiting (before: after it)."""
    import threading

    kv, keys, expected, uri, fs = _stored_with_one_record_hung(run_dir, instance, disk_dir, 2, 3)
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


def test_a_hung_read_that_returns_gives_its_block_back_and_the_tier_recovers(
        run_dir, instance, disk_dir):
    kv, keys, expected, uri, fs = _stored_with_one_record_hung(run_dir, instance, disk_dir, 5)
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
    fs = hangfs.HangFS(os.path.join(disk_dir, shard), f"{shard}{'0' * 30}.kvb", 4096, hang="readdir")
    h = start(run_dir, instance, disk_uri(disk_dir), wait_storage=False)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            s = c.status()
            assert (s["storage_ready"], s["storage"][0]["ready"]) == (False, False)
            assert not c.signals.storage_ready()
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


@pytest.fixture
def tiny_fs():
    """A 1 MiB filesystem (tmpfs) that fills up."""
    path = tempfile.mkdtemp(prefix="kvfull-", dir="/tmp")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", path],
                       capture_output=True)
    if r.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a size-limited tmpfs here: {r.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", path], check=True)
    os.rmdir(path)


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
            assert c.lookup(new) == (0, 16)  # the newest blocks made it to disk
            scramble(kv, 3)
            assert c.load(new, list(range(64, 80))).wait(10) == 16
            assert blocks_equal(kv, list(range(64, 80)), expected)
            assert all(os.path.getsize(f) > 0 for f in files(tiny_fs))  # no torn files left
            assert not glob.glob(os.path.join(tiny_fs, "??", "*.tmp"))
        with open(h.log_path) as f:
            assert f.read().count("the filesystem is full") == 1
    finally:
        h.stop()


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


def test_write_through_selective_waits_for_hits(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    h = start(run_dir, instance, disk_uri(disk_dir),
              extra=["--storage-write-policy", "write_through_selective", "--selective-hits", "2"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            keys = keys_for(4, 5)
            offload_and_flush(c, kv, keys, [0, 1, 2, 3])
            assert files(disk_dir) == []
            c.lookup(keys[:2])
            c.lookup(keys[:2])
            c.flush().wait(10)
            assert len(files(disk_dir)) == 2
    finally:
        h.stop()


def test_write_back_writes_only_what_the_host_tier_evicts(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    h = start(run_dir, instance, disk_uri(disk_dir), host_gb=0.0005,  # 16 host blocks
              extra=["--storage-write-policy", "write_back"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            first, second = keys_for(10, 6), keys_for(10, 7)
            expected = snapshot(kv, list(range(10)))
            offload_and_flush(c, kv, first, list(range(10)))
            assert files(disk_dir) == []
            offload_and_flush(c, kv, second, list(range(10, 20)))  # evicts 4 of `first`
            assert len(files(disk_dir)) == 4
            scramble(kv, 3)
            assert c.lookup(first) == (6, 4)
            assert c.load(first, list(range(50, 60))).wait(10) == 10
            assert blocks_equal(kv, list(range(50, 60)), expected)
    finally:
        h.stop()


def test_a_non_writer_rank_reads_but_never_writes(run_dir, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(4, 8)
    writer = start(run_dir, unique_instance("w"), disk_uri(disk_dir))
    try:
        with writer.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, [0, 1, 2, 3])
    finally:
        writer.stop()
    other = start(run_dir, unique_instance("r"), disk_uri(disk_dir), extra=["--no-storage-writer"])
    try:
        with other.connect() as c:
            c.register_kv_cache(kv)
            more = keys_for(4, 9)
            offload_and_flush(c, kv, more, [4, 5, 6, 7])
            assert len(files(disk_dir)) == 4  # nothing new written
            wait_until(lambda: c.lookup(keys) == (0, 4), 10, "the stored blocks found")
            assert c.load(keys, [10, 11, 12, 13]).wait(10) == 4
    finally:
        other.stop()


def test_keys_already_stored_are_not_rewritten(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            keys = keys_for(3, 10)
            offload_and_flush(c, kv, keys, [0, 1, 2])
            mtimes = [os.stat(f).st_mtime_ns for f in files(disk_dir)]
            c.clear(tier="host")
            offload_and_flush(c, kv, keys, [0, 1, 2])
            assert [os.stat(f).st_mtime_ns for f in files(disk_dir)] == mtimes
            assert c.status()["storage"][0]["puts"] == 3
    finally:
        h.stop()


def test_prefetch_warms_the_host_tier(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(20, 11)
    expected = snapshot(kv, list(range(20)))
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(20)))
            c.clear(tier="host")
            small = c.prefetch(keys[:1], block_tokens=16)  # 16 tokens < threshold 256
            assert small.status == "skipped" and small.wait()["prefetched"] == 0
            task = c.prefetch(keys, block_tokens=16, policy="wait_complete")
            assert task.reply["blocks"] == 20
            assert task.wait(10)["prefetched"] == 20
            assert c.lookup(keys) == (20, 0)
            scramble(kv, 3)
            assert c.load(keys, list(range(30, 50))).wait(10) == 20
            assert blocks_equal(kv, list(range(30, 50)), expected)
    finally:
        h.stop()


def test_prefetch_uses_at_most_its_share_of_the_host_pool(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    keys = keys_for(30, 12)
    h = start(run_dir, instance, disk_uri(disk_dir), host_gb=0.001,  # 32 host blocks
              extra=["--prefetch-max-share", "0.25", "--prefetch-threshold-tokens", "0"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(30)))
            c.clear(tier="host")
            task = c.prefetch(keys)
            assert task.reply["blocks"] == 8
            assert task.wait(10)["prefetched"] == 8
            assert c.lookup(keys) == (8, 22)
    finally:
        h.stop()


def test_cancel_stops_a_prefetch(run_dir, instance, disk_dir):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(20, 13)
    h = start(run_dir, instance, disk_uri(disk_dir), extra=["--prefetch-threshold-tokens", "0"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(20)))
            c.clear(tier="host")
            c.pause()
            task = c.prefetch(keys)
            assert task.cancel() == "cancelled"
            c.resume()
            result = task.wait(10)
            assert task.status == "cancelled" and result["prefetched"] == 0
            assert c.lookup(keys) == (0, 20)
            assert c.status()["host"]["used_bytes"] == 0
    finally:
        h.stop()


@contextlib.contextmanager
def in_storage_only(run_dir, instance, uri, keys):
    """A client of a daemon whose storage tier (uri) holds the blocks of `keys` (from blocks 0..n-1)
    and whose host tier does not: (client, kv, the stored bytes, the daemon)."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    src = list(range(len(keys)))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
            yield c, kv, expected, h
    finally:
        h.stop()


def test_redis_tier_round_trip(run_dir, instance, redis_server):
    keys, dst = keys_for(10, 14), list(range(20, 30))
    with in_storage_only(run_dir, instance, redis_server.uri, keys) as (c, kv, expected, _):
        assert c.lookup(keys) == (0, 10)
        scramble(kv, 3)
        assert c.load(keys, dst).wait(10) == 10
        assert blocks_equal(kv, dst, expected)
        assert c.status()["storage"][0]["healthy"]


@pytest.mark.parametrize("scripts", ["allowed", "refused"])
def test_a_redis_lookup_counts_the_leading_keys_present_with_or_without_scripts(
        run_dir, instance, scripts):
    """A lookup asks redis in one script call for the leading keys present; where the server
    refuses scripts (here EVAL/EVALSHA renamed away, as an ACL or a managed service may), the
    tier says so once and pipelines one EXISTS per key: the same counts either way, and a
    refused script is not an outage."""
    import redis

    off = ["--rename-command", "EVAL", "evaloff", "--rename-command", "EVALSHA", "evalshaoff"]
    server = RedisServer(extra=off if scripts == "refused" else ())
    keys = keys_for(10, 34)
    try:
        with in_storage_only(run_dir, instance, server.uri, keys) as (c, kv, _, h):
            def name(k):
                return b"kvcached:" + stored(k, kv).hex().encode()

            assert c.lookup(keys) == (0, 10)
            redis.Redis(port=server.port).delete(name(keys[4]))
            assert c.lookup(keys) == (0, 4)  # the prefix ends at the first key missing
            assert c.lookup(keys[5:]) == (0, 5)
            assert c.lookup(keys_for(3, 35)) == (0, 0)
            # past one script call's keys (SCRIPT_KEYS): 2,500 present, a hole at 1,100
            r, many = redis.Redis(port=server.port), keys_for(2500, 36)
            r.mset({name(k): b"x" for k in many})
            calls = r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
            assert c.lookup(many) == (0, 2500)
            if scripts == "allowed":  # 1,024 + 1,024 + 452 keys: no call holds redis for all
                assert r.info("commandstats")["cmdstat_evalsha"]["calls"] - calls == 3
            r.delete(name(many[1100]))
            assert c.lookup(many) == (0, 1100)
            assert c.status()["storage"][0]["healthy"]
            with open(h.log_path) as log:
                warned = log.read().count("lookup script is refused")
            assert warned == (1 if scripts == "refused" else 0)
    finally:
        server.close()


def test_a_corrupt_redis_value_is_a_miss(run_dir, instance, redis_server):
    import redis

    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(6, 15)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(6)))
            c.clear(tier="host")
            r = redis.Redis(port=redis_server.port)
            name = b"kvcached:" + stored(keys[3], kv).hex().encode()
            value = bytearray(r.get(name))
            value[-1] ^= 0xFF
            r.set(name, bytes(value))
            assert c.load(keys, list(range(10, 16))).wait(10) == 3
            assert r.get(name) is None  # removed, never served
    finally:
        h.stop()


def test_redis_outage_makes_the_tier_unhealthy_not_the_daemon(run_dir, instance, redis_server):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(4, 16)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, [0, 1, 2, 3])
            c.clear(tier="host")
            redis_server.stop()
            assert c.lookup(keys) == (0, 0)
            more = keys_for(4, 17)
            offload_and_flush(c, kv, more, [4, 5, 6, 7])  # backups dropped, counted
            tier = c.status()["storage"][0]
            assert tier["healthy"] is False and tier["dropped_puts"] >= 4
            assert c.lookup(more) == (4, 0)  # the host tier still works
            redis_server.start()  # empty again: persistence is off
            wait_until(lambda: c.status()["storage"][0]["healthy"], 5, "the redis tier healthy again")
            offload_and_flush(c, kv, keys, [0, 1, 2, 3])
            c.clear(tier="host")
            assert c.lookup(keys) == (0, 4)
    finally:
        h.stop()


def test_a_redis_outage_stalls_no_request_beyond_the_lookup_timeout(run_dir, instance, redis_server):
    """The first lookup after the server died, and another client's pings meanwhile, answer
    within a client timeout of 1 s (redis-py's default retries took ~4 s)."""
    import threading

    kv = small_kv(block_shape=PAGE_SHAPE)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect(timeout=1.0) as c, h.connect(timeout=1.0) as other:
            c.register_kv_cache(kv)
            keys = keys_for(4, 33)
            assert c.lookup(keys) == (0, 0)
            redis_server.stop()
            errors, done = [], threading.Event()

            def ping():
                try:
                    while not done.is_set():
                        other.ping()
                except Exception as exc:  # KvcachedTimeout when the request loop stalls
                    errors.append(exc)

            pinger = threading.Thread(target=ping)
            pinger.start()
            try:
                for _ in range(3):
                    assert c.lookup(keys) == (0, 0)
            finally:
                done.set()
                pinger.join(10)
            assert not errors, errors
    finally:
        h.stop()


def test_an_idle_daemon_shows_a_redis_outage_and_recovery_within_2_s(run_dir, instance, redis_server):
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            assert c.status()["storage"][0]["healthy"] is True
            for up in (False, True):
                (redis_server.start if up else redis_server.stop)()
                deadline = time.monotonic() + 2.0  # no request touches the tier meanwhile
                while c.status()["storage"][0]["healthy"] is not up:
                    assert time.monotonic() < deadline, f"status still says healthy={not up}"
                    time.sleep(0.05)
    finally:
        h.stop()


class Blackhole:
    """A TCP port that accepts connections and never answers (a blackholed server)."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self):
        self.sock.close()
        for conn in self.conns:
            conn.close()
        self._thread.join(5)


def test_a_blackholed_redis_never_stalls_the_request_loop(run_dir, instance):
    """Lookups run on the request thread: with a server that never answers, the tier goes
    unhealthy and its probes run on their own thread, so every request keeps answering within a
    client timeout (0.5 s) shorter than the 1 s a probe on the request thread would block."""
    hole = Blackhole()
    kv = small_kv(block_shape=PAGE_SHAPE)
    h = start(run_dir, instance, f"redis://127.0.0.1:{hole.port}/0")
    try:
        with h.connect(timeout=0.5) as c:
            c.register_kv_cache(kv)
            keys = keys_for(4, 31)
            c.offload([0, 1, 2, 3], keys).wait(5)
            deadline = time.monotonic() + 3.5  # three probe periods
            n = 0
            while time.monotonic() < deadline:
                assert c.lookup(keys_for(4, 32)) == (0, 0)  # KvcachedTimeout if the loop stalls
                assert c.lookup(keys) == (4, 0)
                c.ping()
                n += 1
                time.sleep(0.01)
            tier = c.status()["storage"][0]
            assert tier["healthy"] is False and tier["errors"] >= 1
            assert n > 20
    finally:
        h.stop()
        hole.close()


def _cluster(ports):
    nodes = []
    try:
        for p in ports:
            nodes.append(RedisServer(p, extra=["--cluster-enabled", "yes", "--cluster-config-file",
                                               f"nodes-{p}.conf"]))
        r = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                            "--cluster-replicas", "0", "--cluster-yes"], capture_output=True,
                           text=True, timeout=30)
    except BaseException:
        for n in nodes:
            n.close()
        raise
    return nodes, r


def test_redis_cluster_tier(run_dir, instance):
    from conftest import free_port

    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed")
    nodes, r = _cluster([free_port(with_bus=True) for _ in range(3)])
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        time.sleep(1.0)  # let the nodes agree on the slots
        kv = small_kv(block_shape=PAGE_SHAPE)
        keys = keys_for(12, 18)
        expected = snapshot(kv, list(range(12)))
        h = start(run_dir, instance, f"redis+cluster://127.0.0.1:{nodes[0].port}")
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(12)))
                c.clear(tier="host")
                assert c.lookup(keys) == (0, 12)
                scramble(kv, 3)
                assert c.load(keys, list(range(20, 32))).wait(10) == 12
                assert blocks_equal(kv, list(range(20, 32)), expected)
        finally:
            h.stop()
    finally:
        for n in nodes:
            n.close()


def _load_state(c):
    s = c.status()
    return (s["tasks"]["queued"], s["tasks"]["inflight"], s["host"]["pinned_blocks"],
            s["tasks"]["slots_busy"], c.check())


def test_two_loads_of_a_prefix_being_fetched_share_the_fetch(run_dir, instance, disk_dir):
    with on_disk_only(run_dir, instance, disk_dir, 7) as (c, kv, keys, expected):
        c.pause()  # every load is planned before the first fetch runs
        first = c.load(keys, list(range(20, 28)))
        second = c.load(keys, list(range(40, 48)))  # INTERNAL: KeyError before the fix
        third = c.load(keys[:5], list(range(50, 55)))
        assert first.reply["storage_blocks"] == 8 and second.reply["blocks"] == 8
        c.resume()
        assert (first.wait(10), second.wait(10), third.wait(10)) == (8, 8, 5)
        assert blocks_equal(kv, list(range(20, 28)), expected)
        assert blocks_equal(kv, list(range(40, 48)), expected)
        assert blocks_equal(kv, list(range(50, 55)), expected, upto=5)
        assert c.status()["storage_io"]["fetched"] == 8  # one fetch, not three
        assert _load_state(c) == (0, 0, 0, 0, "ok")


def test_a_load_sharing_a_fetch_that_fails_gets_the_leading_blocks_that_arrived(
        run_dir, instance, disk_dir):
    with on_disk_only(run_dir, instance, disk_dir, 8) as (c, kv, keys, expected):
        os.unlink(record_path(disk_dir, keys[3], kv))
        c.pause()
        first, second = c.load(keys, list(range(20, 28))), c.load(keys, list(range(40, 48)))
        c.resume()
        assert (first.wait(10), second.wait(10)) == (3, 3)
        assert blocks_equal(kv, list(range(40, 48)), expected, upto=3)
        assert _load_state(c) == (0, 0, 0, 0, "ok")


def test_cancelling_the_load_that_owns_a_fetch_leaves_the_sharer_whole(run_dir, instance, disk_dir):
    with on_disk_only(run_dir, instance, disk_dir, 9) as (c, kv, keys, expected):
        c.pause()
        owner, sharer = c.load(keys, list(range(20, 28))), c.load(keys, list(range(40, 48)))
        assert owner.cancel() == "cancelled" and owner.wait(10) == 0
        c.resume()
        assert sharer.wait(10) == 8  # the owner's entries went unfetched: it fetched them itself
        assert blocks_equal(kv, list(range(40, 48)), expected)
        assert _load_state(c) == (0, 0, 0, 0, "ok")
