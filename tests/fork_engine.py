"""An engine that forks after connecting (tests/test_fork.py runs it as a process of its own):
`python fork_engine.py INSTANCE RUN_DIR`. The parent registers random KV and offloads 8 blocks,
then forks; the child calls the Client it inherited (each call timed, with what it raised),
closes it, connects one of its own, drops the KV tensors it inherited and exits through the
interpreter (its finalizers run). The parent, once the child is gone (killed past 30 s), loads
the 8 blocks back and compares them. One JSON line each."""
import gc
import json
import os
import sys
import time

import torch

from kvcached_client import Client, allocate_kv_cache


def _timed(call):
    began = time.monotonic()
    try:
        got = call()
        return {"ok": repr(got), "s": time.monotonic() - began}
    except Exception as exc:  # noqa: BLE001 - reported
        return {"raised": type(exc).__name__, "message": str(exc), "s": time.monotonic() - began}


def child(c, kv, keys, instance, run_dir) -> None:
    out = {name: _timed(call) for name, call in [
        ("lookup", lambda: c.lookup(keys)),
        ("ping", c.ping),
        ("load", lambda: c.load(keys, list(range(8, 16))).wait(5)),
        ("offload", lambda: c.offload(range(16, 24), [os.urandom(16) for _ in range(8)]).wait(5)),
        ("alive", c.alive),
    ]}
    out["close"] = _timed(c.close)
    with Client.connect(instance, run_dir, timeout=5, name="child") as own:
        out["own_ping"] = _timed(own.ping)
        out["own_lookup"] = _timed(lambda: own.lookup(keys))
    c._kv_tensors = None  # the inherited tensors dropped: their segments' finalizers run here
    kv.clear()
    gc.collect()
    print(json.dumps({"child": out}), flush=True)
    sys.exit(0)  # through the interpreter: what is registered to run at exit runs


def main() -> None:
    instance, run_dir = sys.argv[1], sys.argv[2]
    c = Client.connect(instance, run_dir, timeout=3, name="parent")
    kv = allocate_kv_cache(2, 32, (16, 2, 64), torch.float16)
    for layer in kv:
        for t in layer:
            t.copy_(torch.randn(t.shape).to(t.dtype))
    c.register_kv_cache(kv)
    keys = [os.urandom(16) for _ in range(8)]
    c.offload(range(8), keys).wait(10)
    segments = sorted(n for n in os.listdir("/dev/shm") if f".kv.{os.getpid()}." in n)
    pid = os.fork()
    if pid == 0:
        child(c, kv, keys, instance, run_dir)
    deadline, status = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    left = sorted(n for n in os.listdir("/dev/shm") if f".kv.{os.getpid()}." in n)
    loaded = c.load(keys, list(range(24, 32))).wait(10)
    same = all(torch.equal(t[24:32], t[0:8]) for layer in kv for t in layer)
    c.close()
    print(json.dumps({"parent": {"child_status": status, "segments": segments, "left": left,
                                 "loaded": loaded, "same": same}}), flush=True)


if __name__ == "__main__":
    main()
