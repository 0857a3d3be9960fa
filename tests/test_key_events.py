"""The key_events op: the host tier's changes of what it can load, in order, with a gap where a
reader missed some. The ring's logic in process; the op against a real daemon (offload, delete,
eviction, clear, a new geometry)."""
import pytest

from conftest import keys_for, small_kv, sweep_crashed, unique_instance
from kvcached.service.key_events import KeyEvents
from kvcached_client import launch
from kvcached_proto import ErrorCode, Op
from kvcached_proto.errors import RequestError


def test_the_ring_numbers_events_and_says_when_a_reader_missed_some():
    ev = KeyEvents(capacity=4)
    assert ev.since(0, 10) == ([], b"", b"", 0, False, False)
    for i in range(3):
        ev.host(bytes([i]) * 16, i != 1)
    keys, visible, _, last, gap, _ = ev.since(0, 10)
    assert keys == [bytes([0]) * 16, bytes([1]) * 16, bytes([2]) * 16] and visible == b"\x01\x00\x01"
    assert (last, gap) == (3, False)
    assert ev.since(1, 1) == ([bytes([1]) * 16], b"\x00", b"\x00", 2, False, False)  # limit: the next after is 2
    assert ev.since(3, 10) == ([], b"", b"", 3, False, False)  # caught up
    for i in range(3, 7):  # events 4..7; the ring keeps 4 of the 7
        ev.host(bytes([i]) * 16, True)
    keys, _, _, last, gap, _ = ev.since(2, 10)  # event 3 is gone
    assert gap and last == 7 and keys == [bytes([i]) * 16 for i in range(3, 7)]
    assert not ev.since(3, 10)[4]  # 4.. are all there
    assert ev.since(99, 10)[4], "a number this ring never gave is a gap"
    ev.voided()
    keys, _, _, last, gap, _ = ev.since(7, 10)  # caught up before the geometry changed: still a gap
    assert gap and keys == [] and last == 8
    assert ev.since(8, 10) == ([], b"", b"", 8, False, False)


def test_the_ring_answers_as_a_list_of_every_event_would_at_any_place_and_wrap():
    """The slot ring against the plainest model (every event ever, the last `cap` kept), for
    random host and storage events, voids of both kinds and reads from any number, with and
    without the storage events, across many wraps."""
    import random
    rng = random.Random(7)
    cap = 13
    ev, every, oldest, void = KeyEvents(capacity=cap), [None], 1, 0  # every[n]: event n (1-based)
    for _ in range(4000):
        roll = rng.random()
        if roll < 0.6:
            key, flag, tier = rng.randbytes(16), rng.random() < 0.5, rng.choice((0, 0, 1, 2))
            if tier:
                ev.storage(tier, [key], flag)
            else:
                ev.host(key, flag)
            every.append((key, flag, tier))
            oldest = max(oldest, len(every) - cap)
        elif roll < 0.62:
            if len(every) > 1:
                every.append(None)  # the number a void skips
                oldest = len(every)
            ev.voided()
        elif roll < 0.64:
            every.append("void")  # a storage void: a number of its own, given to no one
            oldest = max(oldest, len(every) - cap)
            void = len(every) - 1
            ev.voided(storage=True)
        else:
            nxt, storage = len(every), rng.random() < 0.5
            after = rng.randrange(0, nxt + 3) if rng.random() < 0.2 else max(0, nxt - rng.randrange(1, cap + 4))
            limit = rng.randrange(0, cap + 3)  # (a reader near the newest, mostly: as readers are)
            gap = after + 1 < oldest or after >= nxt
            first = oldest if gap else after + 1
            last = min(nxt, first + limit) - 1
            missed = void if storage and not gap and after < void else 0
            taken = [every[n] for n in range(first, last + 1)
                     if every[n] != "void" and (every[n][2] == 0 or (storage and n > missed))]
            want = ([k for k, _, _ in taken], bytes(int(f) for _, f, _ in taken),
                    bytes(t for _, _, t in taken), last, gap, 0 < missed <= last)
            assert ev.since(after, limit, storage) == want, (after, limit, nxt, oldest, void)
            assert ev.last == nxt - 1


def test_offloads_deletes_evictions_and_clears_are_told_in_order(run_dir):
    name = unique_instance("ke")
    # 256 KiB blocks, a 10 MB host tier: about 38 of them
    d = launch(instance=name, run_dir=run_dir, host_cache_gb=0.01)
    try:
        with d.connect() as c:
            kv = small_kv(num_layers=4, num_blocks=64, block_shape=(16, 8, 128))
            c.register_kv_cache(kv)
            early = keys_for(2, 9)
            c.offload([60, 61], early).wait(10)
            c.delete(early)  # both changes came before anyone followed: none is kept
            assert c.key_events(0) == ([], 0, False, 0)
            first = keys_for(8, 1)
            c.offload(range(8), first).wait(10)
            events, last, gap, newest = c.key_events(0)
            assert events == [(k, True) for k in first] and last == newest == 8 and not gap
            assert c.key_events(0, limit=0) == ([], 0, False, 8)  # where a new reader starts
            c.delete(first[5:])
            events, last, gap, _ = c.key_events(last)
            assert sorted(events) == sorted((k, False) for k in first[5:]) and last == 11
            more = keys_for(40, 2)
            c.offload(range(8, 48), more).wait(10)
            events, last2, gap, _ = c.key_events(last, limit=65536)
            gone = {k for k, v in events if not v}
            came = [k for k, v in events if v]
            assert came == more and gone and gone <= set(first[:5]) | set(more), events
            held = (set(first[:5]) | set(more)) - gone
            assert all(c.lookup([k])[0] == (k in held) for k in first[:5] + more)
            c.clear(tier="host")
            events, last3, gap, _ = c.key_events(last2)
            assert sorted(events) == sorted((k, False) for k in held) and not gap
            with pytest.raises(RequestError) as e:
                c._request(Op.KEY_EVENTS, after=-1)
            assert e.value.code == ErrorCode.BAD_FIELD
            # another geometry voids every host block unheard: a gap for a reader caught up
            c.offload(range(4), keys_for(4, 3)).wait(10)
            _, caught_up, _, _ = c.key_events(last3)
            c.register_kv_cache(small_kv(num_layers=2, num_blocks=64, block_shape=(16, 8, 128)))
            events, _, gap, _ = c.key_events(caught_up)
            assert gap and events == []
    finally:
        d.stop()
        sweep_crashed(name)
