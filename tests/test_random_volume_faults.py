"""Random concurrent work against one daemon whose disk tier's volume goes away and comes back
under it (kvcached/storage/disk_root.py): the engine offloads and loads layer-wise, an operator
deletes, prefetches, looks up and clears the host tier (test_random_ops), the weights change
under the same keys now and then (every tier cleared: no block of before may be loaded after),
and by the clock the tier's tmpfs volume is unmounted (lazily: the daemon's lock keeps it) and
a new volume holding what the old one held is mounted in its place a moment later - a FUSE or
network filesystem remounted, another device. Every block loaded is compared with its key's
content under the weights it was asked under; after the faults the tier serves loads again, and
a restart on the last volume loads every document once more. Seeded; KVCACHED_SOAK_OPS scales the
run, KVCACHED_SOAK_SEED moves its seed. Needs root (mount); skipped without it."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import time

import pytest
from conftest import disk_uri, settled_status, small_kv, wait_until
from storage_util import owes_work
from test_random_disk_faults import HOST_PAGES, _step, check_run, reloaded, served_again
from test_random_ops import BLOCKS, LAYERS, PAGE, SHAPE, Contents, Engine, _docs, operated

from kvcached.storage.disk_clear import MARK
from kvcached_client import launch


class Remounts:
    """The tier's volume at `path` (a tmpfs), taken away for 0.2-0.6 s, then a new one with a
    copy of the old one's files mounted, present for 0.8-1.6 s (`tick`, by the clock). The copy
    is made from the old volume after it left the path (an fd kept on it), so the new one holds
    what the old one held when the daemon lost it, and it appears whole (renamed into place)."""

    def __init__(self, path: str, seed: int):
        self.path, self.rng = path, random.Random(seed)
        self.root = os.path.join(path, "tier")
        self.away_fd = -1  # the old volume, while away
        self.mounts = 0
        self.next_s = 0.0

    def mount(self) -> None:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", self.path],
                              capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
        self.mounts += 1

    def tick(self) -> None:
        if time.monotonic() < self.next_s:
            return
        if self.away_fd < 0:
            self.away_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            subprocess.run(["umount", "-l", self.path], check=True)
            self.next_s = time.monotonic() + self.rng.uniform(0.2, 0.6)
        else:
            self.back()
            self.next_s = time.monotonic() + self.rng.uniform(0.8, 1.6)

    def back(self) -> None:
        self.mount()
        staging = os.path.join(self.path, ".staging")
        shutil.copytree(f"/proc/self/fd/{self.away_fd}/tier", staging, symlinks=True,
                        ignore_dangling_symlinks=True)
        os.rename(staging, self.root)
        os.close(self.away_fd)
        self.away_fd = -1

    def close(self) -> None:
        if self.away_fd >= 0:
            os.close(self.away_fd)
        else:
            subprocess.run(["umount", "-l", self.path], check=True)


@pytest.mark.faults
@pytest.mark.parametrize("seed", [31])
def test_random_ops_on_a_volume_that_goes_and_comes_back_never_serve_a_wrong_byte(
        run_dir, instance, seed):
    ops = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 4
    seed += int(os.environ.get("KVCACHED_SOAK_SEED", "0"))
    rng, docs = random.Random(seed), _docs()
    kv = small_kv(num_layers=LAYERS, num_blocks=BLOCKS, block_shape=SHAPE, seed=seed)
    errors: list = []
    path = tempfile.mkdtemp(prefix="kvvol-", dir="/tmp")
    vol = Remounts(path, seed)
    try:
        vol.mount()
        args = dict(instance=instance, run_dir=run_dir, host_cache_gb=HOST_PAGES * PAGE / 2**30,
                    extra_args=["--storage", disk_uri(vol.root)], wait_storage=True)
        with launch(**args) as d, d.connect(timeout=30) as c:
            c.register_kv_cache(kv)
            engine = Engine(c, Contents(kv), rng)
            with operated(d, docs, seed, errors, {}) as permits:
                n, updated_at = 0, 0
                while n < ops or vol.mounts < 5 or vol.away_fd >= 0:
                    vol.tick()
                    if vol.away_fd >= 0 and updated_at != vol.mounts:  # once while the
                        updated_at = vol.mounts  # volume is away, each time: at the step that
                        # took it away (by chance a later step: a loaded machine ran too few
                        # steps in 0.2-0.6 s, and a run had 3 updates, not the 4 it checks)
                        engine.weights_update()
                    elif rng.random() < 0.001:  # and now and then while it is there
                        engine.weights_update()
                    n = _step(engine, rng, docs, permits, n)
                wait_until(lambda: c.status()["storage"][0]["healthy"] and c.status()["storage"][0]["ready"],
                           10, "the disk tier indexed on the last volume")
                was = served_again(c, engine, rng, docs, permits, n, ops)
            assert c.check() == "ok"
            # the unlinks that failed while the volume was away are done on the last one (the
            # probe tries them again): no clear's mark or owed clear is left for the restart
            wait_until(lambda: not owes_work(c.status()["storage"][0])
                       and not os.path.exists(os.path.join(vol.root, MARK)), 15, "the unlinks done")
            s = settled_status(c)
        check_run(errors, engine, s, seed, was)
        assert engine.updates >= 4, "too few weights updates in the run"
        after, log = reloaded(args, kv, engine.contents, docs, seed)  # a restart on the last volume
        assert "stopped during a clear" not in log and "owed" not in log, log
        assert after.wrong == 0 and (after.loaded > 0 or s["storage"][0]["blocks"] == 0), \
            (after.wrong, after.loaded, s["storage"][0])
    finally:
        vol.close()
        subprocess.run(["rm", "-rf", path], check=True)
