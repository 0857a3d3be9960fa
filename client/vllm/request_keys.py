"""What besides its tokens and multimodal items decides a vLLM request's KV, as vLLM's own prefix
cache keys its blocks (`generate_block_hash_extra_keys` in vllm/v1/core/kv_cache_utils.py):

- its LoRA adapter, name and path (every block): an adapter on the K and V projections
  changes every layer's KV after the first; a local adapter directory's files too (names, sizes,
  mtimes), so a retrained adapter written over the old one is not served the old one's KV
  after a restart; read again where vLLM loads the adapter again (`load_inplace`, or
  `add_lora` of a name it had: freshness.py), and for an adapter that is no directory, a
  salt drawn at each such reload;
- its cache salt (the first block, so every block after it too: keys are chained), which is
  how vLLM keeps one tenant's prefixes from another's;
- its prompt embeddings (each block, the hash of its rows): such a prompt's token ids are
  placeholders, so two of one length have the same tokens and different KV.

Without these the connector served a LoRA request the base model's KV (or another adapter's),
and shared prefixes across cache salts and across prompt-embedding requests. A request with none
of them is keyed by its tokens (and items) alone, as before.

What of a deployment (beyond the checkpoint and the dtypes) changes every block's KV goes into
the namespace (`model_factors`); EAGLE's last block of a hit is dropped (`drops_last_block`).
"""
from __future__ import annotations

import hashlib
import json
from typing import Callable

import torch

from ..hashing import path_identity, short_digest, weights_identity
from ..key_scheme import request_parts as key_parts


def request_parts(request, block_size: int, adapters=None) -> Callable[[int], tuple] | None:
    """block i -> the parts of its key beyond tokens and multimodal items (KeyScheme.extend's
    `block_parts`), for a vLLM `Request` in blocks of `block_size` tokens; None when there are
    none. `adapters` (freshness.Freshness): the files of an adapter vLLM reloads at every step
    as read this step, and an adapter's salt since vLLM last loaded it again."""
    lora = getattr(request, "lora_request", None)
    embeds = getattr(request, "prompt_embeds", None)
    adapter = None
    if lora:
        path = str(getattr(lora, "lora_path", "") or "")
        inplace = adapters is not None and bool(getattr(lora, "load_inplace", False))
        adapter = f"lora\0{lora.lora_name}\0{path}" + adapter_identity(
            path, adapters.identity if inplace else path_identity)
        salt = adapters.adapter_salts.get(lora.lora_name) if adapters is not None else None
        if salt:
            adapter += "\0reloaded:" + salt

    def embeds_of(i: int) -> tuple:
        return (b"prompt_embeds\0" + embeds_hash(request, i * block_size, (i + 1) * block_size),)

    return key_parts(adapter, getattr(request, "cache_salt", None),
                     embeds_of if embeds is not None else None)


def adapter_identity(path: str, read=path_identity) -> str:
    """A local adapter directory's identity (its files' names, sizes and mtimes), read once per
    process (`path_identity`) or as `read` has it (vLLM loads it again: freshness.py): an
    adapter retrained and written where the old one was gets other keys at the next start or
    load, so the daemon's tiers never serve it the old adapter's KV. "" for a path that is no
    directory (a hub id, an adapter in memory): its keys stay as they were."""
    ident = read(path) if path else ""
    return "\0" + ident if ident.startswith("files:") else ""


def embeds_hash(request, start: int, end: int) -> bytes:
    """sha256 of the bytes of rows [start, end) of the request's prompt embeddings, as vLLM's
    block hash has it: taken from the request's own cache of them where vLLM made it (a long
    prompt's embeddings are hashed once), else made and kept there."""
    cache = getattr(request, "_prompt_embeds_per_block_hashes", None)
    found = cache.get((start, end)) if isinstance(cache, dict) else None
    if found is None:
        rows = request.prompt_embeds[start:end].detach().to("cpu").contiguous()
        found = hashlib.sha256(rows.reshape(-1).view(torch.uint8).numpy().tobytes()
                               if rows.numel() else b"").digest()
        if isinstance(cache, dict):
            cache[(start, end)] = found
    return found


def model_factors(model, speculative=None, load=None) -> str:
    """What of vLLM's ModelConfig changes the KV beyond the checkpoint (whose identity and
    config.json the namespace has) and the dtypes: weights quantized at load (`quantization`,
    `quantization_config`), a config other than the checkpoint's (`hf_overrides`, e.g. another
    RoPE scaling, or `hf_config_path`: the config's digest), other model classes
    (`model_class_overrides`), another revision of a model's own code (`code_revision`),
    weights from elsewhere (`model_weights`) or loaded otherwise (LoadConfig's `load_format`
    other than "auto": `dummy` weights are random, `bitsandbytes` quantizes); and a speculative
    decoder whose layers have KV in the blocks (EAGLE, a draft model: their KV is the draft's,
    so another draft, or none, pages other bytes). "" when none is set, so the keys of a plain
    deployment stay as they were."""
    out = ""
    quant = getattr(model, "quantization", None)
    if quant:
        out += f"-q:{quant}"
    if getattr(model, "quantization_config", None):
        out += "-qc:" + short_digest(_text(model.quantization_config))
    if getattr(model, "hf_overrides", None) or getattr(model, "hf_config_path", None):
        config = model.hf_config
        text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") \
            else repr(config)
        out += "-ov:" + short_digest(text)
    if getattr(model, "model_class_overrides", None):
        out += "-cls:" + short_digest(_text(model.model_class_overrides))
    if getattr(model, "code_revision", None):
        out += f"-code:{model.code_revision}"
    if getattr(model, "model_weights", None):
        out += "-w:" + short_digest(str(model.model_weights))
    load_format = str(getattr(load, "load_format", "auto") or "auto")
    if load_format != "auto":
        out += f"-load:{load_format}"
    draft = getattr(speculative, "draft_model_config", None)
    if draft is not None and getattr(speculative, "uses_draft_kv_cache", lambda: True)():
        out += "-sd:" + short_digest("\0".join((
            str(speculative.method), str(draft.model), str(draft.dtype),
            weights_identity(str(draft.model), getattr(draft, "revision", None)),
            model_factors(draft))))
    return out


def drops_last_block(speculative) -> bool:
    """EAGLE-style decoding writes a block's last slot of the drafter's KV with the token after
    the block (a lookahead), which another request sharing the block need not have: vLLM's own
    prefix cache drops the last block of every hit then (`use_eagle_block_drop`), and so does
    the connector's."""
    return bool(getattr(speculative, "use_eagle_block_drop", lambda: False)())


def _text(value) -> str:
    """A setting as text that is the same for equal settings (a dict's keys sorted)."""
    try:
        return json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return repr(value)
