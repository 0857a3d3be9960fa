"""The key table: lookups answered from the daemon's shared memory, never a false hit.

The C table against a model (pure logic), a writer and a reader in two processes on one segment
(the seqlock: a reader never pairs a key with another key's bits while the writer moves keys
back), then real daemons: local answers equal the daemon's, a block evicted between lookup and
load, the disk tier's keys, a Redis tier, a new geometry, a daemon killed and restarted under a
reader, a planted or foreign table, the notes that keep the daemon's statistics, bad notes.
"""
from __future__ import annotations

import mmap
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import posix_ipc
import pytest

from kvcached.server.kv_sweep import sweep_kv_segments
from conftest import keys_for, small_kv, sweep_crashed, unique_instance, wait_until
from kvcached_client import Client, DaemonUnavailable, launch
from kvcached_proto import ErrorCode, KvcachedError, Op, pack_keys
from kvcached_client.key_table import LookupNotes
from kvcached_proto.key_table import (HOST_BIT, MAX_NOTED_KEYS, MAX_NOTED_LOOKUPS, Flags, max_count, native,
                                     segment_name, table_bytes)
from storage_util import start

kt = native()
pytestmark = pytest.mark.skipif(kt is None, reason="kvcached_proto._keytable is not built")


def _bits_of(key: bytes) -> int:
    """The bits the stress writer gives a key: a function of the key, so a torn read shows."""
    return 1 + key[3] % 126


# the C table, pure logic --------------------------------------------------------------------
def test_the_table_answers_as_a_model_through_inserts_removals_and_a_full_table():
    n = 1024
    buf = bytearray(table_bytes(n))
    kt.init(buf, n, 5, 99, max_count(n))
    rng = random.Random(3)
    universe = [rng.randbytes(16) for _ in range(2000)]
    model: dict[bytes, int] = {}
    refused = 0
    for step in range(60000):
        key = rng.choice(universe)
        set_bits, clear_bits = rng.choice((1, 2, 3, 4)), rng.choice((0, 1, 2, 6))
        got = kt.update(buf, key, set_bits, clear_bits)
        want = (model.get(key, 0) | set_bits) & ~clear_bits
        if got == -1:  # full: nothing added, and only a key it did not hold can be refused
            assert key not in model and len(model) == max_count(n) and want
            refused += 1
            continue
        assert got == want
        if want:
            model[key] = want
        else:
            model.pop(key, None)
        if step % 5000 == 0:
            for probe in universe:
                assert kt.bits(buf, probe) == model.get(probe, 0)
    assert refused, "the table never filled: the test did not reach a full table"
    assert kt.count(buf)[0] == len(model)
    assert kt.clear_bits(buf, 2 | 4) == sum(1 for b in model.values() if not b & 1)
    model = {k: b & 1 for k, b in model.items() if b & 1}
    for probe in universe:
        assert kt.bits(buf, probe) == model.get(probe, 0)
    chain = [k for k in universe if k in model][:10] + [k for k in universe if k not in model][:1]
    assert kt.lookup(buf, b"".join(chain), 5)[:2] == (10, 0)
    assert kt.lookup(buf, b"".join(chain), 6)[0] == -1  # another daemon's table: ask it


def test_update_many_is_update_of_each_key_xor_the_mask():
    """A storage tier's whole index goes into the table in one C call (update_many): each name
    XOR the geometry is the engine's key, as update would take it one by one, the limit and a
    full table refusing alike."""
    n = 256
    rng = random.Random(8)
    mask = rng.randbytes(16)
    names = [rng.randbytes(16) for _ in range(300)]  # past max_count(256): some refused

    def xor(a, b):
        return bytes(x ^ y for x, y in zip(a, b))
    one, many = bytearray(table_bytes(n)), bytearray(table_bytes(n))
    for buf in (one, many):
        kt.init(buf, n, 1, 7, max_count(n))
        kt.update(buf, xor(names[0], mask), HOST_BIT, 0)  # a host key too: bits merge
    refused = sum(kt.update(one, xor(k, mask), 4, 0, 150) < 0 for k in names)
    assert refused == kt.update_many(many, b"".join(names), mask, 4, 0, 150) > 0
    for k in names:
        assert kt.bits(many, xor(k, mask)) == kt.bits(one, xor(k, mask))
        assert kt.bits(many, k) == 0  # the stored name itself is no key
    assert kt.bits(many, xor(names[0], mask)) == HOST_BIT | 4
    kt.update_many(many, b"".join(names[:100]), mask, 0, 4)
    assert kt.count(many)[0] == 1 + 149 - 99  # cleared: the host bit keeps names[0]
    with pytest.raises(ValueError):
        kt.update_many(many, b"x" * 17, mask, 4, 0)
    with pytest.raises(ValueError):
        kt.update_many(many, b"", b"short", 4, 0)


def test_the_storage_run_starts_where_the_host_prefix_ends():
    n = 1024
    buf = bytearray(table_bytes(n))
    kt.init(buf, n, 1, 2, max_count(n))
    keys = keys_for(8, namespace="kt-run")
    for k, bits in zip(keys, (1, 1, 3, 2, 2, 1, 2, 0)):
        if bits:
            kt.update(buf, k, bits, 0)
    # host 1,1,1(+disk); then disk, disk; a host-only key ends the storage run
    assert kt.lookup(buf, b"".join(keys), 1)[:2] == (3, 2)
    assert kt.lookup(buf, b"".join(keys[3:]), 1)[:2] == (0, 2)


def test_a_slot_the_writer_holds_is_no_answer_and_never_a_hit():
    """A writer preempted inside a slot write leaves its seq odd: a reader that meets that slot
    after its spins answers nothing (-1, None: ask the daemon), never a hit or a miss."""
    n = 1024
    buf = bytearray(table_bytes(n))
    kt.init(buf, n, 1, 2, max_count(n))
    keys = keys_for(4, namespace="kt-held")
    for k in keys:
        kt.update(buf, k, HOST_BIT, 0)
    slot = next(i for i in range(n) if buf[128 + 32 * i + 8:128 + 32 * i + 24] == keys[2])
    seq = int.from_bytes(buf[128 + 32 * slot:136 + 32 * slot], "little")
    buf[128 + 32 * slot:136 + 32 * slot] = (seq + 1).to_bytes(8, "little")  # the write begun
    absent = next(k for k in (os.urandom(16) for _ in range(100000))
                  if kt.bits(buf, k) == -1)  # an absent key whose probe meets the held slot
    assert kt.bits(buf, keys[2]) == -1 and kt.bits(buf, keys[0]) == HOST_BIT
    assert np.frombuffer(kt.bits_of(buf, keys[2] + absent + keys[1]), dtype=np.int32).tolist() \
        == [-1, -1, HOST_BIT]
    assert kt.lookup(buf, b"".join(keys), 1)[:2] == (-1, 0)
    assert kt.lookup(buf, b"".join(keys[:2]), 1)[:2] == (2, 0)  # the held slot not on the way
    status = bytearray(48)
    status[32:40] = time.monotonic_ns().to_bytes(8, "little")
    status[40:44] = (1).to_bytes(4, "little")
    kt.set_flags(buf, int(Flags.OPEN | Flags.HOST_COMPLETE | Flags.NO_STORAGE), 0)
    assert kt.answer(buf, keys, 1, status, 10**10, -1) is None
    assert kt.answer(buf, [keys[0], keys[1], absent], 1, status, 10**10, -1) is None
    assert kt.answer(buf, keys[:2], 1, status, 10**10, -1)[:2] == (2, 0)
    buf[128 + 32 * slot:136 + 32 * slot] = (seq + 2).to_bytes(8, "little")  # the write ended
    assert kt.answer(buf, keys, 1, status, 10**10, -1)[:2] == (4, 0)
    assert kt.bits(buf, absent) == 0


def test_a_segment_that_is_no_table_is_refused():
    with pytest.raises(ValueError, match="not a kvcached key table"):
        kt.lookup(bytearray(4096), b"", 1)
    buf = bytearray(table_bytes(1024))
    kt.init(buf, 1024, 1, 2, max_count(1024))
    with pytest.raises(ValueError, match="not a kvcached key table"):
        kt.lookup(buf[:2048], b"", 1)  # says 1024 slots, holds fewer
    with pytest.raises(ValueError):
        kt.lookup(buf, b"x" * 17, 1)


_WRITER = textwrap.dedent("""
    import mmap, random, sys, time
    import posix_ipc
    from kvcached_proto import _keytable as kt
    name, seconds, universe_seed = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    shm = posix_ipc.SharedMemory(name)
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    rng = random.Random(universe_seed)
    universe = [rng.randbytes(16) for _ in range(1500)]
    bits_of = lambda key: 1 + key[3] % 126
    print("writing", flush=True)
    end, ops = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for _ in range(1000):
            key = rng.choice(universe)
            if kt.update(mm, key, 0, 0) == 0 or rng.random() < 0.3:  # absent: add it; else often drop it
                kt.update(mm, key, bits_of(key), 0)
            else:
                kt.update(mm, key, 0, 127)
            ops += 1
    print(ops, flush=True)
""")


@pytest.mark.slow
def test_a_reader_never_pairs_a_key_with_other_bits_while_the_writer_moves_keys():
    """Two processes on one segment: the writer adds and drops keys of a 1,500-key universe in a
    1,024-slot table (every drop moves keys back along their probe runs); the reader probes all
    the time. A key found must be of the universe with its own bits; a key never written must
    never be found."""
    name = segment_name(os.getuid(), unique_instance("kts"))
    n = 1024
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=table_bytes(n))
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    writer = None
    try:
        kt.init(mm, n, 1, 12345, max_count(n))
        seed = 11
        rng = random.Random(seed)
        universe = [rng.randbytes(16) for _ in range(1500)]
        never = [os.urandom(16) for _ in range(500)]
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, name, "4", str(seed)],
                                  stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "writing"
        expected = np.array([_bits_of(k) for k in universe], dtype=np.int32)
        packed, never_packed = b"".join(universe), b"".join(never)
        found = torn = false_hits = probes = locked = 0
        while writer.poll() is None:
            got = np.frombuffer(kt.bits_of(mm, packed), dtype=np.int32)
            probes += len(got)
            found += int((got > 0).sum())
            torn += int(((got > 0) & (got != expected)).sum())
            # -1: a slot the writer held past the reader's spins (the writer was preempted in
            # its few-nanosecond write, as on a loaded machine): "ask the daemon", not a hit
            never_got = np.frombuffer(kt.bits_of(mm, never_packed), dtype=np.int32)
            false_hits += int((never_got > 0).sum())
            locked += int((never_got < 0).sum()) + int((got < 0).sum())
            false_hits += kt.lookup(mm, never_packed, 1)[0] > 0
        ops = int(writer.stdout.readline())
        assert writer.wait(10) == 0
        assert ops > 100_000 and probes > 100_000 and found > 10_000, (ops, probes, found)
        assert torn == 0, f"{torn} probes read a key with another key's bits"
        assert false_hits == 0, f"{false_hits} keys never written were found ({locked} probes met a held slot)"
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
            writer.wait(10)
        mm.close()
        posix_ipc.unlink_shared_memory(name)


# a daemon's table -----------------------------------------------------------------------------
def _requests(c: Client) -> int:
    return c.status()["requests"]["handled"]


def test_local_lookups_equal_the_daemons_and_send_no_message(daemon):
    kv = small_kv()
    keys = keys_for(24, namespace="kt-eq")
    with daemon.connect() as c, daemon.connect(key_table=False) as asked:
        assert c.lookup(keys) == (0, 0)  # no table before a geometry: the daemon answers
        c.register_kv_cache(kv)
        c.offload(range(16), keys[:16]).wait(10)
        c.delete(keys[4:6])  # a hole: the prefix ends at 4
        cases = [keys, keys[:4], keys[6:16], keys[16:], keys[6:] + keys[:4], [], keys[:1]]
        before, answered, sent = _requests(asked), c.key_table.answered, c.key_table.asked
        for case in cases:
            assert c.lookup(case) == asked.lookup(case), case
        assert c.key_table.answered - answered == len(cases)
        assert c.key_table.asked == sent
        # asked's lookups and its status: one request each; c sent none (notes go to c's socket
        # only when it sends, or 16 lookups / 50 ms later)
        assert _requests(asked) - before == len(cases) + 1


def test_a_block_evicted_between_lookup_and_load_is_a_shorter_load(daemon):
    """A hit pins nothing: deleted (or evicted) after the local lookup, the block is not loaded
    and the engine's block keeps its bytes (it recomputes it)."""
    kv = small_kv()
    keys = keys_for(8, namespace="kt-evict")
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        c.offload(range(8), keys).wait(10)
        asked = c.key_table.asked
        assert c.lookup(keys) == (8, 0)
        assert c.key_table.asked == asked, "the lookup was not answered from the table"
        c.delete(keys[3:])
        target = list(range(40, 48))
        before = [t[40:48].clone() for layer in kv for t in layer]
        task = c.load(keys, target)
        assert task.num_blocks == 3
        assert task.wait(10) == 3
        after = [t[40:48] for layer in kv for t in layer]
        for b, a in zip(before, after):
            assert a[3:].equal(b[3:])  # not loaded: untouched
            assert not a[:3].equal(b[:3])  # the control: the 3 loaded blocks did change
        assert c.lookup(keys) == (3, 0)


def test_an_evicted_block_leaves_the_table(run_dir, instance):
    """A host pool of a few blocks: offloads evict the oldest chains; the table follows, and a
    lookup of an evicted chain is a miss."""
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.0005)
    try:
        kv = small_kv()
        with d.connect() as c:
            c.register_kv_cache(kv)
            capacity = c.status()["host"]["capacity_blocks"]
            chains = [keys_for(4, seed=i, namespace="kt-lru") for i in range(capacity // 4 + 3)]
            for chain in chains:
                c.offload(range(4), chain).wait(10)
            assert c.status()["host"]["evictions"] > 0
            local = [c.lookup(chain)[0] for chain in chains]
            with d.connect(key_table=False) as asked:
                assert local == [asked.lookup(chain)[0] for chain in chains]
            assert local[0] == 0 and local[-1] == 4
            assert c.key_table.asked == 0  # registered before its first lookup: the table was there
    finally:
        d.stop()


def test_a_new_geometry_makes_a_new_table(daemon):
    keys = keys_for(4, namespace="kt-geo")
    with daemon.connect() as c:
        c.register_kv_cache(small_kv())
        c.offload(range(4), keys).wait(10)
        assert c.lookup(keys) == (4, 0)
        old = c.key_table._mm
        c.register_kv_cache(small_kv(block_shape=(16, 2, 16)))  # another page size: blocks void
        assert c.lookup(keys) == (0, 0)
        assert c.key_table._mm is not old
        c.offload(range(2), keys[:2]).wait(10)
        assert c.lookup(keys) == (2, 0)
        assert c.status()["key_table"]["keys"] == 2


def test_the_disk_tiers_keys_are_answered_from_the_table_after_a_restart(run_dir, instance, disk_dir):
    kv = small_kv()
    keys = keys_for(12, namespace="kt-disk")
    uri = f"disk://{disk_dir}?capacity_gb=1"
    d = start(run_dir, instance, uri)
    try:
        with d.connect() as c:
            c.register_kv_cache(kv)
            c.offload(range(12), keys).wait(10)
            c.flush().wait(30)
    finally:
        d.stop()
    d = start(run_dir, instance, uri)
    try:
        with d.connect() as c, d.connect(key_table=False) as asked:
            c.register_kv_cache(kv)
            wait_until(lambda: "storage_complete" in c.status()["key_table"]["flags"], 5,
                       "the disk tier's keys in the table")
            n = c.key_table.asked
            assert c.lookup(keys) == asked.lookup(keys) == (0, 12)
            c.offload(range(3), keys[:3]).wait(10)
            assert c.lookup(keys) == asked.lookup(keys) == (3, 9)
            c.delete(keys[8:9])  # from every tier
            assert c.lookup(keys) == asked.lookup(keys) == (3, 5)
            assert c.key_table.asked == n, "a lookup went to the daemon"
            status = c.status()["key_table"]
            assert status["local_storage_tiers"] == 1 and status["keys"] == 11
            c.clear(tier="storage")
            assert c.lookup(keys) == asked.lookup(keys) == (3, 0)
    finally:
        d.stop()


def test_a_remote_tier_is_asked_when_the_local_answer_stops_short(run_dir, instance, redis_server):
    kv = small_kv()
    keys = keys_for(6, namespace="kt-redis")
    d = start(run_dir, instance, redis_server.uri)
    try:
        with d.connect() as c:
            c.register_kv_cache(kv)
            c.offload(range(6), keys).wait(10)
            c.flush().wait(30)
            assert c.lookup(keys) == (6, 0)  # a whole host hit needs no tier
            n = c.key_table.asked
            c.delete(keys[4:])
            c.clear(tier="host")
            assert "storage_remote" in c.status()["key_table"]["flags"]
            assert c.lookup(keys) == (0, 4)  # Redis holds 4: only the daemon knows
            assert c.key_table.asked == n + 1
    finally:
        d.stop()


def test_a_killed_daemons_table_answers_nothing_and_its_successor_starts_empty(run_dir, instance):
    kv = small_kv()
    keys = keys_for(4, namespace="kt-kill")
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
    d2 = None
    try:
        c = d.connect()
        c.register_kv_cache(kv)
        c.offload(range(4), keys).wait(10)
        assert c.lookup(keys) == (4, 0)
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(10)
        with pytest.raises(DaemonUnavailable):
            c.lookup(keys)  # the table is still mapped and says 4: the exited daemon is seen
        c.close()
        d2 = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)  # sweeps the old table
        with d2.connect() as c2:
            assert c2.lookup(keys) == (0, 0)  # no table yet: the daemon answered
            c2.register_kv_cache(kv)
            assert c2.lookup(keys) == (0, 0)
            assert c2.key_table.answered == 1 and c2.key_table._mm is not None
    finally:
        if d2 is not None:
            d2.stop()
        d.stop()
        sweep_crashed(instance)


def test_a_stopped_daemons_table_is_closed_for_its_readers(run_dir, instance):
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
    try:
        c = d.connect()
        c.register_kv_cache(small_kv())
        keys = keys_for(2, namespace="kt-stop")
        c.offload(range(2), keys).wait(10)
        assert c.lookup(keys) == (2, 0)
        mm = c.key_table._mm
        d.stop()
        assert not kt.lookup(mm, b"", c.epoch)[2] & Flags.OPEN
        with pytest.raises(DaemonUnavailable):
            c.lookup(keys)
        c.close()
    finally:
        d.stop()


def test_a_planted_table_is_swept_and_a_foreign_one_never_read(run_dir, instance):
    """A segment under the table's name before the daemon starts is swept at start; a table
    that is not 0600, or of another epoch, is never read as the daemon's."""
    name = segment_name(os.getuid(), instance)
    planted = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=table_bytes(1024))
    planted.close_fd()
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
    try:
        keys = keys_for(4, namespace="kt-plant")
        with d.connect() as c:
            assert not os.path.exists(f"/dev/shm{name}")
            c.register_kv_cache(small_kv())
            c.offload(range(4), keys).wait(10)
            assert c.lookup(keys) == (4, 0) and c.key_table.answered == 1
            # a forged table in its place: every key a hit, another epoch, then loose mode
            c.key_table.close()
            posix_ipc.unlink_shared_memory(name)
            forged = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=table_bytes(1024))
            mm = mmap.mmap(forged.fd, forged.size)
            forged.close_fd()
            kt.init(mm, 1024, c.epoch ^ 1, 7, max_count(1024))
            other = keys_for(4, namespace="kt-forged")
            for k in other:
                kt.update(mm, k, HOST_BIT, 0)
            kt.set_flags(mm, Flags.OPEN | Flags.HOST_COMPLETE | Flags.NO_STORAGE, 0)
            assert c.lookup(other) == (0, 0)  # another epoch: the daemon answered
            mm.close()
            posix_ipc.unlink_shared_memory(name)
            loose = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o644, size=table_bytes(1024))
            mm = mmap.mmap(loose.fd, loose.size)
            loose.close_fd()
            kt.init(mm, 1024, c.epoch, 7, max_count(1024))
            for k in other:
                kt.update(mm, k, HOST_BIT, 0)
            kt.set_flags(mm, Flags.OPEN | Flags.HOST_COMPLETE | Flags.NO_STORAGE, 0)
            c.key_table.close()
            assert c.lookup(other) == (0, 0)  # 0644: not the daemon's
            assert c.key_table._mm is None
            mm.close()
            posix_ipc.unlink_shared_memory(name)
    finally:
        d.stop()


def test_local_lookups_reach_the_daemons_statistics_and_policy(daemon):
    kv = small_kv()
    keys = keys_for(8, namespace="kt-notes")
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        c.offload(range(8), keys).wait(10)
        base = c.status()["lookups"]
        for i in range(40):
            c.lookup(keys[:6] if i % 2 else keys[: 1 + i % 8])  # repeats and distinct ones
        c.lookup(keys_for(3, namespace="kt-notes-miss"))
        assert c.key_table.asked == 0 and c.key_table.answered == 41
        got = c.status()["lookups"]  # the pending notes go first on the same socket
        asked = 20 * 6 + sum(1 + i % 8 for i in range(0, 40, 2))
        assert got["lookups"] - base["lookups"] == 41
        assert got["keys"] - base["keys"] == asked + 3
        assert got["host_hits"] - base["host_hits"] == asked
        assert got["unnoted_lookups"] == base["unnoted_lookups"]


def test_a_local_lookup_keeps_its_blocks_from_lru_eviction(run_dir, instance):
    """The notes reach the eviction policy: a chain looked up from the table is recent, so
    under LRU the next eviction takes the chain offloaded after it and not looked up."""
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.0005, extra_args=["--eviction", "lru"])
    try:
        with d.connect() as c:
            c.register_kv_cache(small_kv())
            capacity = c.status()["host"]["capacity_blocks"]
            chains = [keys_for(4, seed=i, namespace="kt-recent") for i in range(capacity // 4)]
            for chain in chains:
                c.offload(range(4), chain).wait(10)
            rest = capacity % 4
            if rest:  # the pool full to the last block
                c.offload(range(rest), keys_for(rest, seed=998, namespace="kt-recent")).wait(10)
            assert c.status()["host"]["evictions"] == 0
            assert c.lookup(chains[0]) == (4, 0) and c.key_table.asked == 0  # from the table
            c.ping()  # the note goes first
            c.offload(range(4), keys_for(4, seed=999, namespace="kt-recent")).wait(10)
            assert c.status()["host"]["evictions"] == 4
            assert c.lookup(chains[0]) == (4, 0)  # looked up: kept
            assert c.lookup(chains[1]) == (0, 0)  # the least recent then: evicted
    finally:
        d.stop()


def test_bad_notes_are_refused_and_change_nothing(daemon):
    with daemon.connect() as c:
        base = c.status()["lookups"]
        keys = pack_keys(keys_for(4, namespace="kt-badnotes"))
        for counts in ([3], [2, 3], [0, 4], [-1, 5]):
            with pytest.raises(KvcachedError) as err:
                c._request(Op.LOOKUP_NOTES, keys=keys, counts=b"".join(
                    x.to_bytes(4, "little", signed=True) for x in counts))
            assert err.value.code == ErrorCode.BAD_FIELD
        with pytest.raises(KvcachedError):
            c._request(Op.LOOKUP_NOTES, keys=keys, counts=b"\x04\x00\x00")
        four = (4).to_bytes(4, "little")
        for repeats in (b"\x00" * 4, b"\x01\x00", four * 2):  # 0 times, not int32s, 2 for 1 lookup
            with pytest.raises(KvcachedError) as err:
                c._request(Op.LOOKUP_NOTES, keys=keys, counts=four, repeats=repeats)
            assert err.value.code == ErrorCode.BAD_FIELD
        many = MAX_NOTED_LOOKUPS + 1  # one frame's work is bounded: 65,536 one-key lookups
        with pytest.raises(KvcachedError) as err:  # noted 8 times each held the daemon ~0.5-1 s
            c._request(Op.LOOKUP_NOTES, keys=pack_keys(keys_for(many, namespace="kt-many")),
                       counts=(1).to_bytes(4, "little") * many)
        assert err.value.code == ErrorCode.TOO_MANY_ITEMS
        with pytest.raises(KvcachedError) as err:  # few lookups, too many keys
            c._request(Op.LOOKUP_NOTES, keys=pack_keys(keys_for(MAX_NOTED_KEYS + 1, namespace="kt-many")),
                       counts=(MAX_NOTED_KEYS + 1).to_bytes(4, "little"))
        assert err.value.code == ErrorCode.TOO_MANY_ITEMS
        assert c.status()["lookups"] == base
        assert c.ping() > 0


def test_a_client_keeps_no_more_notes_than_one_message_may_carry():
    """Past MAX_NOTED_LOOKUPS distinct lookups, or MAX_NOTED_KEYS keys, pending notes take no
    more (counted as dropped, told as `unnoted`): the daemon would refuse the message whole and
    lose them all."""
    notes = LookupNotes()
    big = pack_keys(keys_for(MAX_NOTED_KEYS // 2 + 1, namespace="kt-big"))
    assert notes.add(big, 0) is False and notes.nkeys == MAX_NOTED_KEYS // 2 + 1
    assert notes.add(pack_keys(keys_for(MAX_NOTED_KEYS // 2, seed=1, namespace="kt-big")), 0)
    assert len(notes.pending) == 1 and notes.dropped == 1
    notes.take()
    for i in range(MAX_NOTED_LOOKUPS + 3):
        notes.add(pack_keys(keys_for(1, seed=i, namespace="kt-small")), 0)
    assert len(notes.pending) == MAX_NOTED_LOOKUPS and notes.dropped == 1 + 3
    _keys, counts, _repeats, _storage = notes.take()
    assert len(counts) == MAX_NOTED_LOOKUPS and sum(counts) <= MAX_NOTED_KEYS


def _deleted(log_path: str) -> list[tuple[int, bytes]]:
    """(chain index, its first key) of every chain the engine deleted, in order."""
    out = []
    for line in open(log_path).read().split("\n")[:-1]:  # the last: "" or a line being written
        i, first = line.split()
        out.append((int(i), bytes.fromhex(first)))
    return out


@pytest.mark.slow
@pytest.mark.faults
def test_no_false_hit_under_offloads_evictions_deletes_and_a_restart(run_dir, instance):
    """An engine in another process offloads fresh chains into a small pool (evictions) and
    deletes every third chain, writing each deleted chain to a file once the delete returned.
    A reader answers lookups from the table meanwhile: a key never offloaded, or deleted before
    the lookup began, is never a hit. Then the daemon is killed under the reader (no hit from
    its table after that) and restarted (no hit from before)."""
    log_path = os.path.join(run_dir, "deleted")
    engine_src = textwrap.dedent("""
        import os, sys, hashlib
        from kvcached_client import Client, allocate_kv_cache
        import torch
        instance, run_dir, log_path = sys.argv[1:4]
        kv = allocate_kv_cache(2, 64, (16, 2, 8), torch.bfloat16)
        with Client.connect(instance=instance, run_dir=run_dir) as c, open(log_path, "a") as log:
            c.register_kv_cache(kv)
            print("ready", flush=True)
            i = 0
            while True:
                chain = [hashlib.blake2b(f"chain{i}-{j}".encode(), digest_size=16).digest() for j in range(8)]
                c.offload(range(8 * (i % 4), 8 * (i % 4) + 8), chain).wait(10)
                if i % 3 == 0:
                    c.delete(chain)
                    log.write(f"{i} {chain[0].hex()}\\n")
                    log.flush()
                i += 1
    """)
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.002)
    engine = d2 = None
    try:
        engine = subprocess.Popen([sys.executable, "-c", engine_src, instance, run_dir, log_path],
                                  stdout=subprocess.PIPE, text=True)
        assert engine.stdout.readline().strip() == "ready"
        import hashlib

        def chain(i):
            return [hashlib.blake2b(f"chain{i}-{j}".encode(), digest_size=16).digest() for j in range(8)]

        never = [os.urandom(16) for _ in range(64)]
        hits = checked_deleted = 0
        with d.connect(name="reader") as c:
            c.lookup(never)
            assert c.key_table._mm is not None
            end = time.monotonic() + 4
            last = 0
            while time.monotonic() < end:
                deleted = _deleted(log_path)  # deleted before this lookup began
                for i, first in deleted[-20:]:
                    host, _ = c.lookup([first])
                    assert host == 0, f"chain {i}, deleted, was a hit"
                    checked_deleted += 1
                last = deleted[-1][0] if deleted else 0
                assert c.lookup(never) == (0, 0)
                for i in range(max(0, last - 90), last + 3):  # the recent chains: most are held
                    host, _ = c.lookup(chain(i) + never[:1])
                    assert host <= 8
                    hits += host > 0
            assert c.key_table.answered > 1000 and hits > 0 and checked_deleted > 100, (
                c.key_table.answered, hits, checked_deleted)
            assert c.key_table.asked < c.key_table.answered / 10
            engine.kill()
            engine.wait(10)
            sweep_kv_segments(engine.pid)  # what the daemon would have swept
            last = _deleted(log_path)[-1][0]
            live = [i for i in range(max(0, last - 90), last + 3) if c.lookup(chain(i))[0]]
            assert live
            os.kill(d.pid, signal.SIGKILL)
            d.proc.wait(10)
            for i in live:
                with pytest.raises(DaemonUnavailable):
                    c.lookup(chain(i))
        sweep_crashed(instance)
        d2 = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.002)
        with d2.connect() as c2:
            c2.register_kv_cache(small_kv(num_layers=2, block_shape=(16, 2, 8)))
            assert all(c2.lookup(chain(i)) == (0, 0) for i in live)
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
            engine.wait(10)
            sweep_kv_segments(engine.pid)
        if d2 is not None:
            d2.stop()
        d.stop()
        sweep_crashed(instance)
