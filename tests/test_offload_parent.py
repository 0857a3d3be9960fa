"""An offload that names the block it continues (protocol 1.15 `parent`): a request offloaded in
parts (vLLM saves each step's blocks; a request that hit a prefix saves only what follows it) is
one chain in the host tier and in the disk tier, so both keep its head and lose its tail, as they
do for a request offloaded whole. Each tier's test runs the same parts without the parent as its
control, which loses the head (what the tiers did before)."""
import os

import pytest

from conftest import blocks_equal, disk_uri, keys_for, scramble, small_kv, snapshot
from kvcached.storage.record import HEADER_BYTES
from kvcached_client import launch
from kvcached_proto import ErrorCode, ProtocolError
from kvcached_proto.messages import make_request, parse_request
from kvcached_proto.ops import Op
from storage_util import PAGE_SHAPE, record_path, start

RECORD = HEADER_BYTES + (32 << 10)  # a PAGE_SHAPE block on disk


def test_the_parent_field_is_a_key_or_nothing():
    body = {"keys": b"\x01" * 16, "blocks": (0).to_bytes(4, "little")}
    assert parse_request(make_request(Op.OFFLOAD, 1, "c", **body)).body["parent"] == b""
    got = parse_request(make_request(Op.OFFLOAD, 1, "c", parent=b"\x02" * 16, **body))
    assert got.body["parent"] == b"\x02" * 16
    for bad in (b"\x02" * 15, b"\x02" * 17, "p" * 16, 7):
        with pytest.raises(ProtocolError) as err:
            parse_request(make_request(Op.OFFLOAD, 1, "c", parent=bad, **body))
        assert err.value.code == ErrorCode.BAD_FIELD and "parent" in str(err.value)


def _offload_in_parts(c, keys, src, parent: bool) -> None:
    """keys[:8] from src[:8], then keys[8:] from src[8:] naming keys[7] (or not)."""
    c.offload(src[:8], keys[:8]).wait(10)
    c.offload(src[8:], keys[8:], parent=keys[7] if parent else None).wait(10)


@pytest.mark.parametrize("parent", [True, False], ids=["parent", "control"])
def test_a_request_offloaded_in_two_parts_loses_its_tail_first_in_the_host_tier(
        run_dir, instance, parent):
    """A 24-block host tier holding a 16-block request offloaded as 8 + 8 blocks; another
    request's 16 blocks take 8 of them. Named, the later part goes (the earlier part's last
    block has a child) and a lookup finds the first 8, which load back right. The control:
    the earlier part, older, goes first - the lookup finds nothing while the later part's 8
    blocks stay where no lookup reaches them."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
    keys, other = keys_for(16, 21), keys_for(16, 22)
    src, dst = list(range(16)), list(range(40, 48))
    expected = snapshot(kv, src[:8])
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=24 * (32 << 10) / 2**30)
    try:
        with h.connect() as c:
            assert c.register_kv_cache(kv)["host_blocks"] == 24
            with pytest.raises(ValueError, match="parent"):  # refused before anything is sent
                c.offload(src[8:], keys[8:], parent=keys[7][:8])
            _offload_in_parts(c, keys, src, parent)
            c.offload(list(range(16, 32)), other).wait(10)
            assert c.status()["host"]["evictions"] == 8
            if not parent:
                assert c.lookup(keys) == (0, 0) and c.lookup(keys[8:]) == (8, 0)
                return
            assert c.lookup(keys) == (8, 0) and c.lookup(keys[8:]) == (0, 0)
            scramble(kv, 5)
            assert c.load(keys[:8], dst).wait(10) == 8
            assert blocks_equal(kv, dst, expected)
    finally:
        h.stop()


def test_a_part_that_meets_a_full_host_tier_does_not_evict_the_block_it_names(run_dir, instance):
    """The 24-block host tier full (the first 8 blocks, then another request's 16) when the
    second part comes: its allocations evict 8 blocks, and the first part's last block - the
    least recently used leaf - is the block the part names. It is held through the allocations
    (the other request's tail goes), so the parts link and a lookup finds all 16; before, the
    part's first allocation evicted it, the link was lost and the first part went after it."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
    keys, other = keys_for(16, 24), keys_for(16, 25)
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=24 * (32 << 10) / 2**30)
    try:
        with h.connect() as c:
            assert c.register_kv_cache(kv)["host_blocks"] == 24
            c.offload(list(range(8)), keys[:8]).wait(10)
            c.offload(list(range(16, 32)), other).wait(10)
            c.offload(list(range(8, 16)), keys[8:], parent=keys[7]).wait(10)
            assert c.status()["host"]["evictions"] == 8
            assert c.lookup(keys) == (16, 0) and c.lookup(other) == (8, 0)
    finally:
        h.stop()


@pytest.mark.parametrize("parent", [True, False], ids=["parent", "control"])
def test_a_request_offloaded_in_two_parts_keeps_its_head_in_a_smaller_disk_tier(
        run_dir, instance, disk_dir, parent):
    """32 blocks offloaded as 16 + 16 into a disk tier with room for 20. Named, the second
    part's backup goes on with the first's chain: it evicts none of the first part and takes the
    4 blocks that fit (the tier holds blocks 0-19, a lookup finds 20). The control: the second
    part evicts the first's least recently used blocks (a chain's head is used last: its tail) to
    store its own - the tier holds blocks 0-3 and 16-31, and a lookup finds 4."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
    keys, src = keys_for(32, 23), list(range(32))
    h = start(run_dir, instance, disk_uri(disk_dir, capacity_gb=20.5 * RECORD / 2**30))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            c.offload(src[:16], keys[:16]).wait(10)
            c.offload(src[16:], keys[16:], parent=keys[15] if parent else None).wait(10)
            c.flush().wait(30)
            c.clear(tier="host")
            on_disk = [os.path.exists(record_path(disk_dir, k, kv)) for k in keys]
            storage = c.status()["storage_io"]
            if not parent:
                assert on_disk == [True] * 4 + [False] * 12 + [True] * 16 and c.lookup(keys) == (0, 4)
                assert storage["chains_continued"] == 0
                return
            assert on_disk == [True] * 20 + [False] * 12 and c.lookup(keys) == (0, 20)
            assert storage["chains_continued"] == 1
            dst, expected = list(range(40, 60)), snapshot(kv, src[:20])
            scramble(kv, 3)
            assert c.load(keys[:20], dst).wait(10) == 20
            assert blocks_equal(kv, dst, expected)
    finally:
        h.stop()


def test_kept_chains_are_bounded_and_a_fork_goes_on_in_one_branch(monkeypatch):
    """BackupChains (pure logic, entries faked): a chain goes on with the backup whose first
    block's parent is where it ended, once; at most MAX_CHAINS chains and MAX_KEPT_KEYS keys
    are kept (the oldest go), and a chain over MAX_CHAIN_KEYS is not kept."""
    from types import SimpleNamespace

    from kvcached.service import backup_chains
    from kvcached.service.backup_chains import BackupChains

    def entry(key, parent=None):
        return SimpleNamespace(key=key, parent=parent)

    counters = {}
    chains = BackupChains(counters)
    a7 = entry(b"a7")
    assert chains.start(entry(b"a0")) == {}
    chains.end({b"a0": 0, b"a7": 1}, a7)
    got = chains.start(entry(b"b0", parent=a7))  # one branch of the fork goes on with it ...
    assert got == {b"a0": 0, b"a7": 1} and counters["chains_continued"] == 1
    assert chains.start(entry(b"c0", parent=a7)) == {}  # ... the other starts its own
    chains.end({}, entry(b"x"))  # nothing placed (no disk tier): not kept
    assert len(chains) == 0
    monkeypatch.setattr(backup_chains, "MAX_CHAINS", 3)
    monkeypatch.setattr(backup_chains, "MAX_KEPT_KEYS", 9)
    monkeypatch.setattr(backup_chains, "MAX_CHAIN_KEYS", 6)
    ends = [entry(bytes([i])) for i in range(5)]
    for i, e in enumerate(ends):
        chains.end({e.key: 0, b"k%d" % i: 1}, e)
    assert len(chains) == 3  # the two oldest went
    assert chains.start(entry(b"n", parent=ends[0])) == {}
    assert chains.start(entry(b"n", parent=ends[4])) != {}
    chains.end({bytes([9 + i]): i for i in range(6)}, entry(b"six"))  # 6 keys + the 2 x 2 kept
    assert len(chains) == 2  # 10 keys, over 9: the oldest went
    chains.end({bytes([20 + i]): i for i in range(7)}, entry(b"seven"))  # longer than 6
    assert chains.start(entry(b"n", parent=entry(b"seven"))) == {}
