"""The CURVE handshake flood of `kvcached bench faults`: strangers at the TCP listener.

Anyone who can reach a `--listen` port and holds the daemon's public key (every client is given
it) can start CURVE handshakes: processes here do, as fast as they can, each with a key of its
own that is in no allow dir, while an engine on the ipc socket pings the daemon and an allowed
TCP client connects and pings. What comes out: the engine's ping under the flood against idle
(same run), how long the allowed client took to connect, how many handshakes the daemon refused.
The daemon is one of its own (the bench's other one has no TCP listener).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from kvcached_client import Client, launch

from . import expect_line, free_port, read_line
from .flood import pct, pings, reap

_STRANGER = """
import sys, time, zmq, zmq.auth
endpoint, server_key_file, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
server_key, _ = zmq.auth.load_certificate(server_key_file)
public, secret = zmq.curve_keypair()  # a key of its own: in no allow dir
ctx = zmq.Context()
print("ready", flush=True)
tried, batch, end = 0, [], time.monotonic() + seconds
while time.monotonic() < end:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_key, public, secret
    s.connect(endpoint)
    batch.append(s)
    tried += 1
    if len(batch) == 32:  # 32 handshakes under way, then new ones
        time.sleep(0.02)
        for s in batch:
            s.close(0)
        batch = []
print(tried, flush=True)
"""


def _keys(tmp: str) -> tuple[str, str, str, str]:
    """(daemon's public, daemon's secret, engine's secret, allow dir) under tmp."""
    import zmq.auth

    old = os.umask(0o077)
    try:
        server_pub, server_secret = zmq.auth.create_certificates(tmp, "daemon")
        client_pub, client_secret = zmq.auth.create_certificates(tmp, "engine")
        allow = os.path.join(tmp, "allow")
        os.mkdir(allow)
        shutil.copy(client_pub, allow)
    finally:
        os.umask(old)
    return server_pub, server_secret, client_secret, allow


def handshake_flood(flooders: int = 2, seconds: float = 6.0) -> dict:
    tmp = tempfile.mkdtemp(prefix="kvhs-", dir="/tmp")
    server_pub, server_secret, client_secret, allow = _keys(tmp)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = launch(instance=f"hs{os.getpid()}", run_dir=os.path.join(tmp, "run"), host_cache_gb=0.05,
               extra_args=["--listen", endpoint, "--curve-secret-key-file", server_secret,
                           "--curve-allow-dir", allow])
    procs = []
    try:
        with d.connect(name="engine") as engine:
            idle = pings(engine, 1.0)
            procs = [subprocess.Popen([sys.executable, "-c", _STRANGER, endpoint, server_pub,
                                       str(seconds)], stdout=subprocess.PIPE, text=True)
                     for _ in range(flooders)]
            for p in procs:
                expect_line(p, "ready", "a flooding process")
            time.sleep(0.5)
            t0 = time.monotonic()
            with Client.connect(d.instance, d.run_dir, timeout=10, endpoint=endpoint,
                                curve_server_key_file=server_pub,
                                curve_client_key_file=client_secret) as tcp:
                connect_ms = (time.monotonic() - t0) * 1000
                tcp.ping(timeout=10)
            busy = pings(engine, max(1.0, seconds - 1.0 - connect_ms / 1000))
            tried = sum(int(read_line(p, "a flooding process", seconds + 60) or 0) for p in procs)
            denied = engine.status()["connections"].get("auth_denied", 0)
    finally:
        reap(procs)
        alive = d.alive()
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"flooders": flooders, "handshakes_tried": tried, "handshakes_refused": denied,
            "allowed_connect_ms": round(connect_ms, 1), "ping_idle_p50_ms": pct(idle, 0.5),
            "ping_idle_p99_ms": pct(idle, 0.99), "ping_p50_ms": pct(busy, 0.5),
            "ping_p99_ms": pct(busy, 0.99), "ping_max_ms": pct(busy, 1.0), "daemon_alive": alive}
