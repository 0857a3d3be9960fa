"""Every thread's stack in a daemon's log (kvcached/server/stack_dump.py): on `kill -USR1`, which a
daemon at work lives through, and when its request loop stalls; none without a stderr."""
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

import pytest
import torch

from conftest import disk_uri, kv_parts, small_kv, sweep_crashed, wait_until
from kvcached_client import launch
from kvcached_client.status_block import StatusReader
from kvcached_proto.shm_layout import Flag, State
from kvcached.server.stack_dump import USR1_EVERY_S, StackDumps
from kvcached.server.status_block import StatusSegment


def _taken(caplog, seen: list) -> str:
    """What was logged since the last call (all of it kept in `seen`)."""
    text = caplog.text
    caplog.clear()
    seen.append(text)
    return text


def test_a_request_loop_stuck_past_its_stall_time_has_every_threads_stack_written_once(instance, caplog):
    """The loop stuck in a call that released the GIL (the heartbeat beats on): once it has not
    turned for its stall time, the heartbeat writes every thread's stack - once a stall, none
    while it turns, none while the daemon stops (a drain does not turn it)."""
    lag, seen = [0.0], []
    block = StatusSegment(instance)
    try:
        block.watch_loop(lambda: lag[0], 0.5)
        time.sleep(0.3)
        assert "[stacks]" not in _taken(caplog, seen)
        lag[0] = 0.6
        time.sleep(0.5)
        err = _taken(caplog, seen)
        assert "in test_a_request_loop_stuck" in err and "in _beat" in err, err
        time.sleep(0.3)
        assert "[stacks]" not in _taken(caplog, seen)  # once a stall
        lag[0] = 0.0
        time.sleep(0.2)
        block.set_state(State.STOPPING)
        lag[0] = 0.6
        time.sleep(0.3)
        assert "[stacks]" not in _taken(caplog, seen)
    finally:
        block.close()
    assert "".join(seen).count("the request loop has not turned for 0.6 s") == 1


def _beats_on(view, within: float) -> bool:
    """The heartbeat (which takes the GIL every beat) beat within `within` seconds."""
    beat, deadline = view.heartbeat_ns, time.monotonic() + within
    while time.monotonic() < deadline:
        if view.heartbeat_ns != beat:
            return True
        time.sleep(0.01)
    return False


@contextlib.contextmanager
def _main_thread_held(daemon):
    """The daemon's main thread alone in a ptrace-stop (PTRACE_SEIZE + PTRACE_INTERRUPT): its
    other threads run on. A stop signal would stop them all. Held at a moment it does not hold the
    GIL: the thread stopped holding it (it was between its waits) stops every thread, the
    heartbeat's too (what the daemon then writes is nothing: its docstring says so), so the stop
    is let go and taken again until the heartbeat beats on."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    pid, reader = daemon.pid, StatusReader(daemon.instance, run_dir=daemon.run_dir)
    try:
        for _ in range(20):
            if libc.ptrace(0x4206, pid, None, None) != 0:  # PTRACE_SEIZE
                pytest.skip(f"ptrace refused (errno {ctypes.get_errno()})")
            assert libc.ptrace(0x4207, pid, None, None) == 0  # PTRACE_INTERRUPT
            wait_until(lambda: os.waitpid(pid, os.WNOHANG | 0x40000000)[0] == pid, 10,
                       "the main thread's ptrace-stop")  # (0x40000000: __WALL)
            if _beats_on(reader.view, 1.0):
                break
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH: it held the GIL; again
            time.sleep(0.05)
        else:
            pytest.fail("the main thread held the GIL at each of 20 stops")
        yield
    finally:
        libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
        reader.close()


@pytest.mark.faults
def test_a_daemon_whose_request_loop_is_held_writes_where_it_is(daemon):
    """The daemon's main thread held (the heartbeat beats on: no engine calls it hung): `kill
    -USR1` has every thread's stack written while it is held (the request thread, which runs
    Python's signal handlers, cannot), and once its loop has not turned for 5 s the log has them again,
    the loop's frame among them."""
    with _main_thread_held(daemon):
        os.kill(daemon.pid, signal.SIGUSR1)
        # (the main thread held all along: another thread wrote it; before the stall's, below)
        wait_until(lambda: "kill -USR1: every thread's stack" in open(daemon.log_path).read(), 10,
                   "the USR1 dump")
        wait_until(lambda: "the request loop has not turned" in open(daemon.log_path).read(), 10,
                   "the loop's stall in the log")
        time.sleep(0.2)  # (the dump follows its line)
    log = open(daemon.log_path).read()
    asked = log[log.index("kill -USR1"):log.index("the request loop has not turned")]
    assert "in _loop" in asked and "in _beat" in asked, asked
    dump = log[log.index("the request loop has not turned"):]
    assert "in _loop" in dump and "in _beat" in dump, dump
    with daemon.connect() as c:
        c.ping()


def test_a_daemon_without_stderr_beats_on_and_logs_its_stall(instance, monkeypatch, caplog):
    """Started with stderr closed (sys.stderr None): the stalled loop's stacks are taken all the
    same (faulthandler writes them into a memfd) and logged, and the heartbeat goes on. (When the
    dump went to stderr itself, faulthandler's "sys.stderr is None" ended the heartbeat thread.)"""
    monkeypatch.setattr(sys, "stderr", None)
    block = StatusSegment(instance)
    try:
        block.set_flag(Flag.UP)
        block.watch_loop(lambda: 1.0, 0.5)
        time.sleep(0.5)
        beat = block.view.heartbeat_ns
        time.sleep(0.3)
        assert block.view.heartbeat_ns > beat and block._thread.is_alive()
    finally:
        block.close()
    assert caplog.text.count("the request loop has not turned") == 1
    assert "in _beat" in caplog.text and "stack dumps are off" not in caplog.text



@pytest.mark.faults
def test_kill_usr1_at_a_daemon_at_work_writes_its_stacks_and_every_load_is_right(run_dir, instance,
                                                                                disk_dir, tmp_path):
    """An operator's `kill -USR1` every 5 ms at a daemon an engine keeps busy (offloads backed up
    to a disk tier, loads, lookups): the daemon lives, every load brings its blocks' bytes, and
    the log has every thread's stack at most once a second. (faulthandler's own USR1 dump, read
    in the handler without the GIL, killed such a daemon with SIGSEGV within 40 signals.)"""
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25,
               extra_args=["--storage", disk_uri(disk_dir)], log_path=str(tmp_path / "daemon.log"))
    stop, sent = threading.Event(), [0]

    def signals():
        while not stop.wait(0.005):
            os.kill(d.pid, signal.SIGUSR1)
            sent[0] += 1

    sender = threading.Thread(target=signals)
    try:
        with d.connect(timeout=10) as c:
            kv = small_kv(num_layers=2, num_blocks=64, block_shape=(16, 2, 64))
            c.register_kv_cache(kv)
            sender.start()
            began, rounds = time.monotonic(), 0
            while time.monotonic() - began < 3.0:
                keys = [os.urandom(16) for _ in range(16)]
                for layer in kv:
                    for t in kv_parts(layer):
                        t[:16].copy_(torch.randn(t[:16].shape).to(t.dtype))
                c.offload(range(16), keys).wait(30)
                assert c.lookup(keys)[0] == 16
                assert c.load(keys, list(range(32, 48))).wait(30) == 16
                for layer in kv:
                    for t in kv_parts(layer):
                        assert torch.equal(t[32:48], t[:16])
                rounds += 1
            stop.set()
            sender.join()
            c.ping()
        assert d.proc.poll() is None and rounds > 10 and sent[0] > 200, (rounds, sent[0])
    finally:
        stop.set()
        if sender.is_alive():
            sender.join()
        rc = d.stop()
        sweep_crashed(instance)
    log = open(d.log_path).read()
    dumps = log.count("kill -USR1: every thread's stack follows")
    assert rc == 0 and "Fatal Python error" not in log, log[-3000:]
    assert 2 <= dumps <= 3.0 / USR1_EVERY_S + 3, dumps
    first = log[log.index("kill -USR1"):]
    assert "in _beat" in first and "in _loop" in first, first[:3000]


def test_usr1_asks_the_heartbeat_and_is_put_back_on_close(caplog):
    """In a process of its own making: the signal only writes to the pipe (no dump until a beat
    reads it), signals within a second of a dump make one more dump a second on, and close()
    gives USR1 and the wakeup fd back as they were."""
    before, seen = signal.getsignal(signal.SIGUSR1), []
    dumps = StackDumps()
    assert dumps.listen_for_usr1()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert "[stacks]" not in _taken(caplog, seen)
        dumps.on_beat(stopping=False)
        assert "in test_usr1_asks_the_heartbeat" in _taken(caplog, seen)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        dumps.on_beat(stopping=False)
        assert "Current thread" not in _taken(caplog, seen)  # (within the second)
        time.sleep(USR1_EVERY_S)
        dumps.on_beat(stopping=False)
        assert _taken(caplog, seen).count("Current thread") == 1  # both signals: one dump
        dumps.on_beat(stopping=False)
        assert "Current thread" not in _taken(caplog, seen)
    finally:
        dumps.close()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert signal.set_wakeup_fd(-1) == -1
    assert "".join(seen).count("kill -USR1: every thread's stack follows") == 2


def test_usr1_is_left_alone_where_the_process_has_a_wakeup_fd_of_its_own(caplog):
    """An embedding whose event loop set a wakeup fd keeps it, and its USR1."""
    r, w = os.pipe2(os.O_NONBLOCK)
    before = signal.getsignal(signal.SIGUSR1)
    signal.set_wakeup_fd(w)
    try:
        dumps = StackDumps()
        assert not dumps.listen_for_usr1()
        assert signal.getsignal(signal.SIGUSR1) == before
        assert signal.set_wakeup_fd(w) == w
        dumps.close()
        assert signal.set_wakeup_fd(w) == w
    finally:
        signal.set_wakeup_fd(-1)
        os.close(r)
        os.close(w)
    assert "has a signal wakeup fd of its own" in caplog.text
