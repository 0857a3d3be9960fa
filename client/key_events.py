"""Following what a daemon can load (the key_events op): the host tier's changes (1.9) and its
local storage tiers' (1.10), and which tiers hold given keys now. A part of Client (client.py):
it uses the client's `_request` and `info`."""
from __future__ import annotations

from typing import NamedTuple, Sequence

from kvcached_proto import KvcachedError, Op, ProtocolError, pack_keys
from kvcached_proto.codec import KEY_BYTES
from kvcached_proto.ops import ErrorCode


class TierEvents(NamedTuple):
    events: list  # (key, held?, tier): tier 0 the host tier, n the n-th local storage tier
    last: int  # the number of the last event looked at: the next `after`
    gap: bool  # changes after `after` were missed: start over
    newest: int
    tiers: list  # the local storage tiers' names, tier 1 first
    held: list  # one int per key asked: bit 0 the host tier can load it, bit n tier n holds it
    storage_gap: bool = False  # what the storage tiers hold changed unheard: start that over


class FollowsKeys:
    def key_events(self, after: int, limit: int = 4096, timeout: float | None = None) -> tuple:
        """The host tier's changes after event number `after` (0: from the first): ([(key,
        loadable)], the last number given - the next `after` -, gap: changes were missed, the
        newest number)."""
        reply = self._request(Op.KEY_EVENTS, timeout, after=after, limit=limit)
        keys = _keys(reply["keys"], len(reply["visible"]), "key_events")
        return list(zip(keys, (v == 1 for v in reply["visible"]))), reply["last"], reply["gap"], reply["newest"]

    def tier_events(self, after: int, limit: int = 4096, ask: Sequence[bytes] = (),
                    timeout: float | None = None) -> TierEvents:
        """The changes of the host tier and of the local storage tiers (disk) after event number
        `after`, and which tiers hold the keys of `ask` (at most 4,096) once those changes are
        applied (a change after them comes at the next call). A daemon older than protocol 1.10
        is UNKNOWN_OP."""
        if tuple(self.info.get("protocol_version", (0, 0))) < (1, 10):
            raise ProtocolError(ErrorCode.UNKNOWN_OP, "the daemon's protocol is older than 1.10: "
                                "it follows no storage tier")
        fields = {"ask": pack_keys(ask)} if len(ask) else {}
        reply = self._request(Op.KEY_EVENTS, timeout, after=after, limit=limit, storage=True, **fields)
        visible, tiers, held = reply["visible"], reply.get("tiers", b""), reply.get("held", b"")
        if len(tiers) != len(visible) or len(held) != len(ask):
            raise KvcachedError(f"key_events: {len(tiers)} tiers for {len(visible)} events, "
                                f"{len(held)} answers for {len(ask)} keys asked")
        keys = _keys(reply["keys"], len(visible), "key_events")
        return TierEvents(list(zip(keys, (v == 1 for v in visible), tiers)), reply["last"], reply["gap"],
                          reply["newest"], list(reply.get("storage_tiers", ())), list(held),
                          bool(reply.get("storage_gap", False)))


def _keys(blob: bytes, n: int, op: str) -> list[bytes]:
    if len(blob) != KEY_BYTES * n:
        raise KvcachedError(f"{op}: {len(blob)} bytes of keys for {n} events")
    return [blob[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]
