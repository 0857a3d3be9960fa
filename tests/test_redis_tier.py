"""The Redis tier as deployed: a password (and TLS) in the URI, the password shown nowhere, and
a full server that refuses writes without taking the tier down. Real redis-servers."""
import json
import subprocess
import sys
import urllib.request

import pytest

from conftest import (RedisServer, blocks_equal, free_port, keys_for, make_tls_files, scramble,
                      small_kv, wait_until)
from kvcached_client import launch
from test_storage import PAGE_SHAPE, in_storage_only, offload_and_flush, start

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
