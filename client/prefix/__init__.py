"""The prefix cache manager: the engine's GPU block manager with prefix reuse, backed by the
daemon (manager.py), over its block pool and radix tree (tree.py)."""
from ..mm_keys import MMItem, block_extra_keys
from .manager import PrefixCacheManager
from .records import Match
from .tree import NoFreeBlocks

__all__ = ["PrefixCacheManager", "Match", "MMItem", "block_extra_keys", "NoFreeBlocks"]
