"""A /dev/shm without room for the daemon's own segments (Docker's default is 64 MiB).

A POSIX segment is a sparse file on a tmpfs: a write to a page the tmpfs has no room for is a
SIGBUS. The daemon's key table, sized for the host tier and the local storage tiers' blocks
(256 MiB for 4 KiB blocks on a 20 GB disk tier), killed the daemon at an engine's registration
in a 64 MiB /dev/shm. Each test runs in a private mount namespace with a small tmpfs there.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(os.getuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare(1) for a private /dev/shm")

SMALL_TABLE = textwrap.dedent("""
    import os, sys
    import torch
    sys.path.insert(0, {here!r})
    from conftest import keys_for, small_kv, snapshot
    from kvcached_client import launch
    run_dir, disk = {run_dir!r}, {disk!r}
    with launch(instance="shmroom", run_dir=run_dir, host_cache_gb=0.01,
                extra_args=["--storage", f"disk://{{disk}}?capacity_gb=1"]) as d:
        kv = small_kv(num_blocks=64, seed=1)  # 4 KiB blocks: the table would be 16 MiB
        with d.connect() as c, d.connect(key_table=False) as asked:
            c.register_kv_cache(kv)
            chains = [keys_for(64, seed=s) for s in range(120)]  # 7,680 keys, the host holds 2,441
            for chain in chains:
                c.offload(list(range(64)), chain).wait(30)
                c.flush().wait(30)  # on disk before the next evicts it from the host
            table = c.status()["key_table"]
            print("table", table["slots"], table["max_keys"], " ".join(table["flags"]))
            same = sum(c.lookup(chain) == asked.lookup(chain) for chain in chains)
            print("same", same, len(chains), "hits", sum(sum(c.lookup(ch)) for ch in chains))
            want = snapshot(small_kv(num_blocks=64, seed=1), range(64))
            for layer in kv:  # the engine's blocks overwritten, then the first chain loaded back
                for t in layer:
                    t.zero_()
            n = c.load(chains[0], list(range(64))).wait(30)
            print("loaded", n, all(all(torch.equal(a, b) for a, b in zip(x, y))
                                   for x, y in zip(snapshot(kv, range(64)), want)))
        print("alive", d.proc.poll() is None)
""")


def _in_small_shm(size: str, script: str, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_LOG_DIR"}
    env["TMPDIR"] = str(tmp_path)  # (the log a refused daemon leaves)
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} {path}"],
                          capture_output=True, text=True, timeout=240, env=env)


def test_a_key_table_larger_than_dev_shm_is_made_smaller_not_a_sigbus(tmp_path):
    """A 1 MiB /dev/shm: the table takes at most half of what is free (its memory taken when
    made), holds fewer keys than the tiers do and says so; every lookup answered from it equals
    the daemon's, and the loads are byte-exact."""
    script = SMALL_TABLE.format(here=HERE, run_dir=str(tmp_path / "run"), disk=str(tmp_path / "disk"))
    out = _in_small_shm("1m", script, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    slots, max_keys, flags = lines["table"].split(" ", 2)
    assert int(slots) <= 16384 and int(max_keys) < 7680  # not the 512Ki slots asked for
    assert "storage_complete" not in flags.split()  # what it could not take: ask the daemon
    assert lines["same"].split()[:2] == ["120", "120"] and int(lines["same"].split()[3]) > 0
    assert lines["loaded"] == "64 True"
    assert lines["alive"] == "True"


NO_ROOM_AT_START = textwrap.dedent("""
    from kvcached_client import launch
    try:
        with launch(instance="shmroom", run_dir={run_dir!r}, ready_timeout=30):
            print("started")
    except Exception as exc:
        print("refused", type(exc).__name__, str(exc).replace(chr(10), " "))
""")


def test_a_dev_shm_without_room_for_the_status_segment_refuses_the_start_by_name(tmp_path):
    """A 16 KiB /dev/shm cannot hold the 32 KiB status segment: the daemon does not start, and
    says why and what to change (it started on a sparse segment, whose load-progress slots past
    the room would have been a SIGBUS at an engine's first loads)."""
    out = _in_small_shm("16k", NO_ROOM_AT_START.format(run_dir=str(tmp_path / "run")), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("refused"), out.stdout
    assert "/dev/shm has no room for 32 KiB of status segment" in out.stdout and "--shm-size" in out.stdout
