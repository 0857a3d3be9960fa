"""Start a kvcached daemon next to the engine and wait until it is ready.

The wait watches the child too: a daemon that exits at start raises at once with its exit code
and the last lines of its stderr, instead of running into the ready timeout.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from urllib.parse import urlsplit

from kvcached_proto.errors import DaemonUnavailable, KvcachedError, KvcachedTimeout
from kvcached_proto.paths import DEFAULT_INSTANCE, check_instance, resolve_run_dir

from .forks import current_pid
from .status_block import StatusReader

STDERR_TAIL_LINES = 20


def _tail(path: str, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError as exc:
        return f"(stderr unreadable: {exc})"


def _terminate(proc: subprocess.Popen, timeout: float, log_path: str, keep_log: bool) -> int | None:
    """SIGTERM, wait up to timeout, then SIGKILL. Safe to call twice. The log goes unless it
    is to be kept, or the daemon did not exit cleanly (its last words are in it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.returncode != 0 and os.path.exists(log_path):
        print(f"[kvcached] daemon exited with {proc.returncode}: its log is kept at {log_path}",
              file=sys.stderr)
    elif not keep_log and os.path.exists(log_path):
        os.unlink(log_path)
    return proc.returncode


def _terminate_mine(launcher: int, *args) -> None:
    """The finalizer: only in the process that launched the daemon. In a child it forked, the
    daemon is not the child's (its Popen saw it as exited, with code 0, and the log of the
    running daemon was deleted at the child's exit); the parent stops it (forks.py)."""
    if current_pid() == launcher:
        _terminate(*args)


class DaemonHandle:
    def __init__(self, proc: subprocess.Popen, instance: str, run_dir: str, log_path: str,
                 keep_log: bool = False):
        self.proc = proc
        self.pid = proc.pid
        self.instance = instance
        self.run_dir = run_dir
        self.log_path = log_path
        self.keep_log = keep_log
        self._finalizer = weakref.finalize(self, _terminate_mine, current_pid(), proc, 10.0, log_path,
                                           keep_log)

    def stop(self, timeout: float = 10.0) -> int | None:
        """Graceful stop (SIGTERM), SIGKILL after timeout; returns the exit code."""
        self._finalizer.detach()
        return _terminate(self.proc, timeout, self.log_path, self.keep_log)

    def kill(self) -> None:
        """SIGKILL, no cleanup by the daemon (tests of crash handling): a kill asked for, so
        its log goes like a clean stop's."""
        self._finalizer.detach()
        self.proc.kill()
        self.proc.wait(5)
        if not self.keep_log and os.path.exists(self.log_path):
            os.unlink(self.log_path)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self) -> str:
        return _tail(self.log_path)

    def connect(self, **kwargs):
        from .client import Client

        return Client.connect(instance=self.instance, run_dir=self.run_dir, **kwargs)

    def __enter__(self) -> "DaemonHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch(instance: str = DEFAULT_INSTANCE, device: str = "cpu", host_cache_gb: float = 1.0,
           run_dir: str | None = None, extra_args=(), ready_timeout: float = 60.0,
           env: dict | None = None, wait_storage: bool = False,
           log_path: str | None = None) -> DaemonHandle:
    """Spawn `kvcached serve` and return once its readiness flag is up; with wait_storage, once
    its storage tiers are ready too (the disk index rebuilt: lookups see what disk holds).

    The daemon's stdout and stderr go to `log_path` (kept), else to a file in
    $KVCACHED_LOG_DIR (kept), else to a temporary file removed at a clean stop; a daemon that
    exits non-zero always leaves its log, and says where."""
    check_instance(instance)
    run_dir = resolve_run_dir(run_dir)
    args, env = _storage_off_the_command_line(list(map(str, extra_args)), env)
    cmd = [sys.executable, "-m", "kvcached", "serve", "--instance", instance, "--device", device,
           "--host-cache-gb", str(host_cache_gb), "--run-dir", run_dir, *args]
    keep = log_path is not None or bool(os.environ.get("KVCACHED_LOG_DIR"))
    if log_path is None:
        log_dir = os.environ.get("KVCACHED_LOG_DIR") or None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        fd, log_path = tempfile.mkstemp(prefix=f"kvcached-{instance}-", suffix=".log", dir=log_dir)
        log_file = os.fdopen(fd, "wb")
    else:
        log_file = open(log_path, "ab")
    with log_file:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                env=env, start_new_session=True)
    handle = DaemonHandle(proc, instance, run_dir, log_path, keep)
    deadline = time.monotonic() + ready_timeout
    while True:
        code = proc.poll()
        if code is not None:
            tail = _tail(log_path)
            handle.stop()
            raise KvcachedError(f"kvcached serve exited with code {code} at start:\n{tail}")
        if _ready(instance, proc.pid, wait_storage):
            return handle
        if time.monotonic() > deadline:
            tail = _tail(log_path)
            handle.stop()
            raise KvcachedTimeout(
                f"kvcached serve not ready within {ready_timeout} s (set launch(ready_timeout=...)):\n{tail}")
        time.sleep(0.02)


def _has_password(uri: str) -> bool:
    try:
        return urlsplit(uri).password is not None
    except ValueError:  # a malformed URI (the daemon says how): one with userinfo, kept off argv
        return "@" in uri


def _storage_off_the_command_line(args: list[str], env: dict | None) -> tuple[list[str], dict | None]:
    """`--storage` URIs go to the daemon in $KVCACHED_STORAGE (which they override, as the
    flags would) where one holds a password: a command line is every user's to read (ps,
    /proc/PID/cmdline), a process's environment its own user's."""
    rest, uris, i = [], [], 0
    while i < len(args):
        if args[i] == "--storage" and i + 1 < len(args):
            uris.append(args[i + 1])
            i += 2
            continue
        if args[i].startswith("--storage="):
            uris.append(args[i].split("=", 1)[1])
        else:
            rest.append(args[i])
        i += 1
    if not any(map(_has_password, uris)):
        return args, env
    return rest, {**(os.environ if env is None else env), "KVCACHED_STORAGE": ",".join(uris)}


def _ready(instance: str, pid: int, storage: bool = False) -> bool:
    try:
        reader = StatusReader(instance)
    except DaemonUnavailable:
        return False
    try:
        return reader.pid == pid and reader.ready() and (not storage or reader.storage_ready())
    finally:
        reader.close()
