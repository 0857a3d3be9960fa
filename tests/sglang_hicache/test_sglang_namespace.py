"""Two SGLang servers of one checkpoint share pages through the daemon only where they compute
the same KV: their server args (SGLang's own ServerArgs) that change the weights, the config,
the fp8 KV scales or the drafter whose layers may ride in the pages put them apart. Runs in
.venv-sglang (./scripts/test.sh --with-sglang)."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang", reason="SGLang is installed in .venv-sglang: ./scripts/test.sh --with-sglang")
pytestmark = pytest.mark.timeout(300)

import sglang_pools as sp  # noqa: E402

from kvcached_client import hashing  # noqa: E402


def test_servers_that_compute_other_kv_from_one_checkpoint_share_no_pages(daemon, tmp_path):
    """SGLang's server args of two servers of one checkpoint and pool geometry: another compute
    dtype, weights quantized at load, a config override (another RoPE base), dummy weights,
    fp8 KV scales from a file (and that file rewritten) or another EAGLE drafter make other KV, so neither finds the
    other's pages; a server with the same args does."""
    from sglang.srt.runtime_context import get_context, reset_context
    from sglang.srt.server_args import ServerArgs

    keys = sp.page_hashes(3, seed=51)
    extra = sp.extra_config(daemon.instance, daemon.run_dir)
    backends = []
    drafts = [str(tmp_path / name) for name in ("draft-a", "draft-b")]
    for i, draft in enumerate(drafts):
        os.makedirs(draft)
        with open(os.path.join(draft, "model.safetensors"), "wb") as f:
            f.write(bytes([i]) * (64 + i))  # two checkpoints: other sizes
    scales = str(tmp_path / "kv_scales.json")
    with open(scales, "w") as f:
        f.write('{"kv_cache": {"scaling_factor": {"0": {"0": 1.0}}}}')

    def attached(**args):
        get_context().set_server_args(ServerArgs(model_path="test-org/test-model", device="cpu", **args))
        backends.append(sp.attach(sp.make_pool("mha", "page_first"), extra))
        return backends[-1]

    try:
        writer = attached()
        sp.fill_random(writer.mem_pool_host, 52)
        assert writer.batch_set_v1(keys, sp.pages_of(writer.mem_pool_host, [1, 2, 3])) == [True] * 3
        others = [attached(dtype="float16"), attached(quantization="fp8"),
                  attached(json_model_override_args='{"rope_theta": 500000.0}'),
                  attached(load_format="dummy"), attached(modelopt_quant="fp8"),
                  attached(quantization_param_path=scales),
                  attached(speculative_algorithm="EAGLE", speculative_draft_model_path=drafts[0]),
                  attached(speculative_algorithm="EAGLE", speculative_draft_model_path=drafts[1])]
        assert [b.batch_exists(keys) for b in others] == [0] * 8
        sp.fill_random(others[-1].mem_pool_host, 54)  # a server with drafter b stores its own
        assert others[-1].batch_set_v1(keys, sp.pages_of(others[-1].mem_pool_host, [1, 2, 3])) == [True] * 3
        assert others[-2].batch_exists(keys) == 0 and attached(
            speculative_algorithm="EAGLE", speculative_draft_model_path=drafts[1]).batch_exists(keys) == 3
        assert attached().batch_exists(keys) == 3
        with open(scales, "w") as f:  # other fp8 KV scales under the same path: other KV
            f.write('{"kv_cache": {"scaling_factor": {"0": {"0": 0.5}}}}')
        os.utime(scales, ns=(1, 1))  # another mtime, however soon after the first write
        hashing.path_identity.cache_clear()  # read once per process: a server started after it
        again = attached(quantization_param_path=scales)
        sp.fill_random(again.mem_pool_host, 53)
        assert again.batch_set_v1(keys, sp.pages_of(again.mem_pool_host, [1, 2, 3])) == [True] * 3
        # others[5] is the server of the scales file as it was
        assert others[5].batch_exists(keys) == 0 and again.batch_exists(keys) == 3
    finally:
        for b in backends:
            b.close()
        reset_context()


def test_a_lora_adapter_retrained_where_it_was_does_not_get_the_old_ones_pages(daemon, tmp_path):
    """SGLang keys a `--lora-paths` adapter's pages by its name and path (the same id at every
    start): a server started after the adapter was retrained and written where it was finds none
    of the pages the old one's server stored, while a server of the same files finds them all,
    in each form SGLang takes the paths in (the control). A path that is no directory (a hub id)
    keys as before."""
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.runtime_context import get_context, reset_context
    from sglang.srt.server_args import ServerArgs

    keys = sp.page_hashes(3, seed=61)
    extra = sp.extra_config(daemon.instance, daemon.run_dir)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"\x01" * 64)
    backends = []

    def attached(lora_paths):
        hashing.path_identity.cache_clear()  # each server a process of its own
        get_context().set_server_args(ServerArgs(model_path="test-org/test-model", device="cpu",
                                                 lora_paths=lora_paths))
        backends.append(sp.attach(sp.make_pool("mha", "page_first"), extra))
        return backends[-1]

    try:
        old = attached([f"a={adapter}"])
        sp.fill_random(old.mem_pool_host, 62)
        assert old.batch_set_v1(keys, sp.pages_of(old.mem_pool_host, [1, 2, 3])) == [True] * 3
        same = [attached([f"a={adapter}"]), attached([{"lora_name": "a", "lora_path": str(adapter)}]),
                attached([LoRARef(lora_name="a", lora_path=str(adapter))])]
        assert [b.batch_exists(keys) for b in same] == [3, 3, 3]  # the control
        plain = attached(None)
        assert plain.batch_exists(keys) == 0  # the adapter's files are in its servers' namespace
        assert plain.batch_set_v1(keys, sp.pages_of(old.mem_pool_host, [1, 2, 3])) == [True] * 3
        assert attached(["hub-org/some-adapter"]).batch_exists(keys) == 3  # keyed as before
        os.utime(weights, ns=(1, 1))  # retrained and written where it was
        assert attached([f"a={adapter}"]).batch_exists(keys) == 0
    finally:
        for b in backends:
            b.close()
        reset_context()
        hashing.path_identity.cache_clear()
