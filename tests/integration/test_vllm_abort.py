"""Requests aborted part way (a client gone) in a real vLLM engine (CPU), prompts prefilled in
chunks of 96 tokens, synchronous and with async scheduling: a request aborted after a load and
part of its prefill leaves the blocks it saved served right, holds vLLM's blocks only until its
transfers end, and leaves the daemon nothing in flight or pinned. Runs in .venv-vllm
(./scripts/test.sh --with-vllm)."""
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

BS, PREFIX = vllm_driver.BLOCK, vllm_driver.PREFIX_BLOCKS
CHUNKS = ["--max-batched-tokens", "96"]
# D shares A's first 7 blocks; after their load, 2 chunks of 96 tokens fill its blocks to 13
D_SAVED = 7 + 2 * 96 // vllm_driver.BLOCK


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    """The checkpoint, and the outputs of B and D after vLLM's own hits (no connector)."""
    model = str(tmp_path_factory.mktemp("abort") / "model")
    ref = vllm_driver.EngineProcess(model, "--connector", "none", *CHUNKS)
    try:
        out = {"B": ref.step("genk", f"B {PREFIX}")["tokens"],
               "D": ref.step("genk", f"D {D_SAVED}")["tokens"]}
        assert ref.gen("X")["tokens"] != out["B"]  # the control
    finally:
        ref.close()
    return model, out


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_request_aborted_mid_prefill_leaves_its_saved_blocks_right_and_nothing_held(
        scheduling, model_and_reference, run_dir, instance):
    model, ref = model_and_reference
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    extra = ["--async-scheduling"] if scheduling == "async" else []
    eng = vllm_driver.EngineProcess(model, "--connector", "kvcached", "--instance", instance,
                                    "--run-dir", run_dir, "--inproc", *CHUNKS, *extra)
    try:
        vllm_driver.wait_attached(daemon)
        assert eng.gen("A")["num_cached_tokens"] == 0
        assert eng.step("start", "D 8 2")["started"] is None  # loaded 7 blocks, prefilling
        eng.step("abort", "D")
        d = eng.gen("D")  # the reset took: D's blocks were released once its saves ended
        assert d["reset"] and d["num_cached_tokens"] == D_SAVED * BS, (d, eng.connector_log())
        assert d["tokens"] == ref["D"]
        b = eng.gen("B")
        assert b["reset"] and b["num_cached_tokens"] == PREFIX * BS, b
        assert b["tokens"] == ref["B"]
        with daemon.connect(role="operator") as c:
            s = c.status()
        assert s["tasks"]["inflight"] == 0 and s["tasks"]["parked"] == 0, s["tasks"]
        assert s["host"]["pinned_blocks"] == 0 and s["host"]["writing_blocks"] == 0, s["host"]
        counters = eng.step("counters", "")["counters"][0]
        assert counters["load_errors"] == 0, counters
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)
