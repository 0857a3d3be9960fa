"""A disk tier whose filesystem fails when the daemon starts (kvcached/storage/disk_root.py): a dead
disk (an ext4 shut down: EIO) or a FUSE mount whose server died (ENOTCONN) in place of the
tier's volume. The daemon starts with the tier down and the host tier serving; once the volume
answers again the tier takes its lock, indexes what is there and serves it, and the deletes and
clears made while it was down - across restarts too - hold. Before, such a start refused the
whole daemon ("cannot use ... as the disk tier: Transport endpoint is not connected")."""
import contextlib
import errno
import os
import subprocess
import tempfile
import time

import pytest

import hangfs
from conftest import blocks_equal, disk_uri, keys_for, scramble, small_kv, snapshot, wait_until
from kvcached.server.status_report import format_status
from kvcached.storage import owned
from kvcached.storage.disk import DiskBackend
from kvcached.storage.disk_health import PROBE_EVERY_S
from storage_util import (PAGE_SHAPE, ext4_filesystem, ext4_image, ext4_shut_down, files,
                          mount_ext4, offload_and_flush, start)


def _disk(c) -> dict:
    return c.status()["storage"][0]


def _disk_lines(h) -> list[str]:
    with open(h.log_path) as f:
        return [line for line in f if "[disk]" in line]


GEOMETRY = b"\x07" * 16


def _host_tier_serves(c, kv, keys, blocks, dst) -> None:
    """Blocks offloaded now are loaded back byte-exact from the host tier."""
    offload_and_flush(c, kv, keys, blocks)
    expected = snapshot(kv, blocks)
    scramble(kv, 9)
    assert c.load(keys, dst).wait(10) == len(keys)
    assert blocks_equal(kv, dst, expected)


def _stored(run_dir, instance, root, kv, keys) -> None:
    """keys stored from kv's first blocks on a disk tier at root by a daemon then stopped."""
    h = start(run_dir, instance, disk_uri(root), host_gb=0.01)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(len(keys))))
    finally:
        h.stop()


class _Volume:
    """An ext4 volume at a mount point that can be taken away and given back, with a FUSE
    mount whose server died in its place while it is away (every access: ENOTCONN)."""

    def __init__(self, image: str):
        self.image = image
        self.path = tempfile.mkdtemp(prefix="kvvol-", dir="/tmp")
        self.root = os.path.join(self.path, "tier")
        self._dead: hangfs.HangFS | None = None
        self.mounted = False

    def unmounted(self) -> None:
        """The dead mount taken away and nothing mounted in its place: the mount point is a
        directory of the filesystem beneath."""
        if self._dead is not None:
            self._dead.close()
            self._dead = None

    def back(self) -> None:
        self.unmounted()
        mount_ext4(self.image, self.path)
        self.mounted = True

    def away(self) -> None:
        subprocess.run(["umount", self.path], check=True)
        self.mounted = False
        self._dead = hangfs.HangFS(self.path, "x.kvb", 1)
        self._dead.die()
        with pytest.raises(OSError):
            os.stat(self.root)

    def close(self) -> None:
        if self._dead is not None:
            self._dead.close()
        if self.mounted:
            subprocess.run(["umount", self.path], check=True)
        os.rmdir(self.path)


@contextlib.contextmanager
def _volume():
    why = hangfs.available()
    if why:
        pytest.skip(why)
    with ext4_image() as image:
        vol = _Volume(image)
        try:
            vol.back()
            yield vol
        finally:
            vol.close()


@pytest.mark.faults
def test_a_dead_disk_at_start_leaves_the_host_tier_serving_and_says_why(run_dir, instance):
    """The tier's ext4 volume shut down (EIO on every read and write) before the start: the
    daemon starts, the tier is down with the reason in status and one ERROR line, its puts
    are dropped, and the host tier serves. It was refused: "cannot use ... Input/output error"."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
    keys = keys_for(8, 31)
    with ext4_filesystem() as fs:
        root = os.path.join(fs, "tier")
        os.makedirs(root, mode=0o700)
        ext4_shut_down(fs)
        h = start(run_dir, instance, disk_uri(root), host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                disk = _disk(c)
                assert not disk["healthy"] and "Input/output error" in disk["last_error"], disk
                assert c.status()["storage_ready"]  # nothing to wait for: it says why instead
                line = [x for x in format_status(c.status()).splitlines() if x.startswith("storage ")]
                assert "UNHEALTHY" in line[0] and "Input/output error" in line[0], line
                assert "indexing" not in line[0], line  # (`kvcached status`: it lists nothing)
                _host_tier_serves(c, kv, keys, list(range(8)), list(range(32, 40)))
                assert _disk(c)["dropped_puts"] == 8 and _disk(c)["puts"] == 0
                time.sleep(2.5 * PROBE_EVERY_S)  # the probe tries again, quietly
                assert not _disk(c)["healthy"]
            lines = _disk_lines(h)
            assert len([x for x in lines if "ERROR" in x]) == 1 and len(lines) <= 3, lines
        finally:
            h.stop()


@pytest.mark.faults
def test_a_volume_that_answers_again_is_indexed_and_the_deletes_made_meanwhile_hold(
        run_dir, instance):
    """16 blocks stored on the volume; the volume away (a dead FUSE mount in its place) across
    two restarts, each deleting blocks while the tier is down; then the volume back under the
    running daemon: the tier takes its lock, indexes the volume and serves the 10 blocks not
    deleted byte-exact, none of the 6 deleted (the first daemon's deletes across its stop: on
    record in the run dir), and stores again; while nothing is mounted there (the dead mount
    taken away) the tier stays down rather than write onto the filesystem beneath. Both
    starts were refused before."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=128)
    keys = keys_for(16, 32)
    with _volume() as vol:
        _stored(run_dir, instance, vol.root, kv, keys)
        expected = snapshot(kv, list(range(16)))
        vol.away()
        h = start(run_dir, instance, disk_uri(vol.root), host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                disk = _disk(c)
                assert not disk["healthy"] and "not connected" in disk["last_error"], disk
                assert c.lookup(keys) == (0, 0)
                _host_tier_serves(c, kv, keys_for(4, 33), [16, 17, 18, 19], [40, 41, 42, 43])
                c.delete(keys[14:])
            h.stop()  # the deletes are on record: no file of theirs was removed yet
            h = start(run_dir, instance, disk_uri(vol.root), host_gb=0.01)
            with h.connect() as c:
                c.register_kv_cache(kv)
                c.delete(keys[10:14])
                assert not _disk(c)["healthy"]
                vol.unmounted()  # the tier must not write onto the filesystem beneath
                time.sleep(2.5 * PROBE_EVERY_S)
                disk = _disk(c)
                assert not disk["healthy"] and "nothing is mounted at" in disk["last_error"], disk
                assert not os.path.exists(vol.root)
                vol.back()
                wait_until(lambda: _disk(c)["healthy"] and _disk(c)["ready"], 10,
                           "the tier up and indexed")
                assert c.lookup(keys) == (0, 10)
                assert c.lookup(keys[14:]) == (0, 0) and c.lookup(keys[10:14]) == (0, 0)
                scramble(kv, 5)
                assert c.load(keys[:10], list(range(64, 74))).wait(10) == 10
                assert blocks_equal(kv, list(range(64, 74)), expected, upto=10)
                offload_and_flush(c, kv, keys_for(4, 34), [20, 21, 22, 23])
                disk = _disk(c)
                assert disk["puts"] == 4 and disk["blocks"] == 14, disk
                wait_until(lambda: _disk(c)["deletes_owed"] == 0, 5, "no delete owed")
                assert len(files(vol.root)) == 14
            assert any("answers" in x for x in _disk_lines(h))
        finally:
            h.stop()


@pytest.mark.faults
def test_a_clear_made_while_the_tier_is_down_holds_when_it_comes_up(run_dir, instance):
    """8 blocks stored; with the volume away, a daemon clears the tier (its mark cannot be
    written: owed in the run dir), a second starts and stops while it is still away, and a
    third is running when the volume comes back: none of the 8 is served, and once the listing
    has removed them the owed clear is let go - the blocks that third daemon stores are
    served after a restart (not cleared again). Without the clear on record across the second
    start (it let it go at once), the third served the 8 old blocks."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
    keys, new = keys_for(8, 35), keys_for(4, 36)
    with _volume() as vol:
        _stored(run_dir, instance, vol.root, kv, keys)
        vol.away()
        h = start(run_dir, instance, disk_uri(vol.root), host_gb=0.01)
        try:
            with h.connect(role="operator") as c:
                c.clear()
                assert _disk(c)["clear_owed"]
            h.stop()
            h = start(run_dir, instance, disk_uri(vol.root), host_gb=0.01)
            h.stop()
            h = start(run_dir, instance, disk_uri(vol.root), host_gb=0.01)
            with h.connect() as c:
                c.register_kv_cache(kv)
                vol.back()
                wait_until(lambda: _disk(c)["healthy"] and _disk(c)["ready"], 10,
                           "the tier up and indexed")
                assert c.lookup(keys) == (0, 0)
                wait_until(lambda: not _disk(c)["clear_owed"], 5, "the clear done")
                assert files(vol.root) == []
                offload_and_flush(c, kv, new, [8, 9, 10, 11])
                expected = snapshot(kv, [8, 9, 10, 11])
            h.stop()
            h = start(run_dir, instance, disk_uri(vol.root), host_gb=0.001)
            with h.connect() as c:
                c.register_kv_cache(kv)
                assert c.lookup(keys) == (0, 0)
                assert c.lookup(new) == (0, 4)
                scramble(kv, 6)
                assert c.load(new, [20, 21, 22, 23]).wait(10) == 4
                assert blocks_equal(kv, [20, 21, 22, 23], expected)
        finally:
            h.stop()


def _failing_secure_root(monkeypatch, err: int):
    """owned.secure_root raises err until the returned list is emptied."""
    failing = [err]
    real = owned.secure_root

    def secure_root(root, **kw):
        if failing:
            raise OSError(failing[0], os.strerror(failing[0]))
        return real(root, **kw)

    monkeypatch.setattr(owned, "secure_root", secure_root)
    return failing


@pytest.mark.parametrize("writer", [True, False])
def test_a_tier_down_at_start_comes_up_when_its_root_answers(tmp_path, monkeypatch, writer):
    """A writer and a reader (`--no-storage-writer`) alike: ready at once (nothing to wait
    for), no hits and puts dropped while the root fails, then up and indexed."""
    failing = _failing_secure_root(monkeypatch, errno.ENOTCONN)
    root = tmp_path / "t"
    tier = DiskBackend(str(root), 1 << 30, writer=writer)
    try:
        assert tier.ready() and not tier.health() and not tier.indexed.is_set()
        assert "Transport endpoint is not connected" in tier.usage()["last_error"]
        assert tier.exists_prefix([b"\x01" * 16]) == 0
        if writer:
            assert tier.put([b"\x01" * 16], [[bytearray(64)]], GEOMETRY) == [False]
        failing.clear()
        wait_until(lambda: tier.health() and tier.indexed.is_set(), 3 * PROBE_EVERY_S, "the tier up")
        if writer:
            assert tier.put([b"\x01" * 16], [[bytearray(64)]], GEOMETRY) == [True]
            assert tier.exists_prefix([b"\x01" * 16]) == 1
    finally:
        tier.close()


def test_what_the_operator_must_change_still_refuses_the_start(tmp_path, monkeypatch):
    """EACCES, ENOTDIR and the like are the operator's to fix: the start is refused by name."""
    _failing_secure_root(monkeypatch, errno.EACCES)
    with pytest.raises(ValueError, match="cannot use .* as the disk tier: Permission denied"):
        DiskBackend(str(tmp_path / "t"), 1 << 30)


def test_a_directory_another_tier_took_while_this_one_was_down_keeps_it_down(tmp_path, monkeypatch):
    """The root taken by another tier (its lock) while this one started down: this one stays
    down and says by whom, rather than share the directory."""
    failing = _failing_secure_root(monkeypatch, errno.EIO)
    root = str(tmp_path / "t")
    down = DiskBackend(root, 1 << 30)
    failing.clear()
    other = DiskBackend(root, 1 << 30)
    try:
        time.sleep(2.5 * PROBE_EVERY_S)
        assert not down.health() and other.health()
        assert "in use by this daemon already" in down.usage()["last_error"]
    finally:
        down.close()
        other.close()


class _Tmpfs:
    """A tmpfs volume at a mount point, taken away under the tier (unmounted lazily: the tier's
    lock keeps it alive, the path no longer reaches it) and mounted anew - another volume,
    another device - with a copy of the tier's directory, as a FUSE or network filesystem
    comes back remounted."""

    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="kvvol-", dir="/tmp")
        self.root = os.path.join(self.path, "tier")
        self._saved = tempfile.mkdtemp(prefix="kvsaved-", dir="/tmp")
        self.mounted = False

    def mount(self) -> None:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs",
                               self.path], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
        self.mounted = True

    def away(self) -> None:
        subprocess.run(["cp", "-a", self.root, self._saved], check=True)
        subprocess.run(["umount", "-l", self.path], check=True)
        self.mounted = False

    def back(self) -> None:
        self.mount()
        subprocess.run(["cp", "-a", os.path.join(self._saved, "tier"), self.path], check=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", self.path], check=True)
        subprocess.run(["rm", "-rf", self._saved, self.path], check=True)


@contextlib.contextmanager
def _tmpfs():
    vol = _Tmpfs()
    try:
        vol.mount()
        yield vol
    finally:
        vol.close()


@pytest.mark.faults
def test_a_volume_mounted_anew_under_a_running_tier_is_indexed_and_its_deletes_hold(
        run_dir, instance):
    """8 blocks stored; the volume taken away under the running tier (the path missing: every
    unlink there says ENOENT), 2 of the blocks deleted meanwhile, and a directory made in its
    place on the filesystem beneath; then a volume with the tier's files mounted anew. The
    tier is down while away (not on the directory beneath), then indexes the new volume and
    serves the 6 blocks not deleted byte-exact, not the 2 deleted. Before, it was down until a
    restart, and the deletes counted as done (their files "missing"): a restart served them."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
    keys = keys_for(8, 37)
    with _tmpfs() as vol:
        h = start(run_dir, instance, disk_uri(vol.root), host_gb=0.01)
        try:
            with h.connect() as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(8)))
                expected = snapshot(kv, list(range(8)))
                c.clear(tier="host")
                vol.away()
                wait_until(lambda: not _disk(c)["healthy"], 5, "the tier down")
                c.delete(keys[6:])
                wait_until(lambda: _disk(c)["deletes_owed"] == 2, 5, "the deletes owed")
                os.makedirs(vol.root, mode=0o700)  # the filesystem beneath: not the tier's
                time.sleep(2.5 * PROBE_EVERY_S)
                disk = _disk(c)
                assert not disk["healthy"] and "no longer the directory" in disk["last_error"], disk
                os.rmdir(vol.root)
                vol.back()
                wait_until(lambda: _disk(c)["healthy"] and _disk(c)["ready"], 10,
                           "the new volume indexed")
                assert c.lookup(keys) == (0, 6) and c.lookup(keys[6:]) == (0, 0)
                scramble(kv, 4)
                assert c.load(keys[:6], list(range(16, 22))).wait(10) == 6
                assert blocks_equal(kv, list(range(16, 22)), expected, upto=6)
                wait_until(lambda: _disk(c)["deletes_owed"] == 0, 5, "no delete owed")
                assert len(files(vol.root)) == 6
                offload_and_flush(c, kv, keys_for(2, 38), [30, 31])
                assert _disk(c)["puts"] == 10
            assert any("another directory" in x for x in _disk_lines(h))
        finally:
            h.stop()


@pytest.mark.faults
def test_a_clear_made_while_the_volume_was_away_holds_on_the_volume_mounted_anew(
        run_dir, instance):
    """8 blocks stored; the volume away, the tier cleared (its mark cannot be written; its
    unlinks find nothing); the volume mounted anew with the tier's files: none of the 8 is
    served and their files go, the clear is let go, and what is stored after is served after
    a restart (not cleared again)."""
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
    keys, new = keys_for(8, 39), keys_for(2, 40)
    with _tmpfs() as vol:
        h = start(run_dir, instance, disk_uri(vol.root), host_gb=0.01)
        try:
            with h.connect() as c, h.connect(role="operator") as op:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(8)))
                vol.away()
                wait_until(lambda: not _disk(c)["healthy"], 5, "the tier down")
                op.clear()
                wait_until(lambda: _disk(c)["clear_owed"], 5, "the clear owed")
                vol.back()
                wait_until(lambda: _disk(c)["healthy"] and _disk(c)["ready"], 10,
                           "the new volume indexed")
                assert c.lookup(keys) == (0, 0)
                wait_until(lambda: not _disk(c)["clear_owed"] and not files(vol.root), 5,
                           "the clear done")
                offload_and_flush(c, kv, new, [8, 9])
                expected = snapshot(kv, [8, 9])
            h.stop()
            h = start(run_dir, instance, disk_uri(vol.root), host_gb=0.001)
            with h.connect() as c:
                c.register_kv_cache(kv)
                assert c.lookup(keys) == (0, 0) and c.lookup(new) == (0, 2)
                scramble(kv, 6)
                assert c.load(new, [20, 21]).wait(10) == 2
                assert blocks_equal(kv, [20, 21], expected)
        finally:
            h.stop()


@pytest.mark.faults
def test_a_start_on_a_filesystem_that_hangs_then_fails_is_down_then_takes_its_lock(
        run_dir, instance):
    """The tier's volume a FUSE mount whose lookups hang (a network filesystem gone) at the
    start, then fail (EIO: its soft mount timing out): the daemon starts past the I/O deadline
    with the tier stuck, then down with the reason once the make fails; a volume mounted in
    its place is taken - the lock file holds the daemon's pid - indexed, and stored to.
    Before, the index rebuild ran beside the hung make, and once both failed the tier answered
    again on the new volume without its lock (a second daemon could share the directory)."""
    why = hangfs.available()
    if why:
        pytest.skip(why)
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=64)
    with ext4_image() as image:
        mp = tempfile.mkdtemp(prefix="kvvol-", dir="/tmp")
        root = os.path.join(mp, "tier")
        fs = hangfs.HangFS(mp, "x.kvb", 1, hang="lookup")
        h, mounted = None, False
        try:
            h = start(run_dir, instance, disk_uri(root) + "&io_timeout_s=1", host_gb=0.01,
                      wait_storage=False)
            with h.connect() as c:
                c.register_kv_cache(kv)
                assert _disk(c)["stuck"] and not _disk(c)["healthy"]
                fs.release_reads()
                wait_until(lambda: "Input/output error" in _disk(c)["last_error"], 5, "the make failed")
                assert not _disk(c)["healthy"] and not _disk(c)["stuck"]
                c.wait_storage_ready(5)  # (the shm flag: nothing to wait for)
                fs.close()
                mount_ext4(image, mp)
                mounted = True
                wait_until(lambda: _disk(c)["healthy"] and _disk(c)["ready"], 10, "the tier up")
                with open(os.path.join(root, ".kvcached.lock")) as f:
                    assert f.read().strip() == str(h.pid)
                offload_and_flush(c, kv, keys_for(4, 42), [0, 1, 2, 3])
                assert _disk(c)["puts"] == 4 and len(files(root)) == 4
        finally:
            if h is not None:
                h.stop()
            fs.close()
            if mounted:
                subprocess.run(["umount", mp], check=True)
            os.rmdir(mp)


def test_a_start_whose_root_returns_past_its_deadline_is_indexed_then(tmp_path, monkeypatch):
    """The root's make returns, successfully, past the I/O deadline (a slow filesystem): the
    tier is stuck meanwhile, then takes its lock and indexes what is there - the rebuild waits
    for the make rather than run beside it."""
    real = owned.secure_root

    def slow(root, **kw):
        time.sleep(0.6)
        return real(root, **kw)

    root = tmp_path / "t"
    first = DiskBackend(str(root), 1 << 30)
    assert first.indexed.wait(5)
    assert first.put([b"\x05" * 16], [[bytearray(64)]], GEOMETRY) == [True]
    first.close()
    monkeypatch.setattr(owned, "secure_root", slow)
    tier = DiskBackend(str(root), 1 << 30, io_timeout_s=0.2)
    try:
        assert tier.usage()["stuck"] and not tier.ready()
        assert tier.indexed.wait(5) and tier.exists_prefix([b"\x05" * 16]) == 1
        wait_until(tier.health, 3 * PROBE_EVERY_S, "the tier healthy")
        with open(root / ".kvcached.lock") as f:
            assert f.read().strip() == str(os.getpid())
    finally:
        tier.close()


def test_a_root_reached_through_a_link_is_not_used_on_the_filesystem_beneath(tmp_path):
    """The tier's root a link to a volume's mount point (/var/cache/kv -> /mnt/nvme, say); the
    volume unmounted under the tier: the tier stays down and writes nothing on the directory
    beneath. Before, the mount table was read for the link's own path ("/"), so the directory
    beneath passed for a volume mounted anew: its lock and trial record were written there."""
    mp = tmp_path / "vol"
    mp.mkdir(mode=0o700)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mp)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    link = tmp_path / "link"
    os.symlink(mp, link)
    mounted = True
    tier = DiskBackend(str(link), 1 << 30)
    try:
        assert tier.indexed.wait(5) and tier._volume == str(mp)
        subprocess.run(["umount", "-l", str(mp)], check=True)
        mounted = False
        time.sleep(2.5 * PROBE_EVERY_S)
        assert not tier.health() and "no longer the directory" in tier.usage()["last_error"]
        assert os.listdir(mp) == []
    finally:
        tier.close()
        if mounted:
            subprocess.run(["umount", "-l", str(mp)], check=True)
