"""The daemon as a process: start, handshake, status, stop, crash, restart, side by side."""
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from conftest import sweep_crashed, unique_instance, wait_until
from kvcached_client import Client, DaemonUnavailable, KvcachedError, launch
from kvcached_client.launch import _ready
from kvcached_client.status_block import DEFAULT_HANG_S, hang_threshold
from kvcached_proto.liveness import pid_namespace, start_ticks
from kvcached_proto.shm_layout import SEGMENT_BYTES, Flag, StatusView, segment_name
from kvcached_proto.paths import socket_paths
from kvcached.bench import process_stop

STATUS_KEYS = {"instance", "pid", "epoch", "state", "protocol_version", "host", "kv", "storage",
               "clients", "tasks"}


def _segment(instance):
    return f"/dev/shm/kvcached.{os.getuid()}.{instance}"


def _cli(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "kvcached", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_launch_hello_status_stop(daemon):
    with daemon.connect() as c:
        assert c.info["instance"] == daemon.instance
        assert c.info["pid"] == daemon.pid
        assert c.info["protocol_version"] == [1, 15]
        assert c.ping() < 1.0
        status = c.status()
        assert STATUS_KEYS <= status.keys()
        assert status["clients"] == 1 and status["state"] == "normal"
        assert {"capacity_bytes", "used_bytes"} <= status["host"].keys()
        assert set(status["tasks"]) >= {"queued", "inflight", "completed", "failed"}
    assert daemon.stop() == 0
    assert not os.path.exists(_segment(daemon.instance))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_leaves_no_socket_and_no_segment(daemon, signum):
    """SIGTERM, and SIGHUP (a terminal closed: before, it killed the daemon on the spot)."""
    assert os.path.exists(_segment(daemon.instance))
    os.kill(daemon.pid, signum)
    daemon.proc.wait(10)
    assert daemon.proc.returncode == 0
    assert not os.path.exists(_segment(daemon.instance))
    for path in socket_paths(daemon.run_dir, daemon.instance):
        assert not os.path.exists(path)
    assert os.listdir(daemon.run_dir) == []


def test_run_dir_socket_and_segment_are_private(daemon):
    assert stat.S_IMODE(os.stat(daemon.run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(_segment(daemon.instance)).st_mode) == 0o600
    for path in socket_paths(daemon.run_dir, daemon.instance):
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0


def test_kill_9_makes_the_next_call_raise_within_a_second(daemon):
    c = daemon.connect(timeout=30.0)
    try:
        daemon.kill()
        start = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            c.ping()
        assert time.monotonic() - start < 1.0
    finally:
        c.close()


def test_a_hung_daemon_is_seen_through_its_heartbeat(daemon):
    c = daemon.connect(timeout=30.0)
    process_stop.stop(daemon.pid)
    try:
        start = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="heartbeat"):
            c.ping()
        assert time.monotonic() - start < DEFAULT_HANG_S + 1.0
    finally:
        process_stop.go_on(daemon.pid)
        c.close()


@pytest.mark.faults
def test_connecting_right_after_kill_9_is_refused_by_the_recorded_identity(daemon):
    """The heartbeat is still fresh and the up flag still set: the pid and start time the
    daemon recorded tell that it is gone (before, the connect waited out the send timeout)."""
    with daemon.connect() as c:
        assert c.status_block.pid_start == start_ticks(daemon.pid) and c.status_block.pid_visible
    daemon.kill()
    with pytest.raises(DaemonUnavailable, match="has exited"):
        Client.connect(instance=daemon.instance, run_dir=daemon.run_dir)


def _fake_segment(instance, pid, pid_start):
    """A segment whose header names (pid, pid_start), beating now, flag up: what a killed
    daemon leaves for its first seconds."""
    import mmap

    import posix_ipc

    shm = posix_ipc.SharedMemory(segment_name(os.getuid(), instance), posix_ipc.O_CREX,
                                 mode=0o600, size=SEGMENT_BYTES)
    with mmap.mmap(shm.fd, SEGMENT_BYTES) as mm:
        view = StatusView(mm)
        view.init_header(pid, 12345, pid_start, pid_namespace())
        view.set_heartbeat(time.monotonic_ns())
        view.set_flag(Flag.UP)
        view.release()
    shm.close_fd()


def test_a_reused_pid_does_not_keep_a_dead_daemon_alive(run_dir, instance):
    """The recorded pid now belongs to a live process that started at another time (a pid
    reused after the daemon died): clients see a dead daemon, a new daemon sweeps the segment."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        _fake_segment(instance, other.pid, start_ticks(other.pid) + 1)
        with pytest.raises(DaemonUnavailable, match="has exited"):
            Client.connect(instance=instance, run_dir=run_dir)
        successor = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.1)
        try:
            with successor.connect() as c:
                assert c.info["pid"] == successor.pid
        finally:
            successor.stop()
    finally:
        other.kill()
        other.wait()
        if os.path.exists(_segment(instance)):
            os.unlink(_segment(instance))


def test_the_recorded_live_process_keeps_the_instance(run_dir, instance):
    """The same pid and start time: the instance is taken, a second daemon is refused."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        _fake_segment(instance, other.pid, start_ticks(other.pid))
        with pytest.raises(KvcachedError, match="already running"):
            launch(instance=instance, run_dir=run_dir, host_cache_gb=0.1)
    finally:
        other.kill()
        other.wait()
        os.unlink(_segment(instance))


def test_the_hang_threshold_is_a_setting(daemon, monkeypatch):
    c = daemon.connect(timeout=30.0, hang_s=0.4)
    process_stop.stop(daemon.pid)
    try:
        with pytest.raises(DaemonUnavailable, match="hang threshold is 0.4 s"):
            c.ping()
    finally:
        process_stop.go_on(daemon.pid)
        c.close()
    monkeypatch.setenv("KVCACHED_HANG_S", "0.7")
    assert hang_threshold() == 0.7 and hang_threshold(1.5) == 1.5
    monkeypatch.setenv("KVCACHED_HANG_S", "soon")
    with pytest.raises(ValueError, match="KVCACHED_HANG_S"):
        hang_threshold()
    monkeypatch.delenv("KVCACHED_HANG_S")
    assert hang_threshold() == DEFAULT_HANG_S


@pytest.mark.faults
def test_a_new_daemon_takes_over_after_kill_9(run_dir, instance):
    first = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.1)
    first.kill()
    assert os.path.exists(_segment(instance))  # left behind by the crash
    second = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.1)
    try:
        with second.connect() as c:
            assert c.info["pid"] == second.pid
            assert c.ping() < 1.0
    finally:
        second.stop()
    assert not os.path.exists(_segment(instance))


def test_a_second_daemon_with_the_same_name_refuses_to_start(daemon):
    with pytest.raises(KvcachedError, match="already running"):
        launch(instance=daemon.instance, run_dir=daemon.run_dir, host_cache_gb=0.1)
    with daemon.connect() as c:  # the first one is unharmed
        assert c.ping() < 1.0


def test_two_instances_side_by_side_do_not_interfere(run_dir):
    a = launch(instance=unique_instance("a"), run_dir=run_dir, host_cache_gb=0.1)
    b = launch(instance=unique_instance("b"), run_dir=run_dir, host_cache_gb=0.1)
    try:
        ca, cb = a.connect(), b.connect()
        assert ca.info["pid"] == a.pid and cb.info["pid"] == b.pid
        assert ca.epoch != cb.epoch
        b.stop()
        assert ca.ping() < 1.0 and ca.status()["instance"] == a.instance
        ca.close()
        cb.close()
    finally:
        a.stop()
        b.stop()


def test_launch_of_a_daemon_that_fails_at_start_raises_at_once(run_dir, instance):
    start = time.monotonic()
    with pytest.raises(KvcachedError, match="exited with code") as e:
        launch(instance=instance, run_dir=run_dir, extra_args=["--host-layout", "sideways"])
    assert "sideways" in str(e.value)  # the daemon's own error is in the message
    assert time.monotonic() - start < 30


def test_a_start_refused_for_a_running_instance_never_imports_torch(daemon):
    """The checks a start can fail (a running instance, the run dir, the allow dir, a port in
    use) come before the service, whose modules import torch: such a refusal is said in a few
    tenths of a second instead of after torch's import (1.1 s of one core)."""
    code = ("import sys; from kvcached.cli import main; "
            f"rc = main(['serve', '--instance', {daemon.instance!r}, '--run-dir', {daemon.run_dir!r}, "
            "'--host-cache-gb', '0.1']); print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["1", "False"], (done.stdout, done.stderr)
    assert "already running" in done.stderr


def test_a_stop_wakes_every_thread_it_waits_for(run_dir, instance, tmp_path):
    """SIGTERM ends the daemon at once, not at the request loop's next poll timeout nor those of
    the status, fd and /metrics threads: here every one of them polls for 10 minutes, and the
    daemon must still exit within a minute, cleanly (each thread ended, none left running)."""
    code = ("import kvcached.server.daemon as d, kvcached.server.status as s, "
            "kvcached.server.fd_inbox as f, kvcached.server.metrics_http as m; "
            "d.POLL_MS = s.POLL_MS = 600_000; f.POLL_S = m.POLL_S = 600.0; "
            "from kvcached.cli import main; "
            f"main(['serve', '--instance', {instance!r}, '--run-dir', {run_dir!r}, "
            "'--host-cache-gb', '0.05', '--metrics-port', '0'])")
    with open(tmp_path / "daemon.log", "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log_file, stderr=log_file,
                                start_new_session=True)
    try:
        wait_until(lambda: _ready(instance, proc.pid), 60, "the daemon ready")
        time.sleep(0.5)  # every thread in its poll
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
            sweep_crashed(instance)
    said = (tmp_path / "daemon.log").read_text()
    assert "did not stop" not in said and f"instance {instance} stopped" in said, said


def test_connect_without_a_daemon_is_daemon_unavailable(run_dir):
    with pytest.raises(DaemonUnavailable, match="no kvcached daemon"):
        Client.connect(instance=unique_instance("none"), run_dir=run_dir)


def test_non_loopback_listen_is_refused(run_dir, instance):
    with pytest.raises(KvcachedError, match="CURVE"):
        launch(instance=instance, run_dir=run_dir, extra_args=["--listen", "tcp://0.0.0.0:5555"])


def test_cli_status_json_and_table_and_stop(daemon):
    out = _cli("status", "--instance", daemon.instance, "--run-dir", daemon.run_dir, "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert STATUS_KEYS <= status.keys() and status["pid"] == daemon.pid
    table = _cli("status", "--instance", daemon.instance, "--run-dir", daemon.run_dir)
    assert "state" in table.stdout and "normal" in table.stdout
    stop = _cli("stop", "--instance", daemon.instance, "--run-dir", daemon.run_dir)
    assert stop.returncode == 0, stop.stderr
    daemon.proc.wait(10)
    assert not os.path.exists(_segment(daemon.instance))


def test_a_shutdown_whose_reply_is_lost_to_the_daemons_exit_succeeds(daemon):
    """The daemon exits right after it answers a shutdown, and libzmq drops a reply the client
    had not read when the connection closed (the client's sockets are IMMEDIATE): `kvcached
    stop` said "the daemon has exited" under load. A daemon gone after the request left did
    what was asked. Here it dies with the request unread (stopped, then killed)."""
    c = daemon.connect(role="operator")
    try:
        os.kill(daemon.pid, signal.SIGSTOP)
        said = []
        asker = threading.Thread(target=lambda: said.append(_outcome(c.shutdown, 30)))
        asker.start()
        time.sleep(0.3)  # the request sent to a stopped daemon (well within the hang threshold)
        daemon.kill()
        asker.join(30)
        assert said == [None]
    finally:
        c.close()
        sweep_crashed(daemon.instance)


def _outcome(call, *args):
    try:
        call(*args)
    except Exception as exc:  # (the assertion shows it)
        return exc
    return None


def test_cli_status_without_a_daemon_fails_clearly(run_dir):
    out = _cli("status", "--instance", unique_instance("none"), "--run-dir", run_dir,
               "--timeout", "0.3")
    assert out.returncode == 3 and "no daemon" in out.stderr


def test_numa_binding_of_the_host_pool(run_dir, instance):
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=["--numa", "0"])
    try:
        maps = open(f"/proc/{h.pid}/numa_maps").read()
        assert "bind:0" in maps  # the pool's mapping carries the policy
    finally:
        h.stop()


def test_a_numa_node_that_does_not_exist_is_refused(run_dir, instance):
    with pytest.raises(KvcachedError, match="NUMA node 63 does not exist"):
        launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=["--numa", "63"])


@pytest.mark.slow
def test_a_client_that_reconnects_at_once_is_not_taken_for_the_one_that_left(daemon):
    """A new connection often gets the fd the closed one had; the close's monitor event must
    not be read as the new client's (before the fix ~1 in 4 rounds lost the new client's
    hello and its register answered NOT_HELLO): 20 rounds miss a 1-in-4 race with p < 0.004."""
    from conftest import small_kv

    kv = small_kv(num_layers=1, num_blocks=4)
    for _ in range(20):
        with daemon.connect() as c:
            c.register_kv_cache(kv)
            assert c.status()["kv"]["owner"] == c.client_id
        with daemon.connect() as c2:
            c2.register_kv_cache(kv)  # raised NOT_HELLO when taken for the one that left
            assert c2.status()["kv"]["owner"] == c2.client_id and c2.ping() < 5


def test_a_stop_says_the_instance_stopped(run_dir, instance):
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
    log_path = h.log_path
    h.keep_log = True
    try:
        assert h.stop() == 0
        with open(log_path) as f:
            assert f"[shutdown] instance {instance} stopped" in f.read()
    finally:
        os.unlink(log_path)


def test_an_engine_looking_in_another_run_dir_is_told_where_the_daemon_is(daemon, tmp_path, caplog):
    """The daemon's status segment is named by the instance alone, so an engine whose run dir
    differs found it but never its socket: zero hits forever, one INFO line. Now it is told at
    once where the daemon runs, and a watching reattacher says it at WARNING."""
    import logging
    import time

    from kvcached_client.run_dir_hint import WrongRunDir

    elsewhere = str(tmp_path / "elsewhere")
    t0 = time.monotonic()
    with pytest.raises(WrongRunDir) as e:
        Client.connect(daemon.instance, elsewhere, timeout=5)
    assert time.monotonic() - t0 < 1.0  # not the send timeout
    assert f"is running in run dir {daemon.run_dir}, not in {elsewhere}" in str(e.value)
    with caplog.at_level(logging.INFO, logger="kvcached_client.reattach"):
        r = Client.reattacher(instance=daemon.instance, run_dir=elsewhere, name="engine")
        try:
            assert r.attach_now() is None
        finally:
            r.close()
    assert any(rec.levelno == logging.WARNING and "is running in run dir" in rec.getMessage()
               for rec in caplog.records)


_SAYS_BYE_THEN_DIES = """
import sys, time, torch
from kvcached_client import Client, allocate_kv_cache
kv = allocate_kv_cache(2, 8, (16, 2, 8), torch.float16)
c = Client.connect(sys.argv[1], sys.argv[2], timeout=10)
c.register_kv_cache(kv)
c.close()  # bye: as vLLM's worker says in shutdown(), right before vLLM kills it
print("bye", flush=True)
time.sleep(60)
"""


def test_the_segments_of_an_engine_killed_after_its_bye_are_swept(daemon):
    import subprocess
    import sys

    from conftest import wait_until

    child = subprocess.Popen([sys.executable, "-c", _SAYS_BYE_THEN_DIES, daemon.instance,
                              daemon.run_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "bye"
        prefix = f"kvcached.{os.getuid()}.kv.{child.pid}."
        assert any(n.startswith(prefix) for n in os.listdir("/dev/shm"))
        child.kill()
        child.wait(10)
        wait_until(lambda: not any(n.startswith(prefix) for n in os.listdir("/dev/shm")), 10,
                   "the killed engine's segment swept")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_a_run_dir_too_deep_for_a_unix_socket_refuses_the_start_and_exits(tmp_path):
    """A socket's path may have 107 bytes (a Kubernetes volume's path on the host is deep): the
    bind failed, and the daemon hung at start for good - the socket that failed to bind kept
    its ZeroMQ context from closing. Now the start is refused at once, saying what to change;
    a bind that fails otherwise exits too (no run dir is left to a hung daemon)."""
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    instance = unique_instance("deep")
    try:
        out = subprocess.run([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                              "--run-dir", str(deep), "--host-cache-gb", "0.01"],
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the daemon hung at start on a socket path it cannot bind")
    assert out.returncode == 1, out.stderr
    assert "a Unix socket's path may have 107: give a shorter --run-dir" in out.stderr
    assert not os.path.exists(f"/dev/shm{segment_name(os.getuid(), instance)}")
    from kvcached.server import sockets
    import zmq
    ctx = zmq.Context()
    try:
        with pytest.raises(Exception, match="cannot listen on"):
            sockets.ipc_router(ctx, f"ipc://{tmp_path}/no-such-dir/x.sock")
    finally:
        ctx.term()  # returns: the socket that failed to bind is closed (it hung here)
