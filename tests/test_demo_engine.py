"""The demo engine on a tiny real transformer: continuations after loads equal the recompute."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import sweep_crashed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import demo_engine  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-load"])
def test_logits_after_host_and_disk_hits_equal_a_full_recompute(run_dir, instance, tmp_path, layerwise):
    args = demo_engine.parse_args([
        "--instance", instance, "--run-dir", run_dir,
        "--storage", f"disk://{tmp_path}/disk?capacity_gb=0.1", "--host-cache-gb", "0.05",
        "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
        "--block-size", "16", "--prefix-tokens", "96", "--suffix-tokens", "5",
        "--decode-tokens", "20", *([] if layerwise else ["--no-layerwise"])])
    try:
        results = demo_engine.run(args)
    finally:
        sweep_crashed(instance)
    base = results["recompute"]
    assert base["computed"] == 0
    for name, tier in [("gpu hit", "gpu_tokens"), ("host hit", "host_tokens"),
                       ("disk hit", "storage_tokens")]:
        r = results[name]
        assert getattr(r["match"], tier) == 96 and r["computed"] == 96, name
        assert r["tokens"] == base["tokens"], name
        torch.testing.assert_close(r["logits"], base["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_second_run_recomputes_its_recompute_row(run_dir, instance, tmp_path):
    """The disk tier keeps the first run's blocks; the second run's "recompute" must not load
    them (it did, and every "vs recompute" ratio of a second run was wrong)."""
    args = demo_engine.parse_args([
        "--instance", instance, "--run-dir", run_dir,
        "--storage", f"disk://{tmp_path}/disk?capacity_gb=0.1", "--host-cache-gb", "0.05",
        "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
        "--block-size", "16", "--prefix-tokens", "96", "--suffix-tokens", "5", "--decode-tokens", "2"])
    try:
        for _ in range(2):
            results = demo_engine.run(args)
            recompute = results["recompute"]
            assert recompute["computed"] == 0 and recompute["match"].storage_tokens == 0
            assert results["disk hit"]["match"].storage_tokens == 96
    finally:
        sweep_crashed(instance)


def test_a_wrong_block_would_be_seen():
    """The equality check can fail: one changed KV value changes the continuation's logits."""
    model = demo_engine.build_model(64, 2, 4, 2, 256)
    from transformers import DynamicCache

    ids = torch.arange(40)[None] % 256
    with torch.inference_mode():
        full = model(ids, use_cache=True)
        cache = DynamicCache(config=model.config)
        for i, layer in enumerate(full.past_key_values.layers):
            k, v = layer.keys[:, :, :32].clone(), layer.values[:, :, :32].clone()
            if i == 1:
                k[0, 0, 3] += 0.5
            cache.update(k, v, i)
        part = model(ids[:, 32:], **{demo_engine.cache_arg(model): cache},
                     position_ids=torch.arange(32, 40)[None])
    assert not torch.allclose(part.logits[0, -1], full.logits[0, -1], rtol=1e-4, atol=1e-4)
