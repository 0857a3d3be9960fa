"""Block copies between paged tensors by id: runs become slice copies, the bytes land exactly."""
import pytest
import torch

from kvcached_client.block_copy import copy_blocks
from kvcached_proto.block_runs import fragmented, host_runs, paired_runs


def test_runs_break_where_either_side_jumps():
    assert paired_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 7]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1)]
    assert paired_runs([], []) == []
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        paired_runs([1, 2], [3])


def test_host_runs_and_the_fragmentation_threshold_are_the_ones_both_sides_use():
    import numpy as np

    assert host_runs(np.array([7, 8, 9, 3, 4, 10])) == [(0, 3, 7), (3, 5, 3), (5, 6, 10)]
    assert host_runs(np.array([], dtype=np.int64)) == []
    assert not fragmented(2, 8) and fragmented(3, 8)  # at most one run per four blocks


@pytest.mark.parametrize("src_ids, dst_ids", [
    (list(range(10, 40)), list(range(50, 80))),            # one run
    ([3, 4, 5, 20, 21, 7], [60, 61, 62, 8, 9, 70]),         # a few runs
    ([31, 2, 17, 9, 44, 5, 28, 13], [1, 40, 7, 33, 19, 25, 3, 11]),  # fragmented: gather path
])
def test_copy_blocks_moves_exactly_the_named_blocks(src_ids, dst_ids):
    src = torch.randn(64, 2, 8, 16)
    dst = torch.randn(96, 2, 8, 16)
    before = dst.clone()
    copy_blocks(dst, dst_ids, src, src_ids)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[d], src[s])
    untouched = sorted(set(range(96)) - set(dst_ids))
    assert torch.equal(dst[untouched], before[untouched])
