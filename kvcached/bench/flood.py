"""The flood cases of `kvcached bench faults`: what one client's flood costs the others.

- frames: flooding processes send costly frames as fast as the daemon takes them while this
  process pings it; what comes out is the ping's latency under the flood against the same
  ping idle (same run), and the daemon's memory before, at its peak and after. Kinds:
  `junk`, 2 MiB of small nested arrays under a name that is no field (2 M objects to decode),
  `layout`, a register_kv whose layout holds more objects than a layout may, and `notes`, the
  largest valid lookup_notes (1,024 lookups of 32 keys, each asked 8 times; before a message
  was bounded, 65,536 one-key lookups held the daemon up to 0.95 s), and `unread`, status
  requests from a socket that reads none of the replies (RCVHWM 1: they waited in the daemon,
  +111 MB in seconds, before such a connection was closed). `junk` over many connections
  (bench faults: 4 processes x 32) shows what the daemon holds of one frame per connection at
  its peak, and that it gives that back once the flood is over (heap_trim.py).
- blocking ops (blocking_flood): a process keeps 80 deletes of 65,536 keys in flight (each
  ~64 ms of the control worker) while the engine deletes a key at a time; what its deletes
  wait, and how many were refused (9 of 10 were BUSY before the engine's lane).
- status: processes asking the status socket for the status as fast as it answers (each answer
  was a snapshot under the host lock; one serves 20 ms now) while this process pings.
- connections (connection_flood): a process opens ipc connections far past the daemon's cap
  and holds them while another client connects and pings.
- /metrics (metrics_flood): a process holds connections to the metrics port that never send a
  request while another scrapes from many threads; a client's ping under it against idle, the
  daemon's threads, and how many scrapes were answered.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from kvcached_client import Client

from . import expect_line, read_line

_FLOODER = """
import sys, time, msgpack, zmq
endpoint, kind, seconds, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
head = {"proto": [1, 7], "op": 5, "rid": 1, "client": "flood"}
if kind == "junk":
    frame = msgpack.packb({**head, "junk": [[0] * 2000] * 1024})
elif kind == "notes":  # valid, from a client that said hello
    import os, struct
    head = {"proto": [1, 11], "op": 26, "rid": 2, "client": f"flood-{os.getpid()}"}
    frame = msgpack.packb({**head, "keys": os.urandom(32768 * 16),
                           "counts": struct.pack("<1024i", *[32] * 1024),
                           "repeats": struct.pack("<1024i", *[8] * 1024)})
elif kind == "unread":  # status requests; no reply is read
    frame = msgpack.packb({**head, "proto": [1, 12], "op": 3})
else:
    frame = msgpack.packb({**head, "layout": {"tensors": [[0] * 2000] * 1024}})
ctx = zmq.Context()
poller, socks = zmq.Poller(), []
for _ in range(n):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 4)
    s.setsockopt(zmq.RCVHWM, 1 if kind == "unread" else 1000)
    s.connect(endpoint)
    poller.register(s, zmq.POLLOUT)
    socks.append(s)
if kind == "notes":
    s.send(msgpack.packb({**head, "op": 1, "rid": 1, "pid": os.getpid(), "name": "flood"}))
    assert s.poll(10000) and msgpack.unpackb(s.recv())["ok"], "the flooder's hello"
print("ready", flush=True)
sent, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    for s, _ in poller.poll(200):
        s.send(frame, zmq.NOBLOCK, copy=False)
        sent += 1
        while kind != "unread" and s.poll(0, zmq.POLLIN):
            s.recv()
print(sent, flush=True)
for s in socks:
    s.close(0)
ctx.term()
"""


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _RssPeak(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self._done = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.05):
            self.peak = max(self.peak, rss_mib(self.pid))

    def stop(self) -> float:
        self._done.set()
        self.join(2)
        return self.peak


def reap(procs) -> None:
    """Wait for the flooding processes (30 s each at most, then killed)."""
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def pings(c: Client, seconds: float, gap_s: float = 0.005) -> list[float]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(c.ping(timeout=10) * 1000)
        time.sleep(gap_s)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else 0.0


_STATUS_ASKER = """
import sys, time, msgpack, zmq
endpoint, seconds = sys.argv[1], float(sys.argv[3])
frame = msgpack.packb({"proto": [1, 11], "op": 3, "rid": 1, "client": "status-flood"})  # status
ctx = zmq.Context()
s = ctx.socket(zmq.REQ)
s.setsockopt(zmq.LINGER, 0)
s.connect(endpoint)
print("ready", flush=True)
sent, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    s.send(frame)
    if not s.poll(2000):
        break
    s.recv()
    sent += 1
print(sent, flush=True)
s.close(0)
ctx.term()
"""


def frame_flood(d, kind: str = "junk", flooders: int = 2, seconds: float = 10.0,
                sockets: int = 1) -> dict:
    """Flood daemon `d` (a DaemonHandle) from `flooders` processes, each over `sockets`
    connections; ping it meanwhile (kind `status`: the status socket, each process asking as
    fast as it is answered, one connection). The memory after is the daemon's 2 s after."""
    endpoint = f"ipc://{d.run_dir}/{d.instance}.{'status.' if kind == 'status' else ''}sock"
    script = _STATUS_ASKER if kind == "status" else _FLOODER
    with Client.connect(instance=d.instance, run_dir=d.run_dir) as c:
        idle = pings(c, 1.0)
        before = rss_mib(d.pid)
        peak = _RssPeak(d.pid)
        peak.start()
        procs = [subprocess.Popen([sys.executable, "-c", script, endpoint, kind, str(seconds),
                                   str(sockets)],
                                  stdout=subprocess.PIPE, text=True) for _ in range(flooders)]
        try:
            for p in procs:
                expect_line(p, "ready", "a flooding process")
            busy = pings(c, seconds)
            sent = sum(int(read_line(p, "a flooding process", 60) or 0) for p in procs)
        finally:
            reap(procs)
        high = peak.stop()
        time.sleep(2.0)
        after = rss_mib(d.pid)
        status = c.status()
    return {"kind": kind, "flooders": flooders, "sockets": sockets, "seconds": seconds,
            "frames_sent": sent,
            "frames_refused": status.get("requests", {}).get("refused", 0),
            "pings": len(busy), "ping_idle_p99_ms": pct(idle, 0.99),
            "ping_p50_ms": pct(busy, 0.5), "ping_p99_ms": pct(busy, 0.99),
            "ping_max_ms": pct(busy, 1.0), "rss_before_mib": round(before),
            "rss_peak_mib": round(high), "rss_after_mib": round(after),
            "rss_growth_mib": round(max(high, after) - before),
            "unread_closed": status.get("connections", {}).get("unread_closed", 0)}


_DELETER = """
import os, sys, time, msgpack, zmq
endpoint, seconds = sys.argv[1], float(sys.argv[2])
head = {"proto": [1, 12], "client": f"deleter-{os.getpid()}"}
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect(endpoint)
s.send(msgpack.packb({**head, "op": 1, "rid": 1, "pid": os.getpid(), "name": "deleter"}))
assert s.poll(10000) and msgpack.unpackb(s.recv())["ok"], "the deleter's hello"
frame = msgpack.packb({**head, "op": 30, "rid": 2, "keys": os.urandom(65536 * 16)})
print("ready", flush=True)
done, busy, inflight, end = 0, 0, 0, time.monotonic() + seconds
while time.monotonic() < end:
    while inflight < 80:
        s.send(frame)
        inflight += 1
    if s.poll(100):
        inflight -= 1
        if msgpack.unpackb(s.recv()).get("ok"):
            done += 1
        else:
            busy += 1
print(done, busy, flush=True)
s.close(0)
ctx.term()
"""


def blocking_flood(d, engine: Client, seconds: float = 8.0) -> dict:
    """A process keeps 80 deletes of 65,536 random keys in flight on daemon `d` while `engine`
    (a client with KV registered) deletes one key every 50 ms: its deletes' time and refusals."""
    from kvcached_proto import Busy, Op, pack_keys

    p = subprocess.Popen([sys.executable, "-c", _DELETER, f"ipc://{d.run_dir}/{d.instance}.sock",
                          str(seconds)], stdout=subprocess.PIPE, text=True)
    waits, refused = [], 0
    try:
        expect_line(p, "ready", "the deleting process")
        end = time.monotonic() + seconds - 1
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                engine._request(Op.DELETE, 30, keys=pack_keys([os.urandom(16)]))
                waits.append((time.perf_counter() - t0) * 1000)
            except Busy:
                refused += 1
            time.sleep(0.05)
        done, busy = (int(x) for x in read_line(p, "the deleting process", 60).split())
    finally:
        reap([p])
    return {"seconds": seconds, "flood_deletes_done": done, "flood_deletes_busy": busy,
            "engine_deletes": len(waits), "engine_refused": refused,
            "engine_delete_p50_ms": pct(waits, 0.5), "engine_delete_max_ms": pct(waits, 1.0)}


_HOLDER = """
import resource, socket, sys
kind, target, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = []
for _ in range(n):
    if kind == "ipc":
        s = socket.socket(socket.AF_UNIX)
        s.connect(target)
    else:
        s = socket.create_connection(("127.0.0.1", int(target)))
    held.append(s)  # never a word: a half-open zmq peer
print("holding", flush=True)
sys.stdin.read()
"""


def hold_connections(kind: str, target: str, n: int) -> subprocess.Popen:
    """A process holding n connections that never speak (kind ipc: target is the socket's
    path; tcp: a port on 127.0.0.1) until its stdin is closed."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, kind, target, str(n)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        expect_line(p, "holding", "a process holding connections")
    except RuntimeError:
        p.kill()
        p.wait()
        raise
    return p


def release_connections(procs) -> None:
    for p in procs:
        p.stdin.close()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def connection_flood(d, processes: int = 2, each: int = 600) -> dict:
    """`processes` processes hold `each` silent ipc connections to daemon `d`; meanwhile a new
    engine connects and pings."""
    sock = f"{d.run_dir}/{d.instance}.sock"
    procs = [hold_connections("ipc", sock, each) for _ in range(processes)]
    try:
        t0 = time.monotonic()
        with Client.connect(instance=d.instance, run_dir=d.run_dir, timeout=10) as c:
            connect_ms = (time.monotonic() - t0) * 1000
            ping_ms = c.ping() * 1000
            during = c.status()["connections"]
    finally:
        release_connections(procs)
    return {"connections_tried": processes * each, "open_during": during["open"],
            "refused": during["refused"], "max_per_peer": during["max_per_peer"],
            "newcomer_connect_ms": round(connect_ms, 2), "newcomer_ping_ms": round(ping_ms, 3),
            "daemon_alive": d.alive()}


_SCRAPER = """
import sys, threading, time, urllib.request
url, threads, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
done, failed, end = [0], [0], time.monotonic() + seconds
def scrape():
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(url, timeout=10).read()
            done[0] += 1
        except OSError:
            failed[0] += 1
print("ready", flush=True)
ts = [threading.Thread(target=scrape) for _ in range(threads)]
[t.start() for t in ts]
[t.join() for t in ts]
print(done[0], failed[0], flush=True)
"""


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def metrics_flood(d, port: int, scrapers: int = 16, held: int = 1000, seconds: float = 8.0) -> dict:
    """Daemon `d` serves /metrics on `port`: one process holds `held` connections there that
    never send a request, another scrapes from `scrapers` threads for `seconds`; meanwhile a
    client pings."""
    with Client.connect(instance=d.instance, run_dir=d.run_dir) as c:
        idle = pings(c, 1.0)
        threads_before = _threads(d.pid)
        holder = hold_connections("tcp", str(port), held)
        scraper = subprocess.Popen([sys.executable, "-c", _SCRAPER, f"http://127.0.0.1:{port}/metrics",
                                    str(scrapers), str(seconds)], stdout=subprocess.PIPE, text=True)
        try:
            expect_line(scraper, "ready", "the scraping process")
            busy = pings(c, seconds)
            threads_during = _threads(d.pid)
            answered, failed = (int(x) for x in read_line(scraper, "the scraping process", 60).split())
        finally:
            release_connections([holder])
            scraper.kill()
            scraper.wait()
    return {"held": held, "scrapers": scrapers, "seconds": seconds, "scrapes_answered": answered,
            "scrapes_failed": failed, "ping_idle_p50_ms": pct(idle, 0.5),
            "ping_idle_p99_ms": pct(idle, 0.99), "ping_p50_ms": pct(busy, 0.5),
            "ping_p99_ms": pct(busy, 0.99), "threads_before": threads_before,
            "threads_during": threads_during, "daemon_alive": d.alive()}
