"""The vLLM-free worker core (kvcached_client.kv_worker) against real daemons, with KV laid out
the way engines lay it out in kvcached shared memory (so the daemon can map it: direct mode)
and in private memory (staging mode): byte-exact round trips in every layout, what it
registers and refuses, kernel blocks. Its step protocol under faults: test_kv_worker_steps.py."""
from __future__ import annotations

import logging

import pytest
import torch

from conftest import keys_for, wait_until
from kv_layouts import REGISTERABLE, fill, make_kv, parts_of, vllm_kv
from kvcached_client import KvcachedError
from kvcached_client.daemon_link import DaemonLink
from kvcached_client.hashing import kernel_block_keys
from kvcached_client.kv_alloc import allocate_kv_cache
from kvcached_client.kv_views import vllm_layer_views
from kvcached_client.kv_worker import BlockTransfer, KVWorker
from worker_util import DST, SRC, blocks_of, finish, load_misses, make_worker, saved, step


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
        saved(worker, "save", keys)
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
        saved(worker, "save", keys)
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
        saved(worker, "save", keys)
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
        saved(worker, "s", keys)
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


def test_a_save_names_the_block_before_it_under_the_daemons_keys(daemon, monkeypatch):
    """A save that continues a request (BlockTransfer.parent: an earlier save's last block) tells
    the daemon that block's key as the daemon holds it - the last of its kernel blocks' keys -
    and the daemon links the two parts: the earlier part's last block, now a parent, is not what
    the host tier evicts first (test_offload_parent.py); a first save names none."""
    from kvcached_client.client import Client

    told = []
    offload = Client.offload

    def spy(self, blocks, keys, *args, parent=None, **kw):  # the real offload, its parent noted
        told.append((list(keys), parent))
        return offload(self, blocks, keys, *args, parent=parent, **kw)

    monkeypatch.setattr(Client, "offload", spy)
    raw, kv = vllm_kv("LBHNC", blocks=48, tokens=8)  # kernel factor 2
    fill(kv, seed=17)
    worker, _ = make_worker(daemon, kv, direct=False)
    keys = keys_for(len(SRC) + 2, seed=41)
    try:
        step(worker, saves=[BlockTransfer("s", keys[:2], [1, 2])])
        step(worker, saves=[BlockTransfer("s", keys[2:], SRC, parent=keys[1])])
        saved(worker, "s", keys)
    finally:
        worker.close()
    assert [p for _k, p in told] == [None, kernel_block_keys(keys[1:2], 2)[-1]]
    assert told[1][0][0] == kernel_block_keys(keys[2:3], 2)[0]


def test_a_request_saved_short_saves_nothing_after_the_hole(daemon):
    """Staging for 4 blocks and a 6-block save: blocks 4 and 5 are not stored, so no lookup
    reaches any later block of that request - its next save is skipped (counted), not stored
    where it only takes room. Another request whose saves were whole goes on storing; the
    request's mark goes when it is reported finished."""
    raw, kv = make_kv("LBNHC")
    fill(kv, seed=19)
    worker, _ = make_worker(daemon, kv, direct=False, staging_blocks=4)
    cut, whole = keys_for(8, seed=43), keys_for(5, seed=44)
    try:
        step(worker, saves=[BlockTransfer("cut", cut[:6], SRC)])
        worker._reap_staged(wait=True)
        assert worker.counters["save_skipped_blocks"] == 2
        step(worker, saves=[BlockTransfer("cut", cut[6:], [20, 2], parent=cut[5])])
        step(worker, saves=[BlockTransfer("whole", whole[:3], [11, 12, 13])])
        worker._reap_staged(wait=True)
        step(worker, saves=[BlockTransfer("whole", whole[3:], [7, 1], parent=whole[2])])
        saved(worker, "whole", whole)
        assert worker.counters["save_skipped_blocks"] == 4 and worker.counters["saved_blocks"] == 9
        with daemon.connect(timeout=10) as c:
            assert c.lookup(worker.keys_for_daemon(cut)) == (4, 0)
            assert c.lookup(worker.keys_for_daemon(cut[6:])) == (0, 0)  # not stored at all
        finish(worker, "cut")
        assert not worker._cut
    finally:
        worker.close()
