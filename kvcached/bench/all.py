"""`kvcached bench all`: every benchmark in one run, one JSON with every ratio, the machine and
the date. `python scripts/perf_table.py FILE` turns it into docs/performance.md's table."""
from __future__ import annotations

import datetime
import os
import platform

import torch

from . import disk_index, ipc, storage, transfer

# the public Mooncake trace the tests carry (a checkout's; an installed wheel has none: --trace)
DEFAULT_TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data",
                             "mooncake_synthetic_trace.jsonl")


def machine() -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            mem_kb = int(f.readline().split()[1])
    except OSError:
        mem_kb = 0
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def run(quick: bool = False, trace: str | None = None, **_) -> dict:
    from ..tools import replay

    out = {"bench": "all", "date": datetime.date.today().isoformat(), "machine": machine()}
    out["ipc"] = ipc.run(quick=quick)
    out["transfer"] = transfer.run(quick=quick)
    out["storage"] = storage.run(quick=quick)
    out["disk_index"] = disk_index.run(quick=quick)
    trace = trace or DEFAULT_TRACE
    if os.path.exists(trace):
        results = replay.run(trace, [1_000_000, 3_000_000, 10_000_000], ["lru", "s2lru"])
        daemon = replay.run(trace, [1_000_000], ["lru"], through_daemon=True)
        out["replay"] = {"trace": trace, "results": [r.as_dict() for r in results],
                         "through_daemon_ops_per_s": round(daemon[0].ops_per_s)}
    else:
        out["replay"] = {"skipped": f"trace {trace} not found (--trace)"}
    return out


def format_result(r: dict) -> str:
    parts = []
    for name in ("ipc", "transfer", "storage", "disk_index"):
        mod = {"ipc": ipc, "transfer": transfer, "storage": storage, "disk_index": disk_index}[name]
        parts.append(f"== {name}\n{mod.format_result(r[name])}")
    rep = r["replay"]
    if "results" in rep:
        lines = [f"{x['policy']:>6} @ {x['capacity_tokens']:>10,}: {100 * x['hit_rate']:.2f}%"
                 for x in rep["results"]]
        lines.append(f"through the daemon: {rep['through_daemon_ops_per_s']:,} block ops/s")
        parts.append("== replay\n" + "\n".join(lines))
    else:
        parts.append(f"== replay\n{rep['skipped']}")
    return "\n\n".join(parts)
