"""Failure rules with real processes: a client killed mid-task, overload, many clients at once, a closed connection."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import small_kv, wait_until
from kvcached_client import BlockHasher, Busy, launch
from kvcached_proto import Op
from kvcached_proto.paths import kv_segment_prefix

pytestmark = pytest.mark.faults  # fault injection: every test of this module

HASHER = BlockHasher("faults")

ENGINE = textwrap.dedent("""
    import sys, torch
    from kvcached_client import Client, BlockHasher, allocate_kv_cache
    c = Client.connect(instance=sys.argv[1], run_dir=sys.argv[2], timeout=30)
    kv = allocate_kv_cache(16, 512, (16, 8, 128), torch.bfloat16)
    c.register_kv_cache(kv)
    keys = BlockHasher("victim").hash_blocks(list(range(16 * 200)), 16)
    c.offload(list(range(200)), keys).wait(60)
    c.pause()  # everything below stays queued: the kill lands while work is pending
    c.load(keys, list(range(250, 450)))
    c.offload(list(range(200, 250)), BlockHasher("victim2").hash_blocks(list(range(16 * 50)), 16))
    print("ready", flush=True)
    sys.stdin.read()
""")


def _segments_of(pid: int) -> list[str]:
    """The engine's KV segments still in /dev/shm."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(kv_segment_prefix(os.getuid(), pid))]


def _status(c):
    return c.status()


def test_a_killed_engine_has_its_tasks_cancelled_and_pins_released(run_dir, instance):
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.5)
    try:
        engine = subprocess.Popen([sys.executable, "-c", ENGINE, instance, run_dir],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert engine.stdout.readline().strip() == "ready"
        with h.connect(role="operator") as other:
            before = other.status()
            assert before["tasks"]["queued"] == 2 and before["host"]["pinned_blocks"] == 200
            other.resume()  # the engine paused the daemon; an operator lifts it
            engine.kill()
            engine.wait(10)
            start = time.monotonic()
            while True:
                s = other.status()
                if (s["tasks"]["queued"], s["tasks"]["inflight"], s["host"]["pinned_blocks"],
                        s["clients"], s["kv"]["registered"]) == (0, 0, 0, 1, False):
                    break
                assert time.monotonic() - start < 2.0, s
                time.sleep(0.02)
            assert other.ping() < 1.0  # the other client is unaffected
            kv = small_kv()
            other.register_kv_cache(kv)
            keys = HASHER.hash_blocks(list(range(16 * 4)), 16)
            other.offload([0, 1, 2, 3], keys).wait(10)
            assert other.lookup(keys) == (4, 0)
            # the dead engine's KV mapping is dropped and its shm segment swept (within 2 s)
            while _segments_of(engine.pid):
                assert time.monotonic() - start < 2.0, "the dead engine's KV segment is still there"
                time.sleep(0.02)
    finally:
        h.stop()


def test_a_full_queue_answers_busy_and_changes_nothing(run_dir, instance):
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05,
               extra_args=["--max-queued-tasks", "4"])
    try:
        with h.connect() as c:
            kv = small_kv()
            c.register_kv_cache(kv)
            c.pause()
            tasks = [c.offload([i], HASHER.hash_blocks(list(range(16 * i, 16 * i + 16)), 16))
                     for i in range(4)]
            with pytest.raises(Busy, match="max-queued-tasks"):
                c.offload([10], HASHER.hash_blocks(list(range(999, 999 + 16)), 16))
            assert c.status()["host"]["blocks"] == 4  # the refused one left no trace
            c.resume()
            assert [t.wait(10)["stored"] for t in tasks] == [1, 1, 1, 1]
    finally:
        h.stop()


def test_many_clients_at_once_lose_and_duplicate_no_completion(run_dir, instance):
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    clients, errors, done = 8, [], []
    ops = int(os.environ.get("KVCACHED_SOAK_OPS", "2000"))

    def engine(n):
        try:
            with h.connect(timeout=30) as c:
                kv = small_kv(num_layers=2, num_blocks=64, seed=n) if n == 0 else None
                if kv is not None:
                    c.register_kv_cache(kv)
                seen = set()
                for i in range(ops):
                    keys = HASHER.hash_blocks(list(range(n * 10**6 + i * 16, n * 10**6 + i * 16 + 32)), 16)
                    if n == 0 and i % 3 == 0:
                        t = c.offload([i % 32, 32 + i % 32], keys)
                        t.wait(30)
                        assert t.id not in seen
                        seen.add(t.id)
                        lt = c.load(keys, [(i + 5) % 32, 32 + (i + 7) % 32])
                        assert lt.wait(30) in (0, 1, 2)
                    else:
                        c.lookup(keys)
                done.append((n, ops))
        except Exception as exc:  # reported below with the client number
            errors.append((n, repr(exc)))

    try:
        threads = [threading.Thread(target=engine, args=(n,)) for n in range(clients)]
        rss0 = int(open(f"/proc/{h.pid}/status").read().split("VmRSS:")[1].split()[0])
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert sorted(n for n, _ in done) == list(range(clients))
        with h.connect() as c:
            s = c.status()
        assert s["tasks"]["failed"] == 0 and s["tasks"]["queued"] == 0 and s["tasks"]["inflight"] == 0
        rss1 = int(open(f"/proc/{h.pid}/status").read().split("VmRSS:")[1].split()[0])
        assert rss1 - rss0 < 64 * 1024, f"daemon RSS grew by {(rss1 - rss0) // 1024} MiB"
    finally:
        h.stop()


def test_a_client_whose_pid_the_daemon_cannot_see_is_released_when_its_connection_closes(daemon):
    """Across pid namespaces the pid means nothing; the closed connection tells instead: the
    stranger's queued load is cancelled, its pins and its KV mapping released."""
    from kvcached_client.kv_alloc import describe_kv_cache
    from kvcached_proto import encode, make_request, pack_block_ids, pack_keys
    from rawsock import RawSocket

    kv = small_kv()
    keys = HASHER.hash_blocks(list(range(16 * 4)), 16)
    with daemon.connect() as first, daemon.connect(role="operator") as operator:
        first.register_kv_cache(kv)
        first.offload([0, 1, 2, 3], keys).wait(10)
        first.unregister_kv_cache()  # the host tier keeps the blocks
        raw = RawSocket(daemon.run_dir, daemon.instance)
        unseen_pid = 2**22 + 12345  # above pid_max: not a pid this namespace has
        assert raw.ask(encode(make_request(Op.HELLO, 1, "stranger", pid=unseen_pid)))["ok"]
        assert raw.ask(encode(make_request(Op.REGISTER_KV, 2, "stranger",
                                           layout=describe_kv_cache(kv))))["ok"]
        operator.pause()  # the stranger's load stays queued, pinning 4 host blocks
        reply = raw.ask(encode(make_request(Op.LOAD, 3, "stranger", keys=pack_keys(keys),
                                            blocks=pack_block_ids([8, 9, 10, 11]))))
        assert reply["ok"], reply
        s = operator.status()
        assert s["clients"] == 3 and s["tasks"]["queued"] == 1 and s["host"]["pinned_blocks"] == 4
        raw.close()
        start = time.monotonic()
        while True:
            s = operator.status()
            if (s["clients"], s["tasks"]["queued"], s["host"]["pinned_blocks"],
                    s["kv"]["registered"]) == (2, 0, 0, False):  # its mapping went with it
                break
            assert time.monotonic() - start < 2.0, s
            time.sleep(0.02)
        operator.resume()
        assert operator.check() == "ok"


_DROPPING_ENGINE = textwrap.dedent("""
    import sys, torch
    from kvcached_client import Client, allocate_kv_cache
    kv = allocate_kv_cache(2, 16, (16, 2, 8), torch.bfloat16)
    c = Client.connect(sys.argv[1], sys.argv[2], timeout=10)
    if sys.argv[3] == "register":
        c.register_kv_cache(kv)
    c._sock.close(linger=0)  # gone without a bye, the process still running
    print("dropped", flush=True)
    sys.stdin.read()
""")


def test_a_daemon_stopped_as_an_engine_dies_still_sweeps_its_kv_segments(run_dir, instance):
    """An engine's connection closes a moment before its process is reaped; the daemon sweeps
    its segments on the reaper's next turn. A stop that comes first - here the engine is killed
    only once the daemon is stopping - must not leave the dead engine's memory in /dev/shm. An
    engine that closed its connection but lives on keeps its segments (still in use)."""
    from kvcached_client.status_block import StatusReader
    from kvcached_proto.shm_layout import State

    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    engines = []
    reader = None
    try:
        with h.connect(role="operator") as operator:
            for mode in ("register", "connect"):
                engines.append(subprocess.Popen(
                    [sys.executable, "-c", _DROPPING_ENGINE, instance, run_dir, mode],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
                assert engines[-1].stdout.readline().strip() == "dropped"
                wait_until(lambda: operator.status()["clients"] == 1, 10, "the disconnect seen")
        dying, living = engines
        assert _segments_of(dying.pid) and _segments_of(living.pid)
        reader = StatusReader(instance)
        h.proc.terminate()
        wait_until(lambda: reader.view.state == State.STOPPING, 10, "the daemon stopping")
        dying.kill()
        dying.wait(10)
        assert h.proc.wait(15) == 0
        assert not _segments_of(dying.pid), "the dead engine's KV segment outlived the daemon"
        assert _segments_of(living.pid), "a running engine's segment was swept"
    finally:
        if reader is not None:
            reader.close()
        h.stop()
        for engine in engines:
            if engine.poll() is None:
                engine.stdin.close()  # it exits, unlinking its own segments
                engine.wait(10)
    for engine in engines:
        assert not _segments_of(engine.pid)
