"""A small Llama with real random weights, written as a checkpoint vLLM loads (config.json +
model.safetensors), for tests and benchmarks that must see wrong KV.

vLLM's `load_format="dummy"` fills every weight uniformly in +-1e-3: the logits come out nearly
uniform and the output ignores the prompt, so "equal to a run without the connector" proves
nothing. Here embeddings have std 1, norms 1, the MLP std 0.05 (down 0.02) and attention sharp
enough to carry early tokens to the end (q, k 0.15, v 0.1, o 0.06): changing one token of a
470-token prompt, at position 5, 100 or 300, changes the greedy output (measured with
transformers; with every projection at 0.05/0.02 it did not at 100). Every test that compares
outputs checks such a control.
"""
from __future__ import annotations

import json
import os

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


def config_for(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=0, vocab=1024) -> dict:
    return dict(CONFIG, hidden_size=hidden, intermediate_size=intermediate or hidden * 11 // 4,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, vocab_size=vocab)


def _weights(config: dict, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, v, m = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    head = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rnd(v, h, std=1.0),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
         "lm_head.weight": rnd(v, h, std=0.05)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(h, h, std=0.15),
                  p + "self_attn.k_proj.weight": rnd(kv, h, std=0.15),
                  p + "self_attn.v_proj.weight": rnd(kv, h, std=0.1),
                  p + "self_attn.o_proj.weight": rnd(h, h, std=0.06),
                  p + "mlp.gate_proj.weight": rnd(m, h, std=0.05),
                  p + "mlp.up_proj.weight": rnd(m, h, std=0.05),
                  p + "mlp.down_proj.weight": rnd(h, m, std=0.02),
                  p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    return w


def write_model(model_dir: str, config: dict | None = None, seed: int = 0) -> str:
    """Write the checkpoint (once: an existing one of the same config and seed is kept)."""
    from safetensors.torch import save_file

    config = dict(config or CONFIG, kvcached_test_seed=seed)
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, "config.json")
    if os.path.exists(path) and os.path.exists(os.path.join(model_dir, "model.safetensors")):
        with open(path) as f:
            if json.load(f) == config:
                return model_dir
    save_file(_weights(config, seed), os.path.join(model_dir, "model.safetensors"))
    with open(path, "w") as f:
        json.dump(config, f)
    return model_dir


def write_eagle_draft(model_dir: str, config: dict | None = None, seed: int = 1) -> str:
    """An EAGLE drafter for the model of `config`: one decoder layer of its shape, its embedding
    and the `fc` that joins a token's embedding to the target's hidden state, named as EAGLE
    checkpoints name them (no `model.` prefix; no input norm in its layer, no final norm or
    lm_head: vLLM shares the target's)."""
    import torch
    from safetensors.torch import save_file

    config = dict(config or CONFIG, num_hidden_layers=1, kvcached_test_seed=seed)
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, "config.json")
    if os.path.exists(path) and os.path.exists(os.path.join(model_dir, "model.safetensors")):
        with open(path) as f:
            if json.load(f) == config:  # written already (its identity, mtimes too, kept)
                return model_dir
    full = _weights(config, seed)
    weights = {name.removeprefix("model."): w for name, w in full.items()
               if name.startswith(("model.layers.", "model.embed_tokens."))
               and not name.endswith("layers.0.input_layernorm.weight")}  # EAGLE has none
    h = config["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1000)
    weights["fc.weight"] = (torch.randn(h, 2 * h, generator=gen) * 0.05).to(torch.bfloat16)
    save_file(weights, os.path.join(model_dir, "model.safetensors"))
    with open(path, "w") as f:
        json.dump(config, f)
    return model_dir


def write_lora(adapter_dir: str, config: dict | None = None, seed: int = 1, rank: int = 8) -> str:
    """A PEFT LoRA adapter for the model of `config` (adapter_config.json +
    adapter_model.safetensors, as PEFT saves one) on every attention projection, A and B of
    std 0.1 at alpha 2r: a delta of about a third of the base q/k weights, so it changes every
    layer's KV after the first and the greedy output (the tests' controls check that). Written
    every time (an adapter retrained in place: other files, new mtimes)."""
    import torch
    from safetensors.torch import save_file

    config = config or CONFIG
    gen = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    outs = {"q_proj": h, "k_proj": kv, "v_proj": kv, "o_proj": h}
    weights = {}
    for i in range(config["num_hidden_layers"]):
        for module, out in outs.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{module}."
            weights[p + "lora_A.weight"] = (torch.randn(rank, h, generator=gen) * 0.1).to(torch.bfloat16)
            weights[p + "lora_B.weight"] = (torch.randn(out, rank, generator=gen) * 0.1).to(torch.bfloat16)
    os.makedirs(adapter_dir, exist_ok=True)
    save_file(weights, os.path.join(adapter_dir, "adapter_model.safetensors"))
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                   "lora_alpha": 2 * rank, "target_modules": list(outs), "bias": "none",
                   "kvcached_test_seed": seed}, f)
    return adapter_dir
