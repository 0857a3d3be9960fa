"""The scheduler's lookup gate against real daemons with a disk tier: a storage hit is brought
into the host tier by a prefetch while the request waits, so the load that follows reads host
memory only; every call answers at once, whatever the tier or the daemon does."""
from __future__ import annotations

import time

import pytest
from conftest import blocks_equal, keys_for, wait_until
from storage_util import start, stored_on_disk_only, stored_with_one_record_hung

from kvcached_client import BlockHasher, Client
from kvcached_client.lookup_gate import LookupGate
from kvcached.bench import process_stop

BLOCK_TOKENS = 16
NO_THRESHOLD = ["--prefetch-threshold-tokens", "0"]


def _stored(run_dir, instance, disk_dir, extra=NO_THRESHOLD):
    """A daemon whose disk tier alone holds 8 blocks; (daemon, kv, keys, the stored bytes)."""
    return stored_on_disk_only(run_dir, instance, disk_dir, extra=extra)


def _poll(gate, req_id, client, keys, timeout=10.0, budget_s=0.5):
    """Ask as a scheduler does, once per step, until the gate answers a number; every call
    must answer within budget_s (no step waits on storage or the daemon: a call that waited on
    the hung read takes the tier's 1 s I/O deadline at least; a lookup's round trip on a loaded
    2-core CI machine may take a good part of 0.2 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        hit = gate.match(req_id, client, keys)
        assert time.monotonic() - t0 < budget_s, "a lookup waited on the prefetch"
        if hit is not None:
            return hit
        time.sleep(0.005)
    raise AssertionError(f"no answer for {req_id} within {timeout} s")


def test_a_storage_hit_is_prefetched_between_steps_and_the_load_reads_host_memory_only(
        run_dir, instance, disk_dir):
    h, kv, keys, expected = _stored(run_dir, instance, disk_dir)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            gate = LookupGate(BLOCK_TOKENS)
            assert gate.match("r1", c, keys) is None  # deferred: its prefetch runs
            assert _poll(gate, "r1", c, keys) == 8
            load = c.load(keys, list(range(20, 28)))
            assert load.reply["storage_blocks"] == 0 and load.wait(10) == 8
            assert blocks_equal(kv, list(range(20, 28)), expected)
            io = c.status()["storage_io"]
            assert io["prefetched"] == 8 and io["fetched"] == 8  # every storage read a prefetch
            assert gate.counters["prefetches"] == 1 and gate.pending == 0
            # the same again is a host hit at once: no second prefetch
            assert gate.match("r2", c, keys) == 8 and gate.counters["prefetches"] == 1
    finally:
        h.stop()


def test_a_storage_hit_the_daemon_will_not_prefetch_is_recomputed_not_read_in_the_step(
        run_dir, instance, disk_dir):
    """8 blocks x 16 tokens is under the daemon's default --prefetch-threshold-tokens (256):
    no prefetch, the hit is the host part (none); inline mode counts the storage part."""
    h, kv, keys, _ = _stored(run_dir, instance, disk_dir, extra=())
    try:
        with h.connect() as c:
            gate = LookupGate(BLOCK_TOKENS)
            assert gate.match("r1", c, keys) == 0
            assert gate.counters["storage_blocks_recomputed"] == 8 and gate.pending == 0
            assert LookupGate(BLOCK_TOKENS, "inline").match("r1", c, keys) == 8
            assert c.status()["storage_io"]["fetched"] == 0
    finally:
        h.stop()
    with pytest.raises(ValueError, match="storage_hits"):
        LookupGate(BLOCK_TOKENS, "eager")


def test_a_daemon_that_stops_answering_mid_prefetch_costs_the_request_its_hit_not_a_step(
        run_dir, instance, disk_dir):
    """The prefetch is queued behind a pause, then the daemon is stopped (SIGSTOP): every call
    answers at once (None) until the gate's deadline (prefetch timeout plus grace), then the
    request goes on with no hit. Once the daemon runs again, a later request is served through
    a prefetch of its own."""
    h, kv, keys, _ = _stored(run_dir, instance, disk_dir)
    owner = h.connect()
    c = Client.connect(instance=instance, run_dir=run_dir, hang_s=60)  # the gate's deadline, not hang detection
    stopped = False
    try:
        owner.register_kv_cache(kv)
        owner.pause()
        gate = LookupGate(BLOCK_TOKENS, timeout_s=0.5, grace_s=0.5)
        t0 = time.monotonic()
        assert gate.match("r1", c, keys) is None
        process_stop.stop(h.pid)
        stopped = True
        assert _poll(gate, "r1", c, keys, timeout=5) == 0
        assert time.monotonic() - t0 >= 1.0 and gate.counters["prefetch_timeouts"] == 1
        process_stop.go_on(h.pid)
        stopped = False
        owner.resume()
        # the held prefetch ran past its own timeout_ms: the daemon ends it with nothing fetched.
        # r2's prefetch may find its entries still on their way: it waits for that fetch, and
        # brings the blocks itself when it ended empty
        assert _poll(gate, "r2", c, keys) == 8 and gate.counters["prefetches"] == 2
        assert c.status()["storage_io"]["prefetched"] == 8
    finally:
        if stopped:
            process_stop.go_on(h.pid)
        c.close()
        owner.close()
        h.stop()


def test_requests_sharing_a_storage_hit_on_a_hung_filesystem_wait_for_one_prefetch(
        run_dir, instance, disk_dir):
    """Record 3 lies on a filesystem whose reads hang (the tier's I/O deadline is 1 s). Two
    requests with the same prefix: every key of the second's storage hit is on its way already,
    so it sends no prefetch of its own and waits for the first's; both get the 3 leading
    blocks that arrived, without a call ever waiting on the hung read."""
    kv, keys, expected, uri, fs = stored_with_one_record_hung(run_dir, instance, disk_dir, 3)
    h = None
    try:
        h = start(run_dir, instance, uri, extra=NO_THRESHOLD)
        with h.connect(timeout=5) as c:
            c.register_kv_cache(kv)
            gate = LookupGate(BLOCK_TOKENS, timeout_s=5)
            assert gate.match("r1", c, keys) is None
            wait_until(lambda: fs.held, 5, "the prefetch reaching the hung read")
            assert gate.match("r2", c, keys) is None
            assert _poll(gate, "r2", c, keys) == 3
            assert _poll(gate, "r1", c, keys) == 3
            assert c.lookup(keys) == (3, 0)  # the stuck tier gives no hits until it recovers
            load = c.load(keys[:3], [20, 21, 22])
            assert load.reply["storage_blocks"] == 0 and load.wait(10) == 3
            assert blocks_equal(kv, [20, 21, 22], expected, upto=3)
    finally:
        fs.close()
        if h is not None:
            h.stop()


def test_a_prefetch_refused_with_busy_keeps_the_host_part_of_the_hit(run_dir, instance, disk_dir):
    """Blocks 0-3 of the prefix are in the host tier, 4-7 on disk only; the daemon's queues are
    full (paused, --max-queued-tasks 2 offloads queued), so the prefetch of 4-7 is refused
    (BUSY). The request is not deferred and not sent away empty: it gets the 4 host blocks at
    once, byte-exact once the daemon runs again, and recomputes the rest."""
    h, kv, keys, expected = _stored(run_dir, instance, disk_dir,
                                    extra=[*NO_THRESHOLD, "--max-queued-tasks", "2"])
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            assert c.prefetch(keys[:4], policy="wait_complete").wait(10)["prefetched"] == 4
            assert c.lookup(keys) == (4, 4)
            c.pause()
            other = BlockHasher("busy").hash_blocks(list(range(32)), 16)
            queued = [c.offload([40 + i], [k]) for i, k in enumerate(other)]
            gate = LookupGate(BLOCK_TOKENS)
            assert gate.match("r1", c, keys) == 4
            assert gate.counters["prefetch_refusals"] == 1 and gate.pending == 0
            assert gate.counters["storage_blocks_recomputed"] == 4
            c.resume()
            assert [t.wait(10)["stored"] for t in queued] == [1, 1]
            load = c.load(keys[:4], list(range(20, 24)))
            assert load.reply["storage_blocks"] == 0 and load.wait(10) == 4
            assert blocks_equal(kv, list(range(20, 24)), expected, upto=4)
            assert c.status()["storage_io"]["fetched"] == 4  # the test's own prefetch alone
    finally:
        h.stop()


def test_a_consumers_short_hit_is_asked_for_again_until_the_rest_arrives_or_its_wait_ends(
        run_dir, instance, disk_dir):
    """expect_s (vLLM's kv_consumer): a prefill instance's last blocks may still be on their way
    to the shared tier when the decode request looks up. A short hit is deferred (every call
    answers at once) until the rest is there - then the whole hit - or expect_s has passed -
    then the hit as it is, without waiting again. Without expect_s the short hit comes at once."""
    h, kv, keys, _ = _stored(run_dir, instance, disk_dir)
    late, never = keys_for(4, seed=7), keys_for(4, seed=8)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            # the control, without expect_s: the 8 blocks there (prefetched from disk), not 12
            assert _poll(LookupGate(BLOCK_TOKENS), "now", c, keys + late) == 8
            gate = LookupGate(BLOCK_TOKENS, expect_s=0.6)
            assert gate.match("r1", c, keys + late) is None  # 8 of 12: the rest is expected
            c.offload(list(range(40, 44)), late).wait(10)  # the producer's last blocks land
            assert _poll(gate, "r1", c, keys + late) == 12
            assert gate.counters["expected_deferrals"] >= 1
            start = time.monotonic()
            assert _poll(gate, "r2", c, keys + never) == 8  # the wait ends: the hit it had
            assert time.monotonic() - start >= 0.6
            assert gate.match("r2", c, keys + never) == 8  # asked again: no second wait
            for bad in (-1, float("nan"), float("inf")):  # never a wait without an end
                with pytest.raises(ValueError, match="consumer wait"):
                    LookupGate(BLOCK_TOKENS, expect_s=bad)
    finally:
        h.stop()


def test_a_consumers_wait_brings_in_the_stored_part_of_its_hit_meanwhile(run_dir, instance, disk_dir):
    """While a short hit waits for the rest (expect_s), the part it has in storage is
    prefetched: the host tier holds it before the wait is over, so the answer at the end needs
    no prefetch of its own. One prefetch: a second request over the same blocks starts none."""
    h, kv, keys, expected = _stored(run_dir, instance, disk_dir)
    late = keys_for(4, seed=9)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            assert c.lookup(keys) == (0, 8)
            gate = LookupGate(BLOCK_TOKENS, expect_s=30.0)
            assert gate.match("r1", c, keys + late) is None  # 8 of 12: the rest is expected
            assert gate.counters["expected_prefetches"] == 1
            assert gate.match("r2", c, keys + keys_for(2, seed=10)) is None
            wait_until(lambda: c.lookup(keys) == (8, 0), 10, "the stored part in the host tier")
            assert gate.match("r1", c, keys + late) is None  # still waiting for the rest
            assert gate.counters["expected_prefetches"] == 1
            c.offload(list(range(40, 44)), late).wait(10)  # the producer's last blocks land
            assert gate.match("r1", c, keys + late) == 12  # at once: nothing left to prefetch
            assert gate.counters["prefetches"] == 0
            # what reached the host tier during the wait counts as storage's in the statistics
            # (a consumer's blocks come from the shared tier; here the last 4 were put there)
            assert gate.from_storage["r1"] == 12
            assert c.load(keys, list(range(20, 28))).wait(10) == 8
            assert blocks_equal(kv, range(20, 28), expected)
    finally:
        h.stop()


def test_a_wait_asks_the_daemon_for_a_prefetch_once_however_many_steps_it_takes(run_dir, instance, disk_dir):
    """A daemon that skips the prefetch (by default a storage hit under 256 tokens is
    recomputed: these 8 blocks are 128) is asked once per wait, not at every step of it; the
    stored blocks stay where they are."""
    h, kv, keys, _ = _stored(run_dir, instance, disk_dir, extra=())
    late = keys_for(4, seed=11)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            calls = []

            class Counted:  # the real client, its prefetch calls counted
                lookup = staticmethod(c.lookup)

                @staticmethod
                def prefetch(*args, **kwargs):
                    calls.append(args)
                    return c.prefetch(*args, **kwargs)

            gate = LookupGate(BLOCK_TOKENS, expect_s=30.0)
            for _ in range(20):
                assert gate.match("r", Counted, keys + late) is None
            assert len(calls) == 1 and gate.counters["expected_prefetches"] == 0
            assert c.lookup(keys) == (0, 8)
    finally:
        h.stop()
