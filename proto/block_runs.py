"""Runs of consecutive block ids, the one place both sides find them, and the threshold past
which a list of blocks counts as fragmented (then one gather/scatter beats a copy per run).

Shared by the client (block_copy.py) and the daemon (copy/transfer.py, copy/cuda_copier.py)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

# a copy per run is worth it while there is at most one run per this many blocks
BLOCKS_PER_RUN_MIN = 4


def fragmented(num_runs: int, num_blocks: int) -> bool:
    """More than one run per BLOCKS_PER_RUN_MIN blocks: gather/scatter, not a copy per run."""
    return num_runs * BLOCKS_PER_RUN_MIN > num_blocks


def run_bounds(*ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the position ranges over which every array of ids goes up by one."""
    n = len(ids[0])
    step = np.zeros(max(n - 1, 0), dtype=bool)
    for a in ids:
        step |= np.diff(a) != 1
    breaks = np.flatnonzero(step) + 1
    return np.concatenate(([0], breaks)), np.concatenate((breaks, [n]))


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first src id, first dst id, length) for each run where both ids go up by one."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    if len(src) == 0:
        return []
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    starts, ends = run_bounds(s, d)
    return [(int(s[a]), int(d[a]), int(b - a)) for a, b in zip(starts, ends)]


def host_runs(host_blocks: np.ndarray) -> list[tuple[int, int, int]]:
    """Split positions into runs of consecutive host ids: (start, end, first_host_block)."""
    if len(host_blocks) == 0:
        return []
    starts, ends = run_bounds(np.asarray(host_blocks, dtype=np.int64))
    return [(int(a), int(b), int(host_blocks[a])) for a, b in zip(starts, ends)]
