"""vLLM's async scheduling, its default on CUDA, in a real engine (CPU, whose platform turns it
off: the driver keeps it on): a step is scheduled before the last one's tokens are known, so the
connector sees a decoding request's blocks computed before their tokens arrive. Blocks of a
prompt and of a long output are stored under the right keys, once their KV is written, and
hits of them give vLLM's own outputs. Runs in .venv-vllm (./scripts/test.sh --with-vllm)."""
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

BS, PREFIX = vllm_driver.BLOCK, vllm_driver.PREFIX_BLOCKS
OUTPUT = 200  # A's output: 488 + 200 tokens, the KV of 687 computed: 21 full blocks
TURN = (len(vllm_driver.prompts()["A"]) + OUTPUT - 1) // BS


def _reference(model: str) -> dict:
    """An engine without the connector, scheduling synchronously: A's 200-token output, then
    the outputs of its next turn (A+) and of B after vLLM's own hits of 21 and 14 blocks."""
    ref = vllm_driver.EngineProcess(model, "--connector", "none", "--inproc")
    try:
        assert ref.step("start", f"A {OUTPUT}")["started"] == "A"
        out = {"A": ref.step("finish", "")["outputs"]["A"]}
        out["A+"] = ref.step("genk", f"A+ {TURN}")["tokens"]
        out["B"] = ref.step("genk", f"B {PREFIX}")["tokens"]
        out["X"] = ref.gen("X")["tokens"]  # the control: one prefix token changed
        return out
    finally:
        ref.close()


def test_async_scheduling_stores_prompt_and_output_blocks_that_serve_vllms_own_outputs(
        tmp_path, run_dir, instance):
    model = str(tmp_path / "model")
    ref = _reference(model)
    assert ref["X"] != ref["B"] and len(ref["A"]) == OUTPUT

    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    eng = vllm_driver.EngineProcess(model, "--connector", "kvcached", "--instance", instance,
                                    "--run-dir", run_dir, "--inproc", "--async-scheduling"
                                    ).saves_go_to(daemon)
    try:
        assert eng.ready["async_scheduling"] is True
        vllm_driver.wait_attached(daemon)
        assert eng.step("start", f"A {OUTPUT}")["started"] == "A"
        assert eng.step("finish", "")["outputs"]["A"] == ref["A"]  # nothing hit: a full prefill
        # A's next turn: its prompt blocks and the blocks of its output, stored as they decoded
        turn = eng.gen("A+")
        assert turn["reset"] and turn["num_cached_tokens"] == TURN * BS, (turn, eng.connector_log())
        assert turn["tokens"] == ref["A+"]
        b = eng.gen("B")
        assert b["reset"] and b["num_cached_tokens"] == PREFIX * BS, (b, eng.connector_log())
        assert b["tokens"] == ref["B"]
        counters = eng.step("counters", "")["counters"][0]
        assert counters["loaded_blocks"] == TURN + PREFIX and counters["load_errors"] == 0, counters
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)
