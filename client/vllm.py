"""KvcachedConnector: vLLM's KV connector (KVConnectorBase_V1) backed by kvcached.

    --kv-transfer-config '{"kv_connector": "KvcachedConnector",
                           "kv_connector_module_path": "kvcached_client.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"instance": "gpu0", "run_dir": "..."}}'

Scheduler side: `get_num_new_matched_tokens` looks the request's full prompt blocks up past
vLLM's own prefix hit (host + storage hits); `update_state_after_alloc` notes the blocks to load
into; `build_connector_meta` hands the worker this step's loads and the newly computed full
blocks (prompt and outputs) to save.

Worker side: vLLM's KV tensors are its own memory, which the daemon cannot map on CPU, so the
worker keeps a staging KV cache in shared memory with the same per-block layout (read from the
tensors vLLM hands over), registered with the daemon. A load goes daemon -> staging, and each
layer is copied into vLLM's blocks in `wait_for_layer_load` as soon as the daemon signals it;
a save copies vLLM's blocks into staging in `wait_for_save` and offloads from there, so vLLM's
blocks are free again when the step ends (`request_finished` returns False: nothing of the
request's is in flight). Blocks a load did not fill are reported by
`get_block_ids_with_load_errors` and vLLM recomputes them; a missing or failing daemon only
ever costs the cache, never the generation.

Tensor parallelism: one daemon per rank. `instances` lists them by rank (or `instance` holds
"{rank}", e.g. "gpu{rank}"). The scheduler asks every rank through a GroupClient and takes the
shortest hit, so all ranks load the same prefix; each worker loads and saves on its own rank's
daemon under rank-derived keys (rank-free for MLA, whose KV is the same on every rank: start all
but one daemon with --no-storage-writer). A rank whose load falls short reports those blocks as
load errors; vLLM gathers them from every worker and all ranks recompute them.

kv_connector_extra_config: instance (default "default") or instances, run_dir, timeout_s (5),
hang_s (the hang threshold, default $KVCACHED_HANG_S or 2), staging_blocks (512), namespace (a
salt, e.g. a tenant), weights_version.

A daemon fault costs at most one step: no step waits to (re)connect (a background thread
reattaches, and re-registers the staging cache, once a daemon is there; until then lookups miss
and saves are skipped), a killed daemon is seen at once, and a hung one after the hang threshold
(its loads in flight become load errors, vLLM recomputes them).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcached_proto.errors import DaemonUnavailable, KvcachedError

from .block_copy import copy_blocks
from .client import Client
from .fence_keeper import FenceKeeper
from .group import GroupClient, rank_keys
from .hashing import BlockHasher, make_namespace
from .kv_alloc import allocate_kv_cache
from .prefix import MMItem, block_extra_keys
from .reattach import Reattacher

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _log_to_stderr() -> None:
    """vLLM configures its own loggers only: without a handler, what the connector says about
    its daemon (gone, hung, attached again) would be lost. Say it on stderr, beside vLLM's."""
    ours = logging.getLogger("kvcached_client")
    if not ours.hasHandlers():  # the process configured no logging of its own (root included)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvcached] %(message)s",
                                               "%m-%d %H:%M:%S"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


@dataclass
class BlockTransfer:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class KvcachedConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


class _DaemonLink:
    """A Client attached in the background (Reattacher): get() answers at once, with the
    client or None (no daemon: a miss, a skipped save), and never waits for a daemon."""

    def __init__(self, instance: str, run_dir: str | None, timeout: float, name: str,
                 on_connect=None, hang_s: float | None = None, retire=None):
        """retire(client): what becomes of a dropped client (default: closed); the worker's
        FenceKeeper keeps one whose fences hold until they lift."""
        self.args = dict(instance=instance, run_dir=run_dir, timeout=timeout, name=name,
                         hang_s=hang_s)
        self.client: Client | None = None
        self._retire = retire
        self._reattach = Reattacher(lambda: Client.connect(**self.args), on_connect,
                                    name=f"vllm-{name}")

    def get(self) -> Client | None:
        if self.client is not None:
            try:
                self.client.signals.check_alive()  # shared memory: cheap, and sees a restart
            except (DaemonUnavailable, AttributeError) as exc:
                log.info("[vllm] daemon %s went away: %s", self.args["instance"], str(exc))
                self._drop()
        if self.client is None:
            self._adopt(self._reattach.take())
        return self.client

    def attach_now(self) -> Client | None:
        """At set-up: one attempt on this thread (a daemon that is up is attached at once);
        from then on a thread watches the daemon and prepares a successor's connection."""
        if self.client is None:
            self._adopt(self._reattach.attach_now())
        self._reattach.watch(lambda: self.client)
        return self.client

    def _adopt(self, client: Client | None) -> None:
        if client is not None:
            self.client = client
            log.info("[vllm] connected to kvcached %s", self.args["instance"])

    def _drop(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            (self._retire or Client.close)(client)

    def failed(self, exc: Exception) -> None:
        log.warning("[vllm] kvcached call failed, going on without it: %s", str(exc))
        if isinstance(exc, DaemonUnavailable):
            self._drop()

    def close(self) -> None:
        self._reattach.close()
        self._drop()


class _GroupLink:
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


def rank_instances(extra: dict, tp_size: int) -> list[str]:
    """The daemon of every tensor-parallel rank, from kv_connector_extra_config."""
    if "instances" in extra:
        instances = [str(i) for i in extra["instances"]]
        if len(instances) != tp_size:
            raise ValueError(f"kv_connector_extra_config instances lists {len(instances)} daemons "
                             f"for tensor_parallel_size {tp_size}: one per rank")
        return instances
    instance = str(extra.get("instance", "default"))
    if tp_size == 1:
        return [instance.replace("{rank}", "0")]
    if "{rank}" not in instance:
        raise ValueError(f"tensor_parallel_size {tp_size} needs one kvcached daemon per rank: give "
                         "kv_connector_extra_config 'instances' (by rank) or an 'instance' with "
                         "{rank} in it")
    return [instance.replace("{rank}", str(r)) for r in range(tp_size)]


@dataclass(eq=False)
class _ReqState:
    request: Any
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    local_tokens: int = 0
    ext_tokens: int = 0
    saved_blocks: int = 0


class KvcachedConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_to_stderr()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = vllm_config.cache_config.block_size
        model = vllm_config.model_config
        namespace = make_namespace(str(model.model), str(model.dtype).removeprefix("torch."),
                                   # the KV dtype (fp8 e4m3 and e5m2 blocks are the same size)
                                   f"vllm-bs{self.block_size}-kv:{vllm_config.cache_config.cache_dtype}", 0,
                                   vllm_config.parallel_config.tensor_parallel_size,
                                   tenant=str(extra.get("namespace", "")),
                                   weights_version=str(extra.get("weights_version", "")))
        self.hasher = BlockHasher(namespace)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("KvcachedConnector does not run with pipeline parallelism")
        self.tp_size = parallel.tensor_parallel_size
        self.mla = bool(getattr(model, "use_mla", False))
        instances = rank_instances(extra, self.tp_size)
        timeout = float(extra.get("timeout_s", 5.0))
        hang_s = float(extra["hang_s"]) if "hang_s" in extra else None
        run_dir = extra.get("run_dir")
        self.counters = {"lookups": 0, "hit_tokens": 0, "loaded_blocks": 0, "load_errors": 0,
                         "saved_blocks": 0, "save_skipped_blocks": 0, "daemon_errors": 0}
        if role == KVConnectorRole.SCHEDULER:
            self._reqs: dict[str, _ReqState] = {}
            self._loads: dict[str, BlockTransfer] = {}
            self.link = (_GroupLink(instances, run_dir, timeout, "vllm-scheduler", self.mla, hang_s)
                         if self.tp_size > 1 else
                         _DaemonLink(instances[0], run_dir, timeout, "vllm-scheduler",
                                     hang_s=hang_s))
            self.link.attach_now()
        else:
            self.rank = 0
            if self.tp_size > 1:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                self.rank = get_tensor_model_parallel_rank()
            self.staging_blocks = int(extra.get("staging_blocks", 512))
            # staging blocks a timed-out task may still touch are held back until it ends
            self._fences = FenceKeeper(lambda blocks: self._free_staging.extend(blocks),
                                       lambda: self.link.client)
            self.link = _DaemonLink(instances[self.rank], run_dir, timeout,
                                    f"vllm-worker-tp{self.rank}", self._register, hang_s,
                                    retire=self._fences.retire)
            self._layers: list[str] = []
            self._vllm_kv: list = []      # per layer: a tensor, or a (K, V) pair
            self._staging: list | None = None
            self._free_staging: deque[int] = deque()
            self._pending_loads: list[dict] = []
            self._inflight_saves: list[tuple[Any, list[int]]] = []
            self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ keys
    def _keys(self, state: _ReqState, num_blocks: int) -> list[bytes]:
        tokens = state.request.all_token_ids
        num_blocks = min(num_blocks, len(tokens) // self.block_size)
        if len(state.keys) < num_blocks:
            items = [MMItem(f.mm_position.offset, f.mm_position.length, f.identifier)
                     for f in getattr(state.request, "mm_features", None) or []]
            extra = block_extra_keys(num_blocks, self.block_size, items)
            bs = self.block_size
            for i in range(len(state.keys), num_blocks):
                state.keys.append(self.hasher.hash_block(
                    state.keys[i - 1] if i else None, tokens[i * bs:(i + 1) * bs],
                    extra[i] if extra else None))
        return state.keys[:num_blocks]

    # ------------------------------------------------------------- scheduler
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        state = self._reqs.get(request.request_id)
        if state is None or state.request is not request:
            state = self._reqs[request.request_id] = _ReqState(request)
        state.local_tokens, state.ext_tokens = num_computed_tokens, 0
        limit = max(len(request.prompt_token_ids or ()) - 1, 0) // bs
        start = num_computed_tokens // bs
        state.saved_blocks = start
        if limit <= start:
            return 0, False
        client = self.link.get()
        if client is None:
            return 0, False
        try:
            host, storage = client.lookup(self._keys(state, limit)[start:])
        except KvcachedError as exc:
            self.counters["daemon_errors"] += 1
            self.link.failed(exc)
            return 0, False
        self.counters["lookups"] += 1
        state.ext_tokens = (host + storage) * bs
        self.counters["hit_tokens"] += state.ext_tokens
        return state.ext_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        bs = self.block_size
        start, n = state.local_tokens // bs, num_external_tokens // bs
        block_ids = blocks.get_block_ids()[0]
        keys = self._keys(state, start + n)
        self._loads[request.request_id] = BlockTransfer(
            request.request_id, keys[start:start + n], list(block_ids[start:start + n]))
        state.saved_blocks = start + n  # the daemon has these already

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvcachedConnectorMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._add_save(meta, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._add_save(meta, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _add_save(self, meta: KvcachedConnectorMetadata, state: _ReqState, computed: int) -> None:
        full = min(computed // self.block_size, len(state.block_ids))
        if full <= state.saved_blocks:
            return
        keys = self._keys(state, full)
        full = len(keys)
        if full > state.saved_blocks:
            meta.saves.append(BlockTransfer(state.request.request_id, keys[state.saved_blocks:full],
                                            state.block_ids[state.saved_blocks:full]))
            state.saved_blocks = full

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        """Saves copy vLLM's blocks into staging before the step ends: nothing of the
        request's is in flight here, so its blocks may be freed now."""
        self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Read the layout vLLM hands over: per layer one tensor whose dim 0 is the block (the
        CPU backend: [blocks, kv_heads, block_size, 2 * head_size]) or a [2, blocks, ...] K/V
        pair; build a staging cache with the same per-block shape in shared memory."""
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        self._layers, self._vllm_kv = list(kv_caches), []
        pair = None
        for name, t in kv_caches.items():
            is_pair = t.dim() >= 2 and t.shape[0] == 2 and (num_blocks is None or t.shape[1] == num_blocks)
            if num_blocks is not None and not is_pair and t.shape[0] != num_blocks:
                raise KvcachedError(f"layer {name}: KV shape {tuple(t.shape)} has no block dimension "
                                    f"of {num_blocks} first; kvcached cannot page it")
            pair = is_pair if pair is None else pair
            self._vllm_kv.append((t[0], t[1]) if is_pair else t)
        first = self._vllm_kv[0][0] if pair else self._vllm_kv[0]
        self._staging = allocate_kv_cache(len(self._layers), self.staging_blocks, tuple(first.shape[1:]),
                                          first.dtype, device="cpu", kv_pair=bool(pair))
        self._free_staging = deque(range(self.staging_blocks))
        self.link.attach_now()

    def _rank_keys(self, keys: list[bytes]) -> list[bytes]:
        """The keys this rank's daemon holds a block under (what GroupClient looks up)."""
        return keys if self.tp_size == 1 or self.mla else rank_keys(keys, self.rank, self.tp_size)

    def _register(self, client: Client) -> None:
        if self._staging is None:
            raise KvcachedError("vLLM has not handed over its KV cache yet")
        client.register_kv_cache(self._staging)

    def _take_staging(self, n: int) -> list[int]:
        self._fences.release()
        return [self._free_staging.popleft() for _ in range(min(n, len(self._free_staging)))]

    def _give_staging(self, blocks) -> None:
        self._fences.free(blocks)

    def _copy(self, layer: int, src_blocks, dst_blocks, to_staging: bool) -> None:
        vllm, staging = self._vllm_kv[layer], self._staging[layer]
        for v, s in (zip(vllm, staging) if isinstance(vllm, tuple) else [(vllm, staging)]):
            if to_staging:
                copy_blocks(s, dst_blocks, v, src_blocks)
            else:
                copy_blocks(v, dst_blocks, s, src_blocks)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcachedConnectorMetadata) or not meta.loads:
            return
        for load in meta.loads:
            client = self.link.get()
            staging = self._take_staging(len(load.keys)) if client is not None else []
            task = None
            if staging:
                try:
                    task = client.load(self._rank_keys(load.keys[: len(staging)]), staging)
                except KvcachedError as exc:
                    self.counters["daemon_errors"] += 1
                    self.link.failed(exc)
            planned = task.num_blocks if task is not None else 0
            self._give_staging(staging[planned:])
            self._fail_blocks(load.block_ids[planned:])
            if planned:
                self._pending_loads.append({"task": task, "client": client, "staging": staging[:planned],
                                            "blocks": load.block_ids[:planned], "valid": planned,
                                            "next_layer": 0, "failed": False})

    def _fail_blocks(self, block_ids) -> None:
        self._load_errors.update(block_ids)
        self.counters["load_errors"] += len(block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._pending_loads:
            return
        try:
            layer = self._layers.index(layer_name)
        except ValueError:
            return
        for p in self._pending_loads:
            while not p["failed"] and p["next_layer"] <= layer:
                self._copy_loaded_layer(p, p["next_layer"])

    def _copy_loaded_layer(self, p: dict, layer: int) -> None:
        task = p["task"]
        try:
            task.wait_layer(layer)
            if layer == 0:
                valid = min(task.valid_blocks, p["valid"])
                if valid < p["valid"]:
                    self._fail_blocks(p["blocks"][valid:])
                    p["valid"] = valid
        except KvcachedError as exc:  # short, failed, timed out or the daemon went away
            self.counters["daemon_errors"] += 1
            self._fail_blocks(p["blocks"][: p["valid"]])
            p["failed"] = True
            if isinstance(exc, DaemonUnavailable):
                self.link.failed(exc)
            return
        if p["valid"]:
            self._copy(layer, p["staging"][: p["valid"]], p["blocks"][: p["valid"]], to_staging=False)
        p["next_layer"] = layer + 1

    def _finish_loads(self) -> None:
        """After the forward: a load whose layers were not all copied in time was not used as
        loaded (vLLM recomputes it); every load's task ends before its staging is reused."""
        for p in self._pending_loads:
            if not p["failed"] and p["next_layer"] < len(self._layers):
                self._fail_blocks(p["blocks"][: p["valid"]])
            else:
                self.counters["loaded_blocks"] += p["valid"] if not p["failed"] else 0
            try:
                p["task"].wait()
            except KvcachedError as exc:  # timed out: the client fences the staging blocks
                self.link.failed(exc)
            self._give_staging(p["staging"])
        self._pending_loads.clear()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves run in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        self._finish_loads()
        self._reap_saves()
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcachedConnectorMetadata):
            return
        for save in meta.saves:
            client = self.link.get()
            staging = self._take_staging(len(save.keys)) if client is not None else []
            self.counters["save_skipped_blocks"] += len(save.keys) - len(staging)
            if not staging:
                continue
            n = len(staging)
            for layer in range(len(self._layers)):
                self._copy(layer, save.block_ids[:n], staging, to_staging=True)
            try:
                task = client.offload(staging, self._rank_keys(save.keys[:n]))
            except KvcachedError as exc:
                self.counters["daemon_errors"] += 1
                self.link.failed(exc)
                self._give_staging(staging)
                continue
            self.counters["saved_blocks"] += n
            self._inflight_saves.append((task, staging, client))

    def _reap_saves(self, wait: bool = False) -> None:
        keep = []
        for task, staging, client in self._inflight_saves:
            try:
                finished = wait or task.done()
                if finished:
                    task.wait()
            except KvcachedError as exc:
                self.link.failed(exc)
                if isinstance(exc, DaemonUnavailable):
                    finished = True  # a gone daemon reads nothing more (a hung one: fenced)
                    client.fence(task.id, staging)
            if finished:
                self._give_staging(staging)
            else:
                keep.append((task, staging, client))
        self._inflight_saves = keep

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._reap_saves()
        return None, None

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._finish_loads()
            self._reap_saves(wait=True)
        log.info("[vllm] %s side counters: %s", self.role.name.lower(), self.counters)
        self.link.close()
        if self.role == KVConnectorRole.WORKER:
            for client in self._fences.retired:  # shutting down: their fences no longer matter
                client.close()
