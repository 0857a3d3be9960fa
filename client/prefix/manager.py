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
reused until the task ends; a block a timed-out load or offload may still touch stays held
until the daemon confirms the task ended (or is gone). Without a daemon, or after it dies,
the manager is a GPU-only prefix cache and reattaches when a daemon is back.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

from kvcached_proto.errors import DaemonUnavailable, KvcachedError, KvcachedTimeout, TaskFailed

from ..daemon_link import DaemonLink
from ..hashing import BlockHasher
from ..key_scheme import KeyScheme, request_parts
from ..mm_keys import MMItem
from ..reattach import reconnector
from .blocks import GpuBlocks
from .records import Match, _Seq
from .transfers import Transfers
from .tree import INVALID, LOADING, READY, Node, NoFreeBlocks, parent_first_chains

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
        # free, cached and held GPU blocks (a client in use or replaced may hold blocks)
        self.blocks = GpuBlocks(num_gpu_blocks, lambda: self.client)
        self.pool, self.tree = self.blocks.pool, self.blocks.tree
        self.key_scheme = KeyScheme(hasher or BlockHasher(namespace))  # keys of token blocks
        self.write_policy = write_policy
        self.selective_hits = selective_hits
        self.kv_caches = kv_caches
        self._seqs: dict[object, _Seq] = {}
        # attaching (connect, register the KV cache) runs in the background: no engine call
        # waits for a daemon that is gone, hung or not there yet
        if connect is None and client is not None:
            connect = reconnector(client)
        self.link = DaemonLink(name="prefix", connect=connect, on_connect=self._register,
                               retire=self.blocks.holds.retire, on_adopt=self._attached,
                               on_drop=self._detached)
        self.counters = {
            "requests": 0, "gpu_hit_tokens": 0, "host_hit_tokens": 0, "storage_hit_tokens": 0,
            "computed_tokens": 0, "evictions": 0, "offload_tasks": 0, "offloaded_blocks": 0,
            "offload_failures": 0, "loads": 0, "loaded_blocks": 0, "load_short_blocks": 0,
            "daemon_errors": 0, "detaches": 0, "attaches": 0,
        }
        self.transfers = Transfers(self.blocks, self.link, self.counters)  # loads, offloads in flight
        if client is not None:
            self.link.adopt(client)  # registered here, on the caller's thread
        self.link.watch()  # only now: a watcher started before the client was set raced it to
        # register (KV_IN_USE)

    # attachment -------------------------------------------------------------
    @property
    def client(self):
        """The daemon's client in use, or None (GPU-only until one is attached)."""
        return self.link.client

    @property
    def attached(self) -> bool:
        return self.link.client is not None

    def _register(self, client) -> None:
        if self.kv_caches is not None:
            client.register_kv_cache(self.kv_caches)

    def _attached(self, client) -> None:
        for node in self.tree.nodes.values():
            node.backed_up = False  # a new daemon's host tier starts empty
        self.counters["attaches"] += 1

    def _detached(self, client, exc: Exception) -> None:
        """The daemon is gone (or hung): carry on GPU-only. Work it had in flight may still
        touch device blocks if it is only hung, so those blocks stay held (the link then
        retires the client into the hold keeper)."""
        self.counters["detaches"] += 1
        log.warning("[prefix] daemon unavailable, continuing without it: %s", str(exc))
        self.transfers.hold_and_fail(client, exc)

    # request lifecycle ------------------------------------------------------
    def match(self, request_id, token_ids: Sequence[int], mm_items: Sequence[MMItem] | None = None,
              adapter: str | None = None, cache_salt: str | None = None) -> Match:
        """Find the request's cached prefix: GPU hits are referenced at once; host and storage
        hits get GPU blocks and a load (see wait_loaded / wait_layer). At least the last token
        is left to compute, so the engine has logits. `adapter` names what else changes the
        request's KV (a LoRA adapter: its name and version), `cache_salt` keeps prefixes apart
        (one tenant's from another's): blocks of other adapters or salts are never matched."""
        if request_id in self._seqs:
            raise KvcachedError(f"request {request_id!r} is already matched; release it first")
        self._poll()
        seq = _Seq(request_id, list(token_ids), list(mm_items) if mm_items else None,
                   parts=request_parts(adapter, cache_salt))
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
        found = self.transfers.call(self.client.lookup, keys) if self.client else None
        if not found or not sum(found):
            return 0, 0
        blocks = self._take_blocks(sum(found), partial=True)
        if self.client is None:  # the daemon went away while we made room
            self.pool.give(blocks)
            return 0, 0
        if not blocks:
            return 0, 0
        task = self.transfers.call(self.client.load, keys[: len(blocks)], blocks)
        planned = task.num_blocks if task is not None else 0
        self.blocks.free(blocks[planned:])  # held ones (a rank of a group still writing) wait
        if not planned:
            return 0, 0
        seq.nodes.extend(self.transfers.track_load(task, keys[:planned], blocks, parent))
        host = min(task.reply.get("host_blocks", planned), planned)
        return host, planned - host

    def wait_loaded(self, request_id, timeout: float | None = None) -> int:
        """Wait for the request's loads; returns the tokens whose KV is in place. A load that
        came back short (or failed) trims the prefix: the engine computes from there."""
        seq = self._seq(request_id)
        for node in list(seq.nodes[: seq.cached_blocks]):
            if node is not None and node.state == LOADING:
                self.transfers.resolve(node.load, timeout)
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
                    self.transfers.resolve(load, timeout)
            except (TaskFailed, KvcachedTimeout, DaemonUnavailable):
                self.transfers.resolve(load, timeout)
        return self._trim(seq)

    def _trim(self, seq: _Seq) -> int:
        for i, node in enumerate(seq.nodes[: seq.cached_blocks]):
            if node is not None and node.state == INVALID:
                for block, dropped in zip(seq.blocks[i:], seq.nodes[i:]):
                    if dropped is None:
                        self.blocks.free([block])
                    else:
                        self.blocks.unref(dropped)
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
            self.transfers.offload_chain(added)
        return len(added)

    def release(self, request_id) -> None:
        """The request finished or was preempted: its references go; its private blocks
        return to the pool; its cached blocks stay for later requests."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            raise KvcachedError(f"request {request_id!r} is not known (released twice?)")
        for block, node in zip(seq.blocks, seq.nodes):
            if node is None:
                self.blocks.free([block])
            else:
                self.blocks.unref(node)
        self._poll()

    preempt = release  # preemption frees the blocks; committed ones stay cached for re-match

    def reset(self, clear_daemon: bool = True, namespace: str | None = None,
              timeout: float | None = None) -> None:
        """After a weight update: nothing cached so far is ever matched again. Waits for the
        daemon work in flight, drops every cached GPU block, and clears the daemon's tiers
        (clear_daemon) or switches to a new namespace. Without either - not asked to clear (the
        daemon serves other engines too), or a clear that cannot be done (no daemon attached,
        or it failed) - the keys are salted anew, so what the daemon holds (its disk tier,
        when it comes back) is never matched. Running requests keep their blocks privately
        until released, and nothing they compute is cached."""
        self.settle(timeout)
        self.drop_gpu_cache()
        for seq in self._seqs.values():
            seq.stale = True  # its KV came (partly) from the old weights
        if namespace is not None:
            self.key_scheme.hasher = BlockHasher(namespace)
        attached, cleared = self.client is not None, None
        if clear_daemon and attached:
            cleared = self.transfers.call(self.client.clear, "all", True)
        if namespace is None and cleared is None:  # the old blocks may be there: never match them
            self._salt_anew("not asked to clear the daemon's tiers" if not clear_daemon else
                            "no daemon attached to clear" if not attached else "the daemon's clear failed")

    def _salt_anew(self, why: str) -> None:
        ns = self.key_scheme.hasher.namespace
        salt = f"|reset:{os.urandom(8).hex()}"
        self.key_scheme.hasher = BlockHasher(ns + salt if isinstance(ns, str) else bytes(ns) + salt.encode())
        log.info("[prefix] reset: %s; keys are salted anew, so no block stored before is "
                    "matched again", why)

    def drop_gpu_cache(self) -> int:
        """Forget every cached GPU block (the daemon's tiers keep theirs); blocks in use by
        running requests or in-flight copies are freed when those end. Returns the count."""
        return self.blocks.drop_all()

    def settle(self, timeout: float | None = None) -> None:
        """Wait for every load and offload in flight (each bounded by timeout, or the
        client's)."""
        self.transfers.settle(timeout)

    def try_attach(self) -> bool:
        """Check the daemon now (not at the next request): detach from a dead one, attach to
        one that is there. Returns whether the manager is attached."""
        if self.client is not None:
            try:
                self.client.poll_events()
            except DaemonUnavailable as exc:
                self.link.drop(exc)
        self.link.attach_now()
        return self.attached

    # helpers ----------------------------------------------------------------
    def _seq(self, request_id) -> _Seq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KvcachedError(f"request {request_id!r} is not known; match it first")
        return seq

    def _extend_keys(self, seq: _Seq) -> None:
        self.key_scheme.extend(seq.keys, seq.tokens, self.block_size, len(seq.tokens), seq.mm_items,
                               seq.parts)

    def _take_blocks(self, n: int, partial: bool = False) -> list[int]:
        self._poll()
        if not partial and n > self.pool.num_free + self.tree.idle:
            raise NoFreeBlocks(f"{n} GPU blocks asked: {self.pool.num_free} free and "
                               f"{self.tree.idle} cached ones unreferenced")
        if self.pool.num_free < n:
            self._evict(n - self.pool.num_free)
        if self.pool.num_free < n and (self.transfers.offloads or self.transfers.loads):
            self.transfers.settle(None)  # blocks held by offloads in flight, loads nobody waited for
            self._evict(n - self.pool.num_free)
        if partial:
            n = min(n, self.pool.num_free)
        return self.pool.take(n)

    def _evict(self, count: int) -> None:
        victims = self.blocks.take_victims(count)
        if not victims:
            return
        if self.write_policy == "write_back" and self.client is not None:
            pending = [v for v in victims if not v.backed_up]
            for chain in parent_first_chains(pending):
                off = self.transfers.offload_chain(chain)
                if off is not None:
                    self.transfers.finish_offload(off, None)
        self.counters["evictions"] += len(victims)
        self.blocks.evicted(victims)

    def _selective_write(self, nodes: list[Node]) -> None:
        if self.write_policy != "write_through_selective" or self.client is None:
            return
        hot = [i for i, n in enumerate(nodes) if n.hits >= self.selective_hits and
               n.state == READY and not n.backed_up and n.offloading is None]
        if hot:  # the chain up to the deepest hot block, so the host tier holds it whole
            self.transfers.offload_chain([n for n in nodes[: hot[-1] + 1]
                                 if not n.backed_up and n.offloading is None and n.state == READY])

    def _poll(self) -> None:
        """Settle finished daemon work without blocking; reattach; return blocks no longer held."""
        self.link.refresh()
        self.transfers.poll()
        self.blocks.holds.release()

    # introspection ----------------------------------------------------------
    def stats(self) -> dict:
        return {**self.counters, "attached": self.attached, "cached_blocks": len(self.tree),
                "free_blocks": self.pool.num_free, "held_blocks": len(self.blocks.holds.parked),
                "running": len(self._seqs), "offloads_in_flight": len(self.transfers.offloads),
                "loads_in_flight": len(self.transfers.loads)}

    def check(self) -> None:
        """Invariant walk (tests): every GPU block is in exactly one place - free, held,
        a cached node, or a request's private block - and reference counts add up."""
        from .check import check_manager

        check_manager(self)

    def close(self) -> None:
        """Wait for daemon work in flight (bounded by the client's timeout), then close."""
        self.settle()
        self.link.close()  # the client in use retires too
        for client in self.blocks.holds.retired:
            client.close()
        self.blocks.holds.retired.clear()
