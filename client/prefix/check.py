"""The PrefixCacheManager's invariant walk (tests and fuzzing): every GPU block is in exactly
one place - free, held, a cached node, or a request's private block - and reference counts
add up. Raises AssertionError naming what is wrong."""
from __future__ import annotations

from .tree import Node


def check_manager(mgr) -> None:
    owner: dict[int, str] = {}

    def own(block: int, where: str) -> None:
        if block in owner:
            raise AssertionError(f"GPU block {block} is both {owner[block]} and {where}")
        owner[block] = where

    for b in mgr.pool._free:
        own(b, "free")
    for b in mgr.blocks.holds.blocks():
        own(b, "held")
    refs: dict[int, int] = {}
    held: dict[int, Node] = {}
    for seq in mgr._seqs.values():
        if len(seq.blocks) != len(seq.nodes):
            raise AssertionError(f"request {seq.rid!r}: block table and nodes differ in length")
        for block, node in zip(seq.blocks, seq.nodes):
            if node is None:
                own(block, f"private to {seq.rid!r}")
            else:
                if node.block != block:
                    raise AssertionError("a request's block differs from its node's")
                refs[id(node)] = refs.get(id(node), 0) + 1
                held[id(node)] = node
    nodes = {id(n): n for n in mgr.tree.nodes.values()}
    nodes.update(held)
    for off in mgr.transfers.offloads:
        nodes.update({id(n): n for n in off.nodes})
    for load in mgr.transfers.loads:
        nodes.update({id(n): n for n in load.nodes})
    for node in nodes.values():
        if node.refs != refs.get(id(node), 0):
            raise AssertionError(f"node of block {node.block}: refs {node.refs}, "
                                 f"held by {refs.get(id(node), 0)} requests")
        if node.block >= 0:
            own(node.block, "cached" if mgr.tree.holds(node) else "detached node")
        for key, child in node.children.items():
            if child.parent is not node or not mgr.tree.holds(child):
                raise AssertionError("a child node is not linked to its parent")
    if len(owner) != mgr.pool.num_blocks:
        missing = sorted(set(range(mgr.pool.num_blocks)) - set(owner))
        raise AssertionError(f"GPU blocks lost: {missing[:10]}")
