"""The block index and the host block allocator as pure logic."""
import tracemalloc

import pytest

from kvcached.host.index import READY, BlockIndex
from kvcached.host.pool import BlockAllocator, DoubleFree


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def blocks(index, n):
    return [e.block for e in index.evict(n)]


def chain(index: BlockIndex, ids, first_block=None, parent=None):
    entries = []
    for n, i in enumerate(ids):
        e = index.insert(k(i), i if first_block is None else first_block + n,
                         k(ids[n - 1]) if n else parent)
        index.mark_ready(e)
        entries.append(e)
    return entries


def test_prefix_counts_leading_ready_keys_only():
    idx = BlockIndex()
    chain(idx, [1, 2, 3])
    assert len(idx.prefix([k(1), k(2), k(3), k(4)])) == 3
    assert len(idx.prefix([k(2), k(3)])) == 2
    assert len(idx.prefix([k(9), k(1)])) == 0
    idx.insert(k(4), 4, k(3))  # WRITING: not served
    assert len(idx.prefix([k(1), k(2), k(3), k(4)])) == 3


@pytest.mark.parametrize("policy", ["lru", "s2lru"])
def test_a_request_noted_n_times_at_once_counts_as_n_requests(policy):
    """Noted lookups asked again (lookup_notes) feed the policy in one pass: the history, the
    hits and the eviction order come out as if each had been asked n times - and one pass costs
    a walk of its keys, not n of them."""
    once, at_once = BlockIndex(policy), BlockIndex(policy)
    for idx in (once, at_once):
        chain(idx, [1, 2, 3])
        chain(idx, [7, 8], first_block=7)
    asked = [k(1), k(2), k(5)]
    for _ in range(3):
        once.note_request(asked)
        once.prefix(asked)
    at_once.note_request(asked, 3)
    at_once.prefix(asked, times=3)
    assert [e.hits for e in at_once.prefix(asked, touch=False)] == [3, 3]
    assert [e.hits for e in once.prefix(asked, touch=False)] == [3, 3]
    if policy == "s2lru":
        assert at_once.policy.seen == once.policy.seen and at_once.policy.seen[k(5)] == 3
    assert blocks(at_once, 5) == blocks(once, 5)  # the same order: 8, 7 (not asked), then 3 ...


def test_eviction_is_lru_over_leaves_and_keeps_prefixes_whole():
    idx = BlockIndex()
    chain(idx, [1, 2, 3])
    chain(idx, [10, 11])
    idx.prefix([k(1)])  # touches 1 but 3 is the leaf that goes first
    evicted = blocks(idx, 3)
    # chain 1-2-3 is older except for 1: leaves go 3, 2, then 11 (older than 1)
    assert evicted == [3, 2, 11]
    assert len(idx.prefix([k(1), k(2)])) == 1
    idx.check()


def test_descendants_go_before_ancestors_even_when_ancestors_are_older():
    idx = BlockIndex()
    chain(idx, [1, 2, 3, 4])
    idx.prefix([k(3)])  # make an inner node recently used
    assert blocks(idx, 4) == [4, 3, 2, 1]


def test_pinned_and_writing_entries_are_never_evicted():
    idx = BlockIndex()
    pinned = chain(idx, [1])
    idx.pin(pinned)
    idx.insert(k(2), 2, None)  # writing
    chain(idx, [3])
    assert blocks(idx, 10) == [3]
    assert len(idx) == 2
    idx.unpin(pinned)
    assert blocks(idx, 10) == [1]
    idx.check()


def test_delete_of_an_entry_in_use_waits_for_its_readers():
    idx = BlockIndex()
    e = chain(idx, [1])
    idx.pin(e)
    assert idx.delete(k(1)) is None
    assert len(idx.prefix([k(1)])) == 0  # no longer served
    assert idx.unpin(e) == [1]  # freed when the reader leaves
    assert len(idx) == 0
    idx.check()


def test_removing_a_middle_node_keeps_child_counts_right():
    idx = BlockIndex()
    chain(idx, [1, 2, 3])
    assert idx.delete(k(2)) == 2
    idx.check()
    assert sorted(blocks(idx, 5)) == [1, 3]  # 1 became a leaf when its child went


def test_clear_frees_unused_and_dooms_used():
    idx = BlockIndex()
    a = chain(idx, [1, 2])
    idx.pin(a[:1])
    freed = idx.clear()
    assert freed == [2]
    assert idx.unpin(a[:1]) == [1]
    assert len(idx) == 0


def test_heap_compaction_keeps_live_items():
    idx = BlockIndex()
    chain(idx, list(range(100)))
    for _ in range(200):
        idx.prefix([k(i) for i in range(100)])
    idx.check()
    assert len(idx._heap) <= 2 * len(idx) + 1024 + 1


def test_index_memory_per_block_is_small():
    tracemalloc.start()
    idx = BlockIndex()
    n = 100_000
    parent = None
    for i in range(n):
        e = idx.insert(k(i), i, parent)
        idx.mark_ready(e)
        parent = k(i)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per_block = current / n
    assert per_block * 1_000_000 < 1 << 30, f"{per_block:.0f} bytes per block"
    assert idx.get(k(5)).state == READY


def test_allocator_is_ascending_and_detects_double_free():
    a = BlockAllocator(8)
    got = a.alloc(3)
    assert got == [0, 1, 2]
    a.free([1, 0])
    assert a.alloc(2) == [0, 1]
    with pytest.raises(DoubleFree):
        a.free([5])
    assert a.alloc(100) == [3, 4, 5, 6, 7]
    assert a.num_free == 0
