"""Print docs/performance.md's table (markdown) from the JSON of `kvcached bench all --json`."""
from __future__ import annotations

import json
import sys


def _step_rows(st: dict | None) -> list:
    """`kvcached bench ipc`'s step of 8 loads, one by one against load_batch (since 2026-11-27)."""
    if st is None:
        return []
    rows = [("a step's 8 loads of 8 host hits, to the last reply, p50", "`kvcached bench ipc`",
             f"{st['batch']['p50_us']:.1f} µs (load_batch)", f"one by one {st['one_by_one']['p50_us']:.1f} µs",
             st["p50_ratio"], "—")]
    if "layer0_p50_ratio" in st:
        rows.append(("a step's 8 loads, to layer 0 of every load, p50", "`kvcached bench ipc`",
                     f"{st['batch_layer0']['p50_us']:.1f} µs (load_batch)",
                     f"one by one {st['one_by_one_layer0']['p50_us']:.1f} µs", st["layer0_p50_ratio"], "—"))
    return rows


def table(r: dict) -> str:
    m = r["machine"]
    ipc, tr, st, idx = r["ipc"]["results"], r["transfer"], r["storage"]["results"], r["disk_index"]
    rows = [
        ("ping round trip, p50", "`kvcached bench ipc`", f"{ipc['ping']['daemon']['p50_us']:.1f} µs",
         f"bare pyzmq echo {ipc['ping']['bare_echo']['p50_us']:.1f} µs", ipc["ping"]["p50_ratio"], "≤ 1.5"),
        ("64-key lookup round trip, p50", "`kvcached bench ipc`",
         f"{ipc['lookup64']['daemon']['p50_us']:.1f} µs",
         f"bare echo {ipc['lookup64']['bare_echo']['p50_us']:.1f} µs", ipc["lookup64"]["p50_ratio"], "≤ 1.5"),
        *([("64-block load of host hits, request to reply, p50", "`kvcached bench ipc`",
            f"{ipc['load64']['daemon']['p50_us']:.1f} µs",
            f"bare echo {ipc['load64']['bare_echo']['p50_us']:.1f} µs", ipc["load64"]["p50_ratio"], "—")]
          if "load64" in ipc else []),
        *_step_rows(r["ipc"].get("step_loads")),
        *([("64-key lookup from the key table, p50 / p99", "`kvcached bench ipc`",
             f"{r['ipc']['key_table']['lookup64']['p50_us']:.1f} / {r['ipc']['key_table']['lookup64']['p99_us']:.1f} µs",
             f"lookup op {ipc['lookup64']['daemon']['p50_us']:.1f} µs p50", "—", "≤ 10 / ≤ 50 µs")]
          if "key_table" in r["ipc"] else []),
        ("offload, 1,000 random 7B-layout blocks", "`kvcached bench transfer`", f"{tr['offload_gbps']} GB/s",
         f"memcpy {tr['memcpy_d2h_gbps']} GB/s", tr["offload_ratio"], "≥ 0.6"),
        ("layer-by-layer load", "`kvcached bench transfer`", f"{tr['load_gbps']} GB/s",
         f"memcpy {tr['memcpy_h2d_gbps']} GB/s", tr["load_ratio"], "≥ 0.6"),
        ("layer signal p50 / p99", "`kvcached bench transfer`",
         f"{tr['layer_signal']['p50_us']:.1f} / {tr['layer_signal']['p99_us']:.1f} µs", "—", "—", "p50 ≤ 50 µs"),
    ]
    target = r["storage"].get("target", {})
    for x in st:
        mooncake = x["tier"] == "mooncake"
        # host_layout: in the results since 2026-11-27 (an older file says it in its note only)
        host_layout = x.get("host_layout") or ("page_first" if "page_first" in x.get("note", "")
                                               else "layer_first")
        layout = {"page_first": " (page_first)", "layer_first": " (layer_first, staged)"}[host_layout] \
            if mooncake else ""
        rows.append((f"{x['tier']} tier put / get{layout}", "`kvcached bench storage`",
                     f"{x['put_gbps']:.2f} / {x['get_gbps']:.2f} GB/s",
                     f"raw {x['raw_put_gbps']:.2f} / {x['raw_get_gbps']:.2f} GB/s",
                     f"{x['put_ratio']:.2f} / {x['get_ratio']:.2f}",
                     f"≥ {target.get('mooncake_ratio_min' if mooncake else 'ratio_min', 0.7)}"))
    rows.append(("disk index rebuild", "`kvcached bench disk-index`",
                 f"{idx['files']:,} files in {idx['rebuild_s']} s", "—",
                 f"~{idx['projected_1m_s']} s per 1 M", "< 60 s per 1 M"))
    rep = r.get("replay", {})
    for x in rep.get("results", []):
        rows.append((f"replay hit rate, {x['policy']} @ {x['capacity_tokens']:,} tokens",
                     "`kvcached replay`", f"{100 * x['hit_rate']:.2f} %", "—", "—", "—"))
    if "through_daemon_ops_per_s" in rep:
        rows.append(("replay through the daemon", "`kvcached replay --through-daemon`",
                     f"{rep['through_daemon_ops_per_s']:,} block ops/s", "—", "—", "≥ 20,000"))
    head = (f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}, "
            f"Python {m['python']}, torch {m['torch']}, GPU {m['gpu'] or 'none'}; {r['date']}.\n\n")
    lines = ["| what | command | result | baseline (same run) | ratio | target |",
             "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return head + "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table(json.load(f)))
