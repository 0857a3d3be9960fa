"""The one rule for the keys a daemon holds a block under, for every caller (the scheduler's
lookups, each rank's loads and saves, a GroupClient's fan-out).

A block's key is its namespace's hash of its tokens and its parent's key (BlockHasher). An
engine that splits each block into r kernel blocks (vLLM's virtual block splitting) pages it
under keys of their own (`kernel_block_keys`): its bytes are not the unsplit block's. Under
tensor parallelism each rank stores its shard of the heads under rank keys (`rank_keys`),
except for MLA, whose latent every rank holds whole: there all ranks share the keys (one writer
stores them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .hashing import BlockHasher, kernel_block_keys, rank_keys
from .mm_keys import MMItem, block_extra_keys


@dataclass
class KeyScheme:
    hasher: BlockHasher | None = None  # None: the caller brings block keys already made
    tp_size: int = 1
    mla: bool = False
    kernel_factor: int | None = 1  # None while the engine's workers have not agreed on one

    def extend(self, keys: list[bytes], tokens: Sequence[int], block_size: int, upto: int,
               mm_items: Sequence[MMItem] | None = None,
               block_parts: Callable[[int], tuple] | None = None) -> list[bytes]:
        """Chain block keys onto `keys` (the leading blocks' keys of `tokens`, made before) for
        the full blocks up to `upto`; returns `keys`. A block's multimodal items go in its key,
        and `block_parts(i)` (str or bytes: what else the engine's KV of block i depends on, e.g.
        a LoRA adapter) after them. A block with neither is keyed by its tokens alone."""
        upto = min(upto, len(tokens) // block_size)
        if upto <= len(keys):
            return keys
        extra = block_extra_keys(upto, block_size, list(mm_items or ()))
        for i in range(len(keys), upto):
            parts = extra[i] if extra else None
            more = block_parts(i) if block_parts is not None else ()
            if more:
                parts = (parts or ()) + tuple(more)
            keys.append(self.hasher.hash_block(keys[i - 1] if i else None,
                                               tokens[i * block_size:(i + 1) * block_size], parts))
        return keys

    def kernel_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys of these blocks as the engine pages them (split or not)."""
        if self.kernel_factor is None:
            raise ValueError("the kernel-block factor is not known yet")
        return kernel_block_keys(keys, self.kernel_factor)

    def rank_keys(self, keys: Sequence[bytes], rank: int) -> list[bytes]:
        """Kernel keys as rank `rank`'s daemon holds them."""
        return list(keys) if self.tp_size == 1 or self.mla else rank_keys(keys, rank, self.tp_size)

    def daemon_keys(self, keys: Sequence[bytes], rank: int = 0) -> list[bytes]:
        """Block keys as rank `rank`'s daemon holds them: both steps."""
        return self.rank_keys(self.kernel_keys(keys), rank)


def request_parts(adapter: str | None = None, salt: str | None = None,
                  per_block: Callable[[int], tuple] | None = None) -> Callable[[int], tuple] | None:
    """KeyScheme.extend's `block_parts` for a request whose KV depends on more than its tokens:
    an adapter that changes the K and V projections (a LoRA's identity: every block), a cache
    salt that keeps one tenant's prefixes from another's (the first block, and so every block
    after it: keys are chained), and `per_block(i)`'s parts (e.g. prompt embeddings). None when
    there is none of them: the keys are the tokens' alone."""
    if not adapter and not salt and per_block is None:
        return None
    every = (f"adapter\0{adapter}",) if adapter else ()

    def parts(i: int) -> tuple:
        out = every + ((f"cache_salt\0{salt}",) if i == 0 and salt else ())
        return out + tuple(per_block(i)) if per_block is not None else out

    return parts

