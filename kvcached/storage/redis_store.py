"""The Redis / Valkey tier (optional extra `kvcached-sidecar[redis]`): one value per block, pipelined.

    redis://[[user]:password@]host:port/db[?prefix=P&ttl_s=N]        one server
    rediss://...[&ca=/path/ca.pem]                                     the same over TLS
    redis+cluster://[[user]:password@]host:port[?prefix=P&ttl_s=N]   a cluster (any node as
    rediss+cluster://...                                               the entry point), or over TLS
    redis+sentinel://[[user]:password@]host:port[,host:port...]/db?service=NAME[&sentinel_auth=1]
    rediss+sentinel://...                          a primary the sentinels name (and replicas)

With sentinels, every new connection asks them where the primary is: after a failover the tier
reaches the promoted replica (the connections to the old primary fail once, or are refused as
READONLY, and the probe's next ping finds the new one). The user and password are the data
nodes'; sentinel_auth=1 sends them to the sentinels too (sentinels with requirepass). A
sentinel's port is 26379 unless given.

Replication is asynchronous, so an old primary may have acknowledged deletes and clears its
replica never had: at a failover (behind Sentinel, the probe finds a new primary; in a cluster,
the cluster's current epoch rose) the tier does again the deletes and clears it did in the last
REDO_WINDOW_S before it serves (owed_clear.py). A new primary a connection or a call finds before
the probe does serves nothing either: the tier waits for the probe (redis_failover.py). A server
that restarted (a new run_id) is a failover too, and may undo everything since its last snapshot
(redis_restarts.py).

The password is used to authenticate (AUTH, with the user for an ACL user) and shown nowhere:
status, metrics and logs carry the URI with it replaced by *** (uris.redact).

Keys are `{prefix}{stored key hex}`; values are record.py records (header with a checksum, then the
page), read with GETRANGE to one byte past a record: a value that is no record (too long, another
type) is that key's bad record, deleted, whatever another writer put there. A server that
stops answering marks the tier unhealthy: lookups see 0 hits, puts are dropped and counted,
until it answers again.

A clear the server cannot do now (it is down, or fails midway) is owed: until a probe finds the
server answering and the clear is done, the tier is unhealthy - no hits, puts dropped - so no
block stored before a clear (a weight update's old KV) is read after it.

A command the server refuses (a full server's OOM on SET, a READONLY replica) fails the puts it
was for, counted as `put_errors`, as does a record longer than the server's proto-max-bulk-len
(which resets the connection of such a SET: the probe reads it with CONFIG GET once the server
answers, and again the round after a record was over it, so a limit raised meanwhile is seen);
only a connection that fails or times out marks the tier down - except a backup whose SET times out: writes are held (`writes_held`), backups are dropped
(counted) for HOLD_WRITES_S and then tried again, and the tier stays up for lookups and reads.
That is a server whose writes are paused (CLIENT PAUSE WRITE: a failover's last seconds, while
the replica catches up); a server that hangs altogether fails the probe's ping and goes down.
The lookup script is flagged `no-writes` (Redis 7, Valkey): a write pause does not hold it, and
a read-only replica runs it. A server that refuses the flag (Redis 6) gets it without; one that
refuses scripts gets one EXISTS per key. A probe thread pings the server every PROBE_EVERY_S on its own connection, whether the daemon
is busy or idle, so status shows a server gone (or back) within PROBE_EVERY_S +
PROBE_TIMEOUT_S. Lookups run on the daemon's request thread (one request asks for at most
`lookup_keys` keys, tiers.py): their connection has a short
timeout (LOOKUP_TIMEOUT_S) and no retries, so a server that dies or is blackholed costs one
request at most that long, and lookups skip the tier from then on. (redis-py's default retries
with backoff would take ~4 s.) Fetches and backups run on storage worker threads with the
longer SOCKET_TIMEOUT_S and one quick retry.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Sequence

from .base import StorageBackend, prefix_walk
from .owed_clear import OwesClears
from .redis_failover import FollowsFailovers
from .redis_restarts import FollowsRestarts
from .record import HEADER_BYTES, BadRecord, hex_names, nbytes, pack_header, scatter, verify
from .uris import parse_redis_uri, redact

log = logging.getLogger(__name__)

PROBE_EVERY_S = 0.5
PROBE_TIMEOUT_S = 0.25
SOCKET_TIMEOUT_S = 1.0
LOOKUP_TIMEOUT_S = 0.25
WORKER_RETRY_BACKOFF_S = 0.05
# A lookup's presence check in one command with a one-integer reply: the leading keys present.
# (A pipeline of one EXISTS per key costs the request thread a command and a reply per key.)
PREFIX_SCRIPT = """#!lua flags=no-writes
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 0 then break end
  n = n + 1
end
return n
"""
SCRIPT_KEYS = 1024  # keys per script call: a script holds the server for its whole run
HOLD_WRITES_S = 1.0  # backups dropped after a SET timed out, before the next is tried
MAX_ERROR_CHARS = 300  # of an error shown in status and the log


class RedisBackend(FollowsFailovers, FollowsRestarts, OwesClears, StorageBackend):
    _LOG_TAG = "redis"

    def __init__(self, uri: str):
        try:
            import redis
            import redis.cluster
            import redis.sentinel
        except ImportError:
            raise ValueError(f"{uri!r}: the redis tier needs redis-py: pip install "
                             "'kvcached-sidecar[redis]'") from None
        self._redis = redis
        opts = parse_redis_uri(uri)
        self.uri = redact(uri)
        self.cluster = opts["cluster"]
        self.prefix, self.ttl_s, self.lookup_keys = opts["prefix"], opts["ttl_s"], opts["lookup_keys"]
        host, port, db, sentinels = opts["host"], opts["port"], opts["db"], opts["sentinels"]
        self._sentinels = ",".join(sorted(f"{h}:{p}" for h, p in sentinels or ()))  # (any order: one store)
        where = f"{opts['service']}@{self._sentinels}" if sentinels else f"{host}:{port}"
        kind = "-cluster" if self.cluster else "-sentinel" if sentinels else ""
        self._store_id = (f"redis{kind}://{where}/{db}"
                          f"?prefix={self.prefix.decode(errors='replace')}")  # (owed_clear.py)
        self._start_restarts()  # (before any connection: each reads the server's run_id)
        connect = _connector(redis, opts, self._on_node_connect if self.cluster else self._on_connect)
        self._healthy = True
        self._clear_lock = threading.Lock()  # owed_clear.py: a clear the server has not done
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.counters = {"puts": 0, "gets": 0, "dropped_puts": 0, "errors": 0, "corrupt": 0,
                         "put_errors": 0, "write_timeouts": 0, "failovers": 0, "restarts": 0,
                         "lookups_cut": 0}
        self._refusal_said = ""  # the last refusal logged (a full server refuses every SET alike)
        self._writes_held_until = 0.0  # monotonic: backups are dropped until then (a write pause)
        self._max_value: int | None = None  # the server's proto-max-bulk-len (None: not known)
        self._max_value_asked = False  # since the server was last down (a restart may change it)
        self.last_error = ""
        self._client = connect(SOCKET_TIMEOUT_S, 1)
        self._lookup_client = connect(LOOKUP_TIMEOUT_S, 0)
        # a cluster's keys lie in different slots, which one script may not touch: pipelined
        # The flag first, without it where the server refuses it (Redis 6 cannot compile it).
        # Sent whole (EVAL), never loaded: SCRIPT LOAD waits out a write pause, and a server
        # after a failover or a restart has no script loaded.
        self._prefix_scripts = [] if self.cluster else [PREFIX_SCRIPT, PREFIX_SCRIPT.split("\n", 1)[1]]
        self._probe_client = connect(PROBE_TIMEOUT_S, 0)
        # a failover: followed by the probe, and seen by new connections and calls (redis_failover.py)
        clients = (self._probe_client, self._client, self._lookup_client)
        self._start_following([c.connection_pool for c in clients] if sentinels else [], clients)
        # a failover or a restart may lose the deletes and clears done lately (owed_clear.py)
        self._done_lately = collections.deque()
        self._probe_once()
        self._prober = threading.Thread(target=self._probe, name="kvcached-redis-probe", daemon=True)
        self._prober.start()

    def _name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def _failed(self, exc: Exception) -> None:
        self.counters["errors"] += 1
        text = str(exc)
        if isinstance(exc, self._redis.sentinel.MasterNotFoundError):  # (its text: every
            text = f"no sentinel of {self._sentinels} names a primary for the service"  # client's repr)
        self.last_error = f"{type(exc).__name__}: {text}"[:MAX_ERROR_CHARS]
        with self._lock:
            if self._healthy:
                log.warning("[redis] %s unhealthy: %s", self.uri, self.last_error)
            self._healthy = False
        self._max_value_asked = False

    def _probe(self) -> None:
        while not self._closed.wait(PROBE_EVERY_S):
            self._probe_once()

    def _probe_once(self) -> None:
        try:
            if not self._follow():
                self._probe_client.ping()
        except Exception as exc:  # any failure: the tier is down until a ping answers
            self._failed(exc)
            return
        if not self._max_value_asked:
            self._ask_max_value()
        if self._owes() and not self._owed_now():
            return  # down until its owed clear and deletes are done
        with self._lock:
            back, self._healthy = not self._healthy, True
        if back:
            log.info("[redis] %s healthy again", self.uri)

    def _usable(self) -> bool:
        return self._healthy and not self._owes() and not self._failover_pending()

    def health(self) -> bool:
        """The last known state: an operation or a probe that fails marks the tier down, a
        probe that answers marks it up again (no call here waits on the server); a clear the
        server has not done yet keeps it down."""
        return self._usable()

    def _per_key(self, command: str, keys, client=None, args=None) -> list | None:
        """One pipelined command per key (with args[i] after the i-th key's name); None when
        the store is unusable or fails. A value of another type under a key (WRONGTYPE) is
        that key's ResponseError in the list: one planted value fails no other key, nor the
        tier."""
        if not keys or not self._usable():
            return None
        client, seen = client or self._client, self._changes_seen
        try:
            pipe = client.pipeline(transaction=False)
            for i, name in enumerate(hex_names(keys, self.prefix)):
                getattr(pipe, command)(name, *(args[i] if args else ()))
            got = pipe.execute(raise_on_error=False)
            failed = next((r for r in got if isinstance(r, Exception) and not _wrong_type(r)), None)
            if failed is not None:
                raise failed
            return None if self._changed_since(seen, client) else got
        except self._redis.RedisError as exc:
            self._failed(exc)
            return None

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """On the request thread: the lookup connection (short timeout, no retry)."""
        seen = self._changes_seen
        while self._prefix_scripts and keys and self._usable():
            try:
                n = self._script_prefix(self._prefix_scripts[0], keys)
                return 0 if self._changed_since(seen, self._lookup_client) else n
            except self._redis.exceptions.ResponseError as exc:
                refused = _refusal(exc)
                if refused is None:  # passing (BUSY: another client's script): this lookup
                    break  # pipelines EXISTS, the next tries the script again
                if refused == "flag" and len(self._prefix_scripts) > 1:  # Redis 6
                    self._prefix_scripts.pop(0)
                    log.info("[redis] %s: the no-writes flag is refused (%s); the lookup script "
                             "runs without it", self.uri, str(exc))
                    continue
                self._prefix_scripts = []  # scripts refused (an ACL, a managed service)
                log.warning("[redis] %s: the lookup script is refused (%s); lookups pipeline "
                            "one EXISTS per key from now on", self.uri, str(exc))
            except self._redis.RedisError as exc:
                self._failed(exc)
                return 0
        return prefix_walk(keys, SCRIPT_KEYS, self._exists_part) or 0

    def _exists_part(self, part: Sequence[bytes]) -> int | None:
        found = self._per_key("exists", part, self._lookup_client)
        return None if found is None else next((i for i, hit in enumerate(found) if not hit), len(found))

    def _script_prefix(self, script: str, keys: Sequence[bytes]) -> int:
        """The leading keys present, SCRIPT_KEYS per call (a 65,536-key lookup in one call
        would keep every other client of the server waiting while it runs)."""
        def part_prefix(part: Sequence[bytes]) -> int:
            return int(self._lookup_client.eval(script, len(part), *hex_names(part, self.prefix)))
        return prefix_walk(keys, SCRIPT_KEYS, part_prefix)

    def get_into(self, keys, buffers, geometry, release=None) -> list[bool]:
        """Synchronous: bounded by the socket timeout, never late (release is not called)."""
        # GETRANGE to one byte past a record's length, not GET: a longer value (planted, or
        # another writer's under the prefix) is read no further (16 planted 64 MiB values took
        # a GET 9 s and 2.1 GiB of daemon memory), and shows as too long
        values = self._per_key("getrange", keys, args=[(0, HEADER_BYTES + nbytes(p)) for p in buffers])
        if values is None:
            return [False] * len(keys)
        out = []
        for key, pieces, value in zip(keys, buffers, values):
            if not value:  # (GETRANGE of a missing key: b"")
                out.append(False)
                continue
            try:
                if isinstance(value, Exception):
                    raise BadRecord(f"not a string value ({value})")
                verify(value, key, nbytes(pieces), geometry)
            except BadRecord as exc:
                log.warning("[redis] %s: %s; deleted", key.hex(), str(exc))
                self.counters["corrupt"] += 1
                self.delete([key])
                out.append(False)
                continue
            scatter(memoryview(value)[HEADER_BYTES:], pieces)
            self.counters["gets"] += 1
            out.append(True)
        return out

    def put(self, keys, buffers, geometry, release=None) -> list[bool]:
        if not keys:
            return []
        if not self._usable() or time.monotonic() < self._writes_held_until:
            self.counters["dropped_puts"] += len(keys)
            return [False] * len(keys)
        values = [b"".join([pack_header(key, pieces, geometry), *pieces])
                  for key, pieces in zip(keys, buffers)]
        send = self._sendable(values)
        if not any(send):
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value, ok in zip(keys, values, send):
                if ok:  # NX: a key already stored is not rewritten
                    pipe.set(self._name(key), value, ex=self.ttl_s, nx=True)
            answers = iter(pipe.execute(raise_on_error=False))  # a refused command is that key's
            results = [next(answers) if ok else None for ok in send]
        except self._redis.exceptions.TimeoutError as exc:  # writes held; the ping says if
            self._hold_writes(exc)  # the whole server hangs
            self.counters["dropped_puts"] += sum(send)  # (those over the limit: put_errors)
            return [False] * len(keys)
        except self._redis.RedisError as exc:  # the connection failed: the tier is down
            self._failed(exc)
            self.counters["dropped_puts"] += sum(send)
            return [False] * len(keys)
        stored = [ok and not isinstance(r, Exception) for ok, r in zip(send, results)]
        self.counters["puts"] += sum(stored)
        refused = [r for r in results if isinstance(r, Exception)]
        if refused:
            self._refused(refused)
        return stored

    def _ask_max_value(self) -> None:
        """(The probe, once the server answers.) Its proto-max-bulk-len: it resets the
        connection of a SET whose value is longer, and the tier went down at every backup of
        such blocks, its lookups finding nothing until the probe, in a loop. Not known where
        CONFIG is refused (an ACL, a managed server) or in a cluster (one node answers)."""
        self._max_value_asked = True
        if self.cluster:
            return
        try:
            got = self._probe_client.config_get("proto-max-bulk-len")
            self._max_value = int(got["proto-max-bulk-len"])
        except Exception:  # noqa: BLE001 - refused or unreadable: not known (SETs find out)
            self._max_value = None

    def _sendable(self, values) -> list[bool]:
        """Which values the server takes: those over its proto-max-bulk-len are failed puts,
        said once (the tier stays up)."""
        limit = self._max_value
        send = [limit is None or len(v) <= limit for v in values]
        if not all(send):
            self._max_value_asked = False  # read again next round: an operator may raise it
            over = [len(v) for v, ok in zip(values, send) if not ok]
            self._refused_why(len(over), f"a record of {over[0]} bytes is over the server's "
                              f"proto-max-bulk-len ({limit} bytes): raise it to store these blocks")
        return send

    def _hold_writes(self, exc: Exception) -> None:
        """A backup's SET timed out: a server whose writes are paused (a failover), or one that
        hangs (the probe's ping marks that down). Backups wait HOLD_WRITES_S; reads go on."""
        self.counters["write_timeouts"] += 1
        held = time.monotonic() < self._writes_held_until + HOLD_WRITES_S  # held just before
        self._writes_held_until = time.monotonic() + HOLD_WRITES_S
        self.last_error = (f"writes time out ({type(exc).__name__}: {exc}; a CLIENT PAUSE WRITE, "
                           f"a failover?): backups are dropped for {HOLD_WRITES_S:g} s at a time; "
                           "lookups and reads go on")
        if not held:
            log.warning("[redis] %s: %s", self.uri, self.last_error)

    def _refused(self, errors: list) -> None:
        """Commands the server refused (OOM when full): failed puts, not an outage."""
        self._refused_why(len(errors), f"{type(errors[0]).__name__}: {errors[0]}")

    def _refused_why(self, n: int, why: str) -> None:
        self.counters["put_errors"] += n
        self.last_error = why
        if self.last_error != self._refusal_said:
            self._refusal_said = self.last_error
            log.warning("[redis] %s refused %d puts: %s (the tier stays up; lookups and reads go on)",
                        self.uri, n, self.last_error)

    def _delete_store(self, keys) -> int | None:
        """(owed_clear.py) The keys deleted: how many were there; None on failure."""
        try:
            if self.cluster:  # multi-key DEL must not cross slots
                return sum(self._client.delete(self._name(k)) for k in keys)
            return int(self._client.delete(*[self._name(k) for k in keys]))
        except self._redis.RedisError as exc:
            self._failed(exc)
            return None

    def _clear_store(self) -> int | None:
        """(owed_clear.py) Every key under the prefix deleted: how many; None on failure."""
        try:
            n, batch = 0, []
            for name in self._client.scan_iter(match=self.prefix + b"*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    n += self._delete_names(batch)
                    batch = []
            return n + self._delete_names(batch)
        except self._redis.RedisError as exc:
            self._failed(exc)
            return None

    def _delete_names(self, names) -> int:
        if not names:
            return 0
        if self.cluster:
            return sum(self._client.delete(n) for n in names)
        return int(self._client.delete(*names))

    def usage(self) -> dict:
        return {"used_bytes": 0, "capacity_bytes": 0, "blocks": None, "healthy": self.health(),
                "clear_owed": self._clear_owed, "deletes_owed": len(self._owed_deletes),
                "writes_held": time.monotonic() < self._writes_held_until,
                **({"primary": "%s:%s" % self._primary if self._primary else None} if self._ask_primary else {}),
                "last_error": self.last_error, **self.counters}

    def close(self) -> None:
        self._closed.set()
        self._prober.join(PROBE_TIMEOUT_S + PROBE_EVERY_S)
        for client in (self._client, self._lookup_client, self._probe_client):
            client.close()


def _connector(redis, opts: dict, on_connect=None):
    """connect(timeout, retries): a client of the URI's server, cluster or sentinels' primary
    (each new connection asks the sentinels where it is); on_connect(connection) replaces each
    connection's handshake, or in a cluster runs after it (redis_restarts.py)."""
    from redis.backoff import ConstantBackoff, NoBackoff
    from redis.retry import Retry

    auth = {"username": opts["username"], "password": opts["password"]}
    tls = dict(ssl=True, ssl_ca_certs=opts["ca"]) if opts["tls"] else {}

    def connect(timeout: float, retries: int):
        retry = Retry(ConstantBackoff(WORKER_RETRY_BACKOFF_S) if retries else NoBackoff(), retries)
        common = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry=retry, **auth, **tls,
                      **({"redis_connect_func": on_connect} if on_connect else {}))
        if opts["cluster"]:
            return redis.cluster.RedisCluster(host=opts["host"], port=opts["port"], **common)
        if opts["sentinels"]:
            asked = dict(socket_timeout=timeout, socket_connect_timeout=timeout, **tls,
                         retry=Retry(NoBackoff(), 0),  # (by default each sentinel is asked
                         **(auth if opts["sentinel_auth"] else {}))  # 3 times, with backoff)
            return redis.sentinel.Sentinel(opts["sentinels"], sentinel_kwargs=asked).master_for(
                opts["service"], db=opts["db"], **common)
        return redis.Redis(host=opts["host"], port=opts["port"], db=opts["db"], **common)
    return connect


_FLAG_REFUSALS = ("compil", "shebang", "flag")  # Redis 6: the shebang is a syntax error
_SCRIPT_REFUSALS = ("unknown command", "noperm", "no permissions", "disabled", "not allowed")


def _wrong_type(exc: Exception) -> bool:
    """A command's error that says its key holds another type of value: that key's, not the
    server's."""
    return str(exc).startswith("WRONGTYPE")


def _refusal(exc: Exception) -> str | None:
    """What a script's error says the server will not run: "scripts" (EVAL renamed away or
    denied by an ACL), "flag" (it cannot compile the no-writes flag), or None: it could not
    this time."""
    text = str(exc).lower()
    if any(word in text for word in _SCRIPT_REFUSALS):
        return "scripts"
    return "flag" if any(word in text for word in _FLAG_REFUSALS) else None
