"""Drives a real vLLM engine (CPU) through the prefix-reuse scenario; run by test_vllm.py.

Writes a tiny Llama config, starts LLM(...) with or without the KvcachedConnector, then runs
the steps the test asks for on stdin, one JSON line per step on stdout:
  gen NAME  - greedy-generate prompt NAME after reset_prefix_cache(); prints tokens and
              num_cached_tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
BLOCK = 32
PREFIX = [(i * 37 + 11) % 1000 + 3 for i in range(14 * BLOCK)]  # 448 tokens
PROMPTS = {
    "A": PREFIX + [(i * 13 + 5) % 1000 + 3 for i in range(40)],
    "B": PREFIX + [(i * 7 + 9) % 1000 + 3 for i in range(23)],
    "C": PREFIX + [(i * 3 + 1) % 1000 + 3 for i in range(31)],
}


MARK = "@@kvcached-driver "  # vLLM logs to stdout too: our lines carry this mark


def say(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--instance", default="")
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--connector", choices=["kvcached", "none", "example"], default="kvcached")
    ap.add_argument("--example-path", default="")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    os.makedirs(args.model_dir, exist_ok=True)
    with open(os.path.join(args.model_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if args.connector == "kvcached":
        kv = KVTransferConfig(kv_connector="KvcachedConnector",
                              kv_connector_module_path="kvcached_client.vllm", kv_role="kv_both",
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"instance": args.instance,
                                                         "run_dir": args.run_dir, "timeout_s": 5})
    elif args.connector == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": args.example_path})
    llm = LLM(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, block_size=BLOCK, max_model_len=1024, seed=0,
              dtype="bfloat16", kv_transfer_config=kv, gpu_memory_utilization=0.2)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)
    say({"ready": True})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        if cmd[0] == "gen":
            import time

            llm.reset_prefix_cache()
            start = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[cmd[1]])], params,
                               use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            say({"name": cmd[1], "tokens": list(out.outputs[0].token_ids),
                 "num_cached_tokens": out.num_cached_tokens or 0, "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
