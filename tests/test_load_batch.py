"""Client.load_batch: a step's loads sent together, their replies collected after. Each load
gets what load() would have given it: its task (bytes exact), the daemon's refusal (the others
unaffected), or, sent and unanswered, its blocks held."""
from __future__ import annotations


import pytest
import torch

from conftest import keys_for, small_kv, wait_until
from kvcached_client import DaemonUnavailable
from kvcached_client.tasks import LoadTask
from kvcached_proto import KvcachedError, Op, ProtocolError
from kvcached.bench import process_stop


def _same(kv, a, b) -> bool:
    return all(torch.equal(k[a], k[b]) and torch.equal(v[a], v[b]) for k, v in kv)


def test_each_load_of_a_batch_gets_its_own_answer(daemon):
    kv = small_kv(num_layers=3, num_blocks=64, seed=5)
    sets = [keys_for(4, 60 + i) for i in range(3)]
    with daemon.connect(timeout=10) as c:
        c.register_kv_cache(kv)
        for i, ks in enumerate(sets):
            c.offload(range(4 * i, 4 * i + 4), ks).wait(10)
        got = c.load_batch([(sets[0], [40, 41, 42, 43]),
                            (sets[1], [44, 45, 46, 99]),  # block 99 is past the 64: refused
                            (sets[2][:2] + keys_for(2, 99), [48, 49, 50, 51])])  # 2 of 4 found
        assert isinstance(got[0], LoadTask) and isinstance(got[2], LoadTask)
        assert isinstance(got[1], KvcachedError) and "99" in str(got[1])
        assert got[0].wait(10) == 4 and got[2].wait(10) == 2
        assert got[2].reply["device_blocks"] == [48, 49]
        assert _same(kv, [0, 1, 2, 3], [40, 41, 42, 43]) and _same(kv, [8, 9], [48, 49])
        assert not _same(kv, [4, 5, 6], [44, 45, 46]), "the refused load wrote its blocks"
        assert c.held_blocks() == set()


def test_a_load_that_cannot_be_sent_is_its_own_error_and_the_others_go(daemon):
    kv = small_kv(num_layers=2, num_blocks=16)
    keys = keys_for(2, 1)
    with daemon.connect(timeout=10) as c:
        c.register_kv_cache(kv)
        c.offload([0, 1], keys).wait(10)
        handled = c.status()["requests"]["handled"]
        got = c.load_batch([([b"short"], [2]), (keys, [4, 5]), (keys, [-1, 6])])
        assert isinstance(got[0], ProtocolError) and "keys[0]" in str(got[0])
        assert isinstance(got[2], ProtocolError) and "block ids" in str(got[2])
        assert got[1].wait(10) == 2 and _same(kv, [0, 1], [4, 5])
        # the status call and the one load: the two that could not be sent never were
        assert c.status()["requests"]["handled"] == handled + 2
        with pytest.raises(ProtocolError):
            c.load([b"short"], [2])  # a batch of one raises it


def test_a_batch_sent_to_a_hung_daemon_holds_every_loads_blocks(daemon):
    kv = small_kv(num_layers=2, num_blocks=32)
    sets = [keys_for(2, 70 + i) for i in range(3)]
    with daemon.connect(timeout=30, hang_s=0.5) as c:
        c.register_kv_cache(kv)
        for i, ks in enumerate(sets):
            c.offload(range(2 * i, 2 * i + 2), ks).wait(10)
        pumped = []
        pump = c._pump
        c._pump = lambda wait_s: (pumped.append(wait_s), pump(wait_s))[1]
        process_stop.stop(daemon.pid)
        try:
            got = c.load_batch([(ks, [20 + 2 * i, 21 + 2 * i]) for i, ks in enumerate(sets)], timeout=1.0)
            c._pump = pump
            assert all(isinstance(e, DaemonUnavailable) for e in got)
            # the first reply's wait saw the hang; the others' found the time gone: they polled
            # without waiting (each waited a 20 ms slice for nothing)
            assert pumped[-2:] == [0.0, 0.0], pumped[-4:]
            assert c.held_blocks() == set(range(20, 26))
        finally:
            process_stop.go_on(daemon.pid)
        wait_until(lambda: all(e.unanswered.done() for e in got), 20, "the late loads ending")
        assert _same(kv, list(range(6)), list(range(20, 26))), "the daemon did not take them late"


def test_a_reply_read_while_waiting_for_an_earlier_one_is_taken_without_polling(daemon):
    """The replies of a batch come back together: the first wait reads them all, and each later
    one is taken from what was read (it polled the socket first, up to 20 ms for nothing)."""
    with daemon.connect(timeout=10) as c:
        rids = [c._send(Op.PING, {}) for _ in range(3)]
        c._reply(rids[0], Op.PING, None)
        wait_until(lambda: (c._pump(0.01), all(r in c._replies for r in rids[1:]))[1], 5,
                   "the later replies read")

        def no_pump(wait_s):
            raise AssertionError("polled for a reply already read")

        c._pump = no_pump
        assert all(c._checked(c._reply(r, Op.PING, None))["ok"] for r in rids[1:])
