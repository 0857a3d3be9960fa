"""The worker core (what the vLLM connector runs, on CPU and on CUDA) under random engine steps
against a real daemon: each step loads some new requests' prefixes and saves others', requests
finish and are held until their transfers end, some are preempted while their saves may still
run (their blocks rewritten at once, as the engine reuses them), and an operator clears the
daemon's host tier now and then (its disk tier keeps what it held). Every block's KV is a
function of its key, so a loaded block that is not a load error and differs from its key's KV
is a wrong byte: a save that read a block after its reuse, a load landing in the wrong block,
a block handed back before its transfer ended. Both modes (direct and staging), two vLLM
layouts; seeded; KVCACHED_SOAK_OPS scales it."""
from __future__ import annotations

import os
import random

import pytest
import torch
from conftest import disk_uri
from kv_layouts import make_kv, parts_of
from test_prefix import content
from worker_util import make_worker

from kvcached_client import BlockHasher, launch
from kvcached_client.kv_worker import BlockTransfer

DOCS, DOC_BLOCKS, BS = 6, 4, 16
HOST_PAGES = 12  # half the keys in play


class Steps:
    """A scheduler over the worker core's 24 blocks. A request loads its prefix or saves its KV
    in the step it starts and runs on; it ends finished (its blocks held until the worker
    reports it) or preempted (its blocks reused at once)."""

    def __init__(self, worker, kv, rng):
        self.worker, self.kv, self.rng = worker, kv, rng
        hasher = BlockHasher("worker-random")
        self.docs = [hasher.hash_blocks([d * 10_000 + t for t in range(DOC_BLOCKS * BS)], BS)
                     for d in range(DOCS)]
        a, b = self.docs[0][:2]  # the check tells keys apart
        assert not torch.equal(content(a, (BS, 8), torch.float32), content(b, (BS, 8), torch.float32))
        self.free = set(range(24))
        self.running: dict[str, list[int]] = {}
        self.finishing: dict[str, list[int]] = {}  # finished, not reported yet: its blocks
        self.made = self.checked = self.errors = self.preempted = 0
        self.wrong: list[str] = []

    def _tensors(self):
        return [t for row in parts_of(self.kv) for t in row]

    def _write(self, block: int, key: bytes | None) -> None:
        for i, t in enumerate(self._tensors()):
            t[block] = 0 if key is None else content(bytes([i]) + key, t.shape[1:], t.dtype)

    def _holds(self, block: int, key: bytes) -> bool:
        return all(torch.equal(t[block], content(bytes([i]) + key, t.shape[1:], t.dtype))
                   for i, t in enumerate(self._tensors()))

    def _request(self) -> BlockTransfer | None:
        keys = self.rng.choice(self.docs)[: self.rng.randint(1, DOC_BLOCKS)]
        if len(self.free) < len(keys):
            return None
        blocks = self.rng.sample(sorted(self.free), len(keys))
        self.free -= set(blocks)
        self.made += 1
        return BlockTransfer(f"r{self.made}", keys, blocks)

    def _report(self, done) -> None:
        for rid in done:
            self.free |= set(self.finishing.pop(rid))

    def step(self) -> None:
        w, rng = self.worker, self.rng
        ending = [r for r in sorted(self.running) if rng.random() < 0.4]
        preempt = [r for r in ending if rng.random() < 0.3]
        if preempt:  # the engine takes these requests' blocks back now, their saves perhaps running
            w.preempt(preempt)
            for rid in preempt:
                for b in self.running.pop(rid):
                    self._write(b, None)  # reused at once: another request's KV lands there
                    self.free.add(b)
            self.preempted += len(preempt)
        finished = [r for r in ending if r not in preempt]
        for rid in finished:
            self.finishing[rid] = self.running.pop(rid)
        loads = [r for r in (self._request() for _ in range(rng.randint(0, 2))) if r]
        saves = [r for r in (self._request() for _ in range(rng.randint(0, 2))) if r]
        for load in loads:
            for b in load.block_ids:
                self._write(b, None)  # nothing of an earlier use can pass for a load's bytes
        for save in saves:  # the forward computes their KV
            for b, k in zip(save.block_ids, save.keys):
                self._write(b, k)
        w.start_loads(loads)
        for layer in range(w.num_layers):
            w.layer_ready(layer)
        w.end_forward()
        w.start_saves(saves)
        for r in loads + saves:
            self.running[r.req_id] = r.block_ids
        self._report(w.finished(set(finished)))
        errors = w.load_errors()
        self.errors += len(errors)
        for load in loads:
            for b, k in zip(load.block_ids, load.keys):
                if b not in errors:
                    self.checked += 1
                    if not self._holds(b, k):
                        self.wrong.append(f"{load.req_id}: block {b}")

    def drain(self) -> None:
        """Every running request finished; the reports collected."""
        for rid in list(self.running):
            self.finishing[rid] = self.running.pop(rid)
        self._report(self.worker.finished(set(self.finishing)))


@pytest.mark.parametrize("layout,mode,seed", [("LBNHC", "direct", 1), ("BLNHC", "staging", 2)])
def test_random_steps_load_only_their_keys_kv(run_dir, instance, disk_dir, layout, mode, seed):
    steps = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 4
    rng = random.Random(seed)
    _, kv = make_kv(layout)
    page = sum(t[0].numel() * t.element_size() for row in parts_of(kv) for t in row)
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=HOST_PAGES * page / 2**30,
                extra_args=["--storage", disk_uri(disk_dir)], wait_storage=True) as d, \
            d.connect(role="operator") as op:
        worker, got = make_worker(d, kv, direct=(mode == "direct"))
        assert got == mode
        sched = Steps(worker, kv, rng)
        try:
            for n in range(steps):
                if n % 61 == 60:
                    op.clear(tier="host")
                sched.step()
            for _ in range(200):
                sched.drain()
                if not sched.finishing:
                    break
                worker.link.get().flush().wait(10)
            assert not sched.finishing, sorted(sched.finishing)
        finally:
            worker.close()
        status, check = op.status(), op.check()
    assert not sched.wrong, f"seed {seed}: wrong KV in {sched.wrong[:5]} ({len(sched.wrong)} blocks)"
    assert check == "ok" and status["tasks"]["inflight"] == 0, status["tasks"]
    # a run that exercised it: loads served (from both tiers), misses, preemptions, evictions
    assert sched.checked > steps // 4 and sched.errors > 0 and sched.preempted > 0, vars(sched)
    assert status["lookups"]["loaded_from_storage"] > 0 and status["host"]["evictions"] > 0, (status["host"], status["lookups"])
