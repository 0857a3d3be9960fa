"""What a daemon fault costs a real vLLM engine (CPU): `scripts/bench_vllm.py --faults`.

One engine with the KvcachedConnector runs a batch of 12 prompts over 4 shared prefixes in one
generate call (vllm_driver.batch_prompts), again and again. Each fault case repeats: bring the
daemon up (or leave it out), one batch to settle (the connector reattaches in the background,
the host tier fills), one batch without a fault (the baseline of this repetition), then the same
batch with the fault injected at a random moment inside it (a fraction of the baseline's time):

  sigkill   the daemon is killed (SIGKILL)
  sigstop   the daemon is stopped (SIGSTOP: hung) until the batch has ended
  restart   the daemon is killed and a new one started at once (empty host tier, same disk)
  absent    no daemon during the whole batch (killed before it, and the batch before it too)
  control   no fault: an unrelated daemon (another instance) starts mid-batch, to show what a
            daemon's start-up alone takes from the engine on this machine's CPUs (the restart
            case pays it too)

Each fault batch's wall time is divided by its own baseline, and by the batch on an engine
without a connector (for `absent` the fair comparison: no cache either way); every batch's
greedy tokens are compared with that engine's.
"""
from __future__ import annotations

import os
import random
import signal
import statistics
import time

import vllm_driver

from kvcached_client import launch

CASES = ("sigkill", "sigstop", "restart", "absent", "control")


class Daemon:
    def __init__(self, run_dir: str, storage: str, instance: str = "bvf"):
        self.run_dir, self.storage, self.instance = run_dir, storage, instance
        self.handle = None

    def start(self):
        self.handle = launch(instance=self.instance, run_dir=self.run_dir, host_cache_gb=1.0,
                             extra_args=["--storage", self.storage], wait_storage=True)

    def ensure(self):
        if self.handle is None or not self.handle.alive():
            self.reap()
            self.start()

    def kill(self):
        if self.handle is not None:
            self.handle.kill()
            self.handle = None

    def reap(self):
        if self.handle is not None:
            self.handle.kill()
            self.handle = None
        name = f"/dev/shm/kvcached.{os.getuid()}.{self.instance}"
        if os.path.exists(name):  # what the next daemon would sweep at its start
            os.unlink(name)

    def stop(self):
        if self.handle is not None and self.handle.alive():
            self.handle.stop()
        self.handle = None


def run(model: str, size: list[str], tmp: str, repeats: int, seed: int, hang_s: float) -> dict:
    """Returns {"reference_s", "rows": [{case, baseline_s, fault_s, ratio, equal, at}]}."""
    ref_eng = vllm_driver.EngineProcess(model, "--connector", "none", *size)
    try:
        ref_eng.step("batch", "")  # warm-up
        refs = [ref_eng.step("batch", "") for _ in range(2)]
    finally:
        ref_eng.close()
    ref = refs[-1]
    daemon = Daemon(os.path.join(tmp, "run"), f"disk://{tmp}/disk?capacity_gb=2")
    daemon.start()
    args = ["--connector", "kvcached", "--instance", daemon.instance, "--run-dir", daemon.run_dir]
    if hang_s:
        args += ["--hang-s", str(hang_s)]
    eng = vllm_driver.EngineProcess(model, *args, *size)
    rng = random.Random(seed)
    rows = []
    try:
        eng.step("batch", "")  # warm-up: computes and saves every prefix
        for case in CASES:
            for _ in range(repeats):
                row = _one(eng, daemon, case, rng, ref["tokens"])
                rows.append(row)
                print(f"[faults] {case:<8} at {row['at_s']:.2f} s: baseline {row['baseline_s']:.2f} s "
                      f"({row['baseline_cached']} tokens cached), fault {row['fault_s']:.2f} s "
                      f"({row['fault_cached']} cached), outputs "
                      f"{'equal' if row['equal'] else 'DIFFER'}", flush=True)
    finally:
        eng.close()
        if daemon.handle is not None:
            try:
                os.kill(daemon.handle.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        daemon.stop()
    return {"reference_s": statistics.median(r["seconds"] for r in refs),
            "reference_cached": sum(ref["num_cached_tokens"]), "rows": rows}


def _one(eng, daemon: Daemon, case: str, rng: random.Random, ref_tokens) -> dict:
    daemon.ensure()
    vllm_driver.wait_attached(daemon.handle)  # the connector reattaches in the background
    settle = eng.step("batch", "")
    base = eng.step("batch", "")
    equal = settle["tokens"] == ref_tokens and base["tokens"] == ref_tokens
    at = rng.uniform(0.1, 0.9) * base["seconds"]
    if case == "absent":
        daemon.kill()
        eng.step("batch", "")  # the batch that sees the death (the sigkill case measures it)
        at = 0.0
    eng.send("batch")
    if case != "absent":
        time.sleep(at)
        pid = daemon.handle.pid
        if case == "sigstop":
            os.kill(pid, signal.SIGSTOP)
        elif case == "sigkill":
            daemon.kill()
        elif case == "restart":
            daemon.kill()
            daemon.reap()
            daemon.start()
        elif case == "control":
            other = Daemon(daemon.run_dir, daemon.storage.replace("/disk?", "/disk-control?"),
                           instance="bvf-control")
            other.start()
    fault = eng.answer()
    if case == "control":
        other.stop()
    if case == "sigstop":
        os.kill(pid, signal.SIGCONT)
    hit_base = sum(base["num_cached_tokens"])
    return {"case": case, "at_s": at, "baseline_s": base["seconds"], "fault_s": fault["seconds"],
            "ratio": fault["seconds"] / base["seconds"], "baseline_cached": hit_base,
            "fault_cached": sum(fault["num_cached_tokens"]),
            "equal": equal and fault["tokens"] == ref_tokens}


def report(result: dict, hang_s: float) -> str:
    rows = result["rows"]
    ref_s = result["reference_s"]
    lines = [f"{'case':<9} {'runs':>4} {'baseline s':>11} {'fault s':>8} {'ratio med':>9} "
             f"{'ratio max':>9} {'over base max s':>15} {'vs no conn':>10} {'outputs':>8}  target"]
    targets = {"sigkill": "<= 1.5x", "sigstop": f"<= +{hang_s + 0.5:g} s", "restart": "-",
               "absent": "vs no conn ~1x", "control": "-"}
    for case in CASES:
        rs = [r for r in rows if r["case"] == case]
        if not rs:
            continue
        over = max(r["fault_s"] - r["baseline_s"] for r in rs)
        lines.append(
            f"{case:<9} {len(rs):>4} {statistics.median(r['baseline_s'] for r in rs):>11.2f} "
            f"{statistics.median(r['fault_s'] for r in rs):>8.2f} "
            f"{statistics.median(r['ratio'] for r in rs):>9.2f} {max(r['ratio'] for r in rs):>9.2f} "
            f"{over:>15.2f} {statistics.median(r['fault_s'] for r in rs) / ref_s:>9.2f}x "
            f"{'equal' if all(r['equal'] for r in rs) else 'DIFFER':>8}  {targets[case]}")
    lines.append(f"(no connector: the batch took {ref_s:.2f} s, {result['reference_cached']} tokens "
                 "from vLLM's own prefix cache; the fault moment is a uniform 10-90% of the "
                 "baseline batch's time)")
    return "\n".join(lines)
