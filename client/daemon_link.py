"""Links from an engine's parts to their daemons that never wait for a daemon.

`DaemonLink` holds one connection (a rank's Client, or the GroupClient a PrefixCacheManager
drives), attached in the background (Reattacher), and answers `get()` at once: a caller that
finds no daemon treats it as a miss or a skipped save, so a daemon fault costs the cache, never
the engine's step. Used by the vLLM connector, its vLLM-free worker core (kv_worker.py),
PrefixCacheManager and each rank of a GroupClient (whose GroupLink is the vLLM scheduler's
view of every rank, group.py).
"""
from __future__ import annotations

import logging

from kvcached_proto.errors import DaemonUnavailable

from .client import Client
from .reattach import Reattacher, usable

log = logging.getLogger(__name__)


class DaemonLink:
    """The one holder of an engine part's daemon connection: the client in use (a Client, or a
    GroupClient), the Reattacher that prepares a successor in the background, and what becomes
    of a client that is dropped. get() answers at once, with the client or None (no daemon: a
    miss, a skipped save), and never waits for a daemon."""

    def __init__(self, instance: str | None = None, run_dir: str | None = None, timeout: float = 5.0,
                 name: str = "kvcached", on_connect=None, hang_s: float | None = None, retire=None,
                 connect=None, on_adopt=None, on_drop=None):
        """connect(): a new connection (default: Client.connect to `instance`; neither: no
        daemon ever). on_connect(client): what a new connection gets before it is used (the KV
        registered). retire(client): what becomes of a dropped client (default: closed; a
        HoldKeeper keeps one whose holds hold until they lift). on_adopt(client) and
        on_drop(client, exc): the owner's bookkeeping when a client is taken into use, or
        dropped because its daemon failed."""
        self.name = name
        self.args = dict(instance=instance, run_dir=run_dir, timeout=timeout, name=name, hang_s=hang_s)
        if connect is None and instance is not None:
            connect = lambda: Client.connect(**self.args)  # noqa: E731
        self.client = None
        self._on_connect, self._retire = on_connect, retire
        self._on_adopt, self._on_drop = on_adopt, on_drop
        self._reattach = Reattacher(connect, on_connect, name=name) if connect is not None else None

    def get(self):
        """The client in use, dropped first if its daemon is gone or hung (a status-block check,
        ~30 us here); else one the background made ready; else None."""
        return self._current(check=True)

    def refresh(self):
        """get() for a hot path: the client in use is checked only when the background has a
        successor ready - its watcher looks at the daemon every REATTACH_EVERY_S and prepares
        one when the daemon is gone or hung; a call on a dead daemon meanwhile fails, and the
        owner drops the client then."""
        return self._current(check=self.has_ready())

    def _current(self, check: bool):
        if self.client is not None and check:
            gone = _gone(self.client)
            if gone is not None:
                log.info("[%s] daemon went away: %s", self.name, str(gone))
                self.drop(gone)
        if self.client is None and self._reattach is not None:
            client = self._reattach.take()
            if client is not None:
                self.adopt(client, prepared=True)
        return self.client

    def adopt(self, client, prepared: bool = False) -> None:
        """Take `client` into use now, on this thread (on_connect first unless it was)."""
        if not prepared and self._on_connect is not None:
            self._on_connect(client)
        self.client = client
        log.info("[%s] attached to kvcached (epoch %s)", self.name, getattr(client, "epoch", "?"))
        if self._on_adopt is not None:
            self._on_adopt(client)

    def watch(self) -> None:
        """From now on a thread watches the daemon and prepares a successor's connection."""
        if self._reattach is not None:
            self._reattach.watch(lambda: self.client)

    def attach_now(self):
        """One attempt on this thread when no client is in use (a daemon that is up is attached
        at once), then watch."""
        if self.client is None and self._reattach is not None:
            client = self._reattach.attach_now()
            if client is not None:
                self.adopt(client, prepared=True)
        self.watch()
        return self.client

    @property
    def last_error(self) -> str:
        """Why the last attempt to attach failed ("" after one succeeded)."""
        return self._reattach.last_error if self._reattach is not None else ""

    def has_ready(self) -> bool:
        """The background has a successor's connection ready."""
        return self._reattach is not None and self._reattach.has_ready()

    def drop(self, exc: Exception) -> None:
        """The daemon failed (gone, hung): the owner's on_drop, then the client retires. During
        on_drop the client is still the one in use, so blocks it holds there and the owner
        frees count as held."""
        client = self.client
        if client is None:
            return
        if self._on_drop is not None:
            self._on_drop(client, exc)
        self.client = None
        (self._retire or Client.close)(client)

    def failed(self, exc: Exception) -> None:
        log.warning("[%s] kvcached call failed, going on without it: %s", self.name, str(exc))
        if isinstance(exc, DaemonUnavailable):
            self.drop(exc)

    def close(self) -> None:
        """No more attempts; the client in use retires (no on_drop: nothing failed)."""
        if self._reattach is not None:
            self._reattach.close()
        client, self.client = self.client, None
        if client is not None:
            (self._retire or Client.close)(client)


def _gone(client) -> Exception | None:
    """Why `client`'s daemon is of no use (gone, stopping, hung), or None."""
    if isinstance(client, Client):
        if client.status_block is None:
            return DaemonUnavailable("the client is closed")
        try:
            client.status_block.check_alive()
        except DaemonUnavailable as exc:
            return exc
        return None
    return None if usable(client) else DaemonUnavailable("the daemon is gone")
