"""vLLM's KV events for the blocks kvcached holds (client/vllm/kv_events.py): the scheduler-side
connector under vLLM's own config, Request and block hasher, against a real daemon that the
test drives as the worker would (offloads under the connector's keys). Runs in .venv-vllm
(./scripts/test.sh --with-vllm)."""
from __future__ import annotations

import gc
import os
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: ./scripts/test.sh --with-vllm")

from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,  # noqa: E402
                                         maybe_convert_block_hash)
from vllm.v1.request import Request  # noqa: E402
from vllm_configs import vllm_config  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from conftest import disk_uri, small_kv, sweep_crashed, unique_instance, wait_until  # noqa: E402
from vllm_model import write_model  # noqa: E402

from kvcached.bench.process_stop import stopped  # noqa: E402
from kvcached_client import GroupClient, launch  # noqa: E402
from kvcached_client.vllm.connector import KvcachedConnector, KvcachedConnectorMetadata  # noqa: E402

BS = 16
TOKENS = [(i * 53 + 7) % 1000 for i in range(BS * 4 + 3)]  # 4 full blocks and a partial one


def _connector(model_dir, instance="unused", run_dir="/nonexistent", events: bool = True,
               **extra) -> KvcachedConnector:
    config = vllm_config(model_dir, instance, run_dir, block_size=BS)
    config.kv_transfer_config.kv_connector_extra_config.update(extra)
    if events:
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    c = KvcachedConnector(config, KVConnectorRole.SCHEDULER, None)
    c.kv_events.poll_s = 0.0
    return c


def _request(rid: str, tokens=TOKENS, **kw) -> Request:
    init_none_hash(sha256)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BS, sha256), **kw)


def _save(c: KvcachedConnector, req: Request, blocks: int):
    """The scheduler's save of req's first blocks (as build_connector_meta makes it)."""
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    state = c._reqs[req.request_id]
    state.block_ids = list(range(blocks))
    meta = KvcachedConnectorMetadata()
    c._add_save(meta, state, blocks * BS)
    (save,) = meta.saves
    return save


def _stored(events) -> list:
    return [e for e in events if isinstance(e, BlockStored)]


def _hashes(req: Request, blocks) -> list:
    return [maybe_convert_block_hash(req.block_hashes[i]) for i in blocks]


@pytest.fixture
def model_dir(tmp_path):
    return write_model(str(tmp_path / "model"))


class _Daemon:
    """A daemon and the worker's client of it (its KV registered), as a vLLM worker holds one."""

    def __init__(self, run_dir: str, instance: str):
        self.run_dir, self.instance = run_dir, instance
        self.start()

    def start(self) -> None:
        self.handle = launch(instance=self.instance, run_dir=self.run_dir, host_cache_gb=0.05)
        self.worker = self.handle.connect()
        self.worker.register_kv_cache(small_kv(num_layers=2, num_blocks=16, block_shape=(BS, 2, 8)))

    def stop(self) -> None:
        self.worker.close()
        self.handle.stop()
        self.worker = None
        gc.collect()  # the closed client's KV segment goes with its last reference


@pytest.fixture
def daemon(run_dir, instance):
    d = _Daemon(run_dir, instance)
    yield d
    d.stop()
    sweep_crashed(instance)


def test_a_save_that_continues_a_request_names_the_block_before_it(model_dir):
    """The scheduler's saves of one request (a step's blocks at a time): the first names no
    parent, each later one the last block of the one before; a save after a hit (vLLM's own, here)
    names the hit's last block. (The worker tells the daemon, which keeps the request's head
    before its tail: test_offload_parent.py.)"""
    c = _connector(model_dir, events=False)
    req = _request("a")
    state = _state(c, req, 0)
    keys = c._keys(state, 4)
    state.block_ids = list(range(4))
    meta = KvcachedConnectorMetadata()
    c._add_save(meta, state, 2 * BS)
    c._add_save(meta, state, 4 * BS)
    assert [(s.keys, s.parent) for s in meta.saves] == [(keys[:2], None), (keys[2:], keys[1])]
    hit = _request("b")
    state = _state(c, hit, 3 * BS)  # vLLM's own prefix cache had the first 3 blocks
    state.block_ids = list(range(4))
    meta = KvcachedConnectorMetadata()
    c._add_save(meta, state, 4 * BS)
    assert [(s.keys, s.parent) for s in meta.saves] == [(keys[3:], keys[2])]


def _state(c: KvcachedConnector, req: Request, computed: int):
    assert c.get_num_new_matched_tokens(req, computed) == (0, False)  # (no daemon: no hit)
    return c._reqs[req.request_id]


def test_offloaded_blocks_are_announced_once_loadable_and_removed_when_they_go(
        model_dir, run_dir, instance, daemon):
    worker = daemon.worker
    c = _connector(model_dir, instance, run_dir)
    req = _request("a")
    save = _save(c, req, 4)
    assert c.take_events() == [], "a save sent is not a block held"
    daemon_keys = c.key_scheme.daemon_keys(save.keys)
    worker.offload(save.block_ids, daemon_keys).wait(10)
    events = c.take_events()
    assert [e.block_hashes for e in events] == [[h] for h in _hashes(req, range(4))]
    assert all(isinstance(e, BlockStored) and e.medium == "CPU" and e.block_size == BS for e in events)
    assert [e.parent_block_hash for e in events] == [None] + _hashes(req, range(3))
    assert [e.token_ids for e in events] == [TOKENS[i * BS:(i + 1) * BS] for i in range(4)]
    other = _request("b", TOKENS[:BS] + [t + 1 for t in TOKENS[BS:]])  # control: block 1 on differ
    assert _hashes(other, [0]) == _hashes(req, [0]) and _hashes(other, [1]) != _hashes(req, [1])
    assert c.take_events() == []  # told once

    worker.delete(daemon_keys[2:3])
    (gone,) = c.take_events()
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == _hashes(req, [2])
    assert gone.medium == "CPU"
    worker.offload([2], daemon_keys[2:3]).wait(10)  # stored again: announced again
    assert [e.block_hashes for e in c.take_events()] == [_hashes(req, [2])]

    # a scheduler that starts on a daemon holding blocks announces those it plans loads from
    fresh = _connector(model_dir, instance, run_dir)
    again = _request("c")
    hit, _ = fresh.get_num_new_matched_tokens(again, 0)
    assert hit == 4 * BS
    fresh.update_state_after_alloc(again, SimpleNamespace(get_block_ids=lambda: [list(range(8))]), hit)
    assert [e.block_hashes for e in _stored(fresh.take_events())] == [[h] for h in _hashes(req, range(4))]

    # everything stored before a cache reset is re-keyed: reported removed at once
    fresh.reset_cache()
    assert sorted(h for e in fresh.take_events() for h in e.block_hashes) == sorted(_hashes(req, range(4)))

    worker.clear(tier="host")
    removed = c.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(_hashes(req, range(4)))
    fresh.shutdown()
    c.shutdown()


def test_blocks_on_a_local_disk_are_announced_as_storage_and_found_again_by_a_new_scheduler(
        model_dir, run_dir, instance, tmp_path):
    """A daemon with a disk tier (write-through): each block saved is announced twice, CPU and
    STORAGE (locality LOCAL), and each medium's losses apart, a disk that stops answering a while
    too; a scheduler started later (an engine restart) that loads blocks held only on the disk
    asks where they are and announces them."""
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, wait_storage=True,
               extra_args=["--storage", disk_uri(str(tmp_path / "disk"), 0.1),
                           "--prefetch-threshold-tokens", "0"])  # a hit of 2 blocks is fetched
    worker = d.connect()
    try:
        worker.register_kv_cache(small_kv(num_layers=2, num_blocks=16, block_shape=(BS, 2, 8)))
        c = _connector(model_dir, instance, run_dir)
        req = _request("a")
        save = _save(c, req, 4)
        daemon_keys = c.key_scheme.daemon_keys(save.keys)
        worker.offload(save.block_ids, daemon_keys).wait(10)
        worker.flush().wait(10)
        events = []
        wait_until(lambda: events.extend(c.take_events()) or len(events) >= 8, 10, "the events")
        assert all(isinstance(e, BlockStored) for e in events)
        by_medium = {m: [e for e in events if e.medium == m] for m in ("CPU", "STORAGE")}
        assert [e.block_hashes for e in by_medium["CPU"]] == [[h] for h in _hashes(req, range(4))]
        assert sorted(e.block_hashes[0] for e in by_medium["STORAGE"]) == sorted(_hashes(req, range(4)))
        assert {e.locality for e in by_medium["STORAGE"]} == {"LOCAL"} and len(events) == 8
        # the disk's root gone a while (a volume unmounted): its blocks are reported removed,
        # and stored again once it answers; the CPU ones stand
        root = str(tmp_path / "disk")
        os.rename(root, root + ".away")
        try:
            lost = []
            wait_until(lambda: lost.extend(c.take_events()) or len(lost) >= 4, 10, "the disk's loss")
        finally:
            os.rename(root + ".away", root)
        assert all(isinstance(e, BlockRemoved) and e.medium == "STORAGE" for e in lost)
        assert sorted(h for e in lost for h in e.block_hashes) == sorted(_hashes(req, range(4)))
        back = []
        wait_until(lambda: back.extend(c.take_events()) or len(back) >= 4, 10, "the disk's return")
        assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in back)
        assert sorted(e.block_hashes[0] for e in back) == sorted(_hashes(req, range(4)))
        worker.clear(tier="host")  # the host's losses are not the disk's
        removed = c.take_events()
        assert all(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in removed)
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(_hashes(req, range(4)))
        worker.delete(daemon_keys[2:3])
        (gone,) = c.take_events()
        assert isinstance(gone, BlockRemoved) and (gone.medium, gone.locality) == ("STORAGE", "LOCAL")
        assert gone.block_hashes == _hashes(req, [2])
        c.shutdown()

        fresh = _connector(model_dir, instance, run_dir)  # the engine restarted
        again = _request("c")
        hits = []
        wait_until(lambda: hits.append(fresh.get_num_new_matched_tokens(again, 0)[0]) or hits[-1] is not None,
                   10, "the disk hit brought into the host tier")
        assert hits[-1] == 2 * BS  # blocks 0 and 1: block 2 was deleted
        fresh.update_state_after_alloc(again, SimpleNamespace(get_block_ids=lambda: [list(range(8))]), 2 * BS)
        found = []
        wait_until(lambda: found.extend(fresh.take_events()) or len(found) >= 4, 10, "the answers")
        assert sorted((e.medium, e.block_hashes[0]) for e in found) == sorted(
            (m, h) for m in ("CPU", "STORAGE") for h in _hashes(req, range(2)))
        fresh.shutdown()
    finally:
        worker.close()
        d.stop()
        sweep_crashed(instance)


def test_a_daemon_of_protocol_1_9_is_followed_for_its_host_tier_and_asked_nothing(
        model_dir, run_dir, instance, daemon):
    c = _connector(model_dir, instance, run_dir)
    req = _request("a")
    save = _save(c, req, 4)
    c.link.get().info["protocol_version"] = [1, 9]  # what a 1.9 daemon's hello says
    daemon.worker.offload(save.block_ids, c.key_scheme.daemon_keys(save.keys)).wait(10)
    events = c.take_events()
    assert [(e.medium, e.block_hashes) for e in events] == [("CPU", [h]) for h in _hashes(req, range(4))]
    assert not c.kv_events._asks[0], "a 1.9 daemon refuses the fields it does not know"
    c.shutdown()


def test_a_lora_adapter_loaded_again_reports_its_blocks_removed(model_dir, run_dir, instance, daemon):
    """Blocks carry their LoRA as vLLM's own events do; add_lora loading the adapter again keys
    its blocks anew: they are reported removed, the base model's stay."""
    from vllm.lora.request import LoRARequest

    c = _connector(model_dir, instance, run_dir)
    adapter = LoRARequest("a", 1, "/adapters/a")
    base, tuned = _request("base"), _request("tuned", lora_request=adapter)
    assert _hashes(base, [0]) != _hashes(tuned, [0])  # vLLM keys the adapter's blocks apart
    for req, blocks in ((base, range(4)), (tuned, range(4, 8))):
        save = _save(c, req, 4)
        daemon.worker.offload(blocks, c.key_scheme.daemon_keys(save.keys)).wait(10)
    events = c.take_events()
    assert [(e.lora_name, e.lora_id) for e in events] == [(None, None)] * 4 + [("a", 1)] * 4
    c.adapter_loaded(adapter)  # its first load: nothing changes
    c.adapter_loaded(adapter)  # loaded again
    removed = c.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(_hashes(tuned, range(4)))
    c.shutdown()


def test_a_restarted_daemon_and_a_full_follow_list_report_blocks_removed(
        model_dir, run_dir, instance, daemon):
    c = _connector(model_dir, instance, run_dir)
    req = _request("a")
    save = _save(c, req, 4)
    daemon.worker.offload(save.block_ids, c.key_scheme.daemon_keys(save.keys)).wait(10)
    assert len(c.take_events()) == 4

    old_epoch = c.link.get().epoch
    daemon.stop()
    daemon.start()  # its host tier is empty
    wait_until(lambda: getattr(c.link.get(), "epoch", old_epoch) != old_epoch, 20, "the reattach")
    # a save noted before any step polled: the new daemon keeps its changes from then on
    c.kv_events.max_blocks = 2
    save = _save(c, _request("b"), 4)  # the same blocks again
    keys = c.key_scheme.daemon_keys(save.keys)
    assert set(c.kv_events._asks[0]) == set(keys[2:]), "a block forgotten is not asked about"
    daemon.worker.offload(range(4), c.key_scheme.daemon_keys(save.keys)).wait(10)
    events = c.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(_hashes(req, range(4))), "the old daemon's blocks are gone"
    # past the follow limit the two oldest are not followed: never announced
    assert [e.block_hashes for e in _stored(events)] == [[h] for h in _hashes(req, [2, 3])]
    assert len(c.kv_events._by_key) == 2 and len(c.kv_events._present[0]) == 2
    c.shutdown()


def test_under_tensor_parallelism_a_block_is_held_once_every_rank_holds_it(model_dir, run_dir):
    names = [unique_instance("tp") for _ in range(2)]
    daemons = [launch(instance=n, run_dir=run_dir, host_cache_gb=0.05) for n in names]
    workers = [h.connect() for h in daemons]
    group = GroupClient.connect(names, run_dir=run_dir)
    c = None
    try:
        for w in workers:
            w.register_kv_cache(small_kv(num_layers=2, num_blocks=16, block_shape=(BS, 2, 8)))
        c = _connector(model_dir, names[0], run_dir)
        c.link.close()
        c.link = c.kv_events.link = SimpleNamespace(get=lambda: group, close=lambda: None)
        c.key_scheme.tp_size = 2  # each rank stores its shard under keys of its own
        req = _request("a")
        save = _save(c, req, 4)
        rank_keys = [c.key_scheme.daemon_keys(save.keys, rank) for rank in range(2)]
        assert rank_keys[0] != rank_keys[1]
        workers[0].offload(range(4), rank_keys[0]).wait(10)
        workers[1].offload(range(3), rank_keys[1][:3]).wait(10)  # rank 1 lacks block 3
        assert [e.block_hashes for e in c.take_events()] == [[h] for h in _hashes(req, range(3))]
        workers[1].offload([3], rank_keys[1][3:]).wait(10)
        assert [e.block_hashes for e in c.take_events()] == [_hashes(req, [3])]
        workers[0].delete(rank_keys[0][1:2])  # one rank's loss is the block's
        assert [e.block_hashes for e in c.take_events()] == [_hashes(req, [1])]

        workers[1].close()
        daemons[1].stop()  # rank 1's daemon replaced: its host tier is gone
        daemons[1] = launch(instance=names[1], run_dir=run_dir, host_cache_gb=0.05)
        group.close()
        group = GroupClient.connect(names, run_dir=run_dir)
        removed = c.take_events()
        assert all(isinstance(e, BlockRemoved) for e in removed)
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(_hashes(req, [0, 2, 3]))
        workers[1] = daemons[1].connect()
    finally:
        if c is not None:
            c.shutdown()
        group.close()
        for w, h, n in zip(workers, daemons, names):
            w.close()
            h.stop()
            sweep_crashed(n)


def test_a_daemon_that_stops_answering_costs_a_step_a_short_wait_and_is_followed_again(
        model_dir, run_dir, instance, daemon):
    """The daemon stops (SIGSTOP) under a link that waits 30 s for a reply and takes a daemon
    for hung after 60 s without a heartbeat: a step's poll gives up after its own short wait
    (it waited the link's 30 s), the steps after it ask nothing for a while, and once the
    daemon answers again its changes come as before, none lost (a late reply is dropped and
    the cursor stays)."""
    c = _connector(model_dir, instance, run_dir, timeout_s=30, hang_s=60)
    req = _request("a")
    save = _save(c, req, 4)
    assert c.take_events() == []  # (the daemon followed)
    with stopped(daemon.handle.pid):
        began = time.monotonic()
        assert c.take_events() == []
        waited = time.monotonic() - began
        assert waited < 5, f"a step waited {waited:.1f} s for a stopped daemon"
        assert c.kv_events._quiet_until > time.monotonic()  # the next steps ask nothing
        assert c.kv_events._wait_s == 0.5  # and the next request waits twice as long
    daemon.worker.offload(save.block_ids, c.key_scheme.daemon_keys(save.keys)).wait(10)
    got = []
    wait_until(lambda: got.extend(c.take_events()) or len(got) >= 4, 10, "the blocks announced")
    assert [e.block_hashes for e in got] == [[h] for h in _hashes(req, range(4))]
    assert all(isinstance(e, BlockStored) for e in got) and c.kv_events._wait_s == 0.0


def test_without_vllms_kv_events_nothing_is_followed(model_dir, run_dir, instance, daemon):
    c = _connector(model_dir, instance, run_dir, events=False)
    save = _save(c, _request("a"), 4)
    daemon.worker.offload(save.block_ids, c.key_scheme.daemon_keys(save.keys)).wait(10)
    assert c.take_events() == [] and not c.kv_events._blocks
    c.shutdown()


@pytest.mark.timeout(600)
def test_a_real_engine_publishes_the_blocks_it_offloaded_under_its_own_block_hashes(tmp_path, run_dir,
                                                                                     instance):
    """vLLM's engine with its ZMQ event publisher: the CPU and STORAGE blocks kvcached announces
    (a daemon with a disk tier) carry the block hashes vLLM published for the same blocks on the
    GPU; a host clear is published as the CPU blocks' removal, and leaves the disk's."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import vllm_driver
    from conftest import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.bind(endpoint)  # vLLM's publisher connects to a named address (binds only a wildcard)
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    events = []

    def drain(until, timeout: float = 30.0) -> None:
        def got() -> bool:
            while sub.poll(50):
                events.extend(decode(sub.recv_multipart()[-1]).events)
            return until()
        wait_until(got, timeout, "the events")

    def hashes(medium: str, kind) -> list:
        return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]

    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25, wait_storage=True,
               extra_args=["--storage", disk_uri(str(tmp_path / "disk"), 0.1)])
    eng = vllm_driver.EngineProcess(str(tmp_path / "model"), "--instance", instance, "--run-dir", run_dir,
                                    "--kv-events", endpoint, "--inproc")
    try:
        vllm_driver.wait_attached(d)
        for _ in range(20):  # X shares A's first 3 blocks; its steps' events show the publisher
            eng.gen("X")  # connected (a PUB drops what it sends before)
            if sub.poll(1000):
                break
        quiet = []  # X's blocks are announced by now (its second run hit them all): set aside
        drain(lambda: quiet.append(len(events)) or quiet[-3:] == [len(events)] * 3 and len(quiet) > 3)
        events.clear()
        a_full = len(vllm_driver.prompts()["A"]) // vllm_driver.BLOCK
        eng.gen("A")
        drain(lambda: len(hashes("GPU", BlockStored)) >= a_full)
        a_gpu = hashes("GPU", BlockStored)
        assert len(a_gpu) == a_full
        eng.gen("X")  # steps after A's saves landed: they carry A's CPU events
        drain(lambda: set(a_gpu[3:]) <= set(hashes("CPU", BlockStored)))
        cpu = hashes("CPU", BlockStored)
        assert cpu == a_gpu[3:], "A's blocks past X's are announced once each, as vLLM names them"
        for _ in range(10):  # the backups land after the offloads: a step after them tells
            drain(lambda: True)
            if set(a_gpu[3:]) <= set(hashes("STORAGE", BlockStored)):
                break
            eng.gen("X")
        assert sorted(hashes("STORAGE", BlockStored)) == sorted(a_gpu[3:])  # backed up: any order
        with d.connect(role="operator") as op:
            op.clear(tier="host")
        eng.gen("C")
        drain(lambda: set(hashes("CPU", BlockRemoved)) >= set(cpu))
        assert hashes("STORAGE", BlockRemoved) == []
    except Exception:
        print("".join(eng.log[-40:]))
        raise
    finally:
        eng.close()
        sub.close()
        d.stop()
        sweep_crashed(instance)


def test_a_daemon_without_key_events_turns_them_off_with_one_warning(model_dir, caplog):
    """A daemon older than protocol 1.9 refuses the op (UNKNOWN_OP): the connector stops asking
    (a stand-in client: the refusal is the daemon's reply, as request_error makes it)."""
    from kvcached_proto import ErrorCode, request_error

    asked = []

    def refuse(after, limit, timeout=None):
        asked.append(after)
        raise request_error(int(ErrorCode.UNKNOWN_OP), "unknown op 27")

    c = _connector(model_dir)
    old = SimpleNamespace(epoch=1, key_events=refuse, lookup=lambda keys, timeout=None: (0, 0))
    c.link.close()
    c.link = c.kv_events.link = SimpleNamespace(get=lambda: old, close=lambda: None)
    _save(c, _request("a"), 4)
    _save(c, _request("b", TOKENS[:BS] + [t + 1 for t in TOKENS[BS:]]), 4)
    assert c.take_events() == [] and asked == [0] and not c.kv_events.enabled
    assert sum("no key_events" in r.message for r in caplog.records) == 1
    c.shutdown()
