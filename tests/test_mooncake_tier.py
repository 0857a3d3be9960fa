"""The Mooncake Store tier through a real mooncake_master (and a memory-only mooncake_client) on
loopback, from Mooncake's wheel: two daemons share blocks byte-exact, a restarted daemon finds
them, a damaged or foreign object is a miss and is removed, a master killed or stopped costs no
request more than the tier's deadline and never serves wrong bytes, and status shows the outage.
Skipped only where the `mooncake` extra is not installed (CI installs it)."""
import pytest

from conftest import blocks_equal, keys_for, scramble, small_kv, snapshot, stored, unique_instance, wait_until
from kvcached.bench.mooncake_servers import MooncakeStore, available
from kvcached.storage.uris import parse_mooncake_uri as parse_uri
from kvcached.storage.record import HEADER_BYTES
from storage_util import PAGE_SHAPE, offload_and_flush, pings_answered, start

pytestmark = pytest.mark.skipif(not available(), reason="the mooncake extra is not installed")


@pytest.fixture
def store(tmp_path):
    s = MooncakeStore(provider_mb=128, log_dir=str(tmp_path))
    yield s
    s.close()


def _uri(store, segment_gb=0):
    return f"{store.uri}?segment_gb={segment_gb}&host=127.0.0.1"


def _tier(c) -> dict:
    return next(t for t in c.status()["storage"] if t["uri"].startswith("mooncake://"))


def _bare(store):
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", store.uri[len("mooncake://"):]) == 0
    return client


def test_the_uri_is_checked_before_anything_is_opened():
    got = parse_uri("mooncake://10.0.0.5:50051?segment_gb=2&protocol=rdma&device=mlx5_0&host=10.0.0.9")
    assert got["master"] == "10.0.0.5:50051" and got["segment_bytes"] == 2 << 30
    assert got["protocol"] == "rdma" and got["device"] == "mlx5_0" and got["host"] == "10.0.0.9"
    assert got["metadata"] == "P2PHANDSHAKE" and got["io_timeout_s"] == 0.5 and got["lookup_keys"] == 16384
    for bad, says in (("mooncake://h", "MASTER_HOST:PORT"), ("mooncake://h:1?segment=1", "unknown option"),
                      ("mooncake://h:1?protocol=udp", "tcp or rdma"), ("mooncake://h:1?segment_gb=-1", "non-negative"),
                      ("mooncake://h:1?io_timeout_s=0", "positive"), ("mooncake://h:1?lookup_keys=0", "whole number >= 1")):
        with pytest.raises(ValueError, match=says):
            parse_uri(bad)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_two_daemons_share_blocks_and_a_restarted_one_finds_them(run_dir, store, layout):
    """Daemon A backs up (write_through) into the store; daemon B, another process with its own
    host tier, loads them byte-exact; A stopped and started again finds them too. The blocks sit
    in the memory-only client's segment, which outlives both daemons. layer_first pages (8
    pieces here) move through the staging buffer, page_first ones straight from the pool."""
    kv = small_kv(block_shape=PAGE_SHAPE, seed=1)
    keys, src = keys_for(8, 71), list(range(8))
    expected = snapshot(kv, src)
    layout_args = ["--host-layout", layout]
    name_a, name_b = unique_instance("mca"), unique_instance("mcb")  # instances are host-wide
    a = start(run_dir, name_a, _uri(store), extra=layout_args)
    try:
        with a.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            assert _tier(c)["puts"] == 8 and _tier(c)["healthy"]
    finally:
        a.stop()
    for name in (name_b, name_a):  # another daemon, then A again (a restart)
        other = small_kv(block_shape=PAGE_SHAPE, seed=2)
        scramble(other, 5)
        assert not blocks_equal(other, range(20, 28), expected)  # the control
        h = start(run_dir, name, _uri(store), extra=layout_args)
        try:
            with h.connect() as c:
                c.register_kv_cache(other)
                assert c.lookup(keys) == (0, 8)
                assert c.load(keys, list(range(20, 28))).wait(10) == 8
                assert blocks_equal(other, range(20, 28), expected)
                assert _tier(c)["gets"] == 8 and _tier(c)["corrupt"] == 0
        finally:
            h.stop()


def test_a_damaged_or_foreign_object_is_a_miss_and_is_removed(run_dir, instance, store):
    kv = small_kv(block_shape=PAGE_SHAPE, seed=3)
    keys, src = keys_for(6, 72), list(range(6))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, _uri(store))
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
        bare = _bare(store)
        try:
            # block 2: one payload byte flipped; block 4: block 1's record under its name
            names = [f"kvcached/{stored(k, kv).hex()}" for k in keys]
            damaged = bytearray(bare.get(names[2]))
            assert len(damaged) > HEADER_BYTES + 100
            damaged[HEADER_BYTES + 100] ^= 0x5A
            foreign = bare.get(names[1])
            for name, value in ((names[2], bytes(damaged)), (names[4], foreign)):
                assert bare.remove(name, True) == 0
                assert bare.put(name, value) == 0
            scramble(kv, 9)
            with h.connect() as c:
                c.register_kv_cache(kv)
                assert c.load(keys, list(range(10, 16))).wait(10) == 2  # the first damaged one ends it
                assert blocks_equal(kv, range(10, 12), expected, upto=2)
                assert _tier(c)["corrupt"] >= 1  # the fetch read the whole run: maybe block 4 too
                assert c.load(keys[4:], list(range(20, 22))).wait(10) == 0
                assert _tier(c)["corrupt"] == 2
            assert bare.batch_is_exist([names[2], names[4], names[3]]) == [0, 0, 1]  # removed, kept
        finally:
            bare.close()
    finally:
        h.stop()


@pytest.mark.faults
def test_a_killed_master_costs_misses_and_status_then_the_tier_comes_back(run_dir, instance, store):
    """Killed: lookups and loads of what it placed come back as misses at once, the tier shows
    unhealthy, nothing wrong is served; restarted (empty), the tier is healthy again and stores
    and serves new blocks."""
    kv = small_kv(block_shape=PAGE_SHAPE, seed=4)
    keys, src = keys_for(6, 73), list(range(6))
    expected = snapshot(kv, src)
    h = start(run_dir, instance, _uri(store, segment_gb=0.0625))
    try:
        with h.connect(timeout=2.0) as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
            assert c.lookup(keys) == (0, 6)
            store.kill_master()
            scramble(kv, 4)
            assert c.lookup(keys) == (0, 0)
            assert c.load(keys, list(range(10, 16))).wait(10) == 0
            wait_until(lambda: not _tier(c)["healthy"], 5, "the outage in status")
            assert "does not answer" in _tier(c)["last_error"] or "failed" in _tier(c)["last_error"]
            store.start_master()
            wait_until(lambda: _tier(c)["healthy"], 10, "the tier healthy again")
            store.wait_segments(1)  # the provider and the daemon mount their segments again
            assert c.lookup(keys) == (0, 0)  # the new master knows nothing of them
            fresh = keys_for(4, 74)
            c.offload(range(20, 24), fresh).wait(10)
            wait_until(lambda: (c.flush().wait(30), _tier(c)["puts"] >= 10)[1], 20, "backups stored again")
            c.clear(tier="host")
            assert c.lookup(fresh) == (0, 4)
            assert c.load(fresh, list(range(30, 34))).wait(10) == 4
            assert blocks_equal(kv, range(30, 34), snapshot(kv, range(20, 24)))
            assert not blocks_equal(kv, range(10, 16), expected)  # nothing of the old ones came back
    finally:
        h.stop()


@pytest.mark.faults
def test_a_master_that_stops_answering_stalls_no_request_beyond_the_deadline(run_dir, instance, store):
    """SIGSTOP on the master (its clients' own RPC timeout is 30 s): each lookup and load
    answers within a 1.5 s client timeout (the tier's deadline is 0.5 s), another client's
    pings are answered meanwhile, status shows the tier stuck; SIGCONT brings it back. A clear
    meanwhile is owed: done before the tier serves again (the cleared blocks were hits)."""
    kv = small_kv(block_shape=PAGE_SHAPE, seed=5)
    keys, src = keys_for(4, 75), list(range(4))
    kept = keys_for(4, 76)
    h = start(run_dir, instance, _uri(store))
    try:
        with h.connect(timeout=1.5) as c, h.connect(timeout=1.5) as other:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, src)
            c.clear(tier="host")
            store.stop_master(True)
            try:
                with pings_answered(other):
                    for _ in range(3):
                        assert c.lookup(keys) == (0, 0)
                    assert c.load(keys, list(range(10, 14))).wait(5) == 0
                    tier = _tier(c)
                    assert not tier["healthy"] and tier["stuck"]
                    c.clear(tier="storage")  # owed: the master does not answer
                    assert _tier(c)["clear_owed"]
            finally:
                store.stop_master(False)
            wait_until(lambda: _tier(c)["healthy"], 40, "the tier back once the late call returned")
            assert c.lookup(keys) == (0, 0) and not _tier(c)["clear_owed"]
            offload_and_flush(c, kv, kept, list(range(4, 8)))  # it stores and serves again
            c.clear(tier="host")
            assert c.lookup(kept) == (0, 4)
    finally:
        store.stop_master(False)
        h.stop()


@pytest.mark.faults
def test_a_backup_the_stopped_master_holds_keeps_its_pages_until_it_returns(run_dir, instance, store):
    """A backup's put to a master that stops answering once it began is late (past its 5 s);
    its host pages stay on loan meanwhile: a host clear and new offloads do not reuse them. Once
    the master answers, the put ends and stores the bytes offloaded, which load byte-exact (with
    the pages reused meanwhile, the record's checksum fails: a miss)."""
    kv = small_kv(block_shape=PAGE_SHAPE, seed=8)
    keys, later, src = keys_for(4, 79), keys_for(8, 80), list(range(4))
    expected = snapshot(kv, src)
    # page_first: the put reads the host pages themselves (layer_first stages them); the put
    # begins well before the probe's call to the stopped master is late (2 s)
    h = start(run_dir, instance, _uri(store) + "&io_timeout_s=2", extra=["--host-layout", "page_first"])
    try:
        with h.connect(timeout=10) as c, h.connect(timeout=1.5) as other:
            c.register_kv_cache(kv)
            store.stop_master(True)
            try:
                with pings_answered(other):
                    c.offload(src, keys).wait(10)  # its backup's put waits on the master
                    wait_until(lambda: "a block write" in _tier(c)["last_error"], 20,
                               "the put to be late")
                    c.clear(tier="host")  # the entries go; their pages stay on loan
                    scramble(kv, 3)
                    c.offload(list(range(8)), later).wait(10)  # other bytes into the host tier
                    assert c.status()["host"]["pinned_blocks"] >= len(src)
            finally:
                store.stop_master(False)
            wait_until(lambda: _tier(c)["healthy"], 40, "the tier back once the late put returned")
            assert c.status()["host"]["pinned_blocks"] == 0
            c.clear(tier="host")
            assert c.lookup(keys) == (0, 4)  # the late put stored them
            assert c.load(keys, list(range(10, 14))).wait(10) == 4
            assert blocks_equal(kv, list(range(10, 14)), expected) and _tier(c)["corrupt"] == 0
    finally:
        store.stop_master(False)
        h.stop()


@pytest.mark.faults
def test_a_delete_the_stopped_master_missed_is_done_before_the_tier_serves_again(run_dir, instance, store):
    """SIGSTOP on the master, then a delete: the tier owes it (the deleted blocks were hits once
    the master answered again); once back, the probe removes them before the tier serves."""
    kv = small_kv(block_shape=PAGE_SHAPE, seed=6)
    keys = keys_for(4, 77)
    h = start(run_dir, instance, _uri(store))
    try:
        with h.connect(timeout=1.5) as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(4)))
            c.clear(tier="host")
            store.stop_master(True)
            try:
                assert c.lookup(keys) == (0, 0)  # stuck: the lookup's call is late
                c.delete(keys[:2])
                assert _tier(c)["deletes_owed"] == 2
            finally:
                store.stop_master(False)
            wait_until(lambda: _tier(c)["healthy"], 40, "the tier back, its deletes done")
            assert _tier(c)["deletes_owed"] == 0
            assert c.lookup(keys) == (0, 0) and c.lookup(keys[2:]) == (0, 2)
    finally:
        store.stop_master(False)
        h.stop()


@pytest.mark.faults
def test_a_daemon_started_before_its_master_runs_and_connects_when_it_comes(run_dir, instance, tmp_path):
    """No master yet: the daemon starts and answers (Mooncake's setup would hold the GIL and
    retry for ever: the daemon only calls it once a child process's setup connected), the tier
    is down with the reason; the master comes, and the tier connects and stores."""
    s = MooncakeStore(log_dir=str(tmp_path))
    s.kill_master()
    try:
        h = start(run_dir, instance, f"{s.uri}?segment_gb=0.0625&host=127.0.0.1")
        try:
            with h.connect(timeout=2.0) as c:
                assert c.ping() > 0
                tier = _tier(c)
                assert not tier["healthy"] and not tier["connected"] and "master" in tier["last_error"]
                kv = small_kv(block_shape=PAGE_SHAPE, seed=6)
                c.register_kv_cache(kv)
                s.start_master()
                wait_until(lambda: _tier(c)["healthy"], 30, "the tier connected")
                keys = keys_for(3, 76)
                offload_and_flush(c, kv, keys, [0, 1, 2])
                c.clear(tier="host")
                assert c.lookup(keys) == (0, 3)
        finally:
            h.stop()
    finally:
        s.close()


def test_the_probe_goes_on_after_the_stores_binding_raises(store):
    """The store's binding raising in a probe round (rather than answering an error code): the
    tier is down with the reason, and the probe goes on and finds it answering again. Before,
    the exception ended the probe thread: a tier down was never let serve again."""
    from kvcached.storage.mooncake_store import PROBE_EVERY_S, MooncakeBackend

    tier = MooncakeBackend(_uri(store))
    try:
        wait_until(tier.ready, 10, "connected")
        wait_until(tier.health, 10, "healthy")
        real, raised = tier._store, []

        class Raising:  # the binding, but its probe call raises once
            def __getattr__(self, name):
                return getattr(real, name)

            def batch_is_exist(self, keys):
                if not raised:
                    raised.append(1)
                    raise RuntimeError("the binding raised")
                return real.batch_is_exist(keys)

        tier._store = Raising()
        wait_until(lambda: raised and not tier.health(), 5 * PROBE_EVERY_S, "the tier down")
        assert "the binding raised" in tier.usage()["last_error"]
        wait_until(tier.health, 10 * PROBE_EVERY_S, "the tier healthy again")
    finally:
        tier.close()
