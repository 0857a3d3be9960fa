"""A call interrupted while it waits for the daemon's reply (Ctrl-C in an engine driven from a
notebook, a signal handler that raises): the request was sent, and a daemon that takes it copies
all the same. A load's blocks stay held until the load it made ends, as for a reply that did not
come; an offload is revoked, so blocks the engine reuses are never stored under its keys. Before,
neither: the late load overwrote blocks the engine had handed on, and the late offload stored the
reused blocks' bytes under the old keys."""
from __future__ import annotations

import contextlib
import signal
import threading

import pytest
import torch

from conftest import keys_for, ranks, small_kv, wait_until
from test_unanswered_load import DST, SRC, _all, _fill
from kvcached_client import GroupClient
from kvcached_proto import DaemonUnavailable
from kvcached.bench import process_stop

def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupted_in(seconds: float):
    """A KeyboardInterrupt in this (the main) thread `seconds` from now, from a signal as Ctrl-C's."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    old = signal.signal(signal.SIGUSR2, _interrupt)
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR2))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR2, old)


@contextlib.contextmanager
def _stopped(daemon):
    process_stop.stop(daemon.pid)
    try:
        yield
    finally:
        process_stop.go_on(daemon.pid)


def test_a_load_interrupted_while_it_waits_for_its_reply_holds_its_blocks(daemon):
    kv = small_kv(num_layers=2, num_blocks=16)
    keys = keys_for(len(SRC), 43)
    with daemon.connect(timeout=30, hang_s=30) as c:
        c.register_kv_cache(kv)
        _fill(kv, SRC, 3)
        c.offload(SRC, keys).wait(10)
        _fill(kv, DST, 5)
        with _stopped(daemon):
            with _interrupted_in(0.3), pytest.raises(KeyboardInterrupt):
                c.load(keys, DST)
            assert c.held_blocks() == set(DST), "an interrupted load's blocks are not held"
        wait_until(lambda: c.held_blocks() == set(), 20, "the late load's end")
        assert _all(kv, DST, 3), "the late load did not run (the test proves nothing)"


def test_an_offload_interrupted_while_it_waits_for_its_reply_is_revoked(daemon):
    kv = small_kv(num_layers=2, num_blocks=16)
    keys = keys_for(len(SRC), 47)
    with daemon.connect(timeout=30, hang_s=30) as c, daemon.connect(timeout=10) as probe:
        c.register_kv_cache(kv)
        _fill(kv, SRC, 3)
        with _stopped(daemon):
            with _interrupted_in(0.3), pytest.raises(KeyboardInterrupt):
                c.offload(SRC, keys)
            _fill(kv, SRC, 1)  # the engine reuses the blocks

        def ended() -> list:
            try:
                c.poll_events()
            except DaemonUnavailable:
                return []
            return [e for e in c._events.values() if e.get("status") is not None]

        wait_until(lambda: ended(), 20, "the daemon ran the offload it took late")
        assert [e["status"] for e in ended()] == ["cancelled"]
        assert probe.lookup(keys) == (0, 0)


@contextlib.contextmanager
def _stopped_for(handle, seconds: float):
    """The daemon stopped now and let go on `seconds` later, from another thread."""
    process_stop.stop(handle.pid)
    timer = threading.Timer(seconds, process_stop.go_on, (handle.pid,))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        process_stop.go_on(handle.pid)


def test_a_group_load_interrupted_while_a_rank_is_out_holds_what_every_rank_started(run_dir):
    """Rank 0 answers at once (its copies paused), rank 1 is stopped for 1 s: the interrupt comes
    while the group waits for rank 1. The ranks' calls end first, and each load they started
    holds its blocks: the caller never got a task to wait for."""
    with ranks(run_dir, 2) as (names, handles):
        kv = [small_kv(num_layers=2, num_blocks=32, seed=r) for r in range(2)]
        keys = keys_for(4, 53)
        with GroupClient.connect(names, run_dir=run_dir, timeout=30, hang_s=30) as g, \
                handles[0].connect(role="operator") as op:
            g.register_kv_cache(kv)
            g.offload(SRC, keys).wait(10)
            op.pause()
            try:
                with _stopped_for(handles[1], 1.0), _interrupted_in(0.3), pytest.raises(KeyboardInterrupt):
                    g.load(keys, DST)
                assert g.held_blocks() >= set(DST), "the loads the ranks started are not held"
            finally:
                op.resume()
            wait_until(lambda: not g.held_blocks(), 20, "both ranks' loads ending")
            for r in range(2):
                assert all(torch.equal(part[SRC], part[DST]) for layer in kv[r] for part in layer)


def test_a_group_offload_interrupted_while_a_rank_is_out_stores_no_reused_block(run_dir):
    """Rank 0 answers at once (its copies paused), rank 1 is stopped for 1 s; interrupted, the
    engine reuses the blocks: rank 0's offload, revoked, stores nothing; whatever rank 1 stored
    is the blocks' bytes from before."""
    with ranks(run_dir, 2) as (names, handles):
        kv = [small_kv(num_layers=2, num_blocks=32, seed=r) for r in range(2)]
        before = [[part[SRC].clone() for layer in kv[r] for part in layer] for r in range(2)]
        keys = keys_for(4, 59)
        with GroupClient.connect(names, run_dir=run_dir, timeout=30, hang_s=30) as g, \
                handles[0].connect(role="operator") as op:
            g.register_kv_cache(kv)
            op.pause()
            try:
                with _stopped_for(handles[1], 1.0), _interrupted_in(0.3), pytest.raises(KeyboardInterrupt):
                    g.offload(SRC, keys)
                for r in range(2):  # the engine reuses the blocks
                    for layer in kv[r]:
                        for part in layer:
                            part[SRC] = 1
            finally:
                op.resume()
            clients = g.clients
            wait_until(lambda: all(c.status()["tasks"]["inflight"] == 0 and c.status()["tasks"]["queued"] == 0
                                   for c in clients), 20, "both ranks' offloads ending")
            assert clients[0].lookup(g._keys(keys, 0)) == (0, 0), "rank 0 stored the reused blocks"
            got = clients[1].lookup(g._keys(keys, 1))[0]
            if got:
                assert clients[1].load(g._keys(keys, 1)[:got], DST[:got]).wait(10) == got
                parts = [part for layer in kv[1] for part in layer]
                assert all(torch.equal(p[DST[:got]], b[:got]) for p, b in zip(parts, before[1]))
