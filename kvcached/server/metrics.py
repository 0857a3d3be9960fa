"""Prometheus metrics on `--metrics-port` (off by default), label `instance` on every series.

Counters and gauges are read from the daemon's status snapshot at scrape time (nothing on the
data path); task latencies are a histogram observed when each task ends. The HTTP side is
metrics_http.MetricsServer (one thread, bounded; a rendering shared for MIN_RENDER_S).

    kvcached_bytes_moved_total{direction="d2h"|"h2d",tier="host"}     counter
    kvcached_storage_bytes_total{direction="put"|"get"}               counter (blocks x page bytes)
    kvcached_task_duration_seconds{op="load"|"offload"|"prefetch"|...}  histogram
    kvcached_tasks_total{status="completed"|"failed"|"cancelled"}     counter
    kvcached_copy_phase_seconds_total{op="offload"|"load",phase="wait"|"queue"|"land"}  counter
                                  (completed copies: waiting for the copy worker, the CPU queueing
                                  the copies, then until they landed; per task: divided by
                                  kvcached_copy_tasks_total{op})
    kvcached_load_first_layer_seconds_total                            counter (completed loads:
                                  from the request to their first layer counted; per load:
                                  divided by kvcached_copy_tasks_total{op="load"})
    kvcached_hit_blocks_total{tier="host"|"storage"}                  counter (x block tokens = tokens)
    kvcached_lookup_blocks_total                                       counter
    kvcached_loaded_blocks_total{source="host"|"storage"}             counter (what loads served:
                                  from the host tier, or brought in from storage for them)
    kvcached_evictions_total{tier="host"|"disk"}                      counter
    kvcached_storage_errors_total{uri}                                 counter
    kvcached_storage_healthy{uri}                                      gauge
    kvcached_storage_failovers_total{uri}                              counter (Redis behind
                                  Sentinel or in a cluster: new primaries and epoch rises seen)
    kvcached_storage_restarts_total{uri}                               counter (a Redis server,
                                  Sentinel's or a cluster's primary seen with a new run_id)
    kvcached_storage_owed{uri,what="deletes"|"clear"|"unlinks"}        gauge (work a tier owes:
                                  deletes and a clear not done yet, files a disk tier's unlinks
                                  left; an alert on one that stays above 0 finds a store that
                                  cannot delete)
    kvcached_storage_lookups_cut_total{uri}                            counter (requests that asked
                                  a remote tier for its `lookup_keys` and had more)
    kvcached_key_event_gaps_total{readers="all"|"storage"}            counter (the gaps key_events
                                  gave its followers: a new geometry, for everyone; a disk cleared
                                  or that stopped or started answering, for storage readers)
    kvcached_queue_depth                                               gauge
    kvcached_host_bytes_used / kvcached_host_bytes_capacity            gauges
    kvcached_clients                                                   gauge
    kvcached_heartbeat_late_total                                      counter (beats later than
                                  0.25 s: the daemon starved or held; engines call it hung at 2 s)
    kvcached_heartbeat_max_gap_seconds                                 gauge (the longest since start)
    kvcached_log_lines_dropped_total                                   counter (lines stderr did not
                                  take in time: logs.py)
"""
from __future__ import annotations

import logging
from typing import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from .metrics_http import MetricsServer

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class StatusCollector:
    def __init__(self, instance: str, snapshot: Callable[[], dict]):
        self.instance = instance
        self.snapshot = snapshot

    def _family(self, cls, name, doc, labels=()):
        return cls(name, doc, labels=["instance", *labels])

    def collect(self):
        s = self.snapshot()
        i = self.instance
        fam = self._family
        moved = fam(CounterMetricFamily, "kvcached_bytes_moved", "Bytes copied between device and host",
                    ["direction", "tier"])
        for direction, n in s.get("bytes", {}).items():
            moved.add_metric([i, direction, "host"], n)
        yield moved
        io = s.get("storage_io", {})
        page = s["kv"].get("page_bytes", 0)
        st_bytes = fam(CounterMetricFamily, "kvcached_storage_bytes", "Bytes moved to and from storage",
                       ["direction"])
        st_bytes.add_metric([i, "put"], io.get("backups", 0) * page)
        st_bytes.add_metric([i, "get"], io.get("fetched", 0) * page)
        yield st_bytes
        tasks = fam(CounterMetricFamily, "kvcached_tasks", "Tasks ended, by status", ["status"])
        for status in ("completed", "failed", "cancelled"):
            tasks.add_metric([i, status], s["tasks"].get(status, 0))
        yield tasks
        yield from self._copy_phases(s["tasks"].get("copy_phases", {}))
        lookups = s.get("lookups", {})
        hits = fam(CounterMetricFamily, "kvcached_hit_blocks", "Leading blocks found by lookups", ["tier"])
        hits.add_metric([i, "host"], lookups.get("host_hits", 0))
        hits.add_metric([i, "storage"], lookups.get("storage_hits", 0))
        yield hits
        asked = fam(CounterMetricFamily, "kvcached_lookup_blocks", "Blocks asked for by lookups")
        asked.add_metric([i], lookups.get("keys", 0))
        yield asked
        loaded = fam(CounterMetricFamily, "kvcached_loaded_blocks", "Blocks loads served, by where "
                     "they were", ["source"])
        loaded.add_metric([i, "host"], lookups.get("loaded_from_host", 0))
        loaded.add_metric([i, "storage"], lookups.get("loaded_from_storage", 0))
        yield loaded
        gaps = fam(CounterMetricFamily, "kvcached_key_event_gaps", "Gaps key_events gave its "
                   "followers (vLLM's KV events for a router), by the readers told", ["readers"])
        voids = s.get("key_events", {}).get("voids", {})
        gaps.add_metric([i, "all"], voids.get("host", 0))
        gaps.add_metric([i, "storage"], voids.get("storage", 0))
        yield gaps
        late = fam(CounterMetricFamily, "kvcached_heartbeat_late", "Heartbeats later than 0.25 s "
                   "(engines call a daemon hung when one is 2 s late)")
        late.add_metric([i], s.get("heartbeat_late_beats", 0))
        yield late
        dropped = fam(CounterMetricFamily, "kvcached_log_lines_dropped", "Log lines dropped: "
                      "stderr did not take them in time (a pipe nobody reads, a blocking log driver)")
        dropped.add_metric([i], s.get("log_lines_dropped", 0))
        yield dropped
        yield from self._tiers(s)
        for name, doc, value in (
            ("kvcached_queue_depth", "Tasks queued", s["tasks"].get("queued", 0)),
            ("kvcached_host_bytes_used", "Host tier bytes in use", s["host"]["used_bytes"]),
            ("kvcached_host_bytes_capacity", "Host tier capacity", s["host"]["capacity_bytes"]),
            ("kvcached_clients", "Connected clients", s.get("clients", 0)),
            ("kvcached_heartbeat_max_gap_seconds", "The longest gap between heartbeats since start",
             s.get("heartbeat_max_gap_s", 0.0)),
        ):
            g = fam(GaugeMetricFamily, name, doc)
            g.add_metric([i], value)
            yield g

    def _tiers(self, s: dict):
        """Evictions (host, disk) and each storage tier's errors, health, failovers, restarts,
        lookups cut and owed work."""
        fam, i = self._family, self.instance
        evictions = fam(CounterMetricFamily, "kvcached_evictions", "Blocks evicted", ["tier"])
        evictions.add_metric([i, "host"], s["host"].get("evictions", 0))
        errors = fam(CounterMetricFamily, "kvcached_storage_errors", "Storage errors", ["uri"])
        healthy = fam(GaugeMetricFamily, "kvcached_storage_healthy", "1 when the tier answers", ["uri"])
        failovers = fam(CounterMetricFamily, "kvcached_storage_failovers",
                        "Failovers a tier saw (a new primary, a cluster's epoch risen)", ["uri"])
        restarts = fam(CounterMetricFamily, "kvcached_storage_restarts",
                       "Restarts a tier saw its server make (a new Redis run_id)", ["uri"])
        cut = fam(CounterMetricFamily, "kvcached_storage_lookups_cut",
                  "Requests that asked a remote tier for its lookup_keys and had more", ["uri"])
        owed = fam(GaugeMetricFamily, "kvcached_storage_owed",
                   "Work a tier owes: deletes, a clear (1), files its unlinks left", ["uri", "what"])
        for tier in s.get("storage", []):
            for what, key in (("deletes", "deletes_owed"), ("clear", "clear_owed"), ("unlinks", "unlinks_left")):
                if key in tier:
                    owed.add_metric([i, tier["uri"], what], int(tier[key] or 0))
            if "lookups_cut" in tier:
                cut.add_metric([i, tier["uri"]], tier["lookups_cut"])
            if "failovers" in tier:
                failovers.add_metric([i, tier["uri"]], tier["failovers"])
            if "restarts" in tier:
                restarts.add_metric([i, tier["uri"]], tier["restarts"])
            if "evicted" in tier:
                evictions.add_metric([i, "disk"], tier["evicted"])
            errors.add_metric([i, tier["uri"]], sum(tier.get(k, 0) or 0 for k in
                                                    ("errors", "put_errors", "corrupt", "dropped_puts",
                                                     "io_errors")))
            healthy.add_metric([i, tier["uri"]], 1 if tier.get("healthy") else 0)
        return evictions, errors, healthy, failovers, restarts, cut, owed

    def _copy_phases(self, copy_phases: dict):
        i = self.instance
        phases = self._family(CounterMetricFamily, "kvcached_copy_phase_seconds",
                              "Completed copy tasks' time: waiting for the copy worker, queueing "
                              "the copies, until they landed", ["op", "phase"])
        copied = self._family(CounterMetricFamily, "kvcached_copy_tasks",
                              "Completed copy tasks the phases count", ["op"])
        first = self._family(CounterMetricFamily, "kvcached_load_first_layer_seconds",
                             "Completed loads' time from the request to their first layer "
                             "counted (what an engine waiting layer by layer waits before it)")
        for op, p in copy_phases.items():
            for phase in ("wait", "queue", "land"):
                phases.add_metric([i, op, phase], p[f"{phase}_s"])
            copied.add_metric([i, op], p["tasks"])
        first.add_metric([i], copy_phases.get("load", {}).get("first_layer_s", 0.0))
        return phases, copied, first


class Metrics:
    def __init__(self, instance: str, snapshot: Callable[[], dict], port: int, addr: str,
                 health: Callable[[], tuple[bool, str]] | None = None):
        self.registry = CollectorRegistry()
        self.registry.register(StatusCollector(instance, snapshot))
        self.latency = Histogram("kvcached_task_duration_seconds", "Task latency from request to end",
                                 ["instance", "op"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self.instance = instance
        self._server = None
        if port:  # our own server (metrics_http: bounded), not prometheus_client's
            self._server = MetricsServer(addr, port, self.render, self.format_of, health)
            log.info("[metrics] serving /metrics%s on http://%s:%d",
                     " and /health" if health is not None else "", addr, port)

    @staticmethod
    def format_of(accept: str) -> str:
        """The format (content type) a scraper's Accept header gets."""
        return choose_encoder(accept)[1]

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition in the format the scraper accepts (text, or OpenMetrics)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def observe(self, op: str, seconds: float) -> None:
        self.latency.labels(self.instance, op).observe(seconds)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
