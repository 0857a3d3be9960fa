"""One of SGLang's host pools paged through one daemon: the pool's layout and memfds handed to
the daemon at attach, the link to it, the keys its pages go under, and its zero-copy loads and
offloads of whole pages by index.

The KV pool is one; the side pools (a hybrid model's Mamba states and sliding-window KV,
DeepSeek V3.2's index keys, a draft's KV) are others, each on a daemon of its own, since a daemon takes one page geometry (side_pools.py). No
call raises: a daemon that is missing, gone, hung or refusing costs misses, counted in the
backend's `stats` and logged once per kind (storage.py).
"""
from __future__ import annotations

import logging
import threading
import time

from kvcached_proto import DaemonUnavailable, KvcachedTimeout, TaskStatus

from ..daemon_link import DaemonLink
from ..host_memory import register_host_memory
from .pool_layout import describe_host_pool, page_bytes, page_ids

log = logging.getLogger("kvcached.sglang")
RELEASE_SAY_S = 30.0  # a hung daemon's unconfirmed load waited for this long is logged (once)


def last_prefix_key(extra_info) -> str | None:
    """The hash of the page before a batch (HiCacheStorageExtraInfo.prefix_keys: SGLang passes
    them with hicache_storage_pass_prefix_keys set), or None."""
    prefix = getattr(extra_info, "prefix_keys", None)
    return prefix[-1] if prefix else None


class PoolChannel:
    def __init__(self, backend, name: str, pool, instance: str):
        """ValueError (PoolNotShared among them) when the daemon cannot page `pool`."""
        self.backend, self.name, self.pool, self.instance = backend, name, pool, instance
        self.layout, self.fds = describe_host_pool(pool, name)
        self.page_size = pool.page_size
        self.page_bytes = page_bytes(self.layout)
        self.kv_layout = self.layout["kv_layout"]
        self.keys = None  # PageKeys, set by the backend (and anew at each weight change)
        s = backend.settings
        label = f"sglang-{instance}" if name == "kv" else f"sglang-{instance}-{name}"
        self._lock = threading.RLock()  # (the link's drop calls _retire with it held, or not: close)
        self._calls: dict[int, int] = {}  # id(client) -> the calls in it now (SGLang's threads)
        self._retired: list = []  # dropped clients kept open while a call uses them
        self.link: DaemonLink | None = DaemonLink(instance, s.run_dir, s.timeout_s, name=label,
                                                  on_connect=self._register, hang_s=s.hang_s,
                                                  retire=self._retire)

    def _register(self, client) -> None:
        register_host_memory(client, self.layout, self.fds)

    def attach_now(self) -> bool:
        link = self.link
        if link is None:  # closed
            return False
        if link.attach_now() is None:
            log.warning("[sglang] kvcached daemon %s not attached for the %s pool (%s): its pages "
                        "miss until it is", self.instance, self.name,
                        link.last_error or "no daemon")
            return False
        log.info("[sglang] %s host pool (%s, %d pages) registered with kvcached daemon %s",
                 self.name, self.pool.layout, self.layout["num_blocks"], self.instance)
        return True

    def call(self, what: str, fn, miss):
        """fn(client), or `miss` when no daemon is attached or the call failed (never raises)."""
        link, b = self.link, self.backend
        with self._lock:
            client = link.refresh() if link is not None else None
            if client is None:
                b.stats["no_daemon"] += 1
                return miss
            self._calls[id(client)] = self._calls.get(id(client), 0) + 1
        try:
            return fn(client)
        except Exception as exc:  # never into SGLang's threads: a miss
            b.stats["errors"] += 1
            b._say(f"{what}:{type(exc).__name__}",
                   f"{what} failed, served as a miss: {type(exc).__name__}: {exc}")
            if isinstance(exc, DaemonUnavailable):
                with self._lock:
                    link.failed(exc)
            return miss
        finally:
            self._left(client)

    def _retire(self, client) -> None:
        """A client dropped (its daemon gone or hung) is closed once no call uses it: a load in
        another of SGLang's threads may be waiting for a hung daemon to end what it sent
        (_await_release), which only the open client can read - closed under it, that wait would
        last until the daemon's process ended, stalling SGLang's prefetches."""
        with self._lock:
            if self._calls.get(id(client)):
                self._retired.append(client)
                return
        client.close()

    def _left(self, client) -> None:
        with self._lock:
            n = self._calls.pop(id(client)) - 1
            if n:
                self._calls[id(client)] = n
            elif any(c is client for c in self._retired):
                self._retired.remove(client)
                client.close()

    # pages ---------------------------------------------------------------------------
    def lookup(self, hashes) -> int:
        """How many leading pages of `hashes` the daemon's tiers hold (0 without a daemon)."""
        host, storage = self.call("lookup", lambda c: c.lookup(self.keys(hashes)), (0, 0))
        return min(host + storage, len(hashes))

    def held(self, hashes) -> list[bool]:
        """Whether the daemon's tiers hold each page (for a pool that needs only a window of
        them: SGLang's TRAILING_PAGES); answered from the daemon's key table where it can."""
        def each(client):
            return [sum(client.lookup([k])) > 0 for k in self.keys(hashes)]
        return self.call("lookup", each, [False] * len(hashes))

    def load(self, hashes, host_indices) -> int:
        """Pages loaded into the pool at `host_indices`, a leading run (0 on any failure)."""
        return self.call("load", lambda c: self._load(c, hashes, host_indices), 0)

    def offload(self, hashes, host_indices, parent=None) -> int:
        """Pages stored from the pool at `host_indices`, a leading run (0 on any failure).
        `parent`: the hash of the page before hashes[0] (SGLang's prefix_keys, when it passes
        them), so the daemon's tiers keep the sequence's head before its tail."""
        return self.call("offload", lambda c: self._offload(c, hashes, host_indices, parent), 0)

    def _load(self, client, hashes, host_indices) -> int:
        pages = page_ids(host_indices, self.page_size, len(hashes))
        start = time.perf_counter()
        try:
            task = client.load(self.keys(hashes), pages)
        except (KvcachedTimeout, DaemonUnavailable) as exc:
            if getattr(exc, "unanswered", None) is not None:  # sent, unanswered: a daemon that
                self._await_release(client, exc.unanswered)   # wakes may still take it
            raise
        try:
            loaded = task.wait(self.backend.settings.timeout_s)
        except (KvcachedTimeout, DaemonUnavailable) as exc:  # timed out, or seen hung: held
            if getattr(exc, "held_blocks", None):  # while a daemon that wakes may still write
                self._await_release(client, task)
            raise
        self.backend._measured("prefetch", loaded, start, self.page_bytes)
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
        while not gone() and not self.backend._closing.is_set():
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

    def _offload(self, client, hashes, host_indices, parent=None) -> int:
        page_keys, b = self.keys, self.backend
        if b._old_pages:  # these may be pages of the old weights: not stored
            b.stats["old_weights_refused"] += len(hashes)
            return 0
        pages = page_ids(host_indices, self.page_size, len(hashes))
        start = time.perf_counter()
        parent = page_keys([parent])[0] if parent is not None else None
        task = client.offload(pages, page_keys(hashes), parent=parent)  # revoked if no reply comes
        try:
            task.wait(b.settings.timeout_s)
        except BaseException:
            client.revoke(task)  # whatever the daemon copied after this is discarded
            raise
        if task.status != TaskStatus.DONE:
            return 0
        accepted = int(task.reply.get("accepted", len(hashes)))
        b._measured("backup", accepted, start, self.page_bytes)
        return accepted

    def close(self) -> None:
        """Detach: the daemon unmaps the pool (unregister, then the connection goes)."""
        link, self.link = self.link, None
        if link is None:
            return
        with self._lock:  # no call can take a client from the link now
            retired, self._retired = self._retired, []
        for client in retired:  # (a call still in one fails: a miss)
            client.close()
        client = link.client
        if client is not None:
            try:
                client.unregister_kv_cache(timeout=min(self.backend.settings.timeout_s, 2.0))
            except Exception as exc:  # gone already: its KV mapping goes with the connection
                log.info("[sglang] unregister at close: %s", str(exc))
        link.close()
