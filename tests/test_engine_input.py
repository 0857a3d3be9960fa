"""What an engine passes by mistake is refused with a ProtocolError before anything is sent, and
changes nothing: block ids that are floats (1.5 was sent as block 1, another request's), a
boolean mask (sent as blocks 0 and 1), strings, None, ragged lists; keys of mixed lengths whose
total is a whole number of keys (joined, an 8-byte and a 24-byte key went as two other keys)."""
import numpy as np
import pytest
import torch

from conftest import keys_for, kv_parts, ranks, small_kv
from kvcached_client import GroupClient
from kvcached_proto import ProtocolError
from kvcached_proto.codec import check_block_ids, pack_keys

BAD_IDS = [[1.5, 2.0], np.array([8.0, 9.0]), [True, False], np.array([True] * 4), ["8"], [None], [[8], [9, 10]]]


@pytest.mark.parametrize("ids", BAD_IDS, ids=lambda x: type(x).__name__ + ":" + repr(x)[:12])
def test_ids_that_are_not_integers_are_refused(ids):
    with pytest.raises(ProtocolError, match="block ids"):
        check_block_ids(ids)


def test_integer_ids_of_any_integer_type_pass():
    for ids in ([8, 9], np.array([8, 9], dtype=np.uint16), torch.tensor([8, 9]), range(8, 10), [], np.array([])):
        assert check_block_ids(ids).tolist() == list(ids if not isinstance(ids, np.ndarray) else ids.tolist())


def test_keys_of_mixed_lengths_are_refused_even_where_their_total_fits():
    with pytest.raises(ProtocolError, match="16-byte digest"):
        pack_keys([b"a" * 8, b"b" * 24])


def _snapshot(kv):
    return [t.clone() for layer in kv for t in kv_parts(layer)]


def _same(kv, snap) -> bool:
    return all(torch.equal(t, s) for t, s in zip((t for layer in kv for t in kv_parts(layer)), snap))


def test_a_client_sends_nothing_for_bad_ids_and_the_kv_stays_as_it_was(daemon):
    kv = small_kv(num_layers=2, num_blocks=16)
    keys = keys_for(4, 61)
    with daemon.connect(timeout=10) as c:
        c.register_kv_cache(kv)
        c.offload([0, 1, 2, 3], keys).wait(10)
        snap, done = _snapshot(kv), c.status()["tasks"]["completed"]
        for ids in ([8.0, 9.5, 10.0, 11.0], [True, True, False, False], [None] * 4):
            with pytest.raises(ProtocolError, match="block ids"):
                c.load(keys, ids)
            with pytest.raises(ProtocolError, match="block ids"):
                c.offload(ids, keys)
        with pytest.raises(ProtocolError, match="cannot be encoded"):  # (msgpack's OverflowError)
            c.load(keys, [8, 9, 10, 11], priority=2**70)
        good, bad = c.load_batch([(keys, [8, 9, 10, 11]), (keys, [12.0, 13.0, 14.0, 15.0])])
        assert isinstance(bad, ProtocolError) and good.wait(10) == 4
        for part, before in zip((t for layer in kv for t in kv_parts(layer)), snap):
            assert torch.equal(part[8:12], before[0:4])  # the good load landed
            assert torch.equal(part[12:], before[12:]) and torch.equal(part[:8], before[:8])
        assert c.status()["tasks"]["completed"] == done + 1  # the good load alone ran


def test_a_group_refuses_bad_ids_before_any_rank_is_asked(run_dir):
    with ranks(run_dir, 2) as (names, _):
        kv = [small_kv(num_layers=2, num_blocks=16, seed=r) for r in range(2)]
        keys = keys_for(4, 67)
        with GroupClient.connect(names, run_dir=run_dir, timeout=10) as g:
            g.register_kv_cache(kv)
            g.offload([0, 1, 2, 3], keys).wait(10)
            snaps = [_snapshot(k) for k in kv]
            for ids in ([8.5, 9.0, 10.0, 11.0], [True, False, True, False]):
                with pytest.raises(ProtocolError, match="block ids"):
                    g.load(keys, ids)
                with pytest.raises(ProtocolError, match="block ids"):
                    g.offload(ids, keys)
            got = g.load_batch([(keys, [8, 9, 10, 11]), (keys, [12.0, 13.0, 14.0, 15.0])])
            assert isinstance(got[1], ProtocolError) and got[0].wait(10) == 4
            for r in range(2):
                parts = [t for layer in kv[r] for t in kv_parts(layer)]
                assert all(torch.equal(p[8:12], s[0:4]) and torch.equal(p[12:], s[12:])
                           for p, s in zip(parts, snaps[r]))
