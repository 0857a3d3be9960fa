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
from typing import Sequence

from .hashing import BlockHasher, kernel_block_keys, rank_keys


@dataclass
class KeyScheme:
    hasher: BlockHasher | None = None  # None: the caller brings block keys already made
    tp_size: int = 1
    mla: bool = False
    kernel_factor: int | None = 1  # None while the engine's workers have not agreed on one

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
