"""A real vLLM engine (CPU) under KV pressure: a pool of 40 blocks, so vLLM preempts running
requests (frees their blocks, hands them to others, and runs them again later), and prompts
prefilled in chunks of 96 tokens, synchronous and with async scheduling (vLLM's default on
CUDA). A batch of 12 prompts over 4 shared prefixes, 64 tokens each, gives the outputs of an
engine without the connector under the same pressure, when it stores and when it is served
from kvcached. A request aborted part way (a client gone) leaves the blocks it saved served
right, holds vLLM's blocks only until its transfers end, and leaves the daemon nothing in
flight or pinned. Float32, so the outputs do not depend on how a prefill is split (a hit splits
it otherwise than the reference). Runs in .venv-vllm (./scripts/test.sh --with-vllm)."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: ./scripts/test.sh --with-vllm")
pytestmark = pytest.mark.timeout(600)

from conftest import sweep_crashed  # noqa: E402

from kvcached_client import launch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import vllm_driver  # noqa: E402

vllm_driver.overlap_engines()  # engine after engine: each starts warm and stops behind

OUTPUT, CHUNK = 64, 96
PRESSURE = ["--inproc", "--dtype", "float32", "--num-blocks", "40", "--max-batched-tokens",
            str(CHUNK), "--max-tokens", str(OUTPUT)]
BS, PREFIX = vllm_driver.BLOCK, vllm_driver.PREFIX_BLOCKS
# D shares A's first 7 blocks; after their load, 2 chunks of 96 tokens fill its blocks to 13
D_SAVED = PREFIX // 2 + 2 * CHUNK // BS
# a next turn's hit: the full blocks of its prompt and of the KV computed of its output (all but
# the last token's)
TURN_HITS = [(len(p) + OUTPUT - 1) // BS * BS
             for p in vllm_driver.batch_prompts()]


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    """The checkpoint, and from an engine without the connector: the batch's outputs, its next
    turns', and B's and D's after vLLM's own hits of 14 and 13 blocks."""
    model = str(tmp_path_factory.mktemp("pressure") / "model")
    ref = vllm_driver.EngineProcess(model, "--connector", "none", *PRESSURE)
    try:
        out = ref.step("batch", "")
        turns = ref.step("turns", "")
        hits = {"B": ref.step("genk", f"B {PREFIX}")["tokens"],
                "D": ref.step("genk", f"D {D_SAVED}")["tokens"]}
        assert ref.gen("X")["tokens"] != hits["B"]  # the control: one prefix token changed
    finally:
        ref.close()
    assert out["preemptions"] > 0  # the pool is small enough
    assert len({tuple(t) for t in out["tokens"]}) == 12  # the control: every prompt its own output
    return model, out["tokens"], turns["tokens"], hits


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_preempted_chunked_and_aborted_requests_store_and_are_served_the_right_kv(
        scheduling, model_and_reference, run_dir, instance):
    model, reference, next_turns, hits = model_and_reference
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    extra = ["--async-scheduling"] if scheduling == "async" else []
    eng = vllm_driver.EngineProcess(model, "--connector", "kvcached", "--instance", instance,
                                    "--run-dir", run_dir, *PRESSURE, *extra).saves_go_to(daemon)
    try:
        assert eng.ready["async_scheduling"] is (scheduling == "async")
        # a best-effort cache: vLLM keeps a preempted request's in-flight output (its default
        # for kv_both drops it, and computes it again)
        assert eng.ready["requires_kv_delivery"] is False
        vllm_driver.wait_attached(daemon)
        first = eng.step("batch", "")  # stores, prompts and outputs, while vLLM preempts
        assert first["preemptions"] > 0, first
        assert first["tokens"] == reference
        # every prompt's next turn, vLLM's own cache emptied: the blocks of each prompt and of
        # its output (computed, some of them, after the request was preempted and run again)
        # come from kvcached
        turns = eng.step("turns", "")
        assert turns["reset"], turns
        assert turns["num_cached_tokens"] == TURN_HITS, (turns["num_cached_tokens"],
                                                         eng.connector_log())
        assert turns["tokens"] == next_turns
        _aborted_mid_prefill(eng, hits)
        with daemon.connect(role="operator") as c:
            s = c.status()
        assert s["tasks"]["inflight"] == 0 and s["tasks"]["parked"] == 0, s["tasks"]
        assert s["host"]["pinned_blocks"] == 0 and s["host"]["writing_blocks"] == 0, s["host"]
        counters = eng.step("counters", "")["counters"][0]
        # from kvcached: every turn's blocks past its group's prefix, and each of the 4 prefixes
        # at least once (the group's two others may find it in vLLM's own cache by then)
        least = sum(TURN_HITS) // BS - 8 * PREFIX
        assert counters["loaded_blocks"] >= least, counters
        assert counters["load_errors"] == 0, counters
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)


def _aborted_mid_prefill(eng, hits: dict) -> None:
    """D, aborted after its 7-block load (the batch's first prefix is D's and B's) and two
    chunks of its prefill: the 13 blocks it saved give vLLM's own 13-block hit's output, and
    its blocks are released once its transfers end (the reset before the next step takes)."""
    assert eng.step("start", "D 8 2")["started"] is None  # loaded 7 blocks, prefilling
    eng.step("abort", "D")
    d = eng.gen("D")
    assert d["reset"] and d["num_cached_tokens"] == D_SAVED * BS, (d, eng.connector_log())
    assert d["tokens"] == hits["D"]
    b = eng.gen("B")
    assert b["reset"] and b["num_cached_tokens"] == PREFIX * BS, b
    assert b["tokens"] == hits["B"]
