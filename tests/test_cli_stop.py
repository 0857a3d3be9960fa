"""`kvcached stop` for a daemon that cannot take the shutdown op: hung, still starting, or
stopping already (each fails with a stop that only sends the op: "missed its heartbeat", "is
starting", "is stopping": exit 1, the daemon left running); `kvcached status` of one starting."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import sweep_crashed, wait_until
from kvcached.bench import process_stop
from kvcached_client import launch
from kvcached_client.status_block import StatusReader
from kvcached_proto import DaemonUnavailable
from kvcached_proto.shm_layout import State

pytestmark = pytest.mark.faults


def _stop(instance, run_dir, *extra, hang_s="0.3"):
    """`kvcached stop` started (its hang threshold hang_s); returns the process."""
    return subprocess.Popen([sys.executable, "-m", "kvcached", "stop", "--instance", instance,
                             "--run-dir", run_dir, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "KVCACHED_HANG_S": hang_s})


def _state(instance):
    try:
        reader = StatusReader(instance)
    except DaemonUnavailable:
        return None
    try:
        return reader.view.state
    finally:
        reader.close()


def test_a_hung_daemon_is_sent_sigterm_and_stops_gracefully_once_it_runs_again(run_dir, instance):
    """Frozen past the hang threshold: the stop cannot be asked over the socket. Sent SIGTERM,
    it takes the graceful way out when it goes on; a stop whose --timeout ends first says how
    to end it now."""
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    try:
        process_stop.stop(h.pid, "the daemon")
        time.sleep(0.5)  # its heartbeat missed for longer than the stop's threshold (0.3 s)
        out, err = _stop(instance, run_dir, "--timeout", "0.5").communicate(timeout=30)
        assert "missed its heartbeat" in err and "sent it SIGTERM" in err, err
        assert f"kill -KILL {h.pid}" in err and not out  # exit 1 below: still frozen
        assert h.proc.poll() is None
        late = _stop(instance, run_dir, "--timeout", "30")  # a second stop, left to wait
        said = late.stderr.readline()  # (it waits for the exit from here on)
        assert "sent it SIGTERM" in said, said
        process_stop.go_on(h.pid, "the daemon")
        out, err = late.communicate(timeout=30)
        assert late.returncode == 0 and f"stopped instance {instance} (pid {h.pid})" in out, err
        assert h.proc.wait(30) == 0  # the graceful stop: it exits 0 and removes its segment
        assert not os.path.exists(f"/dev/shm/kvcached.{os.getuid()}.{instance}")
    finally:
        process_stop.go_on(h.pid, "the daemon")
        h.stop()
        sweep_crashed(instance)


def test_a_daemon_stopping_already_is_waited_for(run_dir, instance):
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    try:
        reader = StatusReader(instance)
        try:
            os.kill(h.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while reader.view.state != State.STOPPING:  # (spun: the stop of an idle daemon is short)
                assert time.monotonic() < deadline, "the daemon did not begin its stop"
            process_stop.stop(h.pid, "the daemon")  # (a long drain: backups to a slow tier)
        finally:
            reader.close()
        stop = _stop(instance, run_dir, "--timeout", "30", hang_s="30")
        said = stop.stderr.readline()  # (it waits for the exit from here on)
        assert "stopping already" in said and stop.poll() is None, said
        process_stop.go_on(h.pid, "the daemon")
        out, err = stop.communicate(timeout=30)
        assert stop.returncode == 0 and "stopped instance" in out, err
        assert "SIGTERM" not in said + err and h.proc.wait(30) == 0
    finally:
        process_stop.go_on(h.pid, "the daemon")
        h.stop()
        sweep_crashed(instance)


@contextlib.contextmanager
def _frozen_starting(run_dir, instance):
    """A daemon frozen while it starts (its status block made, its host pool and status socket
    not yet); killed and swept after the block if still there."""
    proc = subprocess.Popen([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                             "--run-dir", run_dir, "--host-cache-gb", "0.25"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while _state(instance) != State.STARTING:  # (spun: the window is about a second)
            assert time.monotonic() < deadline and proc.poll() is None, "no start seen"
        process_stop.stop(proc.pid, "the daemon")
        yield proc
    finally:
        process_stop.go_on(proc.pid, "the daemon")
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        sweep_crashed(instance)


def test_a_daemon_still_starting_is_ended(run_dir, instance):
    """SIGTERM ends a start (nothing to drain); its next start sweeps what it left."""
    with _frozen_starting(run_dir, instance) as proc:
        stop = _stop(instance, run_dir, "--timeout", "30", hang_s="30")
        said = stop.stderr.readline()  # (it waits for the exit from here on)
        assert "is starting" in said and "sent it SIGTERM" in said, said
        process_stop.go_on(proc.pid, "the daemon")
        out, err = stop.communicate(timeout=30)
        assert stop.returncode == 0 and "stopped instance" in out, err
        assert proc.wait(30) == -signal.SIGTERM
        sweep_crashed(instance)
        h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)  # the successor starts
        h.stop()


def test_status_of_a_starting_daemon_says_so_and_watch_waits_it_out(run_dir, instance):
    """Not "no daemon" (exit 3: a liveness probe would restart a daemon pinning tens of GiB)."""
    with _frozen_starting(run_dir, instance) as proc:
        out = subprocess.run([sys.executable, "-m", "kvcached", "status", "--instance", instance,
                              "--run-dir", run_dir], capture_output=True, text=True, timeout=30)
        assert out.returncode == 5 and f"(pid {proc.pid}) is starting" in out.stderr, out.stderr
        watch = subprocess.Popen([sys.executable, "-m", "kvcached", "status", "--instance",
                                  instance, "--run-dir", run_dir, "--json", "--watch", "0.1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert watch.poll() is None  # still watching
        process_stop.go_on(proc.pid, "the daemon")
        deadline = time.monotonic() + 30
        line = ""
        while '"pid"' not in line:  # the status, once the daemon is up
            assert time.monotonic() < deadline and watch.poll() is None, "no status came"
            line = watch.stdout.readline()
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=30)
        assert watch.returncode == 0 and err.count("is starting") == 1, err  # said once


def test_status_of_a_daemon_whose_status_socket_file_was_removed_says_so(run_dir, instance):
    """The file removed while the daemon runs: `kvcached status` waits for the daemon to bind it
    again (about once a second) and answers; one that does not come back (the daemon stopped
    here, so that it cannot; a stuck status thread, in a deployment) is said, exit 3."""
    from kvcached_proto.paths import socket_paths

    def status():
        return subprocess.run([sys.executable, "-m", "kvcached", "status", "--instance", instance,
                               "--run-dir", run_dir], capture_output=True, text=True, timeout=30)

    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    try:
        process_stop.stop(h.pid, "the daemon")
        try:
            os.unlink(socket_paths(run_dir, instance)[1])
            out = status()
        finally:
            process_stop.go_on(h.pid, "the daemon")
        assert out.returncode == 3 and f"(pid {h.pid}) runs (normal)" in out.stderr, out.stderr
        assert "was not bound again" in out.stderr, out.stderr
        path = socket_paths(run_dir, instance)[1]
        wait_until(lambda: os.path.exists(path), 10, "the status socket bound again")
        os.unlink(path)  # the daemon running: status waits for it to come back
        out = status()
        assert out.returncode == 0 and re.search(rf"^pid +{h.pid}$", out.stdout, re.M), (out.stdout, out.stderr)
    finally:
        h.stop()
        sweep_crashed(instance)


def _segment_naming(instance, pid, pid_start, pid_ns):
    """A status block naming (pid, pid_start) in pid namespace pid_ns, up, its beat now."""
    import mmap

    import posix_ipc

    from kvcached_proto.shm_layout import SEGMENT_BYTES, Flag, StatusView, segment_name

    shm = posix_ipc.SharedMemory(segment_name(os.getuid(), instance), posix_ipc.O_CREX,
                                 mode=0o600, size=SEGMENT_BYTES)
    with mmap.mmap(shm.fd, SEGMENT_BYTES) as mm:
        view = StatusView(mm)
        view.init_header(pid, 12345, pid_start, pid_ns)
        view.set_heartbeat(time.monotonic_ns())
        view.set_flag(Flag.UP)
        view.release()
    shm.close_fd()


@pytest.mark.parametrize("case", ["another pid namespace", "a reused pid"])
def test_stop_never_signals_a_process_it_cannot_tell_is_the_daemon(run_dir, instance, case):
    """A status block whose beats stopped names a live process that may not be the daemon:
    one in another pid namespace (its pid means another process here), or a pid reused since
    the daemon died (another start time). Nothing is signalled; the stop says why, exit 1."""
    from kvcached_proto.liveness import pid_namespace, start_ticks

    other = subprocess.Popen(["sleep", "60"])
    try:
        if case == "another pid namespace":
            _segment_naming(instance, other.pid, start_ticks(other.pid), pid_namespace() + 1)
        else:
            _segment_naming(instance, other.pid, start_ticks(other.pid) + 1, pid_namespace())
        time.sleep(0.5)  # its beats stopped (the stop's threshold: 0.3 s)
        out, err = _stop(instance, run_dir, "--timeout", "2").communicate(timeout=30)
        said = "not visible from here" if case == "another pid namespace" else "has exited"
        assert said in err and "SIGTERM" not in err and not out, err
        time.sleep(0.2)
        assert other.poll() is None  # not signalled
    finally:
        other.kill()
        other.wait()
        sweep_crashed(instance)
