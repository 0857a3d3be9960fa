"""The disk tier's room (kvcached/storage/disk_room.py): a chain larger than the tier's room keeps
its head, not its tail, in one put and across an offload's chunks; a full filesystem's limit is
not lowered by another put's eviction in flight."""
import os
import types

import numpy as np
import pytest

from conftest import blocks_equal, disk_uri, keys_for, scramble, small_kv, snapshot, wait_until
from kvcached.storage import disk, disk_room
from kvcached.storage.record import HEADER_BYTES
from storage_util import PAGE_SHAPE, files, offload_and_flush, record_path, small_filesystem, start

GEOMETRY = bytes(16)


def _pages(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [[memoryview(rng.integers(0, 255, 4096, dtype=np.uint8))] for _ in range(n)]


@pytest.fixture
def tier(tmp_path):
    made = []

    def make(capacity_bytes: int) -> disk.DiskBackend:
        t = disk.DiskBackend(str(tmp_path), capacity_bytes=capacity_bytes)
        made.append(t)
        assert t.indexed.wait(10)
        return t
    yield make
    for t in made:
        t.close()


def test_a_chain_larger_than_the_tiers_room_keeps_its_head(tier):
    """A 16-block chain (an offload's backup) put into a tier with room for 12: before, each
    block evicted the least recently used record - the chain's own first blocks once the others
    were gone - and the tier held blocks 4..15, which no lookup reaches. Now it evicts the other
    records, takes the first 12 blocks and drops the last 4."""
    size = HEADER_BYTES + 4096
    t = tier(12 * size)
    others, chain = keys_for(4, 1), keys_for(16, 2)
    assert t.put(others, _pages(4, 1), GEOMETRY) == [True] * 4
    assert t.put(chain, _pages(16, 2), GEOMETRY, chain={}) == [True] * 12 + [False] * 4
    assert t.exists_prefix(chain) == 12
    assert t.holds(chain) == [True] * 12 + [False] * 4
    assert t.holds(others) == [False] * 4  # evicted for it
    assert (t.counters["dropped_puts"], t.counters["evicted"]) == (4, 4)
    assert len(files(t.root)) == 12 and t.used_bytes == 12 * size


def test_blocks_put_in_no_order_are_plain_lru(tier, monkeypatch):
    """A write-back puts the blocks the host tier evicted, tail first, and no chain: the tier
    keeps the last 12 it was given - the chain's first 12, what a lookup reaches. (As a chain,
    the put would keep the blocks it was given first: the chain's tail.) One I/O thread: with
    two, writes land in either order, and plain LRU evicts by when each landed."""
    monkeypatch.setattr(disk, "IO_THREADS", 1)
    size = HEADER_BYTES + 4096
    t = tier(12 * size)
    chain, pages = keys_for(16, 8), _pages(16, 8)
    assert t.put(chain[::-1], pages[::-1], GEOMETRY) == [True] * 16
    assert t.exists_prefix(chain) == 12 and t.counters["dropped_puts"] == 0


def test_a_chain_put_in_chunks_keeps_its_head(tier):
    """The chunks of one offload's backup share a dict of their chain's places (the tier fills
    it): the second chunk evicts none of the first. Control: the same chunks put as two
    unrelated batches keep the first chunk's head and the second chunk (a lookup finds 4)."""
    size = HEADER_BYTES + 4096
    t = tier(20 * size)
    chain, pages = keys_for(32, 3), _pages(32, 3)
    places: dict = {}  # what the backup of one offload keeps for its chunks (storage_flow.py)
    for lo in (0, 16):
        t.put(chain[lo:lo + 16], pages[lo:lo + 16], GEOMETRY, chain=places)
    assert t.exists_prefix(chain) == 20 and t.holds(chain[20:]) == [False] * 12
    t.clear()
    for lo in (0, 16):  # the control: no chain given
        t.put(chain[lo:lo + 16], pages[lo:lo + 16], GEOMETRY)
    assert t.exists_prefix(chain) == 4 and t.holds(chain[16:]) == [True] * 16


@pytest.mark.parametrize("unlinked", [False, True], ids=["not-yet-unlinked", "unlinked-meanwhile"])
def test_another_puts_eviction_does_not_lower_a_full_filesystems_limit(tier, monkeypatch, unlinked):
    """ENOSPC sets the limit to what the tier holds on the filesystem plus its free space, less
    8 blocks. Another put's eviction took 8 records out of the index before their files were
    unlinked (or between the tier's count and the filesystem's): the limit went 8 blocks lower
    than the filesystem called for (20 -> 12 blocks on a 1 MiB filesystem, under a 16-block
    chain: the full-disk test's rare failure)."""
    size = HEADER_BYTES + 4096
    t = tier(1 << 30)
    keys = keys_for(28, 4)
    assert t.put(keys, _pages(28, 4), GEOMETRY) == [True] * 28
    full = types.SimpleNamespace(f_blocks=256, f_frsize=4096, f_bavail=0, f_files=0, f_favail=0)
    held_back: list = []
    if unlinked:  # the other put evicts (and unlinks) between the two readings
        def statvfs(_path):
            t.limit_bytes = 20 * size
            t._evict_over_capacity(0)
            return full
    else:  # evicted before the ENOSPC; its files go after the filesystem was read
        monkeypatch.setattr(t, "_unlink_victims", held_back.append)
        t.limit_bytes = 20 * size
        t._evict_over_capacity(0)

        def statvfs(_path):
            return full
    monkeypatch.setattr(disk_room.os, "statvfs", statvfs)
    t._on_full(size)
    monkeypatch.undo()
    for victims in held_back:
        t._unlink_victims(victims)
    assert t.limit_bytes == 20 * size and len(files(t.root)) == 20


@pytest.mark.faults
def test_an_offload_larger_than_the_disk_tier_keeps_its_head(run_dir, instance, disk_dir):
    """32 blocks offloaded at once (a backup of two 16-block chunks) into a disk tier with room
    for 20: the tier holds the first 20, which load back right; before, it held blocks 0-3 and
    16-31, and a lookup found 4."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
    keys, src, dst = keys_for(32, 5), list(range(32)), list(range(40, 60))
    expected = snapshot(kv, src[:20])
    record = HEADER_BYTES + (32 << 10)  # PAGE_SHAPE: 4 layers x (K, V) x 4 KiB
    h = start(run_dir, instance, disk_uri(disk_dir, capacity_gb=20.5 * record / 2**30))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
            assert c.lookup(keys) == (0, 20)
            assert [os.path.exists(record_path(disk_dir, k, kv)) for k in keys] == [True] * 20 + [False] * 12
            scramble(kv, 3)
            assert c.load(keys[:20], dst).wait(10) == 20
            assert blocks_equal(kv, dst, expected)
            assert c.status()["storage"][0]["dropped_puts"] == 12
    finally:
        h.stop()


@pytest.mark.faults
def test_a_chain_larger_than_a_full_filesystem_keeps_its_head(run_dir, instance):
    """A 1 MiB filesystem that a first offload filled (the tier's limit lowered under it), then a
    32-block chain: whatever the limit, the tier holds a head of the chain - every block before
    the last it holds - and a lookup finds all of them."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    old, new = keys_for(48, 6), keys_for(32, 7)
    with small_filesystem("1m") as fs:
        h = start(run_dir, instance, disk_uri(fs, capacity_gb=1.0), host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, old, list(range(48)))
                assert c.status()["storage"][0]["full"]
                offload_and_flush(c, kv, new, list(range(48, 80)))
                c.clear(tier="host")
                held = [os.path.exists(record_path(fs, k, kv)) for k in new]
                n = sum(held)
                assert n >= 8 and held == [True] * n + [False] * (32 - n)
                assert c.lookup(new) == (0, n)
        finally:
            h.stop()


def test_a_disk_tier_whose_full_index_outgrows_the_machines_memory_is_named_at_registration(
        run_dir, instance, tmp_path):
    """The index holds an entry of about 200 bytes a record: 100,000 GB of 32 KiB blocks would
    take some 600 GiB of the daemon's memory, and a tier that fills up gets the daemon killed for
    memory. The registration that fixes the block size says so (with the capacity that fits);
    a 1 GB tier beside it says nothing."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    said = [line for line in _registration_log(run_dir, instance, tmp_path / "big", 100_000, kv)
            if "indexes at capacity" in line]
    assert len(said) == 1 and "of 32 KiB blocks" in said[0] and str(tmp_path / "big") in said[0]
    assert "capacity_gb at most" in said[0] and "Lower capacity_gb" in said[0]
    small = _registration_log(run_dir, instance, tmp_path / "small", 1.0, kv)
    assert not [line for line in small if "indexes at capacity" in line]


def _registration_log(run_dir, instance, path, capacity_gb: float, kv) -> list[str]:
    """The log of a daemon with a disk tier at path, up to kv's registration."""
    path.mkdir()
    h = start(run_dir, instance, disk_uri(str(path), capacity_gb=capacity_gb))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
        # the daemon's log lines are written by its log thread, after the reply at times (under
        # load: the registration's line was not there yet once); the warning comes before it
        wait_until(lambda: " registered " in open(h.log_path).read(), 20, "the registration's log line")
        with open(h.log_path) as f:
            return f.readlines()
    finally:
        h.stop()
