"""Real Redis clusters on loopback for the tests (redis-server in cluster mode, formed by
redis-cli --cluster create): skipped where redis-cli is missing."""
import contextlib
import shutil
import subprocess

import pytest

from conftest import RedisServer, free_port, wait_until


def cluster_roles(port: int) -> dict[int, str]:
    """port -> master or slave, as the node at `port` sees the cluster."""
    out = subprocess.run(["redis-cli", "-p", str(port), "cluster", "nodes"], capture_output=True,
                         text=True, timeout=5).stdout
    roles = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 2 and "fail" not in parts[2]:
            roles[int(parts[1].split("@")[0].rsplit(":", 1)[1])] = "master" if "master" in parts[2] else "slave"
    return roles


def cluster_ok(port: int) -> bool:
    r = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=5)
    return "cluster_state:ok" in r.stdout


def start_cluster(ports: list, nodes: list, replicas: int = 1) -> None:
    """Three primaries with `replicas` replicas each (node timeout 1 s), their ports and
    RedisServers appended to the lists (the caller closes them)."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed")
    ports += [free_port(with_bus=True) for _ in range(3 * (1 + replicas))]
    for p in ports:
        nodes.append(RedisServer(p, extra=["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{p}.conf",
                                           "--cluster-node-timeout", "1000"]))
    r = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", str(replicas), "--cluster-yes"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_until(lambda: sorted(cluster_roles(ports[0]).values()) == ["master"] * 3 + ["slave"] * 3 * replicas
               and all(cluster_ok(p) for p in ports), 20, "the cluster formed")


@contextlib.contextmanager
def cluster(cluster_info: bool = True, replicas: int = 1):
    """A cluster (start_cluster) for the block: (ports, nodes, the URI to give a tier). Without
    cluster_info, the URI names a user `kv` that may run everything but CLUSTER INFO."""
    ports, nodes = [], []
    try:
        start_cluster(ports, nodes, replicas)
        uri = f"redis+cluster://127.0.0.1:{ports[0]}"
        if not cluster_info:
            for node in nodes:
                node.client().execute_command("ACL", "SETUSER", "kv", "on", ">kv-pw", "~*", "&*", "+@all",
                                              "-cluster|info")
            uri = f"redis+cluster://kv:kv-pw@127.0.0.1:{ports[0]}"
        yield ports, nodes, uri
    finally:
        for n in nodes:
            n.close()
