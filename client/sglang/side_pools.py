"""A hybrid model's side pools: SGLang's v2 storage calls (batch_exists_v2, batch_get_v2,
batch_set_v2), with which its hybrid cache controller pages the host pools beside the KV pool.

Served: `mamba` (the state of a Mamba / linear-attention model's recurrent layers after a page,
one slot per page), `swa` (the KV of its sliding-window layers), `indexer` (DeepSeek V3.2's
sparse-attention index keys) and `draft` (a speculative draft model's KV, which SGLang adds
after the attach for EAGLE-style drafts); the last two ride on the KV pages (SGLang hands them
the KV pool's host indices). SGLang needs the first two for the last pages of a prefix only
(PoolHitPolicy.TRAILING_PAGES: the window that ends where the prefix ends), the others for
every page of it (ALL_PAGES). Every other side pool (DeepSeek V4's, the draft's own sliding
window and indexer) is refused at attach, with SGLang's message that the attach failed, or,
added later, logged and missed.

Each side pool is paged in place through a daemon of its own (a daemon takes one page geometry):
the extra-config's `pool_instances` names it, else it is `{instance}-{pool}` (`sglang0-mamba`
beside `sglang0`). Its pages are keyed as the KV pool's - SGLang's page hashes under the model's
namespace and weight version - with the pool's own layout in the namespace, so a Mamba state is
never matched for a KV page nor by another model or geometry. A Mamba state is keyed by the
tensor-parallel rank even in an MLA model (SGLang shards it across ranks and backs it up on
each); a sliding-window pool by the rank as its KV pool is.

A side pool whose daemon is missing, gone or refusing holds nothing: a prefix whose window needs
it is not a hit, so SGLang recomputes rather than resuming from a state it does not have.
"""
from __future__ import annotations

import logging

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult

from .config import ConfigError
from .pool_channel import PoolChannel, last_prefix_key

log = logging.getLogger("kvcached.sglang")
SERVED = ("mamba", "swa", "indexer", "draft")


def replicated(name: str, pool, cfg) -> bool:
    """Whether side pool `name` holds the same bytes on every tensor-parallel rank: never a
    Mamba pool's (SGLang shards it), a draft's where it is MLA too, the others' as the model's KV
    (an MLA model's is: SGLang backs them up from its storage-writer rank only, and every rank
    loads them)."""
    if name == "mamba":
        return False
    if name == "draft" and getattr(pool, "kv_lora_rank", None) is None:  # an MHA draft: sharded
        return False
    return bool(cfg.is_mla_model)


def trailing_restorable(held: list[bool], window: int) -> list[int]:
    """The prefix lengths p (1..len(held)) whose last `window` pages are all held (fewer where
    p < window): where a pool of SGLang's TRAILING_PAGES policy lets a prefix stop."""
    out, run = [], 0
    for p, page_held in enumerate(held, start=1):
        run = run + 1 if page_held else 0
        if run >= min(max(window, 1), p):
            out.append(p)
    return out


class SidePools:
    """The v2 calls of KvcachedHiCacheStorage (storage.py), over its side pools' channels."""

    def _side_pools(self) -> dict:
        """SGLang's side pools by name; ConfigError (SGLang's attach fails with it) where one
        is not served."""
        pools = {str(n): p for n, p in getattr(self, "registered_pools", {}).items() if str(n) != "kv"}
        unserved = sorted(set(pools) - set(SERVED))
        if unserved:
            raise ConfigError(f"kvcached pages SGLang's KV, {', '.join(SERVED)} host pools; this "
                              f"model also has {', '.join(unserved)} host pools: run it with "
                              "another storage backend")
        return pools

    def side_channels(self, pools: dict) -> dict:
        """A PoolChannel for each of SGLang's side pools (`_side_pools`); ConfigError (SGLang's
        attach fails with it) for one kvcached cannot page."""
        out: dict = {}
        try:
            for name, pool in pools.items():
                out[name] = self._side_channel(name, pool, {self.settings.instance} |
                                               {c.instance for c in out.values()})
        except BaseException:
            for channel in out.values():
                channel.close()
            raise
        return out

    def _side_channel(self, name: str, pool, taken: set) -> PoolChannel:
        instance = self.settings.pool_instance(name)
        if instance in taken:
            raise ConfigError(f"SGLang's {name} host pool needs a daemon of its own (a daemon "
                              f"takes one page geometry), not {instance}: name another in the "
                              "extra-config's pool_instances")
        try:
            return PoolChannel(self, name, pool, instance)
        except Exception as exc:  # a pool whose zero-copy metadata is not as described
            raise ConfigError(f"SGLang's {name} host pool cannot be paged by kvcached: "
                              f"{type(exc).__name__}: {exc}") from None

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        """A side pool SGLang adds after the attach (a dynamic sidecar) is attached on the spot;
        one kvcached cannot page is logged, and its pages miss."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if self.kv is None or name == "kv" or name in self.sides or self._closing.is_set():
            return  # before the attach (on_host_pools_registered takes it), known, or closed
        try:
            if name not in SERVED:
                raise ConfigError(f"kvcached does not page SGLang's {name} host pools")
            channel = self._side_channel(name, host_pool, {self.settings.instance} |
                                         {c.instance for c in self.sides.values()})
        except ConfigError as exc:
            log.error("[sglang] %s: its pages miss", str(exc))
            return
        with self._keys_lock:
            if self._closing.is_set():  # closed meanwhile: close() did not see this one
                channel.close()
                return
            self.sides = {**self.sides, name: channel}
            self._rekey(self.keys.version, self._salt)
        channel.attach_now()

    def _channel(self, name):
        channel = self.kv if str(name) == "kv" else self.sides.get(str(name))
        if channel is None:
            self._say(f"v2:{name}", f"SGLang's {name} pool is not paged by kvcached: its pages miss")
        return channel

    # SGLang's v2 calls --------------------------------------------------------------
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        """The KV prefix the daemons hold, cut to where every side pool can serve its end:
        `restorable_prefix_pages` lists each length that works (SGLang intersects the ranks')."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits = {PoolName.KV: kv_pages} if kv_pages else {}
        ok = set(range(1, kv_pages + 1))
        span = list(keys[:kv_pages])
        for transfer in pool_transfers or ():
            if not ok:
                break
            channel = self._channel(transfer.name)
            if channel is None or transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES,
                                                              PoolHitPolicy.TRAILING_PAGES):
                ok = set()
                break
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                pool_ok = list(range(1, channel.lookup(span) + 1))
            else:
                pool_ok = trailing_restorable(channel.held(span), len(transfer.keys or ()))
            if pool_ok:
                hits[transfer.name] = pool_ok[-1]
            ok &= set(pool_ok)
        restorable = sorted(ok)
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        """Each transfer's pages loaded into its pool, a leading run of True per pool."""
        return self._v2(transfers, "get", extra_info)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        """Each transfer's pages stored from its pool (SGLang picks which ranks back up which
        pool; the KV pool's backups stay the writer rank's, as in batch_set_v1)."""
        return self._v2(transfers, "set", extra_info)

    def _v2(self, transfers, op: str, extra_info=None) -> dict:
        out = {}
        if self.kv is not None:
            self._keys()  # a weight version changed since: every pool keyed anew
        for transfer in transfers:
            keys = list(transfer.keys or ())
            channel = self._channel(transfer.name) if self.kv is not None else None
            if channel is None or not keys:
                out[transfer.name] = [False] * len(keys)
                continue
            if op == "set" and channel is self.kv and not self.config.is_storage_writer:
                out[transfer.name] = [True] * len(keys)
                continue
            if op == "get":
                moved = channel.load(keys, transfer.host_indices)
            else:
                moved = channel.offload(keys, transfer.host_indices, last_prefix_key(extra_info))
            self.stats["side_pages_got" if op == "get" else "side_pages_set"] += moved
            out[transfer.name] = [True] * moved + [False] * (len(keys) - moved)
        return out
