"""What the PrefixCacheManager keeps: a match's result, and its records of requests and of
daemon loads and offloads in flight."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..mm_keys import MMItem
from .tree import Node


@dataclass
class Match:
    """What `match` found: tokens per tier (loads of host/storage hits are in flight)."""
    gpu_tokens: int
    host_tokens: int
    storage_tokens: int
    block_ids: list[int]

    @property
    def cached_tokens(self) -> int:
        return self.gpu_tokens + self.host_tokens + self.storage_tokens


@dataclass(eq=False)
class _Load:
    """A daemon load filling `nodes` (a chain); settled once, by whoever needs it first."""
    task: object
    client: object
    nodes: list[Node]
    loaded: int | None = None


@dataclass(eq=False)
class _Offload:
    task: object
    client: object
    nodes: list[Node]      # the nodes it backs up (a chain, parent first)
    offset: int            # keys before them in the request (an already cached parent)


@dataclass(eq=False)
class _Seq:
    rid: object
    tokens: list[int]
    mm_items: list[MMItem] | None
    keys: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    nodes: list[Node | None] = field(default_factory=list)  # tree node per block, or private
    num_computed: int = 0
    cached_blocks: int = 0   # leading blocks already in the tree (or known there)
    stale: bool = False      # running across a reset: none of its KV may be cached
    parts: Callable[[int], tuple] | None = None  # block key parts beyond tokens (an adapter, a salt)
