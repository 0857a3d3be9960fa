"""The connector's counters in vLLM's own telemetry: vLLM's KVConnectorLogging (its periodic "KV
Transfer metrics" line) and KVConnectorProm (/metrics) built from the connector's class, as
vLLM's loggers build them. Runs in .venv-vllm (./scripts/test.sh --with-vllm)."""
from __future__ import annotations

import functools
import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: ./scripts/test.sh --with-vllm")

from vllm_configs import vllm_config  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from vllm_model import write_model  # noqa: E402

from kvcached_client.vllm.stats import COUNTED, interval  # noqa: E402


def test_each_step_reports_what_its_counters_gained():
    counters, reported = dict.fromkeys(COUNTED, 0), {}
    assert interval(counters, reported) is None  # nothing yet: no report
    counters.update(loaded_blocks=14, saved_blocks=15)
    first = interval(counters, reported)
    assert first.data["loaded_blocks"] == 14 and first.data["saved_blocks"] == 15
    assert interval(counters, reported) is None  # reported once
    counters["load_errors"] += 2
    assert interval(counters, reported).data == dict(dict.fromkeys(COUNTED, 0), load_errors=2)


def test_vllms_log_line_and_prometheus_counters_sum_the_reports(tmp_path):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1 import metrics

    config = vllm_config(write_model(str(tmp_path / "model")))
    reports = [{"loaded_blocks": 14, "saved_blocks": 15}, {"loaded_blocks": 3, "load_errors": 1},
               {"stale_blocks": 6}]
    logging = metrics.KVConnectorLogging(config.kv_transfer_config)
    for data in reports:
        logging.observe(data)
    lines = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: loaded_blocks=17, load_errors=1, saved_blocks=15, "
                     "save_skipped_blocks=0, daemon_errors=0, stale_blocks=6"]

    registry = CollectorRegistry()
    own = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = type("Prom", (metrics.KVConnectorProm,),
                {"_counter_cls": own[Counter], "_gauge_cls": own[Gauge], "_histogram_cls": own[Histogram]})
    exported = prom(config, ["engine"], {0: ["0"], 1: ["1"]})
    for data in reports:
        exported.observe(data, 0)
    exported.observe({"loaded_blocks": 5}, 1)
    text = generate_latest(registry).decode()
    assert 'vllm:kvcached_loaded_blocks_total{engine="0"} 17.0' in text
    assert 'vllm:kvcached_loaded_blocks_total{engine="1"} 5.0' in text
    assert 'vllm:kvcached_stale_blocks_total{engine="0"} 6.0' in text
    assert 'vllm:kvcached_load_errors_total{engine="0"} 1.0' in text
