"""`kvcached bench ipc`: request round trips through the real daemon vs a bare pyzmq echo.

Both sides use the same encoded frames (a ping and a 64-key lookup) in the same run, timed
interleaved; the daemon side goes through the real Client (encode, send, wait, decode) and the
daemon's full request path. The ratio daemon/bare of the p50s is the figure of merit (<= 1.5).
Then a 64-block load of host hits, from Client.load to its reply (what an engine waits before it
can wait on the load's first layer; the copies start once the reply is sent and each load's are
waited for untimed) against the bare echo of a frame of the same size, interleaved.
Then a step's 8 loads of 8 host hits, sent one after another's reply against sent together
(Client.load_batch), to the last reply and to layer 0 of every load: the ratios batch/one-by-one.
Then the same 64-key lookup (64 host hits) through Client.lookup answered from the daemon's key
table in shared memory (client/key_table.py), back to back: p50 <= 10 us, p99 <= 50 us.
Then the loaded case (ipc_load.py): lookups idle and while another engine keeps the disk and
redis tiers busy with backups - sent ones that ask the storage tiers, and key-table ones -
each with its loaded/idle p99 ratio (<= 2).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import zmq

from kvcached_client import allocate_kv_cache, launch
from kvcached_proto import Op, encode, make_request, pack_block_ids, pack_keys

from . import expect_line
from .ipc_load import format_loaded, run_loaded
from .stats import percentiles_us, ratio


def _time_interleaved(calls: dict, n: int, warmup: int) -> dict:
    """Time each call n times, interleaved, so drift in machine load hits all of them alike."""
    samples = {name: [] for name in calls}
    for i in range(warmup + n):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            if i >= warmup:
                samples[name].append(time.perf_counter() - t0)
    return {name: percentiles_us(s) for name, s in samples.items()}


def _bare_call(sock, frame: bytes):
    def call():
        sock.send(frame)
        if not sock.poll(5000):
            raise RuntimeError("bare echo did not answer within 5 s")
        sock.recv()
    return call


def _load_requests(client, bare, frame: bytes, keys, n: int, warmup: int) -> dict:
    """Client.load to its reply (each load's copies waited for after, untimed) and the bare
    echo of a frame of the same size, interleaved."""
    bare_call, blocks = _bare_call(bare, frame), list(range(len(keys)))
    samples = {"daemon": [], "bare": []}
    for i in range(warmup + n):
        t0 = time.perf_counter()
        task = client.load(keys, blocks)
        t1 = time.perf_counter()
        if task.wait(30) != len(keys):
            raise RuntimeError("a load of host hits came back short")
        t2 = time.perf_counter()
        bare_call()
        t3 = time.perf_counter()
        if i >= warmup:
            samples["daemon"].append(t1 - t0)
            samples["bare"].append(t3 - t2)
    return {k: percentiles_us(v) for k, v in samples.items()}


STEP_LOADS, STEP_BLOCKS = 8, 8


def _step_loads(client, keys, n: int, warmup: int) -> dict:
    """A step that loads for 8 requests, 8 host hits each: sent each after the last one's reply
    (Client.load) against sent together (Client.load_batch), interleaved; timed to the last
    reply, and to layer 0 of every load in place (what an engine's forward waits for before its
    first layer), each step's copies waited for after, untimed."""
    reqs = [(keys[i * STEP_BLOCKS:(i + 1) * STEP_BLOCKS], list(range(i * STEP_BLOCKS, (i + 1) * STEP_BLOCKS)))
            for i in range(STEP_LOADS)]
    calls = {"one_by_one": lambda: [client.load(k, b) for k, b in reqs],
             "batch": lambda: client.load_batch(reqs)}
    samples = {f"{name}{what}": [] for name in calls for what in ("", "_layer0")}
    for i in range(warmup + n):
        for name, call in calls.items():
            t0 = time.perf_counter()
            tasks = call()
            t1 = time.perf_counter()
            if any(isinstance(t, Exception) for t in tasks):
                raise RuntimeError(f"a step's load ({name}) failed: {tasks}")
            for t in tasks:
                t.wait_layer(0, timeout=30)
            t2 = time.perf_counter()
            if any(t.wait(30) != STEP_BLOCKS for t in tasks):
                raise RuntimeError(f"a step's load ({name}) came back short")
            if i >= warmup:
                samples[name].append(t1 - t0)
                samples[f"{name}_layer0"].append(t2 - t0)
    out = {name: percentiles_us(v) for name, v in samples.items()}
    out["p50_ratio"] = ratio(out["batch"]["p50_us"], out["one_by_one"]["p50_us"])
    out["layer0_p50_ratio"] = ratio(out["batch_layer0"]["p50_us"], out["one_by_one_layer0"]["p50_us"])
    return out


def run(quick: bool = False, **_) -> dict:
    n, warmup = (300, 50) if quick else (5000, 500)
    run_dir = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    instance = f"bench-ipc-{os.getpid()}"
    keys = [os.urandom(16) for _ in range(64)]
    frames = {
        "ping": encode(make_request(Op.PING, 1, "bench")),
        "lookup64": encode(make_request(Op.LOOKUP, 1, "bench", keys=pack_keys(keys))),
        "load64": encode(make_request(Op.LOAD, 1, "bench", keys=pack_keys(keys),
                                      blocks=pack_block_ids(range(64)))),
    }
    echo_endpoint = f"ipc://{run_dir}/echo.sock"
    echo = subprocess.Popen([sys.executable, "-m", "kvcached.bench.echo", echo_endpoint, "600"],
                            stdout=subprocess.PIPE, text=True)
    daemon = None
    try:
        expect_line(echo, "ready", "the bare echo process")
        daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.0625)
        bare = zmq.Context.instance().socket(zmq.DEALER)
        bare.setsockopt(zmq.LINGER, 0)
        bare.connect(echo_endpoint)
        with daemon.connect(name="bench-ipc", key_table=False) as client, \
                daemon.connect(name="bench-ipc-table") as table_client:
            table_client.register_kv_cache(allocate_kv_cache(2, 64, (16, 2, 64), torch.float16))
            table_client.offload(range(64), keys).wait(30)  # the lookups are 64 host hits
            if table_client.lookup(keys) != client.lookup(keys) or table_client.key_table.answered != 1:
                raise RuntimeError("the key table did not answer the lookup as the daemon does")
            timed = _time_interleaved({
                "daemon/ping": client.ping,
                "bare/ping": _bare_call(bare, frames["ping"]),
                "daemon/lookup64": lambda: client.lookup(keys),
                "bare/lookup64": _bare_call(bare, frames["lookup64"]),
            }, n, warmup)
            loads = _load_requests(table_client, bare, frames["load64"], keys, n, warmup)
            timed.update({"daemon/load64": loads["daemon"], "bare/load64": loads["bare"]})
            step = _step_loads(table_client, keys, n // 5, warmup // 5)
            # on its own, back to back as a scheduler asks (interleaved with round trips, each
            # would run on a CPU the daemon and the echo just left)
            table = {**_time_interleaved({"table": lambda: table_client.lookup(keys)}, n, warmup)["table"],
                     "answered": table_client.key_table.answered, "asked": table_client.key_table.asked}
        bare.send(b"")
        bare.close(linger=100)
    finally:
        if daemon is not None:
            daemon.stop()
        echo.terminate()
        echo.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)
    results = {name: _against_bare(timed, name, len(frame)) for name, frame in frames.items()}
    return {"bench": "ipc", "results": results, "target": {"p50_ratio_max": 1.5},
            "key_table": {"lookup64": table, "target": {"p50_us_max": 10, "p99_us_max": 50}},
            "step_loads": dict(step, loads=STEP_LOADS, blocks=STEP_BLOCKS),
            "loaded": run_loaded(quick)}


def _against_bare(timed: dict, name: str, frame_bytes: int) -> dict:
    daemon, bare = timed[f"daemon/{name}"], timed[f"bare/{name}"]
    return {"daemon": daemon, "bare_echo": bare, "frame_bytes": frame_bytes,
            "p50_ratio": ratio(daemon["p50_us"], bare["p50_us"]),
            "p99_ratio": ratio(daemon["p99_us"], bare["p99_us"])}


def format_result(r: dict) -> str:
    lines = [f"{'request':<10} {'bytes':>6} {'daemon p50':>11} {'p99':>9} {'bare p50':>9} "
             f"{'p99':>9} {'ratio p50':>10} {'p99':>7}"]
    for name, x in r["results"].items():
        d, b = x["daemon"], x["bare_echo"]
        lines.append(f"{name:<10} {x['frame_bytes']:>6} {d['p50_us']:>9.1f}us {d['p99_us']:>7.1f}us "
                     f"{b['p50_us']:>7.1f}us {b['p99_us']:>7.1f}us {x['p50_ratio']:>10.2f} "
                     f"{x['p99_ratio']:>7.2f}")
    lines.append(f"target: p50 ratio <= {r['target']['p50_ratio_max']}")
    if "key_table" in r:
        t, goal = r["key_table"]["lookup64"], r["key_table"]["target"]
        lines.append(f"lookup64 from the key table (no message): p50 {t['p50_us']:.1f}us p99 "
                     f"{t['p99_us']:.1f}us, {t['answered']} answered, {t['asked']} sent to the daemon "
                     f"(target p50 <= {goal['p50_us_max']}us, p99 <= {goal['p99_us_max']}us)")
    if "step_loads" in r:
        st = r["step_loads"]
        lines.append(f"a step's {st['loads']} loads of {st['blocks']} host hits, to the last reply: "
                     f"one by one p50 {st['one_by_one']['p50_us']:.1f}us p99 "
                     f"{st['one_by_one']['p99_us']:.1f}us, load_batch p50 {st['batch']['p50_us']:.1f}us "
                     f"p99 {st['batch']['p99_us']:.1f}us (ratio p50 {st['p50_ratio']:.2f})")
        if "layer0_p50_ratio" in st:
            a, b = st["one_by_one_layer0"], st["batch_layer0"]
            lines.append(f"  to layer 0 of every load in place: one by one p50 {a['p50_us']:.1f}us p99 "
                         f"{a['p99_us']:.1f}us, load_batch p50 {b['p50_us']:.1f}us p99 {b['p99_us']:.1f}us "
                         f"(ratio p50 {st['layer0_p50_ratio']:.2f})")
    if "loaded" in r:
        lines.append(format_loaded(r["loaded"]))
    return "\n".join(lines)
