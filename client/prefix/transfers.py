"""The PrefixCacheManager's daemon work in flight: loads filling chains of tree nodes, and
offloads backing them up. Each is settled once, by whoever needs it first (a wait, a poll, the
manager running short of blocks, the daemon going away); a load or offload its daemon may still
touch after a timeout or a hang keeps its blocks held until the daemon confirms the end."""
from __future__ import annotations

import logging

from kvcached_proto.errors import DaemonStopping, DaemonUnavailable, KvcachedError, KvcachedTimeout, TaskFailed

from ..daemon_link import DaemonLink
from .blocks import GpuBlocks
from .records import _Load, _Offload
from .tree import INVALID, LOADING, READY, Node

log = logging.getLogger("kvcached_client.prefix.manager")


class Transfers:
    def __init__(self, blocks: GpuBlocks, link: DaemonLink, counters: dict):
        self.blocks, self.link, self.counters = blocks, link, counters
        self.loads: list[_Load] = []
        self.offloads: list[_Offload] = []

    def call(self, fn, *args, **kwargs):
        """Call the daemon; on any failure count it and return None (the engine carries on)."""
        if self.link.client is None:
            return None
        try:
            return fn(*args, **kwargs)
        except DaemonUnavailable as exc:
            self.link.drop(exc)
        except KvcachedError as exc:
            self.counters["daemon_errors"] += 1
            log.warning("[prefix] daemon call %s failed: %s", getattr(fn, "__name__", fn), str(exc))
        return None

    # loads -------------------------------------------------------------------
    def track_load(self, task, keys, blocks, parent: Node | None) -> list[Node]:
        """The LOADING nodes (a chain under `parent`) a load of keys into blocks fills."""
        tree, nodes = self.blocks.tree, []
        for key, block in zip(keys, blocks):
            node = tree.insert(key, block, parent, state=LOADING)
            tree.ref(node)
            node.backed_up = True
            nodes.append(node)
            parent = node
        load = _Load(task, self.link.client, nodes)
        for node in nodes:
            node.load = load
        self.loads.append(load)
        self.counters["loads"] += 1
        return nodes

    def resolve(self, load: _Load, timeout: float | None) -> None:
        if load.loaded is not None:
            return
        try:
            loaded = load.task.wait(timeout)
        except DaemonUnavailable as exc:
            if load.client is self.link.client:
                self.link.drop(exc)  # settles this load (held while the daemon may write)
                return
            loaded = 0  # of a client dropped at a stop (its blocks held by the wait)
        except KvcachedTimeout as exc:  # cancelled; held by the client until the ack
            log.warning("[prefix] load timed out: %s", str(exc))
            loaded = 0
        self.settle_load(load, loaded)

    def settle_load(self, load: _Load, loaded: int) -> None:
        if load.loaded is not None:
            return
        load.loaded = loaded
        self.loads.remove(load)
        self.counters["loaded_blocks"] += loaded
        self.counters["load_short_blocks"] += len(load.nodes) - loaded
        for i, node in enumerate(load.nodes):
            node.load = None
            if i < loaded:
                node.state = READY
                self.blocks.tree.maybe_evictable(node)
            else:
                node.state = INVALID
        for node in load.nodes[loaded:]:
            if self.blocks.tree.nodes.get(node.key) is node:
                self.blocks.invalidate(node)
            else:
                self.blocks.free_if_unused(node)

    # offloads ----------------------------------------------------------------
    def offload_chain(self, nodes: list[Node]) -> _Offload | None:
        """Offload a chain of nodes (parent first). Its cached parent goes first in the keys,
        so the daemon links the chain to it (a key it already holds is not copied again); a
        parent with no block any more is named (`parent`, protocol 1.15) for the daemon to link
        the chain to it where it holds it."""
        client = self.link.client
        if client is None or not nodes:
            return None
        head = nodes[0].parent  # (a parent evicted with the chain whose offload settled before
        # this one has no block any more: the daemon holds it from that offload)
        lead = [head] if (head is not None and head.state == READY and head.offloading is None
                          and head.block >= 0) else []
        sent = lead + nodes
        named = head.key if head is not None and not lead else None
        task = self.call(client.offload, [n.block for n in sent], [n.key for n in sent], parent=named)
        if task is None:
            self.counters["offload_failures"] += 1
            return None
        off = _Offload(task, client, sent, len(lead))
        for n in sent:
            n.offloading = off
        self.offloads.append(off)
        self.counters["offload_tasks"] += 1
        return off

    def finish_offload(self, off: _Offload, timeout: float | None) -> None:
        try:
            off.task.wait(timeout)
            self.settle_offload(off, ok=True)
        except DaemonUnavailable as exc:
            self.link.drop(exc)
        except KvcachedTimeout:
            # the daemon may still read these blocks: hold them until it confirms the end
            off.client.hold(off.task.id, [n.block for n in off.nodes])
            self.call(off.task.cancel)
            self.settle_offload(off, ok=False)
        except TaskFailed:
            self.settle_offload(off, ok=False)

    def settle_offload(self, off: _Offload, ok: bool) -> None:
        if off not in self.offloads:
            return
        self.offloads.remove(off)
        accepted = off.task.reply.get("accepted", len(off.nodes)) if ok else 0
        for i, node in enumerate(off.nodes):
            if node.offloading is off:
                node.offloading = None
                if i < accepted:
                    node.backed_up = True
                    if i >= off.offset:
                        self.counters["offloaded_blocks"] += 1
                self.blocks.free_if_unused(node)
        if not ok:
            self.counters["offload_failures"] += 1

    # all of them -------------------------------------------------------------
    def poll(self) -> None:
        """Settle what ended, without blocking."""
        for off in list(self.offloads):
            try:
                if off.task.done():
                    self.finish_offload(off, 0)
            except DaemonUnavailable as exc:
                self.link.drop(exc)
        for load in list(self.loads):
            try:
                if load.task.done():
                    self.resolve(load, 0)
            except DaemonUnavailable as exc:
                if load.client is self.link.client:
                    self.link.drop(exc)
                else:  # of a client dropped at a stop, whose daemon is gone now
                    self.settle_load(load, 0)

    def settle(self, timeout: float | None = None) -> None:
        """Wait for every load and offload in flight (each bounded by timeout, or the client's)."""
        for load in list(self.loads):
            self.resolve(load, timeout)
        for off in list(self.offloads):
            self.finish_offload(off, timeout)

    def hold_and_fail(self, client, exc: Exception) -> None:
        """`client`'s daemon is gone or hung: what it had in flight may still touch device blocks
        if it is only hung, so those blocks stay held; the work counts as failed. A daemon
        stopping gracefully still runs the loads queued before its stop and sends their ends:
        they stay in flight (held, the client kept by the hold keeper), their hits kept."""
        for load in [ld for ld in self.loads if ld.client is client]:
            client.hold(load.task.id, [n.block for n in load.nodes])
            if not isinstance(exc, DaemonStopping):
                self.settle_load(load, 0)
        for off in [o for o in self.offloads if o.client is client]:
            client.hold(off.task.id, [n.block for n in off.nodes])
            self.settle_offload(off, ok=False)
