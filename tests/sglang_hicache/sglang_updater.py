"""SGLang's own scheduler weight updater (`SchedulerWeightUpdaterManager`), driven as its
scheduler drives it. What it reaches beyond itself stands in here: the model runner that loads
the weights (it says it did), and the part of the scheduler a weight update touches. The
scheduler's `record_weight_version_change` is SGLang's own, and `flush_cache` does what the
scheduler's does to the host pool (`tree_cache.reset()` clears it)."""
from __future__ import annotations

from types import SimpleNamespace

import torchvision_standin

torchvision_standin.install()  # before SGLang's scheduler imports

from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager  # noqa: E402


class SchedulerStandIn:
    """The part of SGLang's Scheduler a weight update reaches, with no request in flight."""
    waiting_queue: list = []
    chunked_req = None
    hisparse_coordinator = None
    record_weight_version_change = Scheduler.record_weight_version_change

    def __init__(self, pool):
        self.pool = pool
        self.flushes = 0

    def collect_inflight_reqs(self) -> set:
        return set()

    def flush_cache(self, empty_cache: bool = True) -> bool:
        self.flushes += 1
        self.pool.clear()
        return True


def updater(pool, group=None) -> SchedulerWeightUpdaterManager:
    """SGLang's weight updater of a scheduler whose host pool is `pool` (its TP CPU group
    `group`), with a model runner whose weight loads succeed."""
    loads = SimpleNamespace(update_weights_from_disk=lambda *a, **k: (True, "loaded"))
    runner = SimpleNamespace(weight_updater=loads)
    scheduler = SchedulerStandIn(pool)
    mgr = object.__new__(SchedulerWeightUpdaterManager)  # its __post_init__ asks SGLang's
    fields = dict(tp_worker=SimpleNamespace(weight_update_runners=lambda: [("target", runner)]),
                  draft_worker=None, memory_saver_adapter=None, flush_cache=scheduler.flush_cache,
                  is_fully_idle=lambda **_: True, scheduler=scheduler, metrics_collector=None,
                  offload_tags=set(), stashed_model_static_state=None, _session=None,
                  tp_cpu_group=group)  # parallel state for the group; it is given here
    for name, value in fields.items():
        setattr(mgr, name, value)
    return mgr


def update_from_disk(mgr, version: str | None = None, flush: bool = True):
    """POST /update_weights_from_disk, as it reaches the scheduler."""
    out = mgr.update_weights_from_disk(UpdateWeightFromDiskReqInput(
        model_path="test-org/test-model-step", weight_version=version, flush_cache=flush))
    assert out.success, out.message
    return out
