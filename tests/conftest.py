"""Fixtures: real daemons in real processes, in a short private run dir per test.

The session ends with a check that no /dev/shm/kvcached.* segment and no daemon process
outlives the suite; the daemons' logs are kept under pytest's base temp dir.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile

import proc_children as children
import posix_ipc
import pytest
import torch

from kvcached_client import allocate_kv_cache, launch
from kvcached_proto.liveness import pid_alive

_names = itertools.count()
_child_pids: set[int] = set()


class _RecordedPopen(subprocess.Popen):
    """subprocess.Popen that notes each child's pid (subprocess.run uses it too): an engine the
    tests start in a child and kill leaves KV segments named by the child's pid, which the leak
    check must count as this session's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _child_pids.add(self.pid)


subprocess.Popen = _RecordedPopen


def our_segments() -> set[str]:
    """Segments of this test session: KV segments this process and its children made, and the
    status blocks and key tables of its daemons (instance names carry this pid:
    unique_instance). Others' are not ours to count (a benchmark or a second test run on the
    same machine)."""
    uid, pid = os.getuid(), os.getpid()
    gone = [p for p in _child_pids if not pid_alive(p)]  # a live one is not our child any more:
    pids = "|".join(str(p) for p in (pid, *gone))        # its pid was reused by another process
    mine = re.compile(rf"^kvcached\.{uid}\.(kv\.({pids})\.\d+|([\w-]*[^\d])?{pid}-\d+(\.keys)?)$")
    return {n for n in os.listdir("/dev/shm") if mine.match(n)}


_born_in: dict[str, str] = {}  # segment -> the test during which it was first seen


@pytest.fixture(autouse=True)
def _note_segment_births(request):
    """Names, for the leak check's message, the test that made each segment (a leak seen only
    at the session's end otherwise points at whichever test ran last)."""
    yield
    for name in our_segments():
        _born_in.setdefault(name, request.node.nodeid)


@pytest.fixture(scope="session", autouse=True)
def daemon_logs(tmp_path_factory):
    """Every daemon's log goes under pytest's base temp dir (which pytest rotates), not into
    /tmp: a daemon a test kills on purpose exits non-zero, and its log was kept there for good.
    $KVCACHED_LOG_DIR, when set, is used as is."""
    if not os.environ.get("KVCACHED_LOG_DIR"):
        os.environ["KVCACHED_LOG_DIR"] = str(tmp_path_factory.mktemp("daemon-logs", numbered=False))
    yield


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    before = our_segments()
    children_tmp = _private_tmpdir()
    yield
    import gc

    gc.collect()  # KV segments are unlinked when their tensors are collected
    leaked = our_segments() - before
    for name in leaked:  # reported below; removed so that one failing run leaves none behind
        try:
            posix_ipc.unlink_shared_memory("/" + name)
        except posix_ipc.ExistentialError:
            pass
    engines = sys.modules.get("vllm_engine_process")  # the vLLM suite's engines, closing or warm
    if engines is not None:
        engines.reap()
    alive = children.live_children()
    shutil.rmtree(children_tmp, ignore_errors=True)  # (after the engines: theirs are in it)
    assert not leaked, "tests leaked shared-memory segments: " + ", ".join(
        f"{n} (first seen after {_born_in.get(n, 'the last test')})" for n in sorted(leaked))
    assert not alive, f"tests leaked child processes: {alive}"


def _private_tmpdir() -> str:
    """$TMPDIR of every child process, removed at the session's end: vLLM puts its engines'
    ipc sockets and its distributed-init files in the temp dir and leaves them there when its
    process is stopped (some 14 sockets a run of test_vllm_server.py were left in /tmp). This
    process's own temp dir was chosen before (tempfile caches it)."""
    tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix="kvt-tmp-", dir="/tmp")
    os.environ["TMPDIR"] = path
    return path


def _short_dir():
    # ipc:// paths are limited to ~107 bytes: keep the dir short, not under pytest's tmp_path
    path = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


run_dir = pytest.fixture(_short_dir)
module_run_dir = pytest.fixture(_short_dir, scope="module")


def unique_instance(tag: str = "t") -> str:
    return f"{tag}{os.getpid()}-{next(_names)}"


@pytest.fixture
def instance() -> str:
    return unique_instance()


def sweep_crashed(instance: str) -> None:
    """Remove the segments a kill -9'd daemon left, its status block and key table (what its
    successor would sweep at start)."""
    name = f"/kvcached.{os.getuid()}.{instance}"
    if os.path.exists(f"/dev/shm{name}"):
        reader_pid = int.from_bytes(open(f"/dev/shm{name}", "rb").read(20)[16:20], "little")
        if pid_alive(reader_pid):
            return
        posix_ipc.unlink_shared_memory(name)
    if os.path.exists(f"/dev/shm{name}.keys"):
        posix_ipc.unlink_shared_memory(f"{name}.keys")


@pytest.fixture
def daemon(run_dir, instance):
    handle = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    yield handle
    handle.stop()
    sweep_crashed(instance)


@pytest.fixture(scope="module")
def shared_daemon(module_run_dir):
    """One daemon for a module of tests that do not change its state for each other."""
    name = unique_instance("m")
    handle = launch(instance=name, run_dir=module_run_dir, host_cache_gb=0.25)
    yield handle
    handle.stop()
    sweep_crashed(name)


@pytest.fixture
def client(daemon):
    c = daemon.connect(timeout=10.0)
    yield c
    c.close()


def keys_for(n: int, seed: int = 0, namespace: str = "kvcached-tests") -> list[bytes]:
    """Keys of n 16-token blocks: equal seeds give equal (chained) keys, other seeds others."""
    from kvcached_client import BlockHasher

    return BlockHasher(namespace).hash_blocks([seed * 100_000 + i for i in range(16 * n)], 16)


def kv_parts(layer) -> tuple:
    """A layer's tensors: its (K, V) pair, or the one tensor."""
    return tuple(layer) if isinstance(layer, (tuple, list)) else (layer,)


def snapshot(kv, blocks) -> list[tuple]:
    """Copies of `blocks` of every layer and part, to compare with after a round trip."""
    return [tuple(t[blocks].clone() for t in kv_parts(layer)) for layer in kv]


def blocks_equal(kv, blocks, expected, upto=None) -> bool:
    """`blocks` (the first `upto` of them) hold what `expected` (a snapshot) holds."""
    upto = len(blocks) if upto is None else upto
    blocks = list(blocks)[:upto]
    return all(torch.equal(t[blocks], e[:upto])
               for layer, exp in zip(kv, expected) for t, e in zip(kv_parts(layer), exp))


def scramble(kv, value: int = 7) -> None:
    """Overwrite every block, so that what a load brings back cannot be left over."""
    for layer in kv:
        for t in kv_parts(layer):
            t.fill_(value)


def no_tasks(client) -> bool:
    """The daemon runs no task and has none queued (status's "inflight" leaves out the queued)."""
    tasks = client.status()["tasks"]
    return tasks["inflight"] + tasks["queued"] == 0


def wait_until(predicate, timeout: float = 20.0, what: str = "the condition") -> None:
    """Poll predicate() until it is true; fail the test after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout:g} s"
        time.sleep(0.02)


def settled_status(c, timeout: float = 30.0) -> dict:
    """c's daemon's status once the work it accepted has ended: a flush (which ends after the
    backups of every offload before it), then polled until nothing is in flight or pinned - a
    backup being written holds its host block pinned after the offload's end. Returns the last
    status read, settled or not, for the caller's assertion to print."""
    import time

    c.flush().wait(timeout)
    deadline = time.monotonic() + timeout
    while True:
        s = c.status()
        if (s["tasks"]["inflight"], s["host"]["pinned_blocks"]) == (0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def small_kv(num_layers=4, num_blocks=64, block_shape=(16, 2, 8), dtype=torch.bfloat16,
             kv_pair=True, seed=0):
    """A KV cache in shared memory filled with random data."""
    kv = allocate_kv_cache(num_layers, num_blocks, block_shape, dtype, kv_pair=kv_pair)
    gen = torch.Generator().manual_seed(seed)
    for layer in kv:
        for t in (layer if kv_pair else (layer,)):
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return kv


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_taken: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(with_bus: bool = False) -> int:
    """A free loopback port, not handed out before in this run; with_bus also needs port+10000
    free (a Redis cluster node's bus port). Below the kernel's ephemeral range: a port from it
    could be taken by any outgoing connection between this check and the server's bind."""
    import random

    top = max(12000, _ephemeral_start() - 1 - (10000 if with_bus else 0))
    for _ in range(1000):
        port = random.randint(10000, top)
        if port in _taken or not _bindable(port) or (with_bus and not _bindable(port + 10000)):
            continue
        _taken.add(port)
        return port
    raise RuntimeError("no free loopback port found")


class RedisServer:
    """A real redis-server on a free loopback port, persistence off; stop/start at will. With
    `password`, clients must AUTH; with `tls` (make_tls_files' dict), it speaks TLS only."""

    def __init__(self, port: int | None = None, extra=(), password: str | None = None,
                 tls: dict | None = None):
        import shutil as _shutil
        import subprocess

        self.exe = _shutil.which("redis-server")
        if self.exe is None:
            pytest.skip("redis-server is not installed (.ci/run installs it)")
        self.port = port or free_port()
        self.password, self.tls = password, tls
        self.extra = list(extra)
        if password is not None:
            self.extra += ["--requirepass", password]
        if tls is not None:
            self.extra += ["--tls-cert-file", tls["cert"], "--tls-key-file", tls["key"],
                           "--tls-ca-cert-file", tls["ca"], "--tls-auth-clients", "no"]
        self.dir = tempfile.mkdtemp(prefix="kvredis-", dir="/tmp")
        self._subprocess = subprocess
        self.proc = None
        self.start()

    @property
    def uri(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        if self.tls is not None:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ca={self.tls['ca']}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        tls = {"ssl": True, "ssl_ca_certs": self.tls["ca"]} if self.tls is not None else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=0.5, **tls)

    def start(self) -> None:
        import time

        import redis

        ports = (["--port", "0", "--tls-port", str(self.port)] if self.tls is not None
                 else ["--port", str(self.port)])
        self.proc = self._subprocess.Popen(
            [self.exe, *ports, "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, *self.extra],
            stdout=self._subprocess.DEVNULL, stderr=self._subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not start")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def disk_dir():
    """A directory for a disk tier, removed after the test."""
    path = tempfile.mkdtemp(prefix="kvdisk-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_tls_files(directory: str) -> dict | None:
    """A CA and a server certificate for 127.0.0.1 (openssl), or None without openssl."""
    import subprocess

    if shutil.which("openssl") is None:
        return None
    f = {n: os.path.join(directory, n) for n in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt", "ext")}
    with open(f["ext"], "w") as out:
        out.write("subjectAltName=IP:127.0.0.1\n")
    for cmd in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f["ca.key"], "-out",
                 f["ca.crt"], "-days", "1", "-subj", "/CN=kvcached-test-ca"],
                ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", f["srv.key"], "-out", f["srv.csr"],
                 "-subj", "/CN=127.0.0.1"],
                ["x509", "-req", "-in", f["srv.csr"], "-CA", f["ca.crt"], "-CAkey", f["ca.key"],
                 "-CAcreateserial", "-out", f["srv.crt"], "-days", "1", "-extfile", f["ext"]]):
        subprocess.run(["openssl", *cmd], check=True, capture_output=True)
    return {"ca": f["ca.crt"], "cert": f["srv.crt"], "key": f["srv.key"]}


def disk_uri(path: str, capacity_gb: float = 1.0) -> str:
    return f"disk://{path}?capacity_gb={capacity_gb}"


def geometry_of(kv) -> bytes:
    """The geometry digest the daemon gives kv's blocks once kv is registered."""
    from kvcached_client.kv_alloc import describe_kv_cache
    from kvcached_proto.layout import parse_layout

    return parse_layout(describe_kv_cache(kv)).geometry_digest()


def stored(key: bytes, kv) -> bytes:
    """The name a storage tier gives key's block of kv's geometry (a record file's name, a
    Redis key's suffix)."""
    from kvcached.storage.record import stored_key

    return stored_key(key, geometry_of(kv))


@contextlib.contextmanager
def ranks(run_dir, n, extra=lambda rank: ()):
    """n daemons, one per tensor-parallel rank: (instance names, handles); stopped and swept
    after."""
    names = [unique_instance(f"r{r}-") for r in range(n)]
    handles = []
    try:
        for r, name in enumerate(names):
            handles.append(launch(instance=name, run_dir=run_dir, host_cache_gb=0.05,
                                  extra_args=list(extra(r)), wait_storage=True))
        yield names, handles
    finally:
        for h in handles:
            h.stop()
        for name in names:
            sweep_crashed(name)
