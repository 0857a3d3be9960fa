"""LoRA in a real vLLM engine (CPU) with real random weights and a real PEFT adapter on every
attention projection: a request with an adapter is never served the base model's KV, hits of
its own KV give vLLM's own outputs, and an adapter whose files change under vLLM (loaded again
at every step with `load_inplace`, or once with `add_lora(load_inplace)`) is not served the old
files' KV. Runs in .venv-vllm (./scripts/test.sh --with-vllm)."""
from __future__ import annotations

import os
import shutil
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: ./scripts/test.sh --with-vllm")
pytestmark = pytest.mark.timeout(600)

from conftest import sweep_crashed  # noqa: E402

from kvcached_client import launch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import vllm_driver  # noqa: E402

from vllm_model import write_lora  # noqa: E402

vllm_driver.overlap_engines()  # engine after engine: each starts warm and stops behind

FULL = vllm_driver.PREFIX_BLOCKS * vllm_driver.BLOCK  # B's hit of the whole shared prefix


def _copy_files(src, dst) -> None:
    """`dst`'s adapter made `src`'s, as a retrained adapter is written where the old one was
    (new files: new mtimes, whatever their bytes)."""
    for name in os.listdir(src):
        os.unlink(dst / name)
        shutil.copy(src / name, dst / name)


def _reference(model: str, one, two) -> dict:
    """An engine without the connector: B's outputs with adapter `one`, with `two` and with
    none; "k": after a 14-block hit in vLLM's own cache (its split of the prefill changes bf16
    results), "full": prefilled whole."""
    ref = vllm_driver.EngineProcess(model, "--connector", "none", "--inproc", "--lora")
    try:
        out = {"base": ref.gen("B")["tokens"]}
        for name, path in (("one", one), ("two", two)):
            ref.step("adapter", str(path))
            out[name] = {"full": ref.gen("B")["tokens"],
                         "k": ref.step("genk", f"B {vllm_driver.PREFIX_BLOCKS}")["tokens"]}
        return out
    finally:
        ref.close()


def test_lora_requests_get_their_adapters_kv_and_never_the_old_files(tmp_path, run_dir, instance):
    one = tmp_path / "one"  # the adapter the engine serves as "l1"; its files change below
    write_lora(str(one), seed=1)
    two, orig = tmp_path / "two", tmp_path / "orig"
    write_lora(str(two), seed=2)  # the retrained files
    write_lora(str(orig), seed=1)  # the first files again (a revert)
    l1 = tmp_path / "l1"
    shutil.copytree(one, l1)
    ref = _reference(str(tmp_path / "model"), one, two)
    # the controls: the adapter changes B's output, and the two adapters differ
    assert ref["one"]["full"] != ref["base"] and ref["two"]["full"] != ref["one"]["full"]

    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    eng = vllm_driver.EngineProcess(str(tmp_path / "model"), "--connector", "kvcached", "--lora",
                                    "--instance", instance, "--run-dir", run_dir, "--inproc"
                                    ).saves_go_to(daemon)
    try:
        vllm_driver.wait_attached(daemon)

        def gen(expect_cached: int, expect: list) -> None:
            out = eng.gen("B")
            assert out["reset"] and out["num_cached_tokens"] == expect_cached, \
                (out, eng.connector_log())
            assert out["tokens"] == expect

        assert eng.gen("A")["num_cached_tokens"] == 0  # the base model's blocks, stored
        eng.step("adapter", str(l1))
        gen(0, ref["one"]["full"])  # the base model's KV is not the adapter's
        gen(FULL, ref["one"]["k"])  # its own, stored by the request before

        _copy_files(two, l1)  # retrained in place; vLLM loads the files at every step
        eng.step("adapter", f"{l1} inplace")
        gen(0, ref["two"]["full"])  # the old files' KV is not served
        gen(FULL, ref["two"]["k"])  # the new files' KV, stored by the request before

        _copy_files(orig, l1)  # the first files back, loaded once by add_lora(load_inplace)
        assert eng.step("addlora", str(l1))["added"]
        eng.step("adapter", str(l1))
        gen(0, ref["one"]["full"])  # neither the first load's KV nor the second's
        gen(FULL, ref["one"]["k"])

        counters = eng.step("counters", "")["counters"][0]
        assert counters["loaded_blocks"] == 3 * vllm_driver.PREFIX_BLOCKS, counters
        assert counters["load_errors"] == 0, counters
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)
