"""The Redis / Valkey tier (optional extra `kvcached[redis]`): one value per block, pipelined.

    redis://host:port/db[?prefix=P&ttl_s=N]        one server
    redis+cluster://host:port[?prefix=P&ttl_s=N]   a cluster (any node as the entry point)

Keys are `{prefix}{key hex}`; values are record.py records (header with a checksum, then the
page). A server that stops answering marks the tier unhealthy: lookups see 0 hits, puts are
dropped and counted, and a probe thread pings once a second until it answers again.

Lookups run on the daemon's request thread, so they never wait on a probe and use their own
connection with a short timeout (LOOKUP_TIMEOUT_S): a server that accepts connections but
never answers (a blackholed host) costs one request at most that long, then the tier is
unhealthy and lookups skip it until the probe sees it back. Fetches and backups run on
storage worker threads with the longer SOCKET_TIMEOUT_S.
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence
from urllib.parse import parse_qs, urlparse

from .base import StorageBackend
from .record import HEADER_BYTES, BadRecord, nbytes, pack_header, verify

log = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0
SOCKET_TIMEOUT_S = 1.0
LOOKUP_TIMEOUT_S = 0.25


class RedisBackend(StorageBackend):
    def __init__(self, uri: str):
        try:
            import redis
            import redis.cluster
        except ImportError:
            raise ValueError(f"{uri!r}: the redis tier needs redis-py: pip install 'kvcached[redis]'") from None
        self._redis = redis
        url = urlparse(uri)
        self.uri = uri
        self.cluster = url.scheme == "redis+cluster"
        q = parse_qs(url.query)
        unknown = set(q) - {"prefix", "ttl_s"}
        if unknown:
            raise ValueError(f"{uri!r}: unknown option(s) {sorted(unknown)}")
        self.prefix = q.get("prefix", ["kvcached:"])[0].encode()
        self.ttl_s = int(q.get("ttl_s", ["0"])[0]) or None
        host, port = url.hostname or "127.0.0.1", url.port or 6379
        db = int(url.path.strip("/") or 0)

        def connect(timeout: float):
            common = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
            if self.cluster:
                return redis.cluster.RedisCluster(host=host, port=port, **common)
            return redis.Redis(host=host, port=port, db=db, **common)

        self._healthy = True
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.counters = {"puts": 0, "gets": 0, "dropped_puts": 0, "errors": 0, "corrupt": 0}
        self.last_error = ""
        self._client = connect(SOCKET_TIMEOUT_S)
        self._lookup_client = connect(LOOKUP_TIMEOUT_S)
        try:
            self._client.ping()
        except redis.RedisError as exc:
            self._failed(exc)

    def _name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def _failed(self, exc: Exception) -> None:
        self.counters["errors"] += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            if self._healthy:
                log.warning("[redis] %s unhealthy: %s", self.uri, self.last_error)
            self._healthy = False
            if self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(target=self._probe_until_healthy,
                                                name="kvcached-redis-probe", daemon=True)
                self._prober.start()

    def _probe_until_healthy(self) -> None:
        while not self._closed.wait(PROBE_EVERY_S):
            try:
                self._client.ping()
            except Exception as exc:  # any failure keeps the tier down and the probe going
                self.last_error = f"{type(exc).__name__}: {exc}"
                continue
            with self._lock:
                self._healthy = True
                self._prober = None
            log.info("[redis] %s healthy again", self.uri)
            return
        with self._lock:
            self._prober = None

    def _usable(self) -> bool:
        return self._healthy

    def health(self) -> bool:
        """The last known state: an operation that fails marks the tier down, the probe
        thread marks it up again (no call here waits on the server)."""
        return self._healthy

    def _per_key(self, command: str, keys, client=None) -> list | None:
        """One pipelined command per key; None when the store is unusable or fails."""
        if not keys or not self._usable():
            return None
        try:
            pipe = (client or self._client).pipeline(transaction=False)
            for key in keys:
                getattr(pipe, command)(self._name(key))
            return pipe.execute()
        except self._redis.RedisError as exc:
            self._failed(exc)
            return None

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        found = self._per_key("exists", keys, self._lookup_client)  # the request thread
        if found is None:
            return 0
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    def get_into(self, keys, buffers) -> list[bool]:
        values = self._per_key("get", keys)
        if values is None:
            return [False] * len(keys)
        out = []
        for key, pieces, value in zip(keys, buffers, values):
            if value is None:
                out.append(False)
                continue
            try:
                verify(value, key, nbytes(pieces))
            except BadRecord as exc:
                log.warning("[redis] %s: %s; deleted", key.hex(), exc)
                self.counters["corrupt"] += 1
                self.delete([key])
                out.append(False)
                continue
            _scatter(memoryview(value)[HEADER_BYTES:], pieces)
            self.counters["gets"] += 1
            out.append(True)
        return out

    def put(self, keys, buffers) -> list[bool]:
        if not keys:
            return []
        if not self._usable():
            self.counters["dropped_puts"] += len(keys)
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, pieces in zip(keys, buffers):
                value = b"".join([pack_header(key, pieces), *pieces])
                # NX: a key already stored is not rewritten
                pipe.set(self._name(key), value, ex=self.ttl_s, nx=True)
            pipe.execute()
        except self._redis.RedisError as exc:
            self._failed(exc)
            self.counters["dropped_puts"] += len(keys)
            return [False] * len(keys)
        self.counters["puts"] += len(keys)
        return [True] * len(keys)

    def delete(self, keys) -> int:
        if not keys or not self._usable():
            return 0
        try:
            if self.cluster:  # multi-key DEL must not cross slots
                return sum(self._client.delete(self._name(k)) for k in keys)
            return int(self._client.delete(*[self._name(k) for k in keys]))
        except self._redis.RedisError as exc:
            self._failed(exc)
            return 0

    def clear(self) -> int:
        if not self._usable():
            return 0
        n = 0
        try:
            batch = []
            for name in self._client.scan_iter(match=self.prefix + b"*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    n += self._delete_names(batch)
                    batch = []
            n += self._delete_names(batch)
        except self._redis.RedisError as exc:
            self._failed(exc)
        return n

    def _delete_names(self, names) -> int:
        if not names:
            return 0
        if self.cluster:
            return sum(self._client.delete(n) for n in names)
        return int(self._client.delete(*names))

    def usage(self) -> dict:
        return {"used_bytes": 0, "capacity_bytes": 0, "blocks": None, "healthy": self._healthy,
                "last_error": self.last_error, **self.counters}

    def close(self) -> None:
        self._closed.set()
        prober = self._prober
        if prober is not None:
            prober.join(SOCKET_TIMEOUT_S + PROBE_EVERY_S)
        self._client.close()
        self._lookup_client.close()


def _scatter(payload: memoryview, pieces) -> None:
    off = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        view[:] = payload[off : off + view.nbytes]
        off += view.nbytes
