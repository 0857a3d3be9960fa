"""The daemon's log goes through a queue (kvcached/logs.py): a stderr that takes nothing holds its
writer thread, never the daemon - a daemon whose stderr is a pipe nobody reads keeps answering
its engines and stops on SIGTERM; lines past the queue are dropped, counted and said."""
import fcntl
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

from conftest import sweep_crashed, wait_until
from kvcached_client import Client
from kvcached.logs import LogQueue

F_SETPIPE_SZ = 1031


def test_lines_a_stuck_stderr_does_not_take_are_dropped_counted_and_said():
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    stream = os.fdopen(w, "w")
    handler = LogQueue(stream, records=64)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("kvcached.test-log-queue")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(handler)
    try:
        logging_thread = threading.Thread(target=lambda: [logger.info("x" * 100) for _ in range(2000)])
        logging_thread.start()
        logging_thread.join(10)
        assert not logging_thread.is_alive()  # a blocked pipe held no caller
        assert handler.dropped > 1000, handler.dropped
        dropped = handler.dropped
        got = []
        reader = threading.Thread(target=lambda: got.append(os.read(r, 1 << 20)) or
                                  [got.append(b) for b in iter(lambda: os.read(r, 1 << 20), b"")])
        reader.start()
        wait_until(handler._lines.empty, 10, "the queue written out")
        logger.info("after")
        wait_until(lambda: b"after" in b"".join(got), 10, "the line after the drops")
        text = b"".join(got).decode()
        said = [int(n) for n in re.findall(r"\[log\] (\d+) log lines dropped", text)]
        assert sum(said) == dropped and handler.dropped == dropped, (said, dropped)
        assert text.index("log lines dropped") < text.index("after")
    finally:
        logger.removeHandler(handler)
        handler.close()
        stream.close()
    reader.join(10)
    os.close(r)


def test_a_daemon_whose_stderr_nobody_reads_answers_its_engines_and_stops(run_dir, instance):
    """(Before, with the pipe at 4 KiB, its request thread blocked in a log line after 13
    sessions: no hello was answered, and SIGTERM did not stop it.)"""
    proc = subprocess.Popen([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                             "--run-dir", run_dir, "--host-cache-gb", "0.0625"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for pipe in (proc.stdout, proc.stderr):
            fcntl.fcntl(pipe, F_SETPIPE_SZ, 4096)
        wait_until(lambda: os.path.exists(f"/dev/shm/kvcached.{os.getuid()}.{instance}"), 60, "the start")
        client = None
        for _ in range(60):  # (ready: the hello answered)
            try:
                client = Client.connect(instance, run_dir, timeout=2, name="first")
                break
            except Exception:  # noqa: BLE001 - still starting
                time.sleep(0.5)
        assert client is not None
        client.close()
        for n in range(200):  # ~400 log lines (hello, bye): 4 KiB of pipe is full early
            with Client.connect(instance, run_dir, timeout=5, name=f"engine-{n}" + "-" * 60) as c:
                c.ping()
        with Client.connect(instance, run_dir, timeout=5, name="status") as c:
            assert c.status()["log_lines_dropped"] == 0  # (the queue took them all)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
        sweep_crashed(instance)
    # what the pipe held: the first lines (the rest waited in the queue, and went at the exit)
    assert "[startup]" in err and "[handshake]" in err, err[-2000:]
