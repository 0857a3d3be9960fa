"""What the storage tests share: a daemon with storage tiers, blocks stored on its disk tier only
(or in any tier only), a record's path, a record hung on a filesystem, the load state, a
redis-server stopped, a disk tier's writes held, a filesystem that fills up, one that fails."""
import contextlib
import glob
import os
import subprocess
import tempfile
import threading

import pytest

from conftest import disk_uri, keys_for, scramble, small_kv, snapshot, stored, wait_until
from kvcached_client import launch
from kvcached.bench import process_stop

PAGE_SHAPE = (16, 2, 64)  # 4 layers x (K, V) x 4 KiB = 32 KiB per block


@contextlib.contextmanager
def small_filesystem(size: str, inodes: int | None = None):
    """A tmpfs of `size` (mount's notation: "1m") and of `inodes` inodes where given, under
    /tmp, unmounted and removed after; the test is skipped where it cannot be mounted (mounting
    needs root)."""
    path = tempfile.mkdtemp(prefix="kvfull-", dir="/tmp")
    opts = f"size={size},mode=0700" + (f",nr_inodes={inodes}" if inodes else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True)
    if r.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a size-limited tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=True)
        os.rmdir(path)


@contextlib.contextmanager
def ext4_image(size: str = "64M"):
    """An ext4 filesystem in an image file under /tmp, removed after; mount it with
    mount_ext4. Skipped where it cannot be made."""
    image = tempfile.mktemp(prefix="kvext4-", suffix=".img", dir="/tmp")
    try:
        made = subprocess.run(["truncate", "-s", size, image], capture_output=True)
        if made.returncode == 0:
            made = subprocess.run(["mkfs.ext4", "-q", "-F", image], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"cannot make an ext4 image here: {made.stderr.decode().strip()}")
        yield image
    finally:
        if os.path.exists(image):
            os.unlink(image)


def mount_ext4(image: str, path: str) -> None:
    """The image mounted at path with ext4's default errors=remount-ro; skipped where a loop
    device cannot be mounted (it needs root and loop devices)."""
    made = subprocess.run(["mount", "-o", "loop,errors=remount-ro", image, path], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount an ext4 image here: {made.stderr.decode().strip()}")


@contextlib.contextmanager
def ext4_filesystem(size: str = "64M"):
    """An ext4 filesystem on a loop device (an image file under /tmp), mounted with ext4's
    default errors=remount-ro, so the tests can fail it as a disk fails: `ext4_shut_down(path)`
    (every read and write EIO) or `ext4_error(path)` (read-only, as at a disk error)."""
    path = tempfile.mkdtemp(prefix="kvext4-", dir="/tmp")
    try:
        with ext4_image(size) as image:
            mount_ext4(image, path)
            try:
                yield path
            finally:
                subprocess.run(["umount", path], check=True)
    finally:
        os.rmdir(path)


def ext4_shut_down(path: str) -> None:
    """Every read and write of the ext4 filesystem at path fails with EIO from now on (its
    EXT4_IOC_SHUTDOWN, no log flush): a disk that died. stat and access still answer."""
    import fcntl
    import struct

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x8004587D, struct.pack("I", 2))
    finally:
        os.close(fd)


def ext4_error(path: str) -> None:
    """An error of the ext4 filesystem at path, as a disk error raises one: errors=remount-ro
    makes it read-only (EROFS on every write; reads go on; access(2) still says writable)."""
    device = subprocess.run(["findmnt", "-n", "-o", "SOURCE", path], capture_output=True,
                            text=True, check=True).stdout.strip()
    with open(f"/sys/fs/ext4/{os.path.basename(device)}/trigger_fs_error", "w") as f:
        f.write("kvcached test")


def bind_read_only(root: str) -> None:
    """root bind-mounted on itself, read-only (a filesystem gone read-only under the tier);
    `writable(root)` makes it writable again; the caller unmounts it."""
    subprocess.run(["mount", "--bind", root, root], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", root], check=True)
    except BaseException:
        subprocess.run(["umount", root], check=True)
        raise


def writable(root: str) -> None:
    subprocess.run(["mount", "-o", "remount,bind,rw", root], check=True)


def listing_held(run_dir, instance, disk_dir, kv, keys):
    """keys' blocks of kv stored on disk_dir by a daemon run and stopped, and a FUSE shard of
    no key of theirs made there whose listing hangs (hangfs: the next start's index rebuild
    waits on it until `release_listing()`; `close()` it after). Skipped without FUSE."""
    import hangfs

    why = hangfs.available()
    if why:
        pytest.skip(why)
    h = start(run_dir, instance, disk_uri(disk_dir))
    with h.connect() as c:
        c.register_kv_cache(kv)
        offload_and_flush(c, kv, keys, list(range(len(keys))))
    h.stop()
    shard = next(f"{b:02x}" for b in range(256) if b not in {stored(k, kv)[0] for k in keys})
    os.makedirs(os.path.join(disk_dir, shard), mode=0o700, exist_ok=True)  # (a put makes it)
    return hangfs.HangFS(os.path.join(disk_dir, shard), f"{shard}{'0' * 30}.kvb", 4096, hang="readdir")


def owes_work(tier: dict) -> bool:
    """A tier's status says it owes work: a clear, deletes, files its unlinks left."""
    return bool(tier["clear_owed"] or tier["deletes_owed"] or tier["unlinks_left"])


def files(root):
    return sorted(glob.glob(os.path.join(root, "??", "*.kvb")))


@contextlib.contextmanager
def pings_answered(client):
    """Another client pinging the daemon all along (its timeout is the bound): the block's
    requests must not stall the request loop. Asserts at the end that every ping was answered."""
    errors, done = [], threading.Event()

    def ping():
        try:
            while not done.is_set():
                client.ping()
        except Exception as exc:  # KvcachedTimeout when the request loop stalls
            errors.append(exc)

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        yield
    finally:
        done.set()
        pinger.join(10)
    assert not errors, errors


def start(run_dir, instance, *storage, host_gb=0.05, extra=(), wait_storage=True):
    args = [a for uri in storage for a in ("--storage", uri)] + list(extra)
    return launch(instance=instance, run_dir=run_dir, host_cache_gb=host_gb, extra_args=args,
                  wait_storage=wait_storage)


def offload_and_flush(c, kv, keys, src):
    c.offload(src, keys).wait(10)
    c.flush().wait(30)


def record_path(disk_dir, key, kv):
    """The disk tier's file of key's block of kv's geometry."""
    name = stored(key, kv).hex()
    return os.path.join(disk_dir, name[:2], name + ".kvb")


def stored_on_disk_only(run_dir, instance, disk_dir, seed=0, n=8, extra=()):
    """A daemon whose disk tier holds n blocks its host tier does not, and a KV cache that
    holds other bytes (no client registered): (daemon, kv, keys, the stored bytes)."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys, src = keys_for(n, seed), list(range(n))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, disk_uri(disk_dir), extra=extra)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
    except BaseException:
        h.stop()
        raise
    scramble(kv, 3)
    return h, kv, keys, expected


@contextlib.contextmanager
def on_disk_only(run_dir, instance, disk_dir, seed):
    """stored_on_disk_only with a client that registered the KV: (client, kv, keys, bytes)."""
    h, kv, keys, expected = stored_on_disk_only(run_dir, instance, disk_dir, seed)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            yield c, kv, keys, expected
    finally:
        h.stop()


def keys_alone_in_a_shard(n, index):
    """n keys of which keys[index] has a shard directory to itself."""
    for seed in range(50, 500):
        keys = keys_for(n, seed)
        if sum(k[0] == keys[index][0] for k in keys) == 1:
            return keys
    raise AssertionError("no such keys")


def stored_with_one_record_hung(run_dir, instance, disk_dir, index, io_timeout_s=1):
    """8 blocks stored on disk by a daemon since stopped, keys[index]'s record on a FUSE shard
    whose reads hang (skips where FUSE cannot be mounted). The tier's I/O deadline is 1 s."""
    import hangfs

    why = hangfs.available()
    if why:
        pytest.skip(why)
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys, src = keys_alone_in_a_shard(8, index), list(range(8))
    expected = snapshot(kv, src)
    uri = f"disk://{disk_dir}?capacity_gb=1&io_timeout_s={io_timeout_s}"
    h = start(run_dir, instance, uri)
    with h.connect() as c:
        c.register_kv_cache(kv)
        offload_and_flush(c, kv, keys, src)
    h.stop()
    hung = record_path(disk_dir, keys[index], kv)
    size = os.path.getsize(hung)
    os.unlink(hung)
    return kv, keys, expected, uri, hangfs.HangFS(os.path.dirname(hung), os.path.basename(hung), size)


@contextlib.contextmanager
def in_storage_only(run_dir, instance, uri, keys):
    """A client of a daemon whose storage tier (uri) holds the blocks of `keys` (from blocks 0..n-1)
    and whose host tier does not: (client, kv, the stored bytes, the daemon)."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    src = list(range(len(keys)))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, uri)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
            yield c, kv, expected, h
    finally:
        h.stop()


def load_state(c):
    s = c.status()
    return (s["tasks"]["queued"], s["tasks"]["inflight"], s["host"]["pinned_blocks"],
            s["tasks"]["slots_busy"], c.check())


def backups_behind_a_paused_server(c, redis_server, first, second) -> None:
    """The server holds writes for 0.7 s: `first` offloaded from blocks 0-7 (its backup waits
    on the server), then `second` from blocks 8-15 (its backup is queued behind)."""
    redis_server.client().execute_command("CLIENT", "PAUSE", 700, "WRITE")
    c.offload(list(range(8)), first).wait(10)
    c.offload(list(range(8, 16)), second).wait(10)


@contextlib.contextmanager
def redis_stopped(c, redis_server):
    """The redis-server SIGSTOPped for the block, which begins once c's daemon shows its tier
    down."""
    process_stop.stop(redis_server.proc.pid)
    try:
        wait_until(lambda: not c.status()["storage"][0]["healthy"], 5, "the tier down")
        yield
    finally:
        process_stop.go_on(redis_server.proc.pid)


@contextlib.contextmanager
def writes_held(disk):
    """A DiskBackend whose record writes wait in the filesystem until the block's event is set
    (set on leaving the block too)."""
    held, write = threading.Event(), disk._write

    def slow_write(*args):
        assert held.wait(10)
        return write(*args)

    disk._write = slow_write
    try:
        yield held
    finally:
        held.set()


def nothing_owed(path: str) -> bool:
    """The run dir's record of owed clears and deletes (OwedRecord) owes none: no file, or the
    stores' kept state alone."""
    if not os.path.exists(path):
        return True
    with open(path) as f:
        return all("\tstate\t" in line for line in f)
