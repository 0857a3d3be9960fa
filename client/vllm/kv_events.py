"""vLLM's KV cache events for the blocks kvcached holds: `BlockStored` with medium "CPU" once a
block the engine offloaded (or loaded from the daemon) is loadable from the daemon's host tier,
`BlockRemoved` once it stops being so (evicted, deleted, cleared, the daemon gone); the same with
medium "STORAGE" and locality "LOCAL" for the daemon's local disk tiers (protocol 1.10), once
every key of the block on every rank is on one of its rank's disks, until one is not. A KV-aware
router that follows vLLM's event stream (`--kv-events-config`) then knows which prefixes a
replica can load instead of computing, and from where. Inert unless vLLM's
`enable_kv_cache_events` is on.

Blocks are named as vLLM names its own: the request's block hash (vLLM's, at the block size,
with its extra keys), its parent's, its tokens and its LoRA. The scheduler notes each block as
it sends its save (`saving`) or plans its load from a hit (`loading`: the hit was in the host
tier); `take_events` (vLLM asks after every step) follows every rank's daemon through the
key_events op, at most every POLL_S, and reports a block once all of its keys on every rank are
loadable (the shortest rank's hit is what a lookup gives), removed once one is not. A daemon
first seen is followed from its newest event on, before the first save noted goes out; a daemon
that replaced it (another epoch) from its first: what it holds came after. Each block noted is
also asked about once (`ask`, at most ASK keys a poll): one the daemon held before it was
followed (on disk since before a restart, saved by an earlier engine) is reported too, and after
a gap or a new daemon every block followed is asked about again.

Where it cannot know, it leaves a hint out rather than keep one that may be false: a daemon
that restarted or a gap in its events (it keeps the last 65,536) reports every block of that rank
removed (until its answers say where they are); re-keyed blocks (a cache reset, new weights; a
LoRA adapter loaded again, its own) are reported removed at once, as nothing stored under the
old keys is matched again; past MAX_BLOCKS followed, the oldest is reported removed and
forgotten. A 1.9 daemon is asked nothing: a block whose save it skipped (it held the key
already, not through this scheduler) is not announced. A daemon's change reaches vLLM's stream at the first step at least POLL_S after the previous poll (an idle
engine publishes nothing). A request waits REQUEST_S at most: a daemon that is slow, hung or
gone costs a step that long once, and is asked again after QUIET_S with twice the wait, up to
MAX_REQUEST_S (a reply that comes late is dropped; the cursor stays where it was; the link drops
a hung daemon's client after its hang_s). Remote storage tiers (Redis, Mooncake) are not
reported: other replicas write and delete there, and the store evicts unheard. A daemon older
than 1.10 reports its host tier alone. A disk that stops answering (its root gone, its I/O past
its deadline), answers again or is cleared is a storage gap: that rank's STORAGE blocks are
reported removed and asked about again (stored again once it answers); the CPU ones stand.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvcached_proto import ErrorCode
from kvcached_proto.errors import DaemonUnavailable, KvcachedError, KvcachedTimeout

log = logging.getLogger(__name__)

POLL_S = 0.05  # the daemons are asked at most this often (one round trip per rank)
MAX_BLOCKS = 200_000  # blocks followed; past it the oldest is reported removed and forgotten
LIMIT = 16384  # events per request
ASK = 4096  # keys asked about per poll (the rest at the next)
CPU, STORAGE = 0, 1  # the media reported: the host tier, the local storage tiers
REQUEST_S = 0.25  # a request's wait: a slower daemon is asked again later, the step goes on
MAX_REQUEST_S = 2.0  # each request that runs out of time doubles the next one's wait, up to this
QUIET_S = 1.0  # after a request that ran out of time or found no daemon, none for this long


@dataclass(eq=False, slots=True)
class _Block:
    hash: Any  # vLLM's ExternalBlockHash
    parent: Any
    tokens: list
    lora_id: int | None
    lora_name: str | None
    extra_keys: Any
    keys: tuple  # (rank, daemon key) of each of its kernel blocks on each rank
    missing: list  # per medium (CPU, STORAGE): of those keys, how many are not held there
    announced: list = field(default_factory=lambda: [False, False])  # per medium


@dataclass
class _Cursor:
    epoch: int
    last: int


@dataclass
class KVEventsReporter:
    key_scheme: Any
    link: Any  # the scheduler's DaemonLink or GroupLink
    block_size: int
    hash_block_size: int
    enabled: bool = True
    max_blocks: int = MAX_BLOCKS
    poll_s: float = POLL_S
    request_s: float = REQUEST_S
    _blocks: OrderedDict = field(default_factory=OrderedDict)  # vLLM hash -> _Block
    _by_key: dict = field(default_factory=dict)  # (rank, key) -> _Block
    _present: tuple = field(default_factory=lambda: (set(), set()))  # per medium: (rank, key) held
    _disk_bits: dict = field(default_factory=dict)  # (rank, key) -> bits of the disks holding it
    _asks: dict = field(default_factory=dict)  # rank -> {key: None}: to ask which tiers hold it
    _cursors: dict = field(default_factory=dict)  # rank -> _Cursor
    _out: list = field(default_factory=list)
    _next_poll: float = 0.0
    _quiet_until: float = 0.0  # (monotonic) no request before: the last one timed out
    _wait_s: float = 0.0  # the next request's wait (0: request_s)

    @classmethod
    def for_engine(cls, vllm_config, kv_cache_config, key_scheme, link, block_size: int) -> "KVEventsReporter":
        cfg = getattr(vllm_config, "kv_events_config", None)
        hash_bs = getattr(kv_cache_config, "hash_block_size", None) or block_size
        return cls(key_scheme, link, block_size, hash_bs,
                   enabled=bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False)))

    # ------------------------------------------------------------ noting
    def saving(self, request, first: int, keys: list[bytes]) -> None:
        """Blocks first.. of `request`, keyed `keys`, are being saved: announced once loadable."""
        if self.enabled:
            self._note(request, first, keys, present=False)

    def loading(self, request, first: int, keys: list[bytes]) -> None:
        """Blocks first.. of `request` are loaded from the host tier hit found just now."""
        if self.enabled:
            self._note(request, first, keys, present=True)

    def _note(self, request, first: int, keys: list[bytes], present: bool) -> None:
        if self.key_scheme.kernel_factor is None or not keys:
            return
        self._start(self.link.get())
        if not self.enabled:
            return
        hashes = self._hashes(request)
        if len(hashes) < first + len(keys):
            return  # vLLM hashes only full blocks: ours are full too (never reached)
        per_rank = [self.key_scheme.daemon_keys(keys, rank) for rank in range(self.key_scheme.tp_size)]
        r = len(per_rank[0]) // len(keys)
        for i in range(len(keys)):
            block_keys = tuple((rank, k) for rank, ks in enumerate(per_rank) for k in ks[i * r:(i + 1) * r])
            h = _external(hashes[first + i])
            old = self._blocks.get(h)
            if old is not None and old.keys == block_keys:
                self._blocks.move_to_end(h)
            else:
                if old is not None:  # the same block under other keys (re-keyed): the old ones go
                    self._forget(old)
                self._blocks[h] = self._new_block(request, first + i, hashes, h, block_keys)
                for k in block_keys:
                    self._by_key[k] = self._blocks[h]
                    self._asks.setdefault(k[0], {})[k[1]] = None
            if present:
                for k in block_keys:
                    self._seen(k, True, CPU)
        while len(self._blocks) > self.max_blocks:
            self._forget(next(iter(self._blocks.values())))

    def _hashes(self, request):
        from vllm.v1.core.kv_cache_utils import resolve_block_hashes

        return resolve_block_hashes(request.block_hashes, self.hash_block_size, self.block_size)

    def _new_block(self, request, i: int, hashes, h, block_keys: tuple) -> _Block:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

        bs = self.block_size
        extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
        lora = getattr(request, "lora_request", None)
        return _Block(h, _external(hashes[i - 1]) if i else None,
                      list(request.all_token_ids[i * bs:(i + 1) * bs]),
                      lora.adapter_id if lora is not None else None,
                      lora.name if lora is not None else None,
                      to_event_extra_keys([extra]), block_keys,
                      missing=[sum(k not in held for k in block_keys) for held in self._present])

    def _forget(self, block: _Block) -> None:
        if self._blocks.get(block.hash) is block:
            del self._blocks[block.hash]
        for k in block.keys:
            if self._by_key.get(k) is block:
                del self._by_key[k]
                for held in self._present:
                    held.discard(k)
                self._disk_bits.pop(k, None)
                self._asks.get(k[0], {}).pop(k[1], None)
        for m in (CPU, STORAGE):
            if block.announced[m]:
                self._removed(block, m)

    def forget_all(self) -> None:
        """Every block is keyed anew (a cache reset, new weights): none stored before is ever
        matched again."""
        for block in list(self._blocks.values()):
            self._forget(block)

    def forget_lora(self, name: str) -> None:
        """LoRA adapter `name` was loaded again: its blocks are keyed anew."""
        for block in [b for b in self._blocks.values() if b.lora_name == name]:
            self._forget(block)

    # ------------------------------------------------------------ following
    def _seen(self, k: tuple, loadable: bool, m: int) -> None:
        block = self._by_key.get(k)
        held = self._present[m]
        if block is None or (k in held) == loadable:
            return
        if loadable:
            held.add(k)
            block.missing[m] -= 1
            if block.missing[m] == 0 and not block.announced[m]:
                block.announced[m] = True
                self._out.append(self._stored(block, m))
        else:
            held.discard(k)
            block.missing[m] += 1
            if block.announced[m]:
                self._removed(block, m)

    def _on_disk(self, k: tuple, bits: int) -> None:
        """The disks of k's rank that hold k now (bits 1 << n, n >= 1)."""
        if k not in self._by_key:
            return
        if bits:
            self._disk_bits[k] = bits
        else:
            self._disk_bits.pop(k, None)
        self._seen(k, bool(bits), STORAGE)

    def _rank_lost(self, rank: int, disks_only: bool = False) -> None:
        """Rank `rank`'s events were missed (a gap, a new daemon; `disks_only`: its disks' alone,
        a storage gap): none of its keys (on its disks) is known held any more; each followed
        is asked about again."""
        lost = {k for held in self._present[STORAGE if disks_only else CPU:] for k in held if k[0] == rank}
        if lost:
            log.info("[vllm] kv events of rank %d: its daemon's changes%s were missed (a gap, a new "
                     "daemon, a disk cleared or that stopped or started answering); its %d keys held "
                     "are reported removed", rank, " on disk" if disks_only else "", len(lost))
        for k in lost:
            if not disks_only:
                self._seen(k, False, CPU)
            self._on_disk(k, 0)
        asks = self._asks.setdefault(rank, {})
        for r, key in self._by_key:
            if r == rank:
                asks[key] = None

    @staticmethod
    def _ranks(link_client) -> list:
        clients = getattr(link_client, "clients", None)
        return list(enumerate(clients if clients is not None else [link_client]))

    def _start(self, link_client) -> None:
        """Cursors for the ranks whose daemon is not followed yet: a daemon first seen from its
        newest event; one that replaced the daemon followed before (another epoch) from its
        first, the old one's blocks lost. Asking is what makes a daemon keep its changes."""
        if link_client is None or time.monotonic() < self._quiet_until:
            return
        for rank, client in self._ranks(link_client):
            cursor = self._cursors.get(rank)
            if client is None or (cursor is not None and cursor.epoch == client.epoch):
                continue
            try:
                newest = client.key_events(0, 0, timeout=self._wait_s or self.request_s)[3]
            except KvcachedError as exc:
                self._failed(rank, exc)
                return
            if cursor is not None:  # what this one holds came after: all of its events count
                self._rank_lost(rank)
            self._cursors[rank] = _Cursor(client.epoch, 0 if cursor is not None else newest)

    def poll(self, follow: bool = True) -> None:
        """Read every rank's events, at most every poll_s (nothing where `follow` is False: the
        link is closed)."""
        now = time.monotonic()
        if not self.enabled or not follow or now < max(self._next_poll, self._quiet_until):
            return
        self._next_poll = now + self.poll_s
        link_client = self.link.get()
        if link_client is None:
            return
        self._start(link_client)
        if time.monotonic() < self._quiet_until:  # a daemon that did not answer just now
            return
        for rank, client in self._ranks(link_client):
            cursor = self._cursors.get(rank)
            if client is not None and cursor is not None and cursor.epoch == client.epoch:
                if not self._poll_rank(rank, client):
                    return

    def _poll_rank(self, rank: int, client) -> bool:
        """False: the request failed (the rest of the ranks wait for the next poll)."""
        cursor = self._cursors[rank]
        tiers = tuple(getattr(client, "info", {}).get("protocol_version", (0, 0))) >= (1, 10)
        asks = self._asks.setdefault(rank, {})
        if not tiers:  # a 1.9 daemon: its host tier alone, nothing asked
            asks.clear()
        for i in range(8):  # at most 8 * LIMIT events per poll; the rest at the next
            ask = list(itertools.islice(asks, ASK)) if i == 0 else []  # (one batch a poll: a
            # step pays a few ms for it at most, however many blocks a gap left to ask about)
            try:
                if tiers:
                    events, last, gap, _, _, held, storage_gap = client.tier_events(
                        cursor.last, LIMIT, ask=ask, timeout=self._wait_s or self.request_s)
                else:
                    host, last, gap, _ = client.key_events(cursor.last, LIMIT,
                                                           timeout=self._wait_s or self.request_s)
                    events, held, storage_gap = [(key, on, 0) for key, on in host], [], False
            except KvcachedError as exc:
                self._failed(rank, exc)
                return False
            self._wait_s = 0.0
            if gap or storage_gap:  # what it believed of the rank (of its disks) may be stale:
                self._rank_lost(rank, disks_only=not gap)  # every key of it counts as gone
            cursor.last = last
            for key, on, tier in events:
                k = (rank, key)
                if tier == 0:
                    self._seen(k, on, CPU)
                else:
                    bits = self._disk_bits.get(k, 0)
                    self._on_disk(k, bits | 1 << tier if on else bits & ~(1 << tier))
            for key, bits in zip(ask, held):  # where they are after the events above
                asks.pop(key, None)
                self._seen((rank, key), bool(bits & 1), CPU)
                self._on_disk((rank, key), bits & ~1)
            if len(events) < LIMIT:
                return True
        return True

    def _failed(self, rank: int, exc: KvcachedError) -> None:
        if getattr(exc, "code", None) == ErrorCode.UNKNOWN_OP:  # a daemon older than 1.9
            log.warning("[vllm] the daemon of rank %d has no key_events (protocol 1.9): the "
                        "blocks kvcached holds are not reported in vLLM's KV events", rank)
            self.enabled = False
            self.forget_all()  # what another rank's daemon announced is reported removed
        elif isinstance(exc, (DaemonUnavailable, KvcachedTimeout)):  # slow, hung or gone: the
            log.debug("[vllm] kv events of rank %d: %s", rank, str(exc))  # step goes on; asked again
            self._quiet_until = time.monotonic() + QUIET_S  # after QUIET_S (the link sees a gone one)
            if isinstance(exc, KvcachedTimeout):  # a daemon slower than the wait: a longer one
                self._wait_s = min(MAX_REQUEST_S, 2 * (self._wait_s or self.request_s))
        else:  # a refusal that is not the daemon's absence: said, asked again at the next poll
            log.warning("[vllm] kv events of rank %d: %s", rank, str(exc))

    def take(self) -> list:
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ events
    def _stored(self, block: _Block, m: int):
        from vllm.distributed.kv_events import BlockStored

        medium, locality = _medium(m)
        return BlockStored(block_hashes=[block.hash], parent_block_hash=block.parent,
                           token_ids=block.tokens, block_size=self.block_size,
                           lora_id=block.lora_id, medium=medium, lora_name=block.lora_name,
                           extra_keys=block.extra_keys, group_idx=0, locality=locality)

    def _removed(self, block: _Block, m: int) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        block.announced[m] = False
        medium, locality = _medium(m)
        self._out.append(BlockRemoved(block_hashes=[block.hash], medium=medium, group_idx=0,
                                      locality=locality))


def _medium(m: int) -> tuple:
    """(vLLM's medium, locality) of medium m: the host tier, or the local disks."""
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE

    return (MEDIUM_CPU, None) if m == CPU else (MEDIUM_STORAGE, "LOCAL")


def _external(block_hash):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(block_hash)
