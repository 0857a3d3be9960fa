"""A Redis server that restarted (one server, the primary behind Sentinel, or a primary of a
cluster that restarted in place, before any replica took over): a mixin of RedisBackend
(redis_store.py), beside redis_failover.py.

A server restarted from its persistence comes back with what it last made durable: with RDB
snapshots only (Redis's default), its last snapshot, which may be an hour old; with an
append-only file, all but its last second or so. The deletes and clears the tier did since are
undone, and their blocks come back. The tier knows a restart by the server's run_id (INFO
server), read by the probe every round (of each primary, in a cluster) and by every new
connection (a pooled connection the restart dropped reconnects unseen as it is taken: one that
finds another run_id fails, and a read or lookup during which one was seen serves nothing), and
treats it as a failover: what the restart may have undone is owed again, and the tier serves
nothing until its probe has done it. A node is known by its address ("" for the one server):
a node first seen (a promoted replica, a node added) is no restart.

What a restart may undo (`_keep_since`): the probe reads INFO persistence every round. With the
append-only file on, the failover window (REDO_WINDOW_S). Without it, everything since the last
snapshot: a save that completed between two rounds holds what was done before the earlier
round, less the save's own duration (a background save's snapshot is taken as it starts);
until the tier has seen a save, everything it did. In a cluster, the oldest of its primaries'.
Kept up to MAX_OWED_DELETES keys, then as a clear. A server without persistence comes back
empty: redoing is harmless there.

A user refused INFO (an ACL) is told once that restarts are not followed; the probe pings.
"""
from __future__ import annotations

import logging
import math
import time

from .owed_clear import REDO_WINDOW_S

log = logging.getLogger(__name__.rsplit(".", 1)[0] + ".redis_store")


class FollowsRestarts:
    """Needs `uri`, `counters` (with "restarts"), `cluster`, `_redis`, `_probe_client`,
    `_primary_lock` and `_note_change` (redis_failover.py); `_start_restarts()` is called
    before any connection is made, and `_on_connect` (`_on_node_connect` in a cluster, whose
    client has made the handshake) is every connection's connect function."""

    def _start_restarts(self) -> None:
        # node -> its run_id as last read (none: not known yet, or a new primary)
        self._run_ids: dict[str, str] = {}
        self._saved: dict = {}  # node -> (its rdb_last_save_time, when it was asked for it)
        self._started = time.monotonic()
        self._unanswered: set[str] = set()  # the primaries the probe's last round could not read
        # node -> done before this (monotonic) is in its persistence (inf: the append-only file)
        self._durable: dict[str, float] = {}
        self._info_refused = False

    @property
    def _durable_at(self) -> float:
        """Done before this is in every node's persistence (those not read yet: since start)."""
        return min(self._durable.values(), default=self._started)

    def _keep_since(self, now: float) -> float:
        """What is kept (owed_clear._done), and what a restart redoes: since the server's last
        snapshot, and at least the failover window (a failover redoes that alone: a clear done
        days ago on a server that never saves is not owed again at every failover)."""
        return min(now - REDO_WINDOW_S, self._durable_at)

    def _on_connect(self, conn) -> None:
        """(Every new connection, in place of its handshake.) The handshake, then the
        server's run_id: another than the one known is a restart, and the connection fails."""
        conn.on_connect()
        self._check_run_id(conn, "")

    def _on_node_connect(self, conn) -> None:
        """(A cluster's every new connection, after its handshake.) As _on_connect, of its node."""
        self._check_run_id(conn, f"{conn.host}:{conn.port}")

    def _check_run_id(self, conn, node: str) -> None:
        if node not in self._run_ids or self._info_refused:
            return
        try:
            conn.send_command("INFO", "server")
            text = conn.read_response()
        except self._redis.ResponseError:
            return  # (refused: the probe says so)
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        run_id = next((line.split(":", 1)[1].strip() for line in str(text).splitlines()
                       if line.startswith("run_id:")), None)
        if run_id is not None and self._restarted(run_id, node):
            raise self._redis.ConnectionError("the server restarted (a new run_id): the tier waits for its probe")

    def _restarted(self, run_id: str, node: str = "") -> bool:
        """Note a node's run_id; True where it replaced another (a restart)."""
        server = f"the node {node}" if node else "the server"
        with self._primary_lock:
            old = self._run_ids.get(node)
            if old == run_id:
                return False
            self._run_ids[node] = run_id
            if old is not None:
                self.counters["restarts"] += 1
                self._note_change(f"{server} restarted (run_id {run_id[:12]}, was {old[:12]}): what "
                                  "it did not make durable is lost", restart=True)
        self._remember()  # (a later daemon compares)
        if old is None:
            return False
        log.warning("[redis] %s: %s restarted (a new run_id): the deletes and clears it may "
                    "have lost are done again before the tier serves", self.uri, server)
        return True

    # across daemons -------------------------------------------------------------------------
    def _state(self) -> dict:
        """What a later daemon compares: each node's run_id, the sentinels' primary, the
        cluster's epoch (and the deletes and clears done lately: owed_clear.py)."""
        return {**super()._state(), "run_ids": dict(self._run_ids),
                "primary": list(self._primary) if self._primary else None, "epoch": self._epoch}

    def _restored(self, state: dict) -> float | None:
        """(At start.) The last daemon's state: its deletes and clears done lately are kept until
        a snapshot after them is seen; a node's other run_id, another primary, a higher epoch
        happened while no daemon followed: what it may have undone is redone before serving."""
        oldest = super()._restored(state)
        if oldest is not None:
            self._started = min(self._started, oldest)
            self._durable = {node: at if at == math.inf else min(at, oldest)  # (inf: a restart
                             for node, at in self._durable.items()}  # undoes the window at most)
        seen, primary, epoch = [], state.get("primary"), state.get("epoch")
        with self._primary_lock:
            for node, run_id in dict(state.get("run_ids") or {}).items():
                if self._run_ids.setdefault(str(node), str(run_id)) != str(run_id):
                    seen.append(f"the node {node} restarted" if node else "the server restarted")
                    self.counters["restarts"] += 1
            if isinstance(primary, list) and len(primary) == 2:
                if self._primary is None:
                    self._primary = tuple(primary)  # (the probe compares)
                elif tuple(primary) != tuple(self._primary):
                    seen.append("the sentinels named a new primary, %s:%s" % self._primary)
                    self.counters["failovers"] += 1
            if isinstance(epoch, int) and self._epoch is not None:
                if self._epoch > epoch >= 0:
                    seen.append(f"the cluster's epoch rose to {self._epoch} (from {epoch})")
                    self.counters["failovers"] += 1
                self._epoch = max(self._epoch, epoch)
            if seen:
                self._note_change(f"while no daemon followed the store, {'; '.join(seen)}: what was "
                                  "done before may be undone", restart=True)
            # what could not be compared yet (a store that did not answer) is at the probe's first
            # round that it answers: a change found then may be older than the window too
            self._from_record = bool(state)
        if seen:
            log.warning("[redis] %s: while no daemon followed it, %s: the deletes and clears done "
                        "before are done again before the tier serves", self.uri, "; ".join(seen))
        return oldest

    def _follow_nodes(self) -> None:
        """(The probe; a cluster.) Each primary's run_id and persistence. One that does not
        answer is skipped, said once (its connections see its restart; a later round reads
        it, and a save it finds done is bounded by this node's last reading, not the round's)."""
        if self._info_refused:
            return
        for node in self._probe_client.get_primaries():
            now = time.monotonic()
            try:
                server = self._probe_client.info("server", target_nodes=node)
                persistence = self._probe_client.info("persistence", target_nodes=node)
            except self._redis.ResponseError as exc:
                self._refused_info(exc)
                return
            except self._redis.RedisError as exc:
                if node.name not in self._unanswered:
                    self._unanswered.add(node.name)
                    log.warning("[redis] %s: the primary %s does not answer the probe (%s): its "
                                "restart is seen when it answers", self.uri, node.name, exc)
                continue
            if node.name in self._unanswered:
                self._unanswered.discard(node.name)
                log.info("[redis] %s: the primary %s answers the probe again", self.uri, node.name)
            self._follow_node(node.name, server, persistence, now)

    def _follow_server(self) -> bool:
        """(The probe; a server or Sentinel's primary.) Read the server's run_id and
        persistence (which answers as a ping does). False where INFO is refused: said once,
        restarts are not followed, the probe pings."""
        if self._info_refused:
            return False
        now = time.monotonic()  # (before the reading: what it says was so then, or later)
        try:
            server = self._probe_client.info("server")
            persistence = self._probe_client.info("persistence")
        except self._redis.ResponseError as exc:
            self._refused_info(exc)
            return False
        self._follow_node("", server, persistence, now)
        return True

    def _refused_info(self, exc) -> None:
        log.warning("[redis] %s: INFO refused (%s): a restart is not seen, and the deletes and "
                    "clears it undoes are not done again", self.uri, str(exc))
        self._info_refused = True
        self._durable = {"": math.inf}

    def _follow_node(self, node: str, server: dict, persistence: dict, now: float) -> None:
        """A node's reading, asked at `now`: a save found completed since its last reading
        (at `read`) began at `read` - its duration at the earliest, so what was done before
        that is in it."""
        restarted = self._restarted(str(server.get("run_id", "")), node)
        saved = persistence.get("rdb_last_save_time")
        was, read = self._saved.get(node, (None, now))
        self._saved[node] = (saved, now)
        durable = self._durable.get(node, self._started)
        if persistence.get("aof_enabled"):
            durable = math.inf
        elif durable == math.inf:
            durable = now  # (the append-only file turned off: kept from now)
        elif not restarted and was is not None and saved != was:  # a save completed since
            took = max(0, int(persistence.get("rdb_last_bgsave_time_sec", 0) or 0))
            durable = max(durable, read - took - 1.0)
        self._durable[node] = durable
