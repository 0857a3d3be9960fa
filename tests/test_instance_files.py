"""A daemon whose files go from under it (kvcached/server/instance_files.py, status_block.py,
key_publisher.py): its run dir removed (a $XDG_RUNTIME_DIR at its user's last logout, a tmp
cleaner) and its shared memory unlinked (systemd-logind's RemoveIPC) make them again within a
second or two; the engine attached goes on unaware, new engines attach, and no second daemon
starts under the name. A segment another process put under the name is left alone."""
import os
import shutil
import subprocess
import sys
import time

import posix_ipc
import pytest
import torch

from conftest import kv_parts, small_kv, wait_until
from kvcached_client import Client, RequestError, launch
from kvcached_proto.paths import socket_paths

pytestmark = pytest.mark.faults


def _segments(instance: str) -> list[str]:
    return [f"/dev/shm/kvcached.{os.getuid()}.{instance}", f"/dev/shm/kvcached.{os.getuid()}.{instance}.keys"]


def _all_there(run_dir: str, instance: str) -> bool:
    return all(os.path.exists(p) for p in [*socket_paths(run_dir, instance), *_segments(instance),
                                           os.path.join(run_dir, f"{instance}.lock")])


def test_an_instance_whose_files_were_removed_makes_them_again_and_its_engine_goes_on(
        run_dir, instance, tmp_path):
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25,
               log_path=str(tmp_path / "daemon.log"))
    try:
        with d.connect(timeout=5) as engine:
            kv = small_kv(num_layers=2, num_blocks=64, block_shape=(16, 2, 64))
            engine.register_kv_cache(kv)
            keys = [os.urandom(16) for _ in range(8)]
            engine.offload(range(8), keys).wait(10)
            assert _all_there(run_dir, instance)
            shutil.rmtree(run_dir)  # the run dir, with the lock and the three sockets
            for path in _segments(instance):  # as RemoveIPC does (the engine's own KV too)
                os.unlink(path)
            for name in os.listdir("/dev/shm"):
                if name.startswith(f"kvcached.{os.getuid()}.kv.{os.getpid()}."):
                    os.unlink(f"/dev/shm/{name}")
            wait_until(lambda: _all_there(run_dir, instance), 5, "the instance's files made again")
            # the engine attached went on throughout: its loads land byte for byte
            more = [os.urandom(16) for _ in range(8)]
            assert engine.offload(range(8, 16), more).wait(10)["stored"] == 8
            assert engine.load(keys + more, list(range(32, 48))).wait(10) == 16
            for layer in kv:
                for t in kv_parts(layer):
                    assert torch.equal(t[32:48], t[0:16])
            assert engine.alive()
            # a new engine attaches, and answers its lookups from the new key table
            with Client.connect(instance, run_dir, timeout=5, name="after") as other:
                other.ping()
                assert other.lookup(keys + more) == (16, 0)
                assert other.key_table is not None and other.key_table.answered == 1
            status = subprocess.run([sys.executable, "-m", "kvcached", "status", "--instance", instance,
                                     "--run-dir", run_dir], capture_output=True, text=True, timeout=30)
            assert status.returncode == 0 and "state          normal" in status.stdout, status
            second = subprocess.run([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                                     "--run-dir", run_dir, "--host-cache-gb", "0.0625"],
                                    capture_output=True, text=True, timeout=60)
            assert second.returncode != 0 and "already running" in second.stderr, second.stderr[-2000:]
            engine.ping()
    finally:
        rc = d.stop()
    assert rc == 0
    log = open(d.log_path).read()
    for said in ("segment /kvcached", "the key table", "the lock and request socket", "the fd socket",
                 "the status socket"):
        assert said in log and "RemoveIPC" in log, (said, log[-3000:])
    assert not os.path.exists(run_dir) or os.listdir(run_dir) == []


def test_a_segment_another_process_put_under_the_name_is_left_alone(run_dir, instance, tmp_path):
    """Its name taken by another segment (not this daemon's): not overwritten, not unlinked at
    the stop; said once."""
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.0625, log_path=str(tmp_path / "d.log"))
    name = f"/kvcached.{os.getuid()}.{instance}"
    try:
        posix_ipc.unlink_shared_memory(name)
        planted = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=4096)
        planted.close_fd()
        time.sleep(1.5)
        with open(f"/dev/shm{name}", "rb") as f:
            assert f.read() == bytes(4096)
    finally:
        rc = d.stop()
    try:
        assert rc == 0 and os.path.exists(f"/dev/shm{name}")
    finally:
        posix_ipc.unlink_shared_memory(name)
    assert open(d.log_path).read().count("is no longer this daemon's") == 1


def test_the_beat_goes_on_whatever_a_heal_meets(instance, monkeypatch, caplog):
    """A heal that fails in a way nobody foresaw (here its spare segment cannot be made, then a
    bug) is logged and not tried again; the heartbeat goes on (engines would call it hung)."""
    import kvcached.server.status_block as sb

    block = sb.StatusSegment(instance)
    try:
        posix_ipc.unlink_shared_memory(block.name)
        monkeypatch.setattr(sb, "_create", lambda name: (_ for _ in ()).throw(RuntimeError("a bug")))
        time.sleep(1.5)
        beat = block.view.heartbeat_ns
        time.sleep(0.3)
        assert block.view.heartbeat_ns > beat and block._thread.is_alive()
        assert block.heals == sb.MAX_HEALS and "making segment" in caplog.text
    finally:
        block.close()


def test_an_engine_whose_own_kv_segments_were_removed_is_told_why_it_cannot_register_again(daemon):
    """Its mapping still works for it, but a daemon (a restarted one) cannot map what has no name."""
    kv = small_kv(num_layers=2, num_blocks=16)
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"kvcached.{os.getuid()}.kv.{os.getpid()}."):
            os.unlink(f"/dev/shm/{name}")
    with daemon.connect(timeout=5) as c, pytest.raises(RequestError, match="does not exist.*RemoveIPC"):
        c.register_kv_cache(kv)


def test_a_key_table_removed_again_and_again_is_made_anew_a_bounded_number_of_times(instance):
    """Each heal re-tells the disk tiers' whole index under the host lock: a name removed over
    and over (a process deleting it in a loop) costs the daemon MAX_HEALS of them, then lookups
    go as messages."""
    from kvcached.service import key_publisher
    from kvcached_proto.key_table import segment_name

    publisher = key_publisher.KeyPublisher(instance, 7)
    name = segment_name(os.getuid(), instance)
    try:
        publisher.rebuild(64, bytes(16), 4096)
        for _ in range(key_publisher.MAX_HEALS):
            posix_ipc.unlink_shared_memory(name)
            assert publisher.heal(lambda: [b"k" * 16], 64)
        posix_ipc.unlink_shared_memory(name)
        assert not publisher.heal(lambda: [b"k" * 16], 64)
        assert not os.path.exists(f"/dev/shm{name}")
    finally:
        publisher.close()
