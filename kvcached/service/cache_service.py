"""The cache service: the ops on top of KV registration, the host tier (index, pool), the task
table and the flows (load_flow.py, offload_flow.py, storage_flow.py), which own the copy
workers. Registration, cancel, clear and pause drain the workers here.

Called from the server thread (ops) and from the transfer workers (completions); one lock (the
host tier's) guards the index, the allocator and the task table, and is never held during a
copy.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import torch

from kvcached_proto import OP_SPECS, ErrorCode, Op
from kvcached_proto.replies import (CancelReply, ClearReply, DeleteReply, Empty, FlushReply,
                                    KeyEventsReply, LoadReply, LookupReply, OffloadReply,
                                    PrefetchReply, RegisterKvReply)
from kvcached_proto.shm_layout import NUM_SLOTS, Flag, State

from ..config import DaemonConfig
from ..copy.cuda_copier import make_copier
from ..copy.kv_mapping import KVRegistration
from ..copy.transfer import CopyTask, TaskKind, TransferWorker
from ..errors import OpError
from ..host.index import READY
from .host_tier import HostTier
from .key_events import KeyEvents
from .key_publisher import KeyPublisher
from .lookup_notes import take_notes
from .load_flow import LoadFlow
from .offload_flow import OffloadFlow
from .registration import Registered, checked_layout, claim_fds, index_memory_said
from .report import InvariantWalk, status_of
from .task_table import TaskTable

log = logging.getLogger(__name__)

MAX_ASK = 4096  # keys a key_events request may ask about (a frame's cost stays a few ms)

DRAIN_TIMEOUT_S = 30.0


class CacheService:
    """The op handlers over the host tier (index, pool, lock), the task table and the flows."""

    def __init__(self, cfg: DaemonConfig, status_block, events):
        self.cfg = cfg
        self.status_block = status_block
        self.events = events
        torch.set_num_threads(cfg.copy_threads)
        self.host = HostTier(cfg)
        status_block.set_flag(Flag.HOST_POOL_READY)
        self.reg = Registered()  # the engine's KV mapping and its copier
        self.fd_inbox = None  # the server's FdInbox: fds an engine handed over (fd_pass.py)
        self.table = TaskTable(self.host.lock, status_block, events)  # ids, slots, counters, the end
        self.check = InvariantWalk(self)  # "ok" or what is wrong (report.py); BUSY when run too often
        self.hits = {"lookups": 0, "keys": 0, "host_hits": 0, "storage_hits": 0,
                     "loaded_from_host": 0, "loaded_from_storage": 0,
                     "table_lookups": 0, "unnoted_lookups": 0}  # clients' lookups from the key table
        self.loads = LoadFlow(cfg, self.host, self.table, status_block, self.reg, self.hits)
        self.storage = self.loads.storage  # fetches for loads and prefetches, backups, flush
        self.offloads = OffloadFlow(self.host, self.table, self.reg, self.loads)
        self.host.on_evicted = self.storage.on_evicted  # write_back saves what is evicted
        self.storage.tiers.register_memory(self.host.pool.buffer.data_ptr(), self.host.pool.capacity_bytes)
        self.keys = KeyPublisher(cfg.instance, status_block.epoch, self.storage.tiers)
        self.key_events = KeyEvents()  # and follow its changes (key_events: from the first one)
        self.host.publish_to(self.keys.host)  # clients read the index from shared memory
        # runs work that may block (a drain) off the request thread; the server sets its
        # control worker's run_later here
        self.defer: Callable[[Callable[[], None]], None] = lambda work: work()
        self._paused = False  # by the pause op, until resume: no drain lets the workers go
        # a load's or an offload's copies start once its reply is sent (replied)
        self._after_reply: list[tuple[CopyTask, Callable[[], None]]] = []
        self.loads.after_reply = self.offloads.after_reply = self._start_after_reply
        self._handlers = {
            Op.REGISTER_KV: self._register_kv,
            Op.UNREGISTER_KV: self._unregister_kv,
            Op.OFFLOAD: self._offload,
            Op.LOOKUP: self._lookup,
            Op.LOOKUP_NOTES: self._lookup_notes,
            Op.KEY_EVENTS: self._key_events,
            Op.LOAD: self._load,
            Op.PREFETCH: self._prefetch,
            Op.FLUSH: self._flush,
            Op.CANCEL: self._cancel,
            Op.DELETE: self._delete,
            Op.CLEAR: self._clear,
            Op.PAUSE: self._pause,
            Op.RESUME: self._resume,
        }

    # dispatch -------------------------------------------------------------
    def handle(self, client, req) -> dict:
        """An op from a client the server has checked (hello; for the ops that need the KV
        cache, that it is registered and this client's)."""
        if OP_SPECS[req.op].needs_kv and self.reg.of(client.client_id).lost:
            raise OpError(ErrorCode.KV_MISMATCH, self.reg.of(client.client_id).lost)
        return self._handlers[req.op](client, req)

    def _start_after_reply(self, task: CopyTask, start: Callable[[], None]) -> None:
        """`task` starts once the request's reply is sent: the request thread (the daemon's
        main thread) sends it, then calls replied(); any other thread starts it now (nothing
        would run it there)."""
        if threading.current_thread() is threading.main_thread():
            self._after_reply.append((task, start))
        else:
            start()

    def replied(self) -> None:
        """(The request thread, once it sent a reply, or failed to.) Start the tasks the
        request made. Started before the reply, a load's copy worker could take the GIL from
        the thread sending it, and the engine waits for that reply before it can wait on the
        load's first layer (on CPU the difference was within the noise: CHANGELOG). A start
        that fails (a bug) fails its task, which ends with an event: its client, told the task
        began, is not left waiting for it."""
        while self._after_reply:
            task, start = self._after_reply.pop(0)
            try:
                start()
            except Exception as exc:  # noqa: BLE001 - reported: the task fails with it
                log.exception("[dispatch] task %d did not start", task.task_id)
                self.loads.failed([task], exc)

    def heal_key_table(self) -> None:
        """(The request thread, about once a second.) A key table whose name went from /dev/shm
        is made anew with what it held (key_publisher.heal)."""
        with self.host.lock:
            self.keys.heal(self.host.index.loadable_keys, self.host.pool.num_blocks)

    def capabilities(self) -> list[str]:
        return ["layerwise_load", "host_tier", f"host_layout:{self.cfg.host_layout}",
                *(["cuda_ipc"] if self.cfg.device.startswith("cuda") else ["cpu_shm", "fd_pool"]),
                *(["key_table"] if self.keys.enabled else [])]

    @property
    def kv(self) -> KVRegistration | None:
        return self.reg.kv

    def kv_for(self, client_id: str) -> KVRegistration | None:
        """The client's own registration, else the first one (whose owner a refusal names)."""
        return self.reg.of(client_id) or self.reg.kv

    # registration ---------------------------------------------------------
    def _register_kv(self, client, req) -> RegisterKvReply:
        spec = checked_layout(req.body["layout"], client.client_id, self.reg, self.cfg.device,
                              self.host.pool.capacity_bytes)
        fds = claim_fds(spec, self.fd_inbox)
        try:  # maps or raises, changing nothing; the fds go either way (the mappings stay)
            reg = KVRegistration(spec, client.client_id, self.cfg.device, fds)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            copier, kept = self._install(spec, reg)
        except BaseException:
            reg.close()  # refused (BUSY, the pool's pinning, a CUDA error): unmapped
            if self.reg.kv is None:
                self.status_block.set_flag(Flag.KV_REGISTERED, False)
            raise
        self.status_block.set_flag(Flag.KV_REGISTERED)
        log.info("[kv] %s registered %d layers x %d parts, %d device blocks; %d host blocks kept (copy "
                 "strategy %s; %d engine(s) registered)", client.client_id, spec.num_layers,
                 len(spec.parts), spec.num_blocks, kept, copier.strategy, len(self.reg.all_kv()))
        return RegisterKvReply(host_blocks=self.host.pool.num_blocks, kept_blocks=kept,
                               page_bytes=spec.page_bytes, num_slots=NUM_SLOTS,
                               copy_strategy=copier.strategy, **copier.registration_reply())

    def _install(self, spec, reg) -> tuple:
        """`reg` and its copier made the registration: (copier, host blocks kept). A drain timeout
        or a pool that cannot take the layout leaves the old one; a copier error leaves none."""
        known = self.host.pool.spec  # a new geometry voids the host blocks: queued work on them goes
        self._drain("register_kv", cancel_queued=known is not None and known.geometry() != spec.geometry())
        try:
            with self.host.lock:
                try:
                    new_geometry = self.host.pool.configure(spec)
                except RuntimeError as exc:  # pinning the new layout; the pool is as it was
                    raise OpError(ErrorCode.KV_MISMATCH, f"host pool: {exc}") from None
                if new_geometry:  # old blocks are void
                    self.host.reset_index()
                    self.storage.drop_queued_backups()
                    self.keys.rebuild(self.host.pool.num_blocks, self.host.pool.geometry,
                                      self.host.pool.page_bytes)
                    if self.storage.tiers:
                        index_memory_said(self.storage.tiers, self.host.pool.page_bytes)
                    # after the key table's new geometry: a disk event told before it would
                    # name an old block by the key it has under the new one
                    self.key_events.voided()
                kept = len(self.host.index)
                try:
                    copier = make_copier(spec.device, self.cfg.copy_strategy, reg.views,
                                         self.host.pool, spec.num_layers, reg.order, self.cfg.dma_threads)
                finally:  # the client's old registration goes either way (a CUDA error leaves
                    # none), and those of engines that are gone (one engine per instance)
                    retired = [kv.owner for kv in self.reg.all_kv() if kv.retired or new_geometry]
                    for owner in {reg.owner, *retired}:
                        for gone in reversed(self.reg.pop(owner)):
                            if gone is not None:
                                gone.close()
                self.reg.put(reg.owner, reg, copier)
        finally:
            self._undrain()
        return copier, kept

    def _unregister_kv(self, client, req) -> Empty:
        """The client's own registration; an operator's (or a lone engine's): the first one."""
        kv = self.reg.of(client.client_id) or self.reg.kv
        if kv is None:
            raise OpError(ErrorCode.NOT_REGISTERED, "no KV is registered")
        self._drop_kv("unregister_kv", kv.owner)
        return Empty()

    def _drop_kv(self, why: str, owner: str) -> None:
        """Unmap an engine's KV once the copies in flight have drained."""
        self._drain(why)
        try:
            with self.host.lock:
                old, copier = self.reg.pop(owner)
            if copier is not None:
                copier.close()
            if old is not None:
                old.close()
        finally:
            self._undrain()
        if self.reg.kv is None:
            self.status_block.set_flag(Flag.KV_REGISTERED, False)

    # data ops -------------------------------------------------------------
    def _checked(self, client, req) -> tuple:
        """(the request's device blocks, its fence) once the ids and the queue allow it."""
        blocks, kv = req.body["blocks"], self.reg.of(client.client_id)
        if len(blocks) and int(blocks.max()) >= kv.spec.num_blocks:
            raise OpError(ErrorCode.BAD_FIELD,
                          f"blocks: id {int(blocks.max())} >= {kv.spec.num_blocks} device blocks")
        self._check_queue(client)
        return blocks, self._fence(kv, req)

    def _check_queue(self, client) -> None:
        """BUSY past --max-queued-tasks waiting tasks: those queued on a worker, those parked
        on another task's write (prefetches of keys on their way take no load slot) and the
        flushes not ended (each waits behind backups a hung tier may hold for long). Clients
        with no KV registered (a router prefetching, a proxy flushing) may hold half of them
        together - however many connections they open: the rest stays for the engines' loads
        and offloads."""
        queued = sum(w.queued for w in (self.loads.worker, self.offloads.worker, self.storage.fetcher))
        queued += len(self.loads.parked)
        with self.host.lock:
            queued += self.table.live(TaskKind.FLUSH)
            engines = {kv.owner for kv in self.reg.all_kv()}
            others = len(self.table.tasks) - sum(self.table.of_client[e] for e in engines)
        if client.client_id not in engines and others >= max(1, self.cfg.max_queued_tasks // 2):
            raise OpError(ErrorCode.BUSY, f"clients with no KV registered hold {others} tasks in the "
                          "daemon, the half of --max-queued-tasks they may hold together; retry later")
        if queued >= self.cfg.max_queued_tasks:
            raise OpError(ErrorCode.BUSY, f"{self.cfg.max_queued_tasks} tasks queued "
                          "(--max-queued-tasks); retry later")

    def _fence(self, kv, req) -> tuple[int, int] | None:
        """The engine's order word and value its work on the blocks must reach first (the
        writes of an offload's blocks, the last reads of a load's)."""
        word, fence = req.body.get("fence_word", 0), req.body.get("fence", 0)
        if kv.order is None:
            if fence:
                raise OpError(ErrorCode.BAD_FIELD, "fence: this registration has no order_segment")
            return None
        return kv.order.check_fence(word, fence)

    def _lookup(self, client, req) -> LookupReply:
        keys = req.body["keys"]
        seen, past = self.storage.past_host(keys)
        with self.host.lock:
            self.host.index.note_request(keys)  # the eviction policy's history (lookups only: a load
            entries = self.host.index.prefix(keys)  # follows the lookup of the same request)
            hit = len(entries)
            self.storage.after_hits(entries)
            stored = past if hit == seen else 0  # the host prefix moved meanwhile: no guess
            self.hits["lookups"] += 1
            self.hits["keys"] += len(keys)
            self.hits["host_hits"] += hit
            self.hits["storage_hits"] += stored
        return LookupReply(host=hit, storage=stored)

    def _visible(self, key: bytes, loadable: bool) -> None:
        """(Host lock held.) The index's news of what it can load: the key table, the events."""
        self.keys.host(key, loadable)
        self.key_events.host(key, loadable)

    def _key_events(self, client, req) -> KeyEventsReply:
        body = req.body
        if len(body.get("ask", ())) > MAX_ASK:  # (each key asked costs about 1 us here)
            raise OpError(ErrorCode.TOO_MANY_ITEMS, f"ask: {len(body['ask'])} keys > {MAX_ASK}")
        with self.host.lock:
            if not self.key_events.followed:  # changes are kept from the first request on: a
                self.key_events.followed = True  # daemon nobody follows pays nothing per key
                self.host.publish_to(self._visible)
                self.keys.listen(self.key_events.storage, lambda _n: self.key_events.voided(storage=True))
            keys, visible, tiers, last, gap, storage_gap = self.key_events.since(
                body["after"], body["limit"], body.get("storage", False))
            newest = self.key_events.last
            # what holds the asked keys, read after the events taken: a change from then on is
            # numbered past `last`, so the client that follows on converges on the truth
            asked = body.get("ask", ())
            index = self.host.index
            in_host = [(e := index.get(k)) is not None and e.state == READY and not e.doomed for k in asked]
        held = bytes(bits | on for bits, on in zip(self.keys.local_holds(asked), in_host))
        return KeyEventsReply(keys=b"".join(keys), visible=visible, last=last, gap=gap, newest=newest,
                              tiers=tiers, storage_tiers=self.keys.local_tiers, held=held,
                              storage_gap=storage_gap)

    def _lookup_notes(self, client, req) -> Empty:
        """What the client's local lookups saw (lookup_notes.py), as `_lookup` hears it."""
        take_notes(self.host, self.storage, self.hits, req.body)
        return Empty()

    def _prefetch(self, client, req) -> PrefetchReply:
        self._check_queue(client)
        return self.storage.prefetch(client, req)

    def _flush(self, client, req) -> FlushReply:
        self._check_queue(client)
        return self.storage.flush(client, req)

    def _offload(self, client, req) -> OffloadReply:
        return self.offloads.start(client, req, *self._checked(client, req))

    def _load(self, client, req) -> LoadReply:
        return self.loads.start(client, req, *self._checked(client, req))

    def _cancel(self, client, req) -> CancelReply:
        task_id = req.body["task"]
        with self.host.lock:
            task = self.table.tasks.get(task_id)
            if task is None or task.client_id != client.client_id:
                raise OpError(ErrorCode.UNKNOWN_TASK, f"task {task_id} is not a live task of this client")
            task.cancelled = True
        workers = {TaskKind.LOAD: (self.storage.fetcher, self.loads.worker),
                   TaskKind.OFFLOAD: (self.offloads.worker,),
                   TaskKind.PREFETCH: (self.storage.fetcher,)}.get(task.kind, ())
        if (any(w.remove_queued(lambda t: t is task) for w in workers)
                or self.loads.take_parked(lambda t: t is task)):
            self._finish_cancelled([task])
            return CancelReply(state="cancelled")
        return CancelReply(state="finishing")  # in flight: it stops at the next layer or chunk

    def _delete(self, client, req) -> DeleteReply:
        deleted, stored, missed = self.storage.delete(list(req.body["keys"]))
        return DeleteReply(deleted=deleted, storage_deleted=stored, storage_missed=missed)

    def _clear(self, client, req) -> ClearReply:
        weights = req.body["weights_update"]
        prior = self.status_block.state
        if weights:
            self.status_block.set_state(State.CLEARING)
        tier = "all" if weights else req.body["tier"]  # old weights' KV is in every tier
        self._drain("clear", cancel_queued=True)
        try:
            freed, stored = [], 0
            storage = tier in ("storage", "all") and bool(self.storage.tiers)
            with self.host.lock:
                if storage or weights:  # a backup not begun would put back what goes now
                    self.storage.drop_queued_backups(unpin=True)
                if tier in ("host", "all"):
                    freed = self.host.index.clear()
                    self.host.free(freed)
                elif storage:  # the host blocks stay, no longer stored
                    self.host.index.forget_stored()
            if storage:
                stored = self.storage.tiers.clear()
        finally:
            self._undrain()
        # a paused daemon stays paused (and says so) until resume
        self.status_block.set_state(State.PAUSED if self._paused else State.CLEARED if weights else prior)
        log.info("[clear] %d host blocks and %d stored blocks dropped (tier %s, weights_update=%s)",
                 len(freed), stored, tier, weights)
        return ClearReply(cleared=len(freed) + stored, host_cleared=len(freed), storage_cleared=stored)

    def _pause(self, client, req) -> Empty:
        self._drain("pause", undrain_on_timeout=True)
        self._paused = True
        self.status_block.set_state(State.PAUSED)
        return Empty()

    def _resume(self, client, req) -> Empty:
        self._paused = False
        self._undrain()
        self.status_block.set_state(State.NORMAL)
        return Empty()

    @property
    def _workers(self) -> tuple[TransferWorker, ...]:
        return (self.storage.fetcher, self.loads.worker, self.offloads.worker, self.storage.backer)

    def _drain(self, why: str, cancel_queued: bool = False, undrain_on_timeout: bool = True) -> None:
        ok = all(w.pause(DRAIN_TIMEOUT_S) for w in self._workers)
        if not ok:
            if undrain_on_timeout:
                self._undrain()
            raise OpError(ErrorCode.BUSY, f"{why}: in-flight copies did not drain in {DRAIN_TIMEOUT_S} s")
        if cancel_queued:
            for worker in (self.storage.fetcher, self.loads.worker, self.offloads.worker):
                self._finish_cancelled(worker.remove_queued(lambda t: True))
            self._finish_cancelled(self.loads.take_parked(lambda t: True))

    def _undrain(self) -> None:
        """The workers go on after a drain - unless the daemon is paused: a clear, a
        registration or an engine leaving meanwhile leaves them paused until resume."""
        if self._paused:
            return
        for w in self._workers:
            w.resume()

    def _finish_cancelled(self, tasks: list[CopyTask]) -> None:
        """Tasks taken from a queue before they ran end cancelled."""
        for task in tasks:
            task.cancelled = True
            if task.kind == TaskKind.OFFLOAD:
                self.offloads.complete(task)
        self.loads.end_cancelled([t for t in tasks if t.kind != TaskKind.OFFLOAD])

    # clients and lifecycle -------------------------------------------------
    def drop_client(self, client, dead: bool = False) -> None:
        """A client left or died: cancel its queued tasks; in-flight ones end at the next layer.
        With dead (it died, or said bye) the KV mapping it registered is dropped too (the host
        tier's content stays for the engine that restarts)."""
        mine = lambda t: t.client_id == client.client_id  # noqa: E731
        self.table.cancel_client(client.client_id)
        for worker in (self.storage.fetcher, self.loads.worker, self.offloads.worker):
            self._finish_cancelled(worker.remove_queued(mine))
        self._finish_cancelled(self.loads.take_parked(mine))
        kv = self.reg.of(client.client_id)
        if dead and kv is not None:
            if kv.order is not None:  # copies waiting for fences it will never write go on
                kv.order.release_fences()  # (its tasks are cancelled: nothing is kept)
            # no op may use the mapping from now on (a hello reusing the client id included),
            # though it is unmapped only after the drain, off this thread
            kv.retired = f"the engine that registered this KV cache ({client.client_id}) is gone"
            self.defer(lambda: self._drop_kv_of(client.client_id))

    def _drop_kv_of(self, client_id: str) -> None:
        """The KV mapping of a client that went away, once the copies in flight drained (if
        they do not within the drain timeout, the mapping stays retired: the next engine's
        register_kv replaces it)."""
        if self.reg.of(client_id) is not None:
            self._drop_kv("client gone", client_id)
            log.info("[clients] dropped the KV mapping of client %s (gone)", client_id)

    def expire_parked(self) -> None:
        """(The daemon's loop, every 0.25 s.) Parked prefetches past their timeout end."""
        self.loads.expire_parked()

    def _live_tasks(self) -> list[CopyTask]:
        """Every task that may hold pins: the client tasks, and backups queued or in flight."""
        backer = self.storage.backer
        tasks = list(self.table.tasks.values()) + backer.queued_tasks() + list(backer.inflight)
        return list({id(t): t for t in tasks}.values())  # a flush is in both

    def status(self) -> dict:
        return status_of(self)

    def close(self) -> None:
        # graceful: copies first, then the backups they queued (write_through's promise that
        # what reached the host tier is in storage after a stop)
        self._finish_cancelled(self.loads.take_parked(lambda t: True))
        self.storage.fetcher.stop()
        self.loads.worker.stop()
        self.offloads.worker.stop()
        self.storage.backer.stop(timeout=DRAIN_TIMEOUT_S)
        self.keys.close()  # before the tiers: readers stop trusting it first
        self.storage.tiers.close()
        with self.host.lock:
            for kv, _ in self.reg.pop_all():
                kv.close()
        self.host.pool.close()
