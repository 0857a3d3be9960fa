"""The worker core (what the vLLM connector runs, on CPU and on CUDA) under random engine steps
against a real daemon: each step loads some new requests' prefixes and saves others', requests
finish and are held until their transfers end, some are preempted while their saves may still
run (their blocks rewritten at once, as the engine reuses them), and an operator clears the
daemon's host tier now and then (its disk tier keeps what it held). Every block's KV is a
function of its key, so a loaded block that is not a load error and differs from its key's KV
is a wrong byte: a save that read a block after its reuse, a load landing in the wrong block,
a block handed back before its transfer ended; and a free block (its request reported
finished or preempted) that changes before it is taken again is a late copy into blocks the
engine took back. Both modes (direct and staging), three vLLM layouts; also with the daemon
killed and restarted, or frozen past the hang threshold (and the client's timeout: preempted
loads revoked), in the middle of steps; seeded; KVCACHED_SOAK_OPS scales it, KVCACHED_SOAK_SEED
moves its seeds."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
from conftest import disk_uri, no_tasks, sweep_crashed, wait_until
from kv_layouts import make_kv, parts_of
from test_prefix import content
from worker_util import make_worker

from kvcached.bench import process_stop
from kvcached_client import BlockHasher, launch
from kvcached_client.kv_worker import BlockTransfer

DOCS, DOC_BLOCKS, BS = 6, 4, 16
HOST_PAGES = 12  # half the keys in play


class Steps:
    """A scheduler over the worker core's 24 blocks. A request loads its prefix or saves its KV
    in the step it starts and runs on; it ends finished (its blocks held until the worker
    reports it) or preempted (its blocks reused at once)."""

    def __init__(self, worker, kv, rng, at=lambda point: None):
        """at(point): called at points of each step ("loads sent", "layer 0", "forward done",
        "saves sent")."""
        self.worker, self.kv, self.rng, self.at = worker, kv, rng, at
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
        # a free block keeps what it held when it was freed until it is taken again: a write
        # meanwhile is a late copy (a load the daemon ran after the engine took the blocks back)
        self.freed = {b: self._snapshot(b) for b in self.free}

    def _tensors(self):
        return [t for row in parts_of(self.kv) for t in row]

    def _write(self, block: int, key: bytes | None) -> None:
        for i, t in enumerate(self._tensors()):
            t[block] = 0 if key is None else content(bytes([i]) + key, t.shape[1:], t.dtype)

    def _holds(self, block: int, key: bytes) -> bool:
        return all(torch.equal(t[block], content(bytes([i]) + key, t.shape[1:], t.dtype))
                   for i, t in enumerate(self._tensors()))

    def _snapshot(self, block: int) -> list:
        return [t[block].clone() for t in self._tensors()]

    def _freed(self, blocks) -> None:
        self.free |= set(blocks)
        self.freed.update({b: self._snapshot(b) for b in blocks})

    def _request(self) -> BlockTransfer | None:
        keys = self.rng.choice(self.docs)[: self.rng.randint(1, DOC_BLOCKS)]
        if len(self.free) < len(keys):
            return None
        blocks = self.rng.sample(sorted(self.free), len(keys))
        self.free -= set(blocks)
        for b in blocks:
            if not all(torch.equal(t[b], was) for t, was in zip(self._tensors(), self.freed.pop(b))):
                self.wrong.append(f"free block {b} written")
        self.made += 1
        return BlockTransfer(f"r{self.made}", keys, blocks)

    def _report(self, done) -> None:
        for rid in done:
            self._freed(self.finishing.pop(rid))

    def step(self) -> None:
        w, rng = self.worker, self.rng
        ending = [r for r in sorted(self.running) if rng.random() < 0.4]
        preempt = [r for r in ending if rng.random() < 0.3]
        if preempt:  # the engine takes these requests' blocks back now, their saves perhaps running
            w.preempt(preempt)
            for rid in preempt:
                blocks = self.running.pop(rid)
                for b in blocks:
                    self._write(b, None)  # reused at once: another request's KV lands there
                self._freed(blocks)
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
        self.at("loads sent")
        for layer in range(w.num_layers):
            w.layer_ready(layer)
            if layer == 0:
                self.at("layer 0")
        w.end_forward()
        self.at("forward done")
        w.start_saves(saves)
        self.at("saves sent")
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


class Faults:
    """The daemon under the worker, and what befalls it in the middle of a step (right after its
    loads are sent, or their first layer landed, or its saves are sent). kills: killed (-9)
    three times, each once the worker is attached again, a successor started on the same disk
    tier 30 steps later; stops: the same with a graceful stop (SIGTERM: it drains what is queued
    while the worker already counts it gone). freezes: every 100 steps while attached, stopped
    (SIGSTOP) for 0.4-0.8 s against the worker's hang threshold of 0.3 s; hangs: the same
    against a timeout of 0.3 s too, so a preempted request's load is not confirmed ended and is
    revoked; pauses: every 40 steps paused as long against the worker's timeout of 0.3 s (slow,
    not hung). Else the host tier is cleared every 61 steps."""

    def __init__(self, kind, start, instance, steps, rng):
        self.kind, self.start, self.instance, self.rng = kind, start, instance, rng
        self.daemon = start()
        self.op = self.daemon.connect(role="operator")
        self.kills = [steps * k // 5 for k in (1, 2, 3)] if kind in ("kills", "stops") else []
        self.restart_at = self.thaw_at = None
        self.fault: list = []  # (point, what) due in the next step, in order
        self.freezes, self.paused = 0, False
        self.clients: list = []  # every client the worker attached with

    def _soon(self, fn) -> None:
        """fn at a point of the next step. 3 times in 4 the daemon is paused first, so that the
        step's loads (2 in 4), or its saves, are queued, not yet copied, when fn comes (CPU copies of a
        few blocks end within microseconds of their reply); paused only just before what it
        queues, so no layer wait of the step waits on a paused daemon."""
        r = self.rng.random()
        self.paused = r < 0.75
        if r < 0.5:  # its loads queued
            self.op.pause()
            self.fault = [("loads sent", fn)]
        elif r < 0.75:  # its saves queued
            self.fault = [("forward done", self.op.pause), ("saves sent", fn)]
        else:
            self.fault = [(self.rng.choice(["loads sent", "layer 0", "saves sent"]), fn)]

    def at(self, point: str) -> None:
        """Steps' hook: what is due in this step at this point."""
        while self.fault and self.fault[0][0] == point:
            self.fault.pop(0)[1]()

    def between(self, n, worker) -> None:
        while self.fault:  # (a step with no loads passes no "layer 0")
            self.fault.pop(0)[1]()
        client = worker.link.client
        if client is not None and not any(c is client for c in self.clients):
            self.clients.append(client)
        if self.kills and n >= self.kills[0] and client is not None and self.restart_at is None:
            self.kills.pop(0)
            how = signal.SIGKILL if self.kind == "kills" else signal.SIGTERM
            self._soon(lambda: os.kill(self.daemon.pid, how))
            self.restart_at = n + 30
        elif n == self.restart_at:
            self.daemon.proc.wait(30)
            sweep_crashed(self.instance)
            self.op.close()
            self.daemon, self.restart_at = self.start(), None
            self.op = self.daemon.connect(role="operator")
            wait_until(lambda: worker.link.client is not None or worker.link.has_ready(), 10,
                       "the worker's watcher to have the successor's connection ready")
        elif self.kind in ("freezes", "hangs", "pauses"):
            every = 40 if self.kind == "pauses" else 100
            if self.thaw_at is None and n % every == every // 2 and client is not None:
                self.thaw_at, self.freezes = time.monotonic() + self.rng.uniform(0.4, 0.8), self.freezes + 1
                self._soon(lambda: process_stop.stop(self.daemon.pid, "the daemon")
                           if self.kind != "pauses" else self._pause_long())
            elif self.thaw_at is not None and time.monotonic() > self.thaw_at:
                self._thaw()
            if self.thaw_at is not None or client is None:
                time.sleep(0.004)  # an engine's step takes time: the watcher gets its turns
        elif n % 61 == 60 and self.restart_at is None:
            self.op.clear(tier="host")

    def _pause_long(self) -> None:
        self.op.pause()
        self.paused = True

    def _thaw(self) -> None:
        process_stop.go_on(self.daemon.pid, "the daemon")
        if self.paused:  # the queued work runs now, into blocks the worker still holds
            self.op.resume()
        self.thaw_at, self.paused = None, False

    def settle(self, worker) -> None:
        """The run's end: the daemon going on, or its successor started."""
        if self.fault and self.restart_at is None:
            self.fault = []
            self._thaw()
        if self.thaw_at is not None:
            self._thaw()
        if self.restart_at is not None:
            self.between(self.restart_at, worker)

    def close(self) -> None:
        process_stop.go_on(self.daemon.pid, "the daemon")
        self.op.close()
        self.daemon.stop()
        sweep_crashed(self.instance)  # (a run that failed between a kill and the restart)


@pytest.mark.parametrize("layout,mode,seed,faults", [("LBNHC", "direct", 1, None), ("BLNHC", "staging", 2, None),
                                                     ("LBNHC", "direct", 3, "kills"),
                                                     ("BLNHC", "staging", 4, "kills"),
                                                     ("LBHNC", "direct", 5, "freezes"),
                                                     ("LBNHC", "direct", 10, "hangs"),
                                                     ("BLNHC", "staging", 6, "freezes"),
                                                     ("LBNHC", "direct", 7, "stops"),
                                                     ("BLNHC", "direct", 8, "pauses"),
                                                     ("LBNHC", "staging", 9, "pauses")])
def test_random_steps_load_only_their_keys_kv(run_dir, instance, disk_dir, layout, mode, seed, faults):
    """Also with the daemon killed and restarted, or frozen past the hang threshold (Faults):
    the loads in flight are load errors (recomputed) or their keys' KV, never another's, and
    nothing lands in a block after the engine took it back."""
    steps = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 4
    seed += int(os.environ.get("KVCACHED_SOAK_SEED", "0"))
    rng = random.Random(seed)
    _, kv = make_kv(layout)
    page = sum(t[0].numel() * t.element_size() for row in parts_of(kv) for t in row)
    start = lambda: launch(  # noqa: E731
        instance=instance, run_dir=run_dir, host_cache_gb=HOST_PAGES * page / 2**30,
        extra_args=["--storage", disk_uri(disk_dir)], wait_storage=True)
    fx = Faults(faults, start, instance, steps, rng)
    try:
        worker, got = make_worker(fx.daemon, kv, direct=(mode == "direct"),
                                  hang_s=0.3 if faults in ("freezes", "hangs") else None,
                                  timeout=0.3 if faults in ("pauses", "hangs") else 10.0)
        assert got == mode
        sched = Steps(worker, kv, rng, fx.at)
        try:
            for n in range(steps):
                fx.between(n, worker)
                sched.step()
            fx.settle(worker)
            for _ in range(200):
                sched.drain()
                if not sched.finishing:
                    break
                client = worker.link.get()
                if client is not None:
                    client.flush().wait(10)
                else:
                    time.sleep(0.05)
            assert not sched.finishing, sorted(sched.finishing)
        finally:
            worker.close()
        # a load the daemon (frozen until the run's end) still ran at the worker's bye ends in
        # the bye's drain, after the bye's reply: every task must end, none at once
        wait_until(lambda: no_tasks(fx.op), 10, "the daemon to end the closed worker's tasks")
        status, check = fx.op.status(), fx.op.check()
    finally:
        fx.close()
    assert not sched.wrong, f"seed {seed}: wrong KV in {sched.wrong[:5]} ({len(sched.wrong)} blocks)"
    assert check == "ok" and status["tasks"]["inflight"] == 0, status["tasks"]
    # a run that exercised it: loads served (from both tiers), misses, preemptions, evictions
    assert sched.checked > steps // 4 and sched.errors > 0 and sched.preempted > 0, vars(sched)
    assert status["lookups"]["loaded_from_storage"] > 0 and status["host"]["evictions"] > 0, \
        (status["host"], status["lookups"])
    if faults in ("kills", "stops"):  # each successor attached
        assert not fx.kills and len(fx.clients) >= 4, (fx.kills, len(fx.clients))
    elif faults == "pauses":  # slow, not gone: the one client throughout
        assert fx.freezes >= 3 and len(fx.clients) == 1, (fx.freezes, len(fx.clients))
    elif faults in ("freezes", "hangs"):  # seen as hangs: the worker attached again after
        assert fx.freezes >= 3 and len(fx.clients) >= 2, (fx.freezes, len(fx.clients))
