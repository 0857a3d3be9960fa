"""Where to cut the host pool into several cudaHostRegister calls when one call cannot take it.

A copy must not span two registrations (cudaMemcpyAsync fails with "invalid argument"). So the
cuts fall only where no block's bytes continue past them: at a block boundary of the region
(one (layer, part) view, or the page_first pages) that the cut falls in, and on a host page,
as cudaHostRegister wants. The copy plans then split runs of blocks at the cuts
(copy_strategies.split_pairs / split_host_runs). Pure arithmetic: tested on CPU.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

HOST_PAGE = 4096


class Region(NamedTuple):
    """`count` blocks at start + i * stride, each `stride` bytes apart (block bytes included)."""
    start: int
    stride: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.stride * self.count


def _allowed(cut: int, regions: list[Region], starts: list[int]) -> bool:
    if cut % HOST_PAGE:
        return False
    i = bisect.bisect_right(starts, cut) - 1
    if i < 0:
        return True
    r = regions[i]
    return not (r.start < cut < r.end) or (cut - r.start) % r.stride == 0


def chunks(regions: list[Region], capacity: int, ceiling: int) -> list[tuple[int, int]]:
    """(offset, size) registrations covering [0, capacity), each at most `ceiling` bytes, cut
    only where `_allowed`. Raises ValueError when no such cut exists within a ceiling."""
    regions = sorted(regions)
    starts = [r.start for r in regions]
    out, cur = [], 0
    while cur < capacity:
        target = min(cur + ceiling, capacity)
        if target == capacity:
            out.append((cur, capacity - cur))
            break
        cut = target - target % HOST_PAGE
        while cut > cur and not _allowed(cut, regions, starts):
            cut -= HOST_PAGE
        if cut <= cur:
            raise ValueError(f"no block boundary on a host page within {ceiling} bytes of "
                             f"offset {cur}")
        out.append((cur, cut - cur))
        cur = cut
    return out


def block_cuts(region: Region, cuts: list[int]) -> list[int]:
    """The block indices of `region` at which a new registration starts."""
    return [(c - region.start) // region.stride for c in cuts
            if region.start < c < region.end]
