"""The Redis tier through real redis-servers: round trips, lookups with and without scripts,
corrupt values, outages and a blackholed server that never stall the request loop, cluster mode;
and as deployed: a password (and TLS) in the URI, the password shown nowhere, and a full server
that refuses writes without taking the tier down."""
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import (RedisServer, blocks_equal, free_port, keys_for, make_tls_files, scramble, small_kv,
                      snapshot, stored, wait_until)
from kvcached_client import launch
from redis_cluster import cluster
from kvcached.storage.redis_store import PROBE_EVERY_S
from storage_util import PAGE_SHAPE, in_storage_only, offload_and_flush, pings_answered, start

SECRET = "s3cret-Pa55"


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_a_password_in_the_uri_authenticates_and_is_shown_nowhere(run_dir, instance, tmp_path):
    """Before, the password was dropped (the tier stayed unhealthy with an AUTH error) and the
    URI with it appeared in status, metrics and logs."""
    server = RedisServer(password=SECRET)
    try:
        port = free_port()
        kv = small_kv(block_shape=PAGE_SHAPE)
        keys = keys_for(6, 18)
        log_path = str(tmp_path / "daemon.log")
        h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, log_path=log_path,
                   extra_args=["--storage", server.uri, "--metrics-port", str(port)])
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(6)))
                c.clear(tier="host")
                assert c.lookup(keys) == (0, 6)
                status = json.dumps(c.status())
                assert c.status()["storage"][0]["healthy"]
                # launch() gives the URI in the daemon's environment, not on its command line
                # (every user's to read): the healthy tier above authenticated with it
                with open(f"/proc/{h.proc.pid}/cmdline", "rb") as f:
                    cmdline = f.read().decode()
                assert SECRET not in cmdline and "--metrics-port" in cmdline
                metrics = _metrics(port)
                server.stop()  # an outage: its log line names the tier
                wait_until(lambda: not c.status()["storage"][0]["healthy"], 5, "the outage seen")
                server.start()
                wait_until(lambda: c.status()["storage"][0]["healthy"], 5, "the recovery seen")
        finally:
            h.stop()
        log = open(log_path).read()
        assert "unhealthy" in log
        printed = subprocess.run([sys.executable, "-m", "kvcached", "serve", "--storage", server.uri,
                                  "--print-config"], capture_output=True, text=True, timeout=60).stdout
        for shown in (status, metrics, log, printed):
            assert SECRET not in shown
        assert f":***@127.0.0.1:{server.port}" in status and ":***@" in metrics and ":***@" in printed
    finally:
        server.close()


def test_a_wrong_password_is_an_unhealthy_tier_whose_reason_says_so(run_dir, instance):
    server = RedisServer(password=SECRET)
    try:
        wrong = server.uri.replace(SECRET, "nope")
        h = start(run_dir, instance, wrong)
        try:
            with h.connect() as c:
                tier = c.status()["storage"][0]
                assert not tier["healthy"] and "nope" not in json.dumps(tier)
                assert "Authentication" in tier["last_error"] or "AUTH" in tier["last_error"].upper()
        finally:
            h.stop()
    finally:
        server.close()


def test_rediss_speaks_tls_to_the_server(run_dir, instance, tmp_path):
    tls = make_tls_files(str(tmp_path))
    if tls is None:
        pytest.skip("openssl is not installed")
    server = RedisServer(password=SECRET, tls=tls)
    try:
        assert server.uri.startswith("rediss://")
        keys, dst = keys_for(6, 19), list(range(20, 26))
        with in_storage_only(run_dir, instance, server.uri, keys) as (c, kv, expected, _):
            assert c.lookup(keys) == (0, 6)
            scramble(kv, 3)
            assert c.load(keys, dst).wait(10) == 6
            assert blocks_equal(kv, dst, expected)
    finally:
        server.close()


def test_a_full_redis_fails_puts_and_keeps_serving_what_it_holds(run_dir, instance):
    """maxmemory with noeviction: SETs get OOM. Before, that marked the whole tier down, so
    lookups of blocks it still held came back short while it flapped; now those puts fail
    (counted) and the tier stays up."""
    server = RedisServer(extra=["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"])
    try:
        kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
        held = keys_for(8, 21)
        h = start(run_dir, instance, server.uri)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, held, list(range(8)))
                for seed in range(22, 30):  # 8 x 32 blocks of 32 KiB: far past 3 MiB
                    c.clear(tier="host")
                    offload_and_flush(c, kv, keys_for(32, seed), list(range(32, 64)))
                tier = c.status()["storage"][0]
                assert tier["put_errors"] > 0 and "OutOfMemory" in tier["last_error"], tier
                c.clear(tier="host")
                for _ in range(20):
                    assert c.lookup(held) == (0, 8)
                assert c.status()["storage"][0]["healthy"]
        finally:
            h.stop()
    finally:
        server.close()


@pytest.mark.faults
def test_writes_paused_on_the_server_cost_backups_not_lookups_or_loads(run_dir, instance, redis_server):
    """CLIENT PAUSE WRITE (what a failover does while the replica catches up): reads go on.
    Before, the lookup script (a script may write, so it was paused too) timed out and marked
    the tier down, as did a backup's timed-out SET: the stored blocks were misses for the whole
    pause. Now every lookup meanwhile finds them, they load byte-exact, the backups made meanwhile
    are dropped and counted with the tier up, and once writes go on backups are stored again."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=32, seed=9)
    keys, src = keys_for(4, 37), list(range(4))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect(timeout=1.0) as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
            redis_server.client().execute_command("CLIENT", "PAUSE", 4000, "WRITE")
            c.offload(list(range(4, 8)), keys_for(4, 38)).wait(10)  # its backup meets the pause
            # the backup's SET and its retry time out (~2 s), then writes are held for 1 s: lookups
            # all along, until the status has shown the hold (bounded: the pause ends at 4 s)
            start_s, held = time.monotonic(), False
            while time.monotonic() < start_s + 2.5 or not held:
                assert time.monotonic() < start_s + 3.9, "the status never showed writes_held"
                assert c.lookup(keys) == (0, 4), c.status()["storage"][0]["last_error"]
                held = held or c.status()["storage"][0]["writes_held"]
                time.sleep(0.02)
            c.flush().wait(10)
            tier = c.status()["storage"][0]  # (writes_held may have ended: 1 s after the timeout)
            assert tier["healthy"] and tier["write_timeouts"] >= 1 and tier["dropped_puts"] >= 4, tier
            assert "writes" in tier["last_error"], tier
            assert c.lookup(keys) == (0, 4)
            scramble(kv, 3)
            assert c.load(keys, list(range(10, 14))).wait(10) == 4
            assert blocks_equal(kv, range(10, 14), expected)
            redis_server.client().execute_command("CLIENT", "UNPAUSE")
            wait_until(lambda: not c.status()["storage"][0]["writes_held"], 5, "writes going on")
            fresh = keys_for(4, 39)
            offload_and_flush(c, kv, fresh, list(range(16, 20)))
            c.clear(tier="host")
            assert c.lookup(fresh) == (0, 4)
            assert c.status()["storage"][0]["healthy"]
    finally:
        redis_server.client().execute_command("CLIENT", "UNPAUSE")
        h.stop()


def test_redis_tier_round_trip(run_dir, instance, redis_server):
    keys, dst = keys_for(10, 14), list(range(20, 30))
    with in_storage_only(run_dir, instance, redis_server.uri, keys) as (c, kv, expected, _):
        assert c.lookup(keys) == (0, 10)
        scramble(kv, 3)
        assert c.load(keys, dst).wait(10) == 10
        assert blocks_equal(kv, dst, expected)
        assert c.status()["storage"][0]["healthy"]


@pytest.mark.parametrize("scripts", ["allowed", "refused"])
def test_a_redis_lookup_counts_the_leading_keys_present_with_or_without_scripts(
        run_dir, instance, scripts):
    """A lookup asks redis in one script call for the leading keys present; where the server
    refuses scripts (here EVAL/EVALSHA renamed away, as an ACL or a managed service may), the
    tier says so once and pipelines one EXISTS per key: the same counts either way, and a
    refused script is not an outage."""
    import redis

    off = ["--rename-command", "EVAL", "evaloff", "--rename-command", "EVALSHA", "evalshaoff"]
    server = RedisServer(extra=off if scripts == "refused" else ())
    keys = keys_for(10, 34)
    try:
        with in_storage_only(run_dir, instance, server.uri, keys) as (c, kv, _, h):
            def name(k):
                return b"kvcached:" + stored(k, kv).hex().encode()

            assert c.lookup(keys) == (0, 10)
            redis.Redis(port=server.port).delete(name(keys[4]))
            assert c.lookup(keys) == (0, 4)  # the prefix ends at the first key missing
            assert c.lookup(keys[5:]) == (0, 5)
            assert c.lookup(keys_for(3, 35)) == (0, 0)
            # past one script call's keys (SCRIPT_KEYS): 2,500 present, a hole at 1,100
            r, many = redis.Redis(port=server.port), keys_for(2500, 36)
            r.mset({name(k): b"x" for k in many})
            calls = r.info("commandstats").get("cmdstat_eval", {}).get("calls", 0)
            assert c.lookup(many) == (0, 2500)
            if scripts == "allowed":  # 1,024 + 1,024 + 452 keys: no call holds redis for all
                assert r.info("commandstats")["cmdstat_eval"]["calls"] - calls == 3
            r.delete(name(many[1100]))
            assert c.lookup(many) == (0, 1100)
            assert c.status()["storage"][0]["healthy"]
            with open(h.log_path) as log:
                warned = log.read().count("lookup script is refused")
            assert warned == (1 if scripts == "refused" else 0)
    finally:
        server.close()


def test_a_server_that_cannot_compile_the_no_writes_flag_gets_the_script_without_it(redis_server, caplog):
    """Redis 6 has no script flags: its Lua sees `#!lua flags=no-writes` as a syntax error.
    (Here the real server's EVAL refuses a script with the flag, with Redis 6's message.) The
    tier takes the script without the flag from then on, one call per lookup still, and says so
    once; no lookup comes back short for it. A passing error (BUSY) drops nothing."""
    import redis

    from kvcached.storage.redis_store import RedisBackend

    tier = RedisBackend(redis_server.uri)
    try:
        sent, real = [], tier._lookup_client.eval

        def like_redis6(script, numkeys, *keys):
            sent.append(script)
            if len(sent) == 1:  # a passing error first: no reason to drop the flag
                raise redis.exceptions.ResponseError("BUSY Redis is busy running a script.")
            if script.startswith("#!"):
                raise redis.exceptions.ResponseError("Error compiling script (new function): "
                                                     "user_script:1: unexpected symbol near '#'")
            return real(script, numkeys, *keys)

        tier._lookup_client.eval = like_redis6
        keys = [bytes([i]) * 16 for i in range(6)]
        redis_server.client().mset({tier._name(k): b"x" for k in keys[:4]})
        with caplog.at_level("INFO", logger="kvcached.storage.redis_store"):
            assert tier.exists_prefix(keys) == 4  # (BUSY: answered by EXISTS per key)
            assert tier.exists_prefix(keys) == 4
            assert tier.exists_prefix(keys[:3]) == 3
        assert [s.startswith("#!") for s in sent] == [True, True, False, False]
        assert caplog.text.count("no-writes flag is refused") == 1
        assert "lookup script is refused" not in caplog.text and tier.health()
    finally:
        tier.close()


@pytest.mark.faults
def test_a_corrupt_redis_value_is_a_miss(run_dir, instance, redis_server):
    import redis

    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(6, 15)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(6)))
            c.clear(tier="host")
            r = redis.Redis(port=redis_server.port)
            name = b"kvcached:" + stored(keys[3], kv).hex().encode()
            value = bytearray(r.get(name))
            value[-1] ^= 0xFF
            r.set(name, bytes(value))
            assert c.load(keys, list(range(10, 16))).wait(10) == 3
            assert r.get(name) is None  # removed, never served
    finally:
        h.stop()


@pytest.mark.faults
def test_a_value_planted_under_a_redis_key_fails_that_key_alone_read_no_further_than_a_record(
        run_dir, instance, redis_server):
    """Another writer under the prefix: 32 MiB values under keys 4-7 (a GET read them whole: 16
    such values took a load 9 s and the daemon 2.1 GiB) and a list under key 12 (its WRONGTYPE
    failed the whole pipeline, so the other 15 keys, and the tier went down). Now each is that
    key's bad record, deleted; the server sends at most a record and a byte for each."""
    import redis

    keys = keys_for(16, 16)
    with in_storage_only(run_dir, instance, redis_server.uri, keys) as (c, kv, expected, _h):
        r = redis.Redis(port=redis_server.port)
        names = [b"kvcached:" + stored(k, kv).hex().encode() for k in keys]
        record = len(r.get(names[0]))
        for name in names[4:8]:
            r.set(name, b"x" * (32 << 20))
        r.delete(names[12])
        r.rpush(names[12], b"a", b"b")
        sent = r.info("stats")["total_net_output_bytes"]
        scramble(kv, 7)
        assert c.load(keys, list(range(16, 32))).wait(10) == 4
        assert r.info("stats")["total_net_output_bytes"] - sent < 16 * (record + 1) + (1 << 20)
        assert blocks_equal(kv, list(range(16, 32)), expected, upto=4)
        tier = c.status()["storage"][0]
        assert tier["healthy"] and tier["corrupt"] == 5 and tier["errors"] == 0
        assert sum(r.exists(n) for n in names[4:8] + [names[12]]) == 0  # removed, never served
        assert c.load(keys[8:12], list(range(20, 24))).wait(10) == 4  # the keys between: intact
        assert blocks_equal(kv, list(range(20, 24)), [tuple(t[8:12] for t in p) for p in expected])


def test_a_lookup_asks_a_remote_tier_for_at_most_its_lookup_keys(run_dir, instance, redis_server):
    """A 65,536-key lookup of keys all in Redis held the request thread, and every other client,
    212 ms. A request now asks a remote tier for at most `lookup_keys` keys (default 16,384):
    the rest is a miss, counted as `lookups_cut`. The control: a lookup of as many keys as
    that is whole, and nothing is cut."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(65536, 19)
    pipe = redis_server.client().pipeline(transaction=False)
    for k in keys:
        pipe.set(b"kvcached:" + stored(k, kv).hex().encode(), b"x")
    pipe.execute()
    port = free_port()
    h = start(run_dir, instance, redis_server.uri + "?lookup_keys=3000", extra=("--metrics-port", str(port)))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            assert c.lookup(keys[:3000]) == (0, 3000)
            assert c.status()["storage"][0]["lookups_cut"] == 0
            assert c.lookup(keys) == (0, 3000)
            assert c.status()["storage"][0]["lookups_cut"] == 1
            assert "kvcached_storage_lookups_cut_total{instance=" in _metrics(port)
            cut = next(line for line in _metrics(port).splitlines()
                       if line.startswith("kvcached_storage_lookups_cut_total"))
            assert cut.endswith(" 1.0"), cut
    finally:
        h.stop()


@pytest.mark.faults
def test_redis_outage_makes_the_tier_unhealthy_not_the_daemon(run_dir, instance, redis_server):
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys = keys_for(4, 16)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, [0, 1, 2, 3])
            c.clear(tier="host")
            redis_server.stop()
            assert c.lookup(keys) == (0, 0)
            more = keys_for(4, 17)
            offload_and_flush(c, kv, more, [4, 5, 6, 7])  # backups dropped, counted
            tier = c.status()["storage"][0]
            assert tier["healthy"] is False and tier["dropped_puts"] >= 4
            assert c.lookup(more) == (4, 0)  # the host tier still works
            redis_server.start()  # empty again: persistence is off
            wait_until(lambda: c.status()["storage"][0]["healthy"], 5, "the redis tier healthy again")
            offload_and_flush(c, kv, keys, [0, 1, 2, 3])
            c.clear(tier="host")
            assert c.lookup(keys) == (0, 4)
    finally:
        h.stop()


@pytest.mark.faults
def test_a_redis_outage_stalls_no_request_beyond_the_lookup_timeout(run_dir, instance, redis_server):
    """The first lookup after the server died, and another client's pings meanwhile, answer
    within a client timeout of 1 s (redis-py's default retries took ~4 s)."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect(timeout=1.0) as c, h.connect(timeout=1.0) as other:
            c.register_kv_cache(kv)
            keys = keys_for(4, 33)
            assert c.lookup(keys) == (0, 0)
            redis_server.stop()
            with pings_answered(other):
                for _ in range(3):
                    assert c.lookup(keys) == (0, 0)
    finally:
        h.stop()


@pytest.mark.faults
def test_an_idle_daemon_shows_a_redis_outage_and_recovery_within_2_s(run_dir, instance, redis_server):
    h = start(run_dir, instance, redis_server.uri)
    try:
        with h.connect() as c:
            assert c.status()["storage"][0]["healthy"] is True
            for up in (False, True):
                (redis_server.start if up else redis_server.stop)()
                deadline = time.monotonic() + 2.0  # no request touches the tier meanwhile
                while c.status()["storage"][0]["healthy"] is not up:
                    assert time.monotonic() < deadline, f"status still says healthy={not up}"
                    time.sleep(0.05)
    finally:
        h.stop()


class Blackhole:
    """A TCP port that accepts connections and never answers (a blackholed server)."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self):
        self.sock.close()
        for conn in self.conns:
            conn.close()
        self._thread.join(5)


@pytest.mark.faults
@pytest.mark.slow
def test_a_blackholed_redis_never_stalls_the_request_loop(run_dir, instance):
    """Lookups run on the request thread: with a server that never answers, the tier goes
    unhealthy and its probes run on their own thread, so every request keeps answering within a
    client timeout (0.5 s) shorter than the 1 s a probe on the request thread would block."""
    hole = Blackhole()
    kv = small_kv(block_shape=PAGE_SHAPE)
    h = start(run_dir, instance, f"redis://127.0.0.1:{hole.port}/0")
    try:
        with h.connect(timeout=0.5) as c:
            c.register_kv_cache(kv)
            keys = keys_for(4, 31)
            c.offload([0, 1, 2, 3], keys).wait(5)
            deadline = time.monotonic() + 3.5  # three probe periods
            n = 0
            while time.monotonic() < deadline:
                assert c.lookup(keys_for(4, 32)) == (0, 0)  # KvcachedTimeout if the loop stalls
                assert c.lookup(keys) == (4, 0)
                c.ping()
                n += 1
                time.sleep(0.01)
            tier = c.status()["storage"][0]
            assert tier["healthy"] is False and tier["errors"] >= 1
            assert n > 20
    finally:
        h.stop()
        hole.close()


def test_redis_cluster_tier(run_dir, instance):
    with cluster(replicas=0) as (ports, nodes, uri):
        kv = small_kv(block_shape=PAGE_SHAPE)
        keys = keys_for(12, 18)
        expected = snapshot(kv, list(range(12)))
        h = start(run_dir, instance, uri)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(12)))
                c.clear(tier="host")
                assert c.lookup(keys) == (0, 12)
                scramble(kv, 3)
                assert c.load(keys, list(range(20, 32))).wait(10) == 12
                assert blocks_equal(kv, list(range(20, 32)), expected)
        finally:
            h.stop()


def test_blocks_over_the_servers_value_limit_fail_alone_and_the_tier_stays_up(run_dir, instance):
    """A server whose proto-max-bulk-len (1 MiB, its least) is under a block's record (17 layers x 64 KiB: 1.06 MiB):
    it resets the connection of such a SET. Before, the tier went down at every backup of them
    (its lookups finding nothing of what it held until the probe) and counted no put error.
    Now those puts fail alone, counted and said, and the tier stays up, serving the small
    blocks it holds; the limit raised, they are stored (the probe reads it again)."""
    server = RedisServer(extra=["--proto-max-bulk-len", "1mb"])
    try:
        small = small_kv(block_shape=PAGE_SHAPE, num_blocks=8)
        big = small_kv(num_layers=17, block_shape=(16, 8, 128), num_blocks=8, seed=3)
        held, big_keys = keys_for(4, 51), keys_for(8, 52)
        h = start(run_dir, instance, server.uri)
        try:
            with h.connect() as c:
                c.register_kv_cache(small)
                offload_and_flush(c, small, held, list(range(4)))
            with h.connect() as c:
                c.register_kv_cache(big)
                for i in range(0, 8, 2):
                    offload_and_flush(c, big, big_keys[i:i + 2], [i, i + 1])
                    assert c.status()["storage"][0]["healthy"]
                tier = c.status()["storage"][0]
                assert tier["put_errors"] == 8 and tier["errors"] == 0, tier
                assert "proto-max-bulk-len (1048576 bytes)" in tier["last_error"], tier
                server.client().config_set("proto-max-bulk-len", "4mb")  # raised, as it says
                time.sleep(3 * PROBE_EVERY_S)  # (the probe reads it again)
                offload_and_flush(c, big, keys_for(2, 53), [0, 1])
                assert c.status()["storage"][0]["puts"] == 6  # 4 small ones, now these 2
            with h.connect() as c:
                c.register_kv_cache(small)
                c.clear(tier="host")
                assert c.lookup(held) == (0, 4)
        finally:
            h.stop()
    finally:
        server.close()
