"""The /metrics server (kvcached.server.metrics_http): answers, refusals, deadlines and what a
flood of connections or scrapes costs a real daemon."""
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port, unique_instance, wait_until
from kvcached.server import metrics_http
from kvcached.server.metrics_http import MetricsServer
from kvcached_client import launch


@pytest.fixture
def server():
    renders = []

    def render(accept):
        renders.append(accept)
        return f"# render {len(renders)}\nup 1\n".encode(), "text/plain; version=0.0.4"
    srv = MetricsServer("127.0.0.1", 0, render)
    srv.renders = renders
    yield srv
    srv.close()


def _exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def _closed(s: socket.socket) -> bool:
    """The server closed it: an end of file, or a reset (it had not read all that was sent)."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"200"),
    (b"GET /?name[]=up HTTP/1.0\r\n\r\n", b"200"),
    (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405"),
    (b"GET /secrets HTTP/1.1\r\n\r\n", b"404"),
    (b"\x00\xffjunk\r\n\r\n", b"400"),
    (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"431"),
    (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000, b"431"),  # never ends: refused at the cap
])
def test_each_request_gets_its_answer_and_the_connection_closes(server, request_bytes, status):
    got = _exchange(server.port, request_bytes)
    assert got.startswith(b"HTTP/1.1 " + status), got[:80]
    assert (b"up 1" in got) == (status == b"200")
    assert _exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200")


def test_head_answers_the_headers_alone(server):
    got = _exchange(server.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"\r\n\r\n")


def test_scrapes_close_together_share_one_rendering(server, monkeypatch):
    monkeypatch.setattr(metrics_http, "MIN_RENDER_S", 0.5)
    start = time.monotonic()
    bodies = {_exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n").split(b"\r\n\r\n", 1)[1]
              for _ in range(40)}
    windows = int((time.monotonic() - start) / 0.5) + 1
    assert 1 <= len(server.renders) <= windows < 40
    assert len(bodies) == len(server.renders)  # each scrape got a whole rendering
    time.sleep(0.55)
    after = _exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")
    assert f"# render {len(server.renders)}".encode() in after  # a new one once the old is stale
    # the format follows the scraper's Accept header, each rendered for itself
    _exchange(server.port, b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text\r\n\r\n")
    assert server.renders[-1] == "application/openmetrics-text"


def test_distinct_accept_headers_of_one_format_share_its_rendering():
    """A flood that varies its Accept header must not cost a rendering (a status snapshot under
    the host tier's lock) per scrape: renderings are shared by the format the header gets."""
    from kvcached.server.metrics import Metrics

    metrics = Metrics("i", lambda: {"tasks": {}, "kv": {}, "host": {"used_bytes": 0,
                                                                    "capacity_bytes": 0}},
                      0, "127.0.0.1")
    renders = []
    render = metrics.render
    srv = MetricsServer("127.0.0.1", 0, lambda a: renders.append(a) or render(a), metrics.format_of)
    try:
        for i in range(30):
            got = _exchange(srv.port, f"GET /metrics HTTP/1.1\r\nAccept: text/plain;q=0.{i + 1}"
                                      "\r\n\r\n".encode())
            assert got.startswith(b"HTTP/1.1 200") and b"kvcached_clients" in got
        assert len(renders) <= 3  # one per MIN_RENDER_S window at most, not 30
    finally:
        srv.close()


def test_a_connection_that_never_finishes_its_request_is_closed_at_the_deadline(server, monkeypatch):
    monkeypatch.setattr(metrics_http, "DEADLINE_S", 0.3)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and no end of headers
        start = time.monotonic()
        assert _closed(s)  # by the server
        assert time.monotonic() - start < 3
    wait_until(lambda: server.counts["expired"] == 1, 10)


def test_past_the_connection_cap_the_oldest_goes_and_a_scrape_is_answered(server, monkeypatch):
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 8)
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
    try:
        for s in held:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert _exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200")
        assert server.counts["evicted"] >= 13
        assert _closed(held[0])  # the oldest were closed
    finally:
        for s in held:
            s.close()


_FLOOD = r"""
import socket, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
held, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=0.5)
        s.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request that never ends
        held.append(s)
    except OSError:
        time.sleep(0.01)
print(len(held), flush=True)
time.sleep(30)
"""


def test_a_flood_of_unfinished_requests_costs_the_daemon_no_thread(run_dir):
    """prometheus_client's server held a thread per connection, without a deadline: anyone on
    the machine could pile up the daemon's threads (its user's process limit, the engine's).
    Now the daemon's threads stay as they were, a real scrape is answered during the flood and
    the daemon answers its clients."""
    port = free_port()
    h = launch(instance=unique_instance("mf"), run_dir=run_dir, host_cache_gb=0.05,
               extra_args=["--metrics-port", str(port)])
    flood = None
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        urllib.request.urlopen(url, timeout=10).read()
        threads = len(os.listdir(f"/proc/{h.pid}/task"))
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, str(port), "3"], stdout=subprocess.PIPE,
                                 text=True)
        held = int(flood.stdout.readline())
        assert len(os.listdir(f"/proc/{h.pid}/task")) <= threads + 1, f"{held} connections held"
        assert held > 100  # the flood got its connections in
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert any(f.name == "kvcached_clients" for f in text_string_to_metric_families(body))
        with h.connect() as c:
            c.ping()
    finally:
        if flood is not None:
            flood.kill()
            flood.wait(10)
        h.stop()
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
        raise AssertionError("the /metrics port still answers after the daemon stopped")
    except (urllib.error.URLError, ConnectionError):
        pass


def test_an_error_serving_one_connection_costs_that_connection_only(server, monkeypatch):
    answer = server._answer
    monkeypatch.setattr(server, "_answer", lambda head: 1 / 0)
    assert _exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n") == b""  # closed, no answer
    monkeypatch.setattr(server, "_answer", answer)
    assert _exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200")


def test_health_answers_from_the_check_it_was_given_and_renders_nothing():
    said = [(True, "normal")]

    def check():
        if isinstance(said[0], Exception):
            raise said[0]
        return said[0]
    srv = MetricsServer("127.0.0.1", 0, lambda accept: (b"up 1\n", "text/plain"), health=check)
    try:
        got = _exchange(srv.port, b"GET /health HTTP/1.1\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"\r\n\r\nnormal\n")
        said[0] = (False, "stalled: the request loop has not turned for 6.0 s")
        got = _exchange(srv.port, b"GET /health?verbose=1 HTTP/1.1\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 503") and got.endswith(b"for 6.0 s\n")
        head = _exchange(srv.port, b"HEAD /health HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and head.endswith(b"\r\n\r\n")
        said[0] = RuntimeError("a bug")
        assert _exchange(srv.port, b"GET /health HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 500")
        assert srv.counts["renders"] == 0 and srv.counts["served"] == 3
    finally:
        srv.close()
    plain = MetricsServer("127.0.0.1", 0, lambda accept: (b"up 1\n", "text/plain"))
    try:  # a server given no check has no /health
        assert _exchange(plain.port, b"GET /health HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
    finally:
        plain.close()


def test_the_health_a_daemon_reports():
    from kvcached.server.status_report import health

    assert health("normal", 0.1, False, 5.0) == (True, "normal")
    assert health("paused", 0.1, False, 5.0) == (True, "paused")  # an operator's pause serves
    assert health("normal", 5.5, False, 5.0) == (False, "stalled: the request loop has not "
                                                       "turned for 5.5 s")
    assert health("normal", 9.0, True, 5.0) == (False, "stopping")  # a stop's drain: not stalled
    assert health("stopping", 0.1, False, 5.0) == (False, "stopping")
    assert health("starting", 60.0, False, 5.0) == (False, "starting")  # (its pool pinned meanwhile)


def test_a_daemons_health_endpoint(run_dir):
    """200 and its state while it serves (paused too); no port after its stop."""
    port = free_port()
    h = launch(instance=unique_instance("mh"), run_dir=run_dir, host_cache_gb=0.05,
               extra_args=["--metrics-port", str(port)])
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200 and r.read() == b"normal\n"
        with h.connect(role="operator") as c:
            c.pause()
            assert urllib.request.urlopen(url, timeout=10).read() == b"paused\n"
            c.resume()
        assert urllib.request.urlopen(url, timeout=10).read() == b"normal\n"
    finally:
        h.stop()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(url, timeout=2)


def test_late_heartbeats_are_counted_in_status_and_metrics(run_dir):
    """A daemon stopped 0.6 s (SIGSTOP) beats late once: status and /metrics count it and the
    longest gap covers the stop."""
    from kvcached.bench import process_stop

    port = free_port()
    h = launch(instance=unique_instance("mb"), run_dir=run_dir, host_cache_gb=0.05,
               extra_args=["--metrics-port", str(port)])

    def scraped() -> dict:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples
                if s.name.startswith("kvcached_heartbeat")}
    try:
        with h.connect(role="operator") as c:
            before = c.status()["heartbeat_late_beats"]
            process_stop.stop(h.pid)
            time.sleep(0.6)
            process_stop.go_on(h.pid)
            # The late beat is counted when the heartbeat thread runs again; on a loaded machine
            # the request loop may answer first, so the count is awaited (bounded).
            deadline = time.monotonic() + 10
            status = c.status()
            while status["heartbeat_late_beats"] < before + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
                status = c.status()
            assert status["heartbeat_late_beats"] >= before + 1
            assert status["heartbeat_max_gap_s"] >= 0.55
            time.sleep(0.3)  # (a rendering is shared for 0.25 s)
            got = scraped()
            assert got["kvcached_heartbeat_late_total"] >= before + 1
            assert got["kvcached_heartbeat_max_gap_seconds"] >= 0.55
        table = subprocess.run([sys.executable, "-m", "kvcached", "status", "--instance", h.instance,
                                "--run-dir", run_dir], capture_output=True, text=True, timeout=30).stdout
        assert re.search(r"\nheartbeat +[1-9]\d* beats late \(over 0.25 s\), the longest gap \d+\.\d\d s", table), table
    finally:
        h.stop()
