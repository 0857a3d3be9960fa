"""KvcachedConnector: vLLM's KV connector (KVConnectorBase_V1) backed by kvcached.

    --kv-transfer-config '{"kv_connector": "KvcachedConnector",
                           "kv_connector_module_path": "kvcached_client.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"instance": "gpu0", "run_dir": "..."}}'

Scheduler side: `get_num_new_matched_tokens` looks the request's full prompt blocks up past
vLLM's own prefix hit. A hit held only in storage (disk, redis) is prefetched into the host tier
between steps while the request waits (it answers None: vLLM asks again at the next step), so a
load never reads storage inside a forward step (lookup_gate.py); `update_state_after_alloc`
notes the blocks to load into; `build_connector_meta` hands the worker this step's loads and the
newly computed full blocks (prompt and outputs) to save.

Worker side: a thin adapter over the vLLM-free worker core (kv_worker.py). Where the daemon can
map vLLM's KV (CUDA: one allocation, strided per-layer views) it copies straight into and out of
vLLM's blocks ("direct"): a layer's load is waited for on vLLM's stream, a save is sent after the
step's KV writes and returns, and a finished request whose save is still running is held
(`request_finished` returns True) until `get_finished` reports it in finished_sending. On CPU
the daemon cannot map vLLM's private memory, so the worker stages through a shared-memory copy
of the cache with the same bytes per block ("staging"): loads are copied into vLLM's blocks
layer by layer in `wait_for_layer_load`, saves into staging in `wait_for_save`. Blocks vLLM
splits into r kernel blocks are paged whole under keys of their own; each worker tells the
scheduler its r in vLLM's start-up handshake, and lookups use the same keys. Either way
blocks a load did not fill are reported by `get_block_ids_with_load_errors` and vLLM recomputes
them (the connector sets kv_load_failure_policy="recompute"); a missing or failing daemon only
ever costs the cache, never the generation.

kv_role: kv_both and kv_producer look blocks up and store them; kv_consumer (the decode instances
of a disaggregated deployment, whose daemons share the prefill instances' storage tier) only
looks up and loads, asking again for up to consumer_wait_s (0.5) while its hit is short.

Inside vLLM's MultiConnector the MultiConnector's own config must set kv_load_failure_policy
"recompute" (checks.py warns at start); list kvcached after a connector with a handshake.

Tensor parallelism: one daemon per rank. `instances` lists them by rank (or `instance` holds
"{rank}", e.g. "gpu{rank}"; "{dp_rank}" is vLLM's data-parallel rank). The scheduler asks every
rank through a GroupClient and takes the shortest hit, so all ranks load the same prefix; each worker loads and saves on its own rank's
daemon under rank-derived keys (rank-free for MLA, whose KV is the same on every rank: start all
but one daemon with --no-storage-writer). A rank whose load falls short reports those blocks as
load errors; vLLM gathers them from every worker and all ranks recompute them.

Refused at start-up, by name: pipeline and context parallelism, a model with several KV cache
groups (or none) or one whose attention is not full (sliding-window, chunked-local), and layers
whose KV blocks differ in shape or dtype (the worker core's register).

kv_connector_extra_config (instance or instances, run_dir, timeout_s, hang_s, staging_blocks, mode,
storage_hits, prefetch_timeout_s, namespace, weights_version, consumer_wait_s): docs/engines.md.
With vLLM's KV events on, the blocks the daemons hold are reported too (kv_events.py).

Weights changed in place (vLLM's RL API, reload_weights, an RL framework's worker extension)
key the blocks anew, under the weight version set or a new salt (weight_updates.py).

A daemon fault costs at most one step: no step waits to (re)connect (a background thread
reattaches, and re-registers the staging cache, once a daemon is there; until then lookups miss
and saves are skipped), a killed daemon is seen at once, and a hung one after the hang threshold
(its loads in flight become load errors, vLLM recomputes them).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcached_proto.errors import KvcachedError

from ..daemon_link import DaemonLink
from ..extra_keys import unknown_keys
from ..group import GroupLink
from ..hashing import BlockHasher, make_namespace, weights_identity
from ..key_scheme import KeyScheme
from ..kv_worker import BlockTransfer, KVWorker
from ..lookup_gate import LookupGate
from ..mm_keys import MMItem
from . import weight_updates
from .checks import (
    KvcachedHandshake,
    check_multi_connector_policy,
    check_one_kv_cache_group,
    check_parallelism,
    handshakes_heard,
    rank_instances,
)
from .freshness import Freshness
from .kv_events import KVEventsReporter
from .request_keys import drops_last_block, model_factors, request_parts
from .stats import KvcachedConnectorStats, KvcachedPromMetrics, interval

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
EXTRA_KEYS = ("instance", "instances", "run_dir", "timeout_s", "hang_s", "staging_blocks", "mode",
              "storage_hits", "prefetch_timeout_s", "namespace", "weights_version", "consumer_wait_s")


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
class KvcachedConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # requests whose transfers end first


@dataclass(eq=False)
class _ReqState:
    request: Any
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    local_tokens: int = 0
    ext_tokens: int = 0
    storage_tokens: int = 0  # of ext_tokens, those a storage tier supplied
    saved_blocks: int = 0
    stale: bool = False  # computed on KV of weights or an adapter older than its keys: never saved
    adapter_ident: str | None = None  # its load_inplace adapter's files when it was looked up


class KvcachedConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_one_kv_cache_group(kv_cache_config)
        _log_to_stderr()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        for message in unknown_keys(extra, EXTRA_KEYS):
            log.warning("[vllm] %s", message)
        self.block_size = vllm_config.cache_config.block_size
        model = vllm_config.model_config
        # the KV dtype (fp8 e4m3 and e5m2 blocks are the same size) and the layout vLLM resolved
        # (a block's bytes are in its memory order, in both worker modes) are in the namespace
        layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
        engine = (f"vllm-bs{self.block_size}-kv:{vllm_config.cache_config.cache_dtype}-layout:{layout}"
                  + model_factors(model, vllm_config.speculative_config, vllm_config.load_config))
        # (weights quantized at load, config overrides, a drafter's KV: request_keys.py)
        self.drop_last = int(drops_last_block(vllm_config.speculative_config))
        # the checkpoint's identity, not only its path: a new checkpoint written where the old
        # one was gets other keys (extra config weights_version pins it instead)
        weights = str(extra.get("weights_version", "")) or weights_identity(
            str(model.model), getattr(model, "revision", None))
        self.namespace = make_namespace(str(model.model), str(model.dtype).removeprefix("torch."),
                                        engine, 0, vllm_config.parallel_config.tensor_parallel_size,
                                        tenant=str(extra.get("namespace", "")),
                                        weights_version=weights)
        self.resets = 0
        parallel = vllm_config.parallel_config
        check_parallelism(parallel)
        self.tp_size = parallel.tensor_parallel_size
        self.mla = bool(getattr(model, "use_mla", False))
        # block keys; the kernel factor is the workers' (set_xfer_handshake_metadata), or the worker's own
        self.key_scheme = KeyScheme(BlockHasher(self.namespace), self.tp_size, self.mla)
        warn_dp = role == KVConnectorRole.SCHEDULER  # said once per engine, not by each worker
        instances = rank_instances(extra, self.tp_size, int(parallel.data_parallel_rank or 0),
                                   int(parallel.data_parallel_size or 1) if warn_dp else 1)
        link_args = dict(run_dir=extra.get("run_dir"), timeout=float(extra.get("timeout_s", 5.0)),
                         hang_s=float(extra["hang_s"]) if "hang_s" in extra else None)
        self.counters = {"lookups": 0, "hit_tokens": 0, "daemon_errors": 0, "stale_blocks": 0}
        self._reported: dict = {}  # the counters as last reported to vLLM (stats.py)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(instances, link_args, extra)
        else:
            self._init_worker(instances, link_args, extra)

    def _init_scheduler(self, instances: list[str], link_args: dict, extra: dict) -> None:
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # a load the daemon could not finish must cost a recompute, never the request
            log.warning("[vllm] kvcached sets kv_load_failure_policy='recompute' (was %r)",
                        self._kv_transfer_config.kv_load_failure_policy)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._reqs: dict[str, _ReqState] = {}
        self._loads: dict[str, BlockTransfer] = {}
        self._transfer_reqs: set[str] = set()  # sent a load or a save; held at finish until reported
        consumer = self._kv_transfer_config.kv_role == "kv_consumer"  # loads what others stored
        self.gate = LookupGate(self.block_size, str(extra.get("storage_hits", "prefetch")),
                               float(extra.get("prefetch_timeout_s", 5.0)),
                               grace_s=link_args["timeout"], counters=self.counters,
                               expect_s=float(extra.get("consumer_wait_s", 0.5)) if consumer else 0.0)
        self.link = (GroupLink(instances, name="vllm-scheduler", mla=self.mla, **link_args)
                     if self.tp_size > 1 else
                     DaemonLink(instances[0], name="vllm-scheduler", **link_args))
        self.link.attach_now()
        self.disabled = False  # set where re-keying after a weight update failed: no hit, no save
        self.stores = not consumer
        self.fresh = Freshness()  # which requests' blocks may be stored (freshness.py)
        self.kv_events = KVEventsReporter.for_engine(self._vllm_config, self._kv_cache_config,
                                                     self.key_scheme, self.link, self.block_size)
        weight_updates.watch(self)

    def _init_worker(self, instances: list[str], link_args: dict, extra: dict) -> None:
        self.rank = 0
        if self.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = get_tensor_model_parallel_rank()
        mode = str(extra.get("mode", "auto"))
        if mode not in ("auto", "staging", "direct"):
            raise ValueError(f"kv_connector_extra_config mode {mode!r}: expected auto, staging or direct")
        storage_hits = str(extra.get("storage_hits", "prefetch"))
        if storage_hits not in ("prefetch", "inline"):
            raise ValueError(f"kv_connector_extra_config storage_hits {storage_hits!r}: "
                             "expected prefetch or inline")
        self.worker = KVWorker(None, int(extra.get("staging_blocks", 512)), self.key_scheme, self.rank,
                               direct={"auto": None, "staging": False, "direct": True}[mode],
                               counters=self.counters,
                               host_only_loads=storage_hits == "prefetch")
        if self.rank == 0:
            check_multi_connector_policy(self._kv_transfer_config)
        self.worker.link = DaemonLink(instances[self.rank], name=f"vllm-worker-tp{self.rank}",
                                      on_connect=self.worker.on_connect,
                                      retire=self.worker.retire, **link_args)

    # ------------------------------------------------------------------ keys
    def _keys(self, state: _ReqState, num_blocks: int) -> list[bytes]:
        tokens = state.request.all_token_ids
        num_blocks = min(num_blocks, len(tokens) // self.block_size)
        if len(state.keys) < num_blocks:
            items = [MMItem(f.mm_position.offset, f.mm_position.length, f.identifier)
                     for f in getattr(state.request, "mm_features", None) or []]
            self.key_scheme.extend(state.keys, tokens, self.block_size, num_blocks, items,
                                   request_parts(state.request, self.block_size, self.fresh))
        return state.keys[:num_blocks]

    # ------------------------------------------------------------- scheduler
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self.block_size
        state = self._reqs.get(request.request_id)
        if state is None or state.request is not request:
            state = self._reqs[request.request_id] = _ReqState(request)
        state.local_tokens, state.ext_tokens = num_computed_tokens, 0
        limit = max(len(request.prompt_token_ids or ()) - 1, 0) // bs
        start = num_computed_tokens // bs
        state.saved_blocks = start
        self.fresh.at_lookup(state, start)
        if limit <= start:
            return 0, False
        client = None if self.disabled else self.link.get()
        if client is None:
            return 0, False
        if self.key_scheme.kernel_factor is None:
            return 0, False
        keys = self.key_scheme.kernel_keys(self._keys(state, limit)[start:])
        try:
            hit = self.gate.match(request.request_id, client, keys)
        except KvcachedError as exc:
            self.counters["daemon_errors"] += 1
            self.link.failed(exc)
            return 0, False
        if hit is None:  # its storage hit is being brought into the host tier: ask again later
            return None, False
        hit = max(hit - self.drop_last, 0)  # EAGLE: as vLLM's own hits (drops_last_block)
        self.counters["lookups"] += 1
        state.ext_tokens = hit * bs
        state.storage_tokens = min(hit, self.gate.from_storage.get(request.request_id, 0)) * bs
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
        self.kv_events.loading(request, start, keys[start:start + n])
        state.saved_blocks = start + n  # the daemon has these already

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvcachedConnectorMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        meta.preempted = sorted(set(getattr(scheduler_output, "preempted_req_ids", None) or ())
                                & self._transfer_reqs)
        scheduled = scheduler_output.num_scheduled_tokens
        self.fresh.scheduled(bool(scheduled))
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
        self._transfer_reqs.update(t.req_id for t in meta.loads)
        self._transfer_reqs.update(t.req_id for t in meta.saves)
        self.fresh.saves_built()
        return meta

    def _add_save(self, meta: KvcachedConnectorMetadata, state: _ReqState, computed: int) -> None:
        full = min(computed // self.block_size, len(state.block_ids))
        if full <= state.saved_blocks or self.disabled or not self.stores:
            return
        if not self.fresh.may_save(state):  # computed on KV of old weights or an old adapter
            self.counters["stale_blocks"] += full - state.saved_blocks
            state.saved_blocks = full
            return
        keys = self._keys(state, full)
        full = len(keys)
        if full > state.saved_blocks:
            parent = keys[state.saved_blocks - 1] if state.saved_blocks else None  # a save's, a hit's
            meta.saves.append(BlockTransfer(state.request.request_id, keys[state.saved_blocks:full],
                                            state.block_ids[state.saved_blocks:full], parent))
            self.kv_events.saving(state.request, state.saved_blocks, keys[state.saved_blocks:full])
            state.saved_blocks = full

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request that had a load or a save sent holds its blocks until the workers report
        it in finished_sending (direct mode: the daemon may still read or write them; staging:
        reported at the next step)."""
        self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self.gate.forget(request.request_id)
        return request.request_id in self._transfer_reqs, None

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        """Scheduler: the workers' handshakes, once their KV is registered. Lookups then use the
        keys the workers store under; ranks that disagree get no hits (logged)."""
        self.key_scheme.kernel_factor = handshakes_heard(metadata)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None) -> bool:
        """vLLM 0.33 asks before it enables sleep mode: no (its KV, allocated through CuMem, is
        not exportable over CUDA IPC and moves at wake-up); vLLM then refuses it at start."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """No (vLLM's default for kv_both is yes): a save a preemption cuts short is a later miss."""
        return False

    def reset_cache(self) -> bool:
        """vLLM drops its prefix cache (POST /reset_prefix_cache?reset_external=true; a pause
        with clear_cache, the step before a weight update): keys are salted anew from here on,
        so no block stored before is ever matched again (the daemon's tiers age them out)."""
        self.resets += 1
        self._rekey(f"reset:{os.urandom(8).hex()}")
        log.info("[vllm] cache reset %d: blocks stored before are never matched again", self.resets)
        return True

    def weights_replaced(self, version: str | None, what: str) -> None:
        """vLLM's weights may have changed in place (weight_updates.py): blocks are keyed under
        the weight `version` set, else under a new salt, as at a reset. What vLLM computed
        before stays in its own cache until it is emptied (`pause(mode="keep")` keeps requests
        running on it): a request running now, or one that hits vLLM's own cache before it is
        emptied, computes on the old weights' KV, and its blocks are not stored (stale)."""
        self._rekey(f"vllm-weight-version:{version}" if version is not None
                    else f"reset:{os.urandom(8).hex()}")
        self.fresh.weights_replaced(self._reqs.values())
        log.info("[vllm] %s: blocks are keyed anew (%s)%s", what,  # each chunk of an update
                 f"weight version {version}" if version is not None else "a new salt",
                 "; until vLLM's own cache is emptied, what is computed on it is not stored"
                 if self.fresh.local_stale else "")

    def local_cache_emptied(self) -> None:
        """vLLM emptied its own prefix cache: what it holds from now on is the current weights'."""
        self.fresh.emptied()

    def adapter_loaded(self, lora) -> None:
        """vLLM's add_lora loaded `lora`; loaded again, its blocks are keyed anew (freshness.py)."""
        mine = [s for s in self._reqs.values()
                if getattr(getattr(s.request, "lora_request", None), "lora_name", None) == lora.lora_name]
        if self.fresh.adapter_loaded(lora, mine):
            for state in mine:
                state.keys = []
                self.gate.forget(state.request.request_id)
            self.kv_events.forget_lora(lora.lora_name)  # stored before: never matched again
            log.info("[vllm] LoRA adapter %r loaded again: its blocks are keyed anew", lora.lora_name)

    def close_link(self) -> None:
        """Serve and store nothing more (re-keying failed: the keys may be the old weights')."""
        self.disabled = True
        self.link.close()

    def _rekey(self, part: str) -> None:
        self.key_scheme.hasher = BlockHasher(f"{self.namespace}|{part}")
        for state in self._reqs.values():
            state.keys = []  # computed again under the new keys
        self.gate.forget_all()
        self.kv_events.forget_all()  # nothing stored before is matched again

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        """The hit split by where the daemon had it: its host tier, or a storage tier (disk,
        redis) it was prefetched from while the request waited."""
        if num_external_tokens <= 0:
            return {}
        state = self._reqs.get(request.request_id)
        stored = min(num_external_tokens, state.storage_tokens if state is not None else 0)
        out = {CacheHitSource.HOST: num_external_tokens - stored, CacheHitSource.DISK: stored}
        return {k: v for k, v in out.items() if v}

    def take_events(self):
        """vLLM's KV events (after each step) for the blocks the daemons hold (kv_events.py)."""
        self.kv_events.poll(follow=not self.disabled)
        return self.kv_events.take()

    def update_connector_output(self, connector_output) -> None:
        self._transfer_reqs.difference_update(connector_output.finished_sending or ())

    # ---------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer KV: one tensor per layer with the block first (0.32: strided views of
        one allocation), or a [2, blocks, ...] K/V pair. Direct where the daemon can map it."""
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        mode = self.worker.register(kv_caches, num_blocks)
        shared = len(kv_caches) - self.worker.num_layers
        log.info("[vllm] worker %d: %d layers%s, %s mode", self.rank, len(kv_caches),
                 f" ({shared} sharing another's KV)" if shared else "", mode)

    def get_handshake_metadata(self) -> KvcachedHandshake | None:
        """Worker: told to the scheduler once the KV is registered (set_xfer_handshake_metadata)."""
        if self.role != KVConnectorRole.WORKER or self.worker.mode is None:
            return None
        return KvcachedHandshake(self.worker.kernel_factor, self.worker.mode)

    def _meta(self) -> KvcachedConnectorMetadata | None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return meta if isinstance(meta, KvcachedConnectorMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KvcachedConnectorMetadata) and kv_connector_metadata.preempted:
            self.worker.preempt(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None or not meta.loads:
            return
        self.worker.start_loads(meta.loads)
        mode = getattr(forward_context, "cudagraph_runtime_mode", None)
        if getattr(mode, "name", "NONE").startswith("FULL"):
            self.worker.all_layers_ready()  # a full CUDA graph runs no per-layer hook

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self.worker.layer_index(layer_name)
        if layer is not None:
            self.worker.layer_ready(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves are sent in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        self.worker.end_forward()
        meta = self._meta()
        self.worker.start_saves(meta.saves if meta is not None else [])

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.finished(finished_req_ids) or None, None

    def get_kv_connector_stats(self) -> KvcachedConnectorStats | None:
        """After each step (workers and the scheduler): the counters' gains since (vLLM sums them
        into its log and /metrics: stats.py)."""
        return interval(self.counters, self._reported)

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KvcachedConnectorStats:
        return KvcachedConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvcachedPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self.worker.close()
        else:
            self.link.close()
        log.info("[vllm] %s side counters: %s", self.role.name.lower(), self.counters)
