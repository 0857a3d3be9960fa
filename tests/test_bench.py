"""The benchmarks run end to end and report what they measured (no timing assertions here:
speed is judged from their ratios, recorded in docs/performance.md)."""
import json
import re
import subprocess
import sys

import pytest
import torch


def _bench(*args):
    out = subprocess.run([sys.executable, "-m", "kvcached", "bench", *args, "--quick", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_bench_ipc_reports_both_sides():
    r = _bench("ipc")
    for name in ("ping", "lookup64", "load64"):
        x = r["results"][name]
        assert x["daemon"]["p50_us"] > 0 and x["bare_echo"]["p50_us"] > 0 and x["p50_ratio"] > 0
    step = r["step_loads"]  # (every load of both kinds came back whole, or the bench raised)
    assert step["one_by_one"]["p50_us"] > 0 and step["batch"]["p50_us"] > 0 and step["p50_ratio"] > 0
    assert step["batch_layer0"]["p50_us"] >= step["batch"]["p50_us"] and step["layer0_p50_ratio"] > 0


@pytest.mark.slow
def test_bench_transfer_moves_the_bytes_it_reports():
    r = _bench("transfer")
    assert r["bytes_exact"] is True
    assert r["offload_gbps"] > 0 and r["load_gbps"] > 0 and r["memcpy_d2h_gbps"] > 0
    assert r["layer_signal"]["n"] > 0
    assert r["copy_strategy"] == "native"  # what auto picks on CPU where the extension is built


@pytest.mark.slow
def test_bench_transfer_runs_a_named_copy_strategy():
    r = _bench("transfer", "--copy-strategy", "gather")
    assert r["copy_strategy"] == "gather" and r["bytes_exact"] is True


def test_the_cuda_bench_table_prints_a_recorded_run_and_the_daemon_phases():
    from pathlib import Path

    from kvcached.bench.transfer_cuda import _phases_ms, format_result
    r = json.loads((Path(__file__).parent / "data" / "bench_transfer_cuda_h100.json").read_text())
    table = format_result(r)  # a result written before the phases were reported
    assert re.search(r"cross_layer +dma +53\.6 +0\.97 +53\.4 +0\.97 True", table)
    assert "ratio 1.178" in table and "in the daemon" not in table and "its reply" not in table
    r["daemons"][1]["phases_ms"] = _phases_ms(
        {"load": {"tasks": 4, "wait_s": 0.002, "queue_s": 0.2, "land_s": 0.04},
         "offload": {"tasks": 0, "wait_s": 0.0, "queue_s": 0.0, "land_s": 0.0}})
    lines = format_result(r).splitlines()
    phase = [line for line in lines if "in the daemon" in line]
    assert phase == ["  load in the daemon: worker took it after 0.5 ms, queued the copies in 50.0 ms, "
                     "they landed 10.0 ms later (mean per task)"]
    assert lines.index(phase[0]) == next(i for i, line in enumerate(lines) if "daemon (dma)" in line) + 1
    r["daemons"][1]["phases_ms"] = _phases_ms(
        {"load": {"tasks": 4, "wait_s": 0.002, "queue_s": 0.2, "prepare_s": 0.004, "land_s": 0.04,
                  "first_layer_s": 0.008}})
    r["daemons"][1]["overlap"].update(request_ms=1.4, layer0_wait_ms=1.3, layer0_wake_ms=0.05)
    table = format_result(r)
    assert ("load in the daemon: worker took it after 0.5 ms, queued the copies in 50.0 ms (1.0 ms "
            "of it before the first copy), they landed 10.0 ms later (mean per task); its first "
            "layer counted 2.0 ms after the request") in table
    assert ("(its reply after 1.4 ms); in wait_layer(0) 1.3 ms, 0.05 ms of it from the daemon's "
            "count to this process seeing it") in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="scripts/gpu_check.sh runs it on a GPU")
def test_bench_transfer_on_cuda_says_when_there_is_no_gpu():
    out = subprocess.run([sys.executable, "-m", "kvcached", "bench", "transfer", "--device", "cuda:0",
                          "--quick"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no CUDA device" in out.stderr


@pytest.mark.slow
def test_bench_storage_covers_disk_and_redis_when_installed():
    import shutil

    r = _bench("storage")
    tiers = {x["tier"] for x in r["results"]}
    assert "disk" in tiers and (("redis" in tiers) == bool(shutil.which("redis-server")))
    assert all(x["put_ratio"] > 0 and x["get_ratio"] > 0 for x in r["results"])
    assert {x["host_layout"] for x in r["results"] if x["tier"] != "mooncake"} == {"layer_first"}


@pytest.mark.slow
def test_bench_faults_injects_every_fault_and_loses_nothing():
    r = _bench("faults")
    assert r["lost"] == 0 and r["wrong"] == 0, r
    assert r["faults_injected"] >= 16 and r["inputs_tried"] >= 2000 and r["index_check"] == "ok"
    assert r["bytes_verified"] > 0 and r["tasks_completed"] > 0
    assert r["held_while_stopped"] == 64 and r["disk_loaded_before_damage"] == 30  # the FIFO
    assert r["corrupt_records_seen"] >= 1 and r["dead_daemon_seen_ms"] < 1000
    assert r["hostile_attempts_refused"] == 8 and r["truncated_segment_load"] == 0
    assert r["racing_loads_fetched"] == 32  # two loads of 32 blocks, one fetch
    assert r["other_geometry_hits"] == 0 and r["faults_injected"] >= 20
    assert r["conn_flood_refused"] >= r["conn_flood_connections_tried"] - 2 * 64
    assert r["flood_junk_frames_sent"] > 0 and r["flood_layout_frames_sent"] > 0
    assert r["metrics_flood_scrapes_answered"] > 0  # scrapes get through a held-connection flood
    assert r["metrics_flood_threads_during"] <= r["metrics_flood_threads_before"] + 1
    assert r["flood_unread_unread_closed"] >= 1  # status requests whose replies nobody reads
    assert r["delete_flood_engine_deletes"] > 0 and r["delete_flood_flood_deletes_busy"] > 0


def test_a_bench_helper_that_never_answers_is_killed_and_named():
    """The benches wait for their helper processes' lines with a bound: a silent helper is killed
    and named, a wrong first line is reported with what it said; a helper that answers is read."""
    from kvcached.bench import expect_line, read_line

    def helper(code):
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    silent = helper("import time; time.sleep(60)")
    with pytest.raises(RuntimeError, match="the silent helper said nothing within 0.5 s"):
        expect_line(silent, "ready", "the silent helper", timeout_s=0.5)
    assert silent.wait(10) != 0  # killed, not left behind
    wrong = helper("print('busy', flush=True)")
    with pytest.raises(RuntimeError, match="it said 'busy', not 'ready'"):
        expect_line(wrong, "ready", "the wrong helper")
    wrong.wait(10)
    good = helper("print('ready', flush=True); print('3 4', flush=True)")
    expect_line(good, "ready", "the good helper")
    assert read_line(good, "the good helper") == "3 4"
    good.wait(10)
    good.stdout.close(), wrong.stdout.close(), silent.stdout.close()
