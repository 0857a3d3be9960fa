"""The engine-side KV allocation: what an engine process runs, apart from any daemon."""
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
