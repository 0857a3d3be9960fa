"""The faults bench's flood phase: each flood of flood.py and handshake_flood.py against the
bench's daemon (the handshake flood against one of its own), its figures into the bench's
result, a dead daemon or an engine's op refused for another's flood counted as lost; the
daemon's life checked before each, so that a failed run names the flood it died in."""
from __future__ import annotations


from .flood import blocking_flood, connection_flood, frame_flood, metrics_flood
from .handshake_flood import handshake_flood


def floods(d, c, metrics_port: int, quick: bool, counts, out) -> None:
    for kind in ("junk", "layout", "notes", "status", "unread"):
        alive(d, f"the {kind} flood")
        r = frame_flood(d, kind, flooders=2, seconds=2 if quick else 8)
        counts["faults_injected"] += 1
        for k in ("frames_sent", "ping_idle_p99_ms", "ping_p50_ms", "ping_p99_ms", "ping_max_ms",
                  "rss_growth_mib") + (("unread_closed",) if kind == "unread" else ()):
            out[f"flood_{kind}_{k}"] = r[k]
    alive(d, "the wide junk flood")
    r = frame_flood(d, "junk", flooders=4, seconds=2 if quick else 8, sockets=32)
    counts["faults_injected"] += 1
    out.update({f"flood_wide_{k}": r[k] for k in ("frames_sent", "ping_p50_ms", "ping_p99_ms",
                                                   "rss_before_mib", "rss_peak_mib", "rss_after_mib")})
    alive(d, "the delete flood")
    r = blocking_flood(d, c, seconds=3 if quick else 8)
    counts["faults_injected"] += 1
    counts["lost"] += r["engine_refused"]  # the engine's own op refused for another's flood
    out.update({f"delete_flood_{k}": r[k] for k in ("flood_deletes_done", "flood_deletes_busy",
                                                     "engine_deletes", "engine_refused",
                                                     "engine_delete_p50_ms", "engine_delete_max_ms")})
    r = handshake_flood(flooders=2, seconds=3 if quick else 8)  # a daemon of its own (TCP)
    counts["faults_injected"] += 1
    counts["lost"] += not r["daemon_alive"]
    out.update({f"handshake_flood_{k}": v for k, v in r.items() if k != "daemon_alive"})
    alive(d, "the connection flood (the handshake flood before it has a daemon of its own)")
    r = connection_flood(d)
    counts["faults_injected"] += 1
    counts["lost"] += not r["daemon_alive"]
    out.update({f"conn_flood_{k}": r[k] for k in ("connections_tried", "open_during", "refused",
                                                   "newcomer_connect_ms")})
    alive(d, "the metrics flood")
    r = metrics_flood(d, metrics_port, seconds=2 if quick else 8)
    counts["faults_injected"] += 1
    counts["lost"] += not r["daemon_alive"]
    out.update({f"metrics_flood_{k}": r[k] for k in ("scrapes_answered", "scrapes_failed",
                                                      "ping_idle_p99_ms", "ping_p50_ms", "ping_p99_ms",
                                                      "threads_before", "threads_during")})


def alive(d, what: str) -> None:
    """Before `what`: the daemon lives, or the bench stops naming the phase it died before."""
    if not d.alive():
        raise RuntimeError(f"the daemon died before {what} (exit status {d.proc.returncode})")
