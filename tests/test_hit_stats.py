"""Hit statistics count what loads served, by where it was: a lookup that starts a prefetch and
the one after it ask about the same blocks twice, so lookups alone overstate hits."""
from storage_util import stored_on_disk_only


def _loaded(c):
    hits = c.status()["lookups"]
    return hits["loaded_from_host"], hits["loaded_from_storage"]


def test_blocks_loaded_are_counted_by_the_tier_they_came_from(run_dir, instance, disk_dir):
    h, kv, keys, _ = stored_on_disk_only(run_dir, instance, disk_dir, seed=5, n=8)
    try:
        with h.connect() as c:
            c.register_kv_cache(kv)
            base = _loaded(c)
            assert c.load(keys[:4], list(range(20, 24))).wait(10) == 4  # fetched for this load
            c.prefetch(keys[4:], block_tokens=256).wait(10)  # brought in ahead, then loaded
            assert c.lookup(keys) == (8, 0) and c.lookup(keys) == (8, 0)  # asked twice
            assert c.load(keys, list(range(30, 38))).wait(10) == 8
            host, storage = _loaded(c)
            assert (host - base[0], storage - base[1]) == (4, 8)
    finally:
        h.stop()
