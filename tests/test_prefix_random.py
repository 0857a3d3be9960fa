"""PrefixCacheManager under random work against a real daemon: requests of shared documents with
tails of their own live at once (matched, loaded layer by layer or whole, computed, decoded,
preempted, released in any order), too many for the GPU blocks (evictions, offloads) and for
the daemon's host tier (its disk tier serves the rest). The engine writes each full block's KV
as a function of its key and checks every block the manager says is computed before using it:
a block reused while an offload reads it, a load landing in a block given to another request, or
a tree node pointing at the wrong block would be a wrong byte; so would a block in the free
pool that changes before it is handed out again (a copy landing after its blocks were freed).
Seeded; KVCACHED_SOAK_OPS scales it, KVCACHED_SOAK_SEED moves its seeds."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch
from conftest import disk_uri, kv_parts, ranks, small_kv, sweep_crashed, wait_until
from test_prefix import BS, NS, content

from kvcached.bench import process_stop
from kvcached_client import BlockHasher, Client, GroupClient, launch
from kvcached_client.prefix import PrefixCacheManager
from kvcached_client.prefix.tree import NoFreeBlocks
from kvcached_proto.shm_layout import State

GPU_BLOCKS, LAYERS = 40, 2
HOST_GB = 64 * LAYERS * 2 * BS * 2 * 64 * 2 / 2**30  # 64 pages of (BS, 2, 64) bfloat16 K and V
DOCS = 8


class Request:
    def __init__(self, rid, tokens):
        self.rid, self.tokens, self.phase = rid, tokens, "new"


class RandomEngine:
    """Drives the manager one phase of one request at a time, and checks what it is given."""

    def __init__(self, mgr, shards, rng, wait_s: float | None = 30):
        """shards: the KV cache of each tensor-parallel rank (one for a single daemon); a
        block's KV on rank r is a function of its key and r. wait_s: how long a load is waited
        for (None: the client's timeout)."""
        self.mgr, self.shards, self.rng, self.wait_s = mgr, shards, rng, wait_s
        self.after_match = lambda: None  # a fault's hook: its loads sent, none waited for yet
        self.hasher = BlockHasher(NS)
        self.docs = [[rng.randrange(1000) for _ in range(BS * rng.randint(2, 6))] for _ in range(DOCS)]
        a, b = self.hasher.hash_blocks(self.docs[0][: 2 * BS], BS)  # the check tells keys apart
        assert not torch.equal(content(a, (BS, 8), torch.float32), content(b, (BS, 8), torch.float32))
        self.live: list[Request] = []
        self.made = self.checked = self.no_room = 0
        self.wrong: list[str] = []
        self._watch_free_blocks()

    def _watch_free_blocks(self) -> None:
        """A GPU block back in the manager's free pool keeps what it held until the pool hands
        it out again: a change meanwhile is a late copy (a load that landed after its blocks
        were freed)."""
        freed: dict[int, list] = {}
        pool, holds = self.mgr.blocks.pool, self.mgr.blocks.holds
        give, take = holds._give, pool.take

        def gave(blocks) -> None:
            blocks = list(blocks)
            give(blocks)
            freed.update({b: [t[b].clone() for _, t in self._tensors()] for b in blocks})

        def took(n: int) -> list[int]:
            out = take(n)
            for b in out:
                was = freed.pop(b, None)
                if was is not None and not all(torch.equal(t[b], w) for (_, t), w in zip(self._tensors(), was)):
                    self.wrong.append(f"free GPU block {b} written")
            return out

        holds._give, pool.take = gave, took

    def new_request(self) -> Request:
        doc = self.rng.choice(self.docs)
        tokens = doc[: BS * self.rng.randint(1, len(doc) // BS)]
        tokens += [self.rng.randrange(1000) for _ in range(self.rng.randint(1, 2 * BS))]
        self.made += 1
        return Request(f"r{self.made}", tokens)

    def _tensors(self):
        """(rank, tensor) for every layer and part of every shard."""
        return [(r, t) for r, kv in enumerate(self.shards) for layer in kv for t in kv_parts(layer)]

    def _check(self, req, table, computed) -> None:
        keys = self.hasher.hash_blocks(req.tokens, BS)
        for i in range(computed // BS):
            bad = sorted({r for r, t in self._tensors()
                          if not torch.equal(t[table[i]], content(bytes([r]) + keys[i], t.shape[1:], t.dtype))})
            if bad:
                self.wrong.append(f"{req.rid} block {i} (GPU block {table[i]}, ranks {bad})")
        self.checked += computed // BS

    def _write(self, req, table, start_token) -> None:
        """The forward: KV for the blocks from the one holding start_token to the last full one."""
        keys = self.hasher.hash_blocks(req.tokens, BS)
        for i in range(start_token // BS, len(keys)):
            for r, t in self._tensors():
                t[table[i]] = content(bytes([r]) + keys[i], t.shape[1:], t.dtype)

    def advance(self, req) -> None:
        mgr = self.mgr
        if req.phase == "new":
            mgr.match(req.rid, req.tokens)
            self.after_match()
            req.phase = "matched"
            if self.rng.random() < 0.5:  # as an engine does: its loads waited for at once
                self.advance(req)
        elif req.phase == "matched":
            if self.rng.random() < 0.5:
                mgr.wait_layer(req.rid, self.rng.randrange(LAYERS), timeout=self.wait_s)
            computed = mgr.wait_loaded(req.rid, timeout=self.wait_s)
            try:
                table = mgr.allocate(req.rid, len(req.tokens) - computed)
            except NoFreeBlocks:  # the engine preempts it
                self.no_room += 1
                return self.finish(req)
            self._check(req, table, computed)
            self._write(req, table, computed)
            mgr.commit(req.rid, len(req.tokens))
            req.phase, req.table = "decoding", table
        elif req.phase == "decoding":
            if self.rng.random() < 0.4:
                return self.finish(req)
            start = len(req.tokens)
            req.tokens = req.tokens + [self.rng.randrange(1000) for _ in range(self.rng.randint(1, BS))]
            try:
                req.table = mgr.allocate(req.rid, len(req.tokens) - start)
            except NoFreeBlocks:
                self.no_room += 1
                return self.finish(req)
            self._write(req, req.table, start)
            mgr.commit(req.rid, len(req.tokens), req.tokens)

    def finish(self, req) -> None:
        if req.phase != "new":
            self.mgr.release(req.rid)
        self.live.remove(req)


def _run(mgr, eng, rng, steps: int, between=lambda n: None) -> dict:
    """`steps` random steps over at most 4 live requests (between(n) first at each), then every
    request released; the manager's books checked along the way. Returns its stats."""
    for n in range(steps):
        between(n)
        if len(eng.live) < 4 and (not eng.live or rng.random() < 0.3):
            eng.live.append(eng.new_request())
        eng.advance(rng.choice(eng.live))
        if n % 50 == 0:
            mgr.check()
    for req in list(eng.live):
        eng.finish(req)
    mgr.check()
    return mgr.stats()


def _exercised(eng, stats, steps) -> None:
    """No wrong block, and a run that exercised the tiers: GPU, host and storage hits, evictions,
    loads."""
    assert not eng.wrong, f"wrong KV given for {eng.wrong[:5]} ({len(eng.wrong)} blocks)"
    assert eng.checked > steps // 4, eng.checked
    assert stats["evictions"] > 0 and stats["gpu_hit_tokens"] > 0, stats
    assert stats["host_hit_tokens"] > 0 and stats["loaded_blocks"] > 0, stats


def _kv(seed, rank=0):
    return small_kv(num_layers=LAYERS, num_blocks=GPU_BLOCKS, block_shape=(BS, 2, 64), seed=seed + rank)


@pytest.mark.parametrize("policy,seed,faults", [("write_through", 1, None), ("write_back", 2, None),
                                                ("write_through_selective", 3, None),
                                                ("write_through", 4, "kills"), ("write_back", 6, "freezes"),
                                                ("write_back", 10, "pauses"), ("write_through", 12, "stops")])
def test_random_requests_are_only_ever_given_their_own_kv(run_dir, instance, disk_dir, policy, seed,
                                                          faults):
    """kills: the daemon is killed (-9) three times mid-run, each once the manager has attached
    again, and a successor started on the same disk tier 40 steps later: the engine goes on
    GPU-only meanwhile, never sees an error, and the manager reattaches in the background.
    stops: the same with a graceful stop (SIGTERM: it drains what is queued), sent right after
    a match that sent loads, the daemon frozen for 0.1-0.3 s once stopping: the engine steps on
    meanwhile, its calls refused (the manager detaches) while the loads sent before the stop
    still end and keep their hits.
    freezes: every 150 steps while attached, the daemon is stopped (SIGSTOP) for 0.4-0.8 s, right
    after the next match that sent loads, against a hang threshold of 0.3 s, so loads and
    offloads in flight end late or not at all
    from the manager's side: it detaches, holds the blocks they may still write, and attaches
    again once the daemon goes on. pauses: every 60 steps the daemon is paused (its operator's
    pause: slow, not hung) for 0.4-0.8 s against the manager's timeout of 0.3 s."""
    steps = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 2
    seed += int(os.environ.get("KVCACHED_SOAK_SEED", "0"))
    rng, kv = random.Random(seed), _kv(seed)
    start = lambda: launch(instance=instance, run_dir=run_dir, host_cache_gb=HOST_GB,  # noqa: E731
                           extra_args=["--storage", disk_uri(disk_dir)], wait_storage=True)
    kills = [steps * k // 5 for k in (1, 2, 3)] if faults in ("kills", "stops") else []  # once attached again
    state = {"daemon": start(), "restart_at": None, "thaw_at": None, "freezes": 0, "kept": 0}

    def between(n):
        daemon = state["daemon"]
        if state.get("stopping"):  # a graceful stop, frozen while it drains: the engine steps on
            if daemon.proc.poll() is None:
                time.sleep(0.004)
                return
            assert daemon.proc.returncode == 0, daemon.proc.returncode
            sweep_crashed(instance)
            state["stopping"], state["restart_at"] = False, n + 40
        elif kills and n >= kills[0] and mgr.attached and state["restart_at"] is None:
            if faults == "stops":
                state["stop_due"] = True  # at the next match that sent loads (freeze)
                return
            kills.pop(0)
            os.kill(daemon.pid, signal.SIGKILL)
            daemon.proc.wait(60)
            sweep_crashed(instance)
            state["restart_at"] = n + 40
        elif n == state["restart_at"]:  # GPU-only steps take microseconds: give the watcher its turn
            state["daemon"], state["restart_at"] = start(), None
            wait_until(lambda: mgr.attached or mgr.link.has_ready(), 10,
                       "the manager's watcher to have the successor's connection ready")
        elif faults == "pauses" and n % 60 == 30:  # (the engine may wait on it: a timer resumes)
            if state.get("timer") is not None:
                state["timer"].join(10)
            state["op"].pause()
            state["timer"] = threading.Timer(rng.uniform(0.4, 0.8), state["op"].resume)
            state["timer"].start()
            state["freezes"] += 1
        elif faults == "freezes":
            if state["thaw_at"] is None and n % 150 == 75 and mgr.attached:
                state["freeze_due"] = True  # at the next match: loads in flight
            elif state["thaw_at"] is not None and time.monotonic() > state["thaw_at"]:
                process_stop.go_on(daemon.pid, "the daemon")
                state["thaw_at"] = None
            if state["thaw_at"] is not None or not mgr.attached:
                time.sleep(0.004)  # an engine's step takes time: the watcher gets its turns

    def freeze() -> None:
        if state.get("stop_due") and mgr.transfers.loads:
            del state["stop_due"]
            kills.pop(0)
            status = mgr.client.status_block
            os.kill(state["daemon"].pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while status.view.state != State.STOPPING:  # (spun: the drain may end in ms)
                assert time.monotonic() < deadline, "the daemon did not begin its stop"
            process_stop.stop(state["daemon"].pid, "the daemon")
            state["stopping"] = True  # (a timer: the engine may wait for its loads meanwhile)
            state["timer"] = threading.Timer(rng.uniform(0.1, 0.3), process_stop.go_on,
                                             (state["daemon"].pid, "the daemon"))
            state["timer"].start()
            mgr.try_attach()  # the engine checks its daemon: refused, it detaches
            state["kept"] += len(mgr.transfers.loads)  # (they counted as failed here before)
        if state.get("freeze_due") and state["thaw_at"] is None and mgr.transfers.loads:
            del state["freeze_due"]
            process_stop.stop(state["daemon"].pid, "the daemon")
            state["thaw_at"], state["freezes"] = time.monotonic() + rng.uniform(0.4, 0.8), state["freezes"] + 1

    try:
        hang_s = 0.3 if faults == "freezes" else None
        if faults == "pauses":
            state["op"] = state["daemon"].connect(role="operator")
        mgr = PrefixCacheManager(GPU_BLOCKS, BS, client=state["daemon"].connect(
                                     timeout=0.3 if faults == "pauses" else 10, hang_s=hang_s),
                                 namespace=NS, kv_caches=kv, write_policy=policy)
        eng = RandomEngine(mgr, [kv], rng, wait_s=None if faults == "pauses" else 30)  # (0.3 s:
        eng.after_match = freeze  # loads of a paused daemon time out, cancelled)
        stats = _run(mgr, eng, rng, steps, between)
        mgr.close()
    finally:
        process_stop.go_on(state["daemon"].pid, "the daemon")
        if state.get("timer") is not None:
            state["timer"].join(10)
        if "op" in state:
            state["op"].close()
        state["daemon"].stop()
    _exercised(eng, stats, steps)
    if faults in ("kills", "stops"):  # each successor attached; a failed offload: one the kill cut short
        assert not kills and stats["detaches"] == 3 and stats["attaches"] >= 3, stats
        if faults == "stops":  # loads sent before a stop, in flight after the manager detached
            assert state["kept"] >= 1, state
    elif faults == "pauses":  # offloads timed out (cancelled, their blocks held till the end)
        assert state["freezes"] >= 5 and stats["offload_failures"] > 0 and stats["detaches"] == 0, (state, stats)
    elif faults == "freezes":  # freezes seen as hangs, the same daemon attached again after
        assert state["freezes"] >= 3 and stats["detaches"] >= 1 and stats["attaches"] >= 2, (state, stats)
    else:
        assert stats["offload_failures"] == 0 and stats["daemon_errors"] == 0, stats


def test_random_requests_over_two_tensor_parallel_ranks(run_dir, tmp_path):
    """The same over a GroupClient of two ranks, each with its own daemon, host tier and disk
    tier; rank 1's host tier is cleared now and then, so the ranks hold different blocks and
    every hit is the shorter rank's: each rank's shard is checked."""
    steps, seed = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 2, 5
    rng = random.Random(seed)
    shards = [_kv(seed, r) for r in range(2)]
    extra = lambda r: ["--storage", disk_uri(str(tmp_path / f"disk{r}"))]  # noqa: E731
    with ranks(run_dir, 2, extra) as (names, _), Client.connect(names[1], run_dir, role="operator") as op:
        g = GroupClient.connect(names, run_dir=run_dir)
        mgr = PrefixCacheManager(GPU_BLOCKS, BS, client=g, namespace=NS, kv_caches=shards)
        eng = RandomEngine(mgr, shards, rng)

        def between(n):
            if n % 97 == 96:
                op.clear(tier="host")

        stats = _run(mgr, eng, rng, steps, between)
        mgr.close()
        g.close()
    _exercised(eng, stats, steps)
    assert stats["offload_failures"] == 0 and stats["daemon_errors"] == 0, stats


class RankFaults:
    """What befalls rank 1's daemon between the manager's steps (`between`). kills: killed (-9)
    three times mid-run, a successor started on its disk tier 40 steps later. freezes: every
    150 steps, at the next match that sent loads, stopped (SIGSTOP) for 0.4-0.8 s against a hang
    threshold of 0.3 s. busy: every 50
    steps both daemons are paused for 0.15 s, so rank 1 (2 queued tasks at most) refuses (BUSY)
    loads and offloads that rank 0 took. pauses: every 50 steps rank 1's daemon is paused for
    0.4-0.8 s against the group's timeout of 0.3 s (slow, not hung: rank 0 ends what rank 1 does
    not). `attached`: each client rank 1 was attached with."""

    def __init__(self, kind, g, handles, start, ops, steps, rng):
        """start(): rank 1's successor; ops: an operator client per rank."""
        self.kind, self.g, self.handles, self.start, self.ops, self.rng = kind, g, handles, start, ops, rng
        self.kills = [steps * k // 5 for k in (1, 2, 3)] if kind == "kills" else []
        self.restart_at = self.thaw_at = self.timer = None
        self.freezes, self.freeze_due = 0, False
        self.attached: list = []

    def between(self, n: int) -> None:
        client = self.g.links[1].client
        if client is not None and not any(c is client for c in self.attached):
            self.attached.append(client)
        if self.kills and n >= self.kills[0] and not self.g.missing and self.restart_at is None:
            self.kills.pop(0)
            os.kill(self.handles[1].pid, signal.SIGKILL)
            self.handles[1].proc.wait(10)
            sweep_crashed(self.handles[1].instance)
            self.restart_at = n + 40
        elif n == self.restart_at:
            self.handles[1], self.restart_at = self.start(), None
            wait_until(lambda: self.g.links[1].client is not None or self.g.links[1].has_ready(), 10,
                       "the group's watcher to have rank 1's successor ready")
        elif self.kind in ("busy", "pauses") and n % 50 == 25:  # busy: rank 1's queue fills,
            if self.timer is not None:  # BUSY until both go on; pauses: past the 0.3 s timeout
                self.timer.join(10)
            for op in self.ops[1:] if self.kind == "pauses" else self.ops:
                op.pause()
            self.timer = threading.Timer(0.15 if self.kind == "busy" else self.rng.uniform(0.4, 0.8),
                                         lambda: [op.resume() for op in self.ops])
            self.timer.start()
        elif self.kind == "freezes":
            self._freeze_or_thaw(n)

    def _freeze_or_thaw(self, n: int) -> None:
        if self.thaw_at is None and n % 150 == 75 and not self.g.missing:
            self.freeze_due = True  # at the next match that sent loads (after_match)
        elif self.thaw_at is not None and time.monotonic() > self.thaw_at:
            process_stop.go_on(self.handles[1].pid, "rank 1's daemon")
            self.thaw_at = None
        if self.thaw_at is not None or self.g.missing:
            time.sleep(0.004)  # an engine's step takes time: the watcher gets its turns

    def after_match(self, mgr) -> None:
        if self.freeze_due and self.thaw_at is None and mgr.transfers.loads:
            self.freeze_due = False
            process_stop.stop(self.handles[1].pid, "rank 1's daemon")
            self.thaw_at = time.monotonic() + self.rng.uniform(0.4, 0.8)
            self.freezes += 1

    def settle(self) -> None:
        """The run's end: the timer done, rank 1's daemon going on."""
        if self.timer is not None:
            self.timer.join(10)
        process_stop.go_on(self.handles[1].pid, "rank 1's daemon")


@pytest.mark.parametrize("faults", ["kills", "freezes", "busy", "pauses"])
def test_random_requests_over_two_ranks_one_failing(run_dir, tmp_path, faults):
    """Two ranks again, rank 1's daemon failing with the manager's loads and offloads in flight
    on both ranks (RankFaults: killed, frozen, slow, or refusing what rank 0 took - without the
    group revoking rank 0's offloads, the engine was given another request's KV in every busy
    run).
    Rank 0 has loaded what rank 1 has not, so a hit is the shorter rank's or none, and every
    block the manager calls computed holds each rank's KV of its key (both shards checked). The
    engine never sees an error (before, an offload that failed on the killed rank raised
    TaskFailed out of `allocate`, from the manager's poll); the group reattaches rank 1 in the
    background."""
    steps = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 2
    seed = {"kills": 7, "freezes": 8, "busy": 9, "pauses": 11}[faults] + int(os.environ.get("KVCACHED_SOAK_SEED", "0"))
    rng = random.Random(seed)
    shards = [_kv(seed, r) for r in range(2)]
    busy = ["--max-queued-tasks", "2"] if faults == "busy" else []
    extra = lambda r: ["--storage", disk_uri(str(tmp_path / f"disk{r}"))] + (busy if r == 1 else [])  # noqa: E731
    with ranks(run_dir, 2, extra) as (names, handles):
        g = GroupClient.connect(names, run_dir=run_dir, hang_s=0.3 if faults == "freezes" else None,
                                timeout=0.3 if faults == "pauses" else 10.0)
        ops = [Client.connect(name, run_dir, role="operator") for name in names]
        start = lambda: launch(instance=names[1], run_dir=run_dir, host_cache_gb=0.05,  # noqa: E731
                               extra_args=extra(1), wait_storage=True)
        fx = RankFaults(faults, g, handles, start, ops, steps, rng)
        try:
            mgr = PrefixCacheManager(GPU_BLOCKS, BS, client=g, namespace=NS, kv_caches=shards)
            eng = RandomEngine(mgr, shards, rng)
            eng.after_match = lambda: fx.after_match(mgr)
            stats = _run(mgr, eng, rng, steps, fx.between)
            fx.settle()
            deadline = time.monotonic() + 10  # the engine goes on; rank 1 is attached again
            while g.missing and time.monotonic() < deadline:
                stats = _run(mgr, eng, rng, 5)
                time.sleep(0.05)
            assert not g.missing, g.missing
            mgr.close()
        finally:
            process_stop.go_on(handles[1].pid, "rank 1's daemon")
            for op in ops:
                op.close()
            g.close()
    _exercised(eng, stats, steps)
    assert not fx.kills and fx.restart_at is None, (fx.kills, fx.restart_at)
    # rank 1 attached again after each kill (a successor) and each freeze (the same daemon)
    if faults not in ("busy", "pauses"):
        assert len(fx.attached) >= 4 and (faults == "kills" or fx.freezes >= 3), (len(fx.attached), fx.freezes)
