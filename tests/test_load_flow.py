"""The load, offload and storage flows in process, without a daemon: the real host tier, task
table and transfer workers (threads), a fake storage backend (a dict that can hold its reads
behind a gate or fail them) and a fake copier that records each layer's copy and moves the host
pages into a dict of device blocks, so what a load served is checked byte for byte."""
from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import keys_for, small_kv, wait_until
from kvcached.config import DaemonConfig
from kvcached.copy.transfer import CopyPlan
from kvcached.service.cache_service import CacheService
from kvcached.service.host_tier import HostTier
from kvcached.service.load_flow import LoadFlow
from kvcached.service.offload_flow import OffloadFlow
from kvcached.service.report import check_service
from kvcached.service.registration import Registered
from kvcached.service.task_table import TaskTable
from kvcached.storage.base import StorageBackend
from kvcached_client.kv_alloc import describe_kv_cache
from kvcached_proto import TaskStatus
from kvcached_proto.layout import parse_layout


class StatusBlock:
    """The status block's calls the flows make, recorded."""

    def __init__(self):
        self.layers: dict[int, int] = {}

    def set_flag(self, flag, on=True):
        pass

    def slot_begin(self, slot, task_id, num_layers):
        self.layers[slot] = 0

    def slot_set_valid(self, slot, n):
        pass

    def slot_layer_done(self, slot, n):
        self.layers[slot] = n

    def slot_finish(self, slot, status, loaded):
        pass


class Events:
    def __init__(self):
        self.ended: queue.Queue = queue.Queue()

    def emit(self, routing_id, event):
        self.ended.put(event)

    def wait(self, n: int) -> dict[int, dict]:
        out = {}
        for _ in range(n):
            event = self.ended.get(timeout=10)
            out[event["task"]] = event
        return out


class DictStore(StorageBackend):
    """A storage backend in a dict: reads may wait behind `gate`, or fail with `fail`."""

    uri = "dict://"

    def __init__(self):
        self.pages: dict[bytes, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None
        self.vanish: set[bytes] = set()  # records gone between the lookup and the read
        self.reads = 0
        self.put_gate, self.putting = threading.Event(), threading.Event()  # writes may wait too
        self.put_gate.set()
        self.put_answer = True  # None: each write lands but answers late (it returns at once)

    def exists_prefix(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def get_into(self, keys, pages, geometry, release=None):
        assert self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        for key in self.vanish:
            self.pages.pop(key, None)
        out = []
        for key, pieces in zip(keys, pages):
            data = self.pages.get(key)
            if data is not None:
                self.reads += 1
                _write_pieces(pieces, data)
            out.append(data is not None)
        return out

    def put(self, keys, pages, geometry, release=None):
        self.putting.set()
        assert self.put_gate.wait(10)
        for key, pieces in zip(keys, pages):
            self.pages[key] = b"".join(bytes(p) for p in pieces)
        if self.put_answer is None and release is not None:
            for i in range(len(keys)):
                release(i)  # the late write returned
        return [self.put_answer] * len(keys)

    def delete(self, keys):
        return sum(self.pages.pop(k, None) is not None for k in keys)

    def clear(self):
        n = len(self.pages)
        self.pages.clear()
        return n

    def health(self):
        return True

    def usage(self):
        return {"used_bytes": 0, "capacity_bytes": 0, "blocks": len(self.pages)}


def _write_pieces(pieces, data: bytes) -> None:
    at = 0
    for p in pieces:
        p[:] = data[at : at + len(p)]
        at += len(p)


class DictCopier:
    """A copier whose device is a dict of block -> page bytes; records (kind, layer, dev, host)."""

    strategy = "dict"

    def __init__(self, pool):
        self.pool, self.device, self.calls = pool, {}, []

    def plan(self, kind, dev_ids, host_ids):
        return CopyPlan.make(np.asarray(dev_ids), np.asarray(host_ids))

    def begin_load(self, task):
        pass

    def begin_offload(self, task):
        pass

    def load_layer(self, layer, plan):
        self.calls.append(("load", layer, list(plan.dev_ids), list(plan.host_ids)))
        if layer == 0:
            for d, h in zip(plan.dev_ids, plan.host_ids):
                self.device[int(d)] = b"".join(bytes(p) for p in self.pool.page_pieces(int(h)))
        return len(plan.dev_ids)

    def offload_layer(self, layer, plan):
        self.calls.append(("offload", layer, list(plan.dev_ids), list(plan.host_ids)))
        if layer == 0:
            for d, h in zip(plan.dev_ids, plan.host_ids):
                _write_pieces(self.pool.page_pieces(int(h)), self.device[int(d)])
        return len(plan.dev_ids)

    def layer_loaded(self, task, layer):
        pass

    def sync(self, kind):
        pass

    def close(self):
        pass


class FakeKV:
    def __init__(self, spec):
        self.spec, self.lost, self.order, self.owner, self.retired = spec, None, None, "engine", None


class Req:
    def __init__(self, **body):
        self.body = {"priority": 0, "host_only": False, **body}


class Client:
    client_id, routing_id = "engine", b"engine"


@pytest.fixture(scope="module")
def spec():
    kv = small_kv(num_layers=3, num_blocks=32, block_shape=(16, 2, 8))
    return parse_layout(describe_kv_cache(kv))


@pytest.fixture
def flows(spec):
    cfg = DaemonConfig(host_cache_gb=0.001)
    host = HostTier(cfg)
    host.pool.configure(spec)
    events, status = Events(), StatusBlock()
    table = TaskTable(host.lock, status, events)
    reg = Registered()
    copier = DictCopier(host.pool)
    reg.put(Client.client_id, FakeKV(spec), copier)
    hits = {"loaded_from_host": 0, "loaded_from_storage": 0}
    loads = LoadFlow(cfg, host, table, status, reg, hits)
    store = DictStore()
    loads.storage.tiers.backends.append(store)
    offloads = OffloadFlow(host, table, reg, loads)
    yield loads, offloads, store, copier, events, hits
    for w in (loads.worker, offloads.worker, loads.storage.fetcher):
        w.stop()
    loads.storage.backer.stop(timeout=10)
    host.pool.close()


def _page(spec, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, spec.page_bytes, dtype=np.uint8).tobytes()


def _offload(offloads, events, copier, keys, blocks, spec, seed=0):
    for i, b in enumerate(blocks):
        copier.device[b] = _page(spec, seed + i)
    reply = offloads.start(Client(), Req(keys=keys), np.array(blocks), None)
    assert events.wait(1)[reply["task"]]["status"] == TaskStatus.DONE
    return {b: copier.device[b] for b in blocks}


def _stored(store, loads, keys, pages) -> None:
    from kvcached.storage.record import StoredKeys

    stored = StoredKeys(keys, loads.storage.host.pool.geometry)
    for i, page in enumerate(pages):
        store.pages[stored[i]] = page


def _no_pins(loads) -> None:
    """No task holds a pin or is parked. The offloads' backups (write_through to the DictStore)
    pin their blocks until stored, on the backup thread: waited for, bounded (a pin a task
    leaked never drops)."""
    def pinned() -> int:
        with loads.host.lock:
            return loads.host.index.pinned
    wait_until(lambda: pinned() == 0, 10, "the pins' release")
    with loads.host.lock:
        assert loads.parked == []


def test_a_load_takes_its_host_prefix_and_fetches_the_rest_byte_for_byte(flows, spec):
    loads, offloads, store, copier, events, hits = flows
    keys = keys_for(6, seed=1)
    host_pages = _offload(offloads, events, copier, keys[:2], [0, 1], spec)
    pages = [_page(spec, 100 + i) for i in range(4)]
    _stored(store, loads, keys[2:], pages)
    reply = loads.start(Client(), Req(keys=keys), np.arange(10, 16), None)
    assert (reply["host_blocks"], reply["storage_blocks"], reply["num_layers"]) == (2, 4, 3)
    assert events.wait(1)[reply["task"]]["result"]["loaded"] == 6
    assert [copier.device[10 + i] for i in range(6)] == [host_pages[0], host_pages[1], *pages]
    assert [c[1] for c in copier.calls if c[0] == "load"] == [0, 1, 2]  # layer by layer
    assert hits == {"loaded_from_host": 2, "loaded_from_storage": 4}
    assert store.reads == 4
    _no_pins(loads)


def test_two_loads_racing_for_one_fetch_share_it(flows, spec):
    loads, _, store, copier, events, _ = flows
    keys = keys_for(4, seed=2)
    pages = [_page(spec, 200 + i) for i in range(4)]
    _stored(store, loads, keys, pages)
    store.gate.clear()  # the first load's fetch holds in the store
    first = loads.start(Client(), Req(keys=keys), np.arange(0, 4), None)
    second = loads.start(Client(), Req(keys=keys), np.arange(20, 24), None)
    assert loads.parked  # the second waits for the first's fetch, it does not fetch twice
    store.gate.set()
    ended = events.wait(2)
    assert [ended[r["task"]]["result"]["loaded"] for r in (first, second)] == [4, 4]
    assert store.reads == 4
    assert [copier.device[i] for i in range(4)] == pages == [copier.device[20 + i] for i in range(4)]
    _no_pins(loads)


def test_a_failed_fetch_fails_its_load_and_the_waiting_one_replans(flows, spec):
    loads, _, store, copier, events, _ = flows
    keys = keys_for(3, seed=3)
    _stored(store, loads, keys, [_page(spec, 300 + i) for i in range(3)])
    store.gate.clear()
    first = loads.start(Client(), Req(keys=keys), np.arange(0, 3), None)
    second = loads.start(Client(), Req(keys=keys), np.arange(5, 8), None)
    store.fail = OSError("the store went away")
    store.gate.set()
    ended = events.wait(2)
    assert ended[first["task"]]["status"] == TaskStatus.FAILED
    assert "the store went away" in ended[first["task"]]["result"]["error"]
    # the second's shared entries went with the failure: it planned again and its own fetch
    # failed too - never a load of blocks that did not arrive
    assert ended[second["task"]]["status"] == TaskStatus.FAILED
    assert not any(5 <= d < 8 for d in copier.device)
    _no_pins(loads)
    with loads.host.lock:
        assert len(loads.host.index) == 0  # no WRITING entry left behind


def test_a_short_read_loads_the_leading_blocks_only(flows, spec):
    loads, _, store, copier, events, _ = flows
    keys = keys_for(4, seed=4)
    pages = [_page(spec, 400 + i) for i in range(4)]
    _stored(store, loads, keys, pages)
    store.vanish = {next(k for k in store.pages if store.pages[k] == pages[2])}
    reply = loads.start(Client(), Req(keys=keys), np.arange(0, 4), None)
    assert reply["storage_blocks"] == 4  # planned while all four were there
    assert events.wait(1)[reply["task"]]["result"]["loaded"] == 2
    assert [copier.device[i] for i in range(2)] == pages[:2] and 2 not in copier.device
    _no_pins(loads)


def test_a_cancelled_parked_load_gives_back_its_pins(flows, spec):
    loads, _, store, _, events, _ = flows
    keys = keys_for(2, seed=5)
    _stored(store, loads, keys, [_page(spec, 500), _page(spec, 501)])
    store.gate.clear()
    first = loads.start(Client(), Req(keys=keys), np.arange(0, 2), None)
    second = loads.start(Client(), Req(keys=keys), np.arange(4, 6), None)
    taken = loads.take_parked(lambda t: t.task_id == second["task"])
    assert len(taken) == 1
    loads.end_cancelled(taken)
    store.gate.set()
    ended = events.wait(2)
    assert ended[second["task"]]["status"] == TaskStatus.CANCELLED
    assert ended[first["task"]]["result"]["loaded"] == 2
    _no_pins(loads)


@pytest.mark.parametrize("writer", ["offload", "fetch"])
@pytest.mark.parametrize("reader", ["load", "prefetch"])
def test_a_deleted_entry_being_written_stays_its_writers_when_a_task_waiting_on_it_leaves(
        flows, spec, writer, reader):
    """A WRITING entry (an offload's, or a load's fetch from storage) that a load or prefetch
    of the key waits on instead of fetching it is deleted, then the waiting task is cancelled.
    The entry's host block is still the writer's copy target: before, the waiter's unpin
    removed the doomed entry and freed its block under the copy (another task could take it
    and have its bytes overwritten), and the writer then failed with a KeyError. (Found by
    test_random_shared_tier.py.)"""
    loads, offloads, store, copier, events, _ = flows
    keys = keys_for(1, seed=9)
    _stored(store, loads, keys, [_page(spec, 900)])  # so the reader plans the key from storage
    copier.device[3] = _page(spec, 901)
    if writer == "offload":
        hold, release = (lambda: offloads.worker.pause(10)), offloads.worker.resume
    else:  # the first load's read waits in the store
        hold, release = (lambda: store.gate.clear() or True), store.gate.set
    assert hold()
    try:
        if writer == "offload":
            first = offloads.start(Client(), Req(keys=keys), np.array([3]), None)["task"]
        else:
            first = loads.start(Client(), Req(keys=keys), np.arange(20, 21), None)["task"]
        if reader == "load":
            task = loads.start(Client(), Req(keys=keys), np.arange(10, 11), None)["task"]
        else:
            task = loads.storage.prefetch(Client(), Req(keys=keys, policy="best_effort", timeout_ms=0,
                                                        block_tokens=256))["task"]
        assert [t.task_id for t in loads.parked] == [task]  # it waits for the writer's entry
        host = loads.host
        with host.lock:
            entry = host.index.get(keys[0])
            assert host.index.delete(keys[0]) is None and entry.doomed  # in use: doomed
        loads.end_cancelled(loads.take_parked(lambda t: t.task_id == task))
        with host.lock:
            assert host.pool.allocator.is_used(entry.block)  # no other task can be given it
    finally:
        release()
    ended = events.wait(2)
    assert ended[task]["status"] == TaskStatus.CANCELLED
    assert ended[first]["status"] == TaskStatus.DONE, ended[first]
    host = loads.host
    with host.lock:  # the entry went with its writer's end; every block in use is an indexed one's
        assert not entry.live
        used = {b for b in range(host.pool.num_blocks) if host.pool.allocator.is_used(b)}
        assert used == set(host.index.blocks())  # (a fetching load planned the key once more)
        host.index.check()
    _no_pins(loads)


def test_the_invariant_walk_finds_a_block_written_with_no_entry_and_an_entry_with_no_writer(flows, spec):
    """The walk (`status --check`) says when an offload's entry left the index while the copy
    into its block is queued (the state the defect above made), and when an entry is WRITING
    with no live task writing it; and it counts the pins of the backup the offload queued
    while its write is held up (the state CI met when the backup was slower than the test)."""
    loads, offloads, store, copier, events, _ = flows
    svc = SimpleNamespace(host=loads.host, storage=loads.storage, table=loads.table)
    svc._live_tasks = lambda: CacheService._live_tasks(svc)  # the service's: backups pin too
    keys = keys_for(2, seed=10)
    copier.device[3] = _page(spec, 1000)
    index = loads.host.index
    assert offloads.worker.pause(10)
    try:
        off = offloads.start(Client(), Req(keys=keys[:1]), np.array([3]), None)
        assert check_service(svc) == "ok"
        with loads.host.lock:
            entry = index.get(keys[0])
            index._entries.pop(entry.key)  # the entry gone, the copy still to come
            entry.live = False
            assert "writes its host block" in check_service(svc)
            index._entries[entry.key], entry.live = entry, True
            orphan = index.insert(keys[1], loads.host.alloc(1)[0], None)
            assert check_service(svc) == f"failed: entry {keys[1].hex()} is being written by no live task"
            loads.host.free([index.discard(orphan)])
            assert check_service(svc) == "ok"
    finally:
        offloads.worker.resume()
    store.put_gate.clear()  # the write_through backup it queues waits, its entry pinned
    try:
        assert events.wait(1)[off["task"]]["status"] == TaskStatus.DONE
        assert store.putting.wait(5)
        assert index.get(keys[0]).refs == 1
        assert check_service(svc) == "ok"
    finally:
        store.put_gate.set()
    wait_until(lambda: index.get(keys[0]).refs == 0, 5, "the backup to end")
    assert check_service(svc) == "ok"


def test_write_through_backs_up_what_an_offload_stored(flows, spec):
    loads, offloads, store, copier, events, _ = flows
    keys = keys_for(3, seed=6)
    pages = _offload(offloads, events, copier, keys, [7, 8, 9], spec, seed=600)
    flush = loads.storage.flush(Client(), Req())  # ends once the backups queued before it did
    assert events.wait(1)[flush["task"]]["status"] == TaskStatus.DONE
    from kvcached.storage.record import StoredKeys

    stored = StoredKeys(keys, loads.storage.host.pool.geometry)
    assert [store.pages[stored[i]] for i in range(3)] == [pages[7], pages[8], pages[9]]



def test_backups_pending_at_a_delete_never_store_what_it_deleted(flows, spec):
    """The first offload's backup is writing (held in the store) when the delete comes, the
    second's is queued behind it. The write lands after the tiers' delete: what it stored of
    the deleted keys is deleted again; the queued one leaves them out. Before, all four deleted
    keys were in the store afterwards (storage hits)."""
    from kvcached.storage.record import StoredKeys

    loads, offloads, store, copier, events, _ = flows
    first, second = keys_for(4, seed=30), keys_for(4, seed=31)
    store.put_gate.clear()
    _offload(offloads, events, copier, first, [0, 1, 2, 3], spec, seed=700)
    assert store.putting.wait(5)  # the first backup's write is under way
    _offload(offloads, events, copier, second, [4, 5, 6, 7], spec, seed=710)
    gone = first[2:] + second[:2]
    assert loads.storage.delete(gone) == (0, 0, [])  # pinned by their backups: freed once done
    store.put_gate.set()
    flush = loads.storage.flush(Client(), Req())
    assert events.wait(1)[flush["task"]]["status"] == TaskStatus.DONE
    geometry = loads.storage.host.pool.geometry
    assert set(store.pages) == set(StoredKeys(first[:2] + second[2:], geometry))
    assert loads.storage.counters["deleted_again"] == 2
    assert loads.storage.counters["backup_dropped"] == 2
    with loads.host.lock:
        assert loads.host.index.prefix(first, touch=False) == loads.host.index.prefix(first[:2], touch=False)
    _no_pins(loads)
    assert loads.storage.delete(first[:2]) == (2, 2, [])  # nothing pending: freed and deleted at once


@pytest.mark.parametrize("answer", [None, False], ids=["late", "failed"])
def test_a_backup_write_that_lands_late_after_a_delete_is_deleted_again(flows, spec, answer):
    """A remote write past its deadline (or one the client took for failed) may still land
    after the tiers' delete: its keys were not deleted again (only writes that said they
    stored), and a deleted block was a storage hit once the write landed."""
    from kvcached.storage.record import StoredKeys

    loads, offloads, store, copier, events, _ = flows
    keys = keys_for(4, seed=40)
    store.put_gate.clear()
    store.put_answer = answer
    _offload(offloads, events, copier, keys, [0, 1, 2, 3], spec, seed=720)
    assert store.putting.wait(5)  # the backup's write is under way
    assert loads.storage.delete(keys[1:3]) == (0, 0, [])
    store.put_gate.set()
    flush = loads.storage.flush(Client(), Req())
    assert events.wait(1)[flush["task"]]["status"] == TaskStatus.DONE
    geometry = loads.storage.host.pool.geometry
    assert set(store.pages) == set(StoredKeys([keys[0], keys[3]], geometry))
    assert loads.storage.counters["deleted_again"] == 2
    _no_pins(loads)


def test_a_loads_and_an_offloads_copies_start_once_the_reply_is_sent(flows, spec):
    """The daemon sends a load's or an offload's reply before the copy worker may start: a
    worker started first took the GIL from the thread sending the reply the engine waits for.
    start() only queues the task's start (the service runs it once the reply is sent)."""
    loads, offloads, _store, copier, events, _hits = flows
    queued = []
    loads.after_reply = offloads.after_reply = lambda task, start: queued.append(start)
    keys = keys_for(4, 7)
    for i, b in enumerate(range(4)):
        copier.device[b] = _page(spec, 70 + i)
    reply = offloads.start(Client(), Req(keys=keys), np.arange(4), None)
    assert len(queued) == 1 and copier.calls == []
    queued.pop()()
    assert events.wait(1)[reply["task"]]["status"] == TaskStatus.DONE
    reply = loads.start(Client(), Req(keys=keys), np.arange(20, 24), None)
    assert reply["host_blocks"] == 4 and len(queued) == 1
    assert [c for c in copier.calls if c[0] == "load"] == []
    queued.pop()()
    assert events.wait(1)[reply["task"]]["status"] == TaskStatus.DONE
    assert [copier.device[b] for b in range(20, 24)] == [copier.device[b] for b in range(4)]


def test_a_task_whose_start_fails_after_its_reply_ends_failed(flows, spec, monkeypatch):
    """The client was told the load began; a start that then raises (a bug) fails the task,
    with its end event and its pins given back, instead of leaving the client waiting."""
    import types

    from kvcached.service.cache_service import CacheService

    loads, offloads, _store, copier, events, _hits = flows
    keys = keys_for(4, 9)
    _offload(offloads, events, copier, keys, [0, 1, 2, 3], spec, seed=90)
    service = types.SimpleNamespace(_after_reply=[], loads=loads)
    loads.after_reply = lambda task, start: service._after_reply.append((task, start))

    def broken(task):
        raise RuntimeError("a bug in route")
    monkeypatch.setattr(loads, "route", broken)
    reply = loads.start(Client(), Req(keys=keys), np.arange(20, 24), None)
    assert reply["host_blocks"] == 4
    CacheService.replied(service)
    ended = events.wait(1)[reply["task"]]
    assert ended["status"] == TaskStatus.FAILED and "a bug in route" in ended["result"]["error"]
    assert service._after_reply == []
    _no_pins(loads)


def test_when_ended_waits_for_the_tasks_of_its_kind_in_the_table_then_and_no_later_ones():
    """A flush's wait (TaskTable.when_ended): called once every offload in the table when it was
    asked has ended, in whatever order they end; an offload that came after it, or a task of
    another kind, does not hold it; none in the table: at once."""
    import threading

    table = TaskTable(threading.RLock(), StatusBlock(), Events())
    client = Client()

    def new(kind):
        return table.new(kind, client, Req(), [], [], [])
    fired = []
    table.when_ended("offload", lambda: fired.append("none"))
    assert fired == ["none"]
    a, b, load = new("offload"), new("offload"), new("load")
    table.when_ended("offload", lambda: fired.append("first"))
    c = new("offload")  # after the first waiter: holds only the second
    table.when_ended("offload", lambda: fired.append("second"))
    table.finish(b, TaskStatus.DONE, {})
    table.finish(load, TaskStatus.DONE, {})
    assert fired == ["none"]
    table.finish(a, TaskStatus.CANCELLED, {})
    assert fired == ["none", "first"]
    d = new("offload")  # after both: holds neither
    table.finish(c, TaskStatus.FAILED, {"error": "x"})
    assert fired == ["none", "first", "second"]
    table.finish(d, TaskStatus.DONE, {})
    assert fired == ["none", "first", "second"] and table._waiters == {}
