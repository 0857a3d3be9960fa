"""The engine's GPU blocks as the PrefixCacheManager holds them: the free pool, the prefix tree
of cached blocks, and the blocks held back while a daemon may still touch them (a HoldKeeper).
A block is in exactly one of those places, or private to a request (check.py walks it)."""
from __future__ import annotations

from typing import Callable

from ..hold_keeper import HoldKeeper
from .tree import INVALID, LOADING, READY, BlockPool, Node, PrefixTree


class GpuBlocks:
    def __init__(self, num_blocks: int, current_client: Callable[[], object]):
        """current_client(): the daemon client in use, whose holds hold blocks back."""
        self.pool = BlockPool(num_blocks)
        self.tree = PrefixTree()
        self.holds = HoldKeeper(self.pool.give, current_client)

    def free(self, blocks) -> None:
        """Back to the pool; held ones (a daemon may still write them) wait."""
        self.holds.free(blocks)

    def unref(self, node: Node) -> None:
        self.tree.unref(node)
        self.free_if_unused(node)

    def free_if_unused(self, node: Node) -> None:
        """A node out of the tree frees its block once no request, offload or load holds it."""
        detached = self.tree.nodes.get(node.key) is not node
        if detached and node.refs == 0 and node.offloading is None and node.state != LOADING \
                and node.block >= 0:
            self.free([node.block])
            node.block = -1

    def invalidate(self, node: Node) -> None:
        """Drop node and its descendants from the tree (their KV must not be matched)."""
        for n in self.tree.subtree(node):
            self.tree.remove(n)
            n.state = INVALID if n.state != LOADING else n.state
            if n.state == INVALID:
                self.free_if_unused(n)

    def drop_all(self) -> int:
        """Forget every cached block; blocks in use are freed when their users end."""
        dropped = len(self.tree)
        for node in list(self.tree.nodes.values()):
            if self.tree.holds(node):
                self.invalidate(node)
        return dropped

    def take_victims(self, count: int) -> list[Node]:
        """Up to `count` least recently used idle leaves, out of the tree (READY, no offload in
        flight); their blocks are freed by `evicted` once the caller saved what it must."""
        victims = []
        for node in self.tree.lru_leaves(skip=lambda n: n.state != READY or n.offloading is not None):
            self.tree.remove(node)
            victims.append(node)
            if len(victims) >= count:
                break
        return victims

    def evicted(self, victims: list[Node]) -> None:
        for node in victims:
            node.state = INVALID
            self.free_if_unused(node)
