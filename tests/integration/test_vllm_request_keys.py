"""The connector keys a request's blocks apart exactly where vLLM's own prefix cache does: with
vLLM's own Request and LoRARequest objects and its block hasher, two requests' i-th blocks get
equal kvcached keys if and only if vLLM gives them equal block hashes - across LoRA adapters
(name and path), cache salts, prompt embeddings and tokens. Before, the connector keyed tokens
(and multimodal items) alone: a LoRA request was served the base model's KV, and prefixes were
shared across cache salts. Runs in .venv-vllm (./scripts/test.sh --with-vllm)."""
from __future__ import annotations

import itertools
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: ./scripts/test.sh --with-vllm")

import torch  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvcached_client import BlockHasher  # noqa: E402
from kvcached_client.key_scheme import KeyScheme  # noqa: E402
from kvcached_client.vllm.connector import KvcachedConnector, _ReqState  # noqa: E402
from kvcached_client.vllm.freshness import Freshness  # noqa: E402

BS, BLOCKS, HIDDEN = 16, 4, 8
TOKENS = [(i * 37 + 11) % 1000 for i in range(BS * BLOCKS + 5)]


def _embeds(seed: int, change_block: int | None = None) -> torch.Tensor:
    e = torch.randn(len(TOKENS), HIDDEN, generator=torch.Generator().manual_seed(seed))
    if change_block is not None:
        e[change_block * BS] += 1.0
    return e.to(torch.bfloat16)


def _image(identifier: str, offset: int, length: int):
    """vLLM's record of one image in a prompt (its content hash and placeholder span)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def _requests() -> dict[str, Request]:
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    lora = lambda name, path, i: LoRARequest(name, i, path)  # noqa: E731
    other_tokens = TOKENS[:2 * BS] + [t + 1 for t in TOKENS[2 * BS:]]
    cases = {
        "base": {}, "base again": {}, "tokens differ from block 2": {"tokens": other_tokens},
        "lora a": {"lora_request": lora("a", "/adapters/a", 1)},
        "lora a again": {"lora_request": lora("a", "/adapters/a", 7)},
        "lora b": {"lora_request": lora("b", "/adapters/b", 2)},
        "lora a, another path": {"lora_request": lora("a", "/adapters/a2", 1)},
        "salt x": {"cache_salt": "x"}, "salt x again": {"cache_salt": "x"},
        "salt y": {"cache_salt": "y"},
        "salt x, lora a": {"cache_salt": "x", "lora_request": lora("a", "/adapters/a", 1)},
        "embeds 1": {"prompt_embeds": _embeds(1)}, "embeds 1 again": {"prompt_embeds": _embeds(1)},
        "embeds 2": {"prompt_embeds": _embeds(2)},
        "embeds 1, block 2 differs": {"prompt_embeds": _embeds(1, change_block=2)},
        "image a at 20": {"mm_features": [_image("a", 20, 24)]},
        "image a at 20 again": {"mm_features": [_image("a", 20, 24)]},
        "image b at 20": {"mm_features": [_image("b", 20, 24)]},
        "image a at 22": {"mm_features": [_image("a", 22, 24)]},
        "images a, b": {"mm_features": [_image("a", 5, 8), _image("b", 40, 8)]},
    }
    out = {}
    for n, (name, kw) in enumerate(cases.items()):
        tokens = kw.pop("tokens", TOKENS)
        if "prompt_embeds" in kw:
            tokens = None  # a prompt of embeddings: its token ids are placeholders
        out[name] = Request(f"r{n}", tokens, SamplingParams(max_tokens=1), None,
                            block_hasher=hasher, **kw)
    return out


def _connector_keys(request: Request) -> list[bytes]:
    """The keys the connector's scheduler side makes for the request (its own `_keys`)."""
    conn = SimpleNamespace(key_scheme=KeyScheme(BlockHasher("test-model|bf16")), block_size=BS,
                           fresh=Freshness())
    return KvcachedConnector._keys(conn, _ReqState(request), BLOCKS)


def test_the_connector_keys_blocks_apart_where_vllms_prefix_cache_does():
    reqs = _requests()
    vllm = {name: list(r.block_hashes[:BLOCKS]) for name, r in reqs.items()}
    ours = {name: _connector_keys(r) for name, r in reqs.items()}
    assert all(len(v) == BLOCKS for v in vllm.values()) and all(len(k) == BLOCKS for k in ours.values())
    wrong = [(a, b, i) for a, b in itertools.combinations(reqs, 2) for i in range(BLOCKS)
             if (vllm[a][i] == vllm[b][i]) != (ours[a][i] == ours[b][i])]
    assert not wrong, wrong
    # the cases do differ where they should (else the check above proves little)
    assert ours["base"] == ours["base again"] and ours["lora a"] == ours["lora a again"]
    assert ours["base"][:2] == ours["tokens differ from block 2"][:2]
    assert ours["base"][2] != ours["tokens differ from block 2"][2]
    assert ours["embeds 1"][:2] == ours["embeds 1, block 2 differs"][:2]
    assert ours["embeds 1"][2] != ours["embeds 1, block 2 differs"][2]
    assert all(ours["base"][i] != ours[name][i] for i in range(BLOCKS)
               for name in ("lora a", "lora b", "lora a, another path", "salt x", "salt y", "embeds 1"))
    assert ours["image a at 20"] == ours["image a at 20 again"] and ours["base"][0] == ours["image a at 20"][0]
    assert ours["image a at 20"][1] != ours["image a at 22"][1]  # the same image two tokens later


def test_a_plain_request_keeps_the_keys_it_had():
    """No adapter, salt or embeddings: the keys are the tokens' alone, as before and as the
    PrefixCacheManager and other engines make them, so what is stored stays a hit."""
    plain = _requests()["base"]
    assert _connector_keys(plain) == BlockHasher("test-model|bf16").hash_blocks(TOKENS, BS)[:BLOCKS]


def test_weights_quantized_at_load_and_config_overrides_change_the_namespace(tmp_path):
    """vLLM's own ModelConfig of one checkpoint: quantized at load, or with its config
    overridden (another RoPE base), it computes other KV, so its namespace differs; the same
    overrides give the same one, and a plain config adds nothing (its keys stay as they were).
    So does each other setting that changes the weights or the config."""
    import json
    import os
    import sys

    from vllm.config import LoadConfig, ModelConfig

    from kvcached_client.vllm.request_keys import model_factors

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    from vllm_model import write_model

    path = write_model(str(tmp_path / "model"))
    plain = ModelConfig(model=path)
    rope = [ModelConfig(model=path, hf_overrides={"rope_theta": 500000.0}) for _ in range(2)]
    other = ModelConfig(model=path, hf_overrides={"rope_theta": 250000.0})
    fp8 = ModelConfig(model=path, quantization="fp8")
    assert model_factors(plain) == ""
    assert model_factors(rope[0]) == model_factors(rope[1]) != model_factors(other)
    assert model_factors(rope[0]).startswith("-ov:") and model_factors(fp8) == "-q:fp8"
    # a config from elsewhere (another RoPE base), other model classes, another revision of the model's code, weights from another place,
    # another quantization config: each its own namespace, each the same again when repeated
    elsewhere = str(tmp_path / "config")
    os.makedirs(elsewhere)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(elsewhere, "config.json"), "w") as f:
        json.dump(dict(config, rope_theta=500000.0), f)
    llama = {"LlamaForCausalLM": "vllm.model_executor.models.llama:LlamaForCausalLM"}
    variants = [dict(hf_config_path=elsewhere), dict(model_class_overrides=llama),
                dict(code_revision="v2"), dict(model_weights="s3://bucket/other"),
                dict(quantization="fp8", quantization_config={"activation_scheme": "dynamic"})]
    factors = [model_factors(ModelConfig(model=path, **kw)) for kw in variants]
    assert len({"", *factors, model_factors(fp8)}) == len(variants) + 2, factors
    assert factors == [model_factors(ModelConfig(model=path, **kw)) for kw in variants]
    # weights loaded otherwise: vLLM's dummy (random) weights are not the checkpoint's
    assert model_factors(plain, None, LoadConfig()) == ""
    assert model_factors(plain, None, LoadConfig(load_format="dummy")) == "-load:dummy"


def test_prompt_embeddings_are_hashed_as_vllm_hashes_them_and_once():
    """A block's embedding hash is vLLM's own (taken from the request's cache of them where
    vLLM's block hasher made it, else made the same way and kept there)."""
    from vllm.v1.core.kv_cache_utils import _gen_prompt_embeds_extra_hash_keys

    from kvcached_client.vllm.request_keys import embeds_hash

    fresh = Request("e", None, SamplingParams(max_tokens=1), None, prompt_embeds=_embeds(3))
    assert fresh._prompt_embeds_per_block_hashes == {}
    mine = embeds_hash(fresh, BS, 2 * BS)  # made, and kept in the request's cache
    assert fresh._prompt_embeds_per_block_hashes == {(BS, 2 * BS): mine}
    fresh._prompt_embeds_per_block_hashes.clear()
    assert _gen_prompt_embeds_extra_hash_keys(fresh, BS, 2 * BS) == [("prompt_embeds", mine)]
    assert embeds_hash(fresh, 0, BS) != mine


def test_an_adapter_rewritten_in_place_gets_other_keys_at_the_next_start(tmp_path):
    """A LoRA adapter directory retrained and written where the old one was: a process started
    after it (here: the identity cache cleared) keys the adapter's blocks otherwise, so the
    daemon's disk or Redis tier never serves it the old adapter's KV; the same files keep
    their keys, and a path that is no directory keys as before."""
    from kvcached_client import hashing

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"\x01" * 64)
    (adapter / "adapter_config.json").write_text('{"r": 8}')

    def keys() -> list[bytes]:
        return _connector_keys(Request("l", TOKENS, SamplingParams(max_tokens=1), None,
                                       lora_request=LoRARequest("a", 1, str(adapter))))

    first = keys()
    hashing.path_identity.cache_clear()
    assert keys() == first  # the same files: the same keys, in any process
    os.utime(weights, ns=(1, 1))  # rewritten in place (the same size, another mtime)
    assert keys() == first  # this process read the adapter once: as vLLM, which loaded it once
    hashing.path_identity.cache_clear()
    assert keys() != first
    assert _connector_keys(_requests()["lora a"]) == _connector_keys(_requests()["lora a again"])
