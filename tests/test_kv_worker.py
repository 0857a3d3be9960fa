"""The vLLM-free worker core (kvcached_client.kv_worker) against real daemons, with KV laid out
the way engines lay it out in kvcached shared memory (so the daemon can map it: direct mode)
and in private memory (staging mode): byte-exact round trips in every layout, the finished
protocol of asynchronous saves, preemption, and daemons killed mid-load and mid-save."""
from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

from conftest import disk_uri, keys_for, sweep_crashed, wait_until
from kv_layouts import REGISTERABLE, fill, make_kv, parts_of, vllm_kv
from kvcached_client import DaemonUnavailable, KvcachedError, launch
from kvcached_client.daemon_link import DaemonLink
from kvcached_client.hashing import kernel_block_keys
from kvcached_client.kv_alloc import allocate_kv_cache, describe_kv_cache
from kvcached_client.kv_views import vllm_layer_views
from kvcached_client.kv_worker import BlockTransfer, KVWorker, _Load

SRC, DST = [3, 4, 5, 9, 17, 0], [20, 2, 11, 12, 13, 7]


def make_worker(daemon, kv, direct=None, timeout=10.0, staging_blocks=32, num_blocks=24,
                host_only_loads=False):
    worker = KVWorker(None, staging_blocks=staging_blocks, direct=direct,
                      host_only_loads=host_only_loads)
    worker.link = DaemonLink(daemon.instance, daemon.run_dir, timeout, "test-worker",
                             on_connect=worker.on_connect, retire=worker.retire)
    mode = worker.register({f"layer.{i}": e for i, e in enumerate(kv)}, num_blocks)
    assert worker.link.client is not None, "the daemon is up: the worker attaches at once"
    return worker, mode


def step(worker, loads=(), saves=(), finished=()):
    """One engine step in the order vLLM runs it; returns (finished_sending, load errors)."""
    worker.start_loads(list(loads))
    for layer in range(len(worker._layers)):
        worker.layer_ready(layer)
    worker.end_forward()
    worker.start_saves(list(saves))
    return worker.finished(set(finished)), worker.load_errors()


def finish(worker, req_id: str, timeout: float = 20.0) -> None:
    """Report req_id finished and step until the worker reports it done (exactly once)."""
    got = worker.finished({req_id})
    if req_id not in got:
        wait_until(lambda: req_id in worker.finished(set()), timeout, f"{req_id} reported")
    assert req_id not in worker.finished({req_id}), "reported once only"


def blocks_of(kv, ids) -> list[torch.Tensor]:
    return [t[ids].clone() for row in parts_of(kv) for t in row]


def load_misses(worker, kv, keys, why: str) -> None:
    """A load of `keys` into DST that must find nothing: every DST block is a load error and
    none of them changed."""
    before = blocks_of(kv, DST)
    _, errors = step(worker, loads=[BlockTransfer("miss", keys, DST)])
    assert errors == set(DST), why
    for got, exp in zip(blocks_of(kv, DST), before):
        assert torch.equal(got, exp), why


@pytest.mark.parametrize("layout", REGISTERABLE)
@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_round_trip_in_every_layout_and_mode(daemon, layout, mode):
    raw, kv = make_kv(layout)
    fill(kv, seed=3)
    worker, chosen = make_worker(daemon, kv, direct=(mode == "direct"))
    assert chosen == mode
    keys = keys_for(len(SRC), seed=hash(layout) & 0xFFFF)
    try:
        done, errors = step(worker, saves=[BlockTransfer("save", keys, SRC)])
        assert errors == set() and done == set()
        finish(worker, "save")
        want = blocks_of(kv, SRC)
        for row in parts_of(kv):
            for t in row:
                t[DST] = 0
        untouched = blocks_of(kv, [1, 6, 8])
        done, errors = step(worker, loads=[BlockTransfer("load", keys, DST)], finished={"load"})
        assert errors == set()
        if done != {"load"}:  # direct: held until the load's end event, which may come later
            assert mode == "direct" and done == set()
            wait_until(lambda: "load" in worker.finished(set()), 20, "the load reported")
        for got, exp in zip(blocks_of(kv, DST), want):
            assert torch.equal(got, exp)
        for got, exp in zip(blocks_of(kv, [1, 6, 8]), untouched):
            assert torch.equal(got, exp)
        assert worker.counters["saved_blocks"] == len(SRC)
        assert worker.counters["loaded_blocks"] == len(SRC)
    finally:
        worker.close()


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_staging_stores_the_same_bytes_as_direct(daemon, layout):
    """A block's bytes are kept in the engine's memory order in both modes (its axes are
    permuted in LBNHC), so an engine that stages loads what one that maps its KV saved."""
    raw, kv = make_kv(layout)
    fill(kv, seed=5)
    keys = keys_for(len(SRC), seed=77)
    direct, _ = make_worker(daemon, kv, direct=True)
    try:
        step(direct, saves=[BlockTransfer("a", keys, SRC)])
        finish(direct, "a")
        want = blocks_of(kv, SRC)
    finally:
        direct.close()
    # the same logical views over private memory: the daemon cannot map it
    flat = torch.zeros(raw.numel() // 2, dtype=torch.bfloat16)
    private = vllm_layer_views(flat, layout, (len(kv), *kv[0].shape))
    staged, mode = make_worker(daemon, private)
    assert mode == "staging"
    try:
        _, errors = step(staged, loads=[BlockTransfer("b", keys, DST)])
        assert errors == set()
        for got, exp in zip(blocks_of(private, DST), want):
            assert torch.equal(got, exp)
    finally:
        staged.close()


def test_unmappable_kv_stages_with_one_warning_and_direct_is_refused(daemon, caplog):
    kv = [torch.zeros(24, 2, 16, 16, dtype=torch.bfloat16) for _ in range(2)]  # private memory
    with caplog.at_level(logging.WARNING, logger="kvcached_client.kv_worker"):
        worker, mode = make_worker(daemon, kv)
    worker.close()
    assert mode == "staging"
    assert sum("cannot map" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(KvcachedError, match="kvcached"):
        make_worker(daemon, kv, direct=True)
    raw, lhbnc = make_kv("LHBNC")  # shared memory, but a block is not one contiguous run
    worker, mode = make_worker(daemon, lhbnc)
    worker.close()
    assert mode == "staging"
    with pytest.raises(KvcachedError, match="block dimension"):
        make_worker(daemon, [torch.zeros(50, 2, 16, 16)], num_blocks=24)  # neither nor kernel blocks
    with pytest.raises(KvcachedError, match="different numbers of kernel blocks"):
        make_worker(daemon, [torch.zeros(48, 2, 8, 16), torch.zeros(72, 2, 8, 16)], num_blocks=24)


def _kernel(ids, factor=2) -> list[int]:
    """The kernel blocks of blocks `ids`: block b is kernel blocks b*factor .. b*factor+factor-1."""
    return [b * factor + j for b in ids for j in range(factor)]


@pytest.mark.parametrize("mode", ["auto", "direct", "staging"])
def test_layers_whose_blocks_differ_are_refused_before_anything_is_registered(daemon, mode):
    """A model whose layers differ in KV heads (what vLLM keeps in one KV cache group when every
    layer has the same tokens per block): a daemon pages one block shape per part, and staging
    has one, so register refuses it by name in every mode (staging used to fail at the first
    save's copy, inside the engine's step); the daemon has registered nothing and serves the
    next engine. K/V parts that staging cannot hold alike are refused too."""
    direct = {"auto": None, "direct": True, "staging": False}[mode]
    if mode == "staging":
        kv = [torch.zeros(24, 16, heads, 32, dtype=torch.float16) for heads in (2, 4)]
    else:
        kv = [allocate_kv_cache(1, 24, (16, heads, 32), torch.float16)[0] for heads in (2, 4)]
    with pytest.raises(KvcachedError, match="one block shape and dtype on every layer"):
        make_worker(daemon, kv, direct=direct)
    if mode != "direct":  # private memory: staging (K and V of different head sizes; 3 parts)
        for parts in [(16, 32), (32, 32, 32)]:
            odd = [tuple(torch.zeros(24, 16, 2, d) for d in parts) for _ in range(2)]
            with pytest.raises(KvcachedError, match="staging holds one tensor, or a K/V pair"):
                make_worker(daemon, odd, direct=direct)
    raw, good = make_kv(REGISTERABLE[0])
    worker, chosen = make_worker(daemon, good, direct=direct)
    try:
        assert chosen == ("staging" if mode == "staging" else "direct")
        keys = keys_for(len(SRC), seed=77)
        fill(good, seed=5)
        step(worker, saves=[BlockTransfer("save", keys, SRC)])
        finish(worker, "save")
        _, errors = step(worker, loads=[BlockTransfer("load", keys, DST)])
        assert errors == set() and all(torch.equal(a, b) for a, b in
                                       zip(blocks_of(good, DST), blocks_of(good, SRC)))
    finally:
        worker.close()


@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_a_layer_sharing_another_layers_kv_is_paged_once(daemon, mode):
    """vLLM's cross-layer KV sharing hands a later layer the very tensor of its target. Direct
    mode used to register it as a layer of its own, which a daemon refuses (two layers sharing
    bytes), so the worker stayed detached; staging paged its bytes twice. It is its target's
    layer now: registered once, its layer wait is its target's, and blocks round-trip."""
    raw, kv = make_kv("LBNHC")  # 3 layers in one allocation
    fill(kv, seed=21)
    named = {"layers.0": kv[0], "layers.1": kv[1], "layers.2": kv[2], "layers.3": kv[0]}
    worker = KVWorker(None, staging_blocks=32, direct=(mode == "direct"))
    worker.link = DaemonLink(daemon.instance, daemon.run_dir, 10, "test-worker",
                             on_connect=worker.on_connect, retire=worker.retire)
    try:
        assert worker.register(named, 24) == mode
        assert worker.link.client is not None, "registered: attached at once"
        assert worker.num_layers == 3 and worker.layer_index("layers.3") == 0
        assert worker.layer_index("layers.2") == 2 and worker.layer_index("other") is None
        keys = keys_for(len(SRC), seed=23)
        step(worker, saves=[BlockTransfer("save", keys, SRC)])
        finish(worker, "save")
        want = blocks_of(kv, SRC)
        worker.start_loads([BlockTransfer("load", keys, DST)])
        for name in named:  # the engine's per-layer waits, by name, the shared layer last
            worker.layer_ready(worker.layer_index(name))
        worker.end_forward()
        worker.start_saves([])
        assert worker.load_errors() == set()
        for got, exp in zip(blocks_of(kv, DST), want):
            assert torch.equal(got, exp)
    finally:
        worker.close()


def test_a_registration_the_daemon_refuses_is_a_warning_and_costs_only_the_cache(daemon, caplog):
    """Layers whose KV overlaps without being the same view (here K and V swapped between two
    layers) pass the worker's own checks; the daemon refuses to register them (a load into one
    would overwrite the other). The engine hears it once as a warning naming the reason, goes
    on without the daemon (saves skipped, loads recomputed) and never raises in a step."""
    raw, kv = make_kv("kvcached")
    swapped = {"layers.0": kv[0], "layers.1": (kv[0][1], kv[0][0])}
    worker = KVWorker(None, staging_blocks=32, direct=True)
    worker.link = DaemonLink(daemon.instance, daemon.run_dir, 10, "test-worker",
                             on_connect=worker.on_connect, retire=worker.retire)
    try:
        with caplog.at_level(logging.INFO, logger="kvcached_client.reattach"):
            assert worker.register(swapped, 24) == "direct"
            assert worker.link.client is None
            keys = keys_for(len(SRC), seed=29)
            _, errors = step(worker, loads=[BlockTransfer("load", keys, DST)],
                             saves=[BlockTransfer("save", keys, SRC)])
        assert errors == set(DST) and worker.counters["save_skipped_blocks"] == len(SRC)
        refusals = [r for r in caplog.records if "refused this engine" in r.getMessage()]
        assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING
        assert "share bytes" in refusals[0].getMessage()
    finally:
        worker.close()


@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_kernel_blocks_round_trip_under_keys_of_their_own(daemon, mode):
    """vLLM 0.32 splitting each 16-token block into two 8-token kernel blocks (LBHNC: a block's
    bytes are [2, H, 8, C], not the [H, 16, C] of the same block unsplit): the worker pages whole
    blocks, byte-exact, under kernel_block_keys(keys, 2); an unsplit engine of the same layout,
    handed the same keys, loads none of those bytes."""
    raw, kv = vllm_kv("LBHNC", blocks=48, tokens=8)  # per layer [48 kernel blocks, H, 8, C]
    fill(kv, seed=13)
    worker, chosen = make_worker(daemon, kv, direct=(mode == "direct"))
    assert chosen == mode and worker.kernel_factor == 2
    keys = keys_for(len(SRC), seed=31)
    try:
        step(worker, saves=[BlockTransfer("s", keys, SRC)])
        finish(worker, "s")
        with daemon.connect(timeout=10) as c:
            assert c.lookup(kernel_block_keys(keys, 2))[0] == len(SRC)
            assert c.lookup(keys) == (0, 0), "stored under the unsplit keys"
        want = blocks_of(kv, _kernel(SRC))
        untouched = blocks_of(kv, _kernel([1, 6, 8]))
        for t in kv:
            t[_kernel(DST)] = 0
        _, errors = step(worker, loads=[BlockTransfer("l", keys, DST)])
        assert errors == set()
        finish(worker, "l")
        for got, exp in zip(blocks_of(kv, _kernel(DST)), want):
            assert torch.equal(got, exp)
        for got, exp in zip(blocks_of(kv, _kernel([1, 6, 8])), untouched):
            assert torch.equal(got, exp)
    finally:
        worker.close()
    raw1, unsplit = vllm_kv("LBHNC")  # the same bytes per block, 16-token blocks
    other, _ = make_worker(daemon, unsplit, direct=(mode == "direct"))
    try:
        load_misses(other, unsplit, keys, "a split engine's bytes were loaded into an unsplit one")
    finally:
        other.close()


def test_a_finished_request_is_held_while_its_save_runs(daemon):
    raw, kv = make_kv("LBNHC")
    fill(kv, seed=9)
    worker, _ = make_worker(daemon, kv)
    keys = keys_for(len(SRC), seed=11)
    control = daemon.connect(timeout=10, role="operator")
    try:
        control.pause()  # new tasks are held: the save cannot run yet
        step(worker, saves=[BlockTransfer("r", keys, SRC)])
        for _ in range(3):
            assert worker.finished({"r", "no-transfer"}) == set(), \
                "reported while the daemon may still read its blocks (or one that had none)"
        control.resume()
        finish(worker, "r")
        assert control.lookup(keys) == (len(keys), 0)
    finally:
        control.close()
        worker.close()


def test_preemption_waits_for_the_save_then_revokes_it(daemon):
    """The engine reuses a preempted request's blocks right after preempt(): a save the daemon
    has not run by then is revoked, so what it reads after the reuse is never stored."""
    raw, kv = make_kv("LBHNC")
    fill(kv, seed=13)
    worker, _ = make_worker(daemon, kv, timeout=1.0)
    keys = keys_for(len(SRC), seed=15)
    control = daemon.connect(timeout=10, role="operator")
    try:
        control.pause()
        step(worker, saves=[BlockTransfer("p", keys, SRC)])
        worker.preempt(["p"])  # waits 1 s (the client's timeout), then revokes
        for row in parts_of(kv):  # the engine writes another request's KV there
            for t in row:
                t[SRC] = 1
        assert worker.finished({"p"}) == set(), "the daemon has not ended the save yet"
        control.resume()  # the save runs now, over the reused blocks
        finish(worker, "p")
        assert control.lookup(keys) == (0, 0), "a revoked save was stored"
        step(worker, saves=[BlockTransfer("q", keys, SRC)])  # later saves are not revoked
        finish(worker, "q")
        assert control.lookup(keys) == (len(keys), 0)
    finally:
        control.close()
        worker.close()


def _kill(handle) -> None:
    os.kill(handle.pid, signal.SIGKILL)
    handle.proc.wait(10)


def test_daemon_killed_mid_load_reports_errors_and_serves_nothing_after_restart(run_dir, instance):
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
    raw, kv = make_kv("BLHNC")
    fill(kv, seed=17)
    worker, _ = make_worker(h, kv, timeout=2.0)
    keys = keys_for(len(SRC), seed=19)
    try:
        step(worker, saves=[BlockTransfer("s", keys, SRC)])
        finish(worker, "s")
        with h.connect(timeout=10, role="operator") as control:
            control.pause()
            worker.start_loads([BlockTransfer("l", keys, DST)])  # held by the pause
            _kill(h)
        for layer in range(len(kv)):
            worker.layer_ready(layer)
        worker.end_forward()
        assert worker.load_errors() == set(DST)
        assert worker.finished({"l"}) == {"l"}, "a dead daemon touches nothing: released"
        sweep_crashed(instance)
        h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25)
        wait_until(lambda: worker.link.get() is not None, 20, "the worker reattached")
        load_misses(worker, kv, keys, "the restarted daemon has none of it: all recomputed")
    finally:
        worker.close()
        h.stop()
        sweep_crashed(instance)


def test_daemon_killed_mid_save_releases_the_request(run_dir, instance, tmp_path):
    uri = disk_uri(str(tmp_path / "disk"))
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25,
               extra_args=["--storage", uri], wait_storage=True)
    raw, kv = make_kv("LBNHC")
    fill(kv, seed=21)
    worker, _ = make_worker(h, kv, timeout=2.0)
    keys = keys_for(len(SRC), seed=23)
    try:
        with h.connect(timeout=10, role="operator") as control:
            control.pause()
            step(worker, saves=[BlockTransfer("s", keys, SRC)])
            assert worker.finished({"s"}) == set()
            _kill(h)
        wait_until(lambda: "s" in worker.finished(set()), 20, "released once the daemon died")
        sweep_crashed(instance)
        h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25,
                   extra_args=["--storage", uri], wait_storage=True)
        with h.connect(timeout=10) as c:
            assert c.lookup(keys) == (0, 0), "nothing of the killed save is served"
    finally:
        worker.close()
        h.stop()
        sweep_crashed(instance)


@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_host_only_loads_recompute_what_left_the_host_tier_instead_of_reading_storage(
        run_dir, instance, tmp_path, mode):
    """The scheduler saw 6 blocks in the host tier (its gate prefetched them); 3 were evicted
    before the step (here: the host tier cleared, 3 brought back). The load takes the 3 in host
    memory, byte-exact, and reports the rest as load errors: no storage read in the step."""
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.25, wait_storage=True,
               extra_args=["--storage", disk_uri(str(tmp_path / "disk")),
                           "--prefetch-threshold-tokens", "0"])
    raw, kv = make_kv("LBNHC")
    fill(kv, seed=27)
    worker, _ = make_worker(h, kv, direct=(mode == "direct"), host_only_loads=True)
    keys = keys_for(len(SRC), seed=29)
    try:
        step(worker, saves=[BlockTransfer("s", keys, SRC)])
        finish(worker, "s")
        want = blocks_of(kv, SRC[:3])
        with h.connect(timeout=10, role="operator") as control:
            control.flush().wait(30)
            control.clear(tier="host")
            assert control.prefetch(keys[:3], policy="wait_complete").wait(10)["prefetched"] == 3
            assert control.lookup(keys) == (3, 3)
            _, errors = step(worker, loads=[BlockTransfer("l", keys, DST)])
            assert errors == set(DST[3:])
            for got, exp in zip(blocks_of(kv, DST[:3]), want):
                assert torch.equal(got, exp)
            assert control.status()["storage_io"]["fetched"] == 3, "the load read storage"
        finish(worker, "l")
    finally:
        worker.close()
        h.stop()


def test_without_a_daemon_loads_fail_saves_are_skipped_and_requests_still_finish(daemon):
    raw, kv = make_kv("LBNHC")
    worker, _ = make_worker(daemon, kv)
    daemon.stop()
    keys = keys_for(len(SRC), seed=25)
    try:
        done, errors = step(worker, loads=[BlockTransfer("l", keys, DST)],
                            saves=[BlockTransfer("s", keys, SRC)])
        assert errors == set(DST)
        assert worker.finished({"l", "s"}) == {"l", "s"}
        assert worker.counters["save_skipped_blocks"] == len(SRC)
    finally:
        worker.close()


def test_a_revoke_word_other_than_the_last_fence_word_is_refused():
    from kvcached_proto.errors import ProtocolError
    from kvcached_proto.layout import parse_layout
    from kvcached_proto.order_words import REVOKE_WORD

    raw, kv = make_kv("LBNHC")
    layout = describe_kv_cache(kv)
    assert parse_layout(dict(layout, revoke_word=REVOKE_WORD)).revoke_word == REVOKE_WORD
    assert parse_layout(layout).revoke_word is None  # a 1.4 engine: every fence word is a fence
    for bad in (0, REVOKE_WORD + 1, "255", True):
        with pytest.raises(ProtocolError, match="revoke_word"):
            parse_layout(dict(layout, revoke_word=bad))


def test_an_offload_whose_reply_never_came_is_revoked(daemon):
    """A hung daemon: the offload request gets no reply and the engine takes its blocks back.
    When the daemon resumes it still reads the request and copies the (reused) blocks: the
    revoke sent with the error makes it discard them instead of storing them."""
    from kvcached_proto.errors import DaemonUnavailable

    raw, kv = make_kv("LBNHC")
    fill(kv, seed=27)
    keys = keys_for(len(SRC), seed=29)
    with daemon.connect(timeout=10, hang_s=0.5) as c, daemon.connect(timeout=10) as probe:
        c.register_kv_cache(kv)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnavailable):
                c.offload(SRC, keys)
            for row in parts_of(kv):  # the engine reuses the blocks
                for t in row:
                    t[SRC] = 1
        finally:
            os.kill(daemon.pid, signal.SIGCONT)

        def ended() -> list:
            try:
                c.poll_events()
            except DaemonUnavailable:  # its heartbeat is stale until it beats again
                return []
            return [e for e in c._events.values() if e.get("status") is not None]

        wait_until(lambda: ended(), 20, "the daemon ran the offload it took late")
        assert [e["status"] for e in ended()] == ["cancelled"]
        assert probe.lookup(keys) == (0, 0)


class _FakeLink:
    def __init__(self):
        self.failures = []

    def failed(self, exc):
        self.failures.append(exc)


class _FakeClient:
    timeout = 0.5

    def __init__(self):
        self.fences = {}

    def fence(self, task_id, blocks):
        self.fences[task_id] = list(blocks)

    def fenced_tasks(self):
        return set(self.fences)


class _QueuedLoad:
    """A CUDA load as the worker core sees it: each layer wait returns once the copies are
    queued (the engine's stream waits, not the CPU); `end` is how it ends (None: its daemon
    is gone and the end never comes)."""
    id, num_blocks, valid_blocks, status = 7, len(DST), len(DST), None

    def __init__(self, end):
        self.end, self.result = end, None

    def wait_layer(self, layer):
        pass

    def wait_end(self, timeout):
        if self.end is None:
            raise DaemonUnavailable("the daemon is gone")
        self.result = self.end


@pytest.mark.parametrize("end, loaded", [(None, 0), ({"loaded": 4}, 4),
                                         ({"loaded": len(DST)}, len(DST))])
def test_a_direct_load_counts_as_loaded_only_once_its_copies_ended(end, loaded):
    """Pure logic (fakes): every layer wait of a direct-mode load returned, yet its daemon died
    mid-copy (or ended it short): the step's load_errors report what it did not complete, so
    the engine recomputes them instead of keeping what its forward read."""
    worker = KVWorker(_FakeLink())
    worker.mode, worker._layers = "direct", ["layer.0", "layer.1"]
    client = _FakeClient()
    worker._loads.append(_Load("r", _QueuedLoad(end), client, list(DST), [], len(DST)))
    worker.layer_ready(1)
    worker.end_forward()
    worker.start_saves([])
    assert worker.finished(set()) == set()
    assert worker.load_errors() == set(DST[loaded:])
    assert worker.counters["loaded_blocks"] == loaded
    assert len(worker.link.failures) == (end is None)
    assert worker.load_errors() == set(), "reported once"


def test_close_unlinks_the_staging_segment_at_once(daemon):
    """vLLM runs the connector's shutdown() and then kills its worker: the staging segment's
    finalizer never ran and every stop of `vllm serve` left it in /dev/shm."""
    def mine():
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"kvcached.{os.getuid()}.kv.{os.getpid()}.")}

    raw, kv = make_kv("LBNHC")
    engine = {a["name"].lstrip("/") for a in describe_kv_cache(kv)["allocations"]}
    before = mine()  # (other tests' segments not collected yet are among them, and may go)
    worker, mode = make_worker(daemon, kv, direct=False)
    assert mode == "staging"
    staging = mine() - before
    assert staging and not staging & engine
    worker.close()
    assert worker._staging is not None  # still mapped (a step could be running): the names go
    assert not staging & mine() and engine <= mine()  # the engine's own KV keeps its name
