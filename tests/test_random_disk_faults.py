"""Random concurrent work against one daemon while its disk tier is damaged, or fills up, under
it: the engine offloads and loads layer-wise while an operator deletes, prefetches, looks up and
clears the host tier (test_random_ops), and between the engine's steps a record file is damaged
as a failing disk or a careless hand damages it (a bit flipped in the payload or the header, cut
short, emptied, removed, overwritten by another key's record or by junk of its size), or, on a
2 MiB filesystem, a ballast file takes the free space and gives it back (on a 320-inode one,
ballast files take the free inodes). A damaged record is a
miss, never data: every block loaded is compared with its key's content, and the host tier is
small, so most loads read the disk. After the faults, as many steps again without them: the
tier serves loads again; then the daemon restarts on the damaged directory and every document is
loaded once more. Seeded; KVCACHED_SOAK_OPS scales the run, KVCACHED_SOAK_SEED moves its
seed."""
from __future__ import annotations

import os
import random
import shutil
import time

import pytest
from conftest import disk_uri, settled_status, small_kv, wait_until
from storage_util import files, small_filesystem
from test_random_ops import BLOCKS, LAYERS, PAGE, SHAPE, Contents, Engine, _docs, operated

from kvcached_client import launch

HOST_PAGES = 16  # of the 96 blocks in play: most loads read the disk tier
HEADER = 48  # record.py's header; the payload follows
DAMAGE = ("flip_payload", "flip_header", "truncate", "empty", "remove", "foreign", "junk")


class DiskFaults:
    """What befalls the disk tier's directory between the engine's steps (`tick`): a record
    damaged every few steps ("damage"), or the filesystem's free space taken by a ballast file
    for 0.2-0.6 s, then given back for 1.2-2 s, past the tier's probe that raises its limit again
    ("full"; by the clock: the steps are fast), or its free inodes so ("inodes")."""

    def __init__(self, kind: str, root: str, seed: int):
        self.kind, self.root, self.rng = kind, root, random.Random(seed)
        self.done: dict[str, int] = {}
        self.ballast = os.path.join(root, "ballast")
        self.next_s = 0.0  # (full) when the ballast comes or goes next

    def tick(self, n: int) -> None:
        if self.kind == "damage":
            if n % 4 == 0:
                self.damage()
        elif time.monotonic() >= self.next_s:
            held = os.path.exists(self.ballast)
            self.free() if held else self.fill()
            self.next_s = time.monotonic() + (self.rng.uniform(1.2, 2.0) if held else self.rng.uniform(0.2, 0.6))

    def over(self, n: int, ops: int) -> bool:
        """The faults' part of the run is over: `ops` steps, and (full) three fills, given back."""
        if self.kind != "damage" and (self.done.get("fill", 0) < 3 or os.path.exists(self.ballast)):
            return False
        return n >= ops

    def _did(self, what: str) -> None:
        self.done[what] = self.done.get(what, 0) + 1

    def damage(self, how: str | None = None) -> None:
        records = files(self.root)
        if len(records) < 2:
            return
        path, how = self.rng.choice(records), how or self.rng.choice(DAMAGE)
        try:
            getattr(self, how)(path, [r for r in records if r != path])
        except FileNotFoundError:  # evicted or found damaged meanwhile
            return
        self._did(how)

    def _flip(self, path: str, start: int) -> None:
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= start:
                raise FileNotFoundError(path)  # cut short already: nothing there to flip
            # (a header's byte of a file cut shorter than a header: one of the bytes it has)
            off = self.rng.randrange(start, size) if start else self.rng.randrange(min(HEADER, size))
            f.seek(off)
            byte = f.read(1)[0] ^ (1 << self.rng.randrange(8))
            f.seek(off)
            f.write(bytes([byte]))

    def flip_payload(self, path, others) -> None:
        self._flip(path, HEADER)

    def flip_header(self, path, others) -> None:
        self._flip(path, 0)

    def truncate(self, path, others) -> None:
        size = os.path.getsize(path)
        if not size:
            raise FileNotFoundError(path)  # emptied already: nothing to cut
        os.truncate(path, self.rng.randrange(size))

    def empty(self, path, others) -> None:
        os.truncate(path, 0)

    def remove(self, path, others) -> None:
        os.unlink(path)

    def foreign(self, path, others) -> None:  # a whole record, of another key, under this name
        data = open(self.rng.choice(others), "rb").read()
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate(len(data))

    def junk(self, path, others) -> None:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(self.rng.randbytes(size))

    def fill(self) -> None:
        """Take the filesystem's free space (its inodes, "inodes") but room for 0-2 records."""
        if self.kind == "inodes":
            os.makedirs(self.ballast, exist_ok=True)
            for i in range(max(0, os.statvfs(self.root).f_favail - self.rng.randrange(3))):
                try:
                    os.close(os.open(os.path.join(self.ballast, str(i)), os.O_CREAT | os.O_WRONLY, 0o600))
                except OSError:  # the daemon took the last ones meanwhile
                    break
            self._did("fill")
            return
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize - self.rng.randrange(3) * (PAGE + 4096)
        if free > 0:
            with open(self.ballast, "wb") as f:
                try:
                    f.write(b"\0" * free)
                except OSError:  # the daemon wrote meanwhile: full all the same
                    pass
            self._did("fill")

    def free(self) -> None:
        shutil.rmtree(self.ballast) if self.kind == "inodes" else os.unlink(self.ballast)
        self._did("free")


def _step(engine, rng, docs, permits, n: int) -> int:
    """One engine step, and now and then a permit for the operator's next op: n + 1."""
    if rng.random() < 0.3:
        permits.release()
    engine.step(rng, docs)
    return n + 1


def served_again(c, engine, rng, docs, permits, n: int, ops: int) -> int:
    """`ops` steps more, the faults over, every op then waited for: the blocks loaded from
    storage before them (the run's end checks the tier served again after the faults)."""
    was = c.status()["lookups"]["loaded_from_storage"]
    for n in range(n, n + ops):
        _step(engine, rng, docs, permits, n)
    engine.drain()
    return was


def check_run(errors, engine, s, seed: int, was: int) -> None:
    """No error of the operator or the engine, no wrong byte, nothing left in flight or pinned,
    and loads from storage after the faults."""
    assert not errors, (seed, errors)
    assert engine.wrong == 0, f"seed {seed}: {engine.wrong} of {engine.loaded} loaded blocks wrong"
    assert s["tasks"]["inflight"] == 0 and s["host"]["pinned_blocks"] == 0, s["tasks"]
    assert s["lookups"]["loaded_from_storage"] > was, (was, s["lookups"])  # served again after


def reloaded(args: dict, kv, contents, docs, seed: int) -> tuple[Engine, str]:
    """A daemon started anew (launch args) loads every document once: the engine that did, and
    the daemon's log."""
    with launch(**args) as d, d.connect(timeout=30) as c:
        c.register_kv_cache(kv)
        after = Engine(c, contents, random.Random(seed))
        for keys in docs:
            after.load(keys)
            after.finish_one()
        with open(d.log_path) as f:
            return after, f.read()


@pytest.fixture
def small_fs():
    """A 2 MiB filesystem (tmpfs) for the disk tier: 96 records do not fit in it."""
    with small_filesystem("2m") as path:
        yield path


@pytest.fixture
def few_inodes_fs():
    """A filesystem (tmpfs) of 64 MiB but 320 inodes: the 96 records and their up to 96 shard
    directories fit until the ballast takes the inodes left."""
    with small_filesystem("64m", inodes=320) as path:
        yield path


@pytest.mark.faults
@pytest.mark.parametrize("kind,seed", [("damage", 21), ("full", 22), ("inodes", 23)])
def test_random_ops_on_a_damaged_or_full_disk_tier_never_serve_a_wrong_byte(run_dir, instance, request,
                                                                            kind, seed):
    ops = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 4
    seed += int(os.environ.get("KVCACHED_SOAK_SEED", "0"))
    root = request.getfixturevalue({"damage": "disk_dir", "full": "small_fs", "inodes": "few_inodes_fs"}[kind])
    rng, docs, faults = random.Random(seed), _docs(), DiskFaults(kind, root, seed)
    kv = small_kv(num_layers=LAYERS, num_blocks=BLOCKS, block_shape=SHAPE, seed=seed)
    errors = []
    args = dict(instance=instance, run_dir=run_dir, host_cache_gb=HOST_PAGES * PAGE / 2**30,
                extra_args=["--storage", disk_uri(root)], wait_storage=True)
    with launch(**args) as d, d.connect(timeout=30) as c:
        c.register_kv_cache(kv)
        engine = Engine(c, Contents(kv), rng)
        with operated(d, docs, seed, errors, {}) as permits:
            n = 0
            while not faults.over(n, ops):
                faults.tick(n)
                n = _step(engine, rng, docs, permits, n)
            wait_until(lambda: c.status()["storage"][0]["healthy"], 10, "the disk tier healthy")
            if kind == "full":  # the probe raised the limit again (half the filesystem at least)
                wait_until(lambda: c.status()["storage"][0]["limit_bytes"] >= 1 << 20, 10, "room again")
            was = served_again(c, engine, rng, docs, permits, n, ops)
        assert c.check() == "ok"
        s = settled_status(c)
    check_run(errors, engine, s, seed, was)
    assert kind == "damage" or s["storage"][0]["enospc"] > 0, s["storage"][0]  # (it was full)
    if kind == "damage":  # every kind of damage, and reads that met it
        assert set(faults.done) == set(DAMAGE) and engine.missed > 0, faults.done
        for how in DAMAGE:  # more, while the daemon is down: its restart reads them back
            faults.damage(how)
        after = reloaded(args, kv, Contents(kv), docs, seed)[0]
        assert after.wrong == 0 and after.loaded > 0, (after.wrong, after.loaded)
    else:
        assert faults.done.get("fill", 0) >= 3 and s["storage"][0]["enospc"] > 0, (faults.done, s["storage"])
