"""Drives a real vLLM engine (CPU, or CUDA where vLLM's CUDA build is installed) through prefix
reuse; used by tests/integration/test_vllm.py and scripts/bench_vllm.py (run it with
.venv-vllm's python).

Writes a Llama checkpoint with real random weights (vllm_model.py; tiny by default: hidden 256,
4 layers, 4 heads, 2 KV heads, vocab 1024: outputs depend on every prompt token); --hidden, --layers, --heads, --kv-heads, --intermediate, --vocab and --block
change the shape), starts LLM(...) with the KvcachedConnector, vLLM's ExampleConnector, its
OffloadingConnector (CUDA only: --offload-gb of CPU memory) or none, then runs the steps given
on stdin, answering one marked JSON line per step on stdout:
--tp N runs N tensor-parallel CPU workers (their CPUs split between them) and, with the
kvcached connector, an --instance holding "{rank}" names one daemon per rank. --eagle DIR adds
speculative decoding with an EAGLE drafter (random weights) written to DIR. With --warm alone it
imports vLLM first and then reads those arguments as one JSON list on stdin: how EngineProcess
(vllm_engine_process.py) starts it, so that overlap_engines() can have one importing ahead.
  gen NAME [SALT]  greedy-generate prompt NAME (A, B, C: a shared prefix, different suffixes; D: the
             prefix's first half only; X: B with one prefix token changed, the control) after
             reset_prefix_cache(), with vLLM's cache_salt SALT if given; answers tokens,
             num_cached_tokens, seconds and reset (whether the reset took: it fails while a
             finished request's blocks are still held).
  ttft NAME  the same with one output token: the time to first token.
  genk NAME K  gen NAME with its first K blocks in vLLM's own prefix cache (a prompt sharing
             only those run first): the output of a K-block hit as vLLM itself computes it
             (its split of the prefill changes bf16 results, so a K-block hit from kvcached is
             compared with this, not with the full prefill).
  rpc METHOD [PATH]  LLM.collective_rpc(METHOD) (reload_weights: the weights loaded again in
             place; with PATH, reload_weights(weights_path=PATH): another checkpoint's).
  counters   the worker-side connector's counters (loaded_blocks, load_errors, saved_blocks,
             ...), through collective_rpc of a function (the scheduler re-keys after it, as
             after any function: ask at the end).
  start NAME K [STEPS]  (--inproc) add prompt NAME (greedy, K tokens) and step the engine until
             it has its first token (or STEPS steps: a prefill in chunks stopped part way): a
             request in flight across what the next steps do.
  abort NAME  (--inproc) abort request NAME (a client gone).
  finish     (--inproc) step until every request started is done; answers their tokens, and
             each NAME's prompt followed by its output becomes prompt NAME+ (a next turn).
  version V  LLM.update_weight_version(V).
  adapter DIR [inplace]  (--lora) the LoRA adapter in DIR (named after it) for the gen, genk,
             ttft and start steps that follow; with "inplace", vLLM's load_inplace (it loads the
             adapter's files again at every step); "adapter -": none.
  addlora DIR  (--lora) LLM.llm_engine.add_lora of DIR's adapter with load_inplace (the server's
             /v1/load_lora_adapter with load_inplace: true): its files loaded again now.
  batch      greedy-generate the batch of batch_prompts() (12 prompts over 4 shared prefixes) in
             one generate call after reset_prefix_cache(); answers every prompt's tokens,
             num_cached_tokens, the batch's seconds and (--inproc) how many times vLLM's
             scheduler preempted a request since the engine started.
  turns      the same for the next turn of each prompt of the last batch (the prompt followed by
             its output).
  quit
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_engine_process import (EngineProcess, overlap_engines, say,  # noqa: E402,F401 (theirs)
                                 wait_attached)
from vllm_model import CONFIG, config_for, write_eagle_draft, write_model  # noqa: E402

BLOCK = 32
PREFIX_BLOCKS = 14


def prompts(prefix_blocks: int = PREFIX_BLOCKS, block: int = BLOCK) -> dict[str, list[int]]:
    """A, B, C: one shared prefix of `prefix_blocks` blocks, different suffixes. D shares only
    the prefix's first half (its later blocks differ): a partial-prefix hit."""
    prefix = [(i * 37 + 11) % 1000 + 3 for i in range(prefix_blocks * block)]
    half = prefix_blocks // 2 * block
    return {"A": prefix + [(i * 13 + 5) % 1000 + 3 for i in range(40)],
            "B": prefix + [(i * 7 + 9) % 1000 + 3 for i in range(23)],
            "C": prefix + [(i * 3 + 1) % 1000 + 3 for i in range(31)],
            "D": prefix[:half] + [(i * 11 + 2) % 1000 + 3 for i in range(len(prefix) - half + 19)],
            "X": prefix[:100] + [prefix[100] % 1000 + 4] + prefix[101:] + [(i * 7 + 9) % 1000 + 3 for i in range(23)]}


PREFIX = prompts()["A"][: PREFIX_BLOCKS * BLOCK]


def batch_prompts(prefix_blocks: int = PREFIX_BLOCKS, groups: int = 4, per_group: int = 3) -> list[list[int]]:
    """`groups` prefixes of `prefix_blocks` blocks, each followed by `per_group` suffixes."""
    out = []
    for g in range(groups):
        prefix = [(i * 37 + 11 + 101 * g) % 1000 + 3 for i in range(prefix_blocks * BLOCK)]
        for j in range(per_group):
            out.append(prefix + [(i * (5 + 2 * j) + 7 * g + 1) % 1000 + 3 for i in range(17 + 9 * j)])
    return out


def _args(argv: list[str]):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--instance", default="")
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--connector", choices=["kvcached", "none", "example", "offloading"],
                    default="kvcached")
    ap.add_argument("--example-path", default="")
    ap.add_argument("--offload-gb", type=float, default=8.0,
                    help="offloading: the OffloadingConnector's CPU memory (cpu_bytes_to_use)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=CONFIG["hidden_size"])
    ap.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    ap.add_argument("--prefix-blocks", type=int, default=PREFIX_BLOCKS)
    ap.add_argument("--block", type=int, default=BLOCK, help="vLLM's block_size")
    ap.add_argument("--heads", type=int, default=CONFIG["num_attention_heads"])
    ap.add_argument("--kv-heads", type=int, default=CONFIG["num_key_value_heads"])
    ap.add_argument("--intermediate", type=int, default=0, help="MLP width (0: hidden * 11 / 4)")
    ap.add_argument("--vocab", type=int, default=CONFIG["vocab_size"])
    ap.add_argument("--gpu-mem", type=float, default=0.2, help="gpu_memory_utilization")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (float32: outputs "
                    "that do not depend on how a prefill is split)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="enable_prefix_caching=False (vLLM keeps no prefix cache of its own)")
    ap.add_argument("--num-blocks", type=int, default=0,
                    help="num_gpu_blocks_override: a KV pool this small preempts requests")
    ap.add_argument("--max-batched-tokens", type=int, default=0,
                    help="max_num_batched_tokens: prompts longer are prefilled in chunks")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="let vLLM capture CUDA graphs (default: enforce_eager)")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (one worker per rank)")
    ap.add_argument("--kv-role", choices=["kv_both", "kv_producer", "kv_consumer"], default="kv_both",
                    help="(kvcached) the connector's kv_role: kv_consumer stores nothing")
    ap.add_argument("--hang-s", type=float, default=0.0, help="the connector's hang_s (0: default)")
    ap.add_argument("--dummy-weights", action="store_true",
                    help="vLLM's load_format=dummy instead of real random weights (benchmarks of "
                         "large shapes, where writing a checkpoint would cost more than it tells)")
    ap.add_argument("--storage-hits", choices=["prefetch", "inline"], default="prefetch",
                    help="the connector's storage_hits")
    ap.add_argument("--layer-types", default="", help="comma-separated 'sliding' or 'full' per "
                    "layer (the config's layer_types: sliding-window layers of --sliding-window)")
    ap.add_argument("--sliding-window", type=int, default=64)
    ap.add_argument("--inproc", action="store_true", help="the engine core in this process "
                    "(VLLM_ENABLE_V1_MULTIPROCESSING=0): start and finish step it one by one")
    ap.add_argument("--async-scheduling", action="store_true", help="(--inproc) vLLM's async "
                    "scheduling, its default on CUDA (its CPU platform turns it off)")
    ap.add_argument("--lora", action="store_true", help="enable_lora (rank <= 8, 2 at once)")
    ap.add_argument("--kv-events", default="", help="publish vLLM's KV events on this zmq endpoint")
    ap.add_argument("--eagle", default="", help="speculative decoding with an EAGLE drafter "
                    "(2 tokens) written to this directory (random weights, the model's shape)")
    return ap.parse_args(argv)


def _bind_cpus(tp: int) -> None:
    """vLLM's CPU workers bind to one NUMA node each; on one node, split its CPUs by rank."""
    if tp > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        cpus = sorted(os.sched_getaffinity(0))
        per = max(1, len(cpus) // tp)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{cpus[min(r * per, len(cpus) - 1)]}-{cpus[min((r + 1) * per, len(cpus)) - 1]}"
            for r in range(tp))


def _keep_async_scheduling() -> None:
    """vLLM's CPU platform turns async scheduling off; on CUDA it is on by default. Kept on here,
    for an engine core in this process (--inproc), so the connector runs as it does on CUDA:
    a step scheduled before the last one's tokens are known."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    check = cls.check_and_update_config.__func__

    def keep(klass, vllm_config):
        check(klass, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    cls.check_and_update_config = classmethod(keep)


def _engine(args):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if args.connector == "kvcached":
        extra = {"instance": args.instance, "run_dir": args.run_dir, "timeout_s": 5,
                 "storage_hits": args.storage_hits}
        if args.hang_s:
            extra["hang_s"] = args.hang_s
        kv = KVTransferConfig(kv_connector="KvcachedConnector",
                              kv_connector_module_path="kvcached_client.vllm", kv_role=args.kv_role,
                              kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    elif args.connector == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": args.example_path})
    elif args.connector == "offloading":
        kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": int(args.offload_gb * 2**30)})
    if args.async_scheduling:
        _keep_async_scheduling()
    return LLM(model=args.model_dir, skip_tokenizer_init=True,
               async_scheduling=True if args.async_scheduling else None,
               load_format="dummy" if args.dummy_weights else "auto",
               enforce_eager=not args.cuda_graphs, block_size=args.block, seed=0,
               max_model_len=max(1024, (args.prefix_blocks + 4) * args.block),
               dtype=args.dtype, kv_transfer_config=kv, gpu_memory_utilization=args.gpu_mem,
               num_gpu_blocks_override=args.num_blocks or None,
               enable_prefix_caching=not args.no_prefix_caching,
               max_num_batched_tokens=args.max_batched_tokens or None,
               tensor_parallel_size=args.tp, enable_lora=args.lora,
               kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": args.kv_events} if args.kv_events else None,
               **({"max_lora_rank": 8, "max_loras": 2} if args.lora else {}),
               speculative_config={"method": "eagle", "model": args.eagle,
                                   "num_speculative_tokens": 2} if args.eagle else None)


def _write_checkpoints(args) -> None:
    """The model's checkpoint (its config alone for dummy weights) and the EAGLE drafter's."""
    config = config_for(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate,
                        args.vocab)
    if args.layer_types:  # as interleaved models (GPT-OSS, Gemma 3) name theirs
        config.update(layer_types=[f"{t}_attention" for t in args.layer_types.split(",")],
                      sliding_window=args.sliding_window)
    if args.dummy_weights:  # written once: its modification time is part of the keys' namespace
        os.makedirs(args.model_dir, exist_ok=True)  # (weights_identity), so an engine started
        path = os.path.join(args.model_dir, "config.json")  # again on it finds what one stored
        text = json.dumps(config)
        if not os.path.exists(path) or _read(path) != text:
            with open(path, "w") as f:
                f.write(text)
    else:
        write_model(args.model_dir, config)
    if args.eagle:
        write_eagle_draft(args.eagle, config)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _worker_counters(_worker) -> dict:
    """In a worker: its connector's counters (what its loads and saves did)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(getattr(get_kv_transfer_group(), "counters", {}))


def _scheduler(llm):
    """(--inproc) vLLM's scheduler, in this process."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def _count_preemptions(llm) -> dict:
    """(--inproc) {"n": how many times the scheduler preempted a request}, counted from now."""
    scheduler = _scheduler(llm)
    preempt, count = scheduler._preempt_request, {"n": 0}

    def counted(*args, **kwargs):
        count["n"] += 1
        return preempt(*args, **kwargs)

    scheduler._preempt_request = counted
    return count


def _ready(llm, inproc: bool) -> dict:
    """The engine's answer once it started: how it schedules, and (--inproc) whether its
    scheduler drops a preempted request's in-flight output (its connector's
    requires_kv_delivery)."""
    out = {"ready": True,
           "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling}
    if inproc:
        out["requires_kv_delivery"] = _scheduler(llm).requires_kv_delivery
    return out


def _reset(llm, inproc: bool) -> bool:
    """reset_prefix_cache(): False while a finished request holds blocks (the connector's
    transfers are reported at a later step: in this process, this steps the engine for them)."""
    for _ in range(20 if inproc else 1):
        if llm.reset_prefix_cache():
            return True
        if inproc and not llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
    return False


_ADAPTER_IDS: dict[str, int] = {}  # an adapter's lora_int_id, by name: the same for each use


def _lora(path: str, inplace: bool = False):
    from vllm.lora.request import LoRARequest

    name = os.path.basename(os.path.normpath(path))
    return LoRARequest(name, _ADAPTER_IDS.setdefault(name, len(_ADAPTER_IDS) + 1), path,
                       load_inplace=inplace)


def _control(llm, cmd: list[str], prompt_ids: dict, adapter: dict) -> dict:
    """rpc, counters, start, abort, finish, version, adapter, addlora: the engine told or asked
    something."""
    if cmd[0] == "adapter":
        adapter["lora"] = None if cmd[1] == "-" else _lora(cmd[1], cmd[2:] == ["inplace"])
        return {"adapter": cmd[1:]}
    if cmd[0] == "addlora":
        return {"added": llm.llm_engine.add_lora(_lora(cmd[1], inplace=True))}
    if cmd[0] == "rpc":  # e.g. reload_weights: vLLM's weights changed in place
        llm.collective_rpc(cmd[1], kwargs={"weights_path": cmd[2]} if len(cmd) > 2 else None)
        return {"rpc": cmd[1]}
    if cmd[0] == "counters":
        return {"counters": llm.collective_rpc(_worker_counters)}
    if cmd[0] == "version":
        llm.update_weight_version(cmd[1])
        return {"version": llm.get_weight_version()}
    return _in_flight(llm, cmd, prompt_ids, adapter["lora"])


def _in_flight(llm, cmd: list[str], prompt_ids: dict, lora) -> dict:
    """start NAME K [STEPS] / abort NAME / finish: requests stepped one engine step at a time
    (--inproc)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    if cmd[0] == "abort":  # (its end is reported at later steps: the next reset steps for it)
        engine.abort_request([cmd[1]])
        return {"aborted": cmd[1]}
    if cmd[0] == "start":
        engine.add_request(cmd[1], TokensPrompt(prompt_token_ids=prompt_ids[cmd[1]]),
                           SamplingParams(temperature=0.0, max_tokens=int(cmd[2]), detokenize=False),
                           lora_request=lora)
        started, steps = False, int(cmd[3]) if len(cmd) > 3 else None
        while engine.has_unfinished_requests() and (not started if steps is None else steps > 0):
            # (a request that ends without a token ends the loop too)
            started |= any(o.request_id == cmd[1] and o.outputs[0].token_ids for o in engine.step())
            steps = steps - 1 if steps is not None else None
        return {"started": cmd[1] if started else None}
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    for name, tokens in outputs.items():
        prompt_ids[name + "+"] = prompt_ids[name] + tokens
    return {"outputs": outputs}


def _environment(args) -> None:
    """vLLM's environment settings for this engine, set before it starts."""
    # vLLM's CPU backend reserves one more core when any connector is configured, which changes
    # float results on a small machine: reserve alike with and without one
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(args.tp))
    if args.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif args.async_scheduling:
        raise SystemExit("--async-scheduling needs --inproc (the engine core in this process)")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # counters: a function RPC
    if {"sliding", "full"} <= set(args.layer_types.split(",")):
        # vLLM's CPU attention plans a decode's KV splits once for the group, with no window
        # when sliding and full layers share it; called directly, a sliding layer's decode so
        # planned came out NaN after a call that had left NaN in the kernel's scratch (vec
        # ISA: 10 runs of 10 at 2 threads, 4 of 6 at 4; AMX at 4 threads: 0 of 6; splits off, at
        # 2 or 4: 0 of 10) - the greedy token 0, as CI saw once. Outputs are otherwise the same
        # with the splits off (unless set).
        os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
    _bind_cpus(args.tp)


def _import_vllm() -> None:
    """What every engine imports (most of a start's time): done before the arguments are read."""
    import vllm.config  # noqa: F401
    import vllm.inputs  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401


def _argv() -> list[str] | None:
    """The arguments: the command line's, or with --warm (vllm_engine_process.WarmPool) vLLM
    imported first and then the JSON list on stdin; None when none ever came (never taken)."""
    if sys.argv[1:] != ["--warm"]:
        return sys.argv[1:]
    _import_vllm()
    line = sys.stdin.readline()
    return json.loads(line) if line else None


def main() -> int:
    import time

    argv = _argv()
    if argv is None:
        return 0
    args = _args(argv)
    _write_checkpoints(args)
    _environment(args)
    prompt_ids = prompts(args.prefix_blocks, args.block)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)
    first_token = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    say(_ready(llm, args.inproc))
    batch = {"batch": [TokensPrompt(prompt_token_ids=p) for p in batch_prompts(args.prefix_blocks)]}
    adapter = {"lora": None}  # the LoRA adapter of the steps that follow (the adapter step)
    preempted = _count_preemptions(llm) if args.inproc else {"n": None}
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        reset = _reset(llm, args.inproc)
        start = time.perf_counter()
        if cmd[0] in ("batch", "turns"):
            outs = llm.generate(batch[cmd[0]], params, use_tqdm=False)
            if cmd[0] == "batch":  # each prompt followed by its output: the next turns
                batch["turns"] = [TokensPrompt(prompt_token_ids=p["prompt_token_ids"]
                                               + list(o.outputs[0].token_ids))
                                  for p, o in zip(batch["batch"], outs)]
            say({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                 "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs],
                 "seconds": time.perf_counter() - start, "reset": reset,
                 "preemptions": preempted["n"]})
        elif cmd[0] == "genk":
            k = int(cmd[2]) * args.block
            head = prompt_ids[cmd[1]][:k] + [7] * 40
            llm.generate([TokensPrompt(prompt_token_ids=head)], first_token, use_tqdm=False,
                         lora_request=adapter["lora"])
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids[cmd[1]])], params,
                               use_tqdm=False, lora_request=adapter["lora"])[0]
            say({"name": cmd[1], "tokens": list(out.outputs[0].token_ids),
                 "num_cached_tokens": out.num_cached_tokens or 0, "reset": reset})
        elif cmd[0] in ("rpc", "counters", "start", "abort", "finish", "version", "adapter", "addlora"):
            say(dict(_control(llm, cmd, prompt_ids, adapter), reset=reset))
        elif cmd[0] in ("gen", "ttft"):
            prompt = TokensPrompt(prompt_token_ids=prompt_ids[cmd[1]])
            if len(cmd) > 2:
                prompt["cache_salt"] = cmd[2]  # vLLM's per-request salt (a tenant's)
            out = llm.generate([prompt], params if cmd[0] == "gen" else first_token,
                               use_tqdm=False, lora_request=adapter["lora"])[0]
            say({"name": cmd[1], "tokens": list(out.outputs[0].token_ids),
                 "num_cached_tokens": out.num_cached_tokens or 0,
                 "seconds": time.perf_counter() - start, "reset": reset})
    return 0

if __name__ == "__main__":
    sys.exit(main())
