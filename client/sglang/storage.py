"""kvcached as SGLang HiCache's storage backend (L3), loaded by SGLang with no change to SGLang:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcached",
        "module_path": "kvcached_client.sglang", "class_name": "KvcachedHiCacheStorage",
        "interface_v1": 1, "allocator": "shm", "instance": "sglang{rank}"}'

SGLang makes its host pool in memfds ("allocator": "shm"); at attach (on_host_pools_registered)
the backend hands the fds to the rank's daemon (kvcached_proto.fd_pass) and registers the
pool's geometry (pool_layout.py), so `batch_set_v1` / `batch_get_v1` are the daemon's offload
and load of those pages by index: one copy between SGLang's pool and the daemon's host tier,
no page bytes on a socket. The daemon's disk and Redis tiers sit behind its host tier. The
side pools (a hybrid model's Mamba and sliding-window pools, DeepSeek V3.2's indexer, a draft's
KV) are paged the same way, each through a daemon of its own, by SGLang's v2 calls
(side_pools.py); each pool's part is a PoolChannel (pool_channel.py).

No call raises into SGLang's I/O threads: a daemon that is missing, gone, hung or refusing
costs misses (False / 0), counted in `stats`, logged once per kind; a daemon that restarts is
attached again in the background (DaemonLink). An offload SGLang is told failed is revoked
first (the daemon discards what it copied), and a load whose cancel the daemon has not
confirmed is waited for until it is, or the daemon is gone - so a page SGLang reuses is never
written by a late copy.

A weight update that names a version (SGLang's `weight_version`) changes the keys at the next
call (config.py), so nothing stored before is matched after it; one that names none keys the
pages under a new salt when it returns (weight_updates.py). Pages SGLang computed with the
old weights may still sit in its host pool until it flushes its cache, which follows the update:
until that flush clears the pool, backups are refused (misses), so no old page is stored under
the new keys.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from . import side_pools, weight_updates
from .config import PageKeys, Settings, sglang_weight_version
from .pool_channel import PoolChannel, last_prefix_key

log = logging.getLogger("kvcached.sglang")


class KvcachedHiCacheStorage(side_pools.SidePools, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.config = storage_config
        self.settings = Settings.of(storage_config)  # ConfigError (a ValueError): attach fails
        self.mem_pool_host = None
        self.kv: PoolChannel | None = None  # the KV pool's
        self.sides: dict = {}  # a hybrid model's side pools' PoolChannels, by SGLang's pool name
        self._said: set[str] = set()
        self._closing = threading.Event()  # close(): unconfirmed loads are waited for no more
        self._old_pages = False  # the weight version changed; SGLang's pool not cleared since
        self._pool_version: str | None = None  # the version SGLang's host pool was last cleared at
        self._salt = ""  # set by a storage flush that could not clear the daemon's tiers, and
        # by a weight update that kept the version
        self.pool_clears = 0  # how often SGLang cleared its host pool
        self._keys_lock = threading.Lock()
        self.stats = {"exists_calls": 0, "exists_hits": 0, "get_pages": 0, "got_pages": 0,
                      "set_pages": 0, "set_ok_pages": 0, "no_daemon": 0, "errors": 0,
                      "old_weights_refused": 0, "side_pages_got": 0, "side_pages_set": 0}
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}

    # attach ---------------------------------------------------------------------
    def on_host_pools_registered(self) -> None:
        """Hand the pool to the daemon (raising here fails SGLang's attach: a pool the daemon
        cannot map, an extra-config that cannot work). No daemon yet is no error: pages miss
        until one is attached in the background."""
        pool = self.mem_pool_host
        pools = self._side_pools()  # ConfigError: a side pool kvcached does not serve (before
        # the KV pool is described: a model with such pools may have no KV pool memory of its own)
        kv = PoolChannel(self, "kv", pool, self.settings.instance)
        try:
            sides = self.side_channels(pools)  # ConfigError: a side pool kvcached cannot page
        except BaseException:
            kv.close()
            raise
        self.kv = kv
        self._pool_version = sglang_weight_version()
        watching = weight_updates.watch(self)
        self._salt = weight_updates.salt()  # weights updated in this process before the attach
        self._rekey(self._pool_version, self._salt, sides)
        self._watch_pool_clear(pool)
        if not watching:
            log.warning("[sglang] this SGLang's weight updates cannot be watched: one that names "
                        "no weight_version keeps the keys (name one, or clear the storage)")
        for channel in (self.kv, *sides.values()):
            channel.attach_now()
        self.sides = sides

    @property
    def keys(self) -> PageKeys | None:
        """The KV pool's page keys now (None before the attach)."""
        return self.kv.keys if self.kv is not None else None

    def _rekey(self, version: str | None, salt: str, sides: dict | None = None) -> None:
        """Every pool's page keys under SGLang's weight `version` and `salt` (lock held, or
        before any call)."""
        self.kv.keys = PageKeys(self.config, self.settings, self.kv.kv_layout, version, salt)
        for name, channel in (self.sides if sides is None else sides).items():
            channel.keys = PageKeys(self.config, self.settings, channel.kv_layout, version, salt,
                                    replicated=side_pools.replicated(name, channel.pool, self.config))

    # SGLang's weight version ----------------------------------------------------------
    def _keys(self) -> PageKeys:
        """The page keys under SGLang's weight version now (a change re-keys, and fences
        backups until SGLang clears its host pool)."""
        version = sglang_weight_version()
        if version != self.keys.version:
            with self._keys_lock:
                if version != self.keys.version:
                    self._rekey(version, self._salt)
                    self._old_pages = self._pool_version != version  # not cleared since
                    log.warning("[sglang] weight version %s: pages are keyed anew%s", version,
                                ", and backups are refused until SGLang flushes its cache (its "
                                "host pool holds pages of the old weights)" if self._old_pages else "")
        return self.keys

    def _watch_pool_clear(self, pool) -> None:
        """SGLang clears its host pool when it flushes its cache (after a weight update):
        from then on every page in it is of the weights now."""
        clear = getattr(pool, "clear", None)
        if clear is None:
            return

        def cleared(*args, **kwargs):
            out = clear(*args, **kwargs)
            with self._keys_lock:
                self.pool_clears += 1
                self._pool_version = sglang_weight_version()
                self._old_pages = self._pool_version != self.keys.version
            return out

        pool.clear = cleared

    def weights_replaced(self, version: str | None, salt: str, pool_cleared: bool) -> None:
        """A weight update returned (weight_updates.py): pages are keyed under SGLang's weight
        version now, with `salt` (a new one where the update kept the version), and backups
        are refused until SGLang's host pool is cleared, unless the update's own flush cleared
        it already."""
        with self._keys_lock:
            self._salt = salt
            if self.keys is None or self._closing.is_set():
                return
            self._rekey(version, salt)
            self._old_pages = not pool_cleared
        log.warning("[sglang] weight update (weight version %s%s): pages are keyed anew%s", version,
                    ", kept" if salt else "", "" if pool_cleared else ", and backups are refused "
                    "until SGLang flushes its cache (its host pool holds pages of the old weights)")

    # the zero-copy calls ------------------------------------------------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[Any] = None) -> List[bool]:
        self.stats["get_pages"] += len(keys)
        if self.kv is None:  # not attached
            return [False] * len(keys)
        self._keys()
        loaded = self.kv.load(keys, host_indices)
        self.stats["got_pages"] += loaded
        return [True] * loaded + [False] * (len(keys) - loaded)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[Any] = None) -> List[bool]:
        if not self.config.is_storage_writer:  # MLA: the writer rank stores what every rank holds
            return [True] * len(keys)          # (SGLang skips these ranks' backups itself)
        self.stats["set_pages"] += len(keys)
        if self.kv is None:
            return [False] * len(keys)
        self._keys()
        stored = self.kv.offload(keys, host_indices, last_prefix_key(extra_info))
        self.stats["set_ok_pages"] += stored
        return [True] * stored + [False] * (len(keys) - stored)

    def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
        self.stats["exists_calls"] += 1
        if self.kv is None:
            return 0
        self._keys()
        hit = self.kv.lookup(keys)
        self.stats["exists_hits"] += hit
        return hit

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # the calls SGLang makes only without interface_v1 (which Settings requires) ------------
    def get(self, key, target_location=None, target_sizes=None):
        return self._unpaged("get", None)

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return self._unpaged("batch_get", [None] * len(keys))

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self._unpaged("set", False)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return self._unpaged("batch_set", False)

    def _unpaged(self, what: str, miss):
        self._say(what, f"{what}: kvcached pages the host pool in place only (interface_v1); "
                  "this call copies pages through Python values and is not served")
        return miss

    # the rest of SGLang's interface ---------------------------------------------------
    def clear(self) -> None:
        """SGLang's flush of its storage: the daemon's tiers are cleared (every engine's). When
        that cannot be done (no daemon attached, or it failed), this backend's keys are salted
        anew instead, so what the tiers hold (a disk tier the daemon finds again) is never
        matched by it."""
        if self.kv is None:
            return
        cleared = [c.call("clear", lambda client: client.clear("all"), None) is not None
                   for c in (self.kv, *self.sides.values())]
        if all(cleared):
            return
        with self._keys_lock:
            self._salt = os.urandom(8).hex()
            self._rekey(self.keys.version, self._salt)
        log.warning("[sglang] storage flush: the daemon's tiers could not be cleared; pages are "
                    "keyed anew, so nothing stored before is matched again")

    def close(self) -> None:
        """Detach: the daemon unmaps the pool (unregister, then the connection goes)."""
        self._closing.set()
        with self._keys_lock:  # a side pool added meanwhile is in self.sides, or sees _closing
            channels = (self.kv, *self.sides.values())
        for channel in channels:
            if channel is not None:
                channel.close()

    def get_stats(self):
        if not self.config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        for name, values in self._metrics.items():
            getattr(metrics, name).extend(values)
            values.clear()
        return metrics

    # plumbing -------------------------------------------------------------------
    def _say(self, kind: str, message: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            log.warning("[sglang] %s (said once)", message)

    def _measured(self, kind: str, pages: int, start: float, page_bytes: int) -> None:
        if not self.config.enable_storage_metrics or pages <= 0:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        self._metrics[f"{kind}_pgs"].append(pages)
        self._metrics[f"{kind}_bandwidth"].append(pages * page_bytes / seconds / 1e9)
