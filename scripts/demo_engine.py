"""A demo engine on a real transformer: paged KV, PrefixCacheManager, kvcached (run by run.sh).

A small Llama built from a config with random weights (no download) serves requests that share
a long prefix. Its KV lives in a paged cache registered with the daemon; a PrefixCacheManager
hands out blocks, reuses prefixes and offloads evicted blocks. The script times the first
token of one prompt four ways - recomputed, a GPU-cache hit, a host-tier hit (the engine's
cache dropped), a disk-tier hit (the daemon restarted) - and checks that greedy decoding after
each load gives the same logits (allclose at the dtype's tolerance) and tokens as the recompute.

    python scripts/demo_engine.py --run-dir var/run --storage disk:///abs/var/disk
"""
from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import time
import uuid

import torch

from kvcached_client import allocate_kv_cache, launch, make_namespace
from kvcached_client.prefix import PrefixCacheManager

class ShortLoad(Exception):
    """A load ended short while the forward was running: redo it from fewer cached tokens."""


TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def cache_arg(model) -> str:
    """The forward's name for the KV cache passed in: `cache` since transformers 5.24
    (`past_key_values` is deprecated there), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def build_model(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seed: int = 0,
                dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=16384)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval()


class DemoEngine:
    """One request at a time, prefill then greedy decode, KV in `kv` pages of block_size."""

    def __init__(self, model, manager: PrefixCacheManager, kv, block_size: int, layerwise: bool = True):
        self.model, self.mgr, self.kv, self.bs = model, manager, kv, block_size
        self.cfg = model.config
        self.cache_arg = cache_arg(model)
        self.layerwise = layerwise
        self._pending_layers: dict[int, object] = {}
        if layerwise:
            for layer in model.model.layers:
                layer.register_forward_pre_hook(self._before_layer)

    # paged KV <-> the model's cache ---------------------------------------------------
    def _gather(self, layer: int, blocks: list[int]):
        k, v = self.kv[layer]
        idx = torch.as_tensor(blocks, dtype=torch.long)
        def flat(t):  # [n, bs, H, D] -> [1, H, n*bs, D]
            return t[idx].reshape(-1, *t.shape[2:]).permute(1, 0, 2).unsqueeze(0)
        return flat(k), flat(v)

    def _scatter(self, cache, table: list[int], start: int, end: int) -> None:
        for layer in range(self.cfg.num_hidden_layers):
            keys, values = cache.layers[layer].keys, cache.layers[layer].values
            for pos in range(start - start % self.bs, end, self.bs):
                lo, hi = max(pos, start), min(pos + self.bs, end)
                block = table[pos // self.bs]
                for dst, src in ((self.kv[layer][0], keys), (self.kv[layer][1], values)):
                    dst[block, lo - pos:hi - pos] = src[0, :, lo:hi].permute(1, 0, 2)

    def _before_layer(self, module, args):
        fill = self._pending_layers.pop(module.self_attn.layer_idx, None)
        if fill is not None:
            fill()

    def _cache_for(self, rid, table: list[int], computed: int):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.cfg)
        blocks = table[: computed // self.bs]
        if not blocks:
            return cache, computed
        for layer in range(self.cfg.num_hidden_layers):
            def fill(layer=layer):
                if self.layerwise and self.mgr.wait_layer(rid, layer) < computed:
                    raise ShortLoad(f"layer {layer}")
                k, v = self._gather(layer, blocks)
                cache.layers[layer].update(k, v)
            if layer == 0 or not self.layerwise:
                fill()
            else:
                self._pending_layers[layer] = fill  # filled when the layer is reached
        return cache, computed

    def _prefill(self, rid, prompt, computed: int, layerwise: bool):
        table = self.mgr.allocate(rid, len(prompt) - computed)
        saved, self.layerwise = self.layerwise, layerwise
        try:
            cache, computed = self._cache_for(rid, table, computed)
            ids = torch.as_tensor(prompt[computed:])[None]
            pos = torch.arange(computed, len(prompt))[None]
            out = self.model(ids, **{self.cache_arg: cache}, position_ids=pos, use_cache=True)
        finally:
            self.layerwise = saved
            self._pending_layers.clear()
        return out, cache, table, computed

    # requests -------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, rid, prompt: list[int], max_new_tokens: int = 4) -> dict:
        """Prefill + greedy decode; returns tokens, per-step logits, TTFT and the match."""
        start = time.perf_counter()
        hit = self.mgr.match(rid, prompt)
        computed = self.mgr.wait_layer(rid, 0) if self.layerwise else self.mgr.wait_loaded(rid)
        try:
            out, cache, table, computed = self._prefill(rid, prompt, computed, self.layerwise)
        except ShortLoad:  # a load failed under the forward: take what is valid, compute the rest
            out, cache, table, computed = self._prefill(rid, prompt, self.mgr.wait_loaded(rid), False)
        logits = [out.logits[0, -1].float()]
        token = int(logits[-1].argmax())
        ttft = time.perf_counter() - start
        self._scatter(cache, table, computed, len(prompt))
        self.mgr.commit(rid, len(prompt))
        seq = list(prompt) + [token]
        for _ in range(max_new_tokens - 1):
            table = self.mgr.allocate(rid, 1)
            out = self.model(torch.tensor([[token]]), **{self.cache_arg: cache},
                             position_ids=torch.tensor([[len(seq) - 1]]), use_cache=True)
            self._scatter(cache, table, len(seq) - 1, len(seq))
            self.mgr.commit(rid, len(seq), seq)
            logits.append(out.logits[0, -1].float())
            token = int(logits[-1].argmax())
            seq.append(token)
        self.mgr.release(rid)
        return {"tokens": seq[len(prompt):], "logits": torch.stack(logits), "ttft_s": ttft,
                "match": hit, "computed": computed}


def same_continuation(a: dict, b: dict, dtype) -> bool:
    rtol, atol = TOLERANCE.get(dtype, (1e-3, 1e-3))
    return a["tokens"] == b["tokens"] and torch.allclose(a["logits"], b["logits"], rtol=rtol, atol=atol)


def run(args) -> dict:
    dtype = getattr(torch, args.dtype)
    model = build_model(args.hidden, args.layers, args.heads, args.kv_heads, args.vocab, dtype=dtype)
    head_dim = args.hidden // args.heads
    prompt_tokens = args.prefix_tokens + args.suffix_tokens
    num_blocks = max(args.gpu_blocks, 2 * (-(-(prompt_tokens + args.decode_tokens) // args.block_size)))
    kv = allocate_kv_cache(args.layers, num_blocks, (args.block_size, args.kv_heads, head_dim), dtype)
    extra = [a for uri in args.storage for a in ("--storage", uri)]

    def start():  # once its disk index is rebuilt: the disk-hit row must see what disk holds
        return launch(instance=args.instance, run_dir=args.run_dir, host_cache_gb=args.host_cache_gb,
                      extra_args=extra, wait_storage=True)

    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, args.vocab, (args.prefix_tokens,), generator=gen).tolist()
    prompt = prefix + torch.randint(0, args.vocab, (args.suffix_tokens,), generator=gen).tolist()
    # a namespace of this run's own: the disk tier keeps earlier runs' blocks of the same
    # prompt, and the "recompute" row must compute (not load them)
    run_id = uuid.uuid4().hex[:8]
    namespace = make_namespace("demo-llama", args.dtype, f"bs{args.block_size}", tenant=f"run-{run_id}")
    print(f"[demo] run {run_id}: its own key namespace, so nothing from earlier runs is a hit")
    daemon = start()
    results = {}
    try:
        mgr = PrefixCacheManager(num_blocks, args.block_size, client=daemon.connect(name="demo-engine"),
                                 namespace=namespace, kv_caches=kv, write_policy="write_through")
        engine = DemoEngine(model, mgr, kv, args.block_size, layerwise=not args.no_layerwise)
        engine.generate("warmup", torch.randint(0, args.vocab, (64,)).tolist(), 1)
        results["recompute"] = engine.generate("recompute", prompt, args.decode_tokens)
        results["gpu hit"] = engine.generate("gpu", prompt, args.decode_tokens)
        mgr.settle(timeout=30)  # write-through copies in the host tier
        mgr.drop_gpu_cache()
        results["host hit"] = engine.generate("host", prompt, args.decode_tokens)
        if args.storage:
            mgr.settle(timeout=30)
            mgr.client.flush().wait(timeout=60)
            daemon.stop()
            daemon = start()  # the host tier is gone; the disk tier is found
            mgr.drop_gpu_cache()
            if not mgr.try_attach():
                raise SystemExit("[demo] the manager did not reattach to the restarted daemon")
            results["disk hit"] = engine.generate("disk", prompt, args.decode_tokens)
        print_table(results, dtype)
        print(f"[demo] manager counters: {mgr.stats()}")
        mgr.close()
        if args.status:
            print()
            subprocess.run([sys.executable, "-m", "kvcached", "status", "--instance", args.instance,
                            "--run-dir", args.run_dir], check=True)
    finally:
        code = daemon.stop()
        print(f"[demo] daemon stopped (exit code {code})")
    return results


def print_table(results: dict, dtype) -> None:
    base = results["recompute"]
    print(f"\n{'case':<10} {'cached tokens':>14} {'(gpu/host/disk)':>18} {'TTFT ms':>9} "
          f"{'vs recompute':>13}  same logits+tokens")
    for name, r in results.items():
        m = r["match"]
        tiers = f"{m.gpu_tokens}/{m.host_tokens}/{m.storage_tokens}"
        print(f"{name:<10} {r['computed']:>14} {tiers:>18} {r['ttft_s'] * 1e3:>9.1f} "
              f"{r['ttft_s'] / base['ttft_s']:>12.2f}x  {same_continuation(r, base, dtype)}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instance", default="demo")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--storage", action="append", default=[], help="storage URI (repeatable)")
    ap.add_argument("--host-cache-gb", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--gpu-blocks", type=int, default=0, help="engine blocks (default: 2 prompts)")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=4)
    ap.add_argument("--no-layerwise", action="store_true", help="wait for whole loads, not per layer")
    ap.add_argument("--status", action="store_true", help="print the daemon's status table at the end")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run(args)
    base = results["recompute"]
    ok = all(same_continuation(r, base, getattr(torch, args.dtype)) for r in results.values())
    if not ok:
        print("[demo] FAILED: a continuation after a load differs from the recompute")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
