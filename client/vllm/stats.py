"""The vLLM workers' connector counters in vLLM's own telemetry: its periodic "KV Transfer
metrics" log line and Prometheus counters on the server's /metrics.

Each worker, and the scheduler, reports what changed since its last report (`interval`) after
every step; vLLM sums the reports, then the steps' until it logs, and adds each to the counters
`vllm:kvcached_<name>_total` (summed over tensor-parallel ranks: a 14-block hit on 2 ranks
counts 28 loaded blocks; the scheduler's failed lookups count in daemon_errors, its stale
blocks in stale_blocks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTED = {
    "loaded_blocks": "Blocks loaded from the kvcached daemon into vLLM's KV cache.",
    "load_errors": "Blocks whose load failed (vLLM recomputed them).",
    "saved_blocks": "Blocks stored to the kvcached daemon.",
    "save_skipped_blocks": "Blocks not stored (the daemon already had them, or was full).",
    "daemon_errors": "Calls to the kvcached daemon that failed (gone, hung or refused).",
    "stale_blocks": "Blocks not stored: computed on KV of older weights or an older adapter.",
}


@dataclass
class KvcachedConnectorStats(KVConnectorStats):
    """Counts over an interval, by COUNTED's names."""

    def __post_init__(self):
        self.data = {name: int(self.data.get(name, 0)) for name in COUNTED}

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTED, 0)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTED:
            self.data[name] += int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)


def interval(counters: dict, reported: dict) -> KvcachedConnectorStats | None:
    """What `counters` gained since `reported` (then brought up to them); None for nothing."""
    gained = {name: counters.get(name, 0) - reported.get(name, 0) for name in COUNTED}
    if not any(gained.values()):
        return None
    reported.update({name: counters.get(name, 0) for name in COUNTED})
    return KvcachedConnectorStats(data=gained)


class KvcachedPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvcached_<name>` counters, one per engine (vLLM's engine label)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:kvcached_{name}", documentation=doc,
                                    labelnames=labelnames)
            for name, doc in COUNTED.items()}
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            if name in COUNTED and value:
                key = (engine_idx, name)
                if key not in self._children:
                    self._children[key] = self._counters[name].labels(
                        *self.per_engine_labelvalues[engine_idx])
                self._children[key].inc(value)
