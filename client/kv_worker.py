"""The engine worker's half of a kvcached connector, free of any engine: geometry, the per-step
logic and CPU staging. The vLLM connector (vllm/connector.py) is a thin adapter over it; a test drives it
the same way with tensors laid out as an engine lays them out.

A step: `preempt(req_ids)` (before the step's blocks are reused), `start_loads(loads)`,
`layer_ready(i)` per layer (or `all_layers_ready()` where per-layer hooks do not run, e.g. CUDA
graphs), `end_forward()`, `start_saves(saves)`, then `finished(finished_req_ids)` and
`load_errors()`.

Two modes, chosen at `register`:
- direct: the daemon maps the engine's own KV (CUDA memory, or kvcached shared memory on CPU)
  and copies into and out of the engine's blocks. A load's layer wait is ordered on the engine's
  stream (no CPU wait for the copy on CUDA); the step's last call (`load_errors`) waits for the
  step's loads to end, so a copy its daemon did not complete is a load error of that step; a
  save is one OFFLOAD sent after the step's KV writes, and returns: the request's blocks stay
  the daemon's to read until its copy ended, so a finished request is reported by `finished`
  only then (its blocks are held until).
- staging: the engine's KV is memory the daemon cannot map (vLLM on CPU). A staging cache in
  shared memory with the same bytes per block (each block's axes in the engine's memory
  order, so the bytes stored are the same in both modes) is registered instead; a load lands
  in staging and is copied into the engine's blocks layer by layer; a save copies the blocks
  into staging before the step ends, so nothing of the engine's is in flight after it.

Every transfer of a request whose blocks the daemon may touch after the step is tracked until
it ended: done, failed, cancelled and acknowledged, or the daemon is gone. A daemon that is
only hung keeps its transfers held (it could come back and write or read them). A failed or
short load reports its blocks in `load_errors` for the engine to recompute; so does, with
host_only_loads, a block that left the host tier after the scheduler's lookup (the load would
otherwise read it from storage inside the step).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from kvcached_proto.errors import DaemonUnavailable, KvcachedError, TaskFailed

from .block_copy import copy_blocks
from .client import Client
from .engine_kv import (check_same_blocks, engine_blocks, kv_device, kv_identity, staging_like,
                        unmappable_cuda_kv)
from .hold_keeper import HoldKeeper
from .key_scheme import KeyScheme
from .kv_alloc import describe_kv_cache, unlink_kv_cache

log = logging.getLogger(__name__)


@dataclass
class BlockTransfer:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    parent: bytes | None = None  # a save's: the key of the request's block before keys[0]


@dataclass(eq=False)
class _Load:
    req_id: str
    task: object
    client: Client
    blocks: list[int]         # the engine's blocks, in key order
    staging: list[int]        # staging blocks (staging mode), else []
    valid: int
    next_layer: int = 0
    failed: bool = False


@dataclass(eq=False)
class _Held:
    """A direct-mode transfer that may touch the engine's blocks until its task ended."""
    req_id: str
    task: object
    client: Client
    kind: str  # "save" (revocable) or "load"

    @property
    def task_id(self) -> int:
        return self.task.id


class KVWorker:
    def __init__(self, link, staging_blocks: int = 512, key_scheme: KeyScheme | None = None,
                 rank: int = 0, direct: bool | None = None, counters: dict | None = None,
                 host_only_loads: bool = False):
        """link: a DaemonLink built with on_connect=self.on_connect and retire=self.retire.
        key_scheme, rank: the keys this rank's daemon holds blocks under (the scheme's kernel
        factor is the one `register` finds in the KV).
        direct: None chooses (direct where the daemon can map the KV), False always stages,
        True refuses to stage. host_only_loads: a load never reads a storage tier inside the
        step; what left the host tier since the scheduler's lookup is a load error (recomputed)."""
        self.link = link
        self.host_only_loads = host_only_loads
        self.staging_blocks = staging_blocks
        self.key_scheme = key_scheme or KeyScheme()
        self.rank = rank
        self._want_direct = direct
        self.mode: str | None = None
        self.counters = counters if counters is not None else {}
        for name in ("loaded_blocks", "load_errors", "saved_blocks", "save_skipped_blocks",
                     "daemon_errors"):
            self.counters.setdefault(name, 0)
        self._layers: list[str] = []  # registered layers (a layer sharing another's KV is not)
        self._slot: dict[str, int] = {}  # every layer name -> its registered layer
        self._engine_kv: list = []   # per registered layer: a tensor or a (K, V) pair
        self._staging: list | None = None
        self._free_staging: deque[int] = deque()
        # staging blocks (staging mode) a timed-out task may still touch wait here; in direct
        # mode the keeper only keeps dropped clients while their transfers are unconfirmed
        self._holds = HoldKeeper(self._free_staging.extend, lambda: self.link.client)
        self._loads: list[_Load] = []
        self._landed: list[_Load] = []  # direct: landed in every layer, copies not yet confirmed
        self._staged_saves: list[tuple] = []   # (task, staging blocks, client)
        self._held: list[_Held] = []
        self._transfer_reqs: set[str] = set()  # requests with a transfer, until reported
        self._cut: set[str] = set()  # requests a save stored short of: what follows is not saved
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()

    @property
    def retire(self):
        return self._holds.retire

    # ------------------------------------------------------------- set-up
    def register(self, kv_caches: dict, num_blocks: int | None = None) -> str:
        """kv_caches: per layer name, one tensor whose dim 0 is the block, or a (K, V) pair (a
        [2, num_blocks, ...] tensor is split into one). A layer handed the very KV of an
        earlier one (vLLM's cross-layer KV sharing) is that layer, paged once (`layer_index`).
        A dim 0 of num_blocks * r holds r kernel blocks per block (vLLM's virtual block
        splitting; block b is kernel blocks b*r .. b*r+r-1): each block is then its r kernel
        blocks, under keys of their own (`kernel_block_keys`). Returns the mode chosen; KV it
        refuses raises KvcachedError before anything reaches the daemon."""
        layers, engine_kv, slot, factors, seen = [], [], {}, set(), {}
        for name, t in kv_caches.items():
            ident = kv_identity(t)
            if ident in seen:  # vLLM's cross-layer KV sharing: the target layer's KV
                slot[name] = seen[ident]
                continue
            entry, factor = engine_blocks(name, t, num_blocks)
            seen[ident] = slot[name] = len(layers)
            layers.append(name)
            engine_kv.append(entry)
            factors.add(factor)
        if len(factors) > 1:
            raise KvcachedError(f"the layers split their blocks into different numbers of kernel "
                                f"blocks ({sorted(factors)}); kvcached needs one for every layer")
        check_same_blocks(layers, engine_kv)
        self._layers, self._engine_kv, self._slot = layers, engine_kv, slot
        self.key_scheme.kernel_factor = factors.pop() if factors else 1
        self.mode = self._choose_mode()
        if self.mode == "staging":
            self._staging = staging_like(self._engine_kv[0], len(self._layers),
                                         self.staging_blocks)
            self._free_staging.clear()
            self._free_staging.extend(range(self.staging_blocks))
        self.link.attach_now()
        return self.mode

    @property
    def kernel_factor(self) -> int:
        """Kernel blocks per block in the registered KV (vLLM's virtual block splitting)."""
        return self.key_scheme.kernel_factor

    @property
    def num_layers(self) -> int:
        """The registered layers (a layer sharing another's KV is not one of them)."""
        return len(self._layers)

    def layer_index(self, name: str) -> int | None:
        """The registered layer (what `layer_ready` takes) holding layer `name`'s KV."""
        return self._slot.get(name)

    def keys_for_daemon(self, keys: list[bytes]) -> list[bytes]:
        """The keys this worker's daemon holds these blocks under."""
        return self.key_scheme.daemon_keys(keys, self.rank)

    def _choose_mode(self) -> str:
        if self._want_direct is False:
            return "staging"
        try:
            describe_kv_cache(self._engine_kv)
            return "direct"
        except KvcachedError as exc:
            if self._want_direct:
                raise
            if kv_device(self._engine_kv[0]) != "cpu":
                raise KvcachedError(unmappable_cuda_kv(exc)) from None
            log.warning("[kv] the daemon cannot map this KV cache (%s): staging it through "
                        "shared memory", exc)
            return "staging"

    def on_connect(self, client: Client) -> None:
        """What a (re)attached daemon gets: the KV it copies into and out of."""
        if self.mode is None:
            raise KvcachedError("the engine has not handed over its KV cache yet")
        client.register_kv_cache(self._staging if self.mode == "staging" else self._engine_kv)

    def _copy(self, layer: int, src_blocks, dst_blocks, to_staging: bool) -> None:
        engine, staging = self._engine_kv[layer], self._staging[layer]
        pairs = zip(engine, staging) if isinstance(engine, tuple) else [(engine, staging)]
        for e, s in pairs:
            if to_staging:
                copy_blocks(s, dst_blocks, e, src_blocks)
            else:
                copy_blocks(e, dst_blocks, s, src_blocks)

    def _take_staging(self, n: int) -> list[int]:
        self._holds.release()
        return [self._free_staging.popleft() for _ in range(min(n, len(self._free_staging)))]

    def _daemon_failed(self, exc: Exception) -> None:
        self.counters["daemon_errors"] += 1
        self.link.failed(exc)

    def _fail_blocks(self, block_ids) -> None:
        self._load_errors.update(block_ids)
        self.counters["load_errors"] += len(block_ids)

    # -------------------------------------------------------------- loads
    def start_loads(self, loads: list[BlockTransfer]) -> None:
        """The step's loads, sent together (one round trip for all, `Client.load_batch`)."""
        client = self.link.get()
        plans = []  # (load, blocks to load, staging blocks)
        for load in loads:
            self._transfer_reqs.add(load.req_id)
            n = len(load.keys) if client is not None else 0
            staging = []
            if n and self.mode == "staging":
                staging = self._take_staging(n)
                n = len(staging)
            plans.append((load, n, staging))
        sent = [p for p in plans if p[1]]
        results = []
        if sent:
            try:
                results = client.load_batch(
                    [(self.keys_for_daemon(load.keys[:n]), staging or load.block_ids[:n])
                     for load, n, staging in sent], host_only=self.host_only_loads)
            except KvcachedError as exc:  # none was sent (e.g. no fence word free)
                results = [exc] * len(sent)
        got = {id(p): r for p, r in zip(sent, results)}
        for p in plans:
            self._planned(client, *p, got.get(id(p)))

    def _planned(self, client, load: BlockTransfer, n: int, staging: list[int], task) -> None:
        """One load of the step as the daemon answered it: a task, an error or nothing sent."""
        if isinstance(task, KvcachedError):
            self._daemon_failed(task)
            late = getattr(task, "unanswered", None)  # sent, unanswered: the client holds its
            if late is not None and self.mode == "direct":  # blocks (staging: the keeper)
                self._held.append(_Held(load.req_id, late, client, "load"))
            task = None
        planned = task.num_blocks if task is not None else 0
        self._holds.free(staging[planned:])
        self._fail_blocks(load.block_ids[planned:])
        if planned:
            self._loads.append(_Load(load.req_id, task, client, load.block_ids[:planned],
                                     staging[:planned], planned))

    def layer_ready(self, layer: int) -> None:
        """Layer `layer` of every load of the step is in the engine's blocks (CUDA: ordered on
        the engine's current stream); a load that failed reports its blocks instead."""
        for p in self._loads:
            while not p.failed and p.next_layer <= layer:
                self._land_layer(p, p.next_layer)

    def all_layers_ready(self) -> None:
        if self._layers:
            self.layer_ready(len(self._layers) - 1)

    def _land_layer(self, p: _Load, layer: int) -> None:
        try:
            p.task.wait_layer(layer)
            if layer == 0:
                valid = min(p.task.valid_blocks, p.valid)
                if valid < p.valid:
                    self._fail_blocks(p.blocks[valid:])
                    p.valid = valid
        except KvcachedError as exc:  # short, failed, timed out or the daemon went away
            self._fail_blocks(p.blocks[: p.valid])
            p.failed = True
            if self.mode == "direct":  # held before the link may drop the client: a hung
                self._hold(p.req_id, p.task, p.client, p.blocks, "load")  # end still lifts it
            # (staging: a wait that found the daemon hung held the load's staging blocks itself)
            if isinstance(exc, TaskFailed):  # it ended short (a clear cancelled it, a storage
                # read failed): the daemon answered; its blocks count in load_errors
                log.info("[kv] %s: request %s recomputes %d blocks", str(exc), p.req_id, p.valid)
            else:
                self._daemon_failed(exc)
            return
        if p.valid and self.mode == "staging":
            self._copy(layer, p.staging[: p.valid], p.blocks[: p.valid], to_staging=False)
        p.next_layer = layer + 1

    def end_forward(self) -> None:
        """After the forward: a load not landed in every layer was not used as loaded (the
        engine recomputes it). Staging: every load ends before its staging is reused. Direct:
        nothing waits here; a load is held, and keeps its request held, until its end event (or
        its daemon is gone), and whether its copies completed is settled by `load_errors`."""
        for p in self._loads:
            landed = not p.failed and p.next_layer >= len(self._layers)
            if not p.failed and not landed:
                self._fail_blocks(p.blocks[: p.valid])
            if self.mode == "direct":
                if not p.failed:  # (a failed one was held when it failed)
                    self._hold(p.req_id, p.task, p.client, p.blocks, "load")
                if landed:
                    self._landed.append(p)
                continue
            if landed:
                self.counters["loaded_blocks"] += p.valid
            try:
                p.task.wait()
            except KvcachedError as exc:  # timed out: the client holds the staging blocks
                self.link.failed(exc)
            self._holds.free(p.staging)
        self._loads.clear()

    def _confirm_landed(self) -> None:
        """Direct mode, at the step's end: on CUDA a layer's wait is queued on the engine's
        stream and the CPU learns only from the load's end whether every copy completed (a
        daemon that died mid-copy had those waits released by the client's guard, and the
        forward read partial blocks). Each landed load of the step is waited for here, one
        client timeout for all of them (a dead daemon ends it at once, a hung one at the hang
        threshold); what it did not complete is a load error of this step, which the engine
        recomputes (vLLM drops the step's output for those requests)."""
        if not self._landed:
            return
        deadline = time.monotonic() + self._landed[0].client.timeout
        for p in self._landed:
            try:
                p.task.wait_end(max(0.01, deadline - time.monotonic()))
                valid = min(p.valid, int(p.task.result.get("loaded", 0)))
            except KvcachedError as exc:  # gone, hung or late: it stays held (held)
                valid = 0
                self.link.failed(exc)
            self._fail_blocks(p.blocks[valid: p.valid])
            self.counters["loaded_blocks"] += valid
        self._landed.clear()

    # -------------------------------------------------------------- saves
    def start_saves(self, saves: list[BlockTransfer]) -> None:
        """Called once the step's KV writes are queued. Direct: one OFFLOAD per save, ordered
        after them on the engine's stream; nothing waits. Staging: the blocks are copied into
        staging first."""
        self._reap_staged()
        for save in saves:
            self._transfer_reqs.add(save.req_id)
            client = self.link.get() if save.req_id not in self._cut else None  # (after a hole,
            n = len(save.keys) if client is not None else 0  # no lookup would reach a block)
            staging = self._take_staging(n) if self.mode == "staging" else []
            if self.mode == "staging":
                n = len(staging)
                for layer in range(len(self._layers)):
                    self._copy(layer, save.block_ids[:n], staging, to_staging=True)
            self.counters["save_skipped_blocks"] += len(save.keys) - n
            if n < len(save.keys):
                self._cut.add(save.req_id)
            if not n:
                continue
            try:
                parent = self.keys_for_daemon([save.parent])[-1] if save.parent is not None else None
                task = client.offload(staging or save.block_ids[:n], self.keys_for_daemon(save.keys[:n]),
                                      parent=parent)
            except KvcachedError as exc:
                self._daemon_failed(exc)
                self._holds.free(staging)
                self._cut.add(save.req_id)
                continue
            if task.reply.get("accepted", n) < n:  # the host pool was full of blocks in use
                self._cut.add(save.req_id)
            self.counters["saved_blocks"] += n
            if self.mode == "staging":
                self._staged_saves.append((task, staging, client))
            else:
                self._hold(save.req_id, task, client, save.block_ids[:n], "save")

    def _hold(self, req_id: str, task, client: Client, blocks, kind: str) -> None:
        client.hold(task.id, blocks)  # lifts with the task's end event, or the daemon's death
        self._held.append(_Held(req_id, task, client, kind))

    def _reap_staged(self, wait: bool = False) -> None:
        keep = []
        for task, staging, client in self._staged_saves:
            try:
                finished = wait or task.done()
                if finished:
                    task.wait()
            except KvcachedError as exc:
                self.link.failed(exc)
                if isinstance(exc, DaemonUnavailable):
                    finished = True  # a gone daemon reads nothing more (a hung one: held)
                    client.hold(task.id, staging)
            if finished:
                self._holds.free(staging)
            else:
                keep.append((task, staging, client))
        self._staged_saves = keep

    def _reap_held(self) -> set[str]:
        """Drop the held transfers that ended; returns the requests still holding."""
        if not self._held:
            return set()
        live: dict[int, set[int]] = {}
        for h in self._held:
            if id(h.client) not in live:
                try:
                    live[id(h.client)] = h.client.held_tasks()
                except KvcachedError:  # unreadable: everything of that client still holds
                    live[id(h.client)] = {x.task_id for x in self._held if x.client is h.client}
        keep = []
        for h in self._held:
            if h.task_id in live[id(h.client)]:
                keep.append(h)
            else:
                h.task.collect()  # its end, if it came as an event
        self._held = keep
        self._holds.release()  # a retired client whose transfers all ended is closed
        return {h.req_id for h in keep}

    # ---------------------------------------------------- request lifecycle
    def preempt(self, req_ids) -> None:
        """The engine is about to reuse these requests' blocks: each transfer on them ends first,
        waited for up to the client's timeout (a dead daemon's at once). A save still running
        then is revoked (the daemon discards it rather than store what it would read after the
        reuse); a load is cancelled and its end waited for (one more timeout for all of them).
        A daemon hung mid-load that answers neither could still write those blocks: logged."""
        wanted = set(req_ids)
        held = [h for h in self._held if h.req_id in wanted]
        deadline = time.monotonic() + (held[0].client.timeout if held else 0)
        for h in held:  # one deadline for all of them
            try:
                h.task.wait_end(max(0.01, deadline - time.monotonic()))
                continue
            except KvcachedError as exc:  # timed out, or the daemon is gone or hung
                self.link.failed(exc)
            if h.kind == "save":
                h.client.revoke(h.task)
                log.warning("[kv] save task %d of preempted request %s did not end in time: "
                            "revoked", h.task_id, h.req_id)
            elif _stopped(h.task, deadline + h.client.timeout):  # (one more timeout, for all)
                log.warning("[kv] load task %d of preempted request %s did not end in time: "
                            "cancelled", h.task_id, h.req_id)
            else:  # a daemon that wakes reads the revoke before its next layer (the cancel later)
                h.client.revoke(h.task)
                log.warning("[kv] load %s of preempted request %s is not confirmed ended: revoked "
                            "(a daemon that wakes copies none of its layers not begun), its blocks "
                            "are reused now",
                            f"task {h.task_id}" if h.task_id > 0 else "(sent, never answered)", h.req_id)
        self._reap_held()

    def finished(self, finished_req_ids) -> set[str]:
        """Requests the engine finished whose transfers have all ended, each reported once
        (only requests that had a transfer: the scheduler holds exactly those)."""
        self._reap_staged()
        self._finishing |= set(finished_req_ids) & self._transfer_reqs
        holding = self._reap_held()
        done = {r for r in self._finishing if r not in holding}
        self._finishing -= done
        self._transfer_reqs -= done
        self._cut -= done
        return done

    def load_errors(self) -> set[int]:
        """The step's last call: the engine blocks its loads did not fill (direct mode: once
        the step's loads ended, `_confirm_landed`)."""
        self._confirm_landed()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        self.end_forward()
        self._reap_staged(wait=True)
        self.link.close()
        if self._staging is not None:  # vLLM kills its workers right after shutdown(): the
            unlink_kv_cache(self._staging)  # segment's finalizer would never run
        for client in self._holds.retired:  # shutting down: their holds no longer matter
            client.close()


def _stopped(task, deadline: float) -> bool:
    """A load of a preempted request that did not end in time, cancelled: whether the daemon
    confirmed it writes no more of it - a queued one (a slow or paused daemon's) is dropped at
    once, a running one stops at its next layer and its end is waited for (until `deadline`).
    Without this the engine reused the blocks a slow daemon's queued load then wrote (another
    request's KV). False for a daemon that does not answer, or a load never answered."""
    if task.id <= 0:
        return False
    try:
        if task.cancel() != "finishing":  # "cancelled" (was queued) or "done"
            return True
        task.wait_end(max(0.01, deadline - time.monotonic()))
        return True
    except KvcachedError:
        return False
