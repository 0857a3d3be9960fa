"""The engine-side KV allocation: what an engine process runs, apart from any daemon."""
import os
import subprocess
import sys
import textwrap

import pytest

COLLECT_UNDER_THE_TABLE_LOCK = textwrap.dedent("""
    import gc, torch
    from kvcached_client import allocate_kv_cache, kv_alloc
    garbage = [allocate_kv_cache(1, 2, (4,), torch.float16)]
    garbage.append(garbage)  # a cycle: only a collection frees it, and runs its finalizer
    del garbage
    with kv_alloc._lock:  # held as describe_kv_cache holds it while it walks the segment table
        gc.collect()  # a collection there (any allocation may start one) finalizes the segment
    print("done", flush=True)
""")


def test_a_collection_while_describing_the_kv_cache_does_not_deadlock():
    """A segment's finalizer may run in a collection on a thread that is walking the segment
    table under its lock: it took that lock too, and register_kv_cache hung forever."""
    try:
        out = subprocess.run([sys.executable, "-c", COLLECT_UNDER_THE_TABLE_LOCK],
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("describe_kv_cache deadlocked in a segment finalizer")
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr


_SMALL_SHM = r"""
import os, sys
from kvcached_client import KvcachedError, RequestError, allocate_kv_cache, launch
import kvcached_client.kv_alloc as kv_alloc
try:
    allocate_kv_cache(2, 64, (16, 2, 128))  # 2 MiB: /dev/shm has 512 KiB
    print("allocated")
except KvcachedError as exc:
    print("refused:", exc)
sparse = kv_alloc._reserve
kv_alloc._reserve = lambda fd, n: None  # a segment made without reserving, as before
kv = allocate_kv_cache(2, 64, (16, 2, 128))
kv_alloc._reserve = sparse
run_dir = sys.argv[1]
with launch(instance="smallshm", run_dir=run_dir, host_cache_gb=0.01) as d, d.connect() as c:
    try:
        c.register_kv_cache(kv)
        print("registered")
    except RequestError as exc:
        print("daemon:", exc)
"""


def test_kv_on_a_dev_shm_without_room_is_refused_at_allocation_not_a_sigbus_later(tmp_path):
    """Docker's default /dev/shm is 64 MiB: here a 512 KiB one in a private mount namespace.
    The allocation reserves its memory (ENOSPC at once, naming /dev/shm and --shm-size)
    instead of handing the engine a sparse segment that kills it with SIGBUS at its first
    write; a sparse one made otherwise is refused by the daemon with the same advice."""
    import shutil
    import subprocess
    import sys

    if os.getuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private /dev/shm")
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM)
    out = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=512k tmpfs /dev/shm "
                          f"&& exec {sys.executable} {script} {tmp_path / 'run'}"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: /dev/shm has no room for 2.0 MiB") and "--shm-size" in lines[0]
    assert lines[1].startswith("daemon:") and "/dev/shm has no room" in lines[1] and "--shm-size" in lines[1]
