"""What the vLLM connector checks at start-up (connector.py): the KV cache groups and the
parallelism it can page correctly (others are refused by name), the daemon of each rank, and
how the workers split their blocks (their handshakes)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

log = logging.getLogger("kvcached_client.vllm.connector")  # the connector's logger, as before the split


KEPT_WHOLE = {"FullAttentionSpec", "MLAAttentionSpec"}  # vLLM keeps a running request's blocks


def check_one_kv_cache_group(kv_cache_config) -> None:
    """The connector pages the block ids of one KV cache group (`get_block_ids()[0]`) in every
    layer. A model with several (cross-attention, Mamba state or layers of another spec in
    groups of their own, each numbering its blocks apart) is refused by name: group 0's ids
    in another group's layers would be wrong KV, saved and served. So is one group of sliding-
    window, chunked-local or other attention whose blocks vLLM frees while the request runs: a
    save (asynchronous) could read a block vLLM already gave to another request."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:  # an older vLLM that hands the connector no config
        return
    if len(groups) == 1:
        spec = groups[0].kv_cache_spec
        specs = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]  # uniform-type groups
        kinds = sorted({type(s).__name__ for s in specs} - KEPT_WHOLE)
        if kinds:
            raise ValueError(f"KvcachedConnector pages full attention only; this model's KV is "
                             f"{', '.join(kinds)}: vLLM frees such blocks while their request runs "
                             "(outside its window), under a save still reading them: run it "
                             "without the connector")
        return
    if not groups:
        raise ValueError("KvcachedConnector: this model has no KV cache (attention-free); "
                         "there is nothing for kvcached to keep: run it without the connector")
    kinds = "; ".join(f"{type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)"
                      for g in groups)
    raise ValueError(f"KvcachedConnector pages one KV cache group; this model has {len(groups)} "
                     f"({kinds}), each with block ids of its own: run it without the connector")


def check_parallelism(parallel) -> None:
    """Refuse what the connector cannot page correctly, at start. Pipeline parallelism: a rank
    holds some layers only. Context parallelism (decode or prefill): a rank holds some of each
    block's tokens. Micro-batching (`--enable-dbo`, `ubatch_size` > 1): each
    micro-batch runs every attention layer on a thread and CUDA stream of its own, so a layer's
    load would be waited for on the first micro-batch's stream only, and the second could read
    KV still on its way - wrong KV, silently."""
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("KvcachedConnector does not run with pipeline parallelism")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) > 1:  # each rank holds a share of a block's
            # tokens, and MLA's ranks no longer hold the same KV: its shared keys would be wrong
            raise ValueError(f"KvcachedConnector does not run with context parallelism ({name} "
                             f"{getattr(parallel, name)}: each rank holds a share of every block's "
                             "tokens); run without it")
    if getattr(parallel, "enable_dbo", False) or int(getattr(parallel, "ubatch_size", 0) or 0) > 1:
        raise ValueError("KvcachedConnector does not run with micro-batching (enable_dbo or "
                         "ubatch_size > 1: each micro-batch reads the KV on a CUDA stream of its "
                         "own, which the connector's layer waits do not cover); run without it")


def rank_instances(extra: dict, tp_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[str]:
    """The daemon of every tensor-parallel rank, from kv_connector_extra_config. "{dp_rank}" in
    a name is this engine's data-parallel rank (vLLM's DP: one engine per DP rank, each on GPUs
    of its own, so on one host each needs daemons of its own)."""
    if "instances" in extra:
        instances = [str(i).replace("{dp_rank}", str(dp_rank)) for i in extra["instances"]]
        if len(instances) != tp_size:
            raise ValueError(f"kv_connector_extra_config instances lists {len(instances)} daemons "
                             f"for tensor_parallel_size {tp_size}: one per rank")
    else:
        instance = str(extra.get("instance", "default")).replace("{dp_rank}", str(dp_rank))
        if tp_size > 1 and "{rank}" not in instance:
            raise ValueError(f"tensor_parallel_size {tp_size} needs one kvcached daemon per rank: "
                             "give kv_connector_extra_config 'instances' (by rank) or an "
                             "'instance' with {rank} in it")
        instances = [instance.replace("{rank}", str(r)) for r in range(tp_size)]
    template = str(extra.get("instance", "")) + "".join(str(i) for i in extra.get("instances", ()))
    if dp_size > 1 and "{dp_rank}" not in template:
        log.warning("[vllm] data_parallel_size %d: every DP rank uses daemon(s) %s; on one host "
                    "each DP rank's GPUs need daemons of their own: put {dp_rank} in the "
                    "instance name", dp_size, ", ".join(instances))
    return instances


@dataclass
class KvcachedHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler once its KV is registered (vLLM hands it over before the
    first request): the keys of its blocks depend on how it splits them into kernel blocks."""
    kernel_factor: int
    mode: str


def agreed_kernel_factor(metadata: dict) -> int | None:
    """The workers' kernel blocks per block, from their handshakes (1 where none came: a worker
    splitting its blocks then only misses); None where ranks differ (nothing can hit)."""
    factors = {m.kernel_factor for m in metadata.values() if isinstance(m, KvcachedHandshake)}
    return factors.pop() if len(factors) == 1 else (None if factors else 1)


def check_multi_connector_policy(own) -> None:
    """Inside vLLM's MultiConnector the scheduler takes kv_load_failure_policy from the
    MultiConnector's config, which the connector's scheduler side cannot reach (it sees only its
    own sub-config): under vLLM's default, "fail", a load the daemon could not finish fails its
    request instead of being recomputed. Said at start, from a worker (which sees the engine's
    config), with the key to set."""
    from vllm.config import get_current_vllm_config_or_none

    top = getattr(get_current_vllm_config_or_none(), "kv_transfer_config", None)
    if top is None or top is own or top.kv_connector != "MultiConnector":
        return
    if top.kv_load_failure_policy != "recompute":
        log.warning("[vllm] KvcachedConnector runs inside a MultiConnector whose "
                    "kv_load_failure_policy is %r: a load the daemon cannot finish (a daemon "
                    "restarted, hung or gone) fails its request instead of being recomputed; "
                    "set \"kv_load_failure_policy\": \"recompute\" in the MultiConnector's own "
                    "kv-transfer-config", top.kv_load_failure_policy)


def handshakes_heard(metadata: dict) -> int | None:
    """The scheduler's kernel factor from the workers' handshakes (agreed_kernel_factor), said
    in the log: the workers' modes, ranks that disagree (no hits), or a handshake that is another
    connector's (vLLM's MultiConnector passes only the first sub-connector's that has one)."""
    factor = agreed_kernel_factor(metadata)
    if metadata and not any(isinstance(m, KvcachedHandshake) for m in metadata.values()):
        log.warning("[vllm] the workers' handshake is another connector's (a MultiConnector "
                    "passes the first one's only): kvcached assumes its workers do not split "
                    "blocks into kernel blocks; a worker that does gives no hits")
    elif factor is None:
        log.error("[vllm] the workers split their KV blocks differently (%s): kvcached gives "
                  "no hits", {r: getattr(m, "kernel_factor", "?") for r, m in metadata.items()})
    else:
        log.info("[vllm] workers registered their KV: %s, %d kernel block(s) per block",
                 {rank: getattr(m, "mode", "?") for rank, m in sorted(metadata.items())}, factor)
    return factor
