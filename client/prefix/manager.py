"""PrefixCacheManager: the engine's GPU block manager with prefix reuse, backed by the daemon.

An engine asks it for blocks and prefix hits instead of keeping its own free list:

    mgr = PrefixCacheManager(num_gpu_blocks, block_size, client=Client.connect(...),
                             namespace=make_namespace(model, dtype), kv_caches=kv)
    hit = mgr.match(req_id, prompt_ids)      # GPU hits; host/storage hits start loading
    computed = mgr.wait_loaded(req_id)       # tokens whose KV is in place (a short load trims)
    table = mgr.allocate(req_id, len(prompt_ids) - computed)
    ... forward over prompt_ids[computed:] writing KV into `table` ...
    mgr.commit(req_id, len(prompt_ids))      # full blocks become reusable (outputs too, later)
    mgr.release(req_id)                      # finished or preempted

GPU blocks that eviction takes are offloaded to the daemon first, per `write_policy`:
write_through (every committed block), write_through_selective (a block once it has been hit
`selective_hits` times) or write_back (at eviction). A block whose offload is in flight is not
reused until the task ends; a block a timed-out load or offload may still touch stays fenced
until the daemon confirms the task ended (or is gone). Without a daemon, or after it dies,
the manager is a GPU-only prefix cache and reattaches when a daemon is back.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

from kvcached_proto.errors import DaemonUnavailable, KvcachedError, KvcachedTimeout, TaskFailed

from ..fence_keeper import FenceKeeper
from ..hashing import BlockHasher
from ..mm_keys import MMItem, block_extra_keys
from ..reattach import Reattacher, reconnector, usable
from .records import Match, _Load, _Offload, _Seq
from .tree import (
    INVALID,
    LOADING,
    READY,
    BlockPool,
    Node,
    NoFreeBlocks,
    PrefixTree,
    parent_first_chains,
)

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class PrefixCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, client=None, namespace: str = "",
                 kv_caches=None, write_policy: str = "write_through", selective_hits: int = 2,
                 connect: Callable[[], object] | None = None, hasher: BlockHasher | None = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy {write_policy!r}: expected one of {WRITE_POLICIES}")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.pool = BlockPool(num_gpu_blocks)
        self.tree = PrefixTree()
        self.hasher = hasher or BlockHasher(namespace)
        self.write_policy = write_policy
        self.selective_hits = selective_hits
        self.kv_caches = kv_caches
        self.client = None
        connect = connect or (reconnector(client) if client is not None else None)
        # attaching (connect, register the KV cache) runs in the background: no engine call
        # waits for a daemon that is gone, hung or not there yet
        self._reattach = Reattacher(connect, self._register, name="prefix") if connect else None
        self._seqs: dict[object, _Seq] = {}
        self._loads: list[_Load] = []
        self._offloads: list[_Offload] = []
        # freed blocks held back while a client (this one or one replaced) fences them
        self._fences = FenceKeeper(self.pool.give, lambda: self.client)
        self.counters = {
            "requests": 0, "gpu_hit_tokens": 0, "host_hit_tokens": 0, "storage_hit_tokens": 0,
            "computed_tokens": 0, "evictions": 0, "offload_tasks": 0, "offloaded_blocks": 0,
            "offload_failures": 0, "loads": 0, "loaded_blocks": 0, "load_short_blocks": 0,
            "daemon_errors": 0, "detaches": 0, "attaches": 0,
        }
        if client is not None:
            self._attach(client)
        if self._reattach is not None:  # only now: a watcher started before the client was set
            self._reattach.watch(lambda: self.client)  # raced it to register (KV_IN_USE)

    # attachment -------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return self.client is not None

    def _register(self, client) -> None:
        if self.kv_caches is not None:
            client.register_kv_cache(self.kv_caches)

    def _attach(self, client, registered: bool = False) -> None:
        if not registered:
            self._register(client)
        self.client = client
        for node in self.tree.nodes.values():
            node.backed_up = False  # a new daemon's host tier starts empty
        self.counters["attaches"] += 1
        log.info("[prefix] attached to kvcached daemon (epoch %s)", getattr(client, "epoch", "?"))

    def _maybe_attach(self) -> None:
        """Take a daemon the background has attached (connected and registered), if any; it
        replaces a client whose daemon is gone."""
        if self._reattach is None:
            return
        if self.client is not None:
            if not self._reattach.has_ready() or usable(self.client):
                return
            self._detach(DaemonUnavailable("the daemon is gone; a successor is attached"))
        client = self._reattach.take()
        if client is not None:
            self._attach(client, registered=True)

    def _detach(self, exc: Exception) -> None:
        """The daemon is gone (or hung): carry on GPU-only. Work it had in flight may still
        touch device blocks if it is only hung, so those blocks stay fenced."""
        client, self.client = self.client, None
        if client is None:
            return
        self.counters["detaches"] += 1
        log.warning("[prefix] daemon unavailable, continuing without it: %s", str(exc))
        for load in [ld for ld in self._loads if ld.client is client]:
            client.fence(load.task.id, [n.block for n in load.nodes])
            self._settle_load(load, 0)
        for off in [o for o in self._offloads if o.client is client]:
            client.fence(off.task.id, [n.block for n in off.nodes])
            self._settle_offload(off, ok=False)
        self._fences.retire(client)

    def _daemon(self, fn, *args, **kwargs):
        """Call the daemon; on any failure count it and return None (the engine carries on)."""
        if self.client is None:
            return None
        try:
            return fn(*args, **kwargs)
        except DaemonUnavailable as exc:
            self._detach(exc)
        except KvcachedError as exc:
            self.counters["daemon_errors"] += 1
            log.warning("[prefix] daemon call %s failed: %s", getattr(fn, "__name__", fn), str(exc))
        return None

    # request lifecycle ------------------------------------------------------
    def match(self, request_id, token_ids: Sequence[int], mm_items: Sequence[MMItem] | None = None) -> Match:
        """Find the request's cached prefix: GPU hits are referenced at once; host and storage
        hits get GPU blocks and a load (see wait_loaded / wait_layer). At least the last token
        is left to compute, so the engine has logits."""
        if request_id in self._seqs:
            raise KvcachedError(f"request {request_id!r} is already matched; release it first")
        self._poll()
        seq = _Seq(request_id, list(token_ids), list(mm_items) if mm_items else None)
        self._extend_keys(seq)
        limit = min(len(seq.keys), max(len(seq.tokens) - 1, 0) // self.block_size)
        parent = None
        for key in seq.keys[:limit]:
            node = self.tree.get(key)
            if node is None or node.state == INVALID:
                break
            self.tree.ref(node)
            node.hits += 1
            seq.nodes.append(node)
            parent = node
        gpu = len(seq.nodes)
        self._selective_write(seq.nodes)
        host = storage = 0
        if gpu < limit:
            host, storage = self._load_missing(seq, gpu, limit, parent)
        seq.blocks = [n.block for n in seq.nodes]
        seq.cached_blocks = len(seq.nodes)
        seq.num_computed = len(seq.nodes) * self.block_size
        self._seqs[request_id] = seq
        bs = self.block_size
        self.counters["requests"] += 1
        self.counters["gpu_hit_tokens"] += gpu * bs
        self.counters["host_hit_tokens"] += host * bs
        self.counters["storage_hit_tokens"] += storage * bs
        return Match(gpu * bs, host * bs, storage * bs, list(seq.blocks))

    def _load_missing(self, seq: _Seq, start: int, limit: int, parent: Node | None) -> tuple[int, int]:
        keys = seq.keys[start:limit]
        found = self._daemon(self.client.lookup, keys) if self.client else None
        if not found or not sum(found):
            return 0, 0
        blocks = self._take_blocks(sum(found), partial=True)
        if self.client is None:  # the daemon went away while we made room
            self.pool.give(blocks)
            return 0, 0
        if not blocks:
            return 0, 0
        task = self._daemon(self.client.load, keys[: len(blocks)], blocks)
        planned = task.num_blocks if task is not None else 0
        self._free(blocks[planned:])  # fenced ones (a rank of a group still writing) wait
        if not planned:
            return 0, 0
        nodes = []
        for key, block in zip(keys[:planned], blocks):
            node = self.tree.insert(key, block, parent, state=LOADING)
            self.tree.ref(node)
            node.backed_up = True
            nodes.append(node)
            parent = node
        load = _Load(task, self.client, nodes)
        for node in nodes:
            node.load = load
        self._loads.append(load)
        seq.nodes.extend(nodes)
        self.counters["loads"] += 1
        host = min(task.reply.get("host_blocks", planned), planned)
        return host, planned - host

    def wait_loaded(self, request_id, timeout: float | None = None) -> int:
        """Wait for the request's loads; returns the tokens whose KV is in place. A load that
        came back short (or failed) trims the prefix: the engine computes from there."""
        seq = self._seq(request_id)
        for node in list(seq.nodes[: seq.cached_blocks]):
            if node is not None and node.state == LOADING:
                self._resolve(node.load, timeout)
        return self._trim(seq)

    def wait_layer(self, request_id, layer: int, timeout: float | None = None) -> int:
        """Layer-wise wait: returns once layer `layer` of the loaded blocks is in place, with
        the tokens valid for it. If that is fewer than before, a load came back short: the
        engine must redo the step from the returned count (call wait_loaded, then allocate)."""
        seq = self._seq(request_id)
        for load in {id(n.load): n.load for n in seq.nodes[: seq.cached_blocks]
                     if n is not None and n.state == LOADING}.values():
            try:
                load.task.wait_layer(layer, timeout)
                if layer == 0 and load.task.valid_blocks < len(load.nodes):
                    self._resolve(load, timeout)
            except (TaskFailed, KvcachedTimeout, DaemonUnavailable):
                self._resolve(load, timeout)
        return self._trim(seq)

    def _trim(self, seq: _Seq) -> int:
        for i, node in enumerate(seq.nodes[: seq.cached_blocks]):
            if node is not None and node.state == INVALID:
                for block, dropped in zip(seq.blocks[i:], seq.nodes[i:]):
                    if dropped is None:
                        self._free([block])
                    else:
                        self._unref(dropped)
                del seq.nodes[i:]
                del seq.blocks[i:]
                seq.cached_blocks = i
                seq.num_computed = i * self.block_size
                break
        return seq.num_computed

    def allocate(self, request_id, num_new_tokens: int) -> list[int]:
        """GPU blocks for num_new_tokens past the computed ones; returns the block table.
        Evicts (offloading first, per the write policy) when the pool runs short; raises
        NoFreeBlocks, changing nothing, when even that cannot make room."""
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be >= 0")
        seq = self._seq(request_id)
        need = -(-(seq.num_computed + num_new_tokens) // self.block_size) - len(seq.blocks)
        if need > 0:
            got = self._take_blocks(need)
            seq.blocks.extend(got)
            seq.nodes.extend([None] * len(got))
        return list(seq.blocks)

    def commit(self, request_id, num_computed_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """The engine computed KV up to num_computed_tokens (token_ids: the whole sequence so
        far, outputs included, when it grew). Its new full blocks become cached; returns how
        many blocks were added to the tree."""
        seq = self._seq(request_id)
        if token_ids is not None:
            if len(token_ids) < seq.num_computed:
                raise ValueError("token_ids is shorter than the tokens already computed")
            seq.tokens = list(token_ids)
        if not seq.num_computed <= num_computed_tokens <= min(len(seq.tokens),
                                                               len(seq.blocks) * self.block_size):
            raise ValueError(f"num_computed_tokens {num_computed_tokens} outside "
                             f"[{seq.num_computed}, {min(len(seq.tokens), len(seq.blocks) * self.block_size)}]"
                             " (tokens known and blocks allocated)")
        self.counters["computed_tokens"] += num_computed_tokens - seq.num_computed
        seq.num_computed = num_computed_tokens
        self._extend_keys(seq)
        full = min(num_computed_tokens // self.block_size, len(seq.keys))
        if seq.stale:
            return 0
        added = []
        for i in range(seq.cached_blocks, full):
            parent = self.tree.get(seq.keys[i - 1]) if i else None
            if self.tree.get(seq.keys[i]) is not None:
                continue  # computed by another request meanwhile: ours stays private
            node = self.tree.insert(seq.keys[i], seq.blocks[i], parent)
            self.tree.ref(node)
            seq.nodes[i] = node
            added.append(node)
        seq.cached_blocks = max(seq.cached_blocks, full)
        if added and self.write_policy == "write_through":
            self._offload_chain(added)
        return len(added)

    def release(self, request_id) -> None:
        """The request finished or was preempted: its references go; its private blocks
        return to the pool; its cached blocks stay for later requests."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            raise KvcachedError(f"request {request_id!r} is not known (released twice?)")
        for block, node in zip(seq.blocks, seq.nodes):
            if node is None:
                self._free([block])
            else:
                self._unref(node)
        self._poll()

    preempt = release  # preemption frees the blocks; committed ones stay cached for re-match

    def reset(self, clear_daemon: bool = True, namespace: str | None = None,
              timeout: float | None = None) -> None:
        """After a weight update: nothing cached so far is ever matched again. Waits for the
        daemon work in flight, drops every cached GPU block, and clears the daemon's tiers
        (clear_daemon) or switches to a new namespace. Running requests keep their blocks
        privately until released, and nothing they compute is cached."""
        self.settle(timeout)
        self.drop_gpu_cache()
        for seq in self._seqs.values():
            seq.stale = True  # its KV came (partly) from the old weights
        if namespace is not None:
            self.hasher = BlockHasher(namespace)
        if clear_daemon and self.client is not None:
            self._daemon(self.client.clear, "all", True)

    def drop_gpu_cache(self) -> int:
        """Forget every cached GPU block (the daemon's tiers keep theirs); blocks in use by
        running requests or in-flight copies are freed when those end. Returns the count."""
        dropped = len(self.tree)
        for node in list(self.tree.nodes.values()):
            if self.tree.holds(node):
                self._invalidate(node)
        return dropped

    def settle(self, timeout: float | None = None) -> None:
        """Wait for every load and offload in flight (each bounded by timeout, or the
        client's)."""
        for load in list(self._loads):
            self._resolve(load, timeout)
        for off in list(self._offloads):
            self._finish_offload(off, timeout)

    def try_attach(self) -> bool:
        """Check the daemon now (not at the next request): detach from a dead one, attach to
        one that is there. Returns whether the manager is attached."""
        if self.client is not None:
            try:
                self.client.poll_events()
            except DaemonUnavailable as exc:
                self._detach(exc)
        if self.client is None and self._reattach is not None:
            client = self._reattach.attach_now()
            if client is not None:
                self._attach(client, registered=True)
        return self.attached

    # helpers ----------------------------------------------------------------
    def _seq(self, request_id) -> _Seq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KvcachedError(f"request {request_id!r} is not known; match it first")
        return seq

    def _extend_keys(self, seq: _Seq) -> None:
        bs, have = self.block_size, len(seq.keys)
        full = len(seq.tokens) // bs
        if full <= have:
            return
        extra = block_extra_keys(full, bs, seq.mm_items)
        tokens = seq.tokens
        for i in range(have, full):
            seq.keys.append(self.hasher.hash_block(seq.keys[i - 1] if i else None,
                                                   tokens[i * bs:(i + 1) * bs],
                                                   extra[i] if extra else None))

    def _unref(self, node: Node) -> None:
        self.tree.unref(node)
        self._free_if_unused(node)

    def _free_if_unused(self, node: Node) -> None:
        detached = self.tree.nodes.get(node.key) is not node
        if detached and node.refs == 0 and node.offloading is None and node.state != LOADING \
                and node.block >= 0:
            self._free([node.block])
            node.block = -1

    def _free(self, blocks) -> None:
        self._fences.free(blocks)  # fenced ones (a daemon may still write them) wait

    def _invalidate(self, node: Node) -> None:
        """Drop node and its descendants from the tree (their KV must not be matched)."""
        for n in self.tree.subtree(node):
            self.tree.remove(n)
            n.state = INVALID if n.state != LOADING else n.state
            if n.state == INVALID:
                self._free_if_unused(n)

    def _take_blocks(self, n: int, partial: bool = False) -> list[int]:
        self._poll()
        if not partial and n > self.pool.num_free + self.tree.idle:
            raise NoFreeBlocks(f"{n} GPU blocks asked: {self.pool.num_free} free and "
                               f"{self.tree.idle} cached ones unreferenced")
        if self.pool.num_free < n:
            self._evict(n - self.pool.num_free)
        if self.pool.num_free < n and (self._offloads or self._loads):
            for off in list(self._offloads):  # blocks held by offloads in flight
                self._finish_offload(off, None)
            for load in list(self._loads):  # blocks of loads nobody waited for
                self._resolve(load, None)
            self._evict(n - self.pool.num_free)
        if partial:
            n = min(n, self.pool.num_free)
        return self.pool.take(n)

    def _evict(self, count: int) -> None:
        victims = []
        for node in self.tree.lru_leaves(skip=lambda n: n.state != READY or n.offloading is not None):
            self.tree.remove(node)
            victims.append(node)
            if len(victims) >= count:
                break
        if not victims:
            return
        if self.write_policy == "write_back" and self.client is not None:
            pending = [v for v in victims if not v.backed_up]
            for chain in parent_first_chains(pending):
                off = self._offload_chain(chain)
                if off is not None:
                    self._finish_offload(off, None)
        self.counters["evictions"] += len(victims)
        for node in victims:
            node.state = INVALID
            self._free_if_unused(node)

    def _selective_write(self, nodes: list[Node]) -> None:
        if self.write_policy != "write_through_selective" or self.client is None:
            return
        hot = [i for i, n in enumerate(nodes) if n.hits >= self.selective_hits and
               n.state == READY and not n.backed_up and n.offloading is None]
        if hot:  # the chain up to the deepest hot block, so the host tier holds it whole
            self._offload_chain([n for n in nodes[: hot[-1] + 1]
                                 if not n.backed_up and n.offloading is None and n.state == READY])

    def _offload_chain(self, nodes: list[Node]) -> _Offload | None:
        """Offload a chain of nodes (parent first). Its cached parent goes first in the keys,
        so the daemon links the chain to it (a key it already holds is not copied again)."""
        if self.client is None or not nodes:
            return None
        head = nodes[0].parent
        lead = [head] if head is not None and head.state == READY and head.offloading is None else []
        sent = lead + nodes
        task = self._daemon(self.client.offload, [n.block for n in sent], [n.key for n in sent])
        if task is None:
            self.counters["offload_failures"] += 1
            return None
        off = _Offload(task, self.client, sent, len(lead))
        for n in sent:
            n.offloading = off
        self._offloads.append(off)
        self.counters["offload_tasks"] += 1
        return off

    def _finish_offload(self, off: _Offload, timeout: float | None) -> None:
        try:
            off.task.wait(timeout)
            self._settle_offload(off, ok=True)
        except DaemonUnavailable as exc:
            self._detach(exc)
        except KvcachedTimeout:
            # the daemon may still read these blocks: fence them until it confirms the end
            off.client.fence(off.task.id, [n.block for n in off.nodes])
            self._daemon(off.task.cancel)
            self._settle_offload(off, ok=False)
        except TaskFailed:
            self._settle_offload(off, ok=False)

    def _settle_offload(self, off: _Offload, ok: bool) -> None:
        if off not in self._offloads:
            return
        self._offloads.remove(off)
        accepted = off.task.reply.get("accepted", len(off.nodes)) if ok else 0
        for i, node in enumerate(off.nodes):
            if node.offloading is off:
                node.offloading = None
                if i < accepted:
                    node.backed_up = True
                    if i >= off.offset:
                        self.counters["offloaded_blocks"] += 1
                self._free_if_unused(node)
        if not ok:
            self.counters["offload_failures"] += 1

    def _resolve(self, load: _Load, timeout: float | None) -> None:
        if load.loaded is not None:
            return
        try:
            loaded = load.task.wait(timeout)
        except DaemonUnavailable as exc:
            self._detach(exc)  # settles this load (fenced while the daemon may write)
            return
        except KvcachedTimeout as exc:  # cancelled; fenced by the client until the ack
            log.warning("[prefix] load timed out: %s", str(exc))
            loaded = 0
        self._settle_load(load, loaded)

    def _settle_load(self, load: _Load, loaded: int) -> None:
        if load.loaded is not None:
            return
        load.loaded = loaded
        self._loads.remove(load)
        self.counters["loaded_blocks"] += loaded
        self.counters["load_short_blocks"] += len(load.nodes) - loaded
        for i, node in enumerate(load.nodes):
            node.load = None
            if i < loaded:
                node.state = READY
                self.tree.maybe_evictable(node)
            else:
                node.state = INVALID
        for node in load.nodes[loaded:]:
            if self.tree.nodes.get(node.key) is node:
                self._invalidate(node)
            else:
                self._free_if_unused(node)

    def _poll(self) -> None:
        """Settle finished daemon work without blocking; reattach; return unfenced blocks."""
        self._maybe_attach()
        for off in list(self._offloads):
            try:
                if off.task.done():
                    self._finish_offload(off, 0)
            except DaemonUnavailable as exc:
                self._detach(exc)
        for load in list(self._loads):
            try:
                if load.task.done():
                    self._resolve(load, 0)
            except DaemonUnavailable as exc:
                self._detach(exc)
        self._fences.release()

    # introspection ----------------------------------------------------------
    def stats(self) -> dict:
        return {**self.counters, "attached": self.attached, "cached_blocks": len(self.tree),
                "free_blocks": self.pool.num_free, "fenced_blocks": len(self._fences.parked),
                "running": len(self._seqs), "offloads_in_flight": len(self._offloads),
                "loads_in_flight": len(self._loads)}

    def check(self) -> None:
        """Invariant walk (tests): every GPU block is in exactly one place - free, fenced,
        a cached node, or a request's private block - and reference counts add up."""
        from .check import check_manager

        check_manager(self)

    def close(self) -> None:
        """Wait for daemon work in flight (bounded by the client's timeout), then close."""
        self.settle()
        for client in self._fences.retired + ([self.client] if self.client is not None else []):
            client.close()
        self._fences.retired.clear()
        self.client = None
        if self._reattach is not None:
            self._reattach.close()
            self._reattach = None
