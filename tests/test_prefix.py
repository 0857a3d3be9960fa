"""PrefixCacheManager: GPU prefix reuse on its own (pure logic), then against real daemons."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
from conftest import disk_uri, small_kv, stored, sweep_crashed, wait_until

from kvcached_client import BlockHasher, launch
from kvcached_client.prefix import MMItem, PrefixCacheManager, block_extra_keys
from kvcached_client.prefix.tree import NoFreeBlocks

BS = 16
NS = "test-model|bfloat16"


def toks(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def step(mgr, rid, tokens, mm=None, **match):
    """What an engine does for one prefill: match, wait, allocate, compute, commit."""
    hit = mgr.match(rid, tokens, mm, **match)
    computed = mgr.wait_loaded(rid)
    table = mgr.allocate(rid, len(tokens) - computed)
    mgr.commit(rid, len(tokens))
    mgr.check()
    return hit, computed, table


# --- GPU-only (no daemon) ----------------------------------------------------------------

def test_two_requests_share_a_prefix():
    mgr = PrefixCacheManager(32, BS, namespace=NS)
    shared = toks(4 * BS)
    _, computed_a, table_a = step(mgr, "a", shared + toks(BS + 3, 1))
    hit, computed_b, table_b = step(mgr, "b", shared + toks(2 * BS, 2))
    assert computed_a == 0
    assert hit.gpu_tokens == computed_b == 4 * BS
    assert table_b[:4] == table_a[:4] and not set(table_b[4:]) & set(table_a)
    assert mgr.stats()["gpu_hit_tokens"] == 4 * BS


def test_the_last_token_is_always_computed():
    mgr = PrefixCacheManager(8, BS, namespace=NS)
    prompt = toks(2 * BS)
    step(mgr, "a", prompt)
    mgr.release("a")
    hit, computed, _ = step(mgr, "b", prompt)
    assert hit.gpu_tokens == computed == BS  # the second block holds the last token


def test_lru_leaves_go_first_and_referenced_blocks_never():
    mgr = PrefixCacheManager(8, BS, namespace=NS)
    step(mgr, "old", toks(2 * BS, 1))
    step(mgr, "new", toks(2 * BS, 2))
    mgr.release("old")
    mgr.release("new")
    step(mgr, "held", toks(2 * BS, 3))           # 6 of 8 in use, "held" keeps 2 referenced
    step(mgr, "x", toks(4 * BS, 4))             # needs 4 with 2 free: evicts "old" only
    assert mgr.stats()["evictions"] == 2
    mgr.release("x")
    mgr.match("y", toks(11 * BS, 5))
    with pytest.raises(NoFreeBlocks):  # 6 evictable: not enough, so nothing is evicted
        mgr.allocate("y", 11 * BS)
    assert mgr.stats()["cached_blocks"] == 8 and mgr.stats()["evictions"] == 2
    mgr.check()
    mgr.release("y")
    assert mgr.match("n", toks(2 * BS, 2) + [1]).gpu_tokens == 2 * BS  # "new" is still there
    mgr.release("n")
    mgr.release("held")
    hit, _, _ = step(mgr, "again", toks(4 * BS, 4) + [1])
    assert hit.gpu_tokens == 4 * BS  # "x" survived; its last block came from evicting "new"
    assert mgr.match("n2", toks(2 * BS, 2) + [1]).gpu_tokens == BS
    mgr.check()


def test_commit_adds_output_tokens():
    mgr = PrefixCacheManager(16, BS, namespace=NS)
    prompt = toks(BS + 5)
    step(mgr, "a", prompt)
    out = toks(BS, 9)
    seq = prompt + out
    mgr.allocate("a", len(out))
    assert mgr.commit("a", len(seq), seq) == 1  # the second block filled by outputs
    mgr.release("a")
    hit, _, _ = step(mgr, "b", seq + [7])
    assert hit.gpu_tokens == 2 * BS


def test_release_in_any_order_with_shared_nodes_keeps_the_books():
    rng = random.Random(7)
    mgr = PrefixCacheManager(64, BS, namespace=NS)
    stems = [toks(rng.randrange(1, 4) * BS, s) for s in range(4)]
    live = []
    for i in range(300):
        if live and (len(live) > 5 or rng.random() < 0.4):
            mgr.release(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(stems) + toks(rng.randrange(1, 3 * BS), 100 + i)
            try:
                step(mgr, i, prompt)
                live.append(i)
            except NoFreeBlocks:
                mgr.release(i)
        mgr.check()
    for rid in live:
        mgr.release(rid)
    mgr.check()
    assert mgr.stats()["gpu_hit_tokens"] > 0
    assert mgr.stats()["running"] == 0


def test_multimodal_blocks_carry_item_hashes():
    assert block_extra_keys(3, BS, [MMItem(0, BS, b"img")]) == [(b"img", "@0"), None, None]
    assert block_extra_keys(3, BS, [MMItem(0, BS + 1, b"img")]) == [
        (b"img", "@0"), (b"img", f"@{-BS}"), None]
    assert block_extra_keys(3, BS, [MMItem(BS + 4, 2 * BS, "v")]) == [None, ("v", "@4"), ("v", f"@{4 - BS}")]
    mgr = PrefixCacheManager(32, BS, namespace=NS)
    prompt = toks(4 * BS)
    step(mgr, "cat", prompt, [MMItem(BS, 8, b"cat.png")])
    hit, _, _ = step(mgr, "dog", prompt, [MMItem(BS, 8, b"dog.png")])
    assert hit.gpu_tokens == BS  # equal tokens, but blocks 1.. hold a different image
    hit, _, _ = step(mgr, "cat2", prompt, [MMItem(BS, 8, b"cat.png")])
    assert hit.gpu_tokens == 3 * BS
    hit, _, _ = step(mgr, "cat-moved", prompt, [MMItem(BS + 2, 8, b"cat.png")])
    assert hit.gpu_tokens == BS  # the same image two tokens later: other KV from block 1 on


def test_adapters_and_cache_salts_keep_prefixes_apart():
    """Equal tokens under another LoRA adapter hold other KV, and another cache salt is another
    tenant: neither matches; the same adapter and salt do, and a request with neither keeps the
    keys of its tokens alone."""
    mgr = PrefixCacheManager(64, BS, namespace=NS)
    prompt = toks(4 * BS)
    step(mgr, "lora-a", prompt, adapter="a@v1")
    assert step(mgr, "lora-b", prompt, adapter="b@v1")[0].gpu_tokens == 0
    assert step(mgr, "base", prompt)[0].gpu_tokens == 0
    assert step(mgr, "lora-a2", prompt, adapter="a@v1")[0].gpu_tokens == 3 * BS
    assert step(mgr, "salt-x", prompt, cache_salt="x")[0].gpu_tokens == 0
    assert step(mgr, "salt-y", prompt, cache_salt="y")[0].gpu_tokens == 0
    assert step(mgr, "salt-x2", prompt, cache_salt="x")[0].gpu_tokens == 3 * BS
    assert step(mgr, "base2", prompt)[0].gpu_tokens == 3 * BS
    assert mgr._seqs["base2"].keys == BlockHasher(NS).hash_blocks(prompt, BS)


def test_reset_forgets_everything_cached():
    mgr = PrefixCacheManager(16, BS, namespace=NS)
    prompt = toks(3 * BS)
    step(mgr, "a", prompt)
    step(mgr, "running", toks(2 * BS, 5))
    mgr.release("a")
    mgr.reset()
    mgr.commit("running", 2 * BS)
    assert mgr.stats()["cached_blocks"] == 0
    hit, _, _ = step(mgr, "b", prompt)
    assert hit.cached_tokens == 0
    mgr.release("running")
    mgr.release("b")
    mgr.check()


def test_bad_calls_are_typed_errors_and_change_nothing():
    from kvcached_client import KvcachedError

    mgr = PrefixCacheManager(8, BS, namespace=NS)
    step(mgr, "a", toks(BS + 1))
    with pytest.raises(KvcachedError):
        mgr.match("a", toks(BS))
    with pytest.raises(ValueError):
        mgr.commit("a", 10 * BS)
    with pytest.raises(KvcachedError):
        mgr.release("nope")
    with pytest.raises(ValueError):
        PrefixCacheManager(8, BS, write_policy="sometimes")
    mgr.check()


# --- against real daemons ----------------------------------------------------------------

def content(key: bytes, shape, dtype) -> torch.Tensor:
    """The KV a block with this key holds: a function of the key, so wrong KV is visible."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    return torch.randn(shape, generator=gen).to(dtype)


class SimEngine:
    """An engine that writes each block's KV as a function of its key, and checks every
    block it gets from the cache against that function before using it."""

    def __init__(self, mgr, kv):
        self.mgr, self.kv = mgr, kv
        self.hasher = BlockHasher(NS)

    def prefill(self, rid, tokens):
        hit = self.mgr.match(rid, tokens)
        computed = self.mgr.wait_loaded(rid)
        table = self.mgr.allocate(rid, len(tokens) - computed)
        keys = self.hasher.hash_blocks(tokens, BS)
        for i in range(computed // BS):
            for layer in self.kv:
                for t in layer:
                    assert torch.equal(t[table[i]], content(keys[i], t.shape[1:], t.dtype)), \
                        f"wrong KV served for block {i} of {rid}"
        for i in range(computed // BS, len(keys)):
            for layer in self.kv:
                for t in layer:
                    t[table[i]] = content(keys[i], t.shape[1:], t.dtype)
        self.mgr.commit(rid, len(tokens))
        self.mgr.check()
        return hit, computed


def new_kv():
    # not a fixture: pytest holds fixture values until after the session's leak check
    return small_kv(num_layers=2, num_blocks=12, block_shape=(BS, 2, 8))


def manager(handle, kv, policy="write_through", blocks=12):
    return PrefixCacheManager(blocks, BS, client=handle.connect(timeout=5.0), namespace=NS,
                              kv_caches=kv, write_policy=policy)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_blocks_come_back_from_the_host_tier(daemon, policy):
    kv = new_kv()
    mgr = manager(daemon, kv, policy)
    eng = SimEngine(mgr, kv)
    prompt = toks(6 * BS)
    eng.prefill("a", prompt + [1])
    mgr.release("a")
    for i in range(3):  # push "a" out of the 12 GPU blocks
        eng.prefill(f"f{i}", toks(5 * BS, 10 + i))
        mgr.release(f"f{i}")
    hit, computed = eng.prefill("b", prompt + [2])
    assert hit.gpu_tokens == 0 and hit.host_tokens == 6 * BS and computed == 6 * BS
    st = mgr.stats()
    assert st["evictions"] > 0 and st["offloaded_blocks"] >= 6 and st["loaded_blocks"] == 6
    mgr.release("b")
    mgr.close()


def test_write_back_keeps_every_branch_of_a_prefix_evicted_at_once(daemon, monkeypatch):
    """X with two continuations Y and Z, all three evicted by one allocation: the chains go out
    as [X, Y] then [Z] led by X. X's block was freed once its own chain's offload settled, and
    the second offload named block -1 (BAD_FIELD): Z was lost, the engine warned. Now [Z] goes
    alone and names X as its parent (protocol 1.15), so the daemon links it to X."""
    from kvcached_client.client import Client

    told, offload = [], Client.offload

    def spy(self, blocks, keys, *args, parent=None, **kw):  # the real offload, its parent noted
        told.append((list(keys), parent))
        return offload(self, blocks, keys, *args, parent=parent, **kw)

    monkeypatch.setattr(Client, "offload", spy)
    kv = new_kv()
    mgr = manager(daemon, kv, "write_back")
    eng = SimEngine(mgr, kv)
    x = toks(BS, 1)
    for rid, tail in (("p", toks(BS, 2)), ("q", toks(BS, 3))):
        eng.prefill(rid, x + tail + [1])
        mgr.release(rid)
    eng.prefill("big", toks(11 * BS, 4) + [1])  # all 12 GPU blocks: X, Y and Z go
    assert mgr.stats()["offload_failures"] == 0, mgr.stats()
    with daemon.connect() as c:
        for tail in (toks(BS, 2), toks(BS, 3)):
            assert c.lookup(BlockHasher(NS).hash_blocks(x + tail, BS)) == (2, 0)
    x_key = BlockHasher(NS).hash_blocks(x, BS)[0]
    assert [p for keys, p in told if x_key not in keys] == [x_key], told  # [Z], named X's child
    mgr.release("big")
    hit, computed = eng.prefill("q2", x + toks(BS, 3) + [2])  # Z's KV comes back, checked
    assert hit.host_tokens == computed == 2 * BS, hit
    mgr.release("q2")
    mgr.close()


def test_selective_write_through_offloads_after_two_hits(daemon):
    kv = new_kv()
    mgr = manager(daemon, kv, "write_through_selective")
    eng = SimEngine(mgr, kv)
    hot, cold = toks(2 * BS, 1), toks(2 * BS, 2)
    for rid, prompt in [("h0", hot), ("c0", cold), ("h1", hot), ("h2", hot)]:
        eng.prefill(rid, prompt + [rid.encode()[1]])
        mgr.release(rid)
    mgr._poll()
    hasher = BlockHasher(NS)
    with daemon.connect() as c:
        for _ in range(100):
            if c.lookup(hasher.hash_blocks(hot, BS))[0] == 2:
                break
            time.sleep(0.02)
        assert c.lookup(hasher.hash_blocks(hot, BS)) == (2, 0)
        assert c.lookup(hasher.hash_blocks(cold, BS)) == (0, 0)
    mgr.close()


def test_disk_hit_after_a_daemon_restart_and_a_damaged_block_is_recomputed(run_dir, instance, tmp_path):
    kv = new_kv()
    storage = disk_uri(str(tmp_path / "disk"), 0.1)
    prompt = toks(5 * BS)
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=["--storage", storage],
                wait_storage=True) as d:
        mgr = manager(d, kv)
        SimEngine(mgr, kv).prefill("a", prompt + [1])
        mgr.release("a")
        mgr._poll()
        for off in list(mgr.transfers.offloads):
            mgr.transfers.finish_offload(off, 5.0)
        mgr.client.flush().wait(10)
        mgr.close()
    sweep_crashed(instance)
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=["--storage", storage],
                wait_storage=True) as d:
        mgr = manager(d, kv)
        hit, computed = SimEngine(mgr, kv).prefill("b", prompt + [2])
        assert hit.storage_tokens == 5 * BS and computed == 5 * BS
        mgr.release("b")
        mgr.close()
    sweep_crashed(instance)
    # flip a byte in the record of block 3: blocks 0-2 come back, 3-4 are recomputed
    key3 = BlockHasher(NS).hash_blocks(prompt, BS)[3]
    files = [p for p in (tmp_path / "disk").rglob("*") if p.is_file() and stored(key3, kv).hex() in p.name]
    assert len(files) == 1, "expected one record file named after the key"
    raw = bytearray(files[0].read_bytes())
    raw[-5] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=["--storage", storage],
                wait_storage=True) as d:
        mgr = manager(d, kv)
        hit, computed = SimEngine(mgr, kv).prefill("c", prompt + [3])
        assert hit.storage_tokens == 5 * BS and computed == 3 * BS
        assert mgr.stats()["load_short_blocks"] == 2
        mgr.release("c")
        mgr.close()
    sweep_crashed(instance)


def test_the_manager_degrades_when_the_daemon_dies_and_reattaches(run_dir, instance):
    kv = new_kv()
    d = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
    mgr = manager(d, kv)
    eng = SimEngine(mgr, kv)
    eng.prefill("a", toks(3 * BS) + [1])
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait(10)
    sweep_crashed(instance)
    for i in range(4):  # GPU-only from here: no error reaches the engine
        eng.prefill(f"x{i}", toks(3 * BS, 20 + i) + [1])
        mgr.release(f"x{i}")
    assert not mgr.attached and mgr.stats()["detaches"] == 1
    hit, _ = eng.prefill("a2", toks(3 * BS) + [2])
    assert hit.gpu_tokens == 3 * BS  # the GPU cache kept working
    mgr.release("a")
    mgr.release("a2")
    d.stop()
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05) as d2:
        deadline = time.monotonic() + 5
        while not mgr.attached and time.monotonic() < deadline:
            time.sleep(0.1)
            mgr._poll()
        assert mgr.attached and mgr.stats()["attaches"] == 2
        eng.prefill("b", toks(4 * BS, 40) + [1])  # write-through reaches the new daemon
        mgr.release("b")
        for off in list(mgr.transfers.offloads):
            mgr.transfers.finish_offload(off, 5.0)
        with d2.connect() as c:
            assert c.lookup(BlockHasher(NS).hash_blocks(toks(4 * BS, 40), BS))[0] == 4
        mgr.close()
    sweep_crashed(instance)


def test_reset_after_a_weight_update_leaves_nothing_readable(daemon):
    kv = new_kv()
    mgr = manager(daemon, kv)
    prompt = toks(4 * BS)
    SimEngine(mgr, kv).prefill("a", prompt + [1])
    SimEngine(mgr, kv).prefill("running", toks(2 * BS, 3) + [1])
    mgr.release("a")
    mgr.reset()  # waits for the write-through copies, then clears the daemon's tiers
    mgr.commit("running", 2 * BS + 1)
    keys = BlockHasher(NS).hash_blocks(prompt, BS)
    with daemon.connect() as c:
        assert c.lookup(keys) == (0, 0)
    hit = mgr.match("b", prompt + [2])
    assert hit.cached_tokens == 0
    mgr.release("b")
    mgr.release("running")
    mgr.check()
    mgr.close()


def test_a_reset_told_not_to_clear_the_daemon_never_matches_what_it_holds(daemon):
    """reset(clear_daemon=False): the daemon serves other engines too and keeps its blocks (the
    control), but this manager never matches them again."""
    kv = new_kv()
    mgr = manager(daemon, kv)
    prompt = toks(4 * BS)
    SimEngine(mgr, kv).prefill("a", prompt + [1])
    mgr.release("a")
    mgr.reset(clear_daemon=False)
    with daemon.connect() as c:
        assert c.lookup(BlockHasher(NS).hash_blocks(prompt, BS)) == (4, 0)
    hit = mgr.match("b", prompt + [2])
    assert hit.cached_tokens == 0
    mgr.release("b")
    mgr.close()


def test_a_reset_with_no_daemon_to_clear_never_serves_the_old_weights_kv(run_dir, instance, tmp_path):
    """A weight update while the daemon is gone: no clear reaches its disk tier, so the keys
    are salted anew, and the restarted daemon's old blocks (still there: the control) are
    never matched; the engine's check of every served block would catch the old KV."""
    kv = new_kv()
    args = dict(instance=instance, run_dir=run_dir, host_cache_gb=0.05, wait_storage=True,
                extra_args=["--storage", disk_uri(str(tmp_path / "disk"), 0.1)])
    prompt = toks(5 * BS)
    with launch(**args) as d:
        mgr = manager(d, kv)
        eng = SimEngine(mgr, kv)
        eng.prefill("a", prompt + [1])
        mgr.release("a")
        mgr.settle(5)
        mgr.client.flush().wait(10)
    sweep_crashed(instance)
    assert not mgr.try_attach()
    mgr.reset()  # new weights, and no daemon to clear
    eng.hasher = BlockHasher(NS + "|new weights")  # the KV the engine computes from now on
    try:
        with launch(**args) as d:
            wait_until(mgr.try_attach, 5, "the manager attached again")
            with d.connect() as c:
                assert c.lookup(BlockHasher(NS).hash_blocks(prompt, BS)) == (0, 5)
            hit, computed = eng.prefill("b", prompt + [2])
            assert hit.cached_tokens == 0 and computed == 0
            mgr.release("b")
    finally:
        mgr.close()
    sweep_crashed(instance)


def test_constructing_the_manager_never_races_its_own_reattach_watcher(daemon, caplog):
    """Its background watcher started before the client was set: a second connection raced
    the first to register, and every construction logged a false 'refused this engine'
    (KV_IN_USE) - or the constructor lost the race and raised."""
    import logging

    kv = new_kv()
    with caplog.at_level(logging.INFO, logger="kvcached_client"):
        for _ in range(10):
            mgr = manager(daemon, kv)
            time.sleep(0.05)  # a watcher's first look
            assert mgr.attached
            mgr.close()
    assert not [r for r in caplog.records if "refused" in r.getMessage()]
