"""The native CPU copier (kvcached/copy/_blockcopy.c, native.py): byte for byte against the
source in both directions, packed and strided rows on either side, runs merged or not,
streaming stores on and off (unaligned destinations and tails included), and bad input refused
before anything is copied."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_copy_strategies import check_round_trip, host_views

from kvcached.copy import native
from kvcached.copy.transfer import TaskKind

pytestmark = pytest.mark.skipif(not native.available(), reason="kvcached.copy._blockcopy is not built")


def _copy(src: np.ndarray, dst: np.ndarray, pieces, nontemporal: bool) -> int:
    s = np.array([src.ctypes.data + o for o, _, _ in pieces], dtype=np.int64)
    d = np.array([dst.ctypes.data + o for _, o, _ in pieces], dtype=np.int64)
    z = np.array([n for _, _, n in pieces], dtype=np.int64)
    return native._blockcopy.copy(s, d, z, nontemporal)


@pytest.mark.parametrize("nontemporal", [False, True])
def test_copy_moves_every_piece_and_nothing_else(nontemporal):
    rng = np.random.default_rng(int(nontemporal))
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    # sizes around the streaming threshold, odd offsets (an unaligned head), odd tails
    pieces = [(0, 3, 40_000), (100_003, 200_001, 32_768), (300_000, 400_007, 65_537),
              (500_001, 600_000, 17), (700_000, 700_000, 0), (800_001, 900_013, 100_000)]
    assert _copy(src, dst, pieces, nontemporal) == sum(n for _, _, n in pieces)
    expected = np.zeros_like(dst)
    for s, d, n in pieces:
        expected[d:d + n] = src[s:s + n]
    assert np.array_equal(dst, expected)


def test_bad_input_is_refused_before_any_copy():
    src, dst = np.ones(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="size -1"):
        _copy(src, dst, [(0, 0, 8), (0, 8, -1)], False)
    assert not dst.any()  # the first piece did not run either
    with pytest.raises(ValueError, match="one entry per run"):
        native._blockcopy.copy(np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="size 4 from"):  # a null address
        native._blockcopy.copy(np.zeros(1, np.int64), np.array([dst.ctypes.data]), np.array([4]))
    with pytest.raises(ValueError, match="int64"):
        native._blockcopy.copy(b"abc", b"abc", b"abc")


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("ids", ["scattered", "runs"])
@pytest.mark.parametrize("dev_strided", [False, True])
def test_native_copier_round_trip_is_byte_exact(layout, ids, dev_strided):
    rng = np.random.default_rng(sum(map(ord, layout + ids)) + dev_strided)
    layers, parts, num_dev, num_host, row = 3, 2, 40, 50, 40_000  # rows past the streaming threshold
    if dev_strided:  # vLLM's block-outermost layouts: a layer's rows a stride apart
        whole = torch.from_numpy(rng.integers(0, 256, (num_dev, layers * parts * row), dtype=np.uint8))
        dev = [[whole[:, (l * parts + p) * row:(l * parts + p + 1) * row] for p in range(parts)]
               for l in range(layers)]
    else:
        dev = [[torch.from_numpy(rng.integers(0, 256, (num_dev, row), dtype=np.uint8))
                for _ in range(parts)] for _ in range(layers)]
    host = host_views(layout, layers, parts, num_host, row)
    copier = native.NativeCopier(dev, host)
    check_round_trip(copier, dev, host, rng, ids, num_host)
    copier.close()


def test_runs_are_merged_only_where_both_sides_are_packed():
    dev = [[torch.zeros(16, 64, dtype=torch.uint8)]]
    copier = native.NativeCopier(dev, host_views("layer_first", 1, 1, 16, 64))
    plan = copier.plan(TaskKind.OFFLOAD, np.arange(4, 10), np.concatenate([np.arange(0, 3), np.arange(8, 11)]))
    src, _, sizes = copier._runs(0, plan, to_host=True)
    assert sizes.tolist() == [3 * 64, 3 * 64] and len(src) == 2
    paged = native.NativeCopier(dev, host_views("page_first", 2, 1, 16, 64)[:1])
    _, _, sizes = paged._runs(0, paged.plan(TaskKind.OFFLOAD, np.arange(6), np.arange(6)), to_host=True)
    assert sizes.tolist() == [64] * 6  # page_first host rows are a page apart: one per block
