"""A real vLLM engine (CPU) with the KvcachedConnector and real random weights: prefixes come
back from kvcached after vLLM dropped its own cache, greedy outputs equal a run without the
connector whose own prefix cache hit the same blocks (vLLM's split of a prefill changes bf16
results, so like is compared with like) while a one-token-changed control differs, a dead daemon and
a damaged disk record only cost recomputation. Runs in .venv-vllm (./scripts/test.sh --with-vllm)."""
from __future__ import annotations

import os
import signal
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: ./scripts/test.sh --with-vllm")
# each test starts real engines (a minute each on 2 cores) and the first builds its reference:
# the suite-wide 120 s per test is too short for them
pytestmark = pytest.mark.timeout(600)

from conftest import disk_uri, sweep_crashed, unique_instance, wait_until  # noqa: E402

from kvcached_client import BlockHasher, launch  # noqa: E402

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
DRIVER = os.path.join(SCRIPTS, "vllm_driver.py")
sys.path.insert(0, SCRIPTS)
import vllm_driver  # noqa: E402

vllm_driver.overlap_engines()  # engine after engine: each starts warm and stops behind


def Engine(tmp, *args):
    return vllm_driver.EngineProcess(str(tmp / "model"), *args)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy outputs of the same engine and prompts with no connector."""
    eng = Engine(tmp_path_factory.mktemp("ref"), "--connector", "none", "--inproc")
    try:
        out = {name: eng.gen(name)["tokens"] for name in ("A", "B", "C", "X")}
        # a hit of k blocks as vLLM's own cache gives it: what a k-block kvcached hit must match
        for name, k in (("B", vllm_driver.PREFIX_BLOCKS), ("X", 3), ("D", vllm_driver.PREFIX_BLOCKS)):
            hit = eng.step("genk", f"{name} {k}")
            assert hit["num_cached_tokens"] == k * vllm_driver.BLOCK, hit
            out[f"{name}@{k}"] = hit["tokens"]
    finally:
        eng.close()
    # the same outputs from an engine core in its own process, as the first test's engine
    # runs: vLLM's two modes give other bf16 results on some CPUs, with no connector at all (an
    # AMD EPYC VM at a 5-block hit: 751, 92, ... against 492, 873, ... in process; a CPU with
    # AMX already for A: 735, 467, 732, ... against 735, 467, 678, ...)
    eng = Engine(tmp_path_factory.mktemp("ref-proc"), "--connector", "none")
    try:
        out.update({f"{name} proc": eng.gen(name)["tokens"] for name in ("A", "C")})
        for name, k in (("B", vllm_driver.PREFIX_BLOCKS), ("X", 3), ("B", 5)):
            hit = eng.step("genk", f"{name} {k}")
            assert hit["num_cached_tokens"] == k * vllm_driver.BLOCK, hit
            out[f"{name}@{k} proc"] = hit["tokens"]
    finally:
        eng.close()
    # the control: real random weights, so B with one prefix token changed generates otherwise
    # (with vLLM's dummy weights it did not: equal outputs proved nothing)
    assert out["X"] != out["B"], out
    return out


def _records(disk_dir, keys, geometry: str):
    """The disk records of keys' blocks: named by the stored key (the key XOR the geometry
    digest the daemon's status shows)."""
    from kvcached.storage.record import stored_key

    names = [stored_key(k, bytes.fromhex(geometry)).hex() for k in keys]
    found = {}
    for dirpath, _, files in os.walk(disk_dir):
        for n in files:
            for i, k in enumerate(names):
                if n.startswith(k):
                    found[i] = os.path.join(dirpath, n)
    return found


def test_prefixes_come_back_from_kvcached_and_faults_only_cost_recomputation(
        reference, tmp_path, run_dir, instance):
    storage_dir = tmp_path / "disk"
    storage = disk_uri(str(storage_dir), 0.2)
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2,
                    extra_args=["--storage", storage], wait_storage=True)
    eng = Engine(tmp_path, "--connector", "kvcached", "--instance", instance,
                 "--run-dir", run_dir).saves_go_to(daemon)
    try:
        a = eng.gen("A")
        assert a["tokens"] == reference["A proc"] and a["num_cached_tokens"] == 0
        # the worker's handshake reached the scheduler (it keys lookups by the workers' split)
        assert _said(eng, "workers registered their KV: {0: 'staging'}, 1 kernel block(s)")
        b = eng.gen("B")  # vLLM's own cache was reset: the shared prefix comes from kvcached
        assert b["num_cached_tokens"] >= len(vllm_driver.PREFIX), b
        assert b["tokens"] == reference[f"B@{vllm_driver.PREFIX_BLOCKS} proc"]
        x = eng.gen("X")  # the control: one prefix token changed, the blocks after it miss
        assert x["num_cached_tokens"] == 3 * vllm_driver.BLOCK, x
        assert x["tokens"] == reference["X@3 proc"] != b["tokens"]
        # vLLM's cache salt keeps tenants apart: B under salt x finds nothing A stored unsalted,
        # then finds its own blocks; under salt y nothing
        bx = eng.gen("B", "tenant-x")
        assert bx["num_cached_tokens"] == 0, bx
        bx = eng.gen("B", "tenant-x")
        assert bx["num_cached_tokens"] >= len(vllm_driver.PREFIX), (bx, eng.connector_log())
        assert eng.gen("B", "tenant-y")["num_cached_tokens"] == 0
        assert b["reset"], "A's blocks are still held: its save was never reported finished"
        with daemon.connect() as c:
            # the scheduler's lookups were answered from the key table; the daemon hears of
            # them within 50 ms (its notes), hits included
            wait_until(lambda: c.status()["lookups"]["host_hits"]
                       >= len(vllm_driver.PREFIX) // vllm_driver.BLOCK, 5, "the lookups' notes")
            s = c.status()
            assert 0 < s["lookups"]["table_lookups"] <= s["lookups"]["lookups"], s["lookups"]
            c.flush().wait(30)  # the prefix is on disk before the daemon dies
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.proc.wait(10)
        sweep_crashed(instance)
        c_out = eng.gen("C")  # no daemon: vLLM recomputes, generation goes on
        assert c_out["tokens"] == reference["C proc"] and c_out["num_cached_tokens"] == 0
        assert c_out["reset"]
        # damage the disk record of prefix block 5, then a new daemon (empty host tier)
        connector_keys = _prefix_keys(tmp_path)
        records = _records(storage_dir, connector_keys, s["kv"]["geometry"])
        assert len(records) >= 10, "the prefix blocks were not written through to disk"
        with open(records[5], "r+b") as f:
            f.seek(-2, os.SEEK_END)
            byte = f.read(1)
            f.seek(-2, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x5A]))
        daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2,
                        extra_args=["--storage", storage], wait_storage=True)
        vllm_driver.wait_attached(daemon)
        b2 = eng.gen("B")  # blocks 0-4 come from disk, the damaged one and what follows are recomputed
        # what vLLM computes with those 5 blocks from its own cache (its split of the prefill
        # changes bf16 results: with these weights, not the full prefill's tokens)
        assert b2["num_cached_tokens"] == 5 * vllm_driver.BLOCK and b2["tokens"] == reference["B@5 proc"]
        with daemon.connect() as c:
            s = c.status()
        assert sum(t.get("corrupt", 0) for t in s["storage"]) == 1
        assert s["lookups"]["storage_hits"] >= 10
        # the disk hit came into the host tier by a prefetch while B waited, not in its step
        assert s["storage_io"]["prefetched"] == 5 and s["storage_io"]["fetched"] == 5, s["storage_io"]
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)


def test_with_vllms_own_prefix_cache_off_every_hit_comes_from_kvcached(
        reference, tmp_path, run_dir, instance):
    """--no-enable-prefix-caching (common beside an external cache): vLLM keeps no hit of its
    own, so B's prefix comes from kvcached each time, with vLLM's own 14-block hit's output."""
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    eng = Engine(tmp_path, "--connector", "kvcached", "--instance", instance, "--run-dir", run_dir,
                 "--no-prefix-caching", "--inproc").saves_go_to(daemon)
    try:
        vllm_driver.wait_attached(daemon)
        a = eng.gen("A")
        assert a["num_cached_tokens"] == 0 and a["tokens"] == reference["A"]
        for _ in range(2):
            b = eng.gen("B")
            assert b["num_cached_tokens"] == len(vllm_driver.PREFIX), (b, eng.connector_log())
            assert b["tokens"] == reference[f"B@{vllm_driver.PREFIX_BLOCKS}"]
        counters = eng.step("counters", "")["counters"][0]
        assert counters["loaded_blocks"] == 2 * vllm_driver.PREFIX_BLOCKS, counters
        assert counters["load_errors"] == 0, counters
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)


def test_a_kv_consumer_loads_what_a_kv_producer_stored_and_stores_nothing(
        reference, tmp_path, run_dir, redis_server):
    """Disaggregated prefill: a prefill instance (kv_role kv_producer) and a decode instance
    (kv_consumer), each beside a daemon of its own, the daemons sharing one redis tier. The
    consumer's hit comes from what the producer stored, with vLLM's own hit's output; what the
    consumer computes is stored nowhere, so neither it nor the producer finds it after. A
    decode request sent right after its prefill gets every block the prefill stored."""
    names = {role: unique_instance(role) for role in ("producer", "consumer")}
    # the decode side's daemon prefetches every stored block (its default skips a storage hit
    # under 256 tokens, which the decode instance would compute again)
    daemons = {role: launch(instance=n, run_dir=run_dir, host_cache_gb=0.2, wait_storage=True,
                            extra_args=["--storage", redis_server.uri]
                            + (["--prefetch-threshold-tokens", "0"] if role == "consumer" else []))
               for role, n in names.items()}
    engines = {}
    try:
        for role in ("producer", "consumer"):
            engines[role] = Engine(tmp_path, "--connector", "kvcached", "--kv-role", f"kv_{role}",
                                   "--instance", names[role], "--run-dir", run_dir, "--inproc")
            vllm_driver.wait_attached(daemons[role])
        producer, consumer = engines["producer"], engines["consumer"]
        assert producer.gen("A")["tokens"] == reference["A"]
        with daemons["producer"].connect() as c:
            c.flush().wait(30)  # A's blocks are in redis
            assert c.status()["bytes"]["d2h"] > 0
        b = consumer.gen("B")  # the shared prefix, from redis through the consumer's daemon
        assert b["num_cached_tokens"] == len(vllm_driver.PREFIX), (b, consumer.connector_log())
        assert b["tokens"] == reference[f"B@{vllm_driver.PREFIX_BLOCKS}"]
        block = vllm_driver.BLOCK
        for _ in range(2):  # X's blocks after the third differ from the prefix: never stored
            x = consumer.gen("X")
            assert x["num_cached_tokens"] == 3 * block and x["tokens"] == reference["X@3"], x
        with daemons["consumer"].connect() as c:
            c.flush().wait(30)
            s = c.status()
        assert s["bytes"].get("d2h", 0) == 0 and s["storage_io"]["prefetched"] > 0, s
        assert producer.gen("X")["num_cached_tokens"] == 3 * block  # not in redis either
        with daemons["producer"].connect() as c:  # (its offload of X landed: not a race with the
            c.flush().wait(30)  # lookup of the next request, which once saw 96 of 448 tokens)
        # the control: the producer stores what it computes, so its X now hits whole
        assert producer.gen("X")["num_cached_tokens"] == len(vllm_driver.PREFIX)
        # a decode request right after its prefill, as a proxy sends it (no flush): D's last 7
        # blocks, stored by the producer just now, come from redis (a 224-token storage hit)
        assert producer.gen("D")["num_cached_tokens"] == len(vllm_driver.PREFIX) // 2
        d = consumer.gen("D")
        assert d["num_cached_tokens"] == len(vllm_driver.PREFIX), (d, consumer.connector_log())
        assert d["tokens"] == reference[f"D@{vllm_driver.PREFIX_BLOCKS}"]
    finally:
        for eng in engines.values():
            eng.close()
        for role, daemon in daemons.items():
            daemon.stop()
            sweep_crashed(names[role])


def _vllm_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_dist_")}


def _said(eng, text: str) -> bool:
    return any(text in line for line in eng.log)


def _prefix_keys(tmp_path, tp_size=1):
    """The keys the connector gives the prompt blocks (its namespace: model, dtype, block size, KV dtype,
    the KV cache layout vLLM resolved (LBHNC, the CPU backend's only one), tensor-parallel size;
    each rank's daemon holds them under rank_keys of these)."""
    from kvcached_client import make_namespace
    from kvcached_client.hashing import weights_identity

    model = str(tmp_path / "model")
    ns = make_namespace(model, "bfloat16", f"vllm-bs{vllm_driver.BLOCK}-kv:auto-layout:LBHNC", 0,
                        tp_size, weights_version=weights_identity(model))
    return BlockHasher(ns).hash_blocks(vllm_driver.PREFIX, vllm_driver.BLOCK)


def test_tensor_parallel_ranks_agree_on_the_shortest_hit(tmp_path, run_dir, instance):
    """Two CPU workers, one daemon each: the shared prefix comes back through both ranks; when
    one rank's daemon restarts empty, the group hit is 0 and both ranks recompute."""
    names = [f"{instance}-{r}" for r in range(2)]
    daemons = [launch(instance=n, run_dir=run_dir, host_cache_gb=0.1) for n in names]
    vllm_shm = _vllm_shm()
    eng = Engine(tmp_path, "--connector", "kvcached", "--instance", instance + "-{rank}",
                 "--run-dir", run_dir, "--tp", "2").saves_go_to(*daemons)
    try:
        cold = eng.gen("B")  # nothing cached anywhere yet: the reference for B at TP 2
        assert cold["num_cached_tokens"] == 0
        assert _said(eng, "workers registered their KV: {0: 'staging', 1: 'staging'}, 1 kernel")
        a = eng.gen("A")
        assert a["num_cached_tokens"] >= len(vllm_driver.PREFIX), a
        warm = eng.gen("B")
        assert warm["num_cached_tokens"] >= len(vllm_driver.PREFIX), warm
        from kvcached_client import rank_keys

        base = _prefix_keys(tmp_path, tp_size=2)
        for r, d in enumerate(daemons):  # each rank holds its own shard under its own keys
            with d.connect() as c:
                assert c.lookup(rank_keys(base, r, 2))[0] == len(base)
                assert c.lookup(rank_keys(base, 1 - r, 2)) == (0, 0)
        cold_c = eng.gen("C")
        daemons[1].stop()
        daemons[1] = launch(instance=names[1], run_dir=run_dir, host_cache_gb=0.1)
        again = eng.gen("C")  # rank 0 still has the prefix, rank 1 has nothing (or is not
        # attached yet: the step that finds its daemon gone does not wait for it): recompute
        assert again["num_cached_tokens"] == 0 and again["tokens"] == cold_c["tokens"]
        # the same prefix hit from vLLM's own cache gives the warm output (and differs from a
        # full prefill in bf16 or not: compared with like)
        local = eng.step("genk", f"B {vllm_driver.PREFIX_BLOCKS}")
        assert local["tokens"] == warm["tokens"]
    finally:
        eng.close(wait=True)
        for name in _vllm_shm() - vllm_shm:  # vLLM's own, of its TP workers: left now and then
            os.unlink(os.path.join("/dev/shm", name))  # when its shutdown runs under load
        for d in daemons:
            d.stop()
        for n in names:
            sweep_crashed(n)


def test_one_daemon_per_rank_is_named_or_refused_clearly():
    from kvcached_client.vllm.checks import rank_instances

    assert rank_instances({"instance": "gpu0"}, 1) == ["gpu0"]
    assert rank_instances({"instance": "gpu{rank}"}, 2) == ["gpu0", "gpu1"]
    assert rank_instances({"instances": ["a", "b"]}, 2) == ["a", "b"]
    with pytest.raises(ValueError, match="one per rank"):
        rank_instances({"instances": ["a"]}, 2)
    with pytest.raises(ValueError, match="needs one kvcached daemon per rank"):
        rank_instances({"instance": "gpu0"}, 2)
    # vLLM's data parallelism: an engine per DP rank, each on GPUs of its own
    assert rank_instances({"instance": "dp{dp_rank}-gpu{rank}"}, 2, dp_rank=3, dp_size=4) == \
        ["dp3-gpu0", "dp3-gpu1"]
    assert rank_instances({"instances": ["a{dp_rank}", "b{dp_rank}"]}, 2, 1, 2) == ["a1", "b1"]


def test_a_dp_deployment_without_dp_rank_in_its_daemon_names_is_warned_about_once(tmp_path, caplog):
    """vLLM's own VllmConfig with data_parallel_size 2 and one daemon name for every DP rank:
    the scheduler's connector says so; its workers (one connector each) say nothing more."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_configs import vllm_config
    from vllm_model import write_model

    from kvcached_client.vllm.connector import KvcachedConnector

    config = vllm_config(write_model(str(tmp_path / "model")), data_parallel_size=2)
    said = []
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER, KVConnectorRole.WORKER):
        caplog.clear()
        conn = KvcachedConnector(config, role, None)
        said.append(sum("{dp_rank}" in r.getMessage() for r in caplog.records))
        (conn.link if role == KVConnectorRole.SCHEDULER else conn.worker.link).close()
    assert said == [1, 0, 0]


def test_every_extra_config_key_the_connector_reads_is_known():
    """A key outside EXTRA_KEYS is warned about at start (a typo takes the default silently):
    every key the connector reads must be in it."""
    import inspect
    import re

    from kvcached_client.vllm import checks, connector

    source = inspect.getsource(connector) + inspect.getsource(checks)
    read = set(re.findall(r'extra(?:\.get\(|\[)"([a-z_]+)"', source))
    assert len(read) >= 11 and read <= set(connector.EXTRA_KEYS), read - set(connector.EXTRA_KEYS)


def test_micro_batching_and_pipeline_parallelism_are_refused_at_start():
    """vLLM's own ParallelConfig: with micro-batching each micro-batch reads the KV on a stream
    of its own that the layer waits would not cover (wrong KV); with pipeline or context
    parallelism a rank holds part of the layers or of the tokens. Each is refused by name."""
    from vllm.config import ParallelConfig

    from kvcached_client.vllm.checks import check_parallelism

    check_parallelism(ParallelConfig())
    check_parallelism(ParallelConfig(ubatch_size=1))
    for bad in ({"enable_dbo": True}, {"ubatch_size": 2}):
        with pytest.raises(ValueError, match="micro-batching"):
            check_parallelism(ParallelConfig(**bad))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        check_parallelism(ParallelConfig(pipeline_parallel_size=2))
    check_parallelism(ParallelConfig(tensor_parallel_size=2))
    # a rank holds a share of every block's tokens: MLA's rank-shared keys would load rank 0's
    for bad in ({"decode_context_parallel_size": 2, "tensor_parallel_size": 2},
                {"prefill_context_parallel_size": 2}):
        with pytest.raises(ValueError, match="context parallelism"):
            check_parallelism(ParallelConfig(**bad))


def test_sleep_mode_is_declined_so_vllm_refuses_it_at_start():
    """vLLM 0.33 calls connector_cls.supports_sleep_mode(kv_transfer_config) before it enables
    sleep mode (its KV in CuMem cannot be exported over CUDA IPC, and moves at wake-up)."""
    from kvcached_client.vllm.connector import KvcachedConnector

    assert KvcachedConnector.supports_sleep_mode(None) is False


def test_the_scheduler_takes_the_workers_kernel_factor_only_when_they_agree(caplog):
    from kvcached_client.vllm.checks import KvcachedHandshake, agreed_kernel_factor, handshakes_heard

    assert agreed_kernel_factor({}) == 1, "no handshake: unsplit keys (a splitting worker misses)"
    assert agreed_kernel_factor({0: KvcachedHandshake(2, "direct"),
                                 1: KvcachedHandshake(2, "direct")}) == 2
    assert agreed_kernel_factor({0: KvcachedHandshake(2, "direct"),
                                 1: KvcachedHandshake(4, "direct")}) is None, "ranks disagree"
    assert agreed_kernel_factor({0: object(), 1: KvcachedHandshake(2, "staging")}) == 2
    # in a MultiConnector whose other connector's handshake went out instead: said, and unsplit
    with caplog.at_level("WARNING", logger="kvcached_client.vllm.connector"):
        assert handshakes_heard({0: object()}) == 1
    assert "the workers' handshake is another connector's" in caplog.text


def test_one_kv_head_per_eight_query_heads_with_64_token_blocks_and_a_partial_hit(
        tmp_path, run_dir, instance):
    """A model shape the other tests do not use (grouped-query attention 8:1, block_size 64):
    greedy outputs with the connector after reset_prefix_cache() equal a run without it whose
    own prefix cache hit the same blocks, for a full-prefix hit (B after A) and a partial one (D
    shares A's first half)."""
    shape = ["--heads", "8", "--kv-heads", "1", "--block", "64", "--prefix-blocks", "6"]
    ref = Engine(tmp_path / "ref", "--connector", "none", "--inproc", *shape)
    try:
        reference = {name: ref.step("genk", f"{name} {k}")["tokens"] for name, k in (("B", 6), ("D", 3))}
    finally:
        ref.close()
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    eng = Engine(tmp_path, "--connector", "kvcached", "--instance", instance, "--run-dir", run_dir,
                 "--inproc", *shape).saves_go_to(daemon)
    try:
        vllm_driver.wait_attached(daemon)
        assert eng.gen("A")["num_cached_tokens"] == 0
        b = eng.gen("B")
        assert b["reset"] and b["num_cached_tokens"] == 6 * 64, b
        assert b["tokens"] == reference["B"]
        d = eng.gen("D")
        assert d["reset"] and d["num_cached_tokens"] == 3 * 64, d
        assert d["tokens"] == reference["D"]
        counters = eng.step("counters", "")["counters"][0]  # loaded, not recomputed
        assert counters["loaded_blocks"] == 9 and counters["load_errors"] == 0, counters
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)


def test_a_model_with_several_kv_cache_groups_or_none_is_refused_by_name():
    """The connector pages one group's block ids in every layer: vLLM's own KVCacheConfig with
    a second group (cross-attention, numbering its blocks apart) or none is refused; one passes."""
    import torch
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from kvcached_client.vllm.checks import check_one_kv_cache_group

    full = KVCacheGroupSpec(["layers.0", "layers.1"], FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))
    cross = KVCacheGroupSpec(["cross.0"], CrossAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))
    check_one_kv_cache_group(KVCacheConfig(64, [], [full]))
    check_one_kv_cache_group(None)  # an older vLLM that hands the connector no config
    with pytest.raises(ValueError, match=r"one KV cache group; this model has 2 \(FullAttentionSpec "
                                         r"\(2 layers\); CrossAttentionSpec \(1 layers\)\)"):
        check_one_kv_cache_group(KVCacheConfig(64, [], [full, cross]))
    with pytest.raises(ValueError, match="no KV cache"):
        check_one_kv_cache_group(KVCacheConfig(64, [], []))
    # one group, but vLLM frees its blocks outside the window while the request runs (a save
    # still reading one would store another request's KV)
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    kw = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    check_one_kv_cache_group(KVCacheConfig(64, [], [KVCacheGroupSpec(["l.0"], MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16))]))
    for spec in (SlidingWindowSpec(sliding_window=128, **kw),
                 ChunkedLocalAttentionSpec(attention_chunk_size=64, **kw)):
        with pytest.raises(ValueError, match=f"full attention only; this model's KV is "
                                             f"{type(spec).__name__}"):
            check_one_kv_cache_group(KVCacheConfig(64, [], [KVCacheGroupSpec(["l.0"], spec)]))
