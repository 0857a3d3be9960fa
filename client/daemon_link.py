"""Links from an engine's connector to its daemons that never wait for a daemon.

`DaemonLink` holds one rank's Client, attached in the background (Reattacher); `GroupLink` the
scheduler's view of every rank (a GroupClient). Both answer `get()` at once, and a caller that
finds no daemon treats it as a miss or a skipped save: a daemon fault costs the cache, never
the engine's step. Used by the vLLM connector and its vLLM-free worker core (kv_worker.py).
"""
from __future__ import annotations

import logging

from kvcached_proto.errors import DaemonUnavailable

from .client import Client
from .group import GroupClient
from .reattach import Reattacher

log = logging.getLogger(__name__)


class DaemonLink:
    """A Client attached in the background (Reattacher): get() answers at once, with the
    client or None (no daemon: a miss, a skipped save), and never waits for a daemon."""

    def __init__(self, instance: str, run_dir: str | None, timeout: float, name: str,
                 on_connect=None, hang_s: float | None = None, retire=None):
        """retire(client): what becomes of a dropped client (default: closed); the worker's
        FenceKeeper keeps one whose fences hold until they lift."""
        self.args = dict(instance=instance, run_dir=run_dir, timeout=timeout, name=name,
                         hang_s=hang_s)
        self.client: Client | None = None
        self._retire = retire
        self._reattach = Reattacher(lambda: Client.connect(**self.args), on_connect,
                                    name=name)

    def get(self) -> Client | None:
        if self.client is not None:
            try:
                self.client.status_block.check_alive()  # shared memory: cheap, and sees a restart
            except (DaemonUnavailable, AttributeError) as exc:
                log.info("[vllm] daemon %s went away: %s", self.args["instance"], str(exc))
                self._drop()
        if self.client is None:
            self._adopt(self._reattach.take())
        return self.client

    def attach_now(self) -> Client | None:
        """At set-up: one attempt on this thread (a daemon that is up is attached at once);
        from then on a thread watches the daemon and prepares a successor's connection."""
        if self.client is None:
            self._adopt(self._reattach.attach_now())
        self._reattach.watch(lambda: self.client)
        return self.client

    def _adopt(self, client: Client | None) -> None:
        if client is not None:
            self.client = client
            log.info("[vllm] connected to kvcached %s", self.args["instance"])

    def _drop(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            (self._retire or Client.close)(client)

    def failed(self, exc: Exception) -> None:
        log.warning("[vllm] kvcached call failed, going on without it: %s", str(exc))
        if isinstance(exc, DaemonUnavailable):
            self._drop()

    def close(self) -> None:
        self._reattach.close()
        self._drop()


class GroupLink:
    """The scheduler's view of every rank's daemon: a GroupClient, which reattaches missing
    ranks in the background and answers 0 hits while one is missing."""

    def __init__(self, instances: list[str], run_dir: str | None, timeout: float, name: str,
                 mla: bool, hang_s: float | None = None):
        self.client = GroupClient(instances, run_dir=run_dir, timeout=timeout, name=name, mla=mla,
                                  hang_s=hang_s)

    def attach_now(self) -> GroupClient:
        self.client.reconnect()
        return self.client

    def get(self) -> GroupClient:
        return self.client

    def failed(self, exc: Exception) -> None:
        log.warning("[vllm] kvcached group call failed, going on without it: %s", str(exc))

    def close(self) -> None:
        self.client.close()
