"""Why a layer-wise load slows the forward (the transfer bench's overlap case): the 32-layer
forward of `kvcached bench transfer` timed alone and while another process runs (a) DMA-only
H2D copies, (b) small index kernels (what the gather strategy queues per layer), (c) both.
Run on a GPU machine with the checkout on PYTHONPATH: `python3 scripts/gpu_contention.py`.
Each line is the median of 7 forwards; the ratio is against the forward alone in the same run."""
import subprocess
import sys
import time

import torch

if sys.argv[1:2] == ["child"]:
    mode = sys.argv[2]
    dev = torch.device("cuda:0")
    host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    d = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    src = torch.randn(242 * 2, 16384, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    idx = torch.randperm(242 * 2, device=dev)
    s = torch.cuda.Stream()
    print("READY", flush=True)
    end = time.monotonic() + 8
    with torch.cuda.stream(s):
        while time.monotonic() < end:
            for _ in range(20):
                if mode in ("dma", "both"):
                    d[: 16 << 20].copy_(host[: 16 << 20], non_blocking=True)
                if mode in ("kernel", "both"):
                    dst.index_copy_(0, idx, src)
            s.synchronize()
    sys.exit(0)

from kvcached.bench.transfer_blocks import LAYERS  # noqa: E402
from kvcached.bench.transfer_cuda import Forward, _timed  # noqa: E402

dev = torch.device("cuda:0")
fwd = Forward(2048, dev)
kv = [(torch.zeros(64, 16, 8, 128, device=dev, dtype=torch.bfloat16),) * 2 for _ in range(LAYERS)]
idx = torch.arange(8, device=dev)


def run():
    return _timed(lambda: [fwd.layer(kv[i], idx) for i in range(LAYERS)]) * 1e3


for _ in range(3):
    run()
base = sorted(run() for _ in range(7))[3]
print(f"alone: {base:.2f} ms", flush=True)
for mode in ("dma", "kernel", "both"):
    p = subprocess.Popen([sys.executable, __file__, "child", mode], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "READY"
    time.sleep(0.5)
    t = sorted(run() for _ in range(7))[3]
    print(f"with another process's {mode}: {t:.2f} ms, ratio {t / base:.2f}", flush=True)
    p.wait(30)
