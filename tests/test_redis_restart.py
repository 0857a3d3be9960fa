"""A Redis server that restarts from its snapshot, with real redis-server processes on loopback:
the deletes done after the snapshot come back with it, and the tier does them again before it
serves (redis_restarts.py). The probe runs here only when a test calls it."""
import logging
import os
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import RedisServer, blocks_equal, free_port, keys_for, scramble, small_kv, snapshot, wait_until
from redis_cluster import cluster, cluster_ok
from storage_util import PAGE_SHAPE, offload_and_flush, start


def _tier(monkeypatch, uri: str):
    """The tier, its probe run by the test alone, the failover window (REDO_WINDOW_S) cut to
    0.2 s: what a test sees kept past it is kept for a restart."""
    from kvcached.storage import redis_restarts, redis_store

    monkeypatch.setattr(redis_store, "PROBE_EVERY_S", 3600.0)
    monkeypatch.setattr(redis_restarts, "REDO_WINDOW_S", 0.2)
    return redis_store.RedisBackend(uri)


def _put(tier, n: int):
    """n blocks of random bytes put in the tier: (their keys, their names in the store,
    read(indices) -> which came back, each checked to be the bytes put)."""
    keys, geometry = [bytes([i]) * 16 for i in range(n)], os.urandom(16)
    pages = [bytearray(os.urandom(4096)) for _ in keys]
    assert tier.put(keys, [[memoryview(p)] for p in pages], geometry) == [True] * n

    def read(which) -> list:
        into = [bytearray(4096) for _ in which]
        got = tier.get_into([keys[i] for i in which], [[memoryview(b)] for b in into], geometry)
        assert [b == pages[i] for b, i in zip(into, which)] == got  # (read: what was put)
        return got
    return keys, [tier._name(k) for k in keys], read


@pytest.mark.faults
@pytest.mark.parametrize("first", ["lookup", "read"])
def test_the_deletes_a_restart_undid_are_done_again_before_the_tier_serves(monkeypatch, caplog, first):
    """Six blocks stored and snapshotted (SAVE); one deleted before a second snapshot, four after
    it. The server is killed and started again: it loads the second snapshot, so the four are
    back. The first lookup (or worker's read) after the restart reconnects, finds another
    run_id and serves nothing (it found the four before); the tier is down until its probe has
    deleted the four again. The one deleted before the snapshot is not owed again; the
    block never deleted is kept and reads back byte-exact."""
    server = RedisServer()
    tier = _tier(monkeypatch, server.uri)
    try:
        keys, names, read = _put(tier, 6)
        assert read(range(6)) == [True] * 6
        server.client().save()
        tier._probe_once()
        assert tier.delete(keys[5:]) == 1  # before the snapshot, and before a probe round
        time.sleep(1.1)  # ahead of it by more than the 1 s a save's whole-second times may hide
        tier._probe_once()
        server.client().save()
        tier._probe_once()  # the save seen: what was done before the last round is in it
        assert tier.delete(keys[:4]) == 4  # after it: not in it
        assert tier.exists_prefix(keys[:4]) == 0 and tier.health()
        server.proc.kill()
        server.proc.wait(10)
        server.start()
        assert server.client().exists(*names[:4]) == 4 and server.client().exists(names[5]) == 0
        if first == "lookup":
            assert tier.exists_prefix(keys[:4]) == 0, "a deleted block found after the restart"
        else:
            assert read(range(4)) == [False] * 4, "a deleted block read after the restart"
        assert not tier.health() and tier.usage()["restarts"] == 1
        assert tier.exists_prefix(keys[:4]) == 0 and read(range(4)) == [False] * 4
        with caplog.at_level(logging.WARNING, logger="kvcached.storage"):
            tier._probe_once()  # the deletes done again, then the tier serves
        assert tier.health() and server.client().exists(*names[:4]) == 0
        assert "4 deletes done or owed before the failover are owed" in caplog.text
        assert tier.exists_prefix(keys[4:5]) == 1 and read([4]) == [True]
        assert tier.usage()["restarts"] == 1 and tier.usage()["failovers"] == 0
    finally:
        tier.close()
        server.close()


@pytest.mark.faults
def test_a_restart_without_a_snapshot_since_the_deletes_owes_them_all(monkeypatch):
    """No save seen since the tier started: every delete it did may be undone by a restart (the
    server's snapshot predates them all), and each is done again, past the failover window."""
    server = RedisServer()
    keys = [bytes([i]) * 16 for i in range(3)]
    tier = _tier(monkeypatch, server.uri)
    try:
        names = [tier._name(k) for k in keys]
        server.client().mset({n: b"x" for n in names})
        server.client().save()  # (before the tier's first probe round saw any save: no mark)
        assert tier.delete(keys) == 3
        time.sleep(1.0)  # past the failover window: kept for the restart alone
        server.stop()
        server.start()
        assert server.client().exists(*names) == 3
        assert tier.exists_prefix(keys) == 0 and not tier.health()
        tier._probe_once()
        assert tier.health() and server.client().exists(*names) == 0
    finally:
        tier.close()
        server.close()


@pytest.mark.faults
def test_a_user_refused_info_is_told_once_and_the_tier_serves(monkeypatch, caplog, tmp_path):
    """An ACL user without INFO (what a restart is read from): the tier says once that restarts
    are not followed, its probe pings, it stays up and serves."""
    from kvcached.storage import redis_restarts
    from kvcached.storage.owed_clear import OwedRecord

    server = RedisServer()
    server.client().execute_command("ACL", "SETUSER", "kv", "on", ">kv-pw", "~*", "&*", "+@all", "-info")
    caplog.set_level(logging.WARNING, logger="kvcached.storage.redis_store")
    tier = _tier(monkeypatch, f"redis://kv:kv-pw@127.0.0.1:{server.port}/0")
    try:
        for _ in range(3):
            tier._probe_once()
        keys = [bytes([i]) * 16 for i in range(2)]
        server.client().mset({tier._name(k): b"x" for k in keys})
        assert tier.health() and tier.exists_prefix(keys) == 2, tier.last_error
        assert sum("INFO refused" in r.message for r in caplog.records) == 1
        # what a last daemon did an hour ago is not kept longer than the failover window: a
        # restart is not followed here
        record = OwedRecord(str(tmp_path / "t.clears-owed"))
        record.note_state(tier.store_id, lambda: {"done": [[time.time() - 3600, [keys[0].hex()]]]})
        tier.owe_clear(OwedRecord(record.path))
        now = time.monotonic()
        assert tier._keep_since(now) == now - redis_restarts.REDO_WINDOW_S
    finally:
        tier.close()
        server.close()


@pytest.mark.faults
def test_through_a_daemon_the_deleted_blocks_stay_gone_and_the_restart_is_counted(run_dir, instance):
    """A daemon's blocks backed up and snapshotted, two of them deleted, the server killed and
    started again (the two back in it): once the tier is healthy again the two are misses, the
    other two load byte-exact, and status and metrics count one restart."""
    server = RedisServer()
    metrics_port = free_port()
    h = start(run_dir, instance, server.uri, extra=["--metrics-port", str(metrics_port)])
    try:
        kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=16, seed=17)
        keys = keys_for(4, 50)
        expected = snapshot(kv, [2, 3])  # (the blocks kept)
        with h.connect(timeout=2.0) as c:
            c.register_kv_cache(kv)
            offload_and_flush(c, kv, keys, list(range(4)))
            server.client().save()
            c.delete(keys[:2])
            server.proc.kill()
            server.proc.wait(10)
            server.start()
            assert server.client().dbsize() == 4  # (the two deleted are back)
            wait_until(lambda: c.status()["storage"][0]["restarts"] == 1 and c.status()["storage"][0]["healthy"],
                       10, "the restart seen and its deletes done again")
            assert server.client().dbsize() == 2
            c.clear(tier="host")
            assert c.lookup(keys[:2]) == (0, 0) and c.lookup(keys[2:]) == (0, 2)
            scramble(kv, 6)
            assert c.load(keys[2:], [8, 9]).wait(10) == 2
            assert blocks_equal(kv, [8, 9], expected)
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
                body = r.read().decode()
            (family,) = [f for f in text_string_to_metric_families(body) if f.name == "kvcached_storage_restarts"]
            assert [x.value for x in family.samples if x.name.endswith("_total")] == [1.0]
    finally:
        h.stop()
        server.close()


@pytest.mark.faults
def test_a_failover_redoes_its_window_alone_not_what_a_restart_would(monkeypatch):
    """A server that never saves keeps every delete the tier did owed to a restart; a failover
    (here noted as the sentinels' would be) redoes only the failover window: deletes older than
    it, their keys stored again since, are not done again (a clear done days ago is not owed at
    every failover)."""
    from kvcached.storage import owed_clear

    monkeypatch.setattr(owed_clear, "REDO_WINDOW_S", 0.2)
    server = RedisServer()
    tier = _tier(monkeypatch, server.uri)
    try:
        keys = [bytes([i]) * 16 for i in range(3)]
        names = [tier._name(k) for k in keys]
        server.client().mset({n: b"x" for n in names})
        assert tier.delete(keys) == 3
        time.sleep(1.0)  # past the failover window
        server.client().mset({n: b"x" for n in names})  # stored again since
        with tier._primary_lock:
            tier._note_change("a failover, as the sentinels would name one")
        assert not tier.health() and tier.exists_prefix(keys) == 0  # (pending until the probe)
        tier._probe_once()
        assert tier.health() and tier.exists_prefix(keys) == 3
        assert server.client().exists(*names) == 3 and tier.usage()["deletes_owed"] == 0
    finally:
        tier.close()
        server.close()


@pytest.mark.faults
@pytest.mark.parametrize("first", ["lookup", "read", "probe"])
def test_a_cluster_primary_restarted_in_place_has_its_undone_deletes_done_again(monkeypatch, first):
    """A cluster of three primaries without replicas (nothing fails over): blocks stored on every
    node, each node snapshotted, then blocks on every node deleted. One primary is killed and
    started again from its snapshot: its deleted blocks are back. No lookup (or worker's read)
    serves them: a connection to the node finds another run_id; the tier is down until its
    probe has deleted them again. A probe round that meets the node first (no call did) reads
    its run_id and redoes the deletes. The blocks never deleted read back byte-exact."""
    import redis.cluster

    with cluster(replicas=0) as (ports, nodes, uri):
        tier = _tier(monkeypatch, uri)
        direct = redis.cluster.RedisCluster(host="127.0.0.1", port=ports[0])
        try:
            keys, names, read = _put(tier, 24)
            tier._probe_once()
            time.sleep(1.1)  # (a save's whole-second times)
            for n in nodes:
                n.client().save()
            tier._probe_once()  # the saves seen: what was done before the last round is in them
            gone, kept = list(range(0, 24, 2)), list(range(1, 24, 2))
            assert tier.delete([keys[i] for i in gone]) == len(gone)
            port = {n.port: n for n in nodes}
            node_of = {i: direct.get_node_from_key(names[i]).port for i in range(24)}
            victim = port[node_of[gone[0]]]
            back = [i for i in gone if node_of[i] == victim.port]
            assert len(back) < len(gone), "the deleted blocks lie on one node only"
            victim.proc.kill()
            victim.proc.wait(10)
            victim.start()
            wait_until(lambda: all(cluster_ok(p) for p in ports), 20, "the cluster whole again")
            on_victim = victim.client()
            assert sum(on_victim.exists(names[i]) for i in back) == len(back)  # (back in it)
            assert tier.usage()["restarts"] == 0
            if first == "probe":  # no call meets the node first: the probe's round reads it
                for _ in range(3):  # (its own connection to the node may see it first: one
                    tier._probe_once()  # round down, the next redoes)
                    if tier.health():
                        break
            for _ in range(3):  # the first may meet the dropped connection; none serves them
                if first == "lookup":
                    assert all(tier.exists_prefix([keys[i]]) == 0 for i in back), "a deleted block found"
                elif first == "read":
                    assert read(back) == [False] * len(back), "a deleted block read"
            assert tier.usage()["restarts"] == 1 and tier.health() == (first == "probe")
            tier._probe_once()  # the deletes done again, then the tier serves
            assert tier.health() and sum(on_victim.exists(names[i]) for i in back) == 0
            assert tier.exists_prefix([keys[i] for i in gone]) == 0
            assert all(tier.exists_prefix([keys[i]]) == 1 for i in kept) and read(kept) == [True] * len(kept)
            assert tier.usage()["restarts"] == 1 and tier.usage()["failovers"] == 0
        finally:
            direct.close()
            tier.close()


@pytest.mark.faults
def test_a_restart_while_no_daemon_followed_the_server_is_seen_by_the_next_one(run_dir, instance):
    """A daemon backs up four blocks, the server snapshots, two are deleted, the daemon stops.
    The server restarts from its snapshot while no daemon runs (the two come back). The next
    daemon finds another run_id than the one its predecessor kept on record: the two are
    deleted again before the tier serves, the other two load byte-exact. Before, it took the
    new run_id as the first it saw and served the two."""
    server = RedisServer()
    kv = small_kv(block_shape=PAGE_SHAPE, num_blocks=16, seed=19)
    keys = keys_for(4, 51)
    expected = snapshot(kv, [2, 3])
    try:
        h = start(run_dir, instance, server.uri)
        try:
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                offload_and_flush(c, kv, keys, list(range(4)))
                server.client().save()
                c.delete(keys[:2])
                assert server.client().dbsize() == 2
        finally:
            h.stop()
        server.proc.kill()
        server.proc.wait(10)
        server.start()
        assert server.client().dbsize() == 4  # (the two deleted are back)
        h = start(run_dir, instance, server.uri)
        try:
            with h.connect(timeout=2.0) as c:
                c.register_kv_cache(kv)
                wait_until(lambda: c.status()["storage"][0]["healthy"], 10, "the tier healthy")
                assert c.lookup(keys[:2]) == (0, 0) and server.client().dbsize() == 2
                assert c.status()["storage"][0]["restarts"] == 1
                assert c.lookup(keys[2:]) == (0, 2)
                scramble(kv, 7)
                assert c.load(keys[2:], [8, 9]).wait(10) == 2
                assert blocks_equal(kv, [8, 9], expected)
        finally:
            h.stop()
    finally:
        server.close()


@pytest.mark.faults
def test_a_change_found_before_the_first_round_after_a_start_reaches_back_over_what_was_kept(
        monkeypatch, tmp_path):
    """A daemon starts with the deletes its predecessor did kept on record (older than the
    failover window); a change found before its probe's first round that compares (a sentinel
    that did not answer at start names another primary once it does) may have come while no
    daemon ran: its redo reaches back over them, not the window alone."""
    from kvcached.storage import owed_clear
    from kvcached.storage.owed_clear import OwedRecord

    monkeypatch.setattr(owed_clear, "REDO_WINDOW_S", 0.2)
    server = RedisServer()
    path = str(tmp_path / "t.clears-owed")
    keys = [bytes([i]) * 16 for i in range(3)]
    tier = _tier(monkeypatch, server.uri)
    try:
        tier.owe_clear(OwedRecord(path))
        names = [tier._name(k) for k in keys]
        server.client().mset({n: b"x" for n in names})
        assert tier.delete(keys) == 3
    finally:
        tier.close()
    time.sleep(1.0)  # past the failover window
    server.client().mset({n: b"x" for n in names})  # (undone)
    tier = _tier(monkeypatch, server.uri)
    try:
        tier.owe_clear(OwedRecord(path))
        assert tier.usage()["restarts"] == 0  # (the same run_id)
        with tier._primary_lock:
            tier._note_change("a failover, as the sentinels would name one")
        tier._probe_once()
        assert tier.health() and server.client().exists(*names) == 0
    finally:
        tier.close()
        server.close()


@pytest.mark.faults
def test_a_save_found_after_a_round_that_missed_its_node_dates_from_the_nodes_own_reading(monkeypatch, caplog):
    """A cluster primary snapshots, then its blocks are deleted. The probe's next round cannot
    read that node (its INFO fails; the test's one seam) and reads the others, which save after
    the deletes. When the node answers again its save is found done: taken any time since the
    node's own last reading (before the deletes), not since the round that missed it. So the
    deletes stay kept, and when the node restarts from that snapshot they are done again.
    Dated from the round that missed the node, they counted as saved, and the deleted blocks
    came back and were served."""
    import redis
    import redis.cluster

    with cluster(replicas=0) as (ports, nodes, uri):
        tier = _tier(monkeypatch, uri)
        direct = redis.cluster.RedisCluster(host="127.0.0.1", port=ports[0])
        try:
            keys, names, read = _put(tier, 24)
            tier._probe_once()  # every node's last save read
            port = {n.port: n for n in nodes}
            node_of = {i: direct.get_node_from_key(names[i]).port for i in range(24)}
            victim = port[node_of[0]]
            on = [i for i in range(24) if node_of[i] == victim.port]
            time.sleep(1.1)  # (a save's whole-second times)
            victim.client().save()  # what it restarts from: before the deletes
            time.sleep(1.1)
            assert tier.delete([keys[i] for i in on]) == len(on)
            time.sleep(1.5)
            real_info = tier._probe_client.info

            def info(*args, target_nodes=None, **kw):
                if target_nodes is not None and target_nodes.port == victim.port:
                    raise redis.ConnectionError("(the test) no answer")
                return real_info(*args, target_nodes=target_nodes, **kw)
            monkeypatch.setattr(tier._probe_client, "info", info)
            with caplog.at_level(logging.WARNING, logger="kvcached.storage"):
                tier._probe_once()  # the node missed
            assert f":{victim.port} does not answer the probe" in caplog.text
            monkeypatch.setattr(tier._probe_client, "info", real_info)
            for n in nodes:
                if n is not victim:
                    n.client().save()  # after the deletes
            tier._probe_once()  # their saves and the node's found
            assert tier.health() and tier.usage()["restarts"] == 0
            victim.proc.kill()
            victim.proc.wait(10)
            victim.start()
            wait_until(lambda: all(cluster_ok(p) for p in ports), 20, "the cluster whole again")
            assert sum(victim.client().exists(names[i]) for i in on) == len(on)  # (back in it)
            for _ in range(3):  # (the probe's own connection may see the restart first: one
                tier._probe_once()  # round down, the next redoes)
                if tier.health():
                    break
            assert tier.usage()["restarts"] == 1
            assert all(tier.exists_prefix([keys[i]]) == 0 for i in on), "a deleted block found"
            assert read(on) == [False] * len(on) and sum(victim.client().exists(names[i]) for i in on) == 0
            kept = [i for i in range(24) if i not in on]
            assert read(kept) == [True] * len(kept)  # the control: the others read back byte-exact
        finally:
            direct.close()
            tier.close()
