"""The key_events op's storage events (1.10): a local disk tier's changes of what it holds, each
with its tier, beside the host tier's, and which tiers hold the keys a reader asks about. The
ring's filter for host-only readers in process; the op against a real daemon with a real disk
tier (backups, a host clear, deletes, the disk's own evictions, a storage clear, a new
geometry, the disk's root gone a while)."""
import os

import pytest

from conftest import disk_uri, keys_for, small_kv, sweep_crashed, unique_instance, wait_until
from kvcached.server.metrics import StatusCollector
from kvcached.server.status_report import format_status
from kvcached.service.key_events import KeyEvents
from kvcached_client import launch
from kvcached_proto import ErrorCode
from kvcached_proto.errors import ProtocolError, RequestError


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def test_a_host_only_reader_skips_the_storage_events_and_moves_as_far():
    ev = KeyEvents(capacity=8)
    ev.host(_key(1), True)
    ev.storage(1, [_key(1), _key(2)], True)
    ev.host(_key(3), True)
    ev.storage(2, [_key(2)], False)
    assert ev.since(0, 10, storage=True) == ([_key(1), _key(1), _key(2), _key(3), _key(2)],
                                             b"\x01\x01\x01\x01\x00", b"\x00\x01\x01\x00\x02", 5, False, False)
    assert ev.since(0, 10) == ([_key(1), _key(3)], b"\x01\x01", b"\x00\x00", 5, False, False)
    assert ev.since(1, 2) == ([], b"", b"", 3, False, False)  # two storage events looked at: none given
    ev.voided(storage=True)  # event 6: a storage tier cleared (or stopped answering)
    ev.host(_key(4), True)
    ev.storage(1, [_key(4)], True)
    # a storage gap for the storage readers that pass it: the storage events before it are
    # left out, the host's stand
    assert ev.since(3, 10, storage=True) == ([_key(3), _key(4), _key(4)], b"\x01\x01\x01",
                                             b"\x00\x00\x01", 8, False, True)
    assert ev.since(3, 2, storage=True) == ([_key(3)], b"\x01", b"\x00", 5, False, False)  # not yet
    assert ev.since(5, 10, storage=True) == ([_key(4), _key(4)], b"\x01\x01", b"\x00\x01", 8, False, True)
    assert ev.since(6, 10, storage=True) == ([_key(4), _key(4)], b"\x01\x01", b"\x00\x01", 8, False, False)
    # nothing for the host-only ones
    assert ev.since(3, 10) == ([_key(3), _key(4)], b"\x01\x01", b"\x00\x00", 8, False, False)
    ev.voided()  # a new geometry: a gap for every reader
    assert ev.since(8, 10)[4:] == (True, False) and ev.since(8, 10, storage=True)[4:] == (True, False)


def _split(page) -> tuple[list, list]:
    host = [(k, on) for k, on, t in page.events if t == 0]
    disk = [(k, on) for k, on, t in page.events if t == 1]
    assert len(host) + len(disk) == len(page.events), page.events
    return host, disk


def test_disk_changes_are_told_with_their_tier_and_asked_keys_say_where_they_are(run_dir, tmp_path):
    name = unique_instance("kes")
    uri = disk_uri(str(tmp_path / "disk"), 0.003)  # 256 KiB blocks: 11 of them
    d = launch(instance=name, run_dir=run_dir, host_cache_gb=0.01, extra_args=["--storage", uri],
               wait_storage=True)
    try:
        with d.connect() as c:
            kv = small_kv(num_layers=4, num_blocks=64, block_shape=(16, 8, 128))
            c.register_kv_cache(kv)
            start = c.tier_events(0, 0)
            assert start.events == [] and start.tiers == [uri] and start.held == []
            with pytest.raises(RequestError) as e:  # a frame's cost is bounded
                c.tier_events(0, 0, ask=[bytes(16)] * 4097)
            assert e.value.code == ErrorCode.TOO_MANY_ITEMS
            first = keys_for(8, 1)
            c.offload(range(8), first).wait(10)
            c.flush().wait(10)
            page = c.tier_events(start.newest)
            host, disk = _split(page)
            assert host == [(k, True) for k in first] and sorted(disk) == sorted((k, True) for k in first)
            assert not page.gap and page.last == page.newest == start.newest + 16
            # a host-only reader (protocol 1.9's) gets the host events alone, and moves as far
            events, last, gap, _ = c.key_events(start.newest)
            assert events == [(k, True) for k in first] and last == page.last and not gap
            other = keys_for(2, 9)
            asked = c.tier_events(page.last, ask=first[:2] + other)
            assert asked.events == [] and asked.held == [3, 3, 0, 0]  # host and disk; nowhere
            c.clear(tier="host")
            page = c.tier_events(asked.last, ask=first[:2])
            host, disk = _split(page)
            assert sorted(host) == sorted((k, False) for k in first) and disk == [] and page.held == [2, 2]
            c.delete(first[6:])
            page = c.tier_events(page.last, ask=first[6:])
            host, disk = _split(page)
            assert host == [] and sorted(disk) == sorted((k, False) for k in first[6:]) and page.held == [0, 0]
            # the disk drops its oldest past its capacity: each key dropped is told
            more = keys_for(12, 3)
            c.offload(range(8, 20), more).wait(10)
            c.flush().wait(10)
            page = c.tier_events(page.last, limit=65536)
            _, disk = _split(page)
            now = {}
            for k, on in disk:
                now[k] = on
            dropped = [k for k, on in now.items() if not on]
            assert dropped and set(dropped) <= set(first[:6]) | set(more), disk
            check = c.tier_events(page.last, ask=dropped + more[-2:])
            assert [h & 2 for h in check.held] == [0] * len(dropped) + [2, 2]
            caught_up = check.last
            # a clear of the disk: a storage gap for a reader caught up, and nothing it held is
            # told; a host-only reader lost nothing
            c.clear(tier="storage")
            page = c.tier_events(caught_up, ask=more[-2:])
            assert page.storage_gap and not page.gap and page.events == []
            assert [h & 2 for h in page.held] == [0, 0]
            assert c.key_events(caught_up)[1:3] == (page.last, False)
            c.offload(range(20, 24), keys_for(4, 4)).wait(10)
            c.flush().wait(10)
            caught_up = c.tier_events(page.last).last
            # another geometry: a gap, and the disk's index told to the new key table is no event
            c.register_kv_cache(small_kv(num_layers=2, num_blocks=64, block_shape=(16, 8, 128)))
            page = c.tier_events(caught_up)
            assert page.gap and not page.storage_gap and page.events == []
    finally:
        d.stop()
        sweep_crashed(name)


def test_a_disk_that_stops_answering_is_a_storage_gap_and_holds_nothing_until_it_answers_again(run_dir, tmp_path):
    """The disk's root moved away (a volume unmounted, then mounted again): its blocks cannot be
    loaded meanwhile, unheard by its index. A storage reader is told a storage gap and the disk
    holds none of them; once the root is back, a storage gap again and the disk holds them all.
    A host-only reader sees nothing."""
    name = unique_instance("kea")
    root = str(tmp_path / "disk")
    uri = disk_uri(root, 0.05)
    d = launch(instance=name, run_dir=run_dir, host_cache_gb=0.01, extra_args=["--storage", uri],
               wait_storage=True)
    try:
        with d.connect() as c:
            c.register_kv_cache(small_kv(num_layers=4, num_blocks=64, block_shape=(16, 8, 128)))
            assert c.tier_events(0, 0).newest == 0  # followed from here on
            keys = keys_for(4, 21)
            c.offload(range(4), keys).wait(10)
            c.flush().wait(10)
            page = c.tier_events(0, limit=65536, ask=keys)
            assert page.last == 8 and [h & 2 for h in page.held] == [2] * 4
            os.rename(root, root + ".away")
            try:
                wait_until(lambda: c.tier_events(page.last).storage_gap, 10, "the disk's loss told")
                away = c.tier_events(page.last, ask=keys)
                assert not away.gap and away.held == [1] * 4  # the host's copies stand
                events, _, gap, _ = c.key_events(page.last)
                assert not gap and events == []
            finally:
                os.rename(root + ".away", root)
            wait_until(lambda: c.tier_events(away.last).storage_gap, 10, "the disk's return told")
            back = c.tier_events(away.last, ask=keys)
            assert [h & 2 for h in back.held] == [2] * 4
            assert not c.tier_events(back.last).storage_gap  # told once
            # operators see them (kvcached status)
            status = c.status()
            assert status["key_events"]["followed"] and status["key_events"]["voids"] == {"host": 0, "storage": 2}
            assert "2 for storage readers" in format_status(status)
            gaps = {s.labels["readers"]: s.value for f in StatusCollector("t", lambda: status).collect()
                    if f.name == "kvcached_key_event_gaps" for s in f.samples}
            assert gaps == {"all": 0, "storage": 2}  # (Prometheus, --metrics-port)
    finally:
        d.stop()
        sweep_crashed(name)


def test_a_daemon_older_than_1_10_is_not_asked_for_storage_events(run_dir):
    name = unique_instance("keo")
    d = launch(instance=name, run_dir=run_dir, host_cache_gb=0.01)
    try:
        with d.connect() as c:
            c.info["protocol_version"] = [1, 9]
            try:
                c.tier_events(0, 0)
            except ProtocolError as exc:
                assert exc.code == ErrorCode.UNKNOWN_OP
            else:
                raise AssertionError("a 1.9 daemon was asked for storage events")
            assert c.key_events(0, 0) == ([], 0, False, 0)
    finally:
        d.stop()
        sweep_crashed(name)


def test_a_disk_is_followed_when_the_key_table_cannot_be_made(tmp_path, monkeypatch, instance):
    """The key table's segment cannot be made (clients then send their lookups): the disk's
    changes still reach the key events, as the engine's keys. Before, no table meant no watch,
    and the events missed every disk change."""
    from types import SimpleNamespace

    import posix_ipc

    from kvcached.service import key_publisher
    from kvcached.storage.disk import DiskBackend
    from kvcached.storage.record import stored_key

    disk = DiskBackend(str(tmp_path / "disk"), 1 << 30)
    publisher = None
    try:
        assert disk.indexed.wait(10)

        def cannot(*_a, **_k):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(key_publisher.posix_ipc, "SharedMemory", cannot)
        publisher = key_publisher.KeyPublisher(instance, 7, SimpleNamespace(backends=[disk]))
        heard = []
        publisher.listen(lambda n, keys, on: heard.append((n, keys, on)), lambda n: heard.append(n))
        geometry = bytes(range(16))
        publisher.rebuild(16, geometry, 4096)
        assert publisher.status()["segment"] is None
        monkeypatch.setattr(key_publisher.posix_ipc, "SharedMemory", posix_ipc.SharedMemory)
        key = b"\x05" * 16
        assert disk.put([stored_key(key, geometry)], [[memoryview(bytes(4096))]], geometry) == [True]
        assert heard == [(1, [key], True)]
        assert publisher.local_holds([key, b"\x06" * 16]) == [2, 0]
    finally:
        if publisher is not None:
            publisher.close()
        disk.close()
