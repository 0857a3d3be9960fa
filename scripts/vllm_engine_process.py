"""The caller's side of vllm_driver.py: the driver as a child process (EngineProcess), steps
sent on stdin and answers read from stdout, and waiting for its connector to attach
(wait_attached) and for its daemons' copies to end before a step (saves_go_to).

Every driver process imports vLLM first (~6 s of one core here) and only then reads its
arguments (one JSON line). Under overlap_engines() one such process is started ahead, importing
while the caller does other work, and handed to the next EngineProcess, and a closed engine's
shutdown runs on in the background: a test suite that starts engine after engine pays neither
in full. Each engine still gets a fresh process of its own, so nothing of one engine's state
reaches the next. A warm process started under other environment variables than the engine's
is not used (vLLM may read them at import)."""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading

MARK = "@@kvcached-driver "  # vLLM logs to stdout too: our lines carry this mark
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_driver.py")


def _start_driver() -> subprocess.Popen:
    """A driver process importing vLLM, waiting for its arguments on stdin."""
    return subprocess.Popen([sys.executable, DRIVER, "--warm"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _discard(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.stdin.close()
    proc.stdout.close()


def _environment() -> dict[str, str]:
    """The environment a driver inherits, less what pytest changes at every test."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


class WarmPool:
    """One driver process started ahead of need (see the module's text)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def take(self) -> subprocess.Popen:
        """The warm process when it can serve this engine, else a new one; the next is started."""
        proc, self.proc = self.proc, None
        if proc is not None and (self.env != _environment() or proc.poll() is not None):
            _discard(proc)
            proc = None
        if proc is None:
            proc = _start_driver()
        self.proc, self.env = _start_driver(), _environment()
        return proc

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            _discard(proc)


_pool: WarmPool | None = None


def overlap_engines() -> None:
    """From now on an EngineProcess starts from a process that imported vLLM ahead, while the
    caller did other work, and close() returns before vLLM's shutdown ends (reap() waits):
    for a test suite that starts engine after engine; a benchmark wants neither beside it."""
    global _pool
    if _pool is None:
        _pool = WarmPool()
        atexit.register(reap)


_closing: list[threading.Thread] = []  # engines told to quit, until they are gone


def reap() -> None:
    """Every engine closed is gone and the warm process stopped, when this returns (e.g.
    before a check that no child is left); the next EngineProcess starts another."""
    while _closing:
        _closing.pop().join()
    if _pool is not None:
        _pool.close()


class EngineProcess:
    """vllm_driver.py as a child process: steps sent on stdin, answers read from stdout."""

    def __init__(self, model_dir: str, *args: str):
        self.proc = _pool.take() if _pool is not None else _start_driver()
        self.proc.stdin.write(json.dumps(["--model-dir", model_dir, *args]) + "\n")
        self.proc.stdin.flush()
        self.log: list[str] = []
        self._closer: threading.Thread | None = None
        self._settle: list[tuple[str, str]] = []  # daemons (instance, run_dir) waited on
        self.ready = self._answer()  # {"ready": True, "async_scheduling": ...}
        if not self.ready.get("ready"):
            raise RuntimeError("the engine did not start")

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            self.log.append(line)
            at = line.find(MARK)  # other processes' log output may share the line
            if at >= 0:
                return json.JSONDecoder().raw_decode(line[at + len(MARK):])[0]
        raise RuntimeError("the engine exited:\n" + "".join(self.log[-60:]))

    def connector_log(self, last: int = 20) -> list[str]:
        """The engine's last lines from the connector and the client (what to show when a hit
        comes out otherwise than a test expects)."""
        return [line.rstrip() for line in self.log if "[vllm]" in line or "[kv" in line][-last:]

    def saves_go_to(self, *daemons) -> "EngineProcess":
        """Before each step, wait until these daemons (DaemonHandles; one restarted under the
        same name counts) ended the offloads they accepted (a flush): what the last step saved
        is in their index, so whether the next step hits does not depend on how fast a daemon
        ran meanwhile (a save still being copied is no hit, as in vLLM's own offloading)."""
        self._settle = [(d.instance, d.run_dir) for d in daemons]
        return self

    def send(self, cmd: str, name: str = "") -> None:
        """Start a step; answer() reads its result (a caller may act in between)."""
        for instance, run_dir in self._settle:
            _saves_ended(instance, run_dir)
        self.proc.stdin.write(f"{cmd} {name}\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        return self._answer()

    def step(self, cmd: str, name: str) -> dict:
        self.send(cmd, name)
        return self._answer()

    def gen(self, name: str, salt: str = "") -> dict:
        return self.step("gen", f"{name} {salt}".strip())

    def ttft(self, name: str) -> float:
        return self.step("ttft", name)["seconds"]

    def close(self, wait: bool | None = None) -> None:
        """Tell the engine to quit and wait until it is gone (killed past 60 s). Under
        overlap_engines(), unless wait=True, vLLM's own shutdown (3-6 s here, mostly a garbage
        collection of the whole heap) runs on beside the caller instead, its output still read
        into `log`, until reap()."""
        if self._closer is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # gone already
                pass
            self._closer = threading.Thread(target=self._wait_gone, daemon=True)
            self._closer.start()
            _closing.append(self._closer)
        if wait or (wait is None and _pool is None):
            self._closer.join()

    def _wait_gone(self) -> None:
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate(timeout=10)
        self.log.append(out or "")


def _saves_ended(instance: str, run_dir: str, timeout: float = 30.0) -> None:
    """Until the offloads daemon `instance` accepted so far ended (its flush: their storage
    backups written too); at once when no daemon answers."""
    from kvcached_client import Client, KvcachedError

    try:
        c = Client.connect(instance=instance, run_dir=run_dir, role="operator", timeout=5,
                           key_table=False)
    except KvcachedError:  # no daemon (killed on purpose, say): nothing of it to wait for
        return
    with c:
        c.flush().wait(timeout)


def wait_attached(daemon, clients: int = 2, timeout: float = 30.0) -> float:
    """The connector attaches in the background (no engine step waits for a daemon): wait until
    `clients` of it (the scheduler's and the worker's) are connected to `daemon` (a
    DaemonHandle) and the KV cache is registered. Returns the seconds waited."""
    import time

    from kvcached_client import DaemonUnavailable

    start = time.monotonic()
    while True:  # a daemon just continued (SIGCONT) beats again within its heartbeat period
        try:
            c = daemon.connect(role="operator")  # counts itself among the clients
            break
        except DaemonUnavailable:
            if time.monotonic() - start > timeout:
                raise
            time.sleep(0.02)
    with c:
        while True:
            s = c.status()
            if s["clients"] >= clients + 1 and s["kv"]["registered"]:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"the connector did not attach within {timeout:g} s: "
                                   f"{s['clients'] - 1} clients, kv {s['kv']}")
            time.sleep(0.02)


def say(obj: dict) -> None:
    """(in the driver) one marked answer line."""
    print(MARK + json.dumps(obj), flush=True)
