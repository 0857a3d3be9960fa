"""GroupClient: one call fanned out to the kvcached daemon of every tensor-parallel rank.

Each rank has its own daemon (and its own KV shard); every rank gets the same device block ids.
Answers are the minimum over ranks, so all ranks load the same prefix and compute on the same
context: `lookup` gives the shortest (host, storage) hit, a load's count is the smallest any
rank loaded. A rank whose daemon is missing makes the group report 0 hits (the request is
recomputed) and is named in `missing`; the group reattaches it in the background once its daemon
is back (no call waits for a missing rank's daemon).

Keys: the caller passes one key list. For ordinary attention every rank holds different heads,
so each rank stores them under rank-derived keys (H(key, rank, tp_size): still chained, still
equal for equal prefixes). With `mla=True` the KV is identical on every rank: keys stay
rank-free, and only the daemon started as storage writer puts them to shared storage
(`kvcached serve --no-storage-writer` on the others), while every rank reads.
"""
from __future__ import annotations

import itertools
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kvcached_proto.codec import check_block_ids
from kvcached_proto.errors import DaemonUnavailable, KvcachedError, ProtocolError
from kvcached_proto.paths import resolve_run_dir

from .client import DEFAULT_TIMEOUT_S, Client
from .key_scheme import KeyScheme
from .renamed import Renamed
from .daemon_link import DaemonLink
from .group_tasks import GroupLoadTask, GroupOffloadTask, GroupPrefetchTask, GroupTask
from .tasks import LoadTask, Task

log = logging.getLogger(__name__)


def _ids(blocks) -> list:
    """A load's block ids as ints; ids that are not (floats, a mask) as they came, for each
    rank's load_batch to refuse that load alone."""
    try:
        return check_block_ids(blocks).tolist()
    except ProtocolError:
        return blocks


def _abandon(result) -> None:
    """What a rank's load or offload started, its caller gone (interrupted, _fan): a load's
    blocks held until it ends, an offload revoked (its blocks will be reused)."""
    for task in result if isinstance(result, list) else [result]:
        if isinstance(task, LoadTask):
            task.client.hold(task.id, task.reply.get("device_blocks", ()))
        elif isinstance(task, Task):
            task.client.revoke(task)


class GroupClient:
    """`GroupClient.connect(instances, run_dir=...)`; the calls of Client across ranks."""

    def __init__(self, instances: Sequence[str], run_dir: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, name: str = "", mla: bool = False,
                 local_rank: int = 0, endpoints: Sequence[str] | None = None,
                 hang_s: float | None = None):
        if not instances:
            raise ValueError("a group needs at least one rank")
        if endpoints is not None and len(endpoints) != len(instances):
            raise ValueError("one endpoint per instance")
        self.instances = list(instances)
        self.tp_size = len(self.instances)
        self.run_dir = resolve_run_dir(run_dir)
        self.timeout = timeout
        self.name = name
        self.mla = mla
        self.key_scheme = KeyScheme(tp_size=self.tp_size, mla=mla)  # kernel keys in, rank keys out
        self.hang_s = hang_s
        self.local_rank = local_rank
        self._endpoints = list(endpoints) if endpoints else [None] * self.tp_size
        self.missing: dict[int, str] = {r: "not connected yet" for r in range(self.tp_size)}
        self._retired: list[Client] = []  # lost clients whose holds still hold
        self._kv = None
        # one link per rank: a rank that dies between two calls is attached again before the next
        self.links = [DaemonLink(name=f"{name or 'group'}-tp{r}", connect=lambda r=r: self._connect_rank(r),
                                 on_connect=lambda c, r=r: self._prepare(r, c), retire=self._retire,
                                 on_drop=lambda c, exc, r=r: self._dropped(r, exc))
                      for r in range(self.tp_size)]
        for link in self.links:
            link.watch()
        self._task_ids = itertools.count(1)
        # tasks by id, for hold(task_id); weak, so a task its caller dropped unwaited goes
        self._live: weakref.WeakValueDictionary[int, GroupTask] = weakref.WeakValueDictionary()
        self._pool = ThreadPoolExecutor(self.tp_size, thread_name_prefix="kvcached-group")

    @classmethod
    def connect(cls, instances: Sequence[str], **kwargs) -> "GroupClient":
        group = cls(instances, **kwargs)
        group.reconnect()
        return group

    def reconnect_args(self) -> dict:
        return {"instances": self.instances, "run_dir": self.run_dir, "timeout": self.timeout,
                "name": self.name, "mla": self.mla, "local_rank": self.local_rank,
                "endpoints": self._endpoints, "hang_s": self.hang_s}

    # ranks ------------------------------------------------------------------
    @property
    def clients(self) -> list[Client | None]:
        """Each rank's client in use (None where the rank is missing)."""
        return [link.client for link in self.links]

    def reconnect(self) -> list[int]:
        """Connect every missing rank whose daemon is there, now, on this thread; returns the
        ranks connected. (Calls reattach missing ranks in the background by themselves.)"""
        ranks = list(self.missing)
        list(self._pool.map(lambda r: self.links[r].attach_now(), ranks))
        for r in ranks:
            self._present(r)
        return [r for r in ranks if self.links[r].client is not None]

    def _connect_rank(self, rank: int) -> Client:
        return Client.connect(self.instances[rank], self.run_dir, self.timeout,
                              f"{self.name}-tp{rank}", self._endpoints[rank], hang_s=self.hang_s)

    def _prepare(self, rank: int, client: Client) -> None:
        kv = self._kv
        if kv is not None:
            client.register_kv_cache(kv[rank])

    def _present(self, rank: int) -> None:
        """Settle `missing` for a rank after its link was asked: a client in use is present once
        it holds this rank's KV (prepared before register_kv_cache was called: registered now)."""
        link, kv = self.links[rank], self._kv
        client = link.client
        if client is not None and kv is not None and client._kv_tensors is not kv[rank]:
            try:
                client.register_kv_cache(kv[rank])
            except KvcachedError as exc:
                link.drop(exc)
                return
        if client is not None:
            self.missing.pop(rank, None)
        else:
            self.missing.setdefault(rank, "not connected")
            if link.last_error:
                self.missing[rank] = link.last_error

    def _retire(self, client: Client) -> None:
        """A dropped client stays a source of holds: a wait that saw its rank go holds the
        rank's blocks on it right after (held_blocks closes it once it holds nothing)."""
        self._retired.append(client)

    def _dropped(self, rank: int, exc: Exception) -> None:
        """The rank's client is dropped (its daemon gone or hung): its work in flight is made
        safe now, before the client retires - a hung daemon may still write a load's blocks
        (held until its end comes or the daemon dies) or read an offload's after the engine
        reused them (revoked: the daemon stores nothing of it)."""
        log.warning("[group] rank %d (%s) is missing: %s", rank, self.instances[rank], str(exc))
        self.missing[rank] = str(exc)
        client = self.links[rank].client
        for task in list(self._live.values()):
            t = task.tasks.get(rank)
            if t is None or t.client is not client or t.result is not None:
                continue
            if isinstance(task, GroupLoadTask):
                client.hold(t.id, t.reply.get("device_blocks", ()))
            elif isinstance(task, GroupOffloadTask):
                client.revoke(t)

    def _lost(self, rank: int, exc: Exception) -> None:
        self.links[rank].drop(exc)

    def _hold_rank(self, rank: int, task, blocks) -> None:
        for client in [self.links[rank].client] + self._retired:
            if client is not None and task.client is client:
                client.hold(task.id, blocks)

    def _ready(self) -> bool:
        """All ranks present; a successor the background has attached is taken (replacing a
        rank whose daemon is gone), never waited for. Lost clients that hold nothing any more
        are closed first: a rank's successor cannot register while its old one is open."""
        if self._retired:
            self.held_blocks()
        for rank, link in enumerate(self.links):
            link.refresh()
            self._present(rank)
        return not self.missing

    def _fan(self, call, abandon=None) -> dict[int, object]:
        """call(rank, client) on every present rank in parallel; results by rank. A rank that
        turns out gone is marked missing and left out; other errors are raised. Interrupted
        while waiting (KeyboardInterrupt, a signal handler's exception), it lets the ranks'
        calls end first (each bounded by its client's timeout, and one whose reply does not
        come holds or revokes itself) and `abandon` settles what they started - a load's
        blocks held, an offload revoked - before the interrupt goes on up: no caller will."""
        ranks = [r for r, c in enumerate(self.clients) if c is not None]
        futures = {r: self._pool.submit(call, r, self.clients[r]) for r in ranks}
        out, error = {}, None
        try:
            for r, fut in futures.items():
                try:
                    out[r] = fut.result()
                except DaemonUnavailable as exc:
                    self._lost(r, exc)
                except Exception as exc:  # surfaced below, after every rank's call has ended
                    error = error or exc
        except BaseException:
            for fut in futures.values() if abandon is not None else ():
                if fut.exception() is None:  # (waits for the call to end)
                    try:
                        abandon(fut.result())
                    except Exception:  # noqa: BLE001 - the interrupt goes up, not this
                        log.exception("[group] settling a rank's call after an interrupt failed")
            raise
        if error is not None:
            raise error
        return out

    def _keys(self, keys, rank: int):
        return self.key_scheme.rank_keys(keys, rank)

    def _forget(self, task: GroupTask) -> None:
        self._live.pop(task.id, None)

    # the Client calls ---------------------------------------------------------
    def register_kv_cache(self, per_rank_tensors: Sequence, timeout: float | None = None) -> dict:
        """Register each rank's KV shard with its daemon (one entry per rank); re-registered on
        reconnect."""
        if len(per_rank_tensors) != self.tp_size:
            raise ValueError(f"{len(per_rank_tensors)} KV shards for {self.tp_size} ranks")
        self._kv = list(per_rank_tensors)
        return self._fan(lambda r, c: c.register_kv_cache(self._kv[r], timeout))

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> tuple[int, int]:
        if not self._ready():
            return 0, 0
        hits = self._fan(lambda r, c: c.lookup(self._keys(keys, r), timeout))
        if self.missing or not hits:
            return 0, 0
        host = min(h for h, _ in hits.values())
        total = min(h + s for h, s in hits.values())
        return host, total - host

    def load(self, keys: Sequence[bytes], device_blocks, priority: int = 0,
             timeout: float | None = None, host_only: bool = False) -> GroupLoadTask:
        """A rank whose load raised (e.g. BUSY) fails the whole load, raised once the other
        ranks' loads, which still write the blocks, are held (a rank whose reply never came
        holds its own); a missing rank makes a load of 0 blocks."""
        blocks = check_block_ids(device_blocks).tolist()  # (1.5 is refused, not block 1)
        failed: list[KvcachedError] = []

        def one(rank: int, client: Client):
            try:
                return client.load(self._keys(keys, rank), blocks, priority, timeout, host_only=host_only)
            except DaemonUnavailable:
                raise  # the rank is lost (_fan)
            except KvcachedError as exc:
                failed.append(exc)

        tasks = {r: t for r, t in self._fan(one, _abandon).items() if t is not None} if self._ready() else {}
        return self._group_load(blocks, tasks, failed)

    def load_batch(self, loads: Sequence[tuple[Sequence[bytes], Sequence[int]]], priority: int = 0,
                   timeout: float | None = None, host_only: bool = False
                   ) -> list[GroupLoadTask | KvcachedError]:
        """Client.load_batch on every rank (the ranks in parallel, one round trip each): each
        load, in order, as load() makes it, or the KvcachedError a rank gave it (that load's
        blocks held on the other ranks, as load() holds them)."""
        loads = [(list(keys), _ids(blocks)) for keys, blocks in loads]
        per_rank = self._fan(lambda r, c: c.load_batch(
            [(self._keys(keys, r), blocks) for keys, blocks in loads], priority, timeout,
            host_only=host_only), _abandon) if self._ready() else {}
        out: list[GroupLoadTask | KvcachedError] = []
        for i, (_, blocks) in enumerate(loads):
            tasks, failed = {}, []
            for rank, results in per_rank.items():
                got = results[i]
                if isinstance(got, DaemonUnavailable):
                    self._lost(rank, got)  # its other loads, already sent, hold their blocks
                elif isinstance(got, KvcachedError):
                    failed.append(got)
                else:
                    tasks[rank] = got
            try:
                out.append(self._group_load(blocks, tasks, failed))
            except KvcachedError as exc:
                out.append(exc)
        return out

    def _group_load(self, blocks: list[int], tasks: dict, failed: list) -> GroupLoadTask:
        """One load from its ranks' tasks: the blocks every rank loads (none where a rank is
        missing or one failed; what a rank writes past them stays held). Raises the first
        rank's error where one failed."""
        planned = min((t.num_blocks for t in tasks.values()), default=0)
        planned = 0 if self.missing or failed else planned
        for rank, task in tasks.items():
            if task.num_blocks > planned and task.result is None:  # it writes past the common prefix
                task.client.hold(task.id, blocks[planned:task.num_blocks])
        if failed:
            raise failed[0]
        reply = {"blocks": planned, "device_blocks": blocks[:planned],
                 "host_blocks": min((t.reply.get("host_blocks", 0) for t in tasks.values()), default=0)}
        num_layers = max((t.num_layers for t in tasks.values()), default=0)
        task = GroupLoadTask(self, tasks, reply, num_layers)
        self._live[task.id] = task
        return task

    def offload(self, device_blocks, keys: Sequence[bytes], priority: int = 0,
                timeout: float | None = None, parent: bytes | None = None) -> GroupOffloadTask:
        """A rank that refused it (e.g. BUSY) fails the whole offload, raised once the other
        ranks' offloads are revoked: the caller takes the blocks back, and those ranks would
        read them after (they store nothing of it now). A missing rank stores nothing.
        `parent`: as Client.offload's (each rank is told its own key of it)."""
        blocks = check_block_ids(device_blocks).tolist()
        failed: list[KvcachedError] = []

        def one(rank: int, client: Client):
            try:
                return client.offload(blocks, self._keys(keys, rank), priority, timeout,
                                      parent=None if parent is None else self._keys([parent], rank)[0])
            except DaemonUnavailable:
                raise  # the rank is lost (_fan); its own offload revoked itself
            except KvcachedError as exc:
                failed.append(exc)

        self._ready()
        tasks = {r: t for r, t in self._fan(one, _abandon).items() if t is not None}
        if failed:
            for task in tasks.values():
                task.client.revoke(task)
            raise failed[0]
        reply = {"accepted": min((t.reply.get("accepted", len(blocks)) for t in tasks.values()),
                                 default=0)}
        task = GroupOffloadTask(self, tasks, reply)
        self._live[task.id] = task
        return task

    def prefetch(self, keys: Sequence[bytes], **kwargs) -> GroupPrefetchTask:
        """Client.prefetch on every rank; `.wait()["prefetched"]` is the minimum over ranks."""
        tasks = self._fan(lambda r, c: c.prefetch(self._keys(keys, r), **kwargs)) if self._ready() else {}
        task = GroupPrefetchTask(self, tasks, {})
        self._live[task.id] = task
        if tasks and all(t.result is not None for t in tasks.values()):
            task.done()  # every rank skipped it: ended now, as Client.prefetch's skip is
        return task

    def delete(self, keys: Sequence[bytes], timeout: float | None = None) -> int:
        got = self._fan(lambda r, c: c.delete(self._keys(keys, r), timeout))
        return min(got.values(), default=0)

    def clear(self, tier: str = "all", weights_update: bool = False, timeout: float | None = None) -> int:
        """Every rank's daemon cleared, or KvcachedError naming the ranks whose daemon was not
        there (their tiers keep the old blocks: a weight update must salt its keys anew)."""
        done = self._fan(lambda r, c: c.clear(tier, weights_update, timeout))
        missed = [r for r in range(len(self.clients)) if r not in done]
        if missed:
            raise KvcachedError(f"clear: the daemons of ranks {missed} are not attached; their "
                                f"tiers were not cleared ({sum(done.values())} blocks cleared on the others)")
        return sum(done.values())

    def flush(self, timeout: float | None = None) -> GroupTask:
        task = GroupTask(self, self._fan(lambda r, c: c.flush(timeout)), {})
        self._live[task.id] = task
        return task

    def status(self, timeout: float | None = None) -> list[dict]:
        got = self._fan(lambda r, c: c.status(timeout))
        return [got.get(r, {"rank": r, "instance": self.instances[r], "missing": self.missing.get(r)})
                for r in range(self.tp_size)]

    def ping(self, timeout: float | None = None) -> float:
        return max(self._fan(lambda r, c: c.ping(timeout)).values(), default=0.0)

    # holds and events (what PrefixCacheManager uses) -----------------------------
    def _all_clients(self) -> list[Client]:
        return [c for c in self.clients if c is not None] + self._retired

    def hold(self, task_id: int, blocks) -> None:
        task = self._live.get(task_id)
        if task is None:
            return
        for rank, t in task.tasks.items():
            t.client.hold(t.id, blocks)

    def held_blocks(self) -> set[int]:
        """Every rank's held blocks (see Client.held_blocks); lost clients whose holds lifted
        are closed here."""
        out: set[int] = set()
        for client in self._all_clients():
            out |= client.held_blocks()
        for client in [c for c in self._retired if not c.has_holds]:
            self._retired.remove(client)
            client.close()
        return out

    @property
    def retiring(self) -> bool:
        """Lost ranks' clients are still open (closed by held_blocks once they hold nothing)."""
        return bool(self._retired)

    @property
    def has_holds(self) -> bool:
        return any(c.has_holds for c in self._all_clients())

    @property
    def held_without_check(self) -> set[int]:
        return set().union(*(c.held_without_check for c in self._all_clients()))

    # earlier names ("fence" names the order words only)
    fence, fenced_blocks = Renamed("hold"), Renamed("held_blocks")
    has_fences, fenced_without_check = Renamed("has_holds"), Renamed("held_without_check")

    def poll_events(self) -> None:
        for rank, client in enumerate(self.clients):
            if client is not None:
                try:
                    client.poll_events()
                except DaemonUnavailable as exc:
                    self._lost(rank, exc)

    @property
    def epoch(self) -> tuple:
        return tuple(c.epoch if c else 0 for c in self.clients)

    def close(self) -> None:
        for link in self.links:
            link.close()  # the client in use retires: closed, or kept while it holds blocks
        for client in self._retired:
            client.close()
        self._retired.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "GroupClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GroupLink:
    """The scheduler's view of every rank's daemon: a GroupClient, which reattaches missing
    ranks in the background and answers 0 hits while one is missing."""

    def __init__(self, instances: list[str], run_dir: str | None, timeout: float, name: str,
                 mla: bool, hang_s: float | None = None):
        self.client = GroupClient(instances, run_dir=run_dir, timeout=timeout, name=name, mla=mla,
                                  hang_s=hang_s)

    def attach_now(self) -> GroupClient:
        self.client.reconnect()
        return self.client

    def get(self) -> GroupClient:
        return self.client

    def failed(self, exc: Exception) -> None:
        log.warning("[vllm] kvcached group call failed, going on without it: %s", str(exc))

    def close(self) -> None:
        self.client.close()
