"""/dev/shm is everyone's: segments another uid made under the names of this user's instance
(its status block, its key table) or of an engine's own allocations are never read, never stop
the daemon from starting and never fail an engine's allocation. The planting runs as a second
uid (root needed, else these skip)."""
from __future__ import annotations

import os
import subprocess
import sys

import posix_ipc
import pytest

from kvcached_client import DaemonUnavailable, launch
from test_security import OTHER_UID, _other_uid, run_as_other_uid


def _plant_status_segment(name: str, pid: int) -> str:
    """A segment under the instance's status name with a valid header naming `pid`."""
    import mmap

    from kvcached_proto.liveness import pid_namespace, start_ticks
    from kvcached_proto.shm_layout import SEGMENT_BYTES, StatusView

    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, 0o644, SEGMENT_BYTES)
    with mmap.mmap(shm.fd, SEGMENT_BYTES) as mm:
        view = StatusView(mm)
        view.init_header(pid, 12345, start_ticks(pid) or 0, pid_namespace())
        view.release()
    shm.close_fd()
    return "planted"


def test_a_status_segment_planted_by_another_uid_neither_stops_the_daemon_nor_fools_a_client(
        run_dir, instance, monkeypatch):
    """Another uid made /dev/shm/kvcached.<our uid>.<instance> before the daemon started, with a
    header naming a live process (pid 1): the daemon took it for a running instance and refused
    to start, for as long as the other user liked. A client never trusts such a segment; the
    daemon removes it unread, or says exactly what is in the way when it may not remove it."""
    from kvcached.errors import StartupError
    from kvcached.server import status_block
    from kvcached_proto.shm_layout import segment_name
    from kvcached_client.status_block import StatusReader

    name = segment_name(os.getuid(), instance)
    assert run_as_other_uid(_plant_status_segment, name, 1) == "planted"
    try:
        with pytest.raises(DaemonUnavailable, match=f"belongs to uid {OTHER_UID}"):
            StatusReader(instance)
        real_unlink = posix_ipc.unlink_shared_memory

        def not_allowed(n):  # what a daemon of an ordinary user meets in the sticky /dev/shm
            raise posix_ipc.PermissionsError("Permission denied")
        monkeypatch.setattr(status_block.posix_ipc, "unlink_shared_memory", not_allowed)
        with pytest.raises(StartupError, match=f"was made by uid {OTHER_UID}.*another --instance"):
            status_block.StatusSegment(instance)
        monkeypatch.setattr(status_block.posix_ipc, "unlink_shared_memory", real_unlink)
        with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05) as d:
            with d.connect() as c:
                assert c.ping() >= 0 and c.status_block.pid == d.pid
            assert f"made by uid {OTHER_UID}, not this daemon's user" in open(d.log_path).read()
    finally:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass


def _plant_table(name: str) -> str:
    from kvcached_proto.key_table import table_bytes

    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o644, size=table_bytes(1024))
    shm.close_fd()
    return "planted"


def test_a_table_another_uid_planted_that_cannot_be_removed_costs_the_table_not_the_start(
        instance, monkeypatch):
    """In the sticky /dev/shm an ordinary user cannot remove another uid's file: the sweep's
    PermissionsError escaped and the daemon did not start. Now there is no table (clients send
    their lookups) and the log says why."""
    from kvcached.service import key_publisher
    from kvcached_proto.key_table import segment_name

    name = segment_name(os.getuid(), instance)
    assert run_as_other_uid(_plant_table, name) == "planted"
    try:
        def not_allowed(n):
            raise posix_ipc.PermissionsError("Permission denied")
        monkeypatch.setattr(key_publisher.posix_ipc, "unlink_shared_memory", not_allowed)
        publisher = key_publisher.KeyPublisher(instance, 7)
        publisher.rebuild(64, bytes(16), 4096)
        assert publisher.status()["segment"] is None  # no table of its own: lookups are sent
        publisher.close()
    finally:
        monkeypatch.undo()
        posix_ipc.unlink_shared_memory(name)


def _plant_kv_names(uid: int, pid: int, count: int) -> str:
    """(As another uid.) The first `count` names of engine `pid` of user `uid`."""
    from kvcached_proto.paths import kv_segment_name

    for n in range(count):
        posix_ipc.SharedMemory(kv_segment_name(uid, pid, n), posix_ipc.O_CREX, 0o600, 4096).close_fd()
    return "planted"


_ENGINE = """
import sys
from kvcached_client import Client, BlockHasher, allocate_kv_cache
import torch
print("ready", flush=True)
sys.stdin.readline()  # the names of this pid are planted meanwhile
kv = allocate_kv_cache(2, 8, (16, 2, 8), torch.float16)
for layer in kv:
    for t in layer:
        t.copy_(torch.randn(t.shape))
with Client.connect(instance=sys.argv[1], run_dir=sys.argv[2]) as c:
    c.register_kv_cache(kv)
    keys = BlockHasher("planted-names").hash_blocks(list(range(64)), 16)
    c.offload([0, 1, 2, 3], keys).wait(10)
    assert c.load(keys, [4, 5, 6, 7]).wait(10) == 4
    assert all(torch.equal(t[4:8], t[0:4]) for layer in kv for t in layer)
print("served", flush=True)
"""


def test_kv_segment_names_another_uid_took_first_cost_the_engine_nothing(daemon):
    """An engine's CPU KV and order-word segments were named /kvcached.<uid>.kv.<pid>.<n> with n
    counting from 0: another user who planted those names for its pid made its allocation fail
    (ExistentialError). The names are random now."""
    _other_uid()
    from kvcached_proto.paths import kv_segment_name

    engine = subprocess.Popen([sys.executable, "-c", _ENGINE, daemon.instance, daemon.run_dir],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "ready"
        assert run_as_other_uid(_plant_kv_names, os.getuid(), engine.pid, 64) == "planted"
        engine.stdin.write("go\n")
        engine.stdin.flush()
        out, _ = engine.communicate(timeout=60)
        assert engine.returncode == 0 and "served" in out
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)
        for n in range(64):
            try:
                posix_ipc.unlink_shared_memory(kv_segment_name(os.getuid(), engine.pid, n))
            except posix_ipc.ExistentialError:
                pass
