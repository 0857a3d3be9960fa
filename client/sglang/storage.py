"""kvcached as SGLang HiCache's storage backend (L3), loaded by SGLang with no change to SGLang:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcached",
        "module_path": "kvcached_client.sglang", "class_name": "KvcachedHiCacheStorage",
        "interface_v1": 1, "allocator": "shm", "instance": "sglang{rank}"}'

SGLang makes its host pool in memfds ("allocator": "shm"); at attach (on_host_pools_registered)
the backend hands the fds to the rank's daemon (kvcached_proto.fd_pass) and registers the
pool's geometry (pool_layout.py), so `batch_set_v1` / `batch_get_v1` are the daemon's offload
and load of those pages by index: one copy between SGLang's pool and the daemon's host tier,
no page bytes on a socket. The daemon's disk and Redis tiers sit behind its host tier.

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

from kvcached_proto import DaemonUnavailable, KvcachedTimeout, TaskStatus

from ..daemon_link import DaemonLink
from ..host_memory import register_host_memory
from . import weight_updates
from .config import ConfigError, PageKeys, Settings, sglang_weight_version
from .pool_layout import describe_host_pool, page_bytes, page_ids

log = logging.getLogger("kvcached.sglang")
RELEASE_SAY_S = 30.0  # a hung daemon's unconfirmed load waited for this long is logged (once)


class KvcachedHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.config = storage_config
        self.settings = Settings.of(storage_config)  # ConfigError (a ValueError): attach fails
        self.mem_pool_host = None
        self.link: DaemonLink | None = None
        self.keys: PageKeys | None = None
        self.page_size = self._page_bytes = 0
        self._layout: dict | None = None
        self._fds: list[int] = []
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
                      "old_weights_refused": 0}
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}

    # attach ---------------------------------------------------------------------
    def on_host_pools_registered(self) -> None:
        """Hand the pool to the daemon (raising here fails SGLang's attach: a pool the daemon
        cannot map, an extra-config that cannot work). No daemon yet is no error: pages miss
        until one is attached in the background."""
        pool = self.mem_pool_host
        others = sorted(str(name) for name in getattr(self, "registered_pools", {}) if str(name) != "kv")
        if others:
            raise ConfigError(f"kvcached pages SGLang's KV host pool only; this model also has "
                              f"{', '.join(others)} host pools (a hybrid model): run it with "
                              "another storage backend")
        self._layout, self._fds = describe_host_pool(pool)
        self.page_size = pool.page_size
        self._page_bytes = page_bytes(self._layout)
        self._pool_version = sglang_weight_version()
        watching = weight_updates.watch(self)
        self._salt = weight_updates.salt()  # weights updated in this process before the attach
        self.keys = PageKeys(self.config, self.settings, self._layout["kv_layout"],
                             self._pool_version, self._salt)
        self._watch_pool_clear(pool)
        if not watching:
            log.warning("[sglang] this SGLang's weight updates cannot be watched: one that names "
                        "no weight_version keeps the keys (name one, or clear the storage)")
        s = self.settings
        self.link = DaemonLink(s.instance, s.run_dir, s.timeout_s, name=f"sglang-{s.instance}",
                               on_connect=self._register, hang_s=s.hang_s)
        if self.link.attach_now() is None:
            log.warning("[sglang] kvcached daemon %s not attached (%s): pages miss until it is",
                        s.instance, self.link.last_error or "no daemon")
        else:
            log.info("[sglang] host pool (%s, %d pages) registered with kvcached daemon %s",
                     pool.layout, self._layout["num_blocks"], s.instance)

    def _register(self, client) -> None:
        register_host_memory(client, self._layout, self._fds)

    # SGLang's weight version ----------------------------------------------------------
    def _keys(self) -> PageKeys:
        """The page keys under SGLang's weight version now (a change re-keys, and fences
        backups until SGLang clears its host pool)."""
        version = sglang_weight_version()
        if version != self.keys.version:
            with self._keys_lock:
                if version != self.keys.version:
                    self.keys = PageKeys(self.config, self.settings, self._layout["kv_layout"],
                                         version, self._salt)
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
            self.keys = PageKeys(self.config, self.settings, self._layout["kv_layout"], version, salt)
            self._old_pages = not pool_cleared
        log.warning("[sglang] weight update (weight version %s%s): pages are keyed anew%s", version,
                    ", kept" if salt else "", "" if pool_cleared else ", and backups are refused "
                    "until SGLang flushes its cache (its host pool holds pages of the old weights)")

    # the zero-copy calls ------------------------------------------------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[Any] = None) -> List[bool]:
        self.stats["get_pages"] += len(keys)
        loaded = self._call("load", lambda c: self._load(c, keys, host_indices), 0)
        self.stats["got_pages"] += loaded
        return [True] * loaded + [False] * (len(keys) - loaded)

    def _load(self, client, keys, host_indices) -> int:
        pages = page_ids(host_indices, self.page_size, len(keys))
        start = time.perf_counter()
        try:
            task = client.load(self._keys()(keys), pages)
        except (KvcachedTimeout, DaemonUnavailable) as exc:
            if getattr(exc, "unanswered", None) is not None:  # sent, unanswered: a daemon that
                self._await_release(client, exc.unanswered)   # wakes may still take it
            raise
        try:
            loaded = task.wait(self.settings.timeout_s)
        except KvcachedTimeout as exc:
            if getattr(exc, "held_blocks", None):
                self._await_release(client, task)
            raise
        self._measured("prefetch", loaded, start)
        return loaded

    def _await_release(self, client, task) -> None:
        """A load the daemon did not confirm cancelled, or never answered (`task` is then the
        error's `.unanswered`), may still write its pages. SGLang frees
        a prefetch's pages only after this call returned (its last ack), so this waits until
        the load ends, the daemon's process is gone or the backend closes - however long: a
        copy landing late in a page SGLang reused would be wrong KV. A daemon frozen past
        RELEASE_SAY_S is logged (this prefetch thread of SGLang waits for it; restart it)."""
        gone = (client.status_block.identity_check() if client.status_block is not None
                else (lambda: True))
        said_at = time.monotonic() + RELEASE_SAY_S
        while not gone() and not self._closing.is_set():
            try:
                if task.done():
                    return
            except DaemonUnavailable:
                pass  # hung: it may wake and write, so wait on
            if said_at is not None and time.monotonic() > said_at:
                said_at = None
                log.error("[sglang] the daemon has not ended %s in %.0f s: this prefetch "
                          "waits until it does or its process is gone (a late copy must not land "
                          "in a page SGLang reused); restart a daemon that is stuck",
                          f"load {task.id}" if task.id > 0 else "a load it never answered",
                          RELEASE_SAY_S)
            time.sleep(0.05)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[Any] = None) -> List[bool]:
        if not self.config.is_storage_writer:  # MLA: the writer rank stores what every rank holds
            return [True] * len(keys)          # (SGLang skips these ranks' backups itself)
        self.stats["set_pages"] += len(keys)
        stored = self._call("offload", lambda c: self._offload(c, keys, host_indices), 0)
        self.stats["set_ok_pages"] += stored
        return [True] * stored + [False] * (len(keys) - stored)

    def _offload(self, client, keys, host_indices) -> int:
        page_keys = self._keys()
        if self._old_pages:  # these may be pages of the old weights: not stored
            self.stats["old_weights_refused"] += len(keys)
            return 0
        pages = page_ids(host_indices, self.page_size, len(keys))
        start = time.perf_counter()
        task = client.offload(pages, page_keys(keys))  # revoked by the client if no reply comes
        try:
            task.wait(self.settings.timeout_s)
        except BaseException:
            client.revoke(task)  # whatever the daemon copied after this is discarded
            raise
        if task.status != TaskStatus.DONE:
            return 0
        accepted = int(task.reply.get("accepted", len(keys)))
        self._measured("backup", accepted, start)
        return accepted

    def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
        self.stats["exists_calls"] += 1
        host, storage = self._call("lookup", lambda c: c.lookup(self._keys()(keys)), (0, 0))
        hit = min(host + storage, len(keys))
        self.stats["exists_hits"] += hit
        return hit

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # the calls SGLang makes for hybrid models' side pools (refused at attach): misses --------
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        self._say("v2", "the v2 calls (hybrid models' side pools) are not served")
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers, extra_info=None):
        return self._unpaged("batch_get_v2", {t.name: [False] * len(t.keys or []) for t in transfers})

    def batch_set_v2(self, transfers, extra_info=None):
        return self._unpaged("batch_set_v2", {t.name: [False] * len(t.keys or []) for t in transfers})

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
        if self._call("clear", lambda c: c.clear("all"), None) is not None or self.keys is None:
            return
        with self._keys_lock:
            self._salt = os.urandom(8).hex()
            self.keys = PageKeys(self.config, self.settings, self._layout["kv_layout"],
                                 self.keys.version, self._salt)
        log.warning("[sglang] storage flush: the daemon's tiers could not be cleared; pages are "
                    "keyed anew, so nothing stored before is matched again")

    def close(self) -> None:
        """Detach: the daemon unmaps the pool (unregister, then the connection goes)."""
        self._closing.set()
        link, self.link = self.link, None
        if link is None:
            return
        client = link.client
        if client is not None:
            try:
                client.unregister_kv_cache(timeout=min(self.settings.timeout_s, 2.0))
            except Exception as exc:  # gone already: its KV mapping goes with the connection
                log.info("[sglang] unregister at close: %s", exc)
        link.close()

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
    def _call(self, what: str, fn, miss):
        link = self.link
        client = link.refresh() if link is not None else None
        if client is None:
            self.stats["no_daemon"] += 1
            return miss
        try:
            return fn(client)
        except Exception as exc:  # never into SGLang's threads: a miss
            self.stats["errors"] += 1
            self._say(f"{what}:{type(exc).__name__}",
                      f"{what} failed, served as a miss: {type(exc).__name__}: {exc}")
            if isinstance(exc, DaemonUnavailable):
                link.failed(exc)
            return miss

    def _say(self, kind: str, message: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            log.warning("[sglang] %s (said once)", message)

    def _measured(self, kind: str, pages: int, start: float) -> None:
        if not self.config.enable_storage_metrics or pages <= 0:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        self._metrics[f"{kind}_pgs"].append(pages)
        self._metrics[f"{kind}_bandwidth"].append(pages * self._page_bytes / seconds / 1e9)
