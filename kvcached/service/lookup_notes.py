"""The lookup_notes op: what a client's lookups answered from the key table saw
(client/key_table.py), told in batches, so the eviction policy's history, the hit entries'
recency and selective backups, and the hit counters go on as if the daemon had answered them.

A message's work is bounded: at most MAX_NOTED_LOOKUPS lookups of MAX_NOTED_KEYS keys in all
(5.5 ms under lru, 12 ms under s2lru, noted 8 times each), each walked once however often
it was asked (the policy hears it as asked up to NOTE_REPLAY_MAX times), with the host lock let
go every NOTES_PER_HOLD lookups. (Replayed once per time asked, 65,536 one-key lookups asked 8
times held the daemon 0.54-0.95 s.)
"""
from __future__ import annotations

import array

from kvcached_proto import ErrorCode
from kvcached_proto.key_table import MAX_NOTED_KEYS, MAX_NOTED_LOOKUPS

from ..errors import OpError

NOTE_REPLAY_MAX = 8  # a noted lookup asked more often feeds the policy as if asked this often
NOTES_PER_HOLD = 256  # noted lookups taken under one hold of the host lock


def notes_repeats(body: dict) -> list[int]:
    """lookup_notes' `repeats`: one int32 >= 1 per lookup (default 1 each)."""
    raw, n = body["repeats"], len(body["counts"])
    if not raw:
        return [1] * n
    if len(raw) != 4 * n:
        raise OpError(ErrorCode.BAD_FIELD, f"repeats: {len(raw)} bytes for {n} lookups (int32 each)")
    repeats = array.array("i", raw).tolist()
    if min(repeats, default=1) < 1:
        raise OpError(ErrorCode.BAD_FIELD, "repeats: each lookup was asked at least once")
    return repeats


def take_notes(host, storage, hits: dict, body: dict) -> None:
    """Feed a lookup_notes message to the host tier's index and policy (host: the HostTier),
    the selective backups (storage: the StorageFlow) and the `lookups` counters (hits)."""
    keys, counts, repeats = body["keys"], body["counts"], notes_repeats(body)
    if len(counts) > MAX_NOTED_LOOKUPS or len(keys) > MAX_NOTED_KEYS:
        raise OpError(ErrorCode.TOO_MANY_ITEMS, f"{len(counts)} lookups of {len(keys)} keys: more "
                      f"than {MAX_NOTED_LOOKUPS} lookups or {MAX_NOTED_KEYS} keys")
    if len(counts) and (int(counts.min()) < 1 or int(counts.sum()) != len(keys)):
        raise OpError(ErrorCode.BAD_FIELD, f"counts: {len(counts)} counts of >= 1 key summing "
                      f"to the {len(keys)} keys expected")
    asked = hit = at = 0
    counts = counts.tolist()
    for first in range(0, len(counts), NOTES_PER_HOLD):  # the lock let go between slices
        with host.lock:
            for n, times in zip(counts[first:first + NOTES_PER_HOLD], repeats[first:first + NOTES_PER_HOLD]):
                looked = keys[at:at + n]
                at += n
                heard = min(times, NOTE_REPLAY_MAX)  # what policies count, bounded: one pass
                host.index.note_request(looked, heard)  # whatever the repeats
                entries = host.index.prefix(looked, times=heard)
                storage.after_hits(entries)
                asked += n * times
                hit += len(entries) * times
    with host.lock:
        hits["lookups"] += sum(repeats) + body["unnoted"]
        hits["table_lookups"] += sum(repeats) + body["unnoted"]
        hits["unnoted_lookups"] += body["unnoted"]  # counted, their keys unknown
        hits["keys"] += asked
        hits["host_hits"] += hit
        hits["storage_hits"] += min(body["storage_hits"], asked - hit)
