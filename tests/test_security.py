"""Who may talk to a daemon over TCP (CURVE + allow-list), and tenants kept apart."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import free_port, small_kv

from kvcached_client import BlockHasher, Client, DaemonUnavailable, launch, make_namespace


def keygen(directory, name) -> tuple[str, str]:
    subprocess.run([sys.executable, "-m", "kvcached", "keygen", str(directory), "--name", name],
                   check=True, capture_output=True)
    return os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")


@pytest.fixture
def curve_daemon(run_dir, instance, tmp_path):
    server_pub, server_secret = keygen(tmp_path / "server", "daemon")
    allowed_pub, allowed_secret = keygen(tmp_path / "clients", "engine")
    _, stranger_secret = keygen(tmp_path / "strangers", "other")
    allow = tmp_path / "allow"
    allow.mkdir()
    shutil.copy(allowed_pub, allow)
    port = free_port()
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=[
            "--listen", f"tcp://0.0.0.0:{port}", "--curve-secret-key-file", server_secret,
            "--curve-allow-dir", str(allow)]) as d:
        yield d, f"tcp://127.0.0.1:{port}", server_pub, allowed_secret, stranger_secret


def test_keygen_writes_a_private_secret_key(tmp_path):
    _, secret = keygen(tmp_path, "k")
    assert os.stat(secret).st_mode & 0o077 == 0


def test_a_client_with_an_allowed_key_is_served_over_curve(curve_daemon):
    d, endpoint, server_pub, allowed_secret, _ = curve_daemon
    with Client.connect(d.instance, d.run_dir, timeout=3, endpoint=endpoint,
                        curve_server_key_file=server_pub, curve_client_key_file=allowed_secret) as c:
        assert c.ping() < 1.0
        assert c.status()["instance"] == d.instance


def test_clients_without_an_allowed_key_cannot_connect(curve_daemon):
    d, endpoint, server_pub, _, stranger_secret = curve_daemon
    with pytest.raises(DaemonUnavailable, match="cannot reach"):
        Client.connect(d.instance, d.run_dir, timeout=2, endpoint=endpoint)  # no CURVE at all
    with pytest.raises(DaemonUnavailable, match="cannot reach"):
        Client.connect(d.instance, d.run_dir, timeout=2, endpoint=endpoint,
                       curve_server_key_file=server_pub, curve_client_key_file=stranger_secret)
    with d.connect() as local:  # the private ipc socket in the run dir is unaffected
        assert local.ping() < 1.0


def test_non_loopback_tcp_without_curve_keys_does_not_start(run_dir, instance):
    out = subprocess.run([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                          "--run-dir", run_dir, "--listen", f"tcp://0.0.0.0:{free_port()}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "need CURVE keys" in out.stderr


def test_one_tenants_keys_are_never_served_to_another(daemon):
    kv = small_kv(num_layers=2, num_blocks=16, block_shape=(16, 2, 8))
    tokens = list(range(4 * 16))
    keys_a = BlockHasher(make_namespace("m", "bfloat16", tenant="alice")).hash_blocks(tokens, 16)
    keys_b = BlockHasher(make_namespace("m", "bfloat16", tenant="bob")).hash_blocks(tokens, 16)
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        c.offload(range(4), keys_a).wait(10)
        assert c.lookup(keys_a) == (4, 0)
        assert c.lookup(keys_b) == (0, 0)  # same tokens, same model: another tenant's keys
        assert c.load(keys_b, range(8, 12)).wait(10) == 0
