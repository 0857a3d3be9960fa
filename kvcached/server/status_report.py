"""What the daemon's status says beyond its fields: the reasons it is degraded, and the summary
line logged every --stats-interval-s."""
from __future__ import annotations


def degraded(status: dict, lag: float) -> list[str]:
    """What keeps the daemon from serving fully, for operators. Only a stalled request
    loop makes `kvcached status` fail (exit 4: the health check's cue to restart it); a
    store that is down is not something a restart of the daemon mends."""
    out = [f"the request loop has not turned for {lag:.1f} s"] if status["stalled"] else []
    for tier in status.get("storage", []):
        if not tier.get("healthy", True):
            out.append(f"storage {tier['uri']} unhealthy: {tier.get('last_error') or 'down'}")
    return out


def stats_line(s: dict) -> str:
    """One summary line for the log (every --stats-interval-s at INFO)."""
    host, tasks, lookups = s["host"], s["tasks"], s.get("lookups", {})
    asked = lookups.get("keys", 0)
    hit = 100.0 * lookups.get("host_hits", 0) / asked if asked else 0.0
    host_loads, storage_loads = lookups.get("loaded_from_host", 0), lookups.get("loaded_from_storage", 0)
    return (f"clients={s['clients']} host={host['used_bytes'] / 2**30:.2f}/"
            f"{host['capacity_bytes'] / 2**30:.2f}GiB blocks={host.get('blocks', 0)} "
            f"tasks completed={tasks['completed']} failed={tasks['failed']} queued={tasks['queued']} "
            f"lookup_host_hit={hit:.1f}% loaded_host={host_loads} loaded_storage={storage_loads} d2h={s['bytes']['d2h']} h2d={s['bytes']['h2d']} "
            f"storage_healthy={all(t.get('healthy') for t in s['storage'])}")
