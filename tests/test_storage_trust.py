"""What a storage tier may serve: only records written from the same KV geometry (dtype, block
shape, axis order, layers, parts), never one another user could plant, never hits from a tier
that is gone. Real daemons, real files, a real redis-server."""
import glob
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from conftest import (blocks_equal, disk_uri, geometry_of, keys_for, scramble, small_kv, snapshot,
                      stored, wait_until)
from kv_layouts import vllm_kv
from kvcached.storage.record import HEADER_BYTES, BadRecord, pack_header, verify
from kvcached_client.kv_alloc import describe_kv_cache
from kvcached_proto.layout import parse_layout
from test_security import OTHER_UID, _other_uid, run_as_other_uid
from storage_util import PAGE_SHAPE, in_storage_only, offload_and_flush, record_path, start


def _random_fill(kv, seed):
    gen = torch.Generator().manual_seed(seed)
    for layer in kv:
        for t in layer if isinstance(layer, (list, tuple)) else (layer,):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def _engine(kind: str, seed: int):
    """An engine's KV cache, 1 KiB per layer and part of a block in every kind: A is fp32
    (4, 2, 8); "dtype" is bf16 (4, 2, 16); "axis_order" is A's geometry with its block's axes
    in another memory order (vLLM's LBHNC against LBNHC, the same logical shape)."""
    if kind == "A":
        kv = small_kv(num_layers=2, num_blocks=32, block_shape=(4, 2, 8), dtype=torch.float32, seed=seed)
    elif kind == "dtype":
        kv = small_kv(num_layers=2, num_blocks=32, block_shape=(4, 2, 16), dtype=torch.bfloat16, seed=seed)
    else:
        _raw, kv = vllm_kv(kind, layers=2, blocks=32, heads=2, tokens=4, c=64)
        _random_fill(kv, seed)
    return kv


@pytest.fixture(params=["disk", "redis"])
def storage_uri(request, disk_dir):
    if request.param == "disk":
        yield disk_uri(disk_dir)
        return
    server = request.getfixturevalue("redis_server")
    yield server.uri


@pytest.mark.parametrize("other", ["dtype", "axis_order"])
def test_a_block_stored_from_another_geometry_is_never_served(run_dir, instance, storage_uri, other):
    """Engine B re-registers the instance with a geometry of its own, the same bytes per
    block: A's stored blocks are no hits for it and a load of A's keys leaves B's blocks as
    they were. An engine with A's geometry still finds them (the control: they are there)."""
    first, second = ("LBNHC", "LBHNC") if other == "axis_order" else ("A", "dtype")
    keys, src, dst = keys_for(8, 70), list(range(8)), list(range(16, 24))
    h = start(run_dir, instance, storage_uri)
    try:
        kv_a = _engine(first, 1)
        stored_bytes = snapshot(kv_a, src)
        with h.connect() as c:
            c.register_kv_cache(kv_a)
            offload_and_flush(c, kv_a, keys, src)
        kv_b = _engine(second, 2)
        before = snapshot(kv_b, dst)
        with h.connect() as c:
            c.register_kv_cache(kv_b)
            assert c.lookup(keys) == (0, 0)
            assert c.load(keys, dst).wait(10) == 0
            assert blocks_equal(kv_b, dst, before)
        kv_a2 = _engine(first, 3)
        scramble(kv_a2, 5)
        with h.connect() as c:
            c.register_kv_cache(kv_a2)
            assert c.lookup(keys) == (0, 8)
            assert c.load(keys, dst).wait(10) == 8
            assert blocks_equal(kv_a2, dst, stored_bytes)
    finally:
        h.stop()


# the disk tier's directories and files ----------------------------------------------------------

def _stored_and_stopped(run_dir, instance, disk_dir, n=8, seed=80):
    """n blocks on disk from a daemon since stopped: (kv, keys, their bytes)."""
    kv = small_kv(block_shape=PAGE_SHAPE)
    keys, src = keys_for(n, seed), list(range(n))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
    finally:
        h.stop()
    return kv, keys, expected


def _forged_record(kv, key) -> bytes:
    """A well-formed record of key's block of kv's geometry holding other bytes (xxh3 carries
    no secret: anyone who can write the file can make one)."""
    page = os.urandom(parse_layout(describe_kv_cache(kv)).page_bytes)
    return pack_header(stored(key, kv), [page], geometry_of(kv)) + page


def _plant(path, data):
    if os.path.lexists(path):
        os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)
    return "planted"


def test_a_record_planted_by_another_uid_in_an_open_disk_dir_is_never_served(run_dir, instance, disk_dir):
    """The disk root and its shards were left writable by everyone (0777): another uid
    replaces block 3's record with a well-formed one of its own. At the next start the root is
    made private, the foreign file is removed unread, and block 3 is a miss; blocks 0-2 load."""
    kv, keys, expected = _stored_and_stopped(run_dir, instance, disk_dir)
    for d in [disk_dir] + glob.glob(os.path.join(disk_dir, "??")):
        os.chmod(d, 0o777)
    path = record_path(disk_dir, keys[3], kv)
    assert run_as_other_uid(_plant, path, _forged_record(kv, keys[3])) == "planted"
    assert os.stat(path).st_uid == OTHER_UID
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            scramble(kv, 3)
            assert c.lookup(keys) == (0, 3)
            assert c.load(keys, list(range(20, 28))).wait(10) == 3
            assert blocks_equal(kv, list(range(20, 28)), expected, upto=3)
        assert not os.path.exists(path)
        assert stat.S_IMODE(os.stat(disk_dir).st_mode) == 0o700
        assert all(stat.S_IMODE(os.stat(d).st_mode) == 0o700
                   for d in glob.glob(os.path.join(disk_dir, "??")))
        log = open(h.log_path).read()
        assert "was mode 777" in log and "files of other users" in log
    finally:
        h.stop()


def test_a_record_whose_owner_changed_while_the_daemon_ran_is_a_miss_and_removed(run_dir, instance,
                                                                                disk_dir):
    """The start's index checked every record's owner; a record that belongs to another uid
    by the time it is read (given away by a process with CAP_CHOWN, restored from a backup as
    another user) is checked again as it is opened: a miss, counted as corrupt and removed, and
    the blocks before it load byte-exact."""
    _other_uid()
    keys = keys_for(6, 91)
    with in_storage_only(run_dir, instance, disk_uri(disk_dir), keys) as (c, kv, expected, _h):
        path = record_path(disk_dir, keys[3], kv)
        os.chown(path, OTHER_UID, -1)
        scramble(kv, 5)
        assert c.load(keys, list(range(10, 16))).wait(10) == 3
        assert blocks_equal(kv, list(range(10, 16)), expected, upto=3)
        assert not os.path.exists(path)
        assert c.status()["storage"][0]["corrupt"] == 1
        assert c.lookup(keys) == (3, 0)  # blocks 0-2 now in the host tier; 3 is gone from both


def _plant_shard(shard, path, data):
    os.mkdir(shard, 0o755)
    return _plant(path, data)


def test_a_shard_dir_of_another_uid_is_left_unused(run_dir, instance, disk_dir):
    """Another uid made block 5's shard directory (the root was open) and put a record in it:
    nothing in that shard is served or written; the other blocks are."""
    kv, keys, expected = _stored_and_stopped(run_dir, instance, disk_dir)
    os.chmod(disk_dir, 0o777)
    path = record_path(disk_dir, keys[5], kv)
    shutil.rmtree(os.path.dirname(path))
    assert run_as_other_uid(_plant_shard, os.path.dirname(path), path,
                            _forged_record(kv, keys[5])) == "planted"
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            assert c.lookup(keys) == (0, 5)
            assert c.load(keys, list(range(20, 28))).wait(10) == 5
            assert blocks_equal(kv, list(range(20, 28)), expected, upto=5)
            c.offload([5], [keys[5]]).wait(10)
            c.flush().wait(10)
            assert os.stat(path).st_uid == OTHER_UID  # not written through
        assert "left unused" in open(h.log_path).read()
    finally:
        h.stop()


def test_a_disk_root_of_another_uid_is_refused_at_start(run_dir, instance, disk_dir):
    _other_uid()
    os.chown(disk_dir, OTHER_UID, -1)
    out = subprocess.run([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                          "--run-dir", run_dir, "--storage", disk_uri(disk_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"belongs to uid {OTHER_UID}" in out.stderr


@pytest.mark.slow
def test_a_shard_dir_replaced_by_a_link_is_made_a_directory_again(run_dir, instance, disk_dir, tmp_path):
    """A shard turned into a link to elsewhere: at start the link is removed (what is behind it
    is not served), the next block stored into that shard makes it a directory again, and
    blocks stored there from then on are indexed after a restart (written through the link,
    they never were)."""
    kv, keys, _ = _stored_and_stopped(run_dir, instance, disk_dir)
    shard = os.path.dirname(record_path(disk_dir, keys[2], kv))
    elsewhere = str(tmp_path / "elsewhere")
    shutil.move(shard, elsewhere)
    os.symlink(elsewhere, shard)
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            assert not os.path.lexists(shard)
            c.register_kv_cache(kv)
            assert c.lookup(keys)[1] == 2
            c.offload([2], [keys[2]]).wait(10)
            c.flush().wait(10)
    finally:
        h.stop()
    assert os.path.isdir(shard) and not os.path.islink(shard)
    assert os.path.isfile(record_path(disk_dir, keys[2], kv))
    h = start(run_dir, instance, disk_uri(disk_dir))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            assert c.lookup(keys[:3]) == (0, 3)
    finally:
        h.stop()


def test_a_disk_tier_whose_directory_is_gone_reports_no_hits(run_dir, instance, disk_dir):
    keys = keys_for(6, 90)
    with in_storage_only(run_dir, instance, disk_uri(disk_dir), keys) as (c, _kv, _, _h):
        assert c.lookup(keys) == (0, 6)
        shutil.rmtree(disk_dir)
        wait_until(lambda: not c.status()["storage"][0]["healthy"], 10, "the tier unhealthy")
        assert c.lookup(keys) == (0, 0)
        assert c.load(keys, list(range(10, 16))).wait(10) == 0


# the record format (pure logic: every tier reads records through these checks) -----------------

def _record_cases():
    g1, g2 = bytes(range(16)), bytes(range(100, 116))
    key, page = bytes(range(40, 56)), os.urandom(256)
    good = pack_header(key, [page], g1) + page

    def flipped(at):
        bad = bytearray(good)
        bad[at] ^= 0x01
        return bytes(bad)
    return key, g1, len(page), good, {
        "cut in its header": (good[:HEADER_BYTES - 1], f"record of {HEADER_BYTES - 1} bytes"),
        "another format": (flipped(0), "not a kvcached block record"),
        "another key": (pack_header(bytes(16), [page], g1) + page, "another key"),
        "another geometry": (pack_header(key, [page], g2) + page, "another KV geometry"),
        "a payload cut": (good[:-1], "expected"),
        "a payload byte flipped": (flipped(HEADER_BYTES + 7), "checksum mismatch"),
    }


@pytest.mark.parametrize("case", list(_record_cases()[4]))
def test_a_record_that_is_not_this_keys_this_geometrys_and_whole_is_refused(case):
    key, geometry, size, good, bad = _record_cases()
    verify(good, key, size, geometry)  # the control: the record it was made from passes
    record, why = bad[case]
    with pytest.raises(BadRecord, match=why):
        verify(record, key, size, geometry)
