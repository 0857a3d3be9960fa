"""The Redis tier through failovers, with real processes on loopback. Behind Redis Sentinel
(redis+sentinel://): a primary, its replica and a sentinel monitoring them; after a failover -
asked for, or the primary killed - the tier reaches the promoted replica: what the old primary
held (replicated) is still a hit and loads byte-exact, and new backups are written to the new
primary. A Redis cluster (redis+cluster://) with a replica per primary: after every replica
took over, the same."""
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import (RedisServer, blocks_equal, free_port, keys_for, make_tls_files, scramble, small_kv, snapshot,
                      stored, wait_until)
from kvcached.server.status_report import format_status
from kvcached.storage.tiers import parse_uri
from redis_cluster import cluster, cluster_ok, cluster_roles
from storage_util import PAGE_SHAPE, offload_and_flush, start

SECRET = "s3nt-Pa55"


class SentinelServer:
    """A redis-server in sentinel mode monitoring `primary` as `mymaster` (quorum 1, the
    primary deemed down after 1 s without an answer)."""

    def __init__(self, primary: RedisServer, password: str | None = None, tls: dict | None = None,
                 failover_timeout_ms: int = 10000):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvsentinel-", dir="/tmp")
        self.tls = tls
        conf = os.path.join(self.dir, "sentinel.conf")
        with open(conf, "w") as f:  # (sentinel rewrites it as it learns)
            ports = (f"port 0\ntls-port {self.port}\ntls-cert-file {tls['cert']}\ntls-key-file {tls['key']}\n"
                     f"tls-ca-cert-file {tls['ca']}\ntls-auth-clients no\ntls-replication yes\n"
                     if tls else f"port {self.port}\n")
            f.write(f"{ports}bind 127.0.0.1\ndir {self.dir}\n"
                    f"sentinel monitor mymaster 127.0.0.1 {primary.port} 1\n"
                    "sentinel down-after-milliseconds mymaster 1000\n"
                    f"sentinel failover-timeout mymaster {failover_timeout_ms}\n")
            if password is not None:
                f.write(f"sentinel auth-pass mymaster {password}\nrequirepass {password}\n")
        self.password = password
        self.proc = subprocess.Popen([shutil.which("redis-server"), conf, "--sentinel"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: self._answers(), 10, "the sentinel up")

    def _answers(self) -> bool:
        import redis

        try:
            return bool(self.client().ping())
        except redis.RedisError:
            assert self.proc.poll() is None, "the sentinel exited"
            return False

    def client(self):
        import redis

        tls = {"ssl": True, "ssl_ca_certs": self.tls["ca"]} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1.0,
                           decode_responses=True, **tls)

    def primary_port(self) -> int:
        return int(self.client().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster")[1])

    def names_up(self, port: int) -> bool:
        """The sentinel names the primary at `port`, up (no down flag: what clients take)."""
        got = self.client().execute_command("SENTINEL", "MASTER", "mymaster")
        got = got if isinstance(got, dict) else dict(zip(got[::2], got[1::2]))
        return int(got["port"]) == port and got["flags"] == "master"

    def knows_replica(self, port: int) -> bool:
        replicas = [r if isinstance(r, dict) else dict(zip(r[::2], r[1::2]))
                    for r in self.client().execute_command("SENTINEL", "REPLICAS", "mymaster")]
        return any(int(r["port"]) == port and "s_down" not in r["flags"] for r in replicas)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class _Pair:
    def __init__(self, password, tls=None):
        self.password, self.tls = password, tls
        auth = (["--masterauth", password] if password else []) + (["--tls-replication", "yes"] if tls else [])
        self.primary = RedisServer(extra=auth, password=password, tls=tls)
        self.replica = RedisServer(extra=auth + ["--replicaof", "127.0.0.1", str(self.primary.port)],
                                   password=password, tls=tls)
        self.sentinel = SentinelServer(self.primary, password, tls)

    def close(self):
        for s in (self.sentinel, self.replica, self.primary):
            s.close()


def _names(kv, keys):
    return [b"kvcached:" + stored(k, kv).hex().encode() for k in keys]


def _tier(c) -> dict:
    return c.status()["storage"][0]


def test_a_sentinel_uri_is_checked_before_anything_is_opened():
    got = parse_uri("redis+sentinel://:pw@10.0.0.1,10.0.0.2:26380/2?service=kv&sentinel_auth=1&prefix=p:")
    assert got["sentinels"] == [("10.0.0.1", 26379), ("10.0.0.2", 26380)]
    assert got["service"] == "kv" and got["db"] == 2 and got["sentinel_auth"] and got["password"] == "pw"
    assert parse_uri("rediss+sentinel://h:1/0?service=kv&ca=/c.pem")["tls"]
    for bad, says in (("redis+sentinel://h:1/0", "service=NAME"),
                      ("redis+sentinel://:pw@h:1,h:x/0?service=kv", r"'h:x': the port"),
                      ("redis+sentinel://h:1,/0?service=kv", "no host:port"),
                      ("redis+sentinel://h:1/0?service=kv&sentinel_auth=yes", "sentinel_auth is 0 or 1"),
                      ("redis://h:1/0?service=kv", "unknown option"),
                      ("redis://:pw@h:1/0?lookup_keys=x", "lookup_keys='x': expected a whole number"),
                      ("redis://:pw@h:1/0?lookup_keys=0", "lookup_keys='0': expected a whole number")):
        with pytest.raises(ValueError, match=says) as err:
            parse_uri(bad)
        assert "pw" not in str(err.value)


@pytest.mark.faults
def test_sentinels_that_do_not_answer_are_an_unhealthy_tier_that_says_so(run_dir, instance):
    """No sentinel listening: the tier is down with a short reason naming the sentinels (the
    client library's own text repeats every sentinel client's settings), the daemon serves, and
    the owed-clear record names the store alike whatever the sentinels' order."""
    from kvcached.storage.redis_store import RedisBackend

    a, b = free_port(), free_port()
    tiers = [RedisBackend(f"redis+sentinel://127.0.0.1:{x},127.0.0.1:{y}/0?service=kv") for x, y in ((a, b), (b, a))]
    try:
        assert tiers[0].store_id == tiers[1].store_id
    finally:
        for t in tiers:
            t.close()
    kv = small_kv(block_shape=PAGE_SHAPE, seed=12)
    h = start(run_dir, instance, f"redis+sentinel://127.0.0.1:{a},127.0.0.1:{b}/0?service=kv")
    try:
        with h.connect(timeout=2.0) as c:
            c.register_kv_cache(kv)
            keys = keys_for(4, 43)
            offload_and_flush(c, kv, keys, list(range(4)))
            assert c.lookup(keys) == (4, 0)  # the host tier serves
            tier = _tier(c)
            assert not tier["healthy"] and tier["dropped_puts"] >= 4, tier
            sentinels = ",".join(sorted(f"127.0.0.1:{p}" for p in (a, b)))
            assert tier["last_error"] == f"MasterNotFoundError: no sentinel of {sentinels} names a primary for the service"
    finally:
        h.stop()


@pytest.mark.faults
@pytest.mark.parametrize("how", ["asked", "asked-tls", "primary-killed"])
def test_after_a_failover_the_tier_serves_and_stores_through_the_promoted_replica(run_dir, instance, how,
                                                                                   tmp_path):
    """asked: SENTINEL FAILOVER (a planned switch), with passwords on the data nodes and the
    sentinel (sentinel_auth=1); asked-tls: the same with every process speaking TLS only
    (rediss+sentinel://). primary-killed: the primary dies; the sentinel promotes the replica
    once it has been down 1 s. Either way the blocks the old primary held are hits through the
    new one, byte-exact, and the next backups land on the new primary."""
    tls = make_tls_files(str(tmp_path)) if how == "asked-tls" else None
    if how == "asked-tls" and tls is None:
        pytest.skip("openssl is not installed")
    pair = _Pair(SECRET if how.startswith("asked") else None, tls)
    h = None
    try:
        wait_until(lambda: pair.sentinel.knows_replica(pair.replica.port), 20, "the sentinel knows the replica")
        auth = f":{SECRET}@" if pair.password else ""
        uri = (f"{'rediss' if tls else 'redis'}+sentinel://{auth}127.0.0.1:{pair.sentinel.port}/0?service=mymaster"
               + ("&sentinel_auth=1" if pair.password else "") + (f"&ca={tls['ca']}" if tls else ""))
        kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=32, seed=11)
        keys, src = keys_for(4, 41), list(range(4))
        expected = snapshot(kv, src)
        h = start(run_dir, instance, uri)
        with h.connect(timeout=2.0) as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            assert pair.primary.client().exists(*_names(kv, keys)) == 4
            wait_until(lambda: pair.replica.client().exists(*_names(kv, keys)) == 4, 10, "replicated")
            c.clear(tier="host")
            assert _tier(c)["primary"] == f"127.0.0.1:{pair.primary.port}"
            if how.startswith("asked"):
                pair.sentinel.client().execute_command("SENTINEL", "FAILOVER", "mymaster")
            else:
                pair.primary.stop()
            wait_until(lambda: pair.sentinel.primary_port() == pair.replica.port, 30, "the replica promoted")
            # the probe asks the sentinels: the tier leaves the old primary (which takes writes
            # until the sentinels demote it, seconds later, and loses them then); a connection
            # that found the new one first failed, and the tier is down until the probe's round
            wait_until(lambda: f"healthy  primary 127.0.0.1:{pair.replica.port}" in format_status(c.status()),
                       5, "the new primary, healthy")
            wait_until(lambda: _tier(c)["healthy"] and c.lookup(keys) == (0, 4), 10,
                       "the blocks found through the new primary")
            scramble(kv, 5)
            assert c.load(keys, list(range(10, 14))).wait(10) == 4
            assert blocks_equal(kv, range(10, 14), expected)
            # backups made before the sentinel demoted the old primary went to it and were lost
            # with its data (Redis's own window, as for any client): new keys each time
            seeds = iter(range(42, 1000))

            def new_backup_landed():
                nonlocal fresh
                fresh = keys_for(4, next(seeds))
                offload_and_flush(c, kv, fresh, list(range(16, 20)))
                return pair.replica.client().exists(*_names(kv, fresh)) == 4

            fresh = None
            wait_until(new_backup_landed, 30, "a backup on the new primary")
            c.clear(tier="host")
            assert c.lookup(fresh) == (0, 4) and _tier(c)["healthy"]
            assert "***" in _tier(c)["uri"] or not pair.password
            assert SECRET not in str(c.status())
    finally:
        if h is not None:
            h.stop()
        pair.close()


class _ReplicationLink:
    """A TCP relay between a replica and its primary that can stop passing the primary's
    stream on (`cut`): what the primary acknowledges after it never reaches the replica, as
    when the primary is cut off from its replica and dies."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.cut = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._socks = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self._server.accept()
                up = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                return
            self._socks += [down, up]
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, src, dst, from_primary):
        try:
            while data := src.recv(65536):
                if not (from_primary and self.cut.is_set()):
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        for s in self._socks:
            s.close()


@contextlib.contextmanager
def _cut_pair():
    """A primary, its replica behind a _ReplicationLink, and a sentinel, for the block:
    (primary, link, replica, sentinel), the sentinel knowing the replica."""
    primary = RedisServer()
    link = _ReplicationLink(primary.port)
    replica = RedisServer(extra=["--replicaof", "127.0.0.1", str(link.port)])
    # (a sentinel points a replica that follows another address at the primary once the
    # failover timeout has passed since it found it: not within these tests)
    sentinel = SentinelServer(primary, failover_timeout_ms=120000)
    try:
        wait_until(lambda: sentinel.knows_replica(replica.port), 20, "the sentinel knows the replica")
        yield primary, link, replica, sentinel
    finally:
        for s in (sentinel, replica, primary):
            s.close()
        link.close()


@pytest.mark.faults
@pytest.mark.parametrize("what", ["delete", "clear"])
def test_a_delete_or_clear_the_old_primary_lost_is_done_again_on_the_new_one(run_dir, instance, what):
    """The primary acknowledges a delete (or a clear) that never reaches its replica (the
    replication stream cut), then dies; the sentinel promotes the replica, which still holds the
    blocks. The tier does again on the new primary what it did in the last REDO_WINDOW_S before
    it serves: the blocks stay gone (they were hits again through the new primary before)."""
    with _cut_pair() as (primary, link, replica, sentinel):
        h = None
        try:
            kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=32, seed=14)
            keys, kept = keys_for(4, 46), keys_for(2, 47)
            metrics_port = free_port()
            h = start(run_dir, instance, f"redis+sentinel://127.0.0.1:{sentinel.port}/0?service=mymaster",
                      extra=["--metrics-port", str(metrics_port)])
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(4)))
                wait_until(lambda: replica.client().exists(*_names(kv, keys)) == 4, 10, "replicated")
                link.cut.set()
                if what == "delete":
                    c.delete(keys)
                    offload_and_flush(c, kv, kept, list(range(4, 6)))  # stored after: kept
                else:
                    c.clear()
                assert primary.client().exists(*_names(kv, keys)) == 0
                assert replica.client().exists(*_names(kv, keys)) == 4  # the stream was cut
                primary.proc.kill()
                primary.proc.wait(10)
                wait_until(lambda: sentinel.primary_port() == replica.port, 30, "the replica promoted")
                wait_until(lambda: _tier(c)["primary"] == f"127.0.0.1:{replica.port}", 5, "the new primary")
                wait_until(lambda: _tier(c)["healthy"], 10, "the tier healthy")
                assert replica.client().exists(*_names(kv, keys)) == 0, "the lost one done again"
                c.clear(tier="host")
                assert c.lookup(keys) == (0, 0)
                assert c.load(keys, list(range(10, 14))).wait(10) == 0
                if what == "delete":  # deletes are done again, not a clear: the rest is kept
                    assert _tier(c)["deletes_owed"] == 0
                assert _tier(c)["failovers"] == 1
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
                    body = r.read().decode()
                (family,) = [f for f in text_string_to_metric_families(body) if f.name == "kvcached_storage_failovers"]
                assert [x.value for x in family.samples if x.name.endswith("_total")] == [1.0]
        finally:
            if h is not None:
                h.stop()


@pytest.mark.faults
def test_a_failover_while_no_daemon_followed_the_sentinels_is_seen_by_the_next_one(run_dir, instance):
    """As above, but the daemon stops after the delete, before the primary dies: the next
    daemon finds another primary than the one its predecessor kept on record, and does the
    lost delete again before it serves. Before, it took the promoted replica for the first
    primary it saw and served the deleted blocks."""
    with _cut_pair() as (primary, link, replica, sentinel):
        kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=32, seed=16)
        keys = keys_for(4, 45)
        uri = f"redis+sentinel://127.0.0.1:{sentinel.port}/0?service=mymaster"
        h = start(run_dir, instance, uri)
        try:
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(4)))
                wait_until(lambda: replica.client().exists(*_names(kv, keys)) == 4, 10, "replicated")
                link.cut.set()
                c.delete(keys)
        finally:
            h.stop()
        assert replica.client().exists(*_names(kv, keys)) == 4  # the stream was cut
        primary.proc.kill()
        primary.proc.wait(10)
        wait_until(lambda: sentinel.primary_port() == replica.port, 30, "the replica promoted")
        h = start(run_dir, instance, uri)
        try:
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                wait_until(lambda: _tier(c)["healthy"], 10, "the tier healthy")
                assert replica.client().exists(*_names(kv, keys)) == 0, "the lost delete done again"
                assert c.lookup(keys) == (0, 0) and _tier(c)["failovers"] == 1
        finally:
            h.stop()


@pytest.mark.faults
@pytest.mark.parametrize("first", ["lookup", "read"])
def test_a_connection_that_finds_the_new_primary_before_the_probe_serves_nothing(monkeypatch, first):
    """Between a promotion and the probe's next round: the connection the dead primary dropped
    reconnects as it is taken, and asks the sentinels, who name the promoted replica (which
    missed a delete: the stream was cut). lookup: that lookup fails instead of finding the
    deleted blocks (it found all 4 before). read: a storage worker's read, whose connect is
    retried once (the retry reaches the new primary), reads nothing (it read all 4 before).
    Either way the tier serves nothing until its probe has done the delete again. (The probe
    runs here only when the test calls it.)"""
    from kvcached.storage import redis_store

    monkeypatch.setattr(redis_store, "PROBE_EVERY_S", 3600.0)
    with _cut_pair() as (primary, link, replica, sentinel):
        tier = None
        try:
            tier = redis_store.RedisBackend(f"redis+sentinel://127.0.0.1:{sentinel.port}/0?service=mymaster")
            keys, geometry = [bytes([i]) * 16 for i in range(4)], os.urandom(16)
            names = [tier._name(k) for k in keys]
            pages = [bytearray(os.urandom(4096)) for _ in keys]
            assert tier.put(keys, [[memoryview(p)] for p in pages], geometry) == [True] * 4
            wait_until(lambda: replica.client().exists(*names) == 4, 10, "replicated")
            assert tier.exists_prefix(keys) == 4  # (the lookup connection, to the old primary)

            def read() -> list:
                into = [bytearray(4096) for _ in keys]
                got = tier.get_into(keys, [[memoryview(b)] for b in into], geometry)
                assert [b == p for b, p in zip(into, pages)] == got  # (what is read is what was put)
                return got
            assert read() == [True] * 4
            link.cut.set()
            assert tier.delete(keys) == 4 and tier.exists_prefix(keys) == 0
            assert replica.client().exists(*names) == 4  # the stream was cut
            primary.proc.kill()
            primary.proc.wait(10)
            wait_until(lambda: sentinel.names_up(replica.port), 30, "the replica promoted")
            if first == "lookup":
                assert tier.exists_prefix(keys) == 0, "a deleted block found through the new primary"
            else:
                assert read() == [False] * 4, "a deleted block read through the new primary"
            assert not tier.health() and tier.usage()["failovers"] == 1
            assert tier.exists_prefix(keys) == 0 and read() == [False] * 4
            assert replica.client().exists(*names) == 4
            tier._probe_once()  # the probe: the delete done again, then the tier serves
            assert tier.health() and replica.client().exists(*names) == 0
            assert tier.usage()["primary"] == f"127.0.0.1:{replica.port}" and tier.usage()["failovers"] == 1
            assert tier.put(keys[:1], [[memoryview(pages[0])]], geometry) == [True]
            assert tier.exists_prefix(keys) == 1 and read() == [True, False, False, False]  # (served)
        finally:
            if tier is not None:
                tier.close()


@pytest.mark.faults
@pytest.mark.parametrize("how", ["asked", "primary-killed"])
def test_after_a_cluster_failover_the_tier_serves_and_stores(run_dir, instance, how):
    """Three primaries with a replica each. asked: CLUSTER FAILOVER on every replica (a planned
    switch, as a rolling upgrade does). primary-killed: one primary dies, its replica takes over
    once the others have not heard from it for 1 s (cluster-node-timeout). The blocks stored
    before are hits through the new primaries (the cluster client follows the MOVED replies and
    refreshes its slot map), byte-exact, and new backups are stored and found."""
    with cluster() as (ports, nodes, uri):
        kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64, seed=13)
        keys = keys_for(12, 44)
        expected = snapshot(kv, list(range(12)))
        h = start(run_dir, instance, uri)
        try:
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(12)))
                c.clear(tier="host")
                assert c.lookup(keys) == (0, 12)
                replicas = [p for p, role in cluster_roles(ports[0]).items() if role == "slave"]
                if how == "asked":  # one at a time, as a rolling upgrade does
                    for p in replicas:
                        _failover(nodes[ports.index(p)], p)
                else:  # the primary the daemon was pointed at
                    nodes[0].stop()
                    replicas = [p for p in replicas if _replica_of(p) == ports[0]]
                alive = [p for n, p in zip(nodes, ports) if n.proc is not None]
                wait_until(lambda: all(cluster_roles(p).get(p) == "master" for p in replicas)
                           and all(cluster_ok(p) for p in alive), 30, "the replicas primaries")
                # (while the cluster settles a call may fail and take the tier down until the
                # next probe: misses then, never other bytes; so each step is asked again)
                wait_until(lambda: c.lookup(keys) == (0, 12), 10, "the blocks found through the new primaries")
                scramble(kv, 3)
                wait_until(lambda: c.load(keys, list(range(20, 32))).wait(10) == 12, 10, "the blocks loaded")
                assert blocks_equal(kv, list(range(20, 32)), expected)
                seeds = iter(range(45, 1000))

                def stored_and_found():
                    fresh = keys_for(12, next(seeds))
                    offload_and_flush(c, kv, fresh, list(range(32, 44)))
                    c.clear(tier="host")
                    return c.lookup(fresh) == (0, 12)

                wait_until(stored_and_found, 10, "new backups stored and found")
                wait_until(lambda: _tier(c)["healthy"], 5, "the tier healthy")
        finally:
            h.stop()


@pytest.mark.faults
def test_a_cluster_failover_has_the_deletes_done_lately_done_again(run_dir, instance):
    """Deleted blocks that a failover brings back (a primary that acknowledged the deletes and
    died before its replica had them; here their records are written back before a failover is
    asked, the state such a replica is in) are hits until the failover, and deleted again after
    it, before the tier serves: the cluster's epoch rose. The blocks not deleted are kept."""
    import redis.cluster

    with cluster() as (ports, nodes, uri):
        kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64, seed=15)
        keys = keys_for(12, 48)
        gone, kept = keys[6:], keys[:6]
        h = start(run_dir, instance, uri)
        try:
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(12)))
                direct = redis.cluster.RedisCluster(host="127.0.0.1", port=ports[0])
                records = {n: direct.get(n) for n in _names(kv, gone)}
                c.delete(gone)
                assert direct.exists(*records) == 0
                for name, record in records.items():
                    direct.set(name, record)
                c.clear(tier="host")
                assert [c.lookup([k]) for k in gone] == [(0, 1)] * 6  # (a lost delete: served)
                replica = next(p for p, role in cluster_roles(ports[0]).items() if role == "slave")
                _failover(nodes[ports.index(replica)], replica)
                wait_until(lambda: direct.exists(*records) == 0, 15, "the deletes done again")
                wait_until(lambda: _tier(c)["healthy"], 10, "the tier healthy")
                assert [c.lookup([k]) for k in gone] == [(0, 0)] * 6
                # (a client that follows a slot to a primary the probe's redo did not know of -
                # the node it asked heard of the epoch's rise before the promotion - holds the
                # tier one more round: misses, then the blocks kept)
                wait_until(lambda: c.lookup(kept) == (0, 6), 5, "the blocks not deleted found")
                assert _tier(c)["deletes_owed"] == 0
                assert _tier(c)["failovers"] >= 1
                direct.close()
        finally:
            h.stop()


@pytest.mark.faults
def test_a_cluster_failover_while_no_daemon_followed_is_seen_by_the_next_one(run_dir, instance):
    """As above, but the daemon stops after the deletes, before the failover: the next daemon
    finds the cluster's epoch higher than the one its predecessor kept on record and does the
    deletes again before it serves (before, it took the epoch for the first it saw)."""
    import redis.cluster

    with cluster() as (ports, nodes, uri):
        kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64, seed=18)
        keys = keys_for(8, 49)
        gone = keys[4:]
        h = start(run_dir, instance, uri)
        direct = redis.cluster.RedisCluster(host="127.0.0.1", port=ports[0])
        try:
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(8)))
                records = {n: direct.get(n) for n in _names(kv, gone)}
                c.delete(gone)
            h.stop()
            for name, record in records.items():  # (a replica that missed the deletes)
                direct.set(name, record)
            replica = next(p for p, role in cluster_roles(ports[0]).items() if role == "slave")
            _failover(nodes[ports.index(replica)], replica)
            h = start(run_dir, instance, uri)
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                wait_until(lambda: direct.exists(*records) == 0, 15, "the deletes done again")
                wait_until(lambda: _tier(c)["healthy"], 10, "the tier healthy")
                assert [c.lookup([k]) for k in gone] == [(0, 0)] * 4
                wait_until(lambda: c.lookup(keys[:4]) == (0, 4), 5, "the blocks not deleted found")
                assert _tier(c)["failovers"] >= 1
        finally:
            direct.close()
            h.stop()


@pytest.mark.faults
def test_a_cluster_user_refused_cluster_info_is_told_once_and_the_probe_pings(caplog):
    """An ACL user without CLUSTER INFO (what the probe reads a failover from): the tier says
    once that failovers are not followed, and its probe pings instead: it stays up."""
    import logging

    from kvcached.storage.redis_store import PROBE_EVERY_S, RedisBackend

    with cluster(cluster_info=False) as (ports, nodes, uri):
        caplog.set_level(logging.WARNING, logger="kvcached.storage.redis_store")
        tier = RedisBackend(uri)
        try:
            time.sleep(4 * PROBE_EVERY_S)  # a few probe rounds
            assert tier.health() and tier._epoch is None, tier.last_error
            assert sum("CLUSTER INFO refused" in r.message for r in caplog.records) == 1
        finally:
            tier.close()


@pytest.mark.faults
def test_a_cluster_user_refused_cluster_info_is_served(run_dir, instance):
    """The same user through a daemon: blocks stored, found and loaded byte-exact."""
    with cluster(cluster_info=False) as (ports, nodes, uri):
        kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=16, seed=16)
        keys = keys_for(4, 49)
        expected = snapshot(kv, list(range(4)))
        h = start(run_dir, instance, uri)
        try:
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(4)))
                c.clear(tier="host")
                assert c.lookup(keys) == (0, 4) and _tier(c)["healthy"]
                scramble(kv, 4)
                assert c.load(keys, list(range(8, 12))).wait(10) == 4
                assert blocks_equal(kv, range(8, 12), expected)
        finally:
            h.stop()


def _failover(node, port: int) -> None:
    """CLUSTER FAILOVER on the replica at `port`, asked again until it is a primary: a manual
    failover waits for the replica to catch up, and one that does not win its election within
    Redis's manual-failover timeout (5 s) is dropped, not retried (three sent at once lost one:
    the replicas never all took over in 30 s)."""
    deadline = time.monotonic() + 30
    while cluster_roles(port).get(port) != "master":
        assert time.monotonic() < deadline, f"the replica at {port} did not take over in 30 s"
        node.client().execute_command("CLUSTER", "FAILOVER")
        asked = time.monotonic()
        while time.monotonic() - asked < 6 and cluster_roles(port).get(port) != "master":
            time.sleep(0.1)


def _replica_of(port: int) -> int:
    """The port of the primary the replica at `port` follows."""
    info = subprocess.run(["redis-cli", "-p", str(port), "info", "replication"], capture_output=True,
                          text=True, timeout=5).stdout
    return int(next(line for line in info.splitlines() if line.startswith("master_port:")).split(":")[1])


@pytest.mark.faults
def test_a_cluster_lookup_redirected_to_a_new_primary_before_the_probe_serves_nothing(monkeypatch):
    """Between a cluster failover and the probe's next round: the lookup client follows the old
    primary's MOVED reply to the promoted replica, which holds blocks deleted just before (here
    written back: the state of a replica that missed the delete). That lookup is a miss (it was
    a hit before), and the tier serves nothing until its probe has seen the epoch rise and done
    the deletes again. (The probe runs here only when the test calls it.)"""
    import redis.cluster

    from kvcached.storage import redis_store

    monkeypatch.setattr(redis_store, "PROBE_EVERY_S", 3600.0)
    with cluster() as (ports, nodes, uri):
        tier = redis_store.RedisBackend(uri)
        direct = redis.cluster.RedisCluster(host="127.0.0.1", port=ports[0])
        try:
            keys = [bytes([i]) * 16 for i in range(16)]
            primary = direct.get_node_from_key(tier._name(keys[0])).port
            mine = [k for k in keys if direct.get_node_from_key(tier._name(k)).port == primary]
            names = [tier._name(k) for k in mine]
            for n in names:
                direct.set(n, b"x")
            assert tier.delete(mine) == len(mine)
            for n in names:  # (what a replica that missed the delete holds)
                direct.set(n, b"x")
            assert [tier.exists_prefix([k]) for k in mine] == [1] * len(mine)  # (a lost delete)
            replica = next(p for p, role in cluster_roles(primary).items()
                           if role == "slave" and _replica_of(p) == primary)
            _failover(nodes[ports.index(replica)], replica)
            # (the old primary holds the records written back too: asked before it knows, it
            # answers; one that acknowledged the delete would not hold them)
            wait_until(lambda: cluster_roles(primary).get(primary) == "slave", 10, "the old primary demoted")
            assert tier.exists_prefix(mine[:1]) == 0, "a deleted block found through the new primary"
            assert not tier.health()
            assert [tier.exists_prefix([k]) for k in mine] == [0] * len(mine)
            wait_until(lambda: (tier._probe_once(), tier.health())[1], 10, "the probe's redo")
            assert direct.exists(*names) == 0 and tier.usage()["failovers"] >= 1
            direct.set(names[0], b"x")
            assert tier.exists_prefix(mine[:1]) == 1  # (served: the new primary answers)
        finally:
            direct.close()
            tier.close()
