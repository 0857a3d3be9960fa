"""The order words (kvcached_proto.order_words) on CPU: the GEQ rule, the engine's fence-word
bookkeeping and its guard (pure logic, with a recording stand-in for the CUDA stream
operations), and a real daemon reading and writing a real engine segment: fences checked,
progress words written before the counter, a bad or forged segment refused, a dead engine's
fence words released."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from conftest import keys_for, our_segments, wait_until
from kvcached_client import DaemonUnavailable, RequestError
from kvcached_client import cuda_order
from kvcached_client.cuda_order import EngineOrder
from kvcached_client.kv_alloc import describe_kv_cache
from kvcached_proto import ErrorCode, KvcachedTimeout, Op, pack_block_ids, pack_keys
from kvcached_proto.order_words import FENCE_WORDS, RELEASED, REVOKE_WORD, load_word, reached, segment_bytes
from kvcached_proto.shm_layout import NUM_SLOTS


def small_kv(layers=2, blocks=16):
    from kvcached_client import allocate_kv_cache

    kv = allocate_kv_cache(layers, blocks, (4, 2, 8), torch.float16)
    for i, layer in enumerate(kv):
        for j, t in enumerate(layer):
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * i + 7 * j)
    return kv


# the rule --------------------------------------------------------------------------------------

def test_reached_is_the_drivers_signed_geq():
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    assert reached(RELEASED, 2**40) and reached(RELEASED, 1)  # a release passes every wait
    assert not reached(2**64 - 1, 3)  # all ones is -1 to the driver: it would not pass
    assert reached(3, 2**64 - 2)  # past a wrap, by the signed difference
    assert segment_bytes(NUM_SLOTS, 1) % 4096 == 0
    assert segment_bytes(NUM_SLOTS, 80) >= 8 * load_word(NUM_SLOTS - 1, 79, 80) + 8


# the engine's half, with a stand-in for the stream operations ------------------------------------

class QueuedOps:
    """Records what would be queued on streams; `run()` plays the queued writes like a GPU."""

    def __init__(self, addr, nbytes):
        self.words = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * (nbytes // 8))
                                           .from_address(addr))
        self.writes, self.waits, self.unregistered = [], [], False

    def write(self, stream, word, value):
        self.writes.append((word, value))

    def wait_geq(self, stream, word, value):
        self.waits.append((word, value))

    def run(self):
        for word, value in self.writes:
            self.words[word] = value
        self.writes.clear()

    def unregister(self):
        self.unregistered = True


class FakeStream:
    cuda_stream = 1234


def engine_order(lost=lambda: False, layers=2):
    """An EngineOrder on a stand-in 'cuda:0' and the list its ops factory appends to (the words
    are registered by the first stream operation)."""
    made = []

    def factory(addr, nbytes):
        made.append(QueuedOps(addr, nbytes))
        made[-1].thread = threading.get_ident()
        return made[-1]
    return EngineOrder("cuda:0", layers, lost, ops_factory=factory), made


def test_a_fence_word_is_reused_only_once_its_last_fence_was_reached():
    order, made = engine_order()
    try:
        slots = cuda_order.FENCE_SLOTS
        fences = [order.fence(FakeStream()) for _ in range(slots)]
        ops, = made
        assert sorted(f["fence_word"] for f in fences) == list(range(slots))  # never REVOKE_WORD
        assert [f["fence"] for f in fences] == list(range(1, slots + 1))
        with pytest.raises(KvcachedTimeout, match="fence"):  # every word still waits for its stream
            order.fence(FakeStream(), timeout=0.05)
        ops.run()  # the engine's streams reached their fences
        again = order.fence(FakeStream())
        assert again["fence"] == slots + 1 and ops.writes == [(again["fence_word"], again["fence"])]
    finally:
        order.close()
    assert ops.unregistered


def test_the_guard_releases_waits_only_when_the_daemon_is_lost(monkeypatch):
    monkeypatch.setattr(cuda_order, "GUARD_PERIOD_S", 0.005)
    lost = {"now": False}
    order, made = engine_order(lambda: lost["now"])
    try:
        order.wait_loaded(slot=3, layer=1, task_id=41, stream=FakeStream())
        ops, = made
        assert ops.waits == [(load_word(3, 1, 2), 41)]
        time.sleep(0.1)
        assert order.pending() == 1 and not order.released  # the daemon lives: its write will come
        order.words[load_word(3, 1, 2)] = 41  # the daemon's stream wrote it
        wait_until(lambda: order.pending() == 0, 10)
        order.wait_loaded(slot=4, layer=0, task_id=42, stream=FakeStream())
        lost["now"] = True
        wait_until(lambda: order.released, 10)
        assert order.pending() == 0 and (order.words[FENCE_WORDS:] == RELEASED).all()
    finally:
        order.close()


def test_closing_with_waits_in_flight_keeps_the_mapping_until_they_end(monkeypatch):
    monkeypatch.setattr(cuda_order, "GUARD_PERIOD_S", 0.005)
    monkeypatch.setattr(cuda_order, "CLOSED_RELEASE_S", 0.3)
    order, made = engine_order()
    order.wait_loaded(slot=0, layer=0, task_id=7, stream=FakeStream())
    ops, = made
    order.close()
    assert not os.path.exists(f"/dev/shm{order.name}")  # the name goes at once
    assert not ops.unregistered  # a stream still waits on the mapping
    wait_until(lambda: order.released, 3)  # released past CLOSED_RELEASE_S
    time.sleep(0.05)
    # the guard let it go; the thread that registered it undoes it at its next stream operation
    assert not ops.unregistered
    other, _ = engine_order()
    other.fence(FakeStream())
    assert ops.unregistered
    other.close()


def test_the_words_are_registered_and_unregistered_on_the_engines_thread_only(monkeypatch):
    """A reattach makes a client's order words on a background thread. A CUDA call there (the
    words' cuMemHostRegister) while vLLM captures its CUDA graphs at start-up would invalidate
    the capture: the registration waits for the engine's first stream operation, on its own
    thread, and a close on another thread leaves the unregistration to that thread."""
    monkeypatch.setattr(cuda_order, "GUARD_PERIOD_S", 0.005)
    made_by = {}

    def background():
        made_by["order"] = engine_order()
    t = threading.Thread(target=background)
    t.start()
    t.join()
    order, made = made_by["order"]
    assert made == []  # no CUDA call on the reattach thread
    order.fence(FakeStream())
    ops, = made
    assert ops.thread == threading.get_ident()
    closer = threading.Thread(target=order.close)
    closer.start()
    closer.join()
    assert not ops.unregistered  # not from the closing thread
    nxt, made2 = engine_order()
    nxt.wait_loaded(slot=0, layer=0, task_id=1, stream=FakeStream())
    assert ops.unregistered and made2[0].thread == threading.get_ident()
    nxt.words[load_word(0, 0, 2)] = 1  # the daemon wrote it
    nxt.close()  # the guard frees it once the wait passed: deferred to this thread
    wait_until(lambda: cuda_order._deferred, 10)
    assert not made2[0].unregistered
    cuda_order._undo_deferred()
    assert made2[0].unregistered


# a real daemon with a real engine segment --------------------------------------------------------

def test_progress_words_hold_the_load_before_its_counter_and_fences_are_checked(daemon):
    kv = small_kv()
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        keys = keys_for(4, 31)
        assert c.offload([0, 1, 2, 3], keys).wait(10)["stored"] == 4
        task = c.load(keys, [8, 9, 10, 11])
        for layer in range(2):
            task.wait_layer(layer, timeout=10)  # checks the word against the task id
            assert int(c.order.words[load_word(task.slot, layer, 2)]) == task.id
        assert task.wait(10) == 4
        word = c.order.fence(None)["fence_word"]  # written by the CPU: the next is unwritten
        for op in (Op.OFFLOAD, Op.LOAD):
            c.order.words[REVOKE_WORD] = 1  # a fence of 1 there would pass the CPU check
            for bad in ({"fence_word": word, "fence": 10**6}, {"fence_word": FENCE_WORDS, "fence": 1},
                        {"fence_word": REVOKE_WORD, "fence": 1}):
                with pytest.raises(RequestError) as err:
                    c._request(op, None, keys=pack_keys(keys_for(2, 32)), blocks=pack_block_ids([12, 13]),
                               **bad)
                assert err.value.code == ErrorCode.BAD_FIELD
        assert c.lookup(keys_for(2, 32)) == (0, 0)
        assert c.check() == "ok"


@pytest.mark.parametrize("case", ["kv_segment", "missing", "too_small", "not_ours"])
def test_a_bad_order_segment_is_refused_and_registers_nothing(daemon, case):
    import posix_ipc

    kv = small_kv()
    layout = describe_kv_cache(kv)
    made = None
    if case == "kv_segment":
        layout["order_segment"] = layout["allocations"][0]["name"]
    elif case == "missing":
        layout["order_segment"] = f"/kvcached.{os.getuid()}.kv.{os.getpid()}.99999"
    elif case == "too_small":
        made = f"/kvcached.{os.getuid()}.kv.{os.getpid()}.99998"
        posix_ipc.SharedMemory(made, flags=posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
        layout["order_segment"] = made
    else:
        layout["order_segment"] = "/kvcached.0.kv.1.1" if os.getuid() else "/kvcached.1.kv.1.1"
    try:
        with daemon.connect() as c:
            with pytest.raises(RequestError) as err:
                c._request(Op.REGISTER_KV, layout=layout)
            assert err.value.code in (ErrorCode.KV_MISMATCH, ErrorCode.BAD_FIELD)
            assert "order_segment" in err.value.message or "segment" in err.value.message
            assert c.status()["kv"]["registered"] is False
    finally:
        if made:
            posix_ipc.unlink_shared_memory(made)


def test_cuda_kv_without_an_order_segment_is_refused_at_registration():
    from kvcached_proto import ProtocolError
    from kvcached_proto.layout import parse_layout, require_order_segment

    layout = {"device": "cuda:0", "num_layers": 1, "num_blocks": 4,
              "allocations": [{"kind": "cuda_ipc"}], "tensors": [
                  {"layer": 0, "part": 0, "dtype": "float16", "shape": [4, 8], "alloc": 0, "offset": 0,
                   "block_stride": 16}]}
    with pytest.raises(ProtocolError, match="order_segment"):
        require_order_segment(parse_layout(layout))  # what register_kv checks first
    require_order_segment(parse_layout({**layout, "order_segment": "/kvcached.0.kv.1.1"}))
    cpu = {**layout, "device": "cpu"}
    cpu["allocations"] = [{"kind": "shm"}]
    require_order_segment(parse_layout(cpu))  # optional on CPU


def test_a_dead_engines_fence_words_are_released(daemon):
    """An engine registers and is SIGKILLed; the daemon, seeing it gone, writes RELEASED into
    its fence words (on CUDA that is what lets a copy stream waiting for a fence go on)."""
    import mmap

    import posix_ipc

    code = textwrap.dedent(f"""
        import sys, time, torch
        from kvcached_client import Client, allocate_kv_cache
        kv = allocate_kv_cache(2, 16, (4, 2, 8), torch.float16)
        c = Client.connect(instance={daemon.instance!r}, run_dir={daemon.run_dir!r})
        c.register_kv_cache(kv)
        print(c.order.name, flush=True)
        time.sleep(60)
    """)
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    name = engine.stdout.readline().strip()
    shm = posix_ipc.SharedMemory(name, flags=0)
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    try:
        words = np.frombuffer(mm, dtype=np.uint64)
        assert not (words[:FENCE_WORDS] == RELEASED).any()
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
        wait_until(lambda: bool((words[:FENCE_WORDS] == RELEASED).all()), 15)
        words = None  # lets the mapping close
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)
        mm.close()
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass  # swept by the daemon


def test_a_cuda_registration_that_fails_at_the_first_fence_costs_the_connection_not_the_step():
    """The words are registered by the first stream operation, in the engine's step: a CUDA
    error there comes as DaemonUnavailable (what the engine's callers go on without), never as
    a RuntimeError into the forward, and the connection is spent (a reattach makes another)."""
    def refusing(addr, nbytes):
        raise RuntimeError("cuMemHostRegister of the order words failed: CUDA error 2")
    order = EngineOrder("cuda:0", 2, lambda: False, ops_factory=refusing)
    try:
        with pytest.raises(DaemonUnavailable, match="could not be registered with CUDA"):
            order.fence(FakeStream())
        assert order.released and order.ops is None
    finally:
        order.close()
    order, made = engine_order()
    try:
        order.fence(FakeStream())
        made[0].wait_geq = lambda *a: (_ for _ in ()).throw(RuntimeError("cuStreamWaitValue64 failed"))
        with pytest.raises(DaemonUnavailable, match="wait_geq on the order words failed"):
            order.wait_loaded(slot=0, layer=0, task_id=3, stream=FakeStream())
        assert order.released
    finally:
        order.close()


def test_cuda_refusing_the_order_words_pauses_registrations_not_every_step(monkeypatch, daemon):
    """Each CUDA refusal spends its connection and the reattach registers again; without a
    pause that is a register_kv round trip (and a drain of the daemon's copies) at every engine
    step. The pause doubles with each refusal in a row, and a registration that works ends it."""
    refusals = cuda_order._Refusals()
    monkeypatch.setattr(cuda_order, "refusals", refusals)
    monkeypatch.setattr(cuda_order, "REFUSED_PAUSE_S", (0.2, 0.5))
    pauses = []
    failed = refusals.failed
    monkeypatch.setattr(refusals, "failed", lambda why: pauses.append(failed(why)) or pauses[-1])

    def refusing(addr, nbytes):
        raise RuntimeError("cuMemHostRegister of the order words failed: CUDA error 2")
    for _ in range(3):
        order = EngineOrder("cuda:0", 2, lambda: False, ops_factory=refusing)
        try:
            with pytest.raises(DaemonUnavailable):
                order.fence(FakeStream())
        finally:
            order.close()
    assert pauses == [0.2, 0.4, 0.5]  # doubling, up to the longest
    kv = small_kv()  # (kept: a KV dropped here was unlinked when a collection came to it, and
    layout = describe_kv_cache(kv)  # the segments compared below differed by it)
    layout["device"] = "cuda:0"
    before = our_segments()  # (other workers' tests make segments meanwhile)
    with daemon.connect() as c:
        with pytest.raises(DaemonUnavailable, match="refused the order words 3 time"):
            c.register_layout(dict(layout))  # paused: nothing is sent, no segment made
        assert c.order is None
        assert our_segments() == before
        time.sleep(0.55)
        with pytest.raises(RequestError):  # the pause is over: the daemon is asked (a CPU
            c.register_layout(dict(layout))  # daemon refuses CUDA KV, which is the daemon's say)
    order, made = engine_order()
    try:
        order.fence(FakeStream())  # registered: the streak ends
        assert made and cuda_order.refusals.count == 0
        cuda_order.refusals.check()
    finally:
        order.close()


def test_the_revoke_word_only_grows():
    order, _ = engine_order()
    try:
        order.revoke(40)
        order.revoke(12)  # an older task: already covered
        assert order.words[REVOKE_WORD] == 40
        order.revoke(41)
        assert order.words[REVOKE_WORD] == 41
    finally:
        order.close()


def test_a_released_wait_fails_its_load_and_spends_the_connection(monkeypatch, daemon):
    """A daemon late past the hang threshold has every progress word released (the engine's
    streams must not wait forever); if it then beats again, the same words would let every
    later layer wait pass before its copies landed - wrong KV, the load still DONE. Now the
    loads whose waits were released count 0 blocks and the connection is spent (not alive:
    a reattach makes a new one, with fresh words)."""
    monkeypatch.setattr(cuda_order, "GUARD_PERIOD_S", 0.005)
    lost = {"now": False}
    order, _ops = engine_order(lambda: lost["now"])
    try:
        order.wait_loaded(slot=1, layer=0, task_id=42, stream=FakeStream())
        lost["now"] = True
        wait_until(lambda: order.released, 10)
        assert order.released_loads == {42}
    finally:
        order.close()
    kv = small_kv()
    keys = keys_for(4, 77)
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        c.offload([0, 1, 2, 3], keys).wait(10)
        task = c.load(keys, [8, 9, 10, 11])
        task.wait_layer(0)
        c.order.release("the test: the daemon was late past the hang threshold")
        assert task.wait(10) == 0  # its end says done; a released wait makes it count nothing
        assert not c.alive()
        with pytest.raises(DaemonUnavailable, match="order words were released"):
            c.load(keys, [12, 13, 14, 15]).wait_layer(0)
