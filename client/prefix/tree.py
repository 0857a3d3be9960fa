"""The GPU side of the prefix cache: a block pool and a radix tree of cached blocks.

Pure bookkeeping (no daemon, no tensors): `PrefixCacheManager` (manager.py) drives it.

A node is one full block of tokens, keyed by its chained block key, so a node's path from the
root is the prefix it extends. Nodes referenced by running requests are never evicted; among
unreferenced leaves the least recently used goes first (a heap with lazy deletion), so a
prefix is always evicted from its end and stays whole.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from kvcached_proto.errors import KvcachedError

# node states
READY = "ready"        # bytes in its GPU block are valid
LOADING = "loading"    # a load from the daemon is filling its GPU block
INVALID = "invalid"    # dropped from the tree (a short load, a reset); freed at ref 0


class NoFreeBlocks(KvcachedError):
    """The GPU block pool cannot supply the blocks asked for (every block is in use)."""


class BlockPool:
    """The engine's GPU block ids: a free list with double-free detection."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._used = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"{n} GPU blocks asked, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._used[b] = 1
        return out

    def give(self, blocks) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks or not self._used[b]:
                raise KvcachedError(f"GPU block {b} freed twice or never taken")
            self._used[b] = 0
            self._free.append(b)


@dataclass(eq=False)
class Node:
    key: bytes
    block: int
    parent: "Node | None"
    depth: int  # index of the block in its sequence
    state: str = READY
    refs: int = 0
    last_used: int = 0
    hits: int = 0              # times a later request matched it (selective write-through)
    backed_up: bool = False    # the daemon's host tier holds it (as far as we know)
    offloading: object = None  # the offload task reading its GPU block, while one runs
    load: object = None        # the pending load filling it (state LOADING)
    children: dict = field(default_factory=dict)
    _stamp: int = 0            # heap entry validity

    @property
    def is_leaf(self) -> bool:
        return not self.children


class PrefixTree:
    """Nodes by key, parent links, and LRU over unreferenced leaves."""

    def __init__(self):
        self.nodes: dict[bytes, Node] = {}
        self.roots: dict[bytes, Node] = {}
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, Node]] = []
        self._seq = itertools.count()
        self.idle = 0  # nodes in the tree no request references (evictable, or soon)

    def __len__(self) -> int:
        return len(self.nodes)

    def holds(self, node: Node) -> bool:
        return self.nodes.get(node.key) is node

    def get(self, key: bytes) -> Node | None:
        return self.nodes.get(key)

    def tick(self) -> int:
        return next(self._clock)

    def insert(self, key: bytes, block: int, parent: Node | None, state: str = READY) -> Node:
        if key in self.nodes:
            raise KvcachedError("block key already cached")
        node = Node(key, block, parent, parent.depth + 1 if parent else 0, state,
                    last_used=self.tick())
        self.nodes[key] = node
        self.idle += 1
        (parent.children if parent else self.roots)[key] = node
        return node

    def ref(self, node: Node) -> None:
        if node.refs == 0 and self.holds(node):
            self.idle -= 1
        node.refs += 1
        node.last_used = self.tick()
        node._stamp += 1  # drops its heap entry, if any

    def unref(self, node: Node) -> None:
        if node.refs <= 0:
            raise KvcachedError("prefix node released more often than referenced")
        node.refs -= 1
        if node.refs == 0 and self.holds(node):
            self.idle += 1
        node.last_used = self.tick()
        self.maybe_evictable(node)

    def maybe_evictable(self, node: Node) -> None:
        if node.refs == 0 and node.is_leaf and node.state != INVALID and self.holds(node):
            node._stamp += 1
            heapq.heappush(self._heap, (node.last_used, next(self._seq), node, node._stamp))

    def remove(self, node: Node) -> None:
        """Take a leaf out of the tree (its block is the caller's to free)."""
        if node.children:
            raise KvcachedError("only leaves leave the prefix tree")
        if not self.holds(node):
            return
        del self.nodes[node.key]
        if node.refs == 0:
            self.idle -= 1
        siblings = node.parent.children if node.parent else self.roots
        siblings.pop(node.key, None)
        node._stamp += 1
        if node.parent is not None:
            self.maybe_evictable(node.parent)

    def lru_leaves(self, skip=lambda node: False):
        """Unreferenced leaves, least recently used first, without removing them: yields while
        the caller removes what it takes (parents that become leaves join the order)."""
        skipped = []
        try:
            while self._heap:
                _, _, node, stamp = heapq.heappop(self._heap)
                if stamp != node._stamp or node.refs or node.children or not self.holds(node):
                    continue
                if skip(node):
                    skipped.append(node)
                    continue
                yield node
                if self.holds(node):  # the caller kept it: it stays evictable
                    skipped.append(node)
        finally:
            for node in skipped:
                self.maybe_evictable(node)

    def subtree(self, node: Node) -> list[Node]:
        """node and its descendants, children before parents."""
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out[::-1]


def parent_first_chains(nodes: list[Node]) -> list[list[Node]]:
    """Split nodes into parent-first chains (eviction victims come leaf first)."""
    chosen = {id(n) for n in nodes}
    chains = []
    for n in sorted(nodes, key=lambda n: n.depth):
        for chain in chains:
            if n.parent is chain[-1]:
                chain.append(n)
                break
        else:
            chains.append([n])
    return [c for c in chains if all(id(n) in chosen for n in c)]
