"""Multimodal items in a token sequence, and the extra key parts they give the blocks they
overlap (so that two prompts with the same tokens but different images never share KV)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class MMItem:
    """A multimodal item's span in the token sequence and its content hash."""
    offset: int
    length: int
    content_hash: bytes | str


def block_extra_keys(num_blocks: int, block_size: int, items: Sequence[MMItem] | None) -> list | None:
    """Per block, for each item whose token span overlaps it, the item's content hash and where
    it starts relative to the block's first token ("@-5": five tokens before it): equal
    placeholder tokens with the same item at another position hold other KV (vLLM keys its
    blocks the same way). Spans are half-open: an item ending exactly at a block's first token
    does not belong to it."""
    if not items:
        return None
    out: list = [None] * num_blocks
    for item in items:
        if item.length <= 0 or item.offset < 0:
            raise ValueError(f"multimodal item span ({item.offset}, {item.length}) is empty or negative")
        first = item.offset // block_size
        last = (item.offset + item.length - 1) // block_size
        for b in range(first, min(last, num_blocks - 1) + 1):
            out[b] = (out[b] or ()) + (item.content_hash, f"@{item.offset - b * block_size}")
    return out
