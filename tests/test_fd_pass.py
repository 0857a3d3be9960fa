"""Host memory handed to the daemon as fds (kvcached_proto.fd_pass; SGLang's memfd host pool):
a round trip through a memfd-backed layout, and what the fd socket and a registration refuse -
another uid, a message that is not the protocol's, more sets of fds than it keeps, a token
unknown or used twice, an fd of a file the daemon must not map, a peer that says nothing - with
every refused fd closed in the daemon, and a memfd its owner truncates costing its own tasks."""
from __future__ import annotations

import mmap
import os
import socket
import struct
import tempfile
import threading

import numpy as np
import pytest
from conftest import keys_for, small_kv, wait_until
from test_security import run_as_other_uid

from kvcached.server.status_report import format_status
from kvcached_client.host_memory import register_host_memory
from kvcached_client.kv_alloc import unlink_kv_cache
from kvcached_proto import ErrorCode, RequestError, TaskFailed
from kvcached_proto.fd_pass import (MAGIC, MAX_FDS, MAX_PENDING, MAX_PENDING_FDS, FdPassError, fd_socket_path,
                                   send_fds)

N, B = 16, 8192  # blocks, bytes per block and part


def _memfd(nbytes: int = 2 * N * B) -> tuple[int, np.ndarray]:
    fd = os.memfd_create("kvt-pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    arr = np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    return fd, arr


def _layout(num_blocks: int = N) -> dict:
    part = lambda j, name: {"layer": 0, "part": j, "name": name, "dtype": "uint8",  # noqa: E731
                            "shape": [num_blocks, B], "alloc": 0, "offset": j * num_blocks * B,
                            "block_stride": B}
    return {"device": "cpu", "num_layers": 1, "num_blocks": num_blocks, "kv_layout": "test-fd",
            "allocations": [{"kind": "fd", "index": 0, "size": 2 * num_blocks * B}],
            "tensors": [part(0, "k"), part(1, "v")]}


def _blocks(arr: np.ndarray, ids) -> np.ndarray:
    view = arr.reshape(2, N, B)
    return view[:, list(ids)].copy()


def _fds(pid: int, kind: str) -> int:
    """How many of the daemon's fds are `kind` ("/memfd:kvt-pool": the test's memfds; "socket:").
    Counted by kind, not in all: the daemon may open files of its own meanwhile."""
    n = 0
    for f in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{f}").startswith(kind)
        except FileNotFoundError:  # closed since the listing
            pass
    return n


POOL, SOCKET = "/memfd:kvt-pool", "socket:"


def test_a_memfd_pool_round_trips_byte_exact(daemon):
    fd, arr = _memfd()
    arr[:] = np.random.default_rng(1).integers(0, 256, arr.size, dtype=np.uint8)
    keys = keys_for(3, seed=11)
    with daemon.connect() as c:
        reply = register_host_memory(c, _layout(), [fd])
        assert reply["page_bytes"] == 2 * B
        want = _blocks(arr, [1, 2, 3])
        assert c.offload([1, 2, 3], keys).wait(10)["stored"] == 3
        untouched = _blocks(arr, [0, 4])
        arr.reshape(2, N, B)[:, 9:12] = 0
        assert c.load(keys, [9, 10, 11]).wait(10) == 3
        assert np.array_equal(_blocks(arr, [9, 10, 11]), want)
        assert np.array_equal(_blocks(arr, [0, 4]), untouched)  # only the blocks named
        assert not np.array_equal(want[:, 0], want[:, 1])  # the control: blocks differ
        assert c.status()["kv"]["registered"]
    os.close(fd)


def _still_open(sock: socket.socket) -> bool:
    """The daemon has not closed its side (a read would wait, not see the end)."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True


def _holds_pool(pid: int) -> bool:
    """The daemon has the test pool's memfd open or mapped."""
    fds = []
    for f in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds.append(os.readlink(f"/proc/{pid}/fd/{f}"))
        except FileNotFoundError:  # closed since the listing
            pass
    return any("kvt-pool" in x for x in fds) or "kvt-pool" in open(f"/proc/{pid}/maps").read()


def test_the_daemon_lets_go_of_the_pool_once_unregistered(daemon):
    fd, _ = _memfd()
    with daemon.connect() as c:
        register_host_memory(c, _layout(), [fd])
        assert _holds_pool(daemon.pid)
        c.unregister_kv_cache()
        wait_until(lambda: not _holds_pool(daemon.pid), what="the pool unmapped and its fd closed")
        register_host_memory(c, _layout(), [fd])
    # the engine's connection went: its mapping goes with it
    wait_until(lambda: not _holds_pool(daemon.pid), what="the pool of a gone client let go")
    os.close(fd)


def test_a_token_serves_one_registration(daemon):
    fd, _ = _memfd()
    path = fd_socket_path(daemon.run_dir, daemon.instance)
    token = send_fds(path, [fd])
    layout = _layout()
    layout["allocations"][0]["token"] = token
    with daemon.connect() as c:
        c.register_layout(dict(layout))
        c.unregister_kv_cache()
        with pytest.raises(RequestError) as e:
            c.register_layout(dict(layout))  # claimed already
        assert e.value.code == ErrorCode.KV_MISMATCH and "no fds wait" in str(e.value)
        layout["allocations"][0]["token"] = "0" * 32
        with pytest.raises(RequestError) as e:
            c.register_layout(dict(layout))
        assert e.value.code == ErrorCode.KV_MISMATCH
        assert not c.status()["kv"]["registered"]
    os.close(fd)


@pytest.mark.faults
def test_a_message_that_is_not_the_protocols_has_its_fds_closed(daemon):
    path = fd_socket_path(daemon.run_dir, daemon.instance)
    fd, _ = _memfd()
    conns = []
    for payload, count in ((b"HELLO!!!\0\0", 1), (MAGIC + struct.pack("<H", 3), 1)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conns.append(s)
        s.connect(path)
        s.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd) * count)])
        assert s.recv(512).startswith(b"ER")
        assert _fds(daemon.pid, POOL) == 0  # closed before the answer
    # the daemon closed its end of each connection (the peer reads the end, not a wait)
    wait_until(lambda: not any(_still_open(s) for s in conns), timeout=5,
               what="the connections closed by the daemon")
    for s in conns:
        s.close()
    os.close(fd)


@pytest.mark.faults
def test_sets_of_fds_past_the_cap_are_refused_and_closed(daemon):
    path = fd_socket_path(daemon.run_dir, daemon.instance)
    fd, _ = _memfd(4096)
    for _ in range(MAX_PENDING):
        send_fds(path, [fd])
    assert _fds(daemon.pid, POOL) == MAX_PENDING
    with pytest.raises(FdPassError, match="retry later"):
        send_fds(path, [fd])
    assert _fds(daemon.pid, POOL) == MAX_PENDING  # the refused one closed before the answer
    os.close(fd)


@pytest.mark.faults
def test_fds_waiting_are_capped_in_all_not_only_per_set(daemon):
    """Full sets of 64 fds: past MAX_PENDING_FDS waiting in all the next set is refused and
    closed, though fewer than MAX_PENDING sets wait (16 sets of 64 took 960 of a 1,024-file
    daemon's files, and its next accepted connection aborted it)."""
    path = fd_socket_path(daemon.run_dir, daemon.instance)
    fd, _ = _memfd(4096)
    sets = MAX_PENDING_FDS // MAX_FDS
    assert sets < MAX_PENDING
    for _ in range(sets):
        send_fds(path, [fd] * MAX_FDS)
    assert _fds(daemon.pid, POOL) == MAX_PENDING_FDS
    with pytest.raises(FdPassError, match="retry later"):
        send_fds(path, [fd] * MAX_FDS)
    with pytest.raises(FdPassError, match="retry later"):
        send_fds(path, [fd])
    assert _fds(daemon.pid, POOL) == MAX_PENDING_FDS  # the refused ones closed before the answer
    os.close(fd)


@pytest.mark.faults
def test_silent_peers_do_not_hold_up_the_fd_socket(daemon):
    """A flood of connections that say nothing: a sender among them is answered at once, and
    past the cap the oldest silent ones are dropped (the daemon's open files stay bounded)."""
    path = fd_socket_path(daemon.run_dir, daemon.instance)
    before = _fds(daemon.pid, SOCKET)
    silent = []
    for _ in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        silent.append(s)
    fd, _ = _memfd(4096)
    assert len(send_fds(path, [fd], timeout=5.0)) == 32
    # answered while the newest silent ones still wait (served one after the other, it would
    # have come only once every one of them had timed out and been closed)
    assert any(_still_open(s) for s in silent[-64:])
    # MAX_OPEN waiting at most, and the sender's, answered, maybe not closed yet
    assert _fds(daemon.pid, SOCKET) <= before + 64 + 1
    assert _fds(daemon.pid, POOL) == 1  # the fd kept under its token
    wait_until(lambda: _fds(daemon.pid, SOCKET) <= before, timeout=5,
               what="the silent connections dropped after their second")
    for s in silent:
        s.close()
    os.close(fd)


@pytest.mark.faults
def test_fds_the_daemon_must_not_map_are_refused(daemon, tmp_path):
    ro_path = tmp_path / "pool"
    ro_path.write_bytes(b"\0" * (2 * N * B))
    read_only = os.open(ro_path, os.O_RDONLY)
    r, w = os.pipe()
    with daemon.connect() as c:
        for fd, why in ((read_only, "cannot be mapped"), (r, "no regular file")):
            with pytest.raises(RequestError) as e:
                register_host_memory(c, _layout(), [fd])
            assert e.value.code == ErrorCode.KV_MISMATCH and why in str(e.value)
        if os.getuid() == 0:  # a file of another user, handed over by an engine that could open it
            theirs = tmp_path / "theirs"
            theirs.write_bytes(b"\0" * (2 * N * B))
            os.chown(theirs, 65534, 65534)
            other = os.open(theirs, os.O_RDWR)
            with pytest.raises(RequestError, match="belongs to uid 65534"):
                register_host_memory(c, _layout(), [other])
            os.close(other)
        assert not c.status()["kv"]["registered"]
    for fd in (read_only, r, w):
        os.close(fd)


@pytest.mark.faults
def test_another_uid_is_refused_at_the_fd_socket(daemon):
    path = fd_socket_path(daemon.run_dir, daemon.instance)
    os.chmod(daemon.run_dir, 0o711)  # let it reach the socket: the peer's uid is what refuses it
    os.chmod(path, 0o777)

    def attempt(p):
        fd = os.memfd_create("theirs")
        os.ftruncate(fd, 4096)
        try:
            return send_fds(p, [fd])
        except FdPassError as exc:
            return f"refused: {exc}"

    try:
        got = run_as_other_uid(attempt, path)
    finally:
        os.chmod(daemon.run_dir, 0o700)
    assert got.startswith("refused") and "is not the daemon's" in got
    assert daemon.connect().status()["fds"]["pending"] == 0


@pytest.mark.faults
def test_a_memfd_truncated_by_its_owner_fails_its_own_tasks(daemon):
    fd, arr = _memfd()
    keys = keys_for(4, seed=12)
    with daemon.connect() as c:
        register_host_memory(c, _layout(), [fd])
        assert c.offload([0, 1], keys[:2]).wait(10)["stored"] == 2
        os.ftruncate(fd, 4096)  # the engine shrinks its own pool under the daemon's mapping
        with pytest.raises(TaskFailed):
            c.offload([8, 9], keys[2:]).wait(10)
        wait_until(lambda: c.status()["kv"]["lost"], what="the registration lost")
        assert c.ping() >= 0  # the daemon lives on
    os.close(fd)


def test_concurrent_senders_each_get_their_own_token(daemon):
    path = fd_socket_path(daemon.run_dir, daemon.instance)
    fd, _ = _memfd(4096)
    tokens, errors = [], []

    def send():
        try:
            tokens.append(send_fds(path, [fd]))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(tokens)) == 8
    os.close(fd)


def test_no_fd_socket_is_a_clear_error():
    with tempfile.TemporaryDirectory(prefix="kvt-") as d:
        with pytest.raises(FdPassError, match="handing 1 fds"):
            send_fds(fd_socket_path(d, "nobody"), [0], timeout=1.0)


def test_host_pools_of_one_geometry_share_an_instance(daemon):
    """Two engines' fd host pools side by side (SGLang ranks or replicas on one daemon): each
    copies its own pool, pages one stores the other loads, one leaving costs the other nothing;
    a pool of another geometry and a non-fd KV cache are refused while they are registered."""
    (fa, a), (fb, b) = _memfd(), _memfd()
    a[:] = np.random.default_rng(2).integers(0, 256, a.size, dtype=np.uint8)
    b[:] = 0
    keys = keys_for(2, seed=13)
    with daemon.connect() as ca, daemon.connect() as cb:
        register_host_memory(ca, _layout(), [fa])
        register_host_memory(cb, _layout(), [fb])
        status = ca.status()
        assert status["kv"]["engines"] == 2
        assert "2 engines' host pools, copy strategy native" in format_status(status)  # `kvcached status`
        assert ca.offload([4, 5], keys).wait(10)["stored"] == 2
        a_before = a.copy()
        assert cb.load(keys, [7, 8]).wait(10) == 2
        assert np.array_equal(_blocks(b, [7, 8]), _blocks(a, [4, 5]))
        assert not _blocks(b, [4, 5]).any() and np.array_equal(a, a_before)  # each its own pool
        fc, _ = _memfd(2 * 8 * B)
        with daemon.connect() as cc:
            register_host_memory(cc, _layout(num_blocks=8), [fc])  # fewer pages: one geometry
            cc.unregister_kv_cache()
            other = dict(_layout(num_blocks=8), kv_layout="another-model")
            with pytest.raises(RequestError) as e:
                register_host_memory(cc, other, [fc])  # another geometry
            assert e.value.code == ErrorCode.KV_IN_USE and "same geometry" in str(e.value)
            kv = small_kv(num_layers=1, num_blocks=8)
            with pytest.raises(RequestError) as e:
                cc.register_kv_cache(kv)  # an engine's own KV: one engine per instance
            assert e.value.code == ErrorCode.KV_IN_USE
            assert unlink_kv_cache(kv) == 1
        os.close(fc)
        ca.unregister_kv_cache()
        b[:] = 0
        assert cb.load(keys, [1, 2]).wait(10) == 2  # b goes on without a
        assert np.array_equal(_blocks(b, [1, 2]), _blocks(a, [4, 5]))
        with pytest.raises(RequestError) as e:
            ca.load(keys, [1, 2])  # a's registration is gone, and b's is not a's to use
        assert e.value.code == ErrorCode.FORBIDDEN
    for fd in (fa, fb):
        os.close(fd)


def test_an_fd_pool_is_refused_beside_an_engines_own_kv(daemon):
    kv = small_kv(num_layers=1, num_blocks=8)
    fd, _ = _memfd()
    with daemon.connect() as engine, daemon.connect() as pool:
        engine.register_kv_cache(kv)
        with pytest.raises(RequestError) as e:
            register_host_memory(pool, _layout(), [fd])
        assert e.value.code == ErrorCode.KV_IN_USE and "one engine per instance" in str(e.value)
        engine.unregister_kv_cache()
    assert unlink_kv_cache(kv) == 1
    os.close(fd)
