"""The vLLM connector's scheduler side built under vLLM's own config objects (VllmConfig,
ModelConfig, SpeculativeConfig, KVTransferConfig), as vLLM's engine core builds it, for tests
that need no engine (.venv-vllm)."""
from __future__ import annotations

from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvcached_client.vllm.connector import KvcachedConnector


def vllm_config(model_dir: str, instance: str = "unused", run_dir: str = "/nonexistent",
                block_size: int = 16, data_parallel_size: int = 1, **spec) -> VllmConfig:
    """vLLM's config of a model checkpoint with the KvcachedConnector; `spec`: a
    SpeculativeConfig's arguments (method, model, ...), none for no speculative decoding."""
    target, parallel = ModelConfig(model=model_dir), ParallelConfig(data_parallel_size=data_parallel_size)
    speculative = None
    if spec:
        speculative = SpeculativeConfig(num_speculative_tokens=2, target_model_config=target,
                                        target_parallel_config=parallel, **spec)
    transfer = KVTransferConfig(kv_connector="KvcachedConnector", kv_role="kv_both",
                                kv_connector_module_path="kvcached_client.vllm.connector",
                                kv_connector_extra_config={"instance": instance, "run_dir": run_dir})
    return VllmConfig(model_config=target, parallel_config=parallel,
                      cache_config=CacheConfig(block_size=block_size),
                      speculative_config=speculative, kv_transfer_config=transfer)


def scheduler_connector(model_dir: str, instance: str = "unused", run_dir: str = "/nonexistent",
                        block_size: int = 16, **spec) -> KvcachedConnector:
    """The scheduler-side connector of a model checkpoint (vllm_config's arguments)."""
    return KvcachedConnector(vllm_config(model_dir, instance, run_dir, block_size, **spec),
                             KVConnectorRole.SCHEDULER, None)
