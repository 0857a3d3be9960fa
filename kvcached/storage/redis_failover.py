"""How the Redis tier follows failovers (a mixin of RedisBackend, redis_store.py).

Replication is asynchronous: a primary that acknowledged deletes and clears may fail over before
its replica had them. At a failover the tier owes again what it did in the last REDO_WINDOW_S
(owed_clear.failed_over) and serves nothing until its probe has done that on the new primary.

A failover is seen three ways:
- behind Sentinel, the probe asks the sentinels for the primary every round;
- behind Sentinel, every new connection asks them too (a pooled connection the old primary
  dropped reconnects unseen as it is taken): one that finds a new primary before the probe
  fails, and a read or lookup that saw one (a worker's connect is retried once) serves nothing;
- in a cluster, the probe reads the cluster's current epoch (CLUSTER INFO, in place of its
  ping), which a failover raises; and after each read or lookup, the nodes its client takes for
  primaries are compared with those it took before: a new one (a MOVED reply followed to a
  promoted replica, a slot map refreshed) drops what that call found.

A change seen by a connection or a call is pending until the probe's next round has redone the
window: `_failover_pending` keeps the tier unusable until then.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__.rsplit(".", 1)[0] + ".redis_store")


class FollowsFailovers:
    """Needs `uri`, `counters`, `cluster`, `_redis`, `_probe_client`, `failed_over` (OwesClears),
    and `_start_following(pools, clients)` called once the clients exist."""

    def _start_following(self, pools, clients) -> None:
        self._primary_lock = threading.Lock()
        self._primary = None  # (host, port) the sentinels named last
        self._changes_seen = 0  # new primaries seen by connections, calls and the probe
        self._changes_done = 0  # of those, the ones the probe has redone the window for
        self._change_why = ""  # the last one's
        self._change_restart = False  # one since the last redo was a restart (redis_restarts.py)
        self._from_record = False  # a change now may have come while no daemon ran (_restored)
        self._epoch = -1  # a cluster's current epoch, the highest seen (None: not followed)
        self._ask_primary = [self._watch_primary(pool) for pool in pools]
        self._clients = clients
        self._primaries = {id(c): self._primaries_of(c) for c in clients} if self.cluster else {}
        self._redone_for = frozenset()  # (a cluster) the primaries known when the window was last redone

    def _failover_pending(self) -> bool:
        return self._changes_seen != self._changes_done

    def _changed_since(self, seen: int, client) -> bool:
        """(After a read or lookup begun when `_changes_seen` was `seen`.) True where a new
        primary was seen meanwhile, by this call (a cluster client's slot map; a connection
        that asked the sentinels and was retried) or another: what it found is dropped."""
        if self.cluster:
            self._moved(client)
        return self._changes_seen != seen

    def _note_change(self, why: str, restart: bool = False) -> None:
        """(_primary_lock held.) A new primary, or a restarted server, seen: pending until the
        probe's round has redone the window (a restart's reaches back to the server's last
        snapshot, a failover's REDO_WINDOW_S)."""
        self._changes_seen += 1
        self._change_why = why
        self._change_restart |= restart or self._from_record

    def _follow(self) -> bool:
        """(The probe.) Follow the cluster's epoch, or the sentinels and the server's run_id
        (redis_restarts.py); redo the window for what was seen since the last round. True
        where the server answered (the probe's ping)."""
        if self.cluster:
            answered = self._follow_epoch()
            self._follow_nodes()
        else:
            if self._ask_primary:
                self._new_primary(self._ask_primary[0]())
            answered = self._follow_server()
        with self._primary_lock:
            seen, restart, self._change_restart = self._changes_seen, self._change_restart, False
        if seen != self._changes_done:
            for ask in self._ask_primary[1:]:  # (each pool drops its idle connections to an
                ask()                          # old primary: get_master_address does on a change)
            now = time.monotonic()
            self.failed_over(self._change_why, since=self._keep_since(now) if restart else None)
            if self.cluster:
                self._redone_for = self._primaries_now()
            self._changes_done = seen
        if answered:
            self._from_record = False  # (compared with what the last daemon kept)
        return answered

    # Sentinel

    def _watch_primary(self, pool):
        """Route `pool`'s question (where is the primary?) through _new_primary; a connection
        that finds a new one fails. Returns the pool's own question, unwatched."""
        asked = getattr(pool, "proxy", pool)  # (redis-py 5+: what its connections ask)
        ask = asked.get_master_address

        def get_master_address():
            primary = ask()
            if self._new_primary(primary):
                raise self._redis.ConnectionError(
                    "the sentinels name a new primary, %s:%s: the tier waits for its probe" % primary)
            return primary
        asked.get_master_address = get_master_address
        return ask

    def _new_primary(self, primary) -> bool:
        """Note the primary the sentinels named; True where it replaced another (a failover)."""
        with self._primary_lock:
            old, self._primary = self._primary, primary
            if old == primary:
                return False
            if old is not None:
                self.counters["failovers"] += 1
                self._note_change("the sentinels named a new primary, %s:%s" % primary)
                self._run_ids.pop("", None)  # (another server's: redis_restarts.py)
                self._saved.pop("", None)
        self._remember()  # (a later daemon compares)
        if old is None:
            return False
        log.warning("[redis] %s: the sentinels name a new primary, %s:%s (was %s:%s)",
                    self.uri, *primary, *old)
        return True

    # a cluster

    def _primaries_of(self, client) -> frozenset:
        primary = self._redis.cluster.PRIMARY
        return frozenset(name for name, node in list(client.nodes_manager.nodes_cache.items())
                         if node.server_type == primary)

    def _moved(self, client) -> bool:
        """(A cluster, after a call.) True where the client now takes a node for a primary that
        it did not before the call: what the call found may come from a promoted replica that
        missed a delete; the change is pending until the probe's round."""
        now = self._primaries_of(client)
        with self._primary_lock:
            before, self._primaries[id(client)] = self._primaries.get(id(client), now), now
            new = now - before - self._redone_for
            if not new:
                return False
            self._note_change("a slot moved to a new primary (%s)" % ", ".join(sorted(new)))
        log.warning("[redis] %s: a slot moved to a new primary (%s); the tier waits for its probe",
                    self.uri, ", ".join(sorted(new)))
        return True

    def _primaries_now(self) -> frozenset:
        """(The probe, the window redone.) The primaries the probed node names (CLUSTER NODES;
        refused to an ACL user without it: those the clients take): a client that follows a
        slot to one of them later finds no new primary (the window was redone with it in place)."""
        try:
            nodes = self._probe_client.execute_command("CLUSTER NODES")
        except self._redis.RedisError:
            return frozenset().union(*(self._primaries_of(c) for c in self._clients))
        if isinstance(nodes, bytes):
            nodes = nodes.decode()
        if isinstance(nodes, str):
            nodes = {f[1]: {"flags": f[2]} for f in map(str.split, nodes.splitlines()) if len(f) > 2}
        return frozenset(addr.split("@")[0] for addr, node in nodes.items()
                         if "master" in str(node.get("flags", "")) and "fail" not in str(node.get("flags", "")))

    def _follow_epoch(self) -> bool:
        """(The probe; a cluster.) Ask a node for the cluster's current epoch (which answers
        as a ping does): a failover raises it. A node that has not heard of a raise yet answers
        lower: only the highest counts. False where the server refuses CLUSTER INFO (an ACL
        user without it): said once, failovers are not followed, the probe pings."""
        if self._epoch is None:
            return False
        try:
            info = self._probe_client.execute_command("CLUSTER INFO")
        except self._redis.ResponseError as exc:
            log.warning("[redis] %s: CLUSTER INFO refused (%s): a failover is not seen, and deletes "
                        "and clears the old primary lost are not done again", self.uri, str(exc))
            self._epoch = None
            return False
        if isinstance(info, bytes):
            info = info.decode()
        if isinstance(info, str):
            info = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        epoch = int(info["cluster_current_epoch"])
        if epoch > self._epoch >= 0:
            log.warning("[redis] %s: the cluster's epoch rose to %d (from %d): a failover or a new "
                        "configuration", self.uri, epoch, self._epoch)
            with self._primary_lock:
                self.counters["failovers"] += 1
                self._note_change(f"the cluster's epoch rose to {epoch} (a failover or a new configuration)")
        if epoch > self._epoch:
            self._epoch = epoch
            self._remember()  # (a later daemon compares)
        return True
