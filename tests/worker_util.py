"""What the worker-core tests share: a worker on a real daemon, one engine step as vLLM runs it,
and the blocks' bytes to compare."""
from __future__ import annotations

import contextlib

import torch

from conftest import wait_until
from conftest import keys_for
from kv_layouts import fill, make_kv, parts_of
from kvcached_client.daemon_link import DaemonLink
from kvcached_client.kv_worker import BlockTransfer, KVWorker

SRC, DST = [3, 4, 5, 9, 17, 0], [20, 2, 11, 12, 13, 7]


def make_worker(daemon, kv, direct=None, timeout=10.0, staging_blocks=32, num_blocks=24,
                host_only_loads=False, hang_s=None):
    worker = KVWorker(None, staging_blocks=staging_blocks, direct=direct,
                      host_only_loads=host_only_loads)
    worker.link = DaemonLink(daemon.instance, daemon.run_dir, timeout, "test-worker",
                             on_connect=worker.on_connect, retire=worker.retire, hang_s=hang_s)
    mode = worker.register({f"layer.{i}": e for i, e in enumerate(kv)}, num_blocks)
    assert worker.link.client is not None, "the daemon is up: the worker attaches at once"
    return worker, mode


def step(worker, loads=(), saves=(), finished=()):
    """One engine step in the order vLLM runs it; returns (finished_sending, load errors)."""
    worker.start_loads(list(loads))
    for layer in range(len(worker._layers)):
        worker.layer_ready(layer)
    worker.end_forward()
    worker.start_saves(list(saves))
    return worker.finished(set(finished)), worker.load_errors()


def finish(worker, req_id: str, timeout: float = 20.0) -> None:
    """Report req_id finished and step until the worker reports it done (exactly once)."""
    got = worker.finished({req_id})
    if req_id not in got:
        wait_until(lambda: req_id in worker.finished(set()), timeout, f"{req_id} reported")
    assert req_id not in worker.finished({req_id}), "reported once only"


def saved(worker, req_id: str, keys, timeout: float = 20.0) -> None:
    """finish(), then wait until the worker's daemon holds the blocks: a staging save is
    reported once the engine's blocks are copied into staging (nothing of the engine's is in
    flight), while the daemon's copy out of staging may still run - a load or lookup right
    after could miss them (a miss, never wrong bytes)."""
    finish(worker, req_id, timeout)
    daemon_keys = worker.keys_for_daemon(keys)
    wait_until(lambda: worker.link.get().lookup(daemon_keys)[0] == len(keys), timeout,
               f"{req_id}'s blocks in the daemon's host tier")


def blocks_of(kv, ids) -> list[torch.Tensor]:
    return [t[ids].clone() for row in parts_of(kv) for t in row]


def load_misses(worker, kv, keys, why: str) -> None:
    """A load of `keys` into DST that must find nothing: every DST block is a load error and
    none of them changed."""
    before = blocks_of(kv, DST)
    _, errors = step(worker, loads=[BlockTransfer("miss", keys, DST)])
    assert errors == set(DST), why
    for got, exp in zip(blocks_of(kv, DST), before):
        assert torch.equal(got, exp), why


@contextlib.contextmanager
def worker_with_saved(daemon, seed: int, mode: str, timeout: float = 10.0):
    """A worker in `mode` over random LBNHC KV whose SRC blocks one save stored under keys of
    its own (its staging, if any, back): yields (kv, worker, keys); the worker is closed after."""
    raw, kv = make_kv("LBNHC")
    fill(kv, seed=seed)
    worker, got_mode = make_worker(daemon, kv, direct=(mode == "direct"), timeout=timeout)
    assert got_mode == mode
    keys = keys_for(len(SRC), seed=seed + 2)
    try:
        step(worker, saves=[BlockTransfer("s", keys, SRC)])
        saved(worker, "s", keys)
        worker._reap_staged(wait=True)  # the save's staging blocks back (else a hang holds them too)
        yield kv, worker, keys
    finally:
        worker.close()
