"""A client that floods the daemon - with costly frames or with connections - costs the other
clients little and the daemon a bounded amount of memory and files; it never takes the daemon
down. Real daemons, real flooding processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import free_port, small_kv, wait_until
from kvcached.bench.flood import frame_flood, hold_connections, release_connections
from kvcached_client import Client, DaemonUnavailable, KvcachedTimeout, launch
from kvcached_client.launch import _ready
from test_security import keygen

pytestmark = pytest.mark.faults  # fault injection: every test of this module

RSS_BOUND_MIB = 256


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["junk", "layout"])
def test_a_flood_of_costly_frames_leaves_others_served_and_memory_bounded(run_dir, instance, kind):
    """Two processes send 2 MiB frames as fast as the daemon takes them (junk under a name
    that is no field, or a layout past the object budget: 2 M objects each if decoded whole).
    Before, the daemon queued 10,000 (8 MiB) frames per connection (3.4 GiB here) and another client's
    ping took ~1.1 s; now each frame is refused at a bounded cost, a connection may have 4
    queued, one that sent 3 such frames in a row is closed (the flooder reconnects), and every
    ping of the other client is answered (its latency is in bench faults)."""
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05) as d:
        r = frame_flood(d, kind=kind, flooders=2, seconds=4)
        assert r["frames_sent"] > 0 and r["pings"] > 0, r
        assert r["rss_growth_mib"] <= RSS_BOUND_MIB, r
        with d.connect() as c:
            assert c.status()["requests"]["refused"] >= 6, r
        assert "large frames in a row were no valid request" in open(d.log_path).read()


@pytest.mark.slow
def test_a_flood_over_many_connections_is_bounded_and_its_memory_given_back(run_dir, instance):
    """Two processes send 2 MiB junk frames over 32 connections each: the daemon holds at most
    RECV_HWM queued frames and the one it reads per connection at the peak (about one when it
    keeps up; a daemon short of CPU holds more: +665 MiB seen under a loaded suite, within the
    bound; with 8 MiB frames, the cap before, four times that), and once the flood is over it
    gives the heap back (it kept it before: +400 MB for good after 512 such connections)."""
    from kvcached.server.sockets import RECV_HWM

    bound_mib = 64 * (RECV_HWM + 1) * 2 + 96  # 64 connections' frames, and the daemon's own
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05) as d:
        r = frame_flood(d, kind="junk", flooders=2, seconds=3, sockets=32)
        assert r["frames_sent"] > 64 and r["pings"] > 0, r
        assert r["rss_peak_mib"] - r["rss_before_mib"] <= bound_mib, r
        assert r["rss_after_mib"] - r["rss_before_mib"] <= 32, r
        assert "[memory] gave back" in open(d.log_path).read()


def test_a_client_with_one_bad_large_frame_keeps_its_connection(daemon):
    """A client bug (one request past a limit) gets its error reply and goes on being served."""
    from kvcached_proto import ErrorCode, Op, RequestError, pack_keys

    with daemon.connect() as c:
        for _ in range(4):
            with pytest.raises(RequestError) as e:
                c._request(Op.LOOKUP, keys=pack_keys([b"k" * 16] * 70000))  # > 65,536 keys
            assert e.value.code == ErrorCode.TOO_MANY_ITEMS
            assert c.ping() >= 0  # a valid request between: no strikes add up
        assert c.status()["connections"]["open"] == 1
    assert "closing the connection" not in open(daemon.log_path).read()


_LIMITED = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); "
            "os.execv(sys.executable, [sys.executable, '-m', 'kvcached', *sys.argv[1:]])")


class _LimitedDaemon:
    """`kvcached serve` whose open-files limit is 1024, soft and hard (it cannot raise it)."""

    def __init__(self, run_dir, instance, *extra):
        self.run_dir, self.instance = run_dir, instance
        self.log = open(os.path.join(run_dir, "daemon.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", _LIMITED, "serve", "--instance", instance,
                                      "--run-dir", run_dir, "--host-cache-gb", "0.05", *extra],
                                     stdout=self.log, stderr=self.log, start_new_session=True)
        deadline = time.monotonic() + 60
        while not _ready(instance, self.proc.pid):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()
            time.sleep(0.05)

    def text(self) -> str:
        return open(self.log.name, errors="replace").read()

    def connect(self, **kw) -> Client:
        return Client.connect(instance=self.instance, run_dir=self.run_dir, **kw)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.mark.parametrize("socket_name,per_process", [("sock", 64), ("status.sock", 8)])
def test_a_flood_of_ipc_connections_is_refused_past_the_caps_and_the_daemon_lives(
        run_dir, instance, socket_name, per_process):
    """1,200 ipc connections from two processes into a daemon that may open 1,024 files, on the
    request socket or on the status socket (what `kvcached status` asks): each process gets its
    share (64, 8 on the status socket), the rest are refused (logged once per peer a while), and
    another engine connects and is served, and so is a status. Before, libzmq's accept hit
    EMFILE and aborted the daemon (-6): on the request socket until its cap, on the status
    socket until this test."""
    from kvcached.cli_status import fetch_status

    d = _LimitedDaemon(run_dir, instance)
    try:
        sock = os.path.join(run_dir, f"{instance}.{socket_name}")
        flood = [hold_connections("ipc", sock, 600), hold_connections("ipc", sock, 600)]
        try:
            with d.connect(timeout=5) as c:
                assert c.ping() >= 0
                cap = 2 * per_process
                # the daemon counts the accepts as its loop turns: on a busy machine some only
                # after the flood's processes have made them (seen: 1,141 of 1,184 refused)
                wait_until(lambda: c.status()["connections"]["refused"] >= 1200 - cap, 30,
                           "the connections past the caps refused")
                conns = c.status()["connections"]
                assert conns["open"] <= cap + 1 and conns["refused"] >= 1200 - cap, conns
            assert fetch_status(instance, run_dir, timeout=5)["pid"] == d.proc.pid
        finally:
            release_connections(flood)
        assert d.proc.poll() is None
        with d.connect(timeout=5) as c:
            wait_until(lambda: c.status()["connections"]["open"] == 1, 10, "the flood's connections gone")
        said = d.text()
        assert said.count("refused a connection from pid") <= 4
        assert f".{socket_name}: it has {per_process} connections open" in said
    finally:
        assert d.stop() == 0, d.text()


def test_past_the_connection_cap_newcomers_are_refused_and_those_in_keep_their_service(run_dir, instance):
    d = _LimitedDaemon(run_dir, instance, "--max-connections", "40", "--max-connections-per-peer", "1000")
    try:
        with d.connect(timeout=5) as inside:
            flood = [hold_connections("ipc", os.path.join(run_dir, f"{instance}.sock"), 100)]
            try:
                assert inside.ping() >= 0  # connected before: served
                with pytest.raises((DaemonUnavailable, KvcachedTimeout)):
                    d.connect(timeout=1)  # a newcomer while the cap is taken: refused
                assert inside.status()["connections"]["open"] == 40
            finally:
                release_connections(flood)
            wait_until(lambda: inside.status()["connections"]["open"] == 1, 10, "the flood gone")
            with d.connect(timeout=5) as later:
                assert later.ping() >= 0
        assert "--max-connections 40" in d.text()
    finally:
        assert d.stop() == 0, d.text()


def test_a_newcomer_refused_at_the_per_peer_cap_gets_in_once_a_place_frees_within_its_timeout(
        run_dir, instance):
    """A connection shut at the per-peer cap is made again by zmq, and the client's hello waits
    for it as long as the client's timeout: it gets in once another connection of its process
    (on TCP: of its address) closes. Before, the hello gave up after 1 s whatever the timeout:
    an allowed TCP client failed to connect behind a flood of handshakes from its address while
    the flood's closed connections were still counted (seen once in a full run under load)."""
    import threading

    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.01,
                extra_args=["--max-connections-per-peer", "1"]) as d:
        first = d.connect(timeout=5)
        closer = threading.Timer(1.5, first.close)
        closer.start()
        try:
            with d.connect(timeout=8) as later:  # refused until the first closes
                assert later.ping() >= 0
                assert first.status_block is None  # (it did close first)
                # and no client is left registered for a connection shut at the cap
                wait_until(lambda: later.status()["clients"] == 1, 5, "only the newcomer registered")
        finally:
            closer.join(10)
        assert "it has 1 connections open (--max-connections-per-peer 1)" in open(d.log_path).read()


def test_a_hello_that_came_on_a_connection_shut_at_the_cap_registers_no_client(run_dir, instance):
    """The daemon stopped, a connection past the per-peer cap is made and says hello; when it
    goes on, the connection is shut at its accept and its hello, read after that, is refused:
    before, a client was registered for it that nothing would ever drop (its close handled
    already), and its client id stayed taken - the client's next hello, on its next
    connection, got CLIENT_ID_IN_USE."""
    import zmq

    from kvcached.bench import process_stop
    from kvcached_proto import Op, encode, make_request

    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.01,
                extra_args=["--max-connections-per-peer", "1"]) as d, d.connect(timeout=5) as first:
        own = 0  # this test's status calls since `handled` (each counted in its own answer)

        def status() -> dict:
            nonlocal own
            own += 1
            return first.status()
        read = 0  # tries whose hello the daemon read (zmq may drop it with its closed connection)
        for attempt in range(6):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            own, handled = 0, first.status()["requests"]["handled"]
            process_stop.stop(d.pid, "the daemon")
            try:
                sock.connect(f"ipc://{run_dir}/{instance}.sock")
                sock.send(encode(make_request(Op.HELLO, 1, "ghost", pid=os.getpid(), name="", role="engine")))
                time.sleep(0.1)
            finally:
                process_stop.go_on(d.pid, "the daemon")
            wait_until(lambda: status()["connections"]["refused"] >= attempt + 1, 5,
                       "the connection refused")
            deadline = time.monotonic() + 2
            while not read and time.monotonic() < deadline:
                read += status()["requests"]["handled"] - handled - own >= 1
                time.sleep(0.01)
            sock.close()
            assert first.status()["clients"] == 1
            if read:
                break
        assert read, "no ghost's hello was read by the daemon: the check above could not fail"


@pytest.mark.slow
def test_half_open_tcp_connections_never_exhaust_the_daemons_files(run_dir, instance, tmp_path):
    """1,200 TCP connections that never start the CURVE handshake, into a daemon limited to
    1,024 files: never more than 64 open from the address (the rest refused), each closed by
    the daemon after the handshake interval (5 s); an engine on the ipc socket is served
    throughout. (How many are refused in all depends on how fast the daemon drains its accept
    backlog: one accepted and closed after 5 s makes room for another.)"""
    port = free_port()
    secret_dir = tmp_path / "keys"
    secret_dir.mkdir()
    _public, secret = keygen(str(secret_dir), "daemon")
    allow = tmp_path / "allow"
    allow.mkdir()
    keygen(str(allow), "engine")  # an allowed client key (no client here uses it)
    d = _LimitedDaemon(run_dir, instance, "--listen", f"tcp://127.0.0.1:{port}",
                       "--curve-secret-key-file", secret, "--curve-allow-dir", str(allow))
    try:
        engine = d.connect(timeout=5)  # an engine on the ipc socket, registered before the flood
        engine.register_kv_cache(small_kv(num_layers=1, num_blocks=4))
        flood = [hold_connections("tcp", str(port), 600), hold_connections("tcp", str(port), 600)]
        try:
            with engine as c:
                assert c.ping() >= 0
                seen = {"most_open": 0}

                def only_this_one():
                    seen.update(c.status()["connections"])
                    seen["most_open"] = max(seen["most_open"], seen["open"])
                    return seen["open"] == 1

                try:
                    wait_until(only_this_one, 30, "half-open connections closed after the handshake interval")
                except AssertionError as exc:
                    raise AssertionError(f"{exc}; connections last seen: {seen}") from None
                assert seen["most_open"] <= 64 + 1, seen  # the address's cap, and this client
                assert seen["refused"] >= 600, seen
                kv = c.status()["kv"]  # no TCP close was taken for the engine's: it is still in
                assert kv["registered"] and kv["owner"] == c.client_id, kv
        finally:
            release_connections(flood)
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0, d.text()


def test_a_close_read_after_its_fd_was_reused_by_another_listener_uncounts_nothing_else(tmp_path):
    """Each listener has its own monitor: a TCP connection's DISCONNECTED can be read after an
    ipc connection got the same fd number. Counted as the ipc one's close, it uncounted the
    live engine (and the daemon dropped its KV as if it had left); the TCP one stayed counted
    against its address forever. Real sockets, the guard's own checks."""
    import socket

    from kvcached.server.connections import ConnectionGuard

    tcp = socket.create_server(("127.0.0.1", 0))
    tcp_ep = f"tcp://127.0.0.1:{tcp.getsockname()[1]}"
    path = str(tmp_path / "guard.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    unix.listen()
    ipc_ep = f"ipc://{path}"
    guard = ConnectionGuard(max_connections=100, max_per_peer=1)
    peers = []
    try:
        peers.append(socket.create_connection(tcp.getsockname()))
        conn, _ = tcp.accept()
        fd = conn.fileno()
        guard.accepted(fd, tcp_ep)
        assert guard.status()["open"] == 1
        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        peers.append(client)
        conn.close()  # the TCP connection goes; its DISCONNECTED is still queued
        conn2, _ = unix.accept()
        assert conn2.fileno() == fd  # the number is reused at once
        guard.accepted(fd, ipc_ep)  # the ipc monitor is read first
        assert guard.status()["open"] == 1
        assert guard.closed(fd, tcp_ep) is False  # the TCP close, read late: not the engine's
        assert guard.status()["open"] == 1
        peers.append(socket.create_connection(tcp.getsockname()))
        conn3, _ = tcp.accept()
        guard.accepted(conn3.fileno(), tcp_ep)  # the address's cap (1) is free again
        assert guard.status() == {"open": 2, "refused": 0, "max": 100, "max_per_peer": 1,
                                  "unread_closed": 0}
        assert guard.closed(fd, ipc_ep) is True and guard.status()["open"] == 1
        conn2.close()
        conn3.close()
    finally:
        for s in peers + [tcp, unix]:
            s.close()


def _status_flood_unread(run_dir, instance, rcvhwm: int, seconds: float, closed) -> bool:
    """A DEALER that says hello, then sends status requests for `seconds` and reads nothing;
    whether closed() said so meanwhile (asked every 0.25 s)."""
    import msgpack
    import zmq

    from kvcached_proto.paths import request_endpoint

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.connect(request_endpoint(run_dir, instance))
    head = {"proto": [1, 12], "client": f"unread-{rcvhwm}"}
    sock.send(msgpack.packb({**head, "op": 1, "rid": 1, "pid": os.getpid(), "name": "unread"}))
    assert sock.poll(10000) and msgpack.unpackb(sock.recv())["ok"]
    frame, end, ask = msgpack.packb({**head, "op": 3, "rid": 2}), time.monotonic() + seconds, 0.0
    try:
        while time.monotonic() < end:
            if time.monotonic() > ask:
                if closed():
                    return True
                ask = time.monotonic() + 0.25
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.001)
        return False
    finally:
        sock.close()
        ctx.term()


def test_a_connection_that_reads_none_of_its_replies_is_closed(daemon):
    """Replies a client leaves unread wait in the daemon once its socket's buffer is full: a
    client sending status requests without reading grew the daemon by 111 MB (up to the
    100,000 replies of its send queue). Once the buffer has stayed full at its requests for a
    second, the connection is closed. The control: a client whose socket takes the replies off
    the connection as they come (RCVHWM 0, as kvcached_client's) is not closed, however late
    it reads them; and the engine beside them is served throughout."""
    with daemon.connect() as c:
        def closed():
            return c.status()["connections"].get("unread_closed", 0) > 0

        assert not _status_flood_unread(daemon.run_dir, daemon.instance, 0, 3, closed)
        assert _status_flood_unread(daemon.run_dir, daemon.instance, 1, 20, closed)
        assert c.ping() >= 0
    assert "its replies have filled its socket's buffer, unread" in open(daemon.log_path).read()


def test_another_clients_flood_of_blocking_ops_leaves_the_engines_answered(daemon):
    """Deletes run on the control worker. A client pipelining 65,536-key deletes (80 in
    flight) filled its queue: the engine's own deletes were BUSY (9 of 10), and so would its
    unregister or a pause have been. The engine's ops now have a lane of their own, served
    first, and such a client may have 4 queued; the request loop gives the replies their turn
    every 2 ms (256 such frames first kept one 2 s)."""
    import threading

    import msgpack
    import zmq

    from kvcached_proto import Op, pack_keys
    from kvcached_proto.paths import request_endpoint

    stop, answered = threading.Event(), {"ok": 0, "busy": 0}

    def flood():
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(request_endpoint(daemon.run_dir, daemon.instance))
        head = {"proto": [1, 12], "client": "deleter"}
        sock.send(msgpack.packb({**head, "op": 1, "rid": 1, "pid": os.getpid(), "name": "deleter"}))
        assert sock.poll(10000) and msgpack.unpackb(sock.recv())["ok"]
        frame, inflight = msgpack.packb({**head, "op": 30, "rid": 2, "keys": os.urandom(65536 * 16)}), 0
        while not stop.is_set():
            while inflight < 80:
                sock.send(frame)
                inflight += 1
            if sock.poll(100):
                inflight -= 1
                answered["ok" if msgpack.unpackb(sock.recv()).get("ok") else "busy"] += 1
        sock.close()
        ctx.term()

    with daemon.connect() as engine:
        engine.register_kv_cache(small_kv())
        flooder = threading.Thread(target=flood)
        flooder.start()
        try:
            wait_until(lambda: answered["busy"] > 0, 30, "the flooder refused past its share")
            for _ in range(5):
                engine._request(Op.DELETE, 30, keys=pack_keys([os.urandom(16)]))  # never BUSY
            assert engine.status()["connections"]["open"] == 2
        finally:
            stop.set()
            flooder.join(30)
        assert answered["ok"] > 0


def test_the_control_worker_serves_the_engines_lane_first_and_caps_a_client_in_the_others():
    """(Pure logic: a fake event sink.) Ops queued by other clients wait while an engine's,
    queued after them, runs first; one client may have PER_CLIENT queued in the others' lane;
    a stop answers what is left SHUTTING_DOWN, in order."""
    import threading

    from kvcached.errors import OpError
    from kvcached.server.control import ENGINES, OTHERS, PER_CLIENT, ControlWorker

    class Sink:
        def __init__(self):
            self.replies = []

        def emit(self, routing_id, reply):
            self.replies.append((routing_id, reply))

    sink, gate, ran = Sink(), threading.Event(), []
    worker = ControlWorker(sink)
    worker.start()

    def op(name, wait=False):
        def run():
            if wait:
                assert gate.wait(10)
            ran.append(name)
            return {}
        return run

    worker.submit(b"x", 1, op("held", wait=True), OTHERS)  # running: the lanes fill behind it
    wait_until(lambda: worker.queued == 0, 5, "the first op taken")
    for i in range(PER_CLIENT):
        worker.submit(b"r", 10 + i, op(f"r{i}"), OTHERS)
    with pytest.raises(OpError, match="control ops of this client queued"):
        worker.submit(b"r", 99, op("refused"), OTHERS)
    worker.submit(b"s", 20, op("s0"), OTHERS)  # another client: room of its own
    worker.submit(b"e", 30, op("e0"), ENGINES)
    worker.run_later(op("own"))
    gate.set()
    wait_until(lambda: len(ran) == PER_CLIENT + 4, 5, "every op run")
    assert ran == ["held", "e0", "own", *[f"r{i}" for i in range(PER_CLIENT)], "s0"]
    worker.submit(b"r", 40, op("r-again"), OTHERS)  # its ops answered: it may queue again
    wait_until(lambda: "r-again" in ran, 5, "the client's next op")
    gate.clear()
    worker.submit(b"x", 50, op("held2", wait=True), OTHERS)
    wait_until(lambda: worker.queued == 0, 5, "the op taken")
    worker.submit(b"e", 51, op("late"), ENGINES)
    stopper = threading.Thread(target=worker.stop, args=(10,))
    stopper.start()
    gate.set()
    stopper.join(10)
    assert not worker.is_alive() and "late" not in ran
    assert sink.replies[-1][0] == b"e" and sink.replies[-1][1]["error"]["code"] == 10  # SHUTTING_DOWN


def test_the_status_socket_holds_a_few_messages_of_a_connection_each_way(daemon):
    """A status CLI has one request out at a time. A connection that pipelines 3,000 requests
    and reads none got 1,000 replies queued in the daemon (32 such: +42 MB) and could send 1 MB
    frames (+48 MB); now 4 each way, REP dropping the replies past them, and a frame over 64 KiB
    drops the connection. The client then reads only what its socket's buffers took (the
    kernel's, bounded by the daemon's send buffer), the 4 and its own one."""
    import msgpack
    import zmq

    from kvcached_proto.paths import status_endpoint

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.connect(status_endpoint(daemon.run_dir, daemon.instance))
        frame = msgpack.packb({"proto": [1, 14], "op": 3, "rid": 1, "client": "poller"})
        sock.send_multipart([b"", frame])
        assert sock.poll(10000)
        reply_bytes = len(sock.recv_multipart()[1])
        wmem = int(open("/proc/sys/net/core/wmem_default").read())
        bound = 4 + 1 + 2 * wmem // reply_bytes
        if bound >= 1000:
            pytest.skip(f"a send buffer of {wmem} bytes holds as many replies as the old queue")
        for _ in range(3000):
            sock.send_multipart([b"", frame])
        time.sleep(2)  # the daemon answers them all meanwhile
        got = 0
        while sock.poll(500):
            sock.recv_multipart()
            got += 1
        assert 0 < got <= bound, (got, bound)
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(status_endpoint(daemon.run_dir, daemon.instance))
        big.send_multipart([b"", bytes(100_000)])
        assert not big.poll(1000)  # dropped, not answered
    finally:
        ctx.destroy(linger=0)
    with daemon.connect() as c:
        assert c.status()["connections"]["open"] == 1


_SLOW_READER = r'''
import os, sys, time, subprocess, zmq
from kvcached.server.sockets import _router
path = sys.argv[1]
ctx = zmq.Context()
r = _router(ctx)
r.bind(path)
flood = subprocess.Popen([sys.executable, "-c", """
import sys, time, zmq
ctx, end = zmq.Context(), time.time() + 5
while time.time() < end:
    socks = [ctx.socket(zmq.DEALER) for _ in range(20)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(sys.argv[1])
    for _ in range(30):
        for s in socks:
            try:
                s.send(b"x" * 1000, zmq.NOBLOCK)
            except zmq.Again:
                pass
    time.sleep(0.02)
    for s in socks:
        s.close(0)
""", path])
end = time.time() + 6
while time.time() < end:
    if r.poll(5):
        for _ in range(3):  # slower than the flood: each connection's queue stays full
            try:
                r.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
    time.sleep(0.01)
flood.wait()
print("survived")
'''


@pytest.mark.slow
def test_the_request_sockets_survive_a_flood_of_connections_that_fill_and_close(tmp_path):
    """A flood of connections that fill their queue and close, read slower than it comes: a
    request socket with the daemon's settings lives through it. With a ZMTP heartbeat (the
    daemon had one, every 1 s) libzmq aborts the process ("!_io_error", stream_engine_base.cpp:
    310): seen once as the faults bench's daemon dying; this test with the 1 s beat put back
    aborted 3 runs of 3 on an idle machine (fewer under load: the flood is slower then)."""
    out = subprocess.run([sys.executable, "-c", _SLOW_READER, f"ipc://{tmp_path}/r.sock"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "survived" in out.stdout, out.stderr[-2000:]
