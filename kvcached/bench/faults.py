"""`kvcached bench faults`: inject the failures DESIGN.md names into a real daemon, count what
came out. Lost and wrong must be 0.

One daemon with a disk tier, in a private run dir:
1. an engine process killed (-9) while its loads run: its pins and KV mapping must go;
2. round trips offload -> load of random blocks, every loaded byte compared;
3. random frames (garbage, random maps, well-formed ops with random content) on a raw socket:
   every one answered, the index invariant walk clean afterwards;
4. the daemon stopped (SIGSTOP) under a load that times out: the blocks stay held until the
   daemon, continued, confirms the end; then the bytes are checked;
5. the daemon killed (-9): how long until the client says DaemonUnavailable;
6. records damaged on disk, a new daemon started: the loads stop at the damage, what loads is exact;
7. a second engine on the instance (register, admin ops, loads into the first's KV) and a client
   that says hello with the engine's id: every attempt refused, the engine's bytes exact;
8. an engine that truncates its own KV segment: its load fails, the daemon lives;
9. two loads racing for one fetch from disk: both exact, one fetch, no slot or pin left over;
10. a FIFO in place of a record: the load stops there, nothing hangs;
11. floods (bench/flood.py): two processes sending costly 2 MiB frames (junk; an over-budget
    layout) while another client pings, junk from 4 processes over 32 connections each (the
    daemon's memory at the peak and after), CURVE handshakes from strangers at a TCP listener
    (bench/handshake_flood.py: the engine's ping, an allowed client's connect), 1,200 silent
    ipc connections while a new engine connects, and 1,000 unfinished requests to /metrics
    while 16 threads scrape it: the ping's latency, the daemon's memory growth and threads,
    connections refused; status requests
    whose replies are never read (the connections closed); a process keeping 80 large deletes
    in flight while the engine deletes (its deletes' wait; one refused counts as lost);
12. another KV geometry registered over the stored blocks: none of them is a hit or loaded.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

from kvcached.bench import expect_line, free_port, process_stop
from kvcached.bench.faults_floods import floods
from kvcached_client import (BlockHasher, Client, DaemonUnavailable, KvcachedTimeout,
                             RequestError, allocate_kv_cache, launch)
from kvcached_proto import Op, encode, make_request, pack_block_ids, pack_keys
from kvcached_proto.paths import request_endpoint

LAYERS, BLOCKS, SHAPE = 4, 128, (16, 2, 64)
HALF = BLOCKS // 2

_ENGINE = """
import sys, time, torch
from kvcached_client import Client, BlockHasher, allocate_kv_cache
c = Client.connect(sys.argv[1], sys.argv[2], timeout=10)
kv = allocate_kv_cache(4, 128, (16, 2, 64), torch.float16)
c.register_kv_cache(kv)
keys = BlockHasher("victim").hash_blocks(list(range(64 * 16)), 16)
c.offload(range(64), keys).wait(10)
print("ready", flush=True)
while True:
    c.load(keys, range(64, 128))
"""


def _fill(kv, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    for layer in kv:
        for t in layer:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def _compare(kv, src, dst, counts) -> None:
    for layer in kv:
        for t in layer:
            a, b = t[list(src)], t[list(dst)]
            counts["bytes_verified"] += a.numel() * a.element_size()
            if not bool((a == b).all()):
                counts["wrong"] += int((a != b).flatten(1).any(1).sum())


def _killed_engine(d, counts, out) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _ENGINE, d.instance, d.run_dir],
                            stdout=subprocess.PIPE, text=True)
    try:
        expect_line(proc, "ready", "the engine process")
        time.sleep(0.2)  # loads in flight
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        proc.wait(10)
    counts["faults_injected"] += 1
    with d.connect() as c:
        while True:
            s = c.status()
            if not s["kv"]["registered"] and s["host"].get("pinned_blocks", 0) == 0:
                break
            if time.monotonic() - killed > 5:
                counts["lost"] += 1  # pins or the mapping outlived the engine
                break
            time.sleep(0.01)
    out["dead_engine_released_ms"] = round((time.monotonic() - killed) * 1e3, 1)


def _round_trips(c, kv, rounds: int, counts) -> None:
    """Each round its own data under its own keys: content addressing means one key, one
    content, as an engine's hashes guarantee."""
    for r in range(rounds):
        _fill(kv, r)
        rkeys = BlockHasher(f"bench-faults-round-{r}").hash_blocks(np.arange(HALF * SHAPE[0]), SHAPE[0])
        t = c.offload(range(HALF), rkeys)
        t.wait(30)
        counts["tasks_completed"] += 1
        loaded = c.load(rkeys, range(HALF, BLOCKS)).wait(30)
        counts["tasks_completed"] += 1
        counts["lost"] += HALF - loaded
        _compare(kv, range(loaded), range(HALF, HALF + loaded), counts)


def _random_frame(rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 200))
    if kind == 1:
        fields = ["proto", "op", "rid", "client", "keys", "blocks", "task", "tier", "layout", "x"]
        values = [None, True, -1, 2**63, b"\x00" * 16, "s", [1, 2], 1.5, {"a": 1}]
        return msgpack.packb({rng.choice(fields): rng.choice(values) for _ in range(rng.randrange(6))})
    op = rng.choice([Op.OFFLOAD, Op.LOAD, Op.LOOKUP, Op.DELETE, Op.CANCEL, Op.PREFETCH, Op.FLUSH])
    keys = [rng.choice([bytes([i]) * 16 for i in range(16)]) for _ in range(rng.randrange(1, 8))]
    blocks = [rng.randrange(BLOCKS + 2) for _ in keys]
    fields = {Op.OFFLOAD: {"keys": pack_keys(keys), "blocks": pack_block_ids(blocks)},
              Op.LOAD: {"keys": pack_keys(keys), "blocks": pack_block_ids(blocks)},
              Op.CANCEL: {"task": rng.randrange(100)}, Op.FLUSH: {}}.get(op, {"keys": pack_keys(keys)})
    frame = encode(make_request(op, rng.randrange(1, 2**31), "fuzz", **fields))
    return frame[: rng.randrange(len(frame) + 1)] if kind == 3 and rng.random() < 0.3 else frame


def _fuzz(d, owner, n: int, counts, out) -> None:
    rng = random.Random(42)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(request_endpoint(d.run_dir, d.instance))

    def ask(frame: bytes) -> dict | None:
        sock.send(frame)
        while sock.poll(5000):
            msg = msgpack.unpackb(sock.recv(), raw=False)
            if not (isinstance(msg, dict) and "event" in msg):
                return msg
        return None

    try:
        ok = 0
        for i in range(n):
            if i % 10 == 0:
                ask(encode(make_request(Op.HELLO, 1, "fuzz", pid=os.getpid())))
            reply = ask(_random_frame(rng))
            counts["inputs_tried"] += 1
            if not isinstance(reply, dict) or "ok" not in reply:
                counts["lost"] += 1  # an input without an answer
            ok += bool(reply and reply.get("ok"))
    finally:
        sock.close(linger=0)
    out["fuzz_valid_requests"] = ok
    out["index_check"] = owner.check()
    if out["index_check"] != "ok":
        counts["wrong"] += 1


def _stopped_daemon(d, c, kv, keys, counts, out) -> None:
    _fill(kv, 999)
    c.offload(range(HALF), keys).wait(30)
    long_timeout, c.timeout = c.timeout, 0.5  # the engine's quick give-up on a stalled daemon
    try:
        c.pause()  # the load stays queued, then the daemon stops answering
        task = c.load(keys, range(HALF, BLOCKS))
        process_stop.stop(d.pid)
        counts["faults_injected"] += 1
        try:
            try:
                task.wait(timeout=0.05)
            except (KvcachedTimeout, DaemonUnavailable):
                pass  # expected: the engine gives up on the load, its blocks stay held
            out["held_while_stopped"] = len(c.held_blocks())
        finally:
            process_stop.go_on(d.pid)
        start = time.monotonic()
        while c.held_blocks() and time.monotonic() - start < 10:
            time.sleep(0.005)
        out["hold_lifted_ms"] = round((time.monotonic() - start) * 1e3, 1)
        if c.held_blocks() or out["held_while_stopped"] != HALF:
            counts["lost"] += 1
    finally:
        c.timeout = long_timeout
    c.resume()
    loaded = c.load(keys, range(HALF, BLOCKS)).wait(30)
    counts["tasks_completed"] += 1
    _compare(kv, range(loaded), range(HALF, HALF + loaded), counts)


def _second_engine(d, c, kv, counts, out) -> None:
    """Everything a careless second engine, or a client using the engine's id, tries is
    refused; a success is a wrong (it would have written or served another engine's KV)."""
    _fill(kv, 777)
    rkeys = BlockHasher("bench-faults-owner").hash_blocks(np.arange(HALF * SHAPE[0]), SHAPE[0])
    c.offload(range(HALF), rkeys).wait(30)
    refused = 0
    other_kv = allocate_kv_cache(LAYERS, BLOCKS, SHAPE, kv[0][0].dtype)
    with d.connect(timeout=10) as b:
        attempts = [lambda: b.register_kv_cache(other_kv), lambda: b.clear(), lambda: b.pause(),
                    lambda: b.unregister_kv_cache(), lambda: b.load(rkeys, range(HALF, BLOCKS)),
                    lambda: b.offload(range(HALF), rkeys), lambda: b.shutdown()]
        for attempt in attempts:
            counts["faults_injected"] += 1
            try:
                attempt()
            except RequestError:
                refused += 1
            else:
                counts["wrong"] += 1
    impostor = Client(d.instance, d.run_dir, timeout=5)
    impostor.client_id = c.client_id
    counts["faults_injected"] += 1
    try:
        impostor._open()
        counts["wrong"] += 1
    except RequestError:
        refused += 1
    finally:
        impostor.close()
    out["hostile_attempts_refused"] = refused
    loaded = c.load(rkeys, range(HALF, BLOCKS)).wait(30)
    counts["tasks_completed"] += 2
    counts["lost"] += HALF - loaded
    _compare(kv, range(loaded), range(HALF, HALF + loaded), counts)


def _truncated_segment(d, c, kv, counts, out) -> None:
    """The engine shrinks a KV segment it registered: its load fails (0 loaded), the daemon
    lives, and the engine's next registration serves exact bytes again."""
    import posix_ipc

    from kvcached_client.kv_alloc import describe_kv_cache

    small = allocate_kv_cache(LAYERS, 8, SHAPE, kv[0][0].dtype)
    c.register_kv_cache(small)
    tkeys = BlockHasher("bench-faults-trunc").hash_blocks(np.arange(4 * SHAPE[0]), SHAPE[0])
    c.offload(range(4), tkeys).wait(30)
    layout = describe_kv_cache(small)
    segment = layout["allocations"][layout["tensors"][0]["alloc"]]["name"]
    shm = posix_ipc.SharedMemory(segment, flags=0)
    os.ftruncate(shm.fd, 0)
    shm.close_fd()
    counts["faults_injected"] += 1
    loaded = c.load(tkeys, range(4, 8)).wait(30)
    counts["tasks_completed"] += 2
    if loaded or not d.alive():
        counts["wrong" if loaded else "lost"] += 1
    out["truncated_segment_load"] = loaded
    c.register_kv_cache(kv)


def _racing_loads(c, kv, keys, counts, out) -> None:
    """Two loads of the same prefix while it is fetched from disk share the fetch; both land
    exact (kv's blocks 0..HALF hold what was stored under keys)."""
    c.clear(tier="host")
    n = HALF // 2
    dsts = (range(HALF, HALF + n), range(HALF + n, BLOCKS))
    for dst in dsts:  # zero the destinations: nothing stale can pass as loaded
        for layer in kv:
            for t in layer:
                t[list(dst)] = 0
    before = c.status()["storage_io"]["fetched"]
    c.pause()
    tasks = [c.load(keys[:n], dst) for dst in dsts]
    counts["faults_injected"] += 1
    c.resume()
    for task, dst in zip(tasks, dsts):
        loaded = task.wait(30)
        counts["tasks_completed"] += 1
        counts["lost"] += n - loaded
        _compare(kv, range(loaded), dst[:loaded], counts)
    s = c.status()
    out["racing_loads_fetched"] = s["storage_io"]["fetched"] - before
    if (s["tasks"]["slots_busy"], s["host"]["pinned_blocks"], c.check()) != (0, 0, "ok"):
        counts["lost"] += 1  # a slot or a pin that outlives its load


def _killed_daemon(d, c, counts, out) -> None:
    os.kill(d.pid, signal.SIGKILL)
    killed = time.monotonic()
    counts["faults_injected"] += 1
    try:
        while time.monotonic() - killed < 5:
            c.lookup([b"k" * 16])
    except DaemonUnavailable:
        out["dead_daemon_seen_ms"] = round((time.monotonic() - killed) * 1e3, 1)
    else:
        counts["lost"] += 1
    d.proc.wait(10)


def _damaged_disk(tmp, name, run_dir, storage, kv, keys, counts, out) -> None:
    from kvcached_client.kv_alloc import describe_kv_cache
    from kvcached_proto.layout import parse_layout

    from ..storage.record import stored_key

    geometry = parse_layout(describe_kv_cache(kv)).geometry_digest()  # records are named by it
    files = sorted(p for p in _record_files(os.path.join(tmp, "disk")))
    named = {bytes.fromhex(os.path.basename(p)[:32]): p for p in files}
    by_key = {k: named[stored_key(k, geometry)] for k in keys if stored_key(k, geometry) in named}
    damaged = [i for i in (40, 50, 60) if keys[i] in by_key]
    fifo = by_key.get(keys[30])
    for i in damaged:
        with open(by_key[keys[i]], "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        counts["faults_injected"] += 1
    _sweep(name)
    with launch(instance=name, run_dir=run_dir, host_cache_gb=0.05, wait_storage=True,
                extra_args=["--storage", storage]) as d2, d2.connect(timeout=10) as c:
        c.register_kv_cache(kv)
        if fifo is not None:  # a FIFO in place of an indexed record: opening it would block
            os.unlink(fifo)
            os.mkfifo(fifo, 0o600)
            counts["faults_injected"] += 1
        for b in range(HALF, BLOCKS):  # zero the destinations: nothing stale can pass as loaded
            for layer in kv:
                for t in layer:
                    t[b].zero_()
        loaded = c.load(keys, range(HALF, BLOCKS)).wait(30)
        counts["tasks_completed"] += 1
        expect = min(damaged + ([30] if fifo is not None else [])) if damaged or fifo else HALF
        out["disk_loaded_before_damage"] = loaded
        if loaded > expect:
            counts["wrong"] += loaded - expect  # a damaged block was served
        elif loaded < expect:
            counts["lost"] += expect - loaded
        _compare(kv, range(loaded), range(HALF, HALF + loaded), counts)
        out["corrupt_records_seen"] = sum(s.get("corrupt", 0) for s in c.status()["storage"])
        _other_geometry(c, keys, counts, out)


def _other_geometry(c, keys, counts, out) -> None:
    """The stored blocks were written from float16 KV; a bfloat16 cache of the same shape (the
    same bytes per block) registered over them must see none."""
    import torch

    other = allocate_kv_cache(LAYERS, BLOCKS, SHAPE, torch.bfloat16)
    c.register_kv_cache(other)
    counts["faults_injected"] += 1
    hits = c.lookup(keys)[1]
    loaded = c.load(keys, range(HALF, BLOCKS)).wait(30)
    counts["tasks_completed"] += 1
    counts["wrong"] += hits + loaded
    out["other_geometry_hits"] = hits + loaded


def _record_files(root: str):
    for dirpath, _, names in os.walk(root):
        for n in names:
            if len(n) >= 32 and all(ch in "0123456789abcdef" for ch in n[:32]):
                yield os.path.join(dirpath, n)


def _sweep(name: str) -> None:
    import posix_ipc

    for segment in (f"/kvcached.{os.getuid()}.{name}", f"/kvcached.{os.getuid()}.{name}.keys"):
        try:
            posix_ipc.unlink_shared_memory(segment)
        except posix_ipc.ExistentialError:
            pass  # the successor daemon would sweep it too; nothing there


def run(quick: bool = False, **_) -> dict:
    import torch

    tmp = tempfile.mkdtemp(prefix="kvbf-", dir="/tmp")
    run_dir, name = os.path.join(tmp, "run"), f"bf{os.getpid()}"
    storage = f"disk://{tmp}/disk?capacity_gb=1"
    counts = {"faults_injected": 0, "inputs_tried": 0, "tasks_completed": 0,
              "bytes_verified": 0, "lost": 0, "wrong": 0}
    out: dict = {}
    kv = allocate_kv_cache(LAYERS, BLOCKS, SHAPE, torch.float16)
    keys = BlockHasher("bench-faults").hash_blocks(np.arange(HALF * SHAPE[0]), SHAPE[0])
    started = time.monotonic()
    metrics_port = free_port()
    d = launch(instance=name, run_dir=run_dir, host_cache_gb=0.05, wait_storage=True,
               extra_args=["--storage", storage, "--metrics-port", str(metrics_port)])
    try:
        _killed_engine(d, counts, out)
        c = d.connect(timeout=10)
        c.register_kv_cache(kv)
        _round_trips(c, kv, 5 if quick else 40, counts)
        _fuzz(d, c, 2000 if quick else 20000, counts, out)
        _second_engine(d, c, kv, counts, out)
        _truncated_segment(d, c, kv, counts, out)
        _stopped_daemon(d, c, kv, keys, counts, out)
        c.flush().wait(60)
        _racing_loads(c, kv, keys, counts, out)
        floods(d, c, metrics_port, quick, counts, out)
        _killed_daemon(d, c, counts, out)
        c.close()
        _damaged_disk(tmp, name, run_dir, storage, kv, keys, counts, out)
    except BaseException:
        _last_words(d)
        raise
    finally:
        d.kill()  # killed on purpose above (or still alive after an error): its log goes
        _sweep(name)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"bench": "faults", **counts, **out, "seconds": round(time.monotonic() - started, 1)}


def _last_words(d) -> None:
    """The bench failed: what the daemon's log says of why, to stderr, before its log goes. A
    native abort's own line (libzmq's "... (src/x.cpp:N)", glibc's, Python's "Fatal Python
    error") and the thread it struck in ("Current thread") come first: a dump of every thread
    follows them, longer than any tail a CI report keeps."""
    try:
        with open(d.log_path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return
    said = []
    for i, ln in enumerate(lines):
        if ln.startswith("Current thread"):
            said += lines[i:i + 8]
        elif any(m in ln for m in _CAUSES):
            said.append(ln)
    state = "running" if d.proc.poll() is None else f"exited with {d.proc.returncode}"
    print(f"kvcached bench faults: the daemon ({state}) said:\n{''.join(said[-24:])}...\n"
          f"and last logged:\n{''.join(lines[-20:])}", file=sys.stderr)


_CAUSES = ("(src/", "Fatal Python error", "Assertion", "malloc", "free()", "corrupted",
           "open-files limit", "Traceback", "Error:")


def format_result(r: dict) -> str:
    lines = [f"{k:<28} {v}" for k, v in r.items() if k != "bench"]
    verdict = "OK: nothing lost, nothing wrong" if r["lost"] == 0 and r["wrong"] == 0 else "FAILED"
    return "kvcached bench faults\n" + "\n".join(lines) + f"\n{verdict}"
