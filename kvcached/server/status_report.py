"""What the daemon's status says beyond its fields: the reasons it is degraded, what a client
over TCP is not shown, the summary line logged every --stats-interval-s, and the table
`kvcached status` prints."""
from __future__ import annotations

from ..logs import shown


def degraded(status: dict, lag: float) -> list[str]:
    """What keeps the daemon from serving fully, for operators. Only a stalled request
    loop makes `kvcached status` fail (exit 4: the health check's cue to restart it); a
    store that is down is not something a restart of the daemon mends."""
    out = [f"the request loop has not turned for {lag:.1f} s"] if status["stalled"] else []
    for tier in status.get("storage", []):
        if not tier.get("healthy", True):
            out.append(f"storage {tier['uri']} unhealthy: {tier.get('last_error') or 'down'}")
        elif tier.get("read_only"):  # (a disk tier's filesystem: served, nothing stored)
            out.append(f"storage {tier['uri']}: {tier.get('last_error')}")
    return out


def health(state: str, lag: float, stopping: bool, stall_s: float) -> tuple[bool, str]:
    """What `GET /health` on the metrics port answers (200 when True, else 503), with a line
    saying why: the daemon serves while its request loop turns (paused or clearing included);
    not when it is starting, stopping or its loop has not turned for stall_s (what a restart
    mends, as `kvcached status` exit 4). A store that is down does not fail it. No lock is taken: a probe
    costs the daemon nothing that copies wait on."""
    if stopping or state == "stopping":
        return False, "stopping"
    if state == "starting":
        return False, "starting"
    if lag > stall_s:
        return False, f"stalled: the request loop has not turned for {lag:.1f} s"
    return True, state


TCP_HIDDEN = "(not shown over tcp)"


def for_tcp_peer(status: dict) -> dict:
    """The status a client on a CURVE socket gets: the same counts, without what names the host's
    other clients and paths, or where the storage tiers are (`status` on the ipc socket, the
    status socket and `kvcached status` show it all). Applied before `degraded` is made from it."""
    out = {k: v for k, v in status.items() if k not in ("run_dir", "client_names")}
    if isinstance(out.get("kv"), dict) and out["kv"].get("owner") is not None:
        out["kv"] = {**out["kv"], "owner": TCP_HIDDEN}
    out["storage"] = [{**tier, "uri": tier["uri"].split(":", 1)[0] + "://" + TCP_HIDDEN,
                       "last_error": TCP_HIDDEN if tier.get("last_error") else "",
                       **({"primary": TCP_HIDDEN} if tier.get("primary") else {})}
                      for tier in status.get("storage", [])]
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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 or n == 0 else f"{n / 2**20:.1f} MiB"


def _pct(num: int, den: int) -> str:
    return f"{100.0 * num / den:.1f}%" if den else "-"


def format_status(s: dict) -> str:
    host, tasks, lookups = s["host"], s["tasks"], s.get("lookups", {})
    moved = s.get("bytes", {})
    io = s.get("storage_io", {})
    asked = lookups.get("keys", 0)
    served = lookups.get("loaded_from_host", 0) + lookups.get("loaded_from_storage", 0)
    rows = [
        ("instance", s["instance"]), ("pid", s["pid"]), ("epoch", f"{s['epoch']:x}"),
        ("state", s["state"]), ("protocol", ".".join(map(str, s["protocol_version"]))),
        ("device", s.get("device", "?")), ("uptime", f"{s.get('uptime_s', 0):.1f} s"),
        ("clients", f"{s['clients']}" + (f" ({', '.join(map(shown, s['client_names']))})"
                                         if s.get("client_names") else "")),
        ("kv registered", _kv_line(s["kv"])),
        ("host tier", f"{_gib(host['used_bytes'])} / {_gib(host['capacity_bytes'])} "
                      f"({host.get('blocks', 0)} blocks, {host.get('evictions', 0)} evicted)"),
        ("lookups", f"{lookups.get('lookups', 0)} asking {asked} blocks: host hit "
                    f"{_pct(lookups.get('host_hits', 0), asked)}, storage hit "
                    f"{_pct(lookups.get('storage_hits', 0), asked)}; "
                    f"{_pct(lookups.get('table_lookups', 0), lookups.get('lookups', 0))} from the key table"),
        ("key table", _key_table_line(s.get("key_table", {}))),
        *([("key events", _key_events_line(s["key_events"]))] if s.get("key_events", {}).get("followed") else []),
        ("loaded", f"{served} blocks: {lookups.get('loaded_from_host', 0)} from the host tier, "
                   f"{lookups.get('loaded_from_storage', 0)} brought in from storage"),
        ("moved", f"d2h {_gib(moved.get('d2h', 0))}  h2d {_gib(moved.get('h2d', 0))}  "
                  f"to storage {io.get('backups', 0)} blocks  from storage {io.get('fetched', 0)} blocks"),
        ("tasks", f"queued {tasks['queued']}  inflight {tasks['inflight']}"
                  + (f" ({tasks['parked']} waiting for a shared fetch)" if tasks.get("parked") else "")
                  + f"  completed {tasks['completed']}  failed {tasks['failed']}"),
        *([("copies", _copies_line(tasks["copy_phases"]))] if tasks.get("copy_phases") else []),
        *([("heartbeat", f"{s['heartbeat_late_beats']} beats late (over 0.25 s), the longest gap "
                         f"{s.get('heartbeat_max_gap_s', 0):.2f} s")] if s.get("heartbeat_late_beats") else []),
        *([("log", f"{s['log_lines_dropped']} lines dropped: stderr did not take them in time")]
          if s.get("log_lines_dropped") else []),
    ]
    for st in s["storage"]:
        used = (f"  {_gib(st['used_bytes'])} / {_gib(st['capacity_bytes'])}"
                if st.get("capacity_bytes") else "")
        flags = "".join(f"  {w.replace('_', ' ')}" for w in ("stuck", "full", "read_only", "clear_owed", "writes_held")
                        if st.get(w))
        flags += f"  {st['deletes_owed']} deletes owed" if st.get("deletes_owed") else ""
        flags += f"  {st['unlinks_left']} files left to remove" if st.get("unlinks_left") else ""
        # (a tier down - its root failing since the start - lists nothing: its error says why)
        flags += "" if st.get("ready", True) or not st["healthy"] else "  indexing"
        flags += f"  primary {st['primary']}" if st.get("primary") else ""  # (behind sentinels)
        err = f"  last error: {st['last_error']}" if st.get("last_error") else ""
        rows.append(("storage", f"{st['uri']}  {'healthy' if st['healthy'] else 'UNHEALTHY'}"
                                f"{used}{flags}{err}"))
    for reason in s.get("degraded", []):
        rows.append(("DEGRADED", reason))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _copies_line(phases: dict) -> str:
    """Per copied task, on average: waiting for the copy worker, queueing the copies (a load's
    plan and fence wait, the part before its first copy), until they landed; a load's first
    layer after its request."""
    parts = []
    for op, p in sorted(phases.items()):
        n = max(1, p["tasks"])
        first = f"first layer {p['first_layer_s'] / n * 1e3:.2f} ms, " if "first_layer_s" in p else ""
        prepare = (f" (plan and fence {p['prepare_s'] / n * 1e3:.2f})" if "prepare_s" in p else "")
        parts.append(f"{op} ({p['tasks']}): {first}wait {p['wait_s'] / n * 1e3:.2f} queue "
                     f"{p['queue_s'] / n * 1e3:.2f}{prepare} land {p['land_s'] / n * 1e3:.2f} ms")
    return "; ".join(parts) + " (a task's average)"


def _key_table_line(t: dict) -> str:
    if not t.get("enabled"):
        return f"off ({t['why']})" if t.get("why") else "off"
    if not t.get("segment"):
        return "none yet (made at the first register_kv)"
    refused = sum(t.get("refused", {}).values())
    return (f"{t['keys']} keys in {t['slots']} slots ({_gib(t['bytes'])}), "
            f"{' '.join(f for f in t['flags'] if f != 'open')}" + (f"; {refused} keys refused (full)" if refused else ""))


def _key_events_line(e: dict) -> str:
    """The changes followers are told (key_events): the numbers kept, the gaps given."""
    voids = e.get("voids", {})
    kept = e["newest"] - e["oldest"] + 1
    return (f"followed, {e['newest']} told, the last {kept} kept (of {e['capacity']}); gaps: "
            f"{voids.get('host', 0)} for everyone (a new geometry), {voids.get('storage', 0)} for "
            "storage readers (a disk cleared, or that stopped or started answering)")


def _kv_line(kv: dict) -> str:
    if not kv["registered"]:
        return "no"
    engines = kv.get("engines", 1)
    layout = shown(kv.get("kv_layout") or "")
    layout = f"; layout {layout if len(layout) <= 72 else layout[:69] + '...'}" if layout else ""
    return (f"yes ({engines} engine{'s' if engines != 1 else ''}' host pools, " if engines > 1 else "yes (") + \
        f"copy strategy {kv.get('copy_strategy') or '?'}{layout})"
