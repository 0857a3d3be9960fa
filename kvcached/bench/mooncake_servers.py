"""A Mooncake Store on loopback for the benchmarks and the tests: `mooncake_master` (with its
metrics/admin server on a free port: its default, 9003, binds every address and would clash
between two masters) and, optionally, a `mooncake_client` that only contributes memory (a
segment that outlives the daemons, so a restarted daemon finds what another stored). Both come
with Mooncake's wheel (the `mooncake` extra; Debian's libibverbs1 too, even for TCP).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from kvcached.bench import free_port, process_stop


def available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:  # the extra is not installed, or libibverbs1 is missing
        return False
    return _exe("mooncake_master") is not None


def _exe(name: str) -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else shutil.which(name)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


class MooncakeStore:
    """A master on a free loopback port and, with provider_mb, a memory-only client."""

    def __init__(self, provider_mb: int = 0, log_dir: str | None = None):
        self.port = free_port()
        self.log_dir = log_dir
        self.master: subprocess.Popen | None = None
        self.provider: subprocess.Popen | None = None
        self.provider_mb = provider_mb
        self.start_master()
        if provider_mb:
            self._start_provider()

    @property
    def uri(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def _out(self, name: str):
        if self.log_dir is None:
            return subprocess.DEVNULL
        return open(os.path.join(self.log_dir, name), "ab")

    def start_master(self) -> None:
        self.master = subprocess.Popen(
            [_exe("mooncake_master"), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=false", f"--metrics_port={free_port()}",
             "--metrics_host=127.0.0.1"],
            stdout=self._out("master.log"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not _listening(self.port):
            if self.master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start on port {self.port}")
            time.sleep(0.05)

    def _start_provider(self) -> None:
        self.provider = subprocess.Popen(
            [_exe("mooncake_client"), f"--global_segment_size={self.provider_mb}MB", "--host=127.0.0.1",
             f"--master_server_address=127.0.0.1:{self.port}", "--metadata_server=P2PHANDSHAKE",
             f"--port={free_port()}", f"--http_port={free_port()}"],
            stdout=self._out("provider.log"), stderr=subprocess.STDOUT)
        self.wait_segments(1)

    def wait_segments(self, n: int, timeout: float = 20) -> None:
        """Until a bare client can store an object (the provider's segment is mounted)."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{self.port}") != 0:
            raise RuntimeError("a bare Mooncake client could not reach the master")
        try:
            deadline = time.monotonic() + timeout
            while store.put("kvcached-probe/segment", b"x") != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("no Mooncake segment was mounted in time")
                time.sleep(0.1)
            store.remove("kvcached-probe/segment", True)
        finally:
            store.close()

    def kill_master(self) -> None:
        self.master.kill()
        self.master.wait(10)

    def stop_master(self, stopped: bool) -> None:
        """SIGSTOP (a master that stops answering) or SIGCONT. Returns once every thread of the
        master is stopped (or none is): kill() returns before a busy thread has stopped."""
        if stopped:
            process_stop.stop(self.master.pid, "mooncake_master")
        else:
            process_stop.go_on(self.master.pid, "mooncake_master")

    def close(self) -> None:
        for proc in (self.provider, self.master):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)
